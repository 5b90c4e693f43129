//! The WGSL kernels, compiled once per device.

/// The compiled kernels, one pipeline per format.
pub(super) struct Kernels {
    pub(super) matvec_f32: wgpu::ComputePipeline,
    pub(super) matvec_q8_0: wgpu::ComputePipeline,
    pub(super) matvec_q4_0: wgpu::ComputePipeline,
    pub(super) matvec_q4_1: wgpu::ComputePipeline,
}

impl Kernels {
    pub(super) fn new(device: &wgpu::Device) -> Self {
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("matvec"),
            source: wgpu::ShaderSource::Wgsl(include_str!("matvec.wgsl").into()),
        });
        let pipeline = |entry: &str| {
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: None,
                module: &module,
                entry_point: Some(entry),
                compilation_options: wgpu::PipelineCompilationOptions::default(),
                cache: None,
            })
        };
        Self {
            matvec_f32: pipeline("matvec_f32"),
            matvec_q8_0: pipeline("matvec_q8_0"),
            matvec_q4_0: pipeline("matvec_q4_0"),
            matvec_q4_1: pipeline("matvec_q4_1"),
        }
    }
}
