//! Opening a compute device the way every entry point (server, benchmark) needs it.

use candle_core::{Device, Result};

/// CUDA device `ordinal`, its memory pool set to keep freed blocks (see
/// `cuda::retain_freed_memory`). Without the `cuda` feature candle's own error says so.
pub fn cuda(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda(ordinal)?;
    #[cfg(feature = "cuda")]
    crate::cuda::retain_freed_memory(&device)?;
    Ok(device)
}
