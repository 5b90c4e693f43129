//! Streaming parser of model output into text, reasoning and tool calls.
//!
//! Chat templates differ in how a model marks its reasoning and its tool
//! calls; [`OutputFormat`] names the markers and [`OutputParser`] splits the
//! generated text into [`ParsedChunk`]s as it streams in. Tags may arrive split
//! over several tokens, so text that could be the start of a tag is held back
//! until the next pieces decide it (the same technique as stop strings). Tool
//! call bodies are buffered until they are complete, because a half-parsed
//! call is of no use to a client.
//!
//! Nothing the model wrote is silently dropped apart from the markup itself: a
//! tool-call block that does not parse comes back as
//! [`ParsedChunk::InvalidToolCall`] with its raw text.

use serde_json::Value;

/// Llama 3.x's marker before a tool call (and before code for built-in tools).
pub const PYTHON_TAG: &str = "<|python_tag|>";
/// Mistral's marker before its JSON array of tool calls.
pub const MISTRAL_TOOL_CALLS_TAG: &str = "[TOOL_CALLS]";

/// Below this size a buffered JSON candidate is re-checked on every push, so
/// that non-JSON (e.g. Python after `<|python_tag|>`) is released promptly;
/// above it, only when a closing bracket arrives, which keeps long bodies from
/// being re-parsed on every token.
const ALWAYS_RECHECK_BELOW: usize = 256;

/// One piece of parsed output. Adjacent `Text` (or `Reasoning`) pieces from
/// one call are merged.
#[derive(Clone, Debug, PartialEq)]
pub enum ParsedChunk {
    /// Ordinary answer text.
    Text(String),
    /// The model's reasoning (inside think tags).
    Reasoning(String),
    ToolCall(ParsedToolCall),
    /// A tool-call block whose body is not valid JSON (or not a call): passed
    /// through as text so nothing is lost, with the reason. `raw` is the block
    /// as the model wrote it, markers included.
    InvalidToolCall {
        raw: String,
        reason: String,
    },
}

/// A tool call with its arguments normalised to a JSON object where possible.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ParsedToolCall {
    pub name: String,
    pub arguments: Value,
}

/// How a model writes tool calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolCallSyntax {
    None,
    /// Hermes / Qwen2.5 / Qwen3 / SmolLM2:
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
    TaggedJson {
        open: String,
        close: String,
    },
    /// Llama 3.x: the whole message is one JSON object
    /// `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`.
    BareJson,
    /// Mistral: `[TOOL_CALLS]` followed by a JSON array of
    /// `{"name", "arguments"}`.
    MistralToolCalls,
}

/// The markers of one chat template's output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputFormat {
    /// Opening and closing reasoning tags, e.g. `("<think>", "</think>")`.
    pub think: Option<(String, String)>,
    /// Some templates (Qwen3 thinking, DeepSeek-R1) open the think block in the
    /// prompt, so the output starts inside it. Ignored without `think`.
    pub starts_in_reasoning: bool,
    pub tool_call: ToolCallSyntax,
}

impl OutputFormat {
    /// Everything is text.
    pub fn plain() -> Self {
        Self {
            think: None,
            starts_in_reasoning: false,
            tool_call: ToolCallSyntax::None,
        }
    }

    /// `<think>` reasoning and `<tool_call>` JSON (Hermes, Qwen, SmolLM2).
    pub fn hermes() -> Self {
        Self {
            think: Some(("<think>".to_owned(), "</think>".to_owned())),
            starts_in_reasoning: false,
            tool_call: ToolCallSyntax::TaggedJson {
                open: "<tool_call>".to_owned(),
                close: "</tool_call>".to_owned(),
            },
        }
    }

    pub fn llama3() -> Self {
        Self {
            tool_call: ToolCallSyntax::BareJson,
            ..Self::plain()
        }
    }

    pub fn mistral() -> Self {
        Self {
            tool_call: ToolCallSyntax::MistralToolCalls,
            ..Self::plain()
        }
    }
}

/// What the parser is in the middle of.
/// Whether the parser can go on with what it has, or waits for more text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flow {
    Go,
    Wait,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Content,
    Reasoning,
    /// After a `TaggedJson` open tag, waiting for the close tag.
    TaggedToolCall,
    /// A `BareJson` message that may be a tool call: buffered.
    BareJsonCandidate,
    /// After `[TOOL_CALLS]`, waiting for the JSON value to complete.
    MistralToolCalls,
}

/// What a tag found in content starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ContentTag {
    Think,
    ToolCall,
}

