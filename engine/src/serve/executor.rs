//! Running a model's forward steps on one rank or across the ranks of a
//! [`Group`] (DESIGN section 6, Sharding).
//!
//! Rank 0 drives: it schedules, tokenizes, samples and streams, and before
//! each step it broadcasts a [`Step`]: a batch of sequences' spans (their
//! positions, tokens and block tables). Every rank then runs the same
//! [`Executor::execute`]:
//! - **tensor parallel**: all ranks run every layer on their slice; the
//!   output projections gather their inputs whole and split their output
//!   rows (see [`crate::model::gather`]), so every rank computes what one
//!   machine does, bit for bit; rank 0 gathers the logits;
//! - **pipeline**: the first rank embeds, hidden states go to the next rank,
//!   the last rank's final-normed rows that want logits go round the ring
//!   back to rank 0, which holds the head (tied, its embeddings) and turns
//!   them into logits: a row of hidden states, not a row of the vocabulary,
//!   crosses the network. A prefill
//!   chunk that needs no logits returns at once on rank 0, so the next chunk
//!   starts while later stages still work on this one (stages overlap).
//!
//! Only rank 0 samples and allocates blocks, and a step names every block
//! it writes and reads: ranks cannot drift apart.

use std::collections::VecDeque;
use std::time::Duration;

use crate::dist::collectives::{CollectiveError, Group, SingleRank};
use crate::logits::BestRows;
use crate::model::paged::{BlockId, KvPool};
use crate::model::transformer::RowOutput;
use crate::model::transformer::{ForwardError, Pass};
use crate::model::{ForwardOutput, SeqSpan, StageInput, Transformer, Workspace};
use crate::threadpool::ThreadPool;

/// One sequence's part of a [`Step::Batch`], as it travels between ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireSpan {
    /// The position of the span's first token.
    pub start: usize,
    /// Tokens of the step's input that belong to this sequence.
    pub len: usize,
    /// Rows of logits rank 0 wants, for the span's last tokens.
    pub logits: usize,
    /// The sequence's blocks, for every position up to `start + len`.
    pub table: Vec<BlockId>,
    /// Tokens in the sequence's prompt (dynamic RoPE's base).
    pub prompt: usize,
    /// Its slot of recurrent state (hybrid models).
    pub state: usize,
}

impl WireSpan {
    fn as_span(&self) -> SeqSpan<'_> {
        SeqSpan {
            start: self.start,
            len: self.len,
            table: &self.table,
            prompt: self.prompt,
            logits: self.logits,
            state: self.state,
        }
    }
}

/// Writes a [`Step::Batch`] of `spans` over `tokens` (see [`Step::encode`])
/// without building one.
fn encode_batch(spans: &[SeqSpan<'_>], tokens: &[u32], output: RowOutput, out: &mut Vec<u8>) {
    out.clear();
    let mut word = |w: u32| out.extend_from_slice(&w.to_le_bytes());
    word(match output {
        RowOutput::Logits => BATCH,
        RowOutput::BestTokens => BATCH_OF_BESTS,
        RowOutput::TopCandidates => BATCH_OF_TOPS,
    });
    word(spans.len() as u32);
    for span in spans {
        word(span.start as u32);
        word(span.len as u32);
        word(span.logits as u32);
        word(span.state as u32);
        word(span.prompt as u32);
        word(span.table.len() as u32);
        for &block in span.table {
            word(block);
        }
    }
    for &t in tokens {
        word(t);
    }
}

/// What rank 0 tells every rank to do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Run `tokens`, span by span: every rank writes the same positions of
    /// the same blocks, so every rank's pool holds the same sequences.
    Batch {
        spans: Vec<WireSpan>,
        tokens: Vec<u32>,
        /// What rank 0 wants of the rows that want logits.
        output: RowOutput,
    },
    /// The instance is done: leave [`Executor::serve`].
    Shutdown,
}

const BATCH: u32 = 3;
/// A batch whose rows that want logits want only their best tokens.
const BATCH_OF_BESTS: u32 = 4;
/// A batch whose rows that want logits want their top candidates.
const BATCH_OF_TOPS: u32 = 5;
const SHUTDOWN: u32 = 2;

