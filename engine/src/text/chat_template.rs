//! Chat templates: a model's Jinja template rendered the way Hugging Face
//! transformers renders it, so prompts match the reference token for token.
//!
//! # Compatibility with transformers' `apply_chat_template`
//! - `trim_blocks` and `lstrip_blocks` on, trailing newline dropped, loop
//!   controls (`break`/`continue`) on.
//! - Python string and dict methods (`.strip()`, `.startswith()`, `.split()`,
//!   `.items()`, `.get()`, …) through minijinja-contrib's pycompat.
//! - Globals `raise_exception(msg)` (fails the render with
//!   [`TemplateError::Raised`] carrying `msg`) and `strftime_now(fmt)` (the
//!   current time, UTC here where transformers uses local time).
//! - `tojson` like transformers' (`json.dumps(x, ensure_ascii=False)`:
//!   `", "`/`": "` separators, keys in the order given, `'`, `<`, `>`
//!   unescaped; `indent`, `separators`, `sort_keys`, `ensure_ascii` kwargs).
//! - `{% generation %}…{% endgeneration %}` (transformers' assistant-mask
//!   tag) renders its body.
//! - The context holds `messages`, `tools` and `documents` (`none` when
//!   absent), `add_generation_prompt`, `bos_token`, `eos_token`, and every
//!   key of `extra` (e.g. `enable_thinking`), which win over the others.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use minijinja::value::{Kwargs, Serde, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

/// One chat message as the OpenAI API and chat templates know it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message with only a role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// Errors of compiling or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The template source does not compile.
    #[error("chat template does not compile: {0}")]
    Syntax(String),
    /// The template called `raise_exception(msg)`; carries `msg`.
    #[error("chat template raised an exception: {0}")]
    Raised(String),
    /// Rendering failed (undefined operation, bad filter argument, …).
    #[error("chat template failed to render: {0}")]
    Render(String),
    /// The arguments given to `render` cannot form a context.
    #[error("invalid chat template context: {0}")]
    Context(String),
}

/// A ChatML template, the fallback for models that ship no chat template
/// (it is not any particular model's own template).
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

/// The source error attached by `raise_exception`, found again when rendering fails.
#[derive(Debug)]
struct RaisedException(String);

impl std::fmt::Display for RaisedException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(RaisedException(msg)))
}

impl ChatTemplate {
    /// Compiles `source` once. `bos_token`/`eos_token` are the texts the
    /// template sees as `bos_token` and `eos_token`.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| TemplateError::Syntax(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(source))
            .map_err(|e| TemplateError::Syntax(error_text(&e)))?;
        Ok(Self {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Renders `messages`. `tools` is the list of tool schemas (or `None`),
    /// `add_generation_prompt` opens the assistant's turn, `extra` is a JSON
    /// object whose keys become template variables (e.g.
    /// `{"enable_thinking": false}`).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: Option<&serde_json::Value>,
    ) -> Result<String, TemplateError> {
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        ctx.insert("messages".into(), Value::from(Serde(messages)));
        ctx.insert(
            "tools".into(),
            tools.map_or(Value::from(()), |t| Value::from(Serde(t))),
        );
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        ctx.insert("bos_token".into(), Value::from(self.bos_token.as_str()));
        ctx.insert("eos_token".into(), Value::from(self.eos_token.as_str()));
        match extra {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::Object(map)) => {
                for (k, v) in map {
                    ctx.insert(k.clone(), Value::from(Serde(v)));
                }
            }
            Some(other) => {
                return Err(TemplateError::Context(format!(
                    "`extra` must be a JSON object, got {other}"
                )))
            }
        }
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TemplateError::Render(error_text(&e)))?;
        template
            .render(Value::from(ctx))
            .map_err(|e| match raised_message(&e) {
                Some(msg) => TemplateError::Raised(msg),
                None => TemplateError::Render(error_text(&e)),
            })
    }
}

/// The error's message with its location and causes.
fn error_text(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(cause) = src {
        let _ = write!(s, ": {cause}");
        src = cause.source();
    }
    s
}

fn raised_message(e: &Error) -> Option<String> {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = src {
        if let Some(r) = err.downcast_ref::<RaisedException>() {
            return Some(r.0.clone());
        }
        src = err.source();
    }
    None
}