/// Result of looking for tags in buffered text.
enum TagScan {
    Found {
        start: usize,
        end: usize,
        tag: usize,
    },
    /// No complete tag; `safe_len` bytes cannot be part of one.
    NotFound { safe_len: usize },
}

/// Where a `BareJson` message stands before its first significant character.
enum MessageStart {
    Undecided,
    JsonCandidate,
    NotJson,
}

/// Splits streamed model output into [`ParsedChunk`]s.
#[derive(Clone, Debug)]
pub struct OutputParser {
    format: OutputFormat,
    /// Tags recognised in content, with what each starts.
    content_tags: Vec<(String, ContentTag)>,
    mode: Mode,
    /// Received text not yet emitted (held-back tag prefixes, buffered calls).
    pending: String,
    /// `BareJson` only: no significant content seen yet in this message (or
    /// since the think block closed), so it may still be a tool call.
    at_message_start: bool,
}

impl OutputParser {
    /// A parser for `format`. Empty tags would match everywhere, so a think
    /// pair or tagged tool-call syntax with an empty tag is treated as absent.
    pub fn new(mut format: OutputFormat) -> Self {
        if matches!(&format.think, Some((open, close)) if open.is_empty() || close.is_empty()) {
            format.think = None;
        }
        let empty_tool_tag = matches!(&format.tool_call,
            ToolCallSyntax::TaggedJson { open, close } if open.is_empty() || close.is_empty());
        if empty_tool_tag {
            format.tool_call = ToolCallSyntax::None;
        }
        let mut content_tags = Vec::new();
        if let Some((open, _)) = &format.think {
            content_tags.push((open.clone(), ContentTag::Think));
        }
        match &format.tool_call {
            ToolCallSyntax::TaggedJson { open, .. } => {
                content_tags.push((open.clone(), ContentTag::ToolCall));
            }
            ToolCallSyntax::MistralToolCalls => {
                content_tags.push((MISTRAL_TOOL_CALLS_TAG.to_owned(), ContentTag::ToolCall));
            }
            ToolCallSyntax::None | ToolCallSyntax::BareJson => {}
        }
        let mut parser = Self {
            format,
            content_tags,
            mode: Mode::Content,
            pending: String::new(),
            at_message_start: true,
        };
        parser.reset();
        parser
    }

