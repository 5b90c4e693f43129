//! How tensor-parallel ranks put whole rows back together, so that they
//! compute exactly what one machine computes.
//!
//! A matrix whose input is split across ranks (attention's output
//! projection over the heads, the MLP's down projection over its
//! intermediate rows) could be run by columns, each rank multiplying its
//! slice and the partial sums added up. That reorders each dot product's
//! sum, and the next layer's 8-bit (or f16) rounding of its input turns
//! those last bits into tenths of a logprob a few layers on. Instead the
//! ranks gather the input's slices into whole rows (each rank quantizes
//! the same row one machine does) and split the matrix by its output
//! rows: every output value is one machine's dot product, bit for bit,
//! and one more gather puts the output rows together.

use std::ops::Range;

use super::weights::Matrix;
use crate::dist::collectives::{CollectiveError, Group};
use crate::quant::Activations;
use crate::threadpool::ThreadPool;

/// The threads a product runs on, and the rank's peers (a tensor split's
/// other ranks; `SingleRank` alone).
pub struct Ranks<'a> {
    pub pool: &'a ThreadPool,
    pub group: &'a mut dyn Group,
}

/// `n` rows in, and where the `n` rows out go.
pub struct Rows<'a> {
    pub n: usize,
    pub input: &'a [f32],
    pub out: &'a mut [f32],
}

/// Which columns of a row of `width` values each rank holds: per rank,
/// its runs of consecutive columns in the order its local rows keep them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColumnSplit {
    width: usize,
    runs: Vec<Vec<Range<usize>>>,
}

impl ColumnSplit {
    /// Rank `r` holds the one run `parts[r]`, scaled by `unit` (a head's
    /// width, say).
    pub fn contiguous(parts: &[Range<usize>], unit: usize) -> Self {
        Self::from_runs(
            parts
                .iter()
                .map(|p| std::iter::once(p.start * unit..p.end * unit).collect())
                .collect(),
        )
    }

    /// Each rank's runs (every column held by exactly one rank).
    pub fn from_runs(runs: Vec<Vec<Range<usize>>>) -> Self {
        let width = runs.iter().flatten().map(|r| r.len()).sum();
        Self { width, runs }
    }

    /// Values of a whole row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Values of a row rank `rank` holds.
    pub fn own(&self, rank: usize) -> usize {
        self.runs
            .get(rank)
            .map_or(0, |runs| runs.iter().map(|r| r.len()).sum())
    }

    /// The one run rank `rank` holds, where it holds one.
    pub fn range(&self, rank: usize) -> Option<Range<usize>> {
        match self.runs.get(rank).map(Vec::as_slice) {
            Some([run]) => Some(run.clone()),
            _ => None,
        }
    }

    /// Whole rows (`rows x width`, into `out`) from every rank's local
    /// block (`rows x own`): one all-gather into `scratch`, then each
    /// rank's values put in their columns.
    pub fn gather(
        &self,
        group: &mut dyn Group,
        rows: usize,
        local: &[f32],
        scratch: &mut Vec<f32>,
        out: &mut [f32],
    ) -> Result<(), CollectiveError> {
        let counts: Vec<usize> = (0..self.runs.len()).map(|r| self.own(r) * rows).collect();
        let total: usize = counts.iter().sum();
        if out.len() != rows * self.width || counts.len() != group.size() {
            return Err(CollectiveError::Invalid(format!(
                "gather of {rows} rows of {} over {} ranks into {} values in a group of {}",
                self.width,
                counts.len(),
                out.len(),
                group.size()
            )));
        }
        if scratch.len() < total {
            scratch.resize(total, 0.0);
        }
        group.all_gather(local, &counts, &mut scratch[..total])?;
        self.place(rows, &scratch[..total], out);
        Ok(())
    }

    /// Puts the gathered blocks (rank after rank, each `rows x own`) into
    /// whole rows.
    fn place(&self, rows: usize, gathered: &[f32], out: &mut [f32]) {
        let mut at = 0;
        for (rank, runs) in self.runs.iter().enumerate() {
            let own = self.own(rank);
            let block = &gathered[at..at + rows * own];
            for (row, values) in block.chunks_exact(own.max(1)).take(rows).enumerate() {
                let whole = &mut out[row * self.width..(row + 1) * self.width];
                let mut from = 0;
                for run in runs {
                    whole[run.clone()].copy_from_slice(&values[from..from + run.len()]);
                    from += run.len();
                }
            }
            at += rows * own;
        }
    }
}