/// `{% generation %}` → `{% if true %}` and `{% endgeneration %}` →
/// `{% endif %}`, keeping the whitespace-control marks, so the body renders
/// with the same whitespace as under transformers' AssistantTracker.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                let _ = write!(out, "{{%{lead} {r} {trail}%}}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

// ---------------------------------------------------------------------------
// tojson, as transformers defines it

struct JsonStyle {
    indent: Option<usize>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

fn tojson(value: &Value, positional: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let bad = |what: &str| Error::new(ErrorKind::InvalidOperation, what.to_string());
    let mut ensure_ascii = false;
    let mut indent_val: Option<Value> = None;
    if let Some(p) = positional {
        // Jinja's builtin takes `indent` first, transformers' takes `ensure_ascii`.
        if p.kind() == ValueKind::Bool {
            ensure_ascii = p.is_true();
        } else {
            indent_val = Some(p);
        }
    }
    if let Some(v) = kwargs.get::<Option<Value>>("indent")? {
        indent_val = Some(v);
    }
    if let Some(v) = kwargs.get::<Option<bool>>("ensure_ascii")? {
        ensure_ascii = v;
    }
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let separators = kwargs.get::<Option<Value>>("separators")?;
    kwargs.assert_all_used()?;

    let indent = match indent_val {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_usize() {
            Some(n) => Some(n),
            None => return Err(bad("tojson: indent must be a non-negative integer")),
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if !s.is_none() && !s.is_undefined() => {
            let parts: Vec<String> = s
                .try_iter()?
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| bad("tojson: separators must be two strings"))?;
            match <[String; 2]>::try_from(parts) {
                Ok([a, b]) => (a, b),
                Err(_) => return Err(bad("tojson: separators must be two strings")),
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys,
        ensure_ascii,
    };
    let mut out = String::new();
    write_json(value, &style, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn newline_indent(style: &JsonStyle, depth: usize, out: &mut String) {
    if let Some(n) = style.indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * depth));
    }
}

fn write_json(v: &Value, style: &JsonStyle, depth: usize, out: &mut String) -> Result<(), Error> {
    if depth > 256 {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                match v.as_i64() {
                    Some(i) => {
                        let _ = write!(out, "{i}");
                    }
                    None => out.push_str(&v.to_string()),
                }
            } else {
                let f = f64::try_from(v.clone())?;
                out.push_str(&python_float(f));
            }
        }
        ValueKind::String => write_json_str(v.as_str().unwrap_or_default(), style, out),
        ValueKind::Bytes => write_json_str(
            &String::from_utf8_lossy(v.as_bytes().unwrap_or_default()),
            style,
            out,
        ),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline_indent(style, depth + 1, out);
                write_json(item, style, depth + 1, out)?;
            }
            newline_indent(style, depth, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in v.try_iter()? {
                let item = v.get_item(&key)?;
                let key = match key.as_str() {
                    Some(s) => s.to_string(),
                    None => key.to_string(),
                };
                entries.push((key, item));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline_indent(style, depth + 1, out);
                write_json_str(key, style, out);
                out.push_str(&style.key_sep);
                write_json(item, style, depth + 1, out)?;
            }
            newline_indent(style, depth, out);
            out.push('}');
        }
        _ => write_json_str(&v.to_string(), style, out),
    }
    Ok(())
}