    /// Feeds the next piece of output; returns what is now known.
    pub fn push(&mut self, text: &str) -> Vec<ParsedChunk> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        self.process(false, text.contains(['}', ']']), &mut out);
        out
    }

    /// End of output: releases everything held back. An unterminated think
    /// block's content is `Reasoning`; an unterminated tool call is
    /// `InvalidToolCall`. The parser is then ready for a new message.
    pub fn finish(&mut self) -> Vec<ParsedChunk> {
        let mut out = Vec::new();
        self.process(true, true, &mut out);
        let rest = std::mem::take(&mut self.pending);
        match self.mode {
            Mode::Reasoning => push_merged(&mut out, ParsedChunk::Reasoning(rest)),
            Mode::TaggedToolCall => {
                let (open, close) = match &self.format.tool_call {
                    ToolCallSyntax::TaggedJson { open, close } => (open.as_str(), close.as_str()),
                    _ => ("", ""),
                };
                out.push(ParsedChunk::InvalidToolCall {
                    raw: format!("{open}{rest}"),
                    reason: format!("unterminated tool call: no closing {close}"),
                });
            }
            // Candidates and Mistral calls are decided by `process` when
            // finishing; whatever is left is text.
            Mode::Content | Mode::BareJsonCandidate | Mode::MistralToolCalls => {
                push_merged(&mut out, ParsedChunk::Text(rest));
            }
        }
        self.reset();
        out
    }

    fn reset(&mut self) {
        self.pending.clear();
        self.at_message_start = true;
        self.mode = if self.format.starts_in_reasoning && self.format.think.is_some() {
            Mode::Reasoning
        } else {
            Mode::Content
        };
    }

    /// Consumes as much of `pending` as can be decided. `bracket_arrived`:
    /// whether the latest text could have completed a JSON value.
    fn process(&mut self, finishing: bool, bracket_arrived: bool, out: &mut Vec<ParsedChunk>) {
        loop {
            let flow = match self.mode {
                Mode::Content => self.content(out),
                Mode::Reasoning => self.reasoning(out),
                Mode::TaggedToolCall => self.tagged_tool_call(out),
                Mode::BareJsonCandidate => {
                    self.bare_json_candidate(finishing, bracket_arrived, out)
                }
                Mode::MistralToolCalls => self.mistral_tool_calls(finishing, bracket_arrived, out),
            };
            if flow == Flow::Wait {
                return;
            }
        }
    }

    /// Plain text, until a tag (thinking or a tool call) or, at a message's start, what may be a bare JSON tool call.
    fn content(&mut self, out: &mut Vec<ParsedChunk>) -> Flow {
        if self.at_message_start && self.format.tool_call == ToolCallSyntax::BareJson {
            match self.bare_json_message_start() {
                MessageStart::Undecided => return Flow::Wait,
                MessageStart::JsonCandidate => {
                    self.mode = Mode::BareJsonCandidate;
                    return Flow::Go;
                }
                MessageStart::NotJson => self.at_message_start = false,
            }
        }
        let tags = self.content_tags.iter().map(|(tag, _)| tag.as_str());
        match scan_tags(&self.pending, tags) {
            TagScan::Found { start, end, tag } => {
                self.emit_pending(start, end, ParsedChunk::Text, out);
                self.mode = match self.content_tags.get(tag).map(|(_, kind)| kind) {
                    Some(ContentTag::Think) => Mode::Reasoning,
                    _ if self.format.tool_call == ToolCallSyntax::MistralToolCalls => {
                        Mode::MistralToolCalls
                    }
                    _ => Mode::TaggedToolCall,
                };
            }
            TagScan::NotFound { safe_len } => {
                self.emit_pending(safe_len, safe_len, ParsedChunk::Text, out);
                return Flow::Wait;
            }
        }
        Flow::Go
    }

    /// Reasoning, until its closing tag (a stray opening tag is dropped).
    fn reasoning(&mut self, out: &mut Vec<ParsedChunk>) -> Flow {
        let Some((open, close)) = &self.format.think else {
            self.mode = Mode::Content;
            return Flow::Go;
        };
        // A stray opening tag inside reasoning (a model that writes
        // `<think>` although the prompt opened it) is dropped.
        match scan_tags(&self.pending, [close.as_str(), open.as_str()].into_iter()) {
            TagScan::Found { start, end, tag } => {
                self.emit_pending(start, end, ParsedChunk::Reasoning, out);
                if tag == 0 {
                    self.mode = Mode::Content;
                    self.at_message_start = true;
                }
            }
            TagScan::NotFound { safe_len } => {
                self.emit_pending(safe_len, safe_len, ParsedChunk::Reasoning, out);
                return Flow::Wait;
            }
        }
        Flow::Go
    }

    /// A tool call between tags, once its closing tag is here.
    fn tagged_tool_call(&mut self, out: &mut Vec<ParsedChunk>) -> Flow {
        let ToolCallSyntax::TaggedJson { open, close } = &self.format.tool_call else {
            self.mode = Mode::Content;
            return Flow::Go;
        };
        let Some(start) = self.pending.find(close.as_str()) else {
            return Flow::Wait;
        };
        let body = &self.pending[..start];
        let raw = format!("{open}{body}{close}");
        if body.trim_start().starts_with(XML_FUNCTION_OPEN) {
            out.push(match xml_function_call(body) {
                Ok(call) => ParsedChunk::ToolCall(call),
                Err(reason) => ParsedChunk::InvalidToolCall { raw, reason },
            });
        } else {
            match serde_json::from_str::<Value>(body.trim()) {
                Ok(value) => tool_calls_from_value(&value, &raw, out),
                Err(error) => out.push(ParsedChunk::InvalidToolCall {
                    raw,
                    reason: format!("tool call is not valid JSON: {error}"),
                }),
            }
        }
        self.pending.replace_range(..start + close.len(), "");
        self.mode = Mode::Content;
        Flow::Go
    }

    /// A message that may be a bare JSON tool call, once that is decided.
    fn bare_json_candidate(
        &mut self,
        finishing: bool,
        bracket_arrived: bool,
        out: &mut Vec<ParsedChunk>,
    ) -> Flow {
        let recheck = bracket_arrived || self.pending.len() < ALWAYS_RECHECK_BELOW;
        if !(finishing || recheck) {
            return Flow::Wait;
        }
        match bare_json_verdict(&self.pending, finishing) {
            None => return Flow::Wait,
            Some(Some(call)) => {
                out.push(ParsedChunk::ToolCall(call));
                self.pending.clear();
            }
            Some(None) => {
                let text = std::mem::take(&mut self.pending);
                push_merged(out, ParsedChunk::Text(text));
            }
        }
        self.mode = Mode::Content;
        self.at_message_start = false;
        Flow::Go
    }

    /// Mistral's `[TOOL_CALLS]` JSON, once a value completes (or at the end).
    fn mistral_tool_calls(
        &mut self,
        finishing: bool,
        bracket_arrived: bool,
        out: &mut Vec<ParsedChunk>,
    ) -> Flow {
        if !(finishing || bracket_arrived) {
            return Flow::Wait;
        }
        let body = self.pending.trim_start();
        let leading_whitespace = self.pending.len() - body.len();
        let mut values = serde_json::Deserializer::from_str(body).into_iter::<Value>();
        let parsed = values.next();
        let consumed = leading_whitespace + values.byte_offset();
        match parsed {
            Some(Ok(value)) => {
                let raw = format!("{MISTRAL_TOOL_CALLS_TAG}{}", &self.pending[..consumed]);
                tool_calls_from_value(&value, &raw, out);
                self.pending.replace_range(..consumed, "");
                self.mode = Mode::Content;
            }
            // Incomplete or malformed: it may still be completed
            // (or never be); decide at the end.
            _ if !finishing => return Flow::Wait,
            outcome => {
                let reason = match outcome {
                    Some(Err(error)) if !error.is_eof() => {
                        format!("tool calls are not valid JSON: {error}")
                    }
                    _ => "unterminated tool calls: the JSON never completed".to_owned(),
                };
                let raw = format!("{MISTRAL_TOOL_CALLS_TAG}{}", self.pending);
                out.push(ParsedChunk::InvalidToolCall { raw, reason });
                self.pending.clear();
                self.mode = Mode::Content;
            }
        }
        Flow::Go
    }

    /// Emits `pending[..emit_len]` through `wrap` and drops `pending[..drop_len]`
    /// (the difference being a consumed tag).
    fn emit_pending(
        &mut self,
        emit_len: usize,
        drop_len: usize,
        wrap: fn(String) -> ParsedChunk,
        out: &mut Vec<ParsedChunk>,
    ) {
        if emit_len > 0 {
            push_merged(out, wrap(self.pending[..emit_len].to_owned()));
        }
        self.pending.replace_range(..drop_len, "");
    }

    /// Whether a `BareJson` message (after leading whitespace) starts like a
    /// tool call: with `{` or `<|python_tag|>`. Undecided while only whitespace
    /// or a prefix of a tag has arrived.
    fn bare_json_message_start(&self) -> MessageStart {
        let significant = self.pending.trim_start();
        if significant.starts_with('{') || significant.starts_with(PYTHON_TAG) {
            return MessageStart::JsonCandidate;
        }
        let think_open = self
            .format
            .think
            .as_ref()
            .map_or("", |(open, _)| open.as_str());
        if !think_open.is_empty() && significant.starts_with(think_open) {
            // Reasoning first; the message proper starts after it.
            return MessageStart::NotJson;
        }
        let may_become_tag = |tag: &str| !tag.is_empty() && tag.starts_with(significant);
        if may_become_tag(PYTHON_TAG) || may_become_tag(think_open) {
            MessageStart::Undecided
        } else {
            MessageStart::NotJson
        }
    }
}

