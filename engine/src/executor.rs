//! Running a model's forward steps on one rank or across the ranks of a
//! [`Group`] (DESIGN section 6, Sharding).
//!
//! Rank 0 drives: it tokenizes, samples and streams, and before each step
//! it broadcasts a [`Step`] (the tokens, and how much of the KV cache every
//! rank keeps). Every rank then runs the same [`Executor::execute`]:
//! - **tensor parallel**: all ranks run every layer on their slice and
//!   all-reduce after attention and after the MLP; the logits are gathered;
//! - **pipeline**: the first rank embeds, hidden states go to the next rank,
//!   the last rank's logits go round the ring back to rank 0. A prefill
//!   chunk that needs no logits returns at once on rank 0, so the next chunk
//!   starts while later stages still work on this one (stages overlap).
//!
//! Only rank 0 samples, and the token it samples is in the next step every
//! rank runs: ranks cannot drift apart. A step carries the cache length
//! every rank must hold, and a rank that holds less says so.

use std::time::Duration;

use crate::collectives::{CollectiveError, Group, SingleRank};
use crate::model::transformer::ForwardError;
use crate::model::{ForwardOutput, KvCache, StageInput, Transformer, Workspace};
use crate::threadpool::ThreadPool;

/// What rank 0 tells every rank to do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Keep the first `keep` cached positions, then run `tokens`.
    Forward {
        keep: usize,
        /// Positions to reserve room for (the request's whole length).
        reserve: usize,
        tokens: Vec<u32>,
        want_logits: bool,
    },
    /// The instance is done: leave [`Executor::serve`].
    Shutdown,
}

const FORWARD: u32 = 1;
const SHUTDOWN: u32 = 2;

impl Step {
    /// Little-endian u32 words: kind, keep, reserve, want_logits, count, tokens.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.clear();
        let mut word = |w: u32| out.extend_from_slice(&w.to_le_bytes());
        match self {
            Step::Shutdown => word(SHUTDOWN),
            Step::Forward {
                keep,
                reserve,
                tokens,
                want_logits,
            } => {
                word(FORWARD);
                word(*keep as u32);
                word(*reserve as u32);
                word(u32::from(*want_logits));
                word(tokens.len() as u32);
                for &t in tokens {
                    word(t);
                }
            }
        }
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        if !bytes.len().is_multiple_of(4) || bytes.is_empty() {
            return Err(format!("a step of {} bytes", bytes.len()));
        }
        let words: Vec<u32> = bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        match words[..] {
            [SHUTDOWN] => Ok(Step::Shutdown),
            [FORWARD, keep, reserve, want_logits, count, ref tokens @ ..]
                if tokens.len() == count as usize && want_logits <= 1 && count > 0 =>
            {
                Ok(Step::Forward {
                    keep: keep as usize,
                    reserve: reserve as usize,
                    tokens: tokens.to_vec(),
                    want_logits: want_logits == 1,
                })
            }
            _ => Err(format!("an unknown step of {} words", words.len())),
        }
    }
}

/// Why a step failed on this rank.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error("rank {rank}: received {message}")]
    BadStep { rank: usize, message: String },
    #[error("rank {rank} holds {held} cached positions but was told to keep {keep}: ranks are out of step")]
    OutOfStep {
        rank: usize,
        held: usize,
        keep: usize,
    },
    #[error("rank {rank}: only rank 0 drives steps")]
    NotDriver { rank: usize },
}

impl ExecError {
    /// Whether the group itself failed (a peer died, stalled or sent
    /// garbage), as opposed to this request being bad.
    pub fn is_group_failure(&self) -> bool {
        matches!(
            self,
            ExecError::Collective(_)
                | ExecError::Forward(ForwardError::Collective(_))
                | ExecError::BadStep { .. }
                | ExecError::OutOfStep { .. }
        )
    }
}

/// One rank's share of a model with its KV cache, scratch space, compute
/// threads and group.
pub struct Executor<'m> {
    transformer: &'m Transformer,
    cache: KvCache,
    workspace: Workspace,
    pool: ThreadPool,
    group: Box<dyn Group>,
    logits: Vec<f32>,
    hidden: Vec<f32>,
    message: Vec<u8>,
    shut_down: bool,
}

impl<'m> Executor<'m> {
    /// The whole model on this machine.
    pub fn single(transformer: &'m Transformer, threads: usize) -> Self {
        Self::new(transformer, threads, Box::new(SingleRank))
    }

    /// One rank of `group`; `transformer` is this rank's shard.
    pub fn new(transformer: &'m Transformer, threads: usize, group: Box<dyn Group>) -> Self {
        Self {
            transformer,
            cache: transformer.new_cache(),
            workspace: Workspace::default(),
            pool: ThreadPool::new(threads),
            group,
            logits: Vec::new(),
            hidden: Vec::new(),
            message: Vec::new(),
            shut_down: false,
        }
    }

    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    pub fn world_size(&self) -> usize {
        self.group.size()
    }

    /// Positions in this rank's KV cache.
    pub fn cached(&self) -> usize {
        self.cache.len()
    }

    /// Bytes of this rank's KV cache.
    pub fn cache_bytes(&self) -> usize {
        self.cache.size_bytes()
    }

