//! How fast this machine reads weights in a decode step, on the CPU or a
//! GPU: a matrix-vector product over a Q4_0 matrix larger than any cache,
//! as a decode step is one over every weight. Placement splits a pipeline's
//! layers in proportion to it, so a GPU node takes more than a CPU one.

use std::sync::Arc;
use std::time::Instant;

use crate::gpu::matvec::Format;
use crate::gpu::{DeviceChoice, Gpu, GpuError};
use crate::quant::{self, Activations, QMatrix, WeightFormat};
use crate::threadpool::ThreadPool;

/// The measured matrix: 8192 x 4096 Q4_0, 18 MiB (beyond the caches of the
/// machines people cluster).
const ROWS: usize = 8192;
const COLS: usize = 4096;
/// Timed products; the fastest counts. It is the machine's speed: other
/// work on a busy machine (nodes started together measure at once) only
/// ever slows a run, and a skewed speed skews every pipeline split.
const RUNS: usize = 12;

/// Bytes of weights a decode step reads per second on `device` (`auto`:
/// the GPU it would take for a model, else the CPU), with `threads`
/// threads on the CPU.
pub fn decode_bytes_per_second(device: DeviceChoice, threads: usize) -> Result<u64, GpuError> {
    let bytes = matrix_bytes();
    let index = match device {
        DeviceChoice::Cpu => return Ok(on_cpu(&bytes, threads)),
        DeviceChoice::Gpu(index) => index,
        DeviceChoice::Auto => match crate::gpu::adapter_for(bytes.len() as u64) {
            Some(index) => Some(index),
            None => return Ok(on_cpu(&bytes, threads)),
        },
    };
    on_gpu(&Arc::new(Gpu::open(index)?), &bytes)
}

/// Q4_0 blocks with a scale of 1/64 (f16 0x2400) and varied nibbles.
fn matrix_bytes() -> Vec<u8> {
    let blocks = ROWS * COLS / 32;
    let mut bytes = Vec::with_capacity(blocks * 18);
    for block in 0..blocks {
        bytes.extend_from_slice(&0x2400u16.to_le_bytes());
        bytes.extend((0..16).map(|j| ((block * 7 + j * 13) % 256) as u8));
    }
    bytes
}

fn fastest(seconds: &[f64]) -> f64 {
    seconds
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min)
        .max(1e-9)
}

fn on_cpu(bytes: &[u8], threads: usize) -> u64 {
    let Ok(matrix) = QMatrix::from_bytes(WeightFormat::Q4_0, ROWS, COLS, bytes.to_vec()) else {
        return 0;
    };
    let pool = ThreadPool::new(threads.max(1));
    let x: Vec<f32> = (0..COLS).map(|i| (i % 17) as f32 / 17.0 - 0.5).collect();
    let mut acts = Activations::default();
    let mut out = vec![0.0f32; ROWS];
    let mut seconds = Vec::with_capacity(RUNS);
    for run in 0..=RUNS {
        acts.set(&x, 1, COLS);
        let started = Instant::now();
        quant::matmul(&matrix, &mut acts, &mut out, &pool);
        if run > 0 {
            seconds.push(started.elapsed().as_secs_f64());
        }
    }
    (bytes.len() as f64 / fastest(&seconds)) as u64
}

fn on_gpu(gpu: &Gpu, bytes: &[u8]) -> Result<u64, GpuError> {
    let matrix = gpu.upload_blocks(Format::Q4_0, bytes, ROWS, COLS)?;
    let x: Vec<f32> = (0..COLS).map(|i| (i % 17) as f32 / 17.0 - 0.5).collect();
    let mut seconds = Vec::with_capacity(RUNS);
    for run in 0..=RUNS {
        let started = Instant::now();
        gpu.matvec(&matrix, &x)?;
        if run > 0 {
            seconds.push(started.elapsed().as_secs_f64());
        }
    }
    Ok((bytes.len() as f64 / fastest(&seconds)) as u64)
}