/// Decides a buffered `BareJson` message: `None` = not yet known,
/// `Some(Some(call))` = a tool call, `Some(None)` = plain text. A message is a
/// call only if it is exactly one JSON object with a string "name" (after the
/// optional `<|python_tag|>`), so it is decided as a call only when finishing.
fn bare_json_verdict(message: &str, finishing: bool) -> Option<Option<ParsedToolCall>> {
    let significant = message.trim_start();
    let body = significant.strip_prefix(PYTHON_TAG).unwrap_or(significant);
    let mut values = serde_json::Deserializer::from_str(body).into_iter::<Value>();
    match values.next() {
        Some(Ok(value)) => {
            let trailing_text = !body[values.byte_offset()..].trim().is_empty();
            let call = tool_call_from_value(&value).ok();
            if trailing_text || call.is_none() {
                Some(None)
            } else if finishing {
                Some(call)
            } else {
                None
            }
        }
        Some(Err(error)) if !error.is_eof() => Some(None),
        _ if finishing => Some(None),
        _ => None,
    }
}

/// Emits the call(s) in a parsed tool-call body: one object, or an array of
/// them (each element judged on its own).
fn tool_calls_from_value(value: &Value, raw: &str, out: &mut Vec<ParsedChunk>) {
    match value {
        Value::Array(items) if !items.is_empty() => {
            for item in items {
                out.push(match tool_call_from_value(item) {
                    Ok(call) => ParsedChunk::ToolCall(call),
                    Err(reason) => ParsedChunk::InvalidToolCall {
                        raw: item.to_string(),
                        reason,
                    },
                });
            }
        }
        _ => out.push(match tool_call_from_value(value) {
            Ok(call) => ParsedChunk::ToolCall(call),
            Err(reason) => ParsedChunk::InvalidToolCall {
                raw: raw.to_owned(),
                reason,
            },
        }),
    }
}

