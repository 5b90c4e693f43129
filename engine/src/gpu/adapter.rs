//! The adapters a machine has, and what each can do.

/// What kind of processor an adapter is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdapterKind {
    Discrete,
    Integrated,
    Virtual,
    /// A software implementation (Mesa's lavapipe, on the CPU).
    Cpu,
    Other,
}

impl AdapterKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Discrete => "discrete",
            Self::Integrated => "integrated",
            Self::Virtual => "virtual",
            Self::Cpu => "cpu",
            Self::Other => "other",
        }
    }
}

/// One adapter as the machine reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterReport {
    /// Its place in [`adapters`]' list (`--device gpu:N`).
    pub index: usize,
    pub name: String,
    /// "vulkan", "metal", "dx12".
    pub backend: String,
    pub kind: AdapterKind,
    pub driver: String,
    /// Bytes of its own memory (its device-local heaps) where the backend
    /// tells (Vulkan); 0 where it does not.
    pub memory_bytes: u64,
    /// Whether it shares the machine's memory (integrated GPUs, Apple
    /// silicon, software adapters): then placement counts the machine's.
    pub unified_memory: bool,
    pub shader_f16: bool,
    pub subgroups: bool,
    pub timestamps: bool,
}

/// The backends tessera uses: each platform's native one.
fn backends() -> wgpu::Backends {
    wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12
}

fn instance() -> wgpu::Instance {
    wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: backends(),
        flags: wgpu::InstanceFlags::empty(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    })
}

pub(super) fn report(index: usize, adapter: &wgpu::Adapter) -> AdapterReport {
    let info = adapter.get_info();
    let features = adapter.features();
    let kind = match info.device_type {
        wgpu::DeviceType::DiscreteGpu => AdapterKind::Discrete,
        wgpu::DeviceType::IntegratedGpu => AdapterKind::Integrated,
        wgpu::DeviceType::VirtualGpu => AdapterKind::Virtual,
        wgpu::DeviceType::Cpu => AdapterKind::Cpu,
        wgpu::DeviceType::Other => AdapterKind::Other,
    };
    AdapterReport {
        index,
        name: info.name,
        backend: info.backend.to_str().to_string(),
        kind,
        driver: [info.driver, info.driver_info]
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join(" "),
        memory_bytes: memory_bytes(adapter),
        unified_memory: matches!(kind, AdapterKind::Integrated | AdapterKind::Cpu),
        shader_f16: features.contains(wgpu::Features::SHADER_F16),
        subgroups: features.contains(wgpu::Features::SUBGROUP),
        timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY),
    }
}

/// The size of a Vulkan adapter's device-local heaps (wgpu itself does not
/// say how much memory an adapter has); 0 on other backends.
fn memory_bytes(adapter: &wgpu::Adapter) -> u64 {
    // SAFETY: the Vulkan adapter is only read, while `adapter` holds it.
    let Some(hal) = (unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }) else {
        return 0;
    };
    let instance = hal.shared_instance().raw_instance();
    // SAFETY: the physical device was enumerated from this instance, which
    // outlives the call; the query writes only the returned struct.
    let memory =
        unsafe { instance.get_physical_device_memory_properties(hal.raw_physical_device()) };
    // VK_MEMORY_HEAP_DEVICE_LOCAL_BIT.
    const DEVICE_LOCAL: u32 = 1;
    memory
        .memory_heaps
        .iter()
        .take(memory.memory_heap_count as usize)
        .filter(|heap| heap.flags.as_raw() & DEVICE_LOCAL != 0)
        .map(|heap| heap.size)
        .sum()
}

pub(super) fn enumerate() -> Vec<wgpu::Adapter> {
    pollster::block_on(instance().enumerate_adapters(backends()))
}

/// Every adapter of this machine, in the order `--device gpu:N` counts.
pub fn adapters() -> Vec<AdapterReport> {
    enumerate()
        .iter()
        .enumerate()
        .map(|(index, adapter)| report(index, adapter))
        .collect()
}
