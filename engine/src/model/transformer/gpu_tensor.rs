//! A tensor-parallel rank on the GPU. Its layers run there as on one
//! machine, except at the gathers (see [`crate::model::gather`]): before
//! each output projection the step so far is run and its slice of the
//! projection's input read back, the ranks' slices are gathered on the
//! CPU over the ring, the whole rows go back to the GPU, and a new step
//! records on; the same again for the projection's output rows. Four
//! round trips a layer, each a few rows of activations: every output value
//! is still one machine's dot product.

use crate::dist::collectives::Group;
use crate::gpu::{GpuBuffer, Step};
use crate::model::gather::{grown, ColumnSplit, GatherBuffers};

use super::gpu_scratch::GpuScratch;
use super::io::ForwardError;
use super::split::TensorLayout;
use crate::gpu::matvec::GpuMatrix;

/// A tensor rank's peers and how their slices make whole rows.
pub(super) struct TensorRanks<'a> {
    pub layout: &'a TensorLayout,
    pub group: &'a mut dyn Group,
    pub gathers: &'a mut GatherBuffers,
}

/// Which input an output projection reads.
#[derive(Clone, Copy)]
pub(super) enum Projected {
    Attention,
    Mlp,
}

impl TensorRanks<'_> {
    /// Runs the step so far, gathers every rank's slice of `rows` rows
    /// (this rank's in `local`) into whole rows in `whole`, and starts a
    /// new step after.
    fn gather(
        &mut self,
        step: &mut Step<'_>,
        [local, whole]: [&GpuBuffer; 2],
        split: &ColumnSplit,
        rows: usize,
    ) -> Result<(), ForwardError> {
        let gpu = step.gpu();
        let done = std::mem::replace(step, gpu.step());
        let own = rows * split.own(self.group.rank());
        let values = done.read(local, own)?;
        let local_values = values.get(..own).unwrap_or_default();
        let out = grown(&mut self.gathers.whole, rows * split.width());
        split.gather(
            &mut *self.group,
            rows,
            local_values,
            &mut self.gathers.scratch,
            out,
        )?;
        gpu.write(whole, bytemuck::cast_slice(out));
        Ok(())
    }

    /// `s.proj` = `w` over the `n` whole rows of the attention's output or
    /// the MLP's activations, whose local slice is in `local`: gathered
    /// whole, this rank's output rows computed, and those gathered whole.
    pub(super) fn project(
        &mut self,
        step: &mut Step<'_>,
        (w, local, input): (&GpuMatrix, &GpuBuffer, Projected),
        s: &GpuScratch,
        n: usize,
    ) -> Result<(), ForwardError> {
        let layout = self.layout;
        let split = match input {
            Projected::Attention => &layout.attention,
            Projected::Mlp => &layout.ffn,
        };
        self.gather(step, [local, &s.tensor_whole], split, n)?;
        let products = [(w, &s.tensor_part)];
        let x = [&s.tensor_whole, &s.xq, &s.xqk];
        super::gpu_project::project(step, x, split.width(), n, &products)?;
        self.gather(step, [&s.tensor_part, &s.proj], &layout.hidden, n)
    }
}
