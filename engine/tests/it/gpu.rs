//! The GPU kernels against an exact (f64) reference or the CPU's kernels,
//! and the default model on the GPU against llama.cpp's golden set and
//! itself under batching, on whatever adapter the machine has: Mesa's
//! lavapipe in CI (which `scripts/test` installs, setting
//! `TESSERA_REQUIRE_GPU`, so a missing adapter fails there), a real card
//! elsewhere. Without an adapter and outside `scripts/test`, each test
//! says it did not run.
//!
//! Tolerance of the products: the GPU sums in f32, in its own order. For a
//! row the error is within `cols * eps32 * sum |w x|` (a sum's worst
//! case); the tests hold it to `4 * eps32 * sqrt(cols) * sum |w x| +
//! 1e-30`, which a random-order f32 sum of these sizes meets by a wide
//! margin and a wrong value (a missed block, a swapped scale) misses by
//! orders of magnitude. The block formats take 8-bit activations, as the
//! CPU does, so they are held to the CPU kernel's result, not the exact
//! product: their integer block sums are the same.

use rand::{Rng, SeedableRng};
use std::sync::Arc;
use tessera_engine::gpu::matvec::Format;
use tessera_engine::gpu::ops::{Elementwise, RopeShape};
use tessera_engine::logits::{collect_best, BestToken, TOP_CANDIDATES};
use tessera_engine::model::moe::{route, Route};
use tessera_engine::ops::{self, RopeStyle};
use tessera_engine::quant::{self, Activations, QMatrix, WeightFormat};
use tessera_engine::threadpool::ThreadPool;

use std::ops::ControlFlow;
use tessera_engine::gpu::{self, Gpu};
use tessera_engine::model::Transformer;
use tessera_engine::serve::executor::Executor;
use tessera_engine::serve::sampler::SamplingParams;
use tessera_engine::serve::{GenerateRequest, LoadedModel, Prompt, Session};

use super::distributed::{greedy_with_margins, on_prepared_ranks, Sharding};

fn gpu_for(test: &str) -> Option<Gpu> {
    if gpu::adapters().is_empty() {
        assert!(
            std::env::var_os("TESSERA_REQUIRE_GPU").is_none(),
            "{test}: scripts/test installed Mesa's Vulkan drivers, yet this machine has no GPU adapter"
        );
        tessera_testkit::not_run_here(test, "no GPU adapter on this machine");
        return None;
    }
    Some(Gpu::open(None).expect("the adapter opens"))
}

/// Checks `got` against `rows` of f64 sums; `scale[r]` is row r's sum of
/// |w x|, which bounds its rounding.
fn check(got: &[f32], exact: &[f64], scale: &[f64], cols: usize, what: &str) {
    assert_eq!(got.len(), exact.len(), "{what}");
    let eps = f64::from(f32::EPSILON);
    for (row, ((g, e), s)) in got.iter().zip(exact).zip(scale).enumerate() {
        let bound = 4.0 * eps * (cols as f64).sqrt() * s + 1e-30;
        assert!(
            (f64::from(*g) - e).abs() <= bound,
            "{what}, row {row}: {g} against {e} (bound {bound})"
        );
    }
}

#[test]
fn adapters_are_listed_with_what_they_can_do() {
    let Some(gpu) = gpu_for("adapters_are_listed_with_what_they_can_do") else {
        return;
    };
    let all = gpu::adapters();
    assert!(all.iter().any(|a| a.name == gpu.report.name));
    for adapter in &all {
        assert!(!adapter.name.is_empty());
        eprintln!(
            "adapter {}: {} ({}, {}) f16 {} subgroups {} timestamps {}",
            adapter.index,
            adapter.name,
            adapter.backend,
            adapter.kind.name(),
            adapter.shader_f16,
            adapter.subgroups,
            adapter.timestamps
        );
    }
    assert!(matches!(
        Gpu::open(Some(all.len())),
        Err(gpu::GpuError::NoSuchAdapter { .. })
    ));
}

