//! The final norm and the LM head: logits, or the best token per row
//! (gathered across a tensor group).

use crate::dist::collectives::{CollectiveError, Group};
use crate::logits::BestToken;
use crate::model::config::ModelConfig;
use crate::model::weights::Matrix;
use crate::ops;
use crate::quant::OutLayout;
use crate::threadpool::ThreadPool;

use super::io::{ForwardError, ForwardOutput, RowOutput, SeqSpan};
use super::workspace::Workspace;
use super::{TensorSlice, Transformer};

impl Transformer {
    /// The first stage of a pipeline of several: the logits of rows the
    /// last stage sent ([`ForwardOutput::Normed`]), one row of `vocab` per
    /// row of `normed`.
    pub fn head_of_normed<'w>(
        &self,
        normed: &[f32],
        ws: &'w mut Workspace,
        pool: &ThreadPool,
    ) -> Result<&'w [f32], ForwardError> {
        let (hidden, vocab) = (self.config.hidden, self.config.vocab);
        if normed.is_empty() || !normed.len().is_multiple_of(hidden) {
            return Err(ForwardError::NormedShape {
                hidden,
                values: normed.len(),
            });
        }
        let wanted = normed.len() / hidden;
        let head = self.whole_head()?;
        ws.acts.set(normed, wanted, hidden);
        if ws.logits.len() < wanted * vocab {
            ws.logits.resize(wanted * vocab, 0.0);
        }
        head.matmul(&mut ws.acts, wanted, normed, &mut ws.logits, pool)?;
        cap_logits(
            &mut ws.logits[..wanted * vocab],
            self.config.variant.final_softcap,
        );
        Ok(&ws.logits[..wanted * vocab])
    }

    /// The untied output matrix, or the embeddings it is tied to (a whole
    /// model or a pipeline's first stage).
    pub(super) fn whole_head(&self) -> Result<&Matrix, ForwardError> {
        self.output
            .as_ref()
            .or(self.embeddings.as_ref())
            .ok_or(ForwardError::NotLastStage)
    }

    /// The final norm over the last `logits` tokens of each span, into
    /// the first rows of `ws.normed`.
    pub(super) fn final_norm_rows(&self, spans: &[SeqSpan<'_>], ws: &mut Workspace) {
        let cfg = &self.config;
        let hidden = cfg.hidden;
        let norm = self.final_norm.as_deref().unwrap_or(&[]);
        let mut row = 0;
        let mut end = 0;
        for span in spans {
            end += span.len;
            for at in end - span.logits..end {
                let x = &ws.x[at * hidden..(at + 1) * hidden];
                let out = &mut ws.normed[row * hidden..(row + 1) * hidden];
                ops::rms_norm(x, norm, cfg.norm_eps, out);
                row += 1;
            }
        }
    }

    /// The LM head over the `wanted` rows [`Transformer::final_norm_rows`]
    /// left: `wanted` rows of `vocab`.
    pub(super) fn head<'w>(
        &self,
        wanted: usize,
        output: RowOutput,
        ws: &'w mut Workspace,
        pool: &ThreadPool,
        group: &mut dyn Group,
    ) -> Result<ForwardOutput<'w>, ForwardError> {
        let cfg = &self.config;
        let (hidden, vocab) = (cfg.hidden, cfg.vocab);
        let normed = &ws.normed[..wanted * hidden];
        ws.acts.set(normed, wanted, hidden);
        if ws.logits.len() < wanted * vocab {
            ws.logits.resize(wanted * vocab, 0.0);
        }
        let Some(slice) = &self.tensor else {
            let head = self.whole_head()?;
            head.matmul(&mut ws.acts, wanted, normed, &mut ws.logits, pool)?;
            cap_logits(&mut ws.logits[..wanted * vocab], cfg.variant.final_softcap);
            return Ok(ForwardOutput::Logits(&ws.logits[..wanted * vocab]));
        };
        // Each rank computes its rows of the vocabulary; rank 0 gathers.
        if slice.vocab_counts.len() != group.size() {
            return Err(ForwardError::GroupSize {
                expected: slice.vocab_counts.len(),
                actual: group.size(),
            });
        }
        if output == RowOutput::BestTokens {
            return Self::tensor_best_tokens(slice, cfg, wanted, ws, pool, group);
        }
        // Rank 0's rows of the vocabulary come first: it writes its logits
        // straight into place, the others theirs into one block each.
        let local = slice.head.rows();
        if group.rank() == 0 {
            let layout = OutLayout {
                stride: vocab,
                offset: 0,
            };
            let logits = &mut ws.logits[..wanted * vocab];
            slice
                .head
                .matmul_region(&mut ws.acts, normed, 0..wanted, logits, layout, pool)?;
            ws.local_logits.clear();
        } else {
            ws.local_logits.resize(wanted * local, 0.0);
            slice
                .head
                .matmul(&mut ws.acts, wanted, normed, &mut ws.local_logits, pool)?;
        }
        // One gather for all rows: rank r's block is its rows of every
        // sequence, which are then put in vocabulary order per sequence.
        let mut counts: Vec<usize> = slice.vocab_counts.iter().map(|c| c * wanted).collect();
        counts[0] = 0;
        ws.gathered.resize(counts.iter().sum(), 0.0);
        group.gather_to_first(&ws.local_logits, &counts, &mut ws.gathered)?;
        if group.rank() != 0 {
            return Ok(ForwardOutput::SentToFirst);
        }
        let mut at = 0;
        let mut column = slice.vocab_counts[0];
        for &count in &slice.vocab_counts[1..] {
            for r in 0..wanted {
                let from = &ws.gathered[at + r * count..at + (r + 1) * count];
                ws.logits[r * vocab + column..r * vocab + column + count].copy_from_slice(from);
            }
            at += count * wanted;
            column += count;
        }
        cap_logits(&mut ws.logits[..wanted * vocab], cfg.variant.final_softcap);
        Ok(ForwardOutput::Logits(&ws.logits[..wanted * vocab]))
    }

    /// A tensor rank's head for [`RowOutput::BestTokens`]: each rank takes
    /// the best of its rows of the vocabulary for every row, and rank 0
    /// combines them (the softcap, elementwise, is applied first on each
    /// rank as it would be on the whole row).
    pub(super) fn tensor_best_tokens<'w>(
        slice: &TensorSlice,
        cfg: &ModelConfig,
        wanted: usize,
        ws: &'w mut Workspace,
        pool: &ThreadPool,
        group: &mut dyn Group,
    ) -> Result<ForwardOutput<'w>, ForwardError> {
        let (rank, size) = (group.rank(), group.size());
        let local = slice.head.rows();
        let normed = &ws.normed[..wanted * cfg.hidden];
        ws.local_logits.resize(wanted * local, 0.0);
        slice
            .head
            .matmul(&mut ws.acts, wanted, normed, &mut ws.local_logits, pool)?;
        cap_logits(&mut ws.local_logits, cfg.variant.final_softcap);
        let first_id: usize = slice.vocab_counts[..rank].iter().sum();
        let words = BestToken::WORDS;
        let block = wanted * words;
        ws.local_best.resize(block, 0.0);
        let rows = ws.local_logits.chunks_exact(local);
        for (row, out) in rows.zip(ws.local_best.chunks_exact_mut(words)) {
            out.copy_from_slice(&BestToken::of(row, first_id as u32).to_words());
        }
        // Rank 0 keeps its own; the others' come in rank order.
        let mut counts = vec![block; size];
        counts[0] = 0;
        let sent = if rank == 0 {
            &[][..]
        } else {
            &ws.local_best[..]
        };
        ws.gathered.resize((size - 1) * block, 0.0);
        group.gather_to_first(sent, &counts, &mut ws.gathered)?;
        if rank != 0 {
            return Ok(ForwardOutput::SentToFirst);
        }
        ws.best.clear();
        for row in 0..wanted {
            let at = row * words;
            let of_rank = |r: usize| {
                let words = match r {
                    0 => &ws.local_best[at..at + words],
                    r => &ws.gathered[(r - 1) * block + at..][..words],
                };
                BestToken::from_words([words[0], words[1], words[2]])
            };
            ws.best
                .tokens
                .extend(BestToken::combine((0..size).map(of_rank)));
        }
        if let Some(bad) = ws
            .best
            .tokens
            .iter()
            .find(|b| b.token as usize >= cfg.vocab)
        {
            let message = format!(
                "a best token {} of a vocabulary of {}",
                bad.token, cfg.vocab
            );
            return Err(CollectiveError::Invalid(message).into());
        }
        Ok(ForwardOutput::Best(ws.best.view()))
    }
}

pub(super) fn cap_logits(logits: &mut [f32], cap: Option<f32>) {
    if let Some(cap) = cap {
        ops::softcap(logits, cap);
    }
}