const XML_FUNCTION_OPEN: &str = "<function=";

/// Qwen3-Coder's and Qwen3.5's call inside `<tool_call>`: `<function=NAME>`,
/// any number of `<parameter=KEY>VALUE</parameter>`, `</function>`. A value
/// that reads as JSON other than a string (a number, `true`, an object) is
/// that value, any other is the text itself; one newline either side of it
/// is the template's layout, not the value's.
fn xml_function_call(body: &str) -> Result<ParsedToolCall, String> {
    let rest = body.trim_start();
    let rest = rest
        .strip_prefix(XML_FUNCTION_OPEN)
        .ok_or("expected <function=NAME>")?;
    let (name, mut rest) = rest.split_once('>').ok_or("unterminated <function=NAME>")?;
    let name = name.trim();
    if name.is_empty() {
        return Err("tool call has an empty function name".to_owned());
    }
    let mut arguments = serde_json::Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        if let Some(after) = rest.strip_prefix("</function>") {
            if !after.trim().is_empty() {
                return Err(format!("text after </function>: {:?}", after.trim()));
            }
            break;
        }
        let parameter = rest
            .strip_prefix("<parameter=")
            .ok_or_else(|| format!("expected <parameter=KEY> or </function>, found {rest:?}"))?;
        let (key, after) = parameter
            .split_once('>')
            .ok_or("unterminated <parameter=KEY>")?;
        let (value, after) = after
            .split_once("</parameter>")
            .ok_or_else(|| format!("parameter {key:?} has no </parameter>"))?;
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let parsed = serde_json::from_str::<Value>(value)
            .ok()
            .filter(|v| !v.is_string())
            .unwrap_or_else(|| Value::String(value.to_owned()));
        arguments.insert(key.trim().to_owned(), parsed);
        rest = after;
    }
    Ok(ParsedToolCall {
        name: name.to_owned(),
        arguments: Value::Object(arguments),
    })
}

/// Reads `{"name": ..., "arguments"|"parameters": ...}`. Missing arguments
/// become `{}`; arguments given as a string holding a JSON object become that
/// object (some models double-encode them); any other string stays a string.
fn tool_call_from_value(value: &Value) -> Result<ParsedToolCall, String> {
    let Value::Object(object) = value else {
        return Err(format!(
            "expected a JSON object for a tool call, found {value}"
        ));
    };
    let name = match object.get("name") {
        Some(Value::String(name)) if !name.is_empty() => name.clone(),
        _ => return Err("tool call has no string \"name\"".to_owned()),
    };
    let arguments = match object.get("arguments").or_else(|| object.get("parameters")) {
        None | Some(Value::Null) => Value::Object(serde_json::Map::new()),
        Some(Value::String(encoded)) => match serde_json::from_str::<Value>(encoded) {
            Ok(decoded @ Value::Object(_)) => decoded,
            _ => Value::String(encoded.clone()),
        },
        Some(other) => other.clone(),
    };
    Ok(ParsedToolCall { name, arguments })
}

/// Appends `chunk`, merging it into the previous one if both are `Text` or
/// both `Reasoning`; empty text is dropped.
fn push_merged(out: &mut Vec<ParsedChunk>, chunk: ParsedChunk) {
    match (out.last_mut(), chunk) {
        (_, ParsedChunk::Text(text) | ParsedChunk::Reasoning(text)) if text.is_empty() => {}
        (Some(ParsedChunk::Text(previous)), ParsedChunk::Text(text))
        | (Some(ParsedChunk::Reasoning(previous)), ParsedChunk::Reasoning(text)) => {
            previous.push_str(&text);
        }
        (_, chunk) => out.push(chunk),
    }
}

