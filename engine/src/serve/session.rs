//! One request at a time on a batch of one: the simple way to generate
//! (the CLI, tests, rank 0 of a one-request instance).

use super::loaded::LoadedModel;
use super::request::{EngineError, GenerateRequest, GenerationEvent, GenerationOutput};
use std::ops::ControlFlow;

use crate::model::transformer::ForwardError;
use crate::serve::batch::{Batch, BatchConfig, SeqEvent, SeqId};
use crate::serve::executor::Executor;

/// A conversation context on one model: one request at a time on a
/// [`Batch`] of one, on this machine or driving the ranks of a distributed
/// instance (rank 0). Prompt prefixes of earlier requests are taken from
/// the KV cache in whole blocks.
pub struct Session<'m> {
    batch: Batch<'m>,
}

/// The one sequence of a session.
const SESSION_SEQ: SeqId = 0;

impl<'m> Session<'m> {
    pub fn new(model: &'m LoadedModel, threads: usize) -> Self {
        Self::with_executor(model, Executor::single(&model.transformer, threads))
    }

    /// Rank 0 of a distributed instance: `model` holds rank 0's shard and
    /// `executor` its group.
    pub fn with_executor(model: &'m LoadedModel, executor: Executor<'m>) -> Self {
        let context = model.transformer.config.context_length;
        let config = BatchConfig {
            // The request's own prefill chunk decides, as before batching.
            step_tokens: context,
            ..BatchConfig::for_context(1, context)
        };
        Self {
            batch: Batch::new(model, executor, config),
        }
    }

    /// The executor (for shutting a distributed instance down).
    pub fn executor(&mut self) -> &mut Executor<'m> {
        self.batch.executor()
    }

    /// What a step costs, as speculation measured it ([`Batch::step_cost`]).
    pub fn step_cost(&self) -> Option<(f64, f64)> {
        self.batch.step_cost()
    }

    /// The executor back, once the session is done with.
    pub fn into_executor(self) -> Executor<'m> {
        self.batch.into_executor()
    }

    /// Speculative decoding for the next requests ([`Batch::set_speculation`]).
    pub fn set_speculation(&mut self, speculation: Option<crate::serve::speculative::Speculation>) {
        self.batch.set_speculation(speculation);
    }

    /// Forgets the conversation (the next request starts cold).
    pub fn reset(&mut self) {
        self.batch.clear_cache();
    }

    /// Runs `tokens` from an empty cache and returns the logits after the
    /// last one (for comparisons against reference engines).
    pub fn logits_for(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        self.batch.logits_for(tokens)
    }

    /// Runs one request. `on_event` may return `Break` to cancel.
    pub fn generate(
        &mut self,
        request: &GenerateRequest,
        mut on_event: impl FnMut(GenerationEvent<'_>) -> ControlFlow<()>,
    ) -> Result<GenerationOutput, EngineError> {
        self.batch.submit(SESSION_SEQ, request.clone())?;
        let mut output = None;
        while output.is_none() && !self.batch.is_idle() {
            self.batch.step(&mut |_, event| match event {
                SeqEvent::Generation(event) => on_event(event),
                SeqEvent::Finished(done) => {
                    output = Some(done);
                    ControlFlow::Continue(())
                }
                SeqEvent::Failed(_) => ControlFlow::Continue(()),
            })?;
        }
        output.ok_or(EngineError::Forward(ForwardError::Empty))
    }
}
