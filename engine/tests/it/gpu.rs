//! The GPU kernels against an exact (f64) reference, on whatever adapter
//! the machine has: Mesa's lavapipe in CI (which `scripts/test` installs,
//! setting `TESSERA_REQUIRE_GPU`, so a missing adapter fails there), a real
//! card elsewhere. Without an adapter and outside `scripts/test`, each test
//! says it did not run.
//!
//! Tolerance: the GPU sums in f32, in its own order. For a row the error is
//! within `cols * eps32 * sum |w x|` (a sum's worst case); the tests hold
//! it to `4 * eps32 * sqrt(cols) * sum |w x| + 1e-30`, which a random-order
//! f32 sum of these sizes meets by a wide margin and a wrong value (a
//! missed block, a swapped scale) misses by orders of magnitude.

use rand::{Rng, SeedableRng};
use tessera_engine::gpu::matvec::Format;
use tessera_engine::gpu::{self, Gpu};

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
        let (exact, scale): (Vec<f64>, Vec<f64>) = w
            .chunks(cols)
            .map(|row| {
                let terms = row
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b));
                (terms.clone().sum::<f64>(), terms.map(f64::abs).sum::<f64>())
            })
            .unzip();
        check(&got, &exact, &scale, cols, &format!("f32 {rows} x {cols}"));
    }
}

/// A random matrix of `format`'s blocks as GGUF stores it, and its values.
fn blocks(rng: &mut impl Rng, format: Format, rows: usize, cols: usize) -> (Vec<u8>, Vec<f64>) {
    let mut bytes = Vec::new();
    let mut values = Vec::new();
    fn f16(rng: &mut impl Rng, bytes: &mut Vec<u8>, low: f32, high: f32) -> f64 {
        let v = half::f16::from_f32(rng.gen_range(low..high));
        bytes.extend_from_slice(&v.to_le_bytes());
        f64::from(v.to_f32())
    }
    for _ in 0..rows * cols / 32 {
        let d = f16(rng, &mut bytes, 0.001, 0.05);
        match format {
            Format::Q8_0 => {
                let qs: Vec<i8> = (0..32).map(|_| rng.gen_range(-127..=127)).collect();
                bytes.extend(qs.iter().map(|&q| q as u8));
                values.extend(qs.iter().map(|&q| d * f64::from(q)));
            }
            Format::Q4_0 | Format::Q4_1 => {
                let m = if format == Format::Q4_1 {
                    f16(rng, &mut bytes, -0.5, 0.5)
                } else {
                    0.0
                };
                let nibbles: Vec<u8> = (0..32).map(|_| rng.gen_range(0..16)).collect();
                // Value j in byte j's low nibble, value j + 16 in its high.
                bytes.extend((0..16).map(|j| nibbles[j] | (nibbles[j + 16] << 4)));
                values.extend(nibbles.iter().map(|&q| match format {
                    Format::Q4_0 => d * (f64::from(q) - 8.0),
                    _ => d * f64::from(q) + m,
                }));
            }
            Format::F32 => unreachable!("f32 has no blocks"),
        }
    }
    (bytes, values)
}

#[test]
fn block_matrices_times_a_vector_are_the_exact_product() {
    let Some(gpu) = gpu_for("block_matrices_times_a_vector_are_the_exact_product") else {
        return;
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    for format in [Format::Q8_0, Format::Q4_0, Format::Q4_1] {
        // Rows of one block, of an odd number of blocks (blocks fall
        // across u32 words), and more blocks than threads.
        for (rows, cols) in [(1, 32), (5, 96), (67, 576), (200, 32 * 70)] {
            let (bytes, w) = blocks(&mut rng, format, rows, cols);
            let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let matrix = gpu
                .upload_blocks(format, &bytes, rows, cols)
                .expect("uploads");
            let got = gpu.matvec(&matrix, &x).expect("runs");
            let (exact, scale): (Vec<f64>, Vec<f64>) = w
                .chunks(cols)
                .map(|row| {
                    let terms = row.iter().zip(&x).map(|(a, b)| a * f64::from(*b));
                    (terms.clone().sum::<f64>(), terms.map(f64::abs).sum::<f64>())
                })
                .unzip();
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

#[test]
fn shapes_that_do_not_fit_are_refused() {
    let Some(gpu) = gpu_for("shapes_that_do_not_fit_are_refused") else {
        return;
    };
    assert!(gpu.upload_f32(&[1.0; 5], 2, 3).is_err());
    assert!(gpu.upload_blocks(Format::Q8_0, &[0; 34], 1, 33).is_err());
    assert!(gpu.upload_blocks(Format::Q4_1, &[0; 18], 1, 32).is_err());
    assert!(gpu.upload_blocks(Format::F32, &[0; 128], 1, 32).is_err());
    let matrix = gpu.upload_f32(&[1.0; 6], 2, 3).expect("uploads");
    assert!(gpu.matvec(&matrix, &[1.0; 4]).is_err());
}
