//! One sequence's side of decoding: from each step's logits to its next
//! token and the text it releases (sampling, end-of-generation and stop
//! tokens, stop strings, whole UTF-8 characters, thinking and tool calls,
//! logprobs).

use std::ops::ControlFlow;
use std::time::Instant;

use crate::logits::BestToken;
use crate::serve::sampler::{Sampled, Sampler};
use crate::serve::{
    FinishReason, GenerateRequest, GenerationEvent, LoadedModel, Prompt, TokenLogprob,
};
use crate::text::output_parser::{OutputFormat, OutputParser, ParsedChunk};
use crate::text::stop::StopMatcher;
use crate::text::utf8_stream::Utf8Stream;
use tessera_grammar::TokenMask;

/// Where a sequence's output stands.
pub struct Decoder {
    max_tokens: usize,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    want_logprobs: bool,
    sampler: Sampler,
    /// The request's constraint as it stands (structured output).
    constraint: Option<TokenMask>,
    tokens: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    text: String,
    chunks: Vec<ParsedChunk>,
    utf8: Utf8Stream,
    stops: StopMatcher,
    parser: OutputParser,
    piece: String,
    first_token_at: Option<Instant>,
    reason: FinishReason,
}

/// What a finished sequence produced.
pub struct Decoded {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    pub text: String,
    pub chunks: Vec<ParsedChunk>,
    pub reason: FinishReason,
    pub first_token_at: Option<Instant>,
}

/// Whether `prompt` ends inside an open think block: a template that writes
/// the opening tag into the generation prompt (Qwen3.5 and the thinking
/// Qwen3s by default, DeepSeek-R1) has the output start in reasoning, with
/// only the closing tag to come.
pub fn prompt_opens_reasoning(model: &LoadedModel, format: &OutputFormat, prompt: &[u32]) -> bool {
    let Some((open, _)) = &format.think else {
        return false;
    };
    // A few tokens hold the tag and the whitespace after it.
    let tail = &prompt[prompt.len().saturating_sub(8)..];
    model
        .tokenizer
        .decode(tail, false)
        .is_ok_and(|text| text.trim_end().ends_with(open.as_str()))
}

/// A step's row for one sequence: its logits, or only their best token
/// when that is all its sampling needs ([`Decoder::needs_only_best`]),
/// with the row's best candidates when those are
/// ([`Decoder::needs_only_candidates`]).
pub enum Row<'a> {
    Logits(&'a mut [f32]),
    Best(BestToken, &'a [(u32, f32)]),
}

/// Where a sequence's events go; `Break` cancels it.
pub type Emit<'s> = dyn FnMut(GenerationEvent<'_>) -> ControlFlow<()> + 's;

impl Decoder {
    /// The decoder of one request whose prompt is `prompt`, sampling with
    /// `sampler` under `constraint` (the request's, compiled).
    pub fn new(
        model: &LoadedModel,
        request: &GenerateRequest,
        (sampler, constraint): (Sampler, Option<TokenMask>),
        prompt: &[u32],
    ) -> Self {
        // A raw prompt's continuation is text as it comes: the chat
        // template's reasoning and tool-call markup means nothing there.
        let mut format = match request.prompt {
            Prompt::Chat { .. } => model.output_format.clone(),
            Prompt::Raw(_) | Prompt::Tokens(_) => OutputFormat::plain(),
        };
        format.starts_in_reasoning = prompt_opens_reasoning(model, &format, prompt);
        Self {
            max_tokens: request.max_tokens,
            stop_token_ids: request.stop_token_ids.clone(),
            ignore_eos: request.ignore_eos,
            want_logprobs: request.logprobs,
            sampler,
            constraint,
            tokens: Vec::with_capacity(request.max_tokens.min(4096)),
            logprobs: Vec::new(),
            text: String::new(),
            chunks: Vec::new(),
            utf8: Utf8Stream::new(),
            stops: StopMatcher::new(request.stop.clone()),
            parser: OutputParser::new(format),
            piece: String::new(),
            first_token_at: None,
            reason: FinishReason::Length,
        }
    }

    /// Whether a row's best token is all it needs to choose the next one:
    /// greedy, without penalties, bias, logprobs or a constraint.
    pub fn needs_only_best(&self) -> bool {
        self.sampler.needs_only_best() && !self.want_logprobs && self.constraint.is_none()
    }

    /// Whether a row's best candidates are all it needs: top-k sampling
    /// (or greedy with alternatives to list) without penalties, bias or a
    /// constraint, which read or change the whole row.
    pub fn needs_only_candidates(&self) -> bool {
        self.sampler.needs_only_candidates() && self.constraint.is_none()
    }

