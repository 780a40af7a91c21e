//! Opening a compute device the way every entry point (server, benchmark) needs it, and moving
//! tensors between devices. Each function dispatches to `crate::cuda`'s launch plumbing or
//! answers for the CPU; a build without the `cuda` feature has the stubs below, which answer
//! as for the CPU (no CUDA device can be opened in such a build).

use candle_core::{Device, Result, Tensor};

#[cfg(feature = "cuda")]
use crate::cuda as gpu;

#[cfg(not(feature = "cuda"))]
mod gpu {
    use candle_core::{bail, Device, Result, Tensor};

    pub fn transfer(_t: &Tensor, _device: &Device) -> Result<Tensor> {
        bail!("this build has no CUDA kernels (built without the `cuda` feature)")
    }
    pub fn retain_freed_memory(_device: &Device) -> Result<()> {
        Ok(())
    }
    pub fn release_freed_memory(_device: &Device) -> Result<()> {
        Ok(())
    }
    pub fn bind(_device: &Device) -> Result<()> {
        Ok(())
    }
    pub fn enable_peer_access(_devices: &[&Device]) -> Result<Vec<(usize, usize)>> {
        Ok(Vec::new())
    }
    pub fn memory_total(_device: &Device) -> Result<Option<u64>> {
        Ok(None)
    }
    pub fn pool_peak_since_last(_device: &Device) -> Result<Option<u64>> {
        Ok(None)
    }
}

/// CUDA device `ordinal`, its memory pool set to keep freed blocks (see
/// `cuda::retain_freed_memory`). Without the `cuda` feature candle's own error says so.
pub fn cuda(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda(ordinal)?;
    gpu::retain_freed_memory(&device)?;
    Ok(device)
}

/// `t` on `device`, for the hand-over between pipeline stages: the same tensor where it is
/// there already (the CPU), else a copy that is complete when this returns, so the next stage
/// may use it from its own thread (see `cuda::transfer`).
pub fn transfer(t: &Tensor, device: &Device) -> Result<Tensor> {
    if t.device().same_device(device) {
        return Ok(t.clone());
    }
    if t.device().is_cuda() && device.is_cuda() {
        return gpu::transfer(t, device);
    }
    t.to_device(device)
}

/// Makes `device` current on this thread before work is issued to it (a no-op on the CPU).
pub fn bind(device: &Device) -> Result<()> {
    gpu::bind(device)
}

/// Enables direct peer-to-peer access between the GPUs among `devices` where the hardware
/// allows it; returns the ordered pairs of GPU ordinals that have it (empty on the CPU).
pub fn enable_peer_access(devices: &[&Device]) -> Result<Vec<(usize, usize)>> {
    gpu::enable_peer_access(devices)
}

/// Bytes of memory of `device` (the whole GPU; `None` on the CPU, whose memory placement does
/// not plan for).
pub fn memory_capacity(device: &Device) -> Result<Option<u64>> {
    gpu::memory_total(device)
}

/// The host memory available for new allocations (`MemAvailable` of /proc/meminfo, Linux);
/// `None` where it cannot be read.
pub fn host_memory_available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Hands the memory a GPU's pool kept from freed tensors back to the driver (see
/// `cuda::release_freed_memory`; nothing on the CPU): the benchmark's peak of one model then
/// starts from what live tensors hold.
pub fn release_freed_memory(device: &Device) -> Result<()> {
    gpu::release_freed_memory(device)
}

/// The most bytes live tensors held on `device` since the last call (a GPU pool's high
/// watermark, then reset; `None` on the CPU): the memory column of the stage profile.
pub fn peak_since_last(device: &Device) -> Result<Option<u64>> {
    gpu::pool_peak_since_last(device)
}