impl Step {
    /// Little-endian u32 words: kind (which also says the [`RowOutput`]), span count, then per span start, len,
    /// logits, state slot, prompt length, table length and table, then the
    /// tokens.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.clear();
        let mut word = |w: u32| out.extend_from_slice(&w.to_le_bytes());
        match self {
            Step::Shutdown => word(SHUTDOWN),
            Step::Batch {
                spans,
                tokens,
                output,
            } => {
                let spans: Vec<SeqSpan<'_>> = spans.iter().map(WireSpan::as_span).collect();
                encode_batch(&spans, tokens, *output, out);
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
            [BATCH, count, ref rest @ ..] => {
                Self::decode_batch(count as usize, rest, RowOutput::Logits)
            }
            [BATCH_OF_BESTS, count, ref rest @ ..] => {
                Self::decode_batch(count as usize, rest, RowOutput::BestTokens)
            }
            [BATCH_OF_TOPS, count, ref rest @ ..] => {
                Self::decode_batch(count as usize, rest, RowOutput::TopCandidates)
            }
            _ => Err(format!("an unknown step of {} words", words.len())),
        }
    }

    fn decode_batch(count: usize, mut words: &[u32], output: RowOutput) -> Result<Self, String> {
        let truncated = || "a batch step cut short".to_string();
        let mut spans = Vec::with_capacity(count.min(words.len()));
        let mut total = 0usize;
        for _ in 0..count {
            let [start, len, logits, state, prompt, blocks, ref rest @ ..] = words[..] else {
                return Err(truncated());
            };
            let table = rest.get(..blocks as usize).ok_or_else(truncated)?;
            if len == 0 || logits > len {
                return Err(format!("a span of {len} tokens wants {logits} logits rows"));
            }
            spans.push(WireSpan {
                start: start as usize,
                len: len as usize,
                logits: logits as usize,
                table: table.to_vec(),
                prompt: prompt as usize,
                state: state as usize,
            });
            total += len as usize;
            words = &rest[blocks as usize..];
        }
        if spans.is_empty() || words.len() != total {
            return Err(format!(
                "a batch step of {} spans over {total} tokens carries {}",
                spans.len(),
                words.len()
            ));
        }
        Ok(Step::Batch {
            spans,
            tokens: words.to_vec(),
            output,
        })
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
        )
    }
}

/// One rank's share of a model with its KV pool, scratch space, compute
/// threads and group.
pub struct Executor<'m> {
    transformer: &'m Transformer,
    kv: KvPool,
    workspace: Workspace,
    pool: ThreadPool,
    group: Box<dyn Group>,
    logits: Vec<f32>,
    best: BestRows,
    hidden: Vec<f32>,
    message: Vec<u8>,
    shut_down: bool,
    /// Rank 0: launched steps whose logits are not collected yet.
    launched: VecDeque<Launched>,
    /// Buffers of collected steps, for the next launches.
    spare: Vec<Vec<f32>>,
    spare_best: Vec<BestRows>,
}

/// A step rank 0 launched: how many rows it waits for, of what, and the
/// rows themselves when this rank computed them (no pipeline stage after
/// it).
struct Launched {
    wanted: usize,
    output: RowOutput,
    held: Held,
}

/// A launched step's rows that rank 0 already holds.
enum Held {
    /// They come from the last stage at collection.
    Later,
    Logits(Vec<f32>),
    Best(BestRows),
}

