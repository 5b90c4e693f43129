//! The WGSL kernels, compiled once per device.

/// Every kernel the forward pass records, one pipeline each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kernel {
    MatvecF32,
    MatvecQ8_0,
    MatvecQ4_0,
    MatvecQ4_1,
    MatvecF16,
    MatvecBf16,
    MatvecQ5_0,
    MatvecQ5_1,
    MatvecQ4K,
    MatvecQ5K,
    MatvecQ6K,
    MatvecQ2K,
    MatvecQ3K,
    QuantizeQ8,
    QuantizeQ8K,
    RmsNorm,
    Add,
    AddBias,
    Copy,
    SiluMul,
    GeluMul,
    Rope,
    StoreKv,
    Attention,
    BestOfRows,
    TopOfRows,
    RouteExperts,
    SumExperts,
    AddShared,
    FirstHalves,
    SecondHalves,
    SigmoidMul,
    Conv,
    L2Heads,
    Gates,
    Recur,
}

impl Kernel {
    const ALL: [Kernel; 36] = [
        Kernel::MatvecF32,
        Kernel::MatvecQ8_0,
        Kernel::MatvecQ4_0,
        Kernel::MatvecQ4_1,
        Kernel::MatvecF16,
        Kernel::MatvecBf16,
        Kernel::MatvecQ5_0,
        Kernel::MatvecQ5_1,
        Kernel::MatvecQ4K,
        Kernel::MatvecQ5K,
        Kernel::MatvecQ6K,
        Kernel::MatvecQ2K,
        Kernel::MatvecQ3K,
        Kernel::QuantizeQ8,
        Kernel::QuantizeQ8K,
        Kernel::RmsNorm,
        Kernel::Add,
        Kernel::AddBias,
        Kernel::Copy,
        Kernel::SiluMul,
        Kernel::GeluMul,
        Kernel::Rope,
        Kernel::StoreKv,
        Kernel::Attention,
        Kernel::BestOfRows,
        Kernel::TopOfRows,
        Kernel::RouteExperts,
        Kernel::SumExperts,
        Kernel::AddShared,
        Kernel::FirstHalves,
        Kernel::SecondHalves,
        Kernel::SigmoidMul,
        Kernel::Conv,
        Kernel::L2Heads,
        Kernel::Gates,
        Kernel::Recur,
    ];

    /// The matrix products, which are compiled for token tiles too: the
    /// first 13 of [`Kernel::ALL`].
    pub(super) const PRODUCTS: &'static [Kernel] = Kernel::ALL.as_slice().split_at(13).0;

    /// Its WGSL file and entry point.
    fn source(self) -> (&'static str, &'static str) {
        match self {
            Self::MatvecF32 => ("matvec", "matvec_f32"),
            Self::MatvecQ8_0 => ("matvec", "matvec_q8_0"),
            Self::MatvecQ4_0 => ("matvec", "matvec_q4_0"),
            Self::MatvecQ4_1 => ("matvec", "matvec_q4_1"),
            Self::MatvecF16 => ("matvec", "matvec_f16"),
            Self::MatvecBf16 => ("matvec", "matvec_bf16"),
            Self::MatvecQ5_0 => ("matvec", "matvec_q5_0"),
            Self::MatvecQ5_1 => ("matvec", "matvec_q5_1"),
            Self::MatvecQ4K => ("matvec_k", "matvec_q4_k"),
            Self::MatvecQ5K => ("matvec_k", "matvec_q5_k"),
            Self::MatvecQ6K => ("matvec_k", "matvec_q6_k"),
            Self::MatvecQ2K => ("matvec_k", "matvec_q2_k"),
            Self::MatvecQ3K => ("matvec_k", "matvec_q3_k"),
            Self::QuantizeQ8 => ("matvec", "quantize_q8"),
            Self::QuantizeQ8K => ("matvec_k", "quantize_q8k"),
            Self::RmsNorm => ("norm", "rms_norm"),
            Self::Add => ("elementwise", "add"),
            Self::AddBias => ("elementwise", "add_bias"),
            Self::Copy => ("elementwise", "copy"),
            Self::SiluMul => ("elementwise", "silu_mul"),
            Self::GeluMul => ("elementwise", "gelu_mul"),
            Self::Rope => ("rope", "rope"),
            Self::StoreKv => ("store_kv", "store_kv"),
            Self::Attention => ("attention", "attention"),
            Self::BestOfRows => ("best", "best_of_rows"),
            Self::TopOfRows => ("best", "top_of_rows"),
            Self::RouteExperts => ("moe", "route"),
            Self::SumExperts => ("moe", "sum_experts"),
            Self::AddShared => ("moe", "add_shared"),
            Self::FirstHalves => ("elementwise", "first_halves"),
            Self::SecondHalves => ("elementwise", "second_halves"),
            Self::SigmoidMul => ("elementwise", "sigmoid_mul"),
            Self::Conv => ("deltanet", "conv"),
            Self::L2Heads => ("deltanet", "l2_heads"),
            Self::Gates => ("deltanet", "gates"),
            Self::Recur => ("deltanet", "recur"),
        }
    }
}

/// What the matrix-product files share, compiled before each of them.
const MATVEC_COMMON: &str = include_str!("matvec_common.wgsl");
/// The CPU's exponential, for the files whose results go through one.
const EXP_POLY: &str = include_str!("exp_poly.wgsl");