#[test]
fn an_f32_matrix_times_a_vector_is_the_exact_product() {
    let Some(gpu) = gpu_for("an_f32_matrix_times_a_vector_is_the_exact_product") else {
        return;
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    // Awkward sizes: one row, fewer columns than threads, neither a
    // multiple of the workgroup.
    for (rows, cols) in [(1, 1), (7, 3), (65, 100), (300, 1000), (129, 64)] {
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let matrix = gpu.upload_f32(&w, rows, cols).expect("uploads");
        let got = gpu.matvec(&matrix, &x).expect("runs");
        let (exact, scale) = exact_products(&w, &x, cols);
        check(&got, &exact, &scale, cols, &format!("f32 {rows} x {cols}"));
    }
}

#[test]
fn f16_and_bf16_matrices_times_vectors_are_the_exact_products() {
    let Some(gpu) = gpu_for("f16_and_bf16_matrices_times_vectors_are_the_exact_products") else {
        return;
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(6);
    for (rows, cols) in [(1, 2), (7, 6), (65, 100), (300, 1000)] {
        let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let values: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let halves: Vec<half::f16> = values.iter().map(|v| half::f16::from_f32(*v)).collect();
        let brains: Vec<half::bf16> = values.iter().map(|v| half::bf16::from_f32(*v)).collect();
        let cases = [
            (
                Format::F16,
                bytemuck::cast_slice::<_, u8>(&halves).to_vec(),
                halves.iter().map(|v| v.to_f32()).collect::<Vec<_>>(),
            ),
            (
                Format::Bf16,
                bytemuck::cast_slice::<_, u8>(&brains).to_vec(),
                brains.iter().map(|v| v.to_f32()).collect(),
            ),
        ];
        for (format, bytes, w) in cases {
            let matrix = gpu
                .upload_blocks(format, &bytes, rows, cols)
                .expect("uploads");
            let got = gpu.matvec(&matrix, &x).expect("runs");
            let (exact, scale) = exact_products(&w, &x, cols);
            check(
                &got,
                &exact,
                &scale,
                cols,
                &format!("{format:?} {rows} x {cols}"),
            );
        }
    }
}

/// Each row of `w` (`cols` wide) dotted with `x` in f64, and its sum of
/// |w x|.
fn exact_products(w: &[f32], x: &[f32], cols: usize) -> (Vec<f64>, Vec<f64>) {
    w.chunks(cols)
        .map(|row| {
            let terms = row
                .iter()
                .zip(x)
                .map(|(a, b)| f64::from(*a) * f64::from(*b));
            (terms.clone().sum::<f64>(), terms.map(f64::abs).sum::<f64>())
        })
        .unzip()
}

/// The GPU formats of blocks and their CPU twins.
const BLOCK_FORMATS: [(Format, WeightFormat); 10] = [
    (Format::Q8_0, WeightFormat::Q8_0),
    (Format::Q4_0, WeightFormat::Q4_0),
    (Format::Q4_1, WeightFormat::Q4_1),
    (Format::Q5_0, WeightFormat::Q5_0),
    (Format::Q5_1, WeightFormat::Q5_1),
    (Format::Q4K, WeightFormat::Q4_K),
    (Format::Q5K, WeightFormat::Q5_K),
    (Format::Q6K, WeightFormat::Q6_K),
    (Format::Q2K, WeightFormat::Q2_K),
    (Format::Q3K, WeightFormat::Q3_K),
];

#[test]
fn block_matrices_times_vectors_are_the_cpu_kernels_products() {
    let Some(gpu) = gpu_for("block_matrices_times_vectors_are_the_cpu_kernels_products") else {
        return;
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    let pool = ThreadPool::new(1);
    for (format, cpu_format) in BLOCK_FORMATS {
        let block = cpu_format.block_values();
        // Rows of one block, of an odd number of blocks (blocks fall
        // across u32 words), more blocks than lanes, and several tokens.
        for (rows, blocks, tokens) in [(1, 1, 1), (5, 3, 3), (67, 18, 2), (200, 9, 5)] {
            let cols = blocks * block;
            let values: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let bytes = quant::quantize(cpu_format, &values);
            let x: Vec<f32> = (0..cols * tokens)
                .map(|_| rng.gen_range(-1.0..1.0))
                .collect();
            let matrix = gpu
                .upload_blocks(format, &bytes, rows, cols)
                .expect("uploads");
            let got = gpu.matmul(&matrix, &x, tokens).expect("runs");
            // The CPU kernel: the same 8-bit activations, the same integer
            // dot per block; only the order of the f32 sums differs.
            let cpu = QMatrix::from_bytes(cpu_format, rows, cols, bytes).expect("a matrix");
            let mut w = vec![0.0f32; rows * cols];
            for (r, row) in w.chunks_exact_mut(cols).enumerate() {
                cpu.dequantize_row(r, row);
            }
            let mut acts = Activations::default();
            acts.set(&x, tokens, cols);
            let mut want = vec![0.0f32; rows * tokens];
            quant::matmul(&cpu, &mut acts, &mut want, &pool);
            let scale: Vec<f64> = (0..tokens)
                .flat_map(|t| exact_products(&w, &x[t * cols..(t + 1) * cols], cols).1)
                .collect();
            let want: Vec<f64> = want.iter().map(|v| f64::from(*v)).collect();
            check(
                &got,
                &want,
                &scale,
                cols,
                &format!("{format:?} {rows} x {cols}, {tokens} tokens"),
            );
        }
    }
}

/// The matrix products add a row's lanes across a subgroup where the
/// adapter has subgroups of 8 or more (lavapipe does), else in workgroup
/// memory; and they take several token rows a block of W at a time (token
/// tiles), or one. Each way adds the same values in the same order, so
/// all four give the same bits, for every format, at a single token, a
/// whole tile, and two tiles and a part.
#[test]
fn every_way_of_compiling_the_products_gives_the_same_bits() {
    let name = "every_way_of_compiling_the_products_gives_the_same_bits";
    let Some(default) = gpu_for(name) else {
        return;
    };
    assert!(default.token_tiles, "token tiles are on by default");
    let mut ways = Vec::new();
    for subgroups in [true, false] {
        for token_tiles in [true, false] {
            let options = gpu::GpuOptions {
                subgroups,
                token_tiles,
            };
            let gpu = Gpu::open_with(None, options).expect("the adapter opens");
            assert_eq!(gpu.token_tiles, token_tiles);
            ways.push((options, gpu));
        }
    }
    if !default.subgroups {
        tessera_testkit::not_run_here(
            "every_way_of_compiling_the_products_gives_the_same_bits (subgroups)",
            "the adapter has no subgroups of 8 lanes or more",
        );
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(55);
    let mut formats = vec![
        (Format::F32, WeightFormat::F32),
        (Format::F16, WeightFormat::F16),
        // bf16: its bytes below.
        (Format::Bf16, WeightFormat::F32),
    ];
    formats.extend(BLOCK_FORMATS);
    for (format, cpu_format) in formats {
        for tokens in [1, 8, 19] {
            let (rows, cols) = (67, 2 * 256);
            let values: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let bytes = if format == Format::Bf16 {
                let brains: Vec<half::bf16> =
                    values.iter().map(|v| half::bf16::from_f32(*v)).collect();
                bytemuck::cast_slice::<_, u8>(&brains).to_vec()
            } else {
                quant::quantize(cpu_format, &values)
            };
            let x: Vec<f32> = (0..cols * tokens)
                .map(|_| rng.gen_range(-1.0..1.0))
                .collect();
            let product = |gpu: &Gpu| {
                let matrix = gpu
                    .upload_bytes(format, &bytes, rows, cols)
                    .expect("uploads");
                gpu.matmul(&matrix, &x, tokens).expect("runs")
            };
            let (first_way, first) = (ways[0].0, product(&ways[0].1));
            for (options, gpu) in &ways[1..] {
                let other = product(gpu);
                let same = first
                    .iter()
                    .zip(&other)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same && first.len() == other.len(),
                    "{format:?}, {tokens} tokens: {first_way:?} gives {:?}, {options:?} {:?}",
                    &first[..4],
                    &other[..4]
                );
            }
        }
    }
}

/// Routing: each token's experts are the CPU's `route`'s (ties to the
/// lower index), their weights its weights up to the softmax's sum (f32
/// here, f64 there: a relative 1e-6).
#[test]
fn experts_are_routed_as_the_cpu_routes_them() {
    let Some(gpu) = gpu_for("experts_are_routed_as_the_cpu_routes_them") else {
        return;
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    for (experts, per_token, normalize) in
        [(10, 3, true), (10, 3, false), (4, 4, true), (67, 8, true)]
    {
        let tokens = 9;
        let mut logits: Vec<f32> = (0..tokens * experts)
            .map(|_| rng.gen_range(-4.0..4.0))
            .collect();
        // A row of equal logits and one with a tie for the best.
        logits[..experts].fill(0.5);
        logits[experts] = 3.0;
        logits[experts + 2] = 3.0;
        let logits_gpu = gpu.buffer_with("logits", bytemuck::cast_slice(&logits));
        let routes = gpu.buffer("routes", (8 * tokens * per_token) as u64);
        let mut step = gpu.step();
        let routing = gpu::moe::Routing {
            tokens,
            experts,
            per_token,
            normalize,
        };
        step.route_experts([&logits_gpu, &routes], routing)
            .expect("routes");
        let got = step.read(&routes, 2 * tokens * per_token).expect("runs");
        for t in 0..tokens {
            let mut row = logits[t * experts..(t + 1) * experts].to_vec();
            let mut want = vec![Route::default(); per_token];
            route(&mut row, normalize, &mut want);
            for (slot, want) in want.iter().enumerate() {
                let at = 2 * (t * per_token + slot);
                let what = format!("{experts} experts, {per_token} a token, token {t} slot {slot}");
                assert_eq!(got[at].to_bits(), want.expert, "{what}");
                let weight = got[at + 1];
                assert!(
                    (weight - want.weight).abs() <= 1e-6 * want.weight.abs().max(1e-3),
                    "{what}: {weight} against {}",
                    want.weight
                );
            }
        }
    }
}

/// Routed products (every expert's matrix in one buffer, one product row
/// per token and expert) are each expert's CPU product of its token's
/// row, and the weighted sum adds them in the token's slot order.
#[test]
fn routed_expert_products_are_each_experts_cpu_product() {
    let Some(gpu) = gpu_for("routed_expert_products_are_each_experts_cpu_product") else {
        return;
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(34);
    let pool = ThreadPool::new(1);
    let (experts, rows, cols, tokens, per_token) = (5, 37, 256, 3, 2);
    for (format, cpu_format) in [
        (Format::F32, WeightFormat::F32),
        (Format::Q4_0, WeightFormat::Q4_0),
        (Format::Q4K, WeightFormat::Q4_K),
    ] {
        let matrices: Vec<Vec<u8>> = (0..experts)
            .map(|_| {
                let values: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
                quant::quantize(cpu_format, &values)
            })
            .collect();
        let parts: Vec<&[u8]> = matrices.iter().map(Vec::as_slice).collect();
        let stacked = gpu
            .upload_experts(format, &parts, rows, cols)
            .expect("uploads");
        let x: Vec<f32> = (0..tokens * cols)
            .map(|_| rng.gen_range(-1.0..1.0))
            .collect();
        // Token t's experts: 4 - t and t (a token may take expert 0 last).
        let chosen = |t: usize, slot: usize| if slot == 0 { 4 - t } else { t };
        let mut route_words = Vec::new();
        for t in 0..tokens {
            for slot in 0..per_token {
                route_words.extend([chosen(t, slot) as u32, 0.25f32.to_bits()]);
            }
        }
        let routes = gpu.buffer_with("routes", bytemuck::cast_slice(&route_words));
        let x_gpu = gpu.buffer_with("x", bytemuck::cast_slice(&x));
        let xq = gpu.buffer(
            "xq",
            (tokens * cols / 32 * 40 + tokens * cols / 256 * 324) as u64,
        );
        let y = gpu.buffer("y", (tokens * per_token * rows * 4) as u64);
        let mut step = gpu.step();
        let input = match format.input() {
            gpu::matvec::InputKind::F32 => gpu::matvec::Input::F32(&x_gpu),
            gpu::matvec::InputKind::Q8 => {
                step.quantize_q8(&x_gpu, &xq, tokens, cols).expect("q8");
                gpu::matvec::Input::Q8(&xq)
            }
            gpu::matvec::InputKind::Q8K => {
                step.quantize_q8k(&x_gpu, &xq, tokens, cols).expect("q8k");
                gpu::matvec::Input::Q8K(&xq)
            }
        };
        step.matmul_routed(
            &stacked,
            input,
            [&y, &routes],
            tokens * per_token,
            per_token,
        )
        .expect("records");
        let got = step.read(&y, tokens * per_token * rows).expect("runs");
        for t in 0..tokens {
            for slot in 0..per_token {
                let e = chosen(t, slot);
                let cpu = QMatrix::from_bytes(cpu_format, rows, cols, matrices[e].clone())
                    .expect("a matrix");
                let mut w = vec![0.0f32; rows * cols];
                for (r, row) in w.chunks_exact_mut(cols).enumerate() {
                    cpu.dequantize_row(r, row);
                }
                let token_x = &x[t * cols..(t + 1) * cols];
                let mut acts = Activations::default();
                acts.set(token_x, 1, cols);
                let mut want = vec![0.0f32; rows];
                quant::matmul(&cpu, &mut acts, &mut want, &pool);
                let scale = exact_products(&w, token_x, cols).1;
                let want: Vec<f64> = want.iter().map(|v| f64::from(*v)).collect();
                let row = (t * per_token + slot) * rows;
                check(
                    &got[row..row + rows],
                    &want,
                    &scale,
                    cols,
                    &format!("{format:?}, token {t}, expert {e}"),
                );
            }
        }
        // The weighted sum of each token's rows, in slot order.
        let out = gpu.buffer("sum", (tokens * rows * 4) as u64);
        let mut step = gpu.step();
        step.sum_experts([&y, &routes, &out], [tokens, per_token, rows])
            .expect("records");
        let sums = step.read(&out, tokens * rows).expect("runs");
        for t in 0..tokens {
            for r in 0..rows {
                let at = |slot: usize| got[(t * per_token + slot) * rows + r];
                let want = at(0) * 0.25 + at(1) * 0.25;
                assert!((sums[t * rows + r] - want).abs() <= 1e-6 * want.abs().max(1.0));
            }
        }
    }
}

#[test]
fn norms_rotations_and_activations_are_the_cpu_ops() {
    let Some(gpu) = gpu_for("norms_rotations_and_activations_are_the_cpu_ops") else {
        return;
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let mut random = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-2.0..2.0)).collect() };
    let upload = |v: &[f32]| gpu.buffer_with("test", bytemuck::cast_slice(v));
    for (rows, width) in [(1, 7), (3, 576), (2, 1000)] {
        let (x, w) = (random(rows * width), random(width));
        let out = gpu.buffer("out", (rows * width * 4) as u64);
        let mut step = gpu.step();
        step.rms_norm([&upload(&x), &upload(&w), &out], rows, width, 1e-5)
            .expect("records");
        let got = step.read(&out, rows * width).expect("runs");
        let mut want = vec![0.0; rows * width];
        ops::rms_norm(&x, &w, 1e-5, &mut want);
        close(&got, &want, 1e-5, &format!("rms_norm {rows} x {width}"));
    }
    for (halves, pairs, head_dim) in [
        (false, 32, 64),
        (true, 32, 64),
        (true, 12, 64),
        (false, 3, 10),
    ] {
        let (tokens, heads) = (3, 5);
        let x = random(tokens * heads * head_dim);
        let angles = random(tokens * pairs);
        let (cos, sin): (Vec<f32>, Vec<f32>) = angles.iter().map(|a| (a.cos(), a.sin())).unzip();
        let rotated = upload(&x);
        let mut step = gpu.step();
        let shape = RopeShape {
            tokens,
            heads,
            head_dim,
            pairs,
            halves,
        };
        step.rope([&rotated, &upload(&cos), &upload(&sin)], shape)
            .expect("records");
        let got = step.read(&rotated, x.len()).expect("runs");
        let mut want = x.clone();
        let style = if halves {
            RopeStyle::Halves
        } else {
            RopeStyle::Interleaved
        };
        for t in 0..tokens {
            let row = t * heads * head_dim..(t + 1) * heads * head_dim;
            let angles = t * pairs..(t + 1) * pairs;
            ops::apply_rope(
                &mut want[row],
                head_dim,
                style,
                &cos[angles.clone()],
                &sin[angles],
            );
        }
        close(
            &got,
            &want,
            1e-6,
            &format!("rope halves {halves}, {pairs} pairs of {head_dim}"),
        );
    }
    let count = 1000;
    let (gate, up) = (random(count), random(count));
    for (op, cpu) in [
        (
            Elementwise::SiluMul,
            ops::silu_mul as fn(&mut [f32], &[f32]),
        ),
        (Elementwise::GeluMul, ops::gelu_tanh_mul),
    ] {
        let a = upload(&gate);
        let mut step = gpu.step();
        step.elementwise(op, [&a, &upload(&up)], count, 0)
            .expect("records");
        let got = step.read(&a, count).expect("runs");
        let mut want = gate.clone();
        cpu(&mut want, &up);
        close(&got, &want, 1e-5, &format!("{op:?}"));
    }
}

#[test]
fn each_rows_best_token_is_the_cpus() {
    let Some(gpu) = gpu_for("each_rows_best_token_is_the_cpus") else {
        return;
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(10);
    for (rows, vocab, softcap) in [(1, 7, None), (3, 1000, None), (2, 49152, Some(30.0f32))] {
        let mut logits: Vec<f32> = (0..rows * vocab)
            .map(|_| rng.gen_range(-20.0..20.0))
            .collect();
        // A tie in the first row: the lower id wins, as on the CPU.
        let top = logits[..vocab].iter().copied().fold(f32::MIN, f32::max) + 1.0;
        logits[vocab - 1] = top;
        logits[vocab / 2] = top;
        let input = gpu.buffer_with("logits", bytemuck::cast_slice(&logits));
        let best = gpu.buffer("best", (3 * rows * 4) as u64);
        let mut step = gpu.step();
        step.best_of_rows([&input, &best], rows, vocab, softcap)
            .expect("records");
        let words = step.read(&best, 3 * rows).expect("runs");
        for (row, got) in words.chunks_exact(3).enumerate() {
            let got = BestToken::from_words([got[0], got[1], got[2]]);
            let mut row_logits = logits[row * vocab..(row + 1) * vocab].to_vec();
            if let Some(cap) = softcap {
                ops::softcap(&mut row_logits, cap);
            }
            let want = BestToken::of(&row_logits, 0);
            assert_eq!(got.token, want.token, "row {row} of {vocab}");
            close(
                &[got.logit, got.mass],
                &[want.logit, want.mass],
                1e-4,
                "best",
            );
        }
    }
}

#[test]
fn each_rows_top_candidates_are_the_cpus() {
    let Some(gpu) = gpu_for("each_rows_top_candidates_are_the_cpus") else {
        return;
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let cases = [
        (2, 5, None),
        (1, 7, None),
        (1, TOP_CANDIDATES, None),
        (3, 1000, None),
        (2, 49155, None),
        (2, 3000, Some(30.0f32)),
    ];
    for (rows, vocab, softcap) in cases {
        let mut logits: Vec<f32> = (0..rows * vocab)
            .map(|_| rng.gen_range(-20.0..20.0))
            .collect();
        if softcap.is_none() {
            awkward_row(&mut logits[..vocab], &mut rng);
        }
        let input = gpu.buffer_with("logits", bytemuck::cast_slice(&logits));
        let words = (3 + 2 * TOP_CANDIDATES) * rows;
        let best = gpu.buffer("best", (words * 4) as u64);
        let mut step = gpu.step();
        step.best_of_rows([&input, &best], rows, vocab, softcap)
            .expect("records");
        step.top_of_rows([&input, &best], rows, vocab, softcap)
            .expect("records");
        let words = step.read(&best, words).expect("runs");
        let pairs = words[3 * rows..].chunks_exact(2 * TOP_CANDIDATES);
        for (row, pairs) in pairs.enumerate() {
            let got: Vec<(u32, f32)> = pairs
                .chunks_exact(2)
                .map(|w| (w[0].to_bits(), w[1]))
                .take_while(|&(id, _)| id != u32::MAX)
                .collect();
            let mut row_logits = logits[row * vocab..(row + 1) * vocab].to_vec();
            if let Some(cap) = softcap {
                ops::softcap(&mut row_logits, cap);
            }
            let mut want = Vec::new();
            collect_best(&row_logits, TOP_CANDIDATES, &mut want);
            let what = format!("row {row} of {vocab}");
            let ids = |pairs: &[(u32, f32)]| pairs.iter().map(|p| p.0).collect::<Vec<_>>();
            assert_eq!(ids(&got), ids(&want), "{what}");
            let values = |pairs: &[(u32, f32)]| pairs.iter().map(|p| p.1).collect::<Vec<_>>();
            if softcap.is_some() {
                // The GPU's tanh is its own.
                close(&values(&got), &values(&want), 1e-5, &what);
            } else {
                // Read as stored, -0.0 and -inf included.
                let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
                assert_eq!(bits(values(&got)), bits(values(&want)), "{what}");
            }
        }
    }
}

/// Makes a row hard to rank: NaN, -inf, both zeros, and logits equal to
/// the 60th best in scattered places, so the TOP_CANDIDATES-th place falls
/// among equal logits (taken by lower id). A row of a vocabulary under 8 is
/// all NaN but one.
fn awkward_row(row: &mut [f32], rng: &mut impl Rng) {
    let vocab = row.len();
    if vocab < 8 {
        row.fill(f32::NAN);
        row[vocab / 2] = 1.5;
        return;
    }
    row[0] = f32::NAN;
    row[1] = 0.0;
    row[2] = -0.0;
    row[vocab - 1] = f32::NEG_INFINITY;
    if vocab > 2 * TOP_CANDIDATES {
        let mut order = row.to_vec();
        order.sort_by(|a, b| b.total_cmp(a));
        let tie = order[60];
        for _ in 0..12 {
            row[rng.gen_range(3..vocab - 1)] = tie;
        }
    }
}

/// `got` within `tolerance` of `want`, relative to each value's size (and
/// absolute below 1): f32 kernels that differ in the order or the
/// approximation of their operations (exp, the norm's sum).
fn close(got: &[f32], want: &[f32], tolerance: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tolerance * w.abs().max(1.0),
            "{what}, value {i}: {g} against {w}"
        );
    }
}

#[test]
fn shapes_that_do_not_fit_are_refused() {
    let Some(gpu) = gpu_for("shapes_that_do_not_fit_are_refused") else {
        return;
    };
    assert!(gpu.upload_f32(&[1.0; 5], 2, 3).is_err());
    assert!(gpu.upload_blocks(Format::Q8_0, &[0; 34], 1, 33).is_err());
    assert!(gpu.upload_blocks(Format::Q4_1, &[0; 18], 1, 32).is_err());
    assert!(gpu.upload_blocks(Format::F32, &[0; 128], 1, 32).is_err());
    assert!(gpu.upload_blocks(Format::Q4K, &[0; 144], 1, 128).is_err());
    assert!(gpu.upload_blocks(Format::F16, &[0; 6], 1, 3).is_err());
    let matrix = gpu.upload_f32(&[1.0; 6], 2, 3).expect("uploads");
    assert!(gpu.matvec(&matrix, &[1.0; 4]).is_err());
}

/// The default model with its weights on the GPU.
fn default_model_on(gpu: Gpu) -> LoadedModel {
    let mut model = LoadedModel::load(&tessera_testkit::default_model_path(), |_, _| {})
        .expect("default model loads");
    model
        .transformer
        .to_gpu(Arc::new(gpu))
        .expect("the default model runs on the GPU");
    model
}

#[test]
fn the_default_model_on_the_gpu_matches_llama_cpp_on_the_golden_set() {
    let Some(gpu) = gpu_for("the_default_model_on_the_gpu_matches_llama_cpp_on_the_golden_set")
    else {
        return;
    };
    super::golden::golden_set(&default_model_on(gpu));
}

/// 8 concurrent greedy requests (and a seeded sampled one) on the GPU, with
/// prompt chunks sharing steps with other sequences' decoding, each give
/// what they give alone.
#[test]
fn a_q4_k_m_file_on_the_gpu_gives_llama_cpps_logits() {
    let Some(gpu) = gpu_for("a_q4_k_m_file_on_the_gpu_gives_llama_cpps_logits") else {
        return;
    };
    // Q4_K and Q6_K where the columns are whole super-blocks, Q5_0 and
    // Q8_0 where they are not: each read as the file stores it.
    let mut model = LoadedModel::load(&super::kquants::q4_k_m_mix(), |_, _| {}).expect("loads");
    let cpu_bytes = model.transformer.weight_bytes() as u64;
    model
        .transformer
        .to_gpu(Arc::new(gpu))
        .expect("a Q4_K_M file runs on the GPU");
    let gpu_bytes = model.transformer.gpu_weight_bytes();
    assert!(
        gpu_bytes <= cpu_bytes,
        "{gpu_bytes} bytes on the GPU for {cpu_bytes} on the CPU: some matrix was widened"
    );
    super::kquants::q4_k_m_logits_match_llama_cpp(&model);
}

#[test]
fn eight_concurrent_requests_on_the_gpu_each_get_what_they_get_alone() {
    let Some(gpu) = gpu_for("eight_concurrent_requests_on_the_gpu_each_get_what_they_get_alone")
    else {
        return;
    };
    let model = default_model_on(gpu);
    super::batching::check_invariance(&model, Executor::single(&model.transformer, 2));
}

/// The GGUF fixtures of a mixture of experts and of a hybrid model (as
/// llama.cpp converted them, experts stored as one tensor) on the GPU:
/// a token's experts do not depend on who else is in the step, and each
/// sequence's recurrent state stays in its own slot (three slots for
/// eight requests: a slot is reset when the next sequence takes it).
#[test]
fn experts_and_recurrent_states_on_the_gpu_are_batch_invariant() {
    let name = "experts_and_recurrent_states_on_the_gpu_are_batch_invariant";
    let Some(gpu) = gpu_for(name) else {
        return;
    };
    let gpu = Arc::new(gpu);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf-reference");
    for case in ["qwen3-moe", "qwen3-5", "qwen3-5-moe"] {
        let path = root.join(case).join("model.gguf");
        let mut model = LoadedModel::load(&path, |_, _| {}).expect("the fixture loads");
        model.transformer.to_gpu(gpu.clone()).expect("on the GPU");
        super::batching::check_invariance(&model, Executor::single(&model.transformer, 2));
        if model.transformer.has_recurrent_state() {
            let executor = Executor::single(&model.transformer, 2);
            super::batching::check_invariance_with(&model, executor, 3);
        }
    }
}

/// Top-k sampling on the GPU reads back each row's candidates, not its
/// logits, and draws what the whole rows draw: a bias of zero on one token
/// (which the candidates cannot carry) sends the same request through the
/// logits, and the tokens are the same, their logprobs within the two
/// exponentials' rounding.
#[test]
fn top_k_sampling_on_the_gpu_draws_from_the_candidates_what_whole_rows_draw() {
    let name = "top_k_sampling_on_the_gpu_draws_from_the_candidates_what_whole_rows_draw";
    let Some(gpu) = gpu_for(name) else {
        return;
    };
    let model = default_model_on(gpu);
    let mut session = Session::new(&model, 2);
    let generate = |session: &mut Session<'_>, logit_bias: Vec<(u32, f32)>| {
        let mut request = GenerateRequest::new(Prompt::Raw("Once upon a time".into()));
        request.max_tokens = 16;
        request.ignore_eos = true;
        request.logprobs = true;
        request.sampling = SamplingParams {
            temperature: 1.2,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.02,
            top_logprobs: 3,
            seed: Some(5),
            logit_bias,
            ..SamplingParams::default()
        };
        session
            .generate(&request, |_| ControlFlow::Continue(()))
            .expect("generates")
    };
    let candidates = generate(&mut session, Vec::new());
    let whole_rows = generate(&mut session, vec![(0, 0.0)]);
    assert_eq!(candidates.tokens, whole_rows.tokens);
    for (a, b) in candidates.logprobs.iter().zip(&whole_rows.logprobs) {
        close(&[a.logprob], &[b.logprob], 1e-4, "logprob");
        let ids = |t: &[(u32, f32)]| t.iter().map(|p| p.0).collect::<Vec<_>>();
        assert_eq!(ids(&a.top), ids(&b.top));
    }
}

/// Prefix sharing on the GPU: a second question under the same system
/// prompt takes its blocks, computed for the first, from the GPU's cache
/// and answers what it answers cold.
#[test]
fn a_shared_system_prompt_is_taken_from_the_gpus_cache_and_gives_cold_tokens() {
    let name = "a_shared_system_prompt_is_taken_from_the_gpus_cache_and_gives_cold_tokens";
    let Some(gpu) = gpu_for(name) else {
        return;
    };
    let model = default_model_on(gpu);
    super::batching::check_shared_system_prompt(&model, Executor::single(&model.transformer, 2), 3);
}

/// Speculative verification on the GPU: prompt lookup's drafts, checked
/// several positions a step, give plain decoding's tokens.
#[test]
fn speculative_decoding_on_the_gpu_gives_plain_decodings_tokens() {
    let Some(gpu) = gpu_for("speculative_decoding_on_the_gpu_gives_plain_decodings_tokens") else {
        return;
    };
    let model = default_model_on(gpu);
    super::speculative::echo_speculates_identically(
        &model,
        Executor::single(&model.transformer, 2),
    );
}

fn first_rank_on_the_gpu(rank: usize, transformer: &mut Transformer) {
    if rank == 0 {
        on_the_gpu(transformer);
    }
}

fn second_rank_on_the_gpu(rank: usize, transformer: &mut Transformer) {
    if rank == 1 {
        on_the_gpu(transformer);
    }
}

fn on_the_gpu(transformer: &mut Transformer) {
    let gpu = Gpu::open(None).expect("the adapter opens");
    transformer
        .to_gpu(Arc::new(gpu))
        .expect("the stage runs on the GPU");
}

/// A pipeline of two stages, one on the GPU and one on the CPU (either
/// way round; activations cross through host memory over the ring), gives
/// the single machine's greedy answers, up to the first step where the
/// single machine's top two are within 0.25 (the GPU rounds its sums in
/// another order, so near-ties may go either way).
#[test]
fn a_pipeline_of_a_gpu_stage_and_a_cpu_stage_gives_the_single_machine_answer() {
    let name = "a_pipeline_of_a_gpu_stage_and_a_cpu_stage_gives_the_single_machine_answer";
    if gpu_for(name).is_none() {
        return;
    }
    let prepares: [fn(usize, &mut Transformer); 2] =
        [first_rank_on_the_gpu, second_rank_on_the_gpu];
    on_ranks_with_the_gpu_give_the_single_machines_answers(Sharding::Pipeline, &prepares);
}

/// Tensor-parallel ranks on the GPU (both, or one beside a CPU rank):
/// each gathers the attention's output and the MLP's activations through
/// the CPU's ring between its GPU's steps, and the instance gives the
/// single machine's greedy answers under the same margin rule.
#[test]
fn tensor_parallel_ranks_on_the_gpu_give_the_single_machine_answer() {
    let name = "tensor_parallel_ranks_on_the_gpu_give_the_single_machine_answer";
    if gpu_for(name).is_none() {
        return;
    }
    let prepares: [fn(usize, &mut Transformer); 2] =
        [every_rank_on_the_gpu, second_rank_on_the_gpu];
    on_ranks_with_the_gpu_give_the_single_machines_answers(Sharding::Tensor, &prepares);
}

/// What a tensor rank on the GPU cannot gather yet is refused by name, and
/// the rank stays on the CPU.
#[test]
fn a_tensor_rank_the_gpu_cannot_run_is_refused_by_name() {
    let Some(gpu) = gpu_for("a_tensor_rank_the_gpu_cannot_run_is_refused_by_name") else {
        return;
    };
    let gpu = Arc::new(gpu);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf-reference");
    for (case, reason) in [
        ("olmo2", "q and k normed across heads"),
        ("qwen3-moe", "a mixture of experts"),
        ("qwen3-5", "linear attention"),
    ] {
        let path = root.join(case).join("model.gguf");
        let layers = tessera_engine::serve::model_config(&path)
            .expect("config")
            .layers;
        let shard = super::distributed::spec(Sharding::Tensor, 1, 2, layers);
        let mut rank = tessera_engine::serve::load_transformer(&path, &shard, |_, _| {})
            .expect("the rank loads");
        let error = rank.to_gpu(gpu.clone()).expect_err("refused").to_string();
        assert!(
            error.contains(reason) && error.contains("tensor-parallel rank"),
            "{case}: {error}"
        );
        assert!(rank.gpu().is_none());
    }
}

fn every_rank_on_the_gpu(_: usize, transformer: &mut Transformer) {
    on_the_gpu(transformer);
}

/// The first cases greedily on two ranks of `sharding`, prepared each way
/// of `prepares`, against the single machine (the margin rule).
fn on_ranks_with_the_gpu_give_the_single_machines_answers(
    sharding: Sharding,
    prepares: &[fn(usize, &mut Transformer)],
) {
    let path = tessera_testkit::default_model_path();
    let cases: Vec<_> = super::distributed::cases().into_iter().take(3).collect();
    let model = LoadedModel::load(&path, |_, _| {}).expect("loads");
    let mut single = Session::new(&model, 2);
    let reference: Vec<_> = cases
        .iter()
        .map(|(_, prompt, _)| greedy_with_margins(&mut single, prompt, 24))
        .collect();
    for &prepare in prepares {
        let (outputs, followers) = on_prepared_ranks(
            &path,
            sharding,
            2,
            |r| Box::new(r),
            prepare,
            |model, executor| {
                let mut session = Session::with_executor(model, executor);
                let outputs: Vec<Vec<u32>> = cases
                    .iter()
                    .map(|(_, prompt, _)| greedy_with_margins(&mut session, prompt, 24).0)
                    .collect();
                session.executor().shutdown().expect("shutdown");
                outputs
            },
        );
        for follower in followers {
            follower.expect("the other rank serves until rank 0 is done");
        }
        for ((name, _, _), (ours, (want, margins))) in
            cases.iter().zip(outputs.iter().zip(&reference))
        {
            for (step, (a, b)) in ours.iter().zip(want).enumerate() {
                if margins[step] < 0.25 {
                    eprintln!(
                        "{name} {sharding:?}: compared {step} steps, then a margin of {:.3}",
                        margins[step]
                    );
                    break;
                }
                assert_eq!(
                    a, b,
                    "{name} {sharding:?}, step {step}: ours {ours:?}, single machine {want:?}"
                );
            }
        }
    }
}

/// The transformers reference cases of every family the GPU runs (their
/// safetensors weights, f32, dequantized on upload), held to the same rule
/// as on the CPU (`hf_reference.rs`).
const ON_THE_GPU: &[&str] = &[
    "llama",
    "llama-rope-llama3",
    "llama-rope-linear",
    "llama-rope-yarn",
    "llama-rope-dynamic",
    "llama-bias",
    "mistral",
    "mistral-sliding-window",
    "qwen2",
    "qwen3",
    "phi3",
    "phi3-longrope",
    "phi3-longrope-short",
    "phi3-longrope-crossing",
    "smollm3",
    "olmo2",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen3-moe",
    "qwen3-moe-dense-layer",
    "qwen3-5",
    "qwen3-5-moe",
    "qwen3-next",
];

#[test]
fn every_family_the_gpu_runs_matches_transformers_there() {
    let Some(gpu) = gpu_for("every_family_the_gpu_runs_matches_transformers_there") else {
        return;
    };
    let gpu = Arc::new(gpu);
    for name in ON_THE_GPU {
        super::hf_reference::single_on_gpu(name, gpu.clone());
    }
}

/// Every reference case runs on the GPU (a new family's case must be
/// added to [`ON_THE_GPU`] or its refusal tested).
#[test]
fn every_reference_case_is_run_on_the_gpu() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf-reference");
    for entry in std::fs::read_dir(root)
        .expect("hf-reference folder")
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let old_layout = name == "llama-rope-llama3-old-config";
        assert!(
            !entry.path().is_dir() || old_layout || ON_THE_GPU.contains(&name.as_str()),
            "{name}: not run on the GPU"
        );
    }
}