    /// Rank 0: every rank keeps `keep` cached positions and runs `tokens`
    /// after them. Returns the logits of the last token if `want_logits`.
    pub fn step(
        &mut self,
        keep: usize,
        reserve: usize,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, ExecError> {
        if self.rank() != 0 {
            return Err(ExecError::NotDriver { rank: self.rank() });
        }
        if self.world_size() > 1 {
            Step::Forward {
                keep,
                reserve,
                tokens: tokens.to_vec(),
                want_logits,
            }
            .encode(&mut self.message);
            let mut message = std::mem::take(&mut self.message);
            let sent = self.group.broadcast_bytes(0, &mut message);
            self.message = message;
            sent?;
        }
        self.execute(keep, reserve, tokens, want_logits)
    }

    /// Rank 0: tells the other ranks to leave [`Executor::serve`].
    pub fn shutdown(&mut self) -> Result<(), ExecError> {
        if self.shut_down || self.rank() != 0 || self.world_size() == 1 {
            return Ok(());
        }
        self.shut_down = true;
        Step::Shutdown.encode(&mut self.message);
        let mut message = std::mem::take(&mut self.message);
        let sent = self.group.broadcast_bytes(0, &mut message);
        self.message = message;
        Ok(sent?)
    }

    /// Ranks other than 0: run rank 0's steps until it shuts down. Waiting
    /// for the next step is bounded by `idle_timeout` (`None`: until rank 0
    /// sends or its connection closes); each step by `step_timeout`.
    pub fn serve(
        &mut self,
        idle_timeout: Option<Duration>,
        step_timeout: Duration,
    ) -> Result<(), ExecError> {
        let rank = self.rank();
        loop {
            self.group.set_timeout(idle_timeout)?;
            let mut message = std::mem::take(&mut self.message);
            let received = self.group.broadcast_bytes(0, &mut message);
            let step = received.map(|()| Step::decode(&message));
            self.message = message;
            self.group.set_timeout(Some(step_timeout))?;
            match step? {
                Err(message) => return Err(ExecError::BadStep { rank, message }),
                Ok(Step::Shutdown) => return Ok(()),
                Ok(Step::Forward {
                    keep,
                    reserve,
                    tokens,
                    want_logits,
                }) => {
                    self.execute(keep, reserve, &tokens, want_logits)?;
                }
            }
        }
    }

    /// Sets how long any one wait on a peer may take.
    pub fn set_timeout(&mut self, timeout: Option<Duration>) -> Result<(), ExecError> {
        Ok(self.group.set_timeout(timeout)?)
    }

    /// Waits until every rank gets here (after loading, say).
    pub fn barrier(&mut self) -> Result<(), ExecError> {
        Ok(self.group.barrier()?)
    }

    /// This rank's part of one step.
    fn execute(
        &mut self,
        keep: usize,
        reserve: usize,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, ExecError> {
        let rank = self.group.rank();
        if keep > self.cache.len() {
            return Err(ExecError::OutOfStep {
                rank,
                held: self.cache.len(),
                keep,
            });
        }
        self.cache.truncate(keep);
        self.cache.reserve(reserve);
        let model = self.transformer;
        let hidden = model.config.hidden;
        let group = self.group.as_mut();
        let input = if model.is_first_stage() {
            StageInput::Tokens(tokens)
        } else {
            self.hidden.resize(tokens.len() * hidden, 0.0);
            group.recv_prev(&mut self.hidden)?;
            StageInput::Hidden(&self.hidden)
        };
        let out = model.forward_in(
            input,
            &mut self.cache,
            &mut self.workspace,
            &self.pool,
            group,
            want_logits,
        )?;
        let mut have_logits = false;
        match out {
            ForwardOutput::Logits(logits) if rank == 0 => {
                self.logits.clear();
                self.logits.extend_from_slice(logits);
                have_logits = true;
            }
            // Tensor-parallel ranks other than 0 hold the same logits; only
            // rank 0 samples.
            ForwardOutput::Logits(_) if model.is_tensor_parallel() => {}
            // The last pipeline stage: the logits go round to rank 0.
            ForwardOutput::Logits(logits) => group.send_next(logits)?,
            ForwardOutput::Hidden(x) if !model.is_last_stage() => group.send_next(x)?,
            ForwardOutput::Hidden(_) => {}
        }
        if rank == 0 && want_logits && !have_logits {
            self.logits.resize(model.config.vocab, 0.0);
            group.recv_prev(&mut self.logits)?;
            have_logits = true;
        }
        Ok(have_logits.then_some(&self.logits[..]))
    }
}

impl Drop for Executor<'_> {
    fn drop(&mut self) {
        // Let the other ranks go rather than wait for a step that never
        // comes; a broken group has nothing to tell.
        if !self.shut_down && self.rank() == 0 && self.world_size() > 1 {
            let _ = self.group.set_timeout(Some(Duration::from_secs(1)));
            let _ = self.shutdown();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_round_trip_and_garbage_is_refused() {
        let mut bytes = Vec::new();
        for step in [
            Step::Shutdown,
            Step::Forward {
                keep: 7,
                reserve: 300,
                tokens: vec![1, 2, 49151],
                want_logits: true,
            },
        ] {
            step.encode(&mut bytes);
            assert_eq!(Step::decode(&bytes), Ok(step));
        }
        assert!(Step::decode(&[]).is_err());
        assert!(Step::decode(&[1, 2, 3]).is_err());
        assert!(Step::decode(&[9, 0, 0, 0]).is_err());
        // A token count that does not match the tokens that follow.
        let mut short = Vec::new();
        for w in [FORWARD, 0, 0, 1, 5, 1] {
            short.extend_from_slice(&w.to_le_bytes());
        }
        assert!(Step::decode(&short).is_err());
    }
}