    /// Samples the next token from `row` (`history`: the prompt and the
    /// tokens so far) and streams what it releases. `Some(token)` when the
    /// sequence goes on with `token` fed back; `None` once it has ended.
    pub fn next(
        &mut self,
        model: &LoadedModel,
        row: Row<'_>,
        history: &[u32],
        emit: &mut Emit<'_>,
    ) -> Option<u32> {
        let sampled = match row {
            Row::Logits(logits) => {
                if let Some(constraint) = &mut self.constraint {
                    if let Err(error) = constraint.apply(logits) {
                        return self.constraint_failed(&error);
                    }
                }
                self.sampler.sample(logits, history)
            }
            Row::Best(best, []) => self.sampler.sample_best(best),
            Row::Best(best, candidates) => self.sampler.sample_candidates(best, candidates),
        };
        let id = sampled.token;
        self.first_token_at.get_or_insert_with(Instant::now);
        self.tokens.push(id);
        if self.want_logprobs {
            self.logprobs.push(TokenLogprob {
                token: id,
                logprob: sampled.logprob,
                top: sampled.top_logprobs.clone(),
            });
        }
        let tokenizer = &model.tokenizer;
        let end_of_generation = !self.ignore_eos && tokenizer.eog_ids().contains(&id);
        if end_of_generation || self.stop_token_ids.contains(&id) {
            self.reason = FinishReason::Stop;
            return None;
        }
        if let Some(constraint) = &mut self.constraint {
            if let Err(error) = constraint.accept(id) {
                return self.constraint_failed(&error);
            }
        }
        self.piece.clear();
        if !tokenizer.is_control(id) {
            self.utf8
                .push_into(tokenizer.token_bytes(id), &mut self.piece);
        }
        let outcome = self.stops.push(&self.piece);
        let flow = self.emit(emit, id, &outcome.emit, &sampled);
        if outcome.stopped.is_some() {
            self.reason = FinishReason::StopString;
            return None;
        }
        if flow.is_break() {
            self.reason = FinishReason::Cancelled;
            return None;
        }
        if self.constraint.as_ref().is_some_and(TokenMask::is_finished) {
            // Nothing but an end token could follow: end without the step.
            self.reason = FinishReason::Stop;
            return None;
        }
        if self.tokens.len() >= self.max_tokens {
            self.reason = FinishReason::Length;
            return None;
        }
        Some(id)
    }

    /// A constraint that can go no further (its grammar met a state it
    /// cannot leave): the sequence ends with what it has.
    fn constraint_failed(&mut self, error: &tessera_grammar::GrammarError) -> Option<u32> {
        tracing::warn!(%error, "the constraint ended the sequence");
        self.reason = FinishReason::Stop;
        None
    }

    fn emit(
        &mut self,
        emit: &mut Emit<'_>,
        id: u32,
        released: &str,
        sampled: &Sampled,
    ) -> ControlFlow<()> {
        self.text.push_str(released);
        let mut flow = emit(GenerationEvent::Token {
            id,
            text: released,
            logprob: sampled.logprob,
            top_logprobs: &sampled.top_logprobs,
        });
        if !released.is_empty() {
            for chunk in self.parser.push(released) {
                if emit(GenerationEvent::Parsed(&chunk)).is_break() {
                    flow = ControlFlow::Break(());
                }
                self.chunks.push(chunk);
            }
        }
        flow
    }

    /// Ends the sequence as cancelled (unless it already ended otherwise).
    pub fn cancel(&mut self) {
        if self.reason == FinishReason::Length && self.tokens.len() < self.max_tokens {
            self.reason = FinishReason::Cancelled;
        }
    }

    /// Releases what was held back (unless a stop string cut it) and
    /// closes the parser, streaming the last chunks.
    pub fn finish(mut self, emit: &mut Emit<'_>) -> Decoded {
        if self.reason != FinishReason::StopString {
            let mut tail = self.utf8.finish();
            tail = format!("{}{}", self.stops.push(&tail).emit, self.stops.finish());
            if !tail.is_empty() {
                for chunk in self.parser.push(&tail) {
                    let _ = emit(GenerationEvent::Parsed(&chunk));
                    self.chunks.push(chunk);
                }
                self.text.push_str(&tail);
            }
        }
        for chunk in self.parser.finish() {
            let _ = emit(GenerationEvent::Parsed(&chunk));
            self.chunks.push(chunk);
        }
        Decoded {
            tokens: self.tokens,
            logprobs: self.logprobs,
            text: self.text,
            chunks: self.chunks,
            reason: self.reason,
            first_token_at: self.first_token_at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_ending_in_an_open_think_tag_starts_in_reasoning() {
        let model = LoadedModel::load(&tessera_testkit::default_model_path(), |_, _| {})
            .expect("the default model loads");
        let format = model.output_format.clone();
        let opens = |text: &str| {
            let ids = model.tokenizer.encode(text, true).expect("encodes");
            prompt_opens_reasoning(&model, &format, &ids)
        };
        assert!(opens("<|im_start|>assistant\n<think>\n"));
        // Thinking switched off writes an empty block: the output is text.
        assert!(!opens("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(!opens("<|im_start|>assistant\n"));
        assert!(!prompt_opens_reasoning(
            &model,
            &OutputFormat::plain(),
            &[1, 2]
        ));
    }
}
