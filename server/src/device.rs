//! Opening a compute device the way every entry point (server, benchmark) needs it.

use candle_core::{Device, Result, Tensor};

/// CUDA device `ordinal`, its memory pool set to keep freed blocks (see
/// `cuda::retain_freed_memory`). Without the `cuda` feature candle's own error says so.
pub fn cuda(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda(ordinal)?;
    #[cfg(feature = "cuda")]
    crate::cuda::retain_freed_memory(&device)?;
    Ok(device)
}

/// `t` on `device`, for the hand-over between pipeline stages: the same tensor where it is
/// there already (the CPU), else a copy that is complete when this returns, so the next stage
/// may use it from its own thread (see `cuda::transfer`).
pub fn transfer(t: &Tensor, device: &Device) -> Result<Tensor> {
    if t.device().same_device(device) {
        return Ok(t.clone());
    }
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() && device.is_cuda() {
        return crate::cuda::transfer(t, device);
    }
    t.to_device(device)
}

/// Makes `device` current on this thread before work is issued to it (a no-op on the CPU).
pub fn bind(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    crate::cuda::bind(device)?;
    #[cfg(not(feature = "cuda"))]
    let _ = device;
    Ok(())
}

/// Enables direct peer-to-peer access between the GPUs among `devices` where the hardware
/// allows it; returns the ordered pairs of GPU ordinals that have it (empty on the CPU).
pub fn enable_peer_access(devices: &[&Device]) -> Result<Vec<(usize, usize)>> {
    #[cfg(feature = "cuda")]
    return crate::cuda::enable_peer_access(devices);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = devices;
        Ok(Vec::new())
    }
}

/// Bytes of memory of `device` (the whole GPU; `None` on the CPU, whose memory placement does
/// not plan for).
pub fn memory_capacity(device: &Device) -> Result<Option<u64>> {
    #[cfg(feature = "cuda")]
    return crate::cuda::memory_total(device);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        Ok(None)
    }
}
