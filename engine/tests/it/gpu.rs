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

/// A random Q8_0 matrix as GGUF stores it, and its values.
fn q8_0(rng: &mut impl Rng, rows: usize, cols: usize) -> (Vec<u8>, Vec<f64>) {
    let mut bytes = Vec::new();
    let mut values = Vec::new();
    for _ in 0..rows * cols / 32 {
        let scale = half::f16::from_f32(rng.gen_range(0.001..0.05));
        bytes.extend_from_slice(&scale.to_le_bytes());
        for _ in 0..32 {
            let q: i8 = rng.gen_range(-127..=127);
            bytes.push(q as u8);
            values.push(f64::from(scale.to_f32()) * f64::from(q));
        }
    }
    (bytes, values)
}

#[test]
fn a_q8_0_matrix_times_a_vector_is_the_exact_product() {
    let Some(gpu) = gpu_for("a_q8_0_matrix_times_a_vector_is_the_exact_product") else {
        return;
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    // Rows of one block, of an odd number of blocks (34-byte blocks fall
    // across u32 words), and more blocks than threads.
    for (rows, cols) in [(1, 32), (5, 96), (67, 576), (200, 32 * 70)] {
        let (bytes, w) = q8_0(&mut rng, rows, cols);
        let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let matrix = gpu.upload_q8_0(&bytes, rows, cols).expect("uploads");
        let got = gpu.matvec(&matrix, &x).expect("runs");
        let (exact, scale): (Vec<f64>, Vec<f64>) = w
            .chunks(cols)
            .map(|row| {
                let terms = row.iter().zip(&x).map(|(a, b)| a * f64::from(*b));
                (terms.clone().sum::<f64>(), terms.map(f64::abs).sum::<f64>())
            })
            .unzip();
        check(&got, &exact, &scale, cols, &format!("Q8_0 {rows} x {cols}"));
    }
}

#[test]
fn shapes_that_do_not_fit_are_refused() {
    let Some(gpu) = gpu_for("shapes_that_do_not_fit_are_refused") else {
        return;
    };
    assert!(gpu.upload_f32(&[1.0; 5], 2, 3).is_err());
    assert!(gpu.upload_q8_0(&[0; 34], 1, 33).is_err());
    let matrix = gpu.upload_f32(&[1.0; 6], 2, 3).expect("uploads");
    assert!(gpu.matvec(&matrix, &[1.0; 4]).is_err());
}