/// Buffers of the gathers, grown to the largest step seen and reused.
#[derive(Default)]
pub struct GatherBuffers {
    /// Whole input rows.
    pub whole: Vec<f32>,
    /// This rank's columns of the output rows.
    pub part: Vec<f32>,
    /// What the all-gathers receive, before it is put in place.
    pub scratch: Vec<f32>,
}

/// `v[..len]`, grown first if it is shorter.
pub fn grown(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if v.len() < len {
        v.resize(len, 0.0);
    }
    &mut v[..len]
}

impl GatherBuffers {
    /// A matrix split by output rows over an input split by columns:
    /// every rank's `local` (`rows x input.own`) gathered into whole rows,
    /// `matmul` of them into this rank's output columns, and those gathered
    /// into `out` (`rows x output.width`).
    pub fn split_rows<E: From<CollectiveError>>(
        &mut self,
        group: &mut dyn Group,
        (input, output): (&ColumnSplit, &ColumnSplit),
        Rows {
            n: rows,
            input: local,
            out,
        }: Rows<'_>,
        matmul: impl FnOnce(&[f32], &mut [f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        let whole = grown(&mut self.whole, rows * input.width());
        input.gather(group, rows, local, &mut self.scratch, whole)?;
        let part = grown(&mut self.part, rows * output.own(group.rank()));
        matmul(whole, part)?;
        output.gather(group, rows, part, &mut self.scratch, out)?;
        Ok(())
    }
}

/// `out` (`n` whole rows) = `w` over the `n` rows of `local`: on one
/// machine directly; on a tensor rank (`splits`: how the input's columns
/// and the output's rows are split) over whole input rows gathered from
/// every rank, this rank computing its output rows and gathering the
/// others'.
pub fn project<E: From<CollectiveError> + From<candle_core::Error>>(
    w: &Matrix,
    splits: Option<(&ColumnSplit, &ColumnSplit)>,
    rows: Rows<'_>,
    acts: &mut Activations,
    gathers: &mut GatherBuffers,
    ranks: &mut Ranks<'_>,
) -> Result<(), E> {
    let (n, pool) = (rows.n, ranks.pool);
    let Some((input, output)) = splits else {
        let Rows {
            input: local, out, ..
        } = rows;
        acts.set(local, n, local.len() / n.max(1));
        return Ok(w.matmul(acts, n, local, out, pool)?);
    };
    gathers.split_rows(&mut *ranks.group, (input, output), rows, |whole, part| {
        acts.set(whole, n, input.width());
        Ok::<_, E>(w.matmul(acts, n, whole, part, pool)?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::collectives::SingleRank;

    #[test]
    fn blocks_go_back_to_their_columns() {
        // Rank 0 holds columns 0..2 and 5..6, rank 1 columns 2..5.
        let split = ColumnSplit::from_runs(vec![vec![0..2, 5..6], vec![2..5]]);
        assert_eq!((split.width(), split.own(0), split.own(1)), (6, 3, 3));
        assert_eq!(split.range(1), Some(2..5));
        assert_eq!(split.range(0), None);
        // Two rows: rank 0's block, then rank 1's.
        let gathered = [0., 1., 5., 10., 11., 15., 2., 3., 4., 12., 13., 14.];
        let mut out = [0.0; 12];
        split.place(2, &gathered, &mut out);
        let expected = [0., 1., 2., 3., 4., 5., 10., 11., 12., 13., 14., 15.];
        assert_eq!(out, expected);
    }

    #[test]
    fn a_single_rank_gathers_its_own_rows() -> Result<(), CollectiveError> {
        let whole = std::iter::once(0..2).collect::<Vec<_>>();
        let split = ColumnSplit::contiguous(&whole, 3);
        let local: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let (mut scratch, mut out) = (Vec::new(), vec![0.0; 12]);
        split.gather(&mut SingleRank, 2, &local, &mut scratch, &mut out)?;
        assert_eq!(out, local);
        // A split for another group size is refused, not misread.
        let two = ColumnSplit::contiguous(&[0..1, 1..2], 6);
        assert!(two
            .gather(&mut SingleRank, 2, &local, &mut scratch, &mut out)
            .is_err());
        Ok(())
    }
}