/// Python's `json.dumps` string escaping.
fn write_json_str(s: &str, style: &JsonStyle, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (style.ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)` as `json.dumps` writes it.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        let s = format!("{f:e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.abs());
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

// ---------------------------------------------------------------------------
// strftime_now

const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// A UTC civil time broken down from seconds since the Unix epoch.
struct CivilTime {
    year: i64,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    weekday: usize,
    yday: u32,
}

fn civil_time(unix_seconds: i64) -> CivilTime {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const CUM: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[month as usize - 1] + day + u32::from(leap && month > 2);
    CivilTime {
        year,
        month,
        day,
        hour: (secs / 3600) as u32,
        minute: (secs % 3600 / 60) as u32,
        second: (secs % 60) as u32,
        weekday: (days + 4).rem_euclid(7) as usize,
        yday,
    }
}

/// Python's `strftime` for the common directives; others are kept as written.
fn format_time(t: &CivilTime, fmt: &str) -> String {
    let mut out = String::with_capacity(fmt.len() + 16);
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let hour12 = match t.hour % 12 {
            0 => 12,
            h => h,
        };
        let _ = match d {
            'Y' => write!(out, "{}", t.year),
            'y' => write!(out, "{:02}", t.year.rem_euclid(100)),
            'm' => write!(out, "{:02}", t.month),
            'd' => write!(out, "{:02}", t.day),
            'e' => write!(out, "{:2}", t.day),
            '-' => match chars.next() {
                Some('d') => write!(out, "{}", t.day),
                Some('m') => write!(out, "{}", t.month),
                Some('H') => write!(out, "{}", t.hour),
                Some('I') => write!(out, "{hour12}"),
                Some(other) => write!(out, "%-{other}"),
                None => write!(out, "%-"),
            },
            'H' => write!(out, "{:02}", t.hour),
            'I' => write!(out, "{hour12:02}"),
            'M' => write!(out, "{:02}", t.minute),
            'S' => write!(out, "{:02}", t.second),
            'p' => write!(out, "{}", if t.hour < 12 { "AM" } else { "PM" }),
            'B' => write!(out, "{}", MONTHS[t.month as usize - 1]),
            'b' | 'h' => write!(out, "{}", &MONTHS[t.month as usize - 1][..3]),
            'A' => write!(out, "{}", WEEKDAYS[t.weekday]),
            'a' => write!(out, "{}", &WEEKDAYS[t.weekday][..3]),
            'w' => write!(out, "{}", t.weekday),
            'j' => write!(out, "{:03}", t.yday),
            'F' => write!(out, "{}-{:02}-{:02}", t.year, t.month, t.day),
            'T' => write!(out, "{:02}:{:02}:{:02}", t.hour, t.minute, t.second),
            'Z' => write!(out, "UTC"),
            'z' => write!(out, "+0000"),
            '%' => write!(out, "%"),
            other => write!(out, "%{other}"),
        };
    }
    out
}

fn strftime_now(fmt: String) -> Result<String, Error> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(format_time(&civil_time(now), &fmt))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::tokenizer::Tokenizer;
    use std::sync::OnceLock;

    const GOLDEN: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/llamacpp-smollm2-135m-q4_1.json"
    );

    fn tok() -> &'static Tokenizer {
        static TOK: OnceLock<Tokenizer> = OnceLock::new();
        TOK.get_or_init(|| {
            let path = tessera_testkit::default_model_path();
            let mut file = std::fs::File::open(&path).unwrap_or_else(|e| {
                panic!(
                    "test model {} is missing ({e}); run scripts/fetch-model (or set TESSERA_TEST_MODEL)",
                    path.display()
                )
            });
            let content = candle_core::quantized::gguf_file::Content::read(&mut file)
                .unwrap_or_else(|e| panic!("cannot read GGUF {}: {e}", path.display()));
            Tokenizer::from_gguf(&content.metadata).expect("tokenizer from GGUF")
        })
    }

    fn golden() -> serde_json::Value {
        let text =
            std::fs::read_to_string(GOLDEN).unwrap_or_else(|e| panic!("golden file {GOLDEN}: {e}"));
        serde_json::from_str(&text).expect("golden JSON")
    }

    fn model_template() -> ChatTemplate {
        let t = tok();
        let bos = t.token_text(t.bos_id().unwrap()).unwrap();
        let eos = t.token_text(2).unwrap();
        ChatTemplate::new(t.chat_template().expect("GGUF chat template"), bos, eos).unwrap()
    }

    fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs
            .iter()
            .map(|(r, c)| ChatMessage::new(*r, *c))
            .collect()
    }

    fn render_str(
        source: &str,
        messages: &[ChatMessage],
        extra: Option<&serde_json::Value>,
    ) -> Result<String, TemplateError> {
        ChatTemplate::new(source, "<s>", "</s>")?.render(messages, None, true, extra)
    }

    #[test]
    fn golden_chats_render_and_encode_exactly() {
        let g = golden();
        let template = model_template();
        let chats = g["chats"].as_array().unwrap();
        assert_eq!(chats.len(), 6);
        for chat in chats {
            let messages: Vec<ChatMessage> =
                serde_json::from_value(chat["messages"].clone()).unwrap();
            assert_eq!(messages[0].content, chat["user_message"].as_str().unwrap());
            let prompt = template.render(&messages, None, true, None).unwrap();
            assert_eq!(prompt, chat["prompt"].as_str().unwrap());
            let want: Vec<u32> = chat["prompt_token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(tok().encode(&prompt, true).unwrap(), want);
        }
    }

    #[test]
    fn multi_turn_with_system_prompt_is_chatml() {
        let messages = msgs(&[
            ("system", "You are terse."),
            ("user", "Hi"),
            ("assistant", "Hello."),
            ("user", "Bye"),
        ]);
        let want = "<|im_start|>system\nYou are terse.<|im_end|>\n\
                    <|im_start|>user\nHi<|im_end|>\n\
                    <|im_start|>assistant\nHello.<|im_end|>\n\
                    <|im_start|>user\nBye<|im_end|>\n\
                    <|im_start|>assistant\n";
        assert_eq!(
            model_template()
                .render(&messages, None, true, None)
                .unwrap(),
            want
        );
        let fallback = ChatTemplate::new(CHATML_TEMPLATE, "", "").unwrap();
        assert_eq!(fallback.render(&messages, None, true, None).unwrap(), want);
        let no_prompt = fallback.render(&messages, None, false, None).unwrap();
        assert_eq!(
            no_prompt,
            want.strip_suffix("<|im_start|>assistant\n").unwrap()
        );
    }

    #[test]
    fn raise_exception_surfaces_the_message() {
        let source = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must start with user') }}{% endif %}ok";
        let err = render_str(source, &msgs(&[("assistant", "x")]), None).unwrap_err();
        match &err {
            TemplateError::Raised(m) => assert_eq!(m, "Conversation roles must start with user"),
            other => panic!("expected Raised, got {other:?}"),
        }
        assert!(err
            .to_string()
            .contains("Conversation roles must start with user"));
        assert_eq!(
            render_str(source, &msgs(&[("user", "x")]), None).unwrap(),
            "ok"
        );
    }

    #[test]
    fn syntax_and_render_errors() {
        assert!(matches!(
            ChatTemplate::new("{% for x in %}", "", ""),
            Err(TemplateError::Syntax(_))
        ));
        let err = render_str(
            "{{ messages[0].nope.deeper }}",
            &msgs(&[("user", "x")]),
            None,
        )
        .unwrap_err();
        assert!(matches!(err, TemplateError::Render(_)), "{err:?}");
        let err = ChatTemplate::new("x", "", "")
            .unwrap()
            .render(&[], None, true, Some(&serde_json::json!([1])))
            .unwrap_err();
        assert!(matches!(err, TemplateError::Context(_)));
    }

    #[test]
    fn python_methods_and_whitespace_like_transformers() {
        // trim_blocks + lstrip_blocks: block lines leave no blank lines or indentation.
        let source = "{% for m in messages %}\n    {% if m.content.strip().startswith('A') %}\n{{ m.role.upper() }}:{{ m.content.strip() }}\n    {% endif %}\n{% endfor %}\n";
        let out = render_str(
            source,
            &msgs(&[("user", "  Apple "), ("assistant", "Banana")]),
            None,
        )
        .unwrap();
        assert_eq!(out, "USER:Apple\n");
        let out = render_str(
            "{{ messages[0].content.split(',') | join('|') }} {{ 'a-b'.replace('-', '+') }} {{ {'k': 1}.get('k') }} {{ {'k': 1}.get('z', 7) }}",
            &msgs(&[("user", "a,b,c")]),
            None,
        )
        .unwrap();
        assert_eq!(out, "a|b|c a+b 1 7");
        // loop controls
        let out = render_str(
            "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
            &msgs(&[("user", "one"), ("user", "two")]),
            None,
        )
        .unwrap();
        assert_eq!(out, "one");
        // bos/eos and namespace
        let out = render_str(
            "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}{{ eos_token }}",
            &msgs(&[("user", "a"), ("user", "b")]),
            None,
        )
        .unwrap();
        assert_eq!(out, "<s>2</s>");
    }

    #[test]
    fn extra_variables_tools_and_tojson() {
        let source = "{% if tools is not none %}{{ tools | tojson }}{% endif %}|{{ enable_thinking }}|{{ documents is none }}";
        let t = ChatTemplate::new(source, "", "").unwrap();
        let extra = serde_json::json!({"enable_thinking": false});
        // Booleans print the Python way, as under Jinja2.
        assert_eq!(
            t.render(&[], None, true, Some(&extra)).unwrap(),
            "|False|True"
        );
        let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather", "description": "The user's city <b> & café", "parameters": {"a": [1, 2.5, null, true]}}}]);
        let out = t.render(&[], Some(&tools), true, None).unwrap();
        // Keys keep the order serde_json gives them (sorted unless its `preserve_order` is on).
        assert_eq!(out, format!("{}||True", python_dumps(&tools)));
        assert!(
            out.contains(r#""description": "The user's city <b> & café""#),
            "{out}"
        );
        // indent, sort_keys, ensure_ascii
        let t = ChatTemplate::new(
            "{{ messages[0] | tojson(indent=2, sort_keys=true) }}",
            "",
            "",
        )
        .unwrap();
        let m = ChatMessage::new("user", "é");
        assert_eq!(
            t.render(std::slice::from_ref(&m), None, false, None)
                .unwrap(),
            "{\n  \"content\": \"é\",\n  \"role\": \"user\"\n}"
        );
        let t = ChatTemplate::new("{{ messages[0] | tojson(ensure_ascii=true) }}", "", "").unwrap();
        assert_eq!(
            t.render(&[m], None, false, None).unwrap(),
            "{\"role\": \"user\", \"content\": \"\\u00e9\"}"
        );
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(1e-5), "1e-05");
        assert_eq!(python_float(2.5e20), "2.5e+20");
        assert_eq!(python_float(0.1), "0.1");
    }

    /// Python's json.dumps(v, ensure_ascii=False) for the test's values.
    fn python_dumps(v: &serde_json::Value) -> String {
        match v {
            serde_json::Value::Array(a) => format!(
                "[{}]",
                a.iter().map(python_dumps).collect::<Vec<_>>().join(", ")
            ),
            serde_json::Value::Object(o) => format!(
                "{{{}}}",
                o.iter()
                    .map(|(k, v)| format!(
                        "{}: {}",
                        serde_json::Value::String(k.clone()),
                        python_dumps(v)
                    ))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            other => other.to_string(),
        }
    }

    #[test]
    fn tool_call_fields_reach_the_template() {
        let mut m = ChatMessage::new("assistant", "");
        m.tool_calls = Some(
            serde_json::json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]),
        );
        let tool = ChatMessage {
            role: "tool".into(),
            content: "42".into(),
            tool_calls: None,
            tool_call_id: Some("c1".into()),
            name: Some("f".into()),
        };
        let source = "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}{% elif m.role == 'tool' %}[{{ m.tool_call_id }}/{{ m.name }}]={{ m.content }}{% endif %}{% if m.name is defined %}!{% endif %}{% endfor %}";
        let out = ChatTemplate::new(source, "", "")
            .unwrap()
            .render(&[m, tool], None, false, None)
            .unwrap();
        assert_eq!(out, "f({\"x\": 1})[c1/f]=42!");
    }

    #[test]
    fn generation_tags_render_their_body() {
        let source = "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}\n{{ m.content }}{%- endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}";
        let out = render_str(source, &msgs(&[("user", "q"), ("assistant", "a")]), None).unwrap();
        // As in Jinja2, trim_blocks eats the newline after each block tag.
        assert_eq!(out, "qa");
        assert_eq!(
            rewrite_generation_tags("{%- generation -%}x{% endgeneration %}{% if a %}{% endif %}"),
            "{%- if true -%}x{% endif %}{% if a %}{% endif %}"
        );
    }

    #[test]
    fn strftime_now_formats_dates() {
        // 2024-07-26 13:05:09 UTC, a Friday, day 208.
        let t = civil_time(1_721_999_109);
        assert_eq!(format_time(&t, "%d %b %Y"), "26 Jul 2024");
        assert_eq!(
            format_time(&t, "%A %B %-d, %H:%M:%S %p %j %%"),
            "Friday July 26, 13:05:09 PM 208 %"
        );
        let t = civil_time(0);
        assert_eq!(format_time(&t, "%Y-%m-%d %a"), "1970-01-01 Thu");
        let t = civil_time(951_782_400); // 2000-02-29
        assert_eq!(format_time(&t, "%F %j"), "2000-02-29 060");
        let out = render_str("{{ strftime_now('%Y') }}", &[], None).unwrap();
        assert!(out.len() == 4 && out.starts_with("20"), "{out}");
    }
}