/// Finds the earliest complete tag (ties: the first listed) in `text` or, if
/// none, how much of `text` is safe: everything before the longest suffix that
/// is a proper prefix of a tag. Suffixes start on char boundaries only.
fn scan_tags<'t>(text: &str, tags: impl Iterator<Item = &'t str> + Clone) -> TagScan {
    let mut found: Option<TagScan> = None;
    for (index, tag) in tags.clone().enumerate() {
        let Some(start) = text.find(tag) else {
            continue;
        };
        if !matches!(found, Some(TagScan::Found { start: best, .. }) if best <= start) {
            let end = start + tag.len();
            found = Some(TagScan::Found {
                start,
                end,
                tag: index,
            });
        }
    }
    if let Some(found) = found {
        return found;
    }
    let longest_tag = tags.clone().map(str::len).max().unwrap_or(0);
    let earliest = text.len().saturating_sub(longest_tag.saturating_sub(1));
    let safe_len = (earliest..text.len())
        .filter(|&offset| text.is_char_boundary(offset))
        .find(|&offset| tags.clone().any(|tag| tag.starts_with(&text[offset..])))
        .unwrap_or(text.len());
    TagScan::NotFound { safe_len }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn text(s: &str) -> ParsedChunk {
        ParsedChunk::Text(s.to_owned())
    }

    fn reasoning(s: &str) -> ParsedChunk {
        ParsedChunk::Reasoning(s.to_owned())
    }

    fn call(name: &str, arguments: Value) -> ParsedChunk {
        ParsedChunk::ToolCall(ParsedToolCall {
            name: name.to_owned(),
            arguments,
        })
    }

    /// Feeds `pieces`, then finishes; adjacent text pieces from different
    /// calls are merged so results compare independently of chunking.
    fn parse(format: OutputFormat, pieces: &[&str]) -> Vec<ParsedChunk> {
        let mut parser = OutputParser::new(format);
        let mut all = Vec::new();
        for piece in pieces {
            for chunk in parser.push(piece) {
                push_merged(&mut all, chunk);
            }
        }
        for chunk in parser.finish() {
            push_merged(&mut all, chunk);
        }
        all
    }

    /// Parses `input` whole, char by char and in 3-char pieces, checks the
    /// three agree and returns the result.
    fn parse_all_ways(format: OutputFormat, input: &str) -> Vec<ParsedChunk> {
        let whole = parse(format.clone(), &[input]);
        let chars: Vec<String> = input.chars().map(String::from).collect();
        let by_char: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(
            parse(format.clone(), &by_char),
            whole,
            "char by char: {input:?}"
        );
        let triples: Vec<String> = chars.chunks(3).map(|c| c.concat()).collect();
        let by_triple: Vec<&str> = triples.iter().map(String::as_str).collect();
        assert_eq!(parse(format, &by_triple), whole, "in threes: {input:?}");
        whole
    }

    #[test]
    fn plain_passes_everything_through() {
        let input = "a <think>b</think> <tool_call>{}</tool_call> [TOOL_CALLS] {\"name\":\"x\"}";
        assert_eq!(
            parse_all_ways(OutputFormat::plain(), input),
            vec![text(input)]
        );
        assert_eq!(parse(OutputFormat::plain(), &[]), vec![]);
    }

    #[test]
    fn think_block_split_across_pushes() {
        let mut parser = OutputParser::new(OutputFormat::hermes());
        assert_eq!(parser.push("<thi"), vec![]);
        assert_eq!(parser.push("nk>I am "), vec![reasoning("I am ")]);
        assert_eq!(parser.push("thinking</th"), vec![reasoning("thinking")]);
        assert_eq!(parser.push("ink>\n\nAnswer <"), vec![text("\n\nAnswer ")]);
        assert_eq!(parser.push("b>"), vec![text("<b>")]);
        assert_eq!(parser.finish(), vec![]);

        let input = "<think>思考 😀 a<b</think>答え";
        assert_eq!(
            parse_all_ways(OutputFormat::hermes(), input),
            vec![reasoning("思考 😀 a<b"), text("答え")]
        );
    }

    #[test]
    fn output_that_starts_in_reasoning() {
        let format = OutputFormat {
            starts_in_reasoning: true,
            ..OutputFormat::hermes()
        };
        let input = "step one</think>The answer.";
        assert_eq!(
            parse_all_ways(format.clone(), input),
            vec![reasoning("step one"), text("The answer.")]
        );
        // A model that opens the block again anyway: the stray tag is dropped.
        assert_eq!(
            parse_all_ways(format.clone(), "<think>\nhmm</think>ok"),
            vec![reasoning("\nhmm"), text("ok")]
        );
        // The parser is reusable: the next message starts in reasoning again.
        let mut parser = OutputParser::new(format);
        parser.push("a</think>b");
        parser.finish();
        assert_eq!(parser.push("c"), vec![reasoning("c")]);
    }

    #[test]
    fn multiple_tool_calls_with_text_around_them() {
        let input = "Let me check.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\":\"time\",\"arguments\":{}}</tool_call>\nDone.";
        assert_eq!(
            parse_all_ways(OutputFormat::hermes(), input),
            vec![
                text("Let me check.\n"),
                call("weather", json!({"city": "Paris"})),
                text("\n"),
                call("time", json!({})),
                text("\nDone."),
            ]
        );
        let xml = "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
        assert_eq!(
            parse_all_ways(OutputFormat::hermes(), xml),
            [ParsedChunk::ToolCall(ParsedToolCall {
                name: "weather".into(),
                arguments: serde_json::json!({"city": "Paris", "days": 3}),
            })],
            "Qwen3.5's XML calls"
        );
        let broken = "<tool_call><function=f><parameter=x>1</function></tool_call>";
        assert!(matches!(
            &parse_all_ways(OutputFormat::hermes(), broken)[..],
            [ParsedChunk::InvalidToolCall { reason, .. }] if reason.contains("</parameter>")
        ));
        let think_then_call = "<think>need tool</think><tool_call>{\"name\":\"f\"}</tool_call>";
        assert_eq!(
            parse_all_ways(OutputFormat::hermes(), think_then_call),
            vec![reasoning("need tool"), call("f", json!({}))]
        );
    }

    #[test]
    fn invalid_tool_call_json_is_passed_through_with_reason() {
        let input = "a<tool_call>{\"name\": \"f\", \"arguments\": {</tool_call>b";
        let chunks = parse_all_ways(OutputFormat::hermes(), input);
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks[0], text("a"));
        let ParsedChunk::InvalidToolCall { raw, reason } = &chunks[1] else {
            panic!("{chunks:?}");
        };
        assert_eq!(
            raw,
            "<tool_call>{\"name\": \"f\", \"arguments\": {</tool_call>"
        );
        assert!(reason.contains("not valid JSON"), "{reason}");
        assert_eq!(chunks[2], text("b"));
        // Valid JSON that is not a call.
        let chunks = parse(OutputFormat::hermes(), &["<tool_call>[1]</tool_call>"]);
        assert!(matches!(&chunks[..], [ParsedChunk::InvalidToolCall { raw, .. }] if raw == "1"));
        let chunks = parse(
            OutputFormat::hermes(),
            &["<tool_call>{\"arguments\":{}}</tool_call>"],
        );
        assert!(
            matches!(&chunks[..], [ParsedChunk::InvalidToolCall { reason, .. }] if reason.contains("name"))
        );
    }

    #[test]
    fn arguments_are_normalised() {
        let cases = [
            (
                r#"{"name":"f","arguments":"{\"city\": \"Paris\"}"}"#,
                json!({"city": "Paris"}),
            ),
            (r#"{"name":"f","arguments":"not json"}"#, json!("not json")),
            (r#"{"name":"f","arguments":"[1]"}"#, json!("[1]")),
            (r#"{"name":"f","parameters":{"x":1}}"#, json!({"x": 1})),
            (r#"{"name":"f","arguments":null}"#, json!({})),
            (r#"{"name":"f"}"#, json!({})),
        ];
        for (body, arguments) in cases {
            let input = format!("<tool_call>{body}</tool_call>");
            assert_eq!(
                parse(OutputFormat::hermes(), &[&input]),
                vec![call("f", arguments)]
            );
        }
    }

    #[test]
    fn unterminated_blocks() {
        assert_eq!(
            parse_all_ways(OutputFormat::hermes(), "<think>still thinking</thi"),
            vec![reasoning("still thinking</thi")]
        );
        let chunks = parse_all_ways(OutputFormat::hermes(), "ok <tool_call>{\"name\": \"f\"}");
        assert_eq!(chunks[0], text("ok "));
        assert!(
            matches!(&chunks[1], ParsedChunk::InvalidToolCall { raw, reason }
            if raw == "<tool_call>{\"name\": \"f\"}" && reason.contains("unterminated"))
        );
        // A held-back tag prefix at the end is plain text.
        assert_eq!(
            parse(OutputFormat::hermes(), &["x <tool_"]),
            vec![text("x <tool_")]
        );
    }

    #[test]
    fn llama3_bare_json_tool_calls() {
        let input = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
        let expected = vec![call("get_weather", json!({"city": "Paris"}))];
        assert_eq!(parse_all_ways(OutputFormat::llama3(), input), expected);
        let tagged = format!("  \n{PYTHON_TAG}{input}\n");
        assert_eq!(parse_all_ways(OutputFormat::llama3(), &tagged), expected);

        // A call is only decided at the end: trailing text makes it text.
        let mut parser = OutputParser::new(OutputFormat::llama3());
        assert_eq!(parser.push(input), vec![]);
        assert_eq!(
            parser.push(" and more"),
            vec![text(&format!("{input} and more"))]
        );
        assert_eq!(parser.push(" text"), vec![text(" text")]);
        assert_eq!(parser.finish(), vec![]);
    }

    #[test]
    fn llama3_text_is_streamed_and_non_calls_released_early() {
        let mut parser = OutputParser::new(OutputFormat::llama3());
        assert_eq!(parser.push("  "), vec![]);
        assert_eq!(parser.push("Hello {"), vec![text("  Hello {")]);
        assert_eq!(parser.push("\"name\": 1}"), vec![text("\"name\": 1}")]);
        assert_eq!(parser.finish(), vec![]);

        // JSON that is not a call is released as soon as it is complete.
        let mut parser = OutputParser::new(OutputFormat::llama3());
        assert_eq!(parser.push("{\"answer\": "), vec![]);
        assert_eq!(parser.push("42}"), vec![text("{\"answer\": 42}")]);
        // Python for a built-in tool, and broken JSON, are text.
        let code = format!("{PYTHON_TAG}print(1 + 1)");
        assert_eq!(
            parse_all_ways(OutputFormat::llama3(), &code),
            vec![text(&code)]
        );
        let mut parser = OutputParser::new(OutputFormat::llama3());
        assert_eq!(parser.push("{not json"), vec![text("{not json")]);
        let unterminated = "{\"name\": \"f\", \"parameters\": {";
        assert_eq!(
            parse_all_ways(OutputFormat::llama3(), unterminated),
            vec![text(unterminated)]
        );
        assert_eq!(
            parse(OutputFormat::llama3(), &["<|py", "x"]),
            vec![text("<|pyx")]
        );
    }

    #[test]
    fn bare_json_after_a_think_block() {
        let format = OutputFormat {
            think: Some(("<think>".to_owned(), "</think>".to_owned())),
            ..OutputFormat::llama3()
        };
        let input = "<think>call it</think>\n{\"name\": \"f\", \"parameters\": {}}";
        assert_eq!(
            parse_all_ways(format.clone(), input),
            vec![reasoning("call it"), call("f", json!({}))]
        );
        assert_eq!(parse(format.clone(), &["<think>"]), vec![]);
        assert_eq!(
            parse_all_ways(format, "<think>a</think>Hi {}"),
            vec![reasoning("a"), text("Hi {}")]
        );
    }

    #[test]
    fn mistral_tool_calls() {
        let input = r#"Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": "{\"y\": 2}"}, {"arguments": {}}] after"#;
        let chunks = parse_all_ways(OutputFormat::mistral(), input);
        assert_eq!(chunks.len(), 5, "{chunks:?}");
        assert_eq!(chunks[0], text("Sure. "));
        assert_eq!(chunks[1], call("a", json!({"x": 1})));
        assert_eq!(chunks[2], call("b", json!({"y": 2})));
        assert!(
            matches!(&chunks[3], ParsedChunk::InvalidToolCall { raw, .. } if raw == r#"{"arguments":{}}"#)
        );
        assert_eq!(chunks[4], text(" after"));

        let single = r#"[TOOL_CALLS]{"name": "a", "arguments": {}}"#;
        assert_eq!(
            parse_all_ways(OutputFormat::mistral(), single),
            vec![call("a", json!({}))]
        );

        let unterminated = r#"[TOOL_CALLS] [{"name": "a", "#;
        let chunks = parse_all_ways(OutputFormat::mistral(), unterminated);
        assert!(
            matches!(&chunks[..], [ParsedChunk::InvalidToolCall { raw, reason }]
            if raw == unterminated && reason.contains("unterminated")),
            "{chunks:?}"
        );
        let malformed = "[TOOL_CALLS]get_weather[ARGS]{}";
        let chunks = parse_all_ways(OutputFormat::mistral(), malformed);
        assert!(
            matches!(&chunks[..], [ParsedChunk::InvalidToolCall { raw, reason }]
            if raw == malformed && reason.contains("not valid JSON")),
            "{chunks:?}"
        );
    }

    #[test]
    fn empty_tags_are_treated_as_absent() {
        let format = OutputFormat {
            think: Some((String::new(), "</think>".to_owned())),
            starts_in_reasoning: true,
            tool_call: ToolCallSyntax::TaggedJson {
                open: "<tool_call>".to_owned(),
                close: String::new(),
            },
        };
        assert_eq!(
            parse(format, &["a</think><tool_call>b"]),
            vec![text("a</think><tool_call>b")]
        );
    }
}
