//! Gated DeltaNet on the GPU (`deltanet.wgsl`): the causal convolution,
//! the unit-length q and k heads, the gates, and the delta rule over each
//! sequence's state in a [`super::GpuKv`]'s state slots. The projections
//! around them are ordinary matrix products.

use super::error::GpuError;
use super::kernels::Kernel;
use super::ops::{check, word};
use super::step::{grid_for_values, params, GpuBuffer, Step};

/// A linear-attention layer's sizes.
#[derive(Clone, Copy, Debug)]
pub struct LinearShape {
    pub key_heads: usize,
    pub key_dim: usize,
    pub value_heads: usize,
    pub value_dim: usize,
    /// Taps of the convolution.
    pub kernel: usize,
    /// Value heads per key head when value head j reads key head
    /// `j / per_key` (grouped), `None` when it reads `j % key_heads`.
    pub grouped: Option<usize>,
}

impl LinearShape {
    pub fn qk_width(&self) -> usize {
        self.key_heads * self.key_dim
    }

    pub fn v_width(&self) -> usize {
        self.value_heads * self.value_dim
    }

    pub fn channels(&self) -> usize {
        2 * self.qk_width() + self.v_width()
    }

    /// Floats of the convolution's history in a sequence's state.
    pub fn conv_floats(&self) -> usize {
        (self.kernel - 1) * self.channels()
    }
}

/// The most taps the convolution kernel holds (`MOST_TAPS`).
pub const MOST_TAPS: usize = 8;

/// Where a layer's state sits: the floats of a slot, and this layer's
/// offset in one.
#[derive(Clone, Copy, Debug)]
pub struct StateAt {
    pub slot_floats: usize,
    pub offset: usize,
}

/// One of q, k and v for the convolution: its buffer (`tokens x width`)
/// and its first channel among q, k and v.
#[derive(Clone, Copy)]
pub struct Section<'a> {
    pub values: &'a GpuBuffer,
    pub width: usize,
    pub first_channel: usize,
}

impl Step<'_> {
    /// The causal convolution and silu over one section, for `spans`
    /// spans (`spans`: four words each, see `deltanet.wgsl`), carrying the
    /// history in `states`.
    pub fn linear_conv(
        &mut self,
        section: Section<'_>,
        [taps, states, spans]: [&GpuBuffer; 3],
        [span_count, tokens]: [usize; 2],
        (shape, at): (LinearShape, StateAt),
    ) -> Result<(), GpuError> {
        if shape.kernel == 0 || shape.kernel > MOST_TAPS {
            return Err(GpuError::Unsupported(format!(
                "a convolution of {} taps (at most {MOST_TAPS})",
                shape.kernel
            )));
        }
        check("conv values", section.values, tokens * section.width)?;
        check("conv taps", taps, shape.channels() * shape.kernel)?;
        check("conv spans", spans, 4 * span_count)?;
        check("conv states", states, at.slot_floats)?;
        let values = [
            word(section.width)?,
            word(section.first_channel)?,
            word(shape.channels())?,
            word(shape.kernel)?,
            word(at.slot_floats)?,
            word(at.offset)?,
            word(span_count)?,
        ];
        let shape = params(&[&[0u32][..], &values[..]].concat());
        let buffers = [Some(section.values), Some(taps), Some(states), Some(spans)];
        let grid = grid_for_values(span_count * section.width);
        self.record(Kernel::Conv, shape, &buffers, grid);
        Ok(())
    }

    /// Each of `heads` heads of `width` values in `x` to unit length
    /// (`eps` under the root), then times `scale`.
    pub fn l2_heads(
        &mut self,
        x: &GpuBuffer,
        [heads, width]: [usize; 2],
        eps: f32,
        scale: f32,
    ) -> Result<(), GpuError> {
        check("l2 heads", x, heads * width)?;
        let shape = params(&[word(heads)?, word(width)?, eps.to_bits(), scale.to_bits()]);
        self.record(Kernel::L2Heads, shape, &[Some(x)], grid_for_values(heads));
        Ok(())
    }

    /// Each (token, value head)'s beta and decay into `out` (two words),
    /// from the rows of b's and a's products (`row_width` wide; one buffer
    /// twice where they are one product) and `head_gates` (four words a
    /// head: b's and a's places in a row, A, dt).
    pub fn linear_gates(
        &mut self,
        [beta_rows, alpha_rows, head_gates, out]: [&GpuBuffer; 4],
        [tokens, heads, row_width]: [usize; 3],
    ) -> Result<(), GpuError> {
        check("b rows", beta_rows, tokens * row_width)?;
        check("a rows", alpha_rows, tokens * row_width)?;
        check("head gates", head_gates, 4 * heads)?;
        check("gates", out, 2 * tokens * heads)?;
        let shape = params(&[word(tokens * heads)?, word(heads)?, word(row_width)?]);
        let buffers = [beta_rows, alpha_rows, head_gates, out].map(Some);
        self.record(
            Kernel::Gates,
            shape,
            &buffers,
            grid_for_values(tokens * heads),
        );
        Ok(())
    }

    /// The delta rule over each span's tokens, every value head, from its
    /// state in `states` (this layer's S at `at.offset` of each slot),
    /// reading q, k, v and the gates, into `out` (`tokens x value width`).
    pub fn delta_rule(
        &mut self,
        [q, k, v, gates, states, spans, out]: [&GpuBuffer; 7],
        [span_count, tokens]: [usize; 2],
        (shape, at): (LinearShape, StateAt),
    ) -> Result<(), GpuError> {
        check("delta q", q, tokens * shape.qk_width())?;
        check("delta k", k, tokens * shape.qk_width())?;
        check("delta v", v, tokens * shape.v_width())?;
        check("delta gates", gates, 2 * tokens * shape.value_heads)?;
        check("delta spans", spans, 4 * span_count)?;
        check("delta out", out, tokens * shape.v_width())?;
        check("delta states", states, at.slot_floats)?;
        let shape_words = params(&[
            0,
            word(shape.value_heads)?,
            word(shape.key_dim)?,
            word(shape.value_dim)?,
            word(shape.key_heads)?,
            word(at.slot_floats)?,
            word(at.offset)?,
            word(shape.grouped.unwrap_or(0))?,
        ]);
        let buffers = [q, k, v, gates, states, spans, out].map(Some);
        let grid = [word(shape.value_heads)?, word(span_count)?, 1];
        self.record(Kernel::Recur, shape_words, &buffers, grid);
        Ok(())
    }
}