/// Rank 0's best tokens of whole rows of logits, with their candidates
/// for [`RowOutput::TopCandidates`].
fn best_of_rows(logits: &[f32], vocab: usize, output: RowOutput, out: &mut BestRows) {
    out.take_of(logits, vocab, output == RowOutput::TopCandidates);
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
            kv: transformer.new_pool(),
            workspace: Workspace::default(),
            pool: ThreadPool::new(threads),
            group,
            logits: Vec::new(),
            best: BestRows::default(),
            hidden: Vec::new(),
            message: Vec::new(),
            shut_down: false,
            launched: VecDeque::new(),
            spare: Vec::new(),
            spare_best: Vec::new(),
        }
    }

    /// Whether a launched step's logits come later from other ranks, so
    /// that launching a second one before collecting the first keeps every
    /// pipeline stage busy (rank 0 is a first stage but not the last).
    pub fn overlaps_steps(&self) -> bool {
        self.world_size() > 1
            && !self.transformer.is_tensor_parallel()
            && !self.transformer.is_last_stage()
    }

    /// Steps launched and not yet collected.
    pub fn in_flight(&self) -> usize {
        self.launched.len()
    }

    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    pub fn world_size(&self) -> usize {
        self.group.size()
    }

    /// This rank's shard.
    pub fn transformer(&self) -> &'m Transformer {
        self.transformer
    }

    /// Bytes of this rank's KV pool.
    pub fn kv_bytes(&self) -> usize {
        self.kv.size_bytes()
    }

    /// Grows this rank's pool to `blocks` now rather than on first use
    /// (rank 0 knows the instance's budget; the others grow as steps name
    /// their blocks).
    pub fn reserve_blocks(&mut self, blocks: usize) {
        self.kv.ensure_blocks(blocks);
    }

    /// Every rank's most KV blocks (`local`: what its memory holds) to
    /// rank 0, which gets the least of them: the instance's pool has the
    /// same blocks on every rank, so the smallest GPU caps it. Every rank
    /// calls this once, before the first step; the others get their own.
    pub fn least_kv_blocks(&mut self, local: usize) -> Result<usize, ExecError> {
        // Counts up to MAX_POOL_BLOCKS (2^20) are exact as f32.
        let mine = local.min(MAX_POOL_BLOCKS);
        let size = self.world_size();
        if size == 1 {
            return Ok(mine);
        }
        let rank = self.rank();
        let mut counts = vec![1; size];
        counts[0] = 0;
        let word = [mine as f32];
        let sent: &[f32] = if rank == 0 { &[] } else { &word };
        let mut gathered = vec![0.0f32; size - 1];
        self.group.gather_to_first(sent, &counts, &mut gathered)?;
        if rank != 0 {
            return Ok(mine);
        }
        let mut least = mine;
        for (from, &other) in (1..).zip(&gathered) {
            if !(other >= 0.0 && other <= MAX_POOL_BLOCKS as f32) {
                return Err(ExecError::BadStep {
                    rank: from,
                    message: format!("a KV budget of {other} blocks"),
                });
            }
            least = least.min(other as usize);
        }
        Ok(least)
    }

    /// Rank 0: every rank runs `tokens`, span by span. Returns the logits
    /// rows the spans ask for, in span order.
    pub fn step(
        &mut self,
        spans: &[SeqSpan<'_>],
        tokens: &[u32],
    ) -> Result<Option<&[f32]>, ExecError> {
        self.launch(spans, tokens, RowOutput::Logits)?;
        self.collect()
    }

    /// Rank 0: starts a step on every rank and runs this rank's part; its
    /// logits are [`Executor::collect`]ed later, oldest step first. On a
    /// pipeline, the next step can be launched first: this stage works on
    /// it while later stages finish the last one. `output`: what it wants
    /// of each row that wants logits.
    pub fn launch(
        &mut self,
        spans: &[SeqSpan<'_>],
        tokens: &[u32],
        output: RowOutput,
    ) -> Result<(), ExecError> {
        if self.rank() != 0 {
            return Err(ExecError::NotDriver { rank: self.rank() });
        }
        if self.world_size() > 1 {
            encode_batch(spans, tokens, output, &mut self.message);
            let mut message = std::mem::take(&mut self.message);
            let sent = self.group.broadcast_bytes(0, &mut message);
            self.message = message;
            sent?;
        }
        let wanted: usize = spans.iter().map(|s| s.logits).sum();
        // The rows move to the launch; their buffer gets a spare one.
        let held = match (self.execute(spans, tokens, output)?, output) {
            (false, _) => Held::Later,
            (true, RowOutput::Logits) => {
                let buffer = self.spare.pop().unwrap_or_default();
                Held::Logits(std::mem::replace(&mut self.logits, buffer))
            }
            (true, RowOutput::BestTokens | RowOutput::TopCandidates) => {
                let buffer = self.spare_best.pop().unwrap_or_default();
                Held::Best(std::mem::replace(&mut self.best, buffer))
            }
        };
        self.launched.push_back(Launched {
            wanted,
            output,
            held,
        });
        Ok(())
    }

    /// Rank 0: the logits of the oldest launched step (`None` when it
    /// asked for none), waiting for the last stage if need be.
    pub fn collect(&mut self) -> Result<Option<&[f32]>, ExecError> {
        let mut logits = std::mem::take(&mut self.logits);
        let mut best = std::mem::take(&mut self.best);
        let collected = self.collect_into(&mut logits, &mut best);
        self.logits = logits;
        self.best = best;
        let vocab = self.transformer.config.vocab;
        Ok(collected?.map(|rows| &self.logits[..rows * vocab]))
    }

    /// Rank 0: [`Executor::collect`] into `logits` (or `best`, for a step
    /// launched for [`RowOutput::BestTokens`] or
    /// [`RowOutput::TopCandidates`]), whose buffer is traded for
    /// the one holding the rows rather than copied into; returns how many
    /// rows at its start are the step's.
    pub fn collect_into(
        &mut self,
        logits: &mut Vec<f32>,
        best: &mut BestRows,
    ) -> Result<Option<usize>, ExecError> {
        let Some(launched) = self.launched.pop_front() else {
            return Ok(None);
        };
        let wanted = launched.wanted;
        match launched.held {
            Held::Logits(local) => {
                self.spare.push(std::mem::replace(logits, local));
                return Ok(Some(wanted));
            }
            Held::Best(local) => {
                self.spare_best.push(std::mem::replace(best, local));
                return Ok(Some(wanted));
            }
            Held::Later if wanted == 0 => return Ok(None),
            Held::Later => {}
        }
        // The last stage sent the rows' final-normed hidden states; this
        // first stage holds the head.
        let model = self.transformer;
        self.hidden.resize(wanted * model.config.hidden, 0.0);
        let computed = self
            .group
            .recv_prev(&mut self.hidden)
            .map_err(ExecError::from)
            .and_then(|()| {
                Ok(model.head_of_normed(&self.hidden, &mut self.workspace, &self.pool)?)
            });
        match (computed, launched.output) {
            (Ok(rows), RowOutput::BestTokens | RowOutput::TopCandidates) => {
                best_of_rows(rows, model.config.vocab, launched.output, best)
            }
            (Ok(_), RowOutput::Logits) => self.workspace.swap_logits(logits),
            (Err(error), _) => {
                // What else was launched will not come either.
                self.launched.clear();
                return Err(error);
            }
        }
        Ok(Some(wanted))
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
                Ok(Step::Batch {
                    spans,
                    tokens,
                    output,
                }) => {
                    let spans: Vec<SeqSpan<'_>> = spans.iter().map(WireSpan::as_span).collect();
                    self.execute(&spans, &tokens, output)?;
                }
            }
        }
    }

    /// Rank 0: runs `tokens` through a whole model of its own (a
    /// speculative draft) on this rank's compute threads, between the
    /// instance's steps, with its own pool and scratch space. Returns the
    /// logits rows the spans ask for.
    pub fn run_beside<'w>(
        &self,
        model: &Transformer,
        kv: &mut KvPool,
        workspace: &'w mut Workspace,
        spans: &[SeqSpan<'_>],
        tokens: &[u32],
    ) -> Result<&'w [f32], ExecError> {
        let most = spans
            .iter()
            .flat_map(|s| s.table.iter())
            .max()
            .map_or(0, |&b| b as usize + 1);
        kv.ensure_blocks(most);
        let input = StageInput::Tokens(tokens);
        let logits = RowOutput::Logits;
        let mut single = SingleRank;
        let step = Pass {
            kv,
            ws: workspace,
            pool: &self.pool,
            group: &mut single,
        };
        let out = model.forward_batch(input, spans, logits, step)?;
        match out {
            ForwardOutput::Logits(logits) => Ok(logits),
            ForwardOutput::Hidden(_)
            | ForwardOutput::Normed(_)
            | ForwardOutput::Best(_)
            | ForwardOutput::SentToFirst => Err(ForwardError::NotLastStage.into()),
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

    /// This rank's part of one step; true when rank 0 holds the step's
    /// rows now: logits in `logits`, or their best tokens in `best`.
    fn execute(
        &mut self,
        spans: &[SeqSpan<'_>],
        tokens: &[u32],
        output: RowOutput,
    ) -> Result<bool, ExecError> {
        let rank = self.group.rank();
        let most = spans
            .iter()
            .flat_map(|s| s.table.iter())
            .max()
            .map_or(0, |&b| b as usize + 1);
        if most > MAX_POOL_BLOCKS {
            return Err(ExecError::BadStep {
                rank,
                message: format!("a block id of {most} (at most {MAX_POOL_BLOCKS})"),
            });
        }
        self.kv.ensure_blocks(most);
        let model = self.transformer;
        let hidden = model.config.hidden;
        let group = self.group.as_mut();
        let input = if model.is_first_stage() {
            StageInput::Tokens(tokens)
        } else {
            let rows: usize = spans.iter().map(|s| s.len).sum();
            self.hidden.resize(rows * hidden, 0.0);
            group.recv_prev(&mut self.hidden)?;
            StageInput::Hidden(&self.hidden)
        };
        let step = Pass {
            kv: &mut self.kv,
            ws: &mut self.workspace,
            pool: &self.pool,
            group,
        };
        let out = model.forward_batch(input, spans, output, step)?;
        let mut have_logits = false;
        let mut have_best = false;
        match out {
            ForwardOutput::Logits(rows) if rank == 0 && output != RowOutput::Logits => {
                best_of_rows(rows, model.config.vocab, output, &mut self.best);
                have_best = true;
            }
            ForwardOutput::Logits(_) if rank == 0 => have_logits = true,
            ForwardOutput::Best(rows) if rank == 0 => {
                self.best.copy_from(rows);
                have_best = true;
            }
            // Tensor-parallel ranks other than 0 sent their share of the
            // logits to rank 0, which samples.
            ForwardOutput::SentToFirst => {}
            // Only rank 0 holds a head whose logits are whole.
            ForwardOutput::Logits(_) | ForwardOutput::Best(_) => {
                return Err(ExecError::BadStep {
                    rank,
                    message: "a step that left whole logits on a rank other than 0".into(),
                })
            }
            // The last pipeline stage: the rows go round to rank 0's head.
            ForwardOutput::Normed(rows) => group.send_next(rows)?,
            ForwardOutput::Hidden(x) if !model.is_last_stage() => group.send_next(x)?,
            ForwardOutput::Hidden(_) => {}
        }
        if have_logits {
            self.workspace.swap_logits(&mut self.logits);
        }
        // Rank 0 of a pipeline collects the last stage's logits later.
        Ok(have_logits || have_best)
    }
}

/// The most blocks a step may name: a rank grows its pool to what rank 0
/// asks, and this keeps a corrupt step from asking for all memory (2^20
/// blocks of 16 positions is 16M positions).
const MAX_POOL_BLOCKS: usize = 1 << 20;

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
            Step::Batch {
                spans: vec![
                    WireSpan {
                        start: 7,
                        len: 2,
                        logits: 2,
                        table: vec![4, 9],
                        prompt: 5,
                        state: 3,
                    },
                    WireSpan {
                        start: 0,
                        len: 1,
                        logits: 0,
                        table: vec![0],
                        prompt: 1,
                        state: 0,
                    },
                ],
                tokens: vec![1, 2, 49151],
                output: RowOutput::BestTokens,
            },
            Step::Batch {
                spans: vec![WireSpan {
                    start: 0,
                    len: 1,
                    logits: 1,
                    table: vec![0],
                    prompt: 1,
                    state: 0,
                }],
                tokens: vec![5],
                output: RowOutput::Logits,
            },
            Step::Batch {
                spans: vec![WireSpan {
                    start: 3,
                    len: 1,
                    logits: 1,
                    table: vec![2],
                    prompt: 3,
                    state: 1,
                }],
                tokens: vec![9],
                output: RowOutput::TopCandidates,
            },
        ] {
            step.encode(&mut bytes);
            assert_eq!(Step::decode(&bytes), Ok(step));
        }
        assert!(Step::decode(&[]).is_err());
        assert!(Step::decode(&[1, 2, 3]).is_err());
        assert!(Step::decode(&[9, 0, 0, 0]).is_err());
        let words = |ws: &[u32]| ws.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>();
        // More logits rows than tokens.
        // Words: start, len, logits, state slot, prompt, table length, table.
        assert!(Step::decode(&words(&[BATCH, 1, 0, 1, 2, 0, 0, 1, 0, 5])).is_err());
        // Spans of 3 tokens followed by 1 token; a table longer than what follows.
        assert!(Step::decode(&words(&[BATCH, 1, 0, 3, 1, 0, 0, 1, 0, 5])).is_err());
        assert!(Step::decode(&words(&[BATCH, 1, 0, 1, 1, 0, 0, 9, 0])).is_err());
        assert!(Step::decode(&words(&[BATCH, 0])).is_err());
        assert!(Step::decode(&words(&[BATCH, 1, 0, 1, 1, 0, 0, 1, 0, 5])).is_ok());
    }
}