/// How the matrix products add a row's lanes: in workgroup memory (every
/// adapter), or across a subgroup (the same sums, where subgroups hold 8
/// lanes or more).
const FINISH_SHARED: &str = include_str!("finish_shared.wgsl");
const FINISH_SUBGROUP: &str = include_str!("finish_subgroup.wgsl");

/// Each module's name and its source's parts, compiled as one; the matrix
/// products' with one of the `FINISH_*` parts.
const MODULES: [(&str, &[&str]); 10] = [
    ("matvec", &[MATVEC_COMMON, include_str!("matvec.wgsl")]),
    ("matvec_k", &[MATVEC_COMMON, include_str!("matvec_k.wgsl")]),
    ("norm", &[include_str!("norm.wgsl")]),
    ("elementwise", &[EXP_POLY, include_str!("elementwise.wgsl")]),
    ("rope", &[include_str!("rope.wgsl")]),
    ("store_kv", &[include_str!("store_kv.wgsl")]),
    ("attention", &[EXP_POLY, include_str!("attention.wgsl")]),
    ("best", &[include_str!("best.wgsl")]),
    ("moe", &[EXP_POLY, include_str!("moe.wgsl")]),
    ("deltanet", &[include_str!("deltanet.wgsl")]),
];

/// Product rows of a token tile: each block of W a workgroup reads is
/// multiplied with this many rows of x (`matvec_common.wgsl`'s `TOKENS`).
pub(super) const TILE_TOKENS: usize = 8;

/// The compiled kernels, in [`Kernel::ALL`]'s order, and the matrix
/// products compiled for token tiles where the device takes them.
pub(super) struct Kernels {
    pipelines: Vec<wgpu::ComputePipeline>,
    /// [`Kernel::PRODUCTS`] over tiles of [`TILE_TOKENS`] product rows.
    tiled: Vec<wgpu::ComputePipeline>,
}

impl Kernels {
    /// The kernels, the products reducing across subgroups if
    /// `subgroups` (the device must have [`wgpu::Features::SUBGROUP`]),
    /// and compiled for token tiles too if `token_tiles`.
    pub(super) fn new(device: &wgpu::Device, subgroups: bool, token_tiles: bool) -> Self {
        let modules = compile(device, subgroups, 1);
        let pipelines = Kernel::ALL
            .iter()
            .map(|kernel| pipeline(device, &modules, *kernel))
            .collect();
        let tiled = if token_tiles {
            let modules = compile(device, subgroups, TILE_TOKENS);
            Kernel::PRODUCTS
                .iter()
                .map(|kernel| pipeline(device, &modules, *kernel))
                .collect()
        } else {
            Vec::new()
        };
        Self { pipelines, tiled }
    }

    /// `kernel`'s pipeline, over token tiles if `tiled` (a product, on a
    /// device whose tiled kernels were compiled: else the plain one).
    pub(super) fn get(&self, kernel: Kernel, tiled: bool) -> &wgpu::ComputePipeline {
        let tile = Kernel::PRODUCTS.iter().position(|k| *k == kernel);
        match tile.and_then(|at| self.tiled.get(at)) {
            Some(pipeline) if tiled => pipeline,
            // Built in `Kernel::ALL`'s order, which is the variants' order.
            _ => &self.pipelines[kernel as usize],
        }
    }

    /// Whether the products were compiled for token tiles.
    pub(super) fn has_tiles(&self) -> bool {
        !self.tiled.is_empty()
    }
}

/// Every module of [`MODULES`], the matrix products' with `finish` by
/// subgroups or not and `tokens` product rows a workgroup (the others
/// do not depend on it).
fn compile(
    device: &wgpu::Device,
    subgroups: bool,
    tokens: usize,
) -> Vec<(&'static str, wgpu::ShaderModule)> {
    let finish = if subgroups {
        FINISH_SUBGROUP
    } else {
        FINISH_SHARED
    };
    let tokens_line = format!("const TOKENS: u32 = {tokens}u;");
    MODULES
        .iter()
        .filter(|(name, _)| tokens == 1 || name.starts_with("matvec"))
        .map(|(name, parts)| {
            let mut parts = parts.to_vec();
            if name.starts_with("matvec") {
                parts.insert(0, &tokens_line);
                parts.insert(2, finish);
            }
            let source = parts.join("\n");
            let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(name),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
            (*name, module)
        })
        .collect()
}

fn pipeline(
    device: &wgpu::Device,
    modules: &[(&str, wgpu::ShaderModule)],
    kernel: Kernel,
) -> wgpu::ComputePipeline {
    let (file, entry) = kernel.source();
    let module = modules
        .iter()
        .find(|(name, _)| *name == file)
        .map(|(_, module)| module);
    device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(entry),
        layout: None,
        // Every kernel's file is compiled.
        module: module.unwrap_or(&modules[0].1),
        entry_point: Some(entry),
        compilation_options: wgpu::PipelineCompilationOptions::default(),
        cache: None,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_products_compiled_for_token_tiles_are_every_matrix_product() {
        let products: Vec<super::Kernel> = super::Kernel::ALL
            .into_iter()
            .filter(|k| k.source().1.starts_with("matvec_"))
            .collect();
        assert_eq!(products, super::Kernel::PRODUCTS);
    }

    #[test]
    fn the_top_kernel_keeps_as_many_candidates_as_the_cpu_reads() {
        let wanted = format!("const TOP: u32 = {}u;", crate::logits::TOP_CANDIDATES);
        assert!(include_str!("best.wgsl").contains(&wanted), "{wanted}");
    }
}
