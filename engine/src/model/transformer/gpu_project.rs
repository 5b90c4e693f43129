//! A matrix product step shared by the GPU's forward pass and a tensor
//! rank's gathers: the input rounded to the 8-bit blocks the matrices'
//! formats take, once, then each product.

use crate::gpu::matvec::{GpuMatrix, Input, InputKind};
use crate::gpu::{GpuBuffer, GpuError, Step};

/// Each matrix of `products` times the `n` rows of `cols` in `x`, into its
/// output; `xq` and `xqk` take x's 8-bit blocks (of 32, of 256) once for
/// those that read them.
pub(super) fn project(
    step: &mut Step<'_>,
    [x, xq, xqk]: [&GpuBuffer; 3],
    cols: usize,
    n: usize,
    products: &[(&GpuMatrix, &GpuBuffer)],
) -> Result<(), GpuError> {
    let takes = |kind| products.iter().any(|(m, _)| m.format.input() == kind);
    if takes(InputKind::Q8) {
        step.quantize_q8(x, xq, n, cols)?;
    }
    if takes(InputKind::Q8K) {
        step.quantize_q8k(x, xqk, n, cols)?;
    }
    for (matrix, y) in products {
        let input = match matrix.format.input() {
            InputKind::F32 => Input::F32(x),
            InputKind::Q8 => Input::Q8(xq),
            InputKind::Q8K => Input::Q8K(xqk),
        };
        step.matmul(matrix, input, y, n)?;
    }
    Ok(())
}
