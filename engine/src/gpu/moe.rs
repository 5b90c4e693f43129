//! A mixture of experts on the GPU (`moe.wgsl`): each token's experts
//! chosen from its router logits, and their outputs' weighted sum. The
//! experts' products between them are [`Step::matmul_routed`].

use super::error::GpuError;
use super::kernels::Kernel;
use super::ops::{check, word};
use super::step::{grid_for_values, grid_of, params, GpuBuffer, Step};

/// How a layer chooses its experts.
#[derive(Clone, Copy, Debug)]
pub struct Routing {
    pub tokens: usize,
    pub experts: usize,
    pub per_token: usize,
    /// Whether the chosen experts' weights are renormalised to sum to one.
    pub normalize: bool,
}

impl Step<'_> {
    /// Each token's `per_token` experts from its row of `logits` (`tokens x
    /// experts`, softmaxed in place) into `routes`: two words per (token,
    /// slot), the expert and its weight, as the CPU's `model::moe::route`
    /// chooses them.
    pub fn route_experts(
        &mut self,
        [logits, routes]: [&GpuBuffer; 2],
        routing: Routing,
    ) -> Result<(), GpuError> {
        let Routing {
            tokens,
            experts,
            per_token,
            normalize,
        } = routing;
        if per_token == 0 || per_token > experts {
            return Err(GpuError::Shape(format!(
                "{per_token} of {experts} experts a token"
            )));
        }
        check("router logits", logits, tokens * experts)?;
        check("routes", routes, 2 * tokens * per_token)?;
        let shape = params(&[
            word(tokens)?,
            word(experts)?,
            word(per_token)?,
            u32::from(normalize),
        ]);
        let buffers = [Some(logits), Some(routes)];
        let grid = grid_for_values(tokens);
        self.record(Kernel::RouteExperts, shape, &buffers, grid);
        Ok(())
    }

    /// `out` (`tokens x width`) = each token's expert rows of `rows`
    /// (`tokens x per_token` rows of `width`), weighted by `routes` and
    /// added in slot order.
    pub fn sum_experts(
        &mut self,
        [rows, routes, out]: [&GpuBuffer; 3],
        [tokens, per_token, width]: [usize; 3],
    ) -> Result<(), GpuError> {
        check("expert rows", rows, tokens * per_token * width)?;
        check("routes", routes, 2 * tokens * per_token)?;
        check("experts' sum", out, tokens * width)?;
        let shape = params(&[word(tokens)?, word(width)?, word(per_token)?]);
        let buffers = [Some(rows), Some(routes), Some(out)];
        let grid = grid_for_values(tokens * width);
        self.record(Kernel::SumExperts, shape, &buffers, grid);
        Ok(())
    }

    /// `out` (`tokens x width`) += sigmoid(x[t] . gate) rows[t]: a shared
    /// expert's output `rows` scaled by its gate over the block's input.
    pub fn add_shared_expert(
        &mut self,
        [rows, x, gate, out]: [&GpuBuffer; 4],
        tokens: usize,
        width: usize,
    ) -> Result<(), GpuError> {
        check("shared expert rows", rows, tokens * width)?;
        check("shared expert input", x, tokens * width)?;
        check("shared expert gate", gate, width)?;
        check("shared expert sum", out, tokens * width)?;
        let shape = params(&[word(tokens)?, word(width)?]);
        let buffers = [Some(rows), None, Some(out), Some(x), Some(gate)];
        self.record(Kernel::AddShared, shape, &buffers, grid_of(tokens, 1));
        Ok(())
    }
}
