//! CUDA launches of the kernels in `server/kernels/` (feature `cuda`), one file per op family
//! beside its `ops/` dispatch and its `kernels/` source. This file holds only the launch
//! plumbing the families share: kernel names, grids, device slices, the memory pool, copies
//! between devices, peer access and the pinned host buffer.
// Kernel launches are FFI: the argument lists below must match the kernel signatures.
#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PinnedHostSlice,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{bail, DType, Result, Shape, Storage, Tensor};

const THREADS: u32 = 256;

/// Runs `$body` with `$T` bound to the Rust type of a float dtype.
macro_rules! with_float_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            DType::F16 => {
                type $T = half::f16;
                $body
            }
            other => bail!("no CUDA kernel for dtype {other:?}"),
        }
    };
}

pub mod attention;
pub mod dequant;
pub mod embedding;
mod fp8_cublaslt;
pub mod fp8_gemm;
pub mod gemm;
pub mod linear_attention;
pub mod moe;
pub mod norm;
pub mod rope;
pub mod scoring;

mod module;

fn kernel_name(base: &str, dtype: DType) -> String {
    format!("{base}_{}", dtype_suffix(dtype))
}

/// The kernels' name for a float dtype (f16 for any but f32 and bf16).
fn dtype_suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        _ => "f16",
    }
}

/// [`kernel_name`] of the `{base}_v8` variant (16-byte vectors, see [`rows_of_vectors`]) when
/// `vectors`, else of `base`.
fn vector_kernel_name(base: &str, vectors: bool, dtype: DType) -> String {
    kernel_name(
        &format!("{base}{}", if vectors { "_v8" } else { "" }),
        dtype,
    )
}

fn grid_1d(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(THREADS).max(1), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Items (int words, groups of 8 fp8 codes) each thread of the dequantization kernels takes:
/// `DEQUANT_ITEMS` in dequant.cu.
const DEQUANT_ITEMS: usize = 2;

/// The dequantization kernels' grid: one block per row and run of `THREADS * DEQUANT_ITEMS` of
/// the row's `items`.
fn grid_row_items(rows: usize, items: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            rows as u32,
            items.div_ceil(THREADS as usize * DEQUANT_ITEMS) as u32,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn grid_rows(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Whether rows of `cols` values of every tensor can be read as 16-byte vectors of 8 values:
/// `cols` and every start offset a multiple of 8 (allocations themselves are aligned).
fn rows_of_vectors(cols: usize, tensors: &[&Tensor]) -> bool {
    cols.is_multiple_of(8)
        && tensors
            .iter()
            .all(|t| t.layout().start_offset().is_multiple_of(8))
}

/// Runs `f` with the CUDA slice of a contiguous tensor, its start offset and its device.
fn with_slice<T: CudaDType + DeviceRepr, R>(
    t: &Tensor,
    f: impl FnOnce(&CudaSlice<T>, usize, &CudaDevice) -> Result<R>,
) -> Result<R> {
    if !t.is_contiguous() {
        bail!("CUDA kernels need contiguous inputs");
    }
    with_view(t, |slice, offset, _, dev| f(slice, offset, dev))
}

/// [`with_slice`] for a tensor whose last dimension alone need be contiguous (rows of a wider
/// tensor, seen in place): also its strides, in elements.
fn with_view<T: CudaDType + DeviceRepr, R>(
    t: &Tensor,
    f: impl FnOnce(&CudaSlice<T>, usize, &[usize], &CudaDevice) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        bail!("expected a CUDA tensor, found one on {:?}", t.device())
    };
    if layout.stride().last().is_some_and(|&s| s != 1) {
        bail!("CUDA kernels need the last dimension contiguous");
    }
    f(
        T::as_cuda_slice(cuda)?,
        layout.start_offset(),
        layout.stride(),
        &cuda.device,
    )
}

fn wrap<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice, shape: impl Into<Shape>) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

/// Runs `f` on the default memory pool of `device`'s GPU (nothing on the CPU); `what` names
/// the operation in the error.
fn with_default_pool(
    device: &candle_core::Device,
    what: &str,
    f: impl FnOnce(sys::CUmemoryPool) -> sys::CUresult,
) -> Result<()> {
    let candle_core::Device::Cuda(dev) = device else {
        return Ok(());
    };
    let cu_device = dev.cuda_stream().context().cu_device();
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a driver call on a device the context was created for; `pool` outlives it.
    let status = match unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, cu_device) } {
        sys::CUresult::CUDA_SUCCESS => f(pool),
        error => error,
    };
    if status != sys::CUresult::CUDA_SUCCESS {
        bail!("cannot {what}: {status:?}");
    }
    Ok(())
}

/// Keeps memory freed by stream-ordered deallocations in the device's default pool instead of
/// handing it back to the driver at every synchronization (the pool's default threshold is 0).
/// Without this, each forward pass maps its activations afresh after the scoring step syncs.
pub(crate) fn retain_freed_memory(device: &candle_core::Device) -> Result<()> {
    let mut threshold = u64::MAX;
    with_default_pool(
        device,
        "set the CUDA memory pool's release threshold",
        |pool| {
            // SAFETY: `pool` is the device's default pool; `threshold` outlives the call.
            unsafe {
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    (&mut threshold as *mut u64).cast(),
                )
            }
        },
    )
}

/// Hands the memory that [`retain_freed_memory`] kept in the pool back to the driver, so that
/// the device's used memory is again what live tensors hold (the benchmark measures each
/// model's peak this way after dropping the previous one).
pub fn release_freed_memory(device: &candle_core::Device) -> Result<()> {
    device.synchronize()?;
    // SAFETY: `pool` is the device's default pool.
    with_default_pool(device, "trim the CUDA memory pool", |pool| unsafe {
        sys::cuMemPoolTrimTo(pool, 0)
    })
}

/// The most bytes that live allocations of `device`'s pool held since the last call (the pool's
/// used-memory high watermark, then reset), for `exactscore-bench speed --profile`.
pub fn pool_peak_since_last(device: &candle_core::Device) -> Result<Option<u64>> {
    if !device.is_cuda() {
        return Ok(None);
    }
    let mut high = 0u64;
    // SAFETY: `pool` is the device's default pool; both attributes are a cuuint64_t.
    with_default_pool(
        device,
        "read the CUDA memory pool's high watermark",
        |pool| unsafe {
            use sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH as HIGH;
            match sys::cuMemPoolGetAttribute(pool, HIGH, (&mut high as *mut u64).cast()) {
                sys::CUresult::CUDA_SUCCESS => {
                    let mut zero = 0u64;
                    sys::cuMemPoolSetAttribute(pool, HIGH, (&mut zero as *mut u64).cast())
                }
                error => error,
            }
        },
    )?;
    Ok(Some(high))
}

/// The device address of `t`'s first element (contiguous, on a GPU), for kernels that take
/// tensors by address.
fn device_address<T: CudaDType + DeviceRepr>(t: &Tensor) -> Result<u64> {
    with_slice::<T, _>(t, |slice, offset, dev| {
        let stream = dev.cuda_stream();
        let view = slice.slice(offset..);
        let (address, _sync) = view.device_ptr(&stream);
        Ok(address)
    })
}

/// `t` copied onto `device`: another GPU, or another logical device (stream) of the same GPU.
/// Hands a tensor from one pipeline stage's thread to the next. Candle's streams are per
/// thread (`CU_STREAM_PER_THREAD` resolves against the calling thread and its current context),
/// so nothing is left to stream order here: the source's stream is synchronized before the
/// copy (its producer may still be writing it), the copy is issued in the destination's
/// context on its stream, and that stream is synchronized after it, so the source may be freed
/// and the copy used from any thread. Between GPUs the driver copies peer to peer where peer
/// access is enabled ([`enable_peer_access`]) and through host memory where it is missing.
pub fn transfer(t: &Tensor, device: &candle_core::Device) -> Result<Tensor> {
    use candle_core::cuda_backend::cudarc::driver::{result, DevicePtrMut};
    let candle_core::Device::Cuda(dst) = device else {
        bail!("transfer: {device:?} is not a CUDA device")
    };
    let t = t.contiguous()?;
    t.device().synchronize()?;
    let n = t.elem_count();
    with_float_type!(t.dtype(), T => with_slice::<T, _>(&t, |src, at, src_dev| {
        let (src_stream, dst_stream) = (src_dev.cuda_stream(), dst.cuda_stream());
        let (src_ctx, dst_ctx) = (src_stream.context(), dst_stream.context());
        // SAFETY: the copy below writes all `n` elements before anything reads them.
        let mut out = unsafe { dst_stream.alloc::<T>(n) }.w()?;
        let bytes = n * std::mem::size_of::<T>();
        {
            let src_view = src.slice(at..at + n);
            let (src_ptr, _src) = src_view.device_ptr(&src_stream);
            let (dst_ptr, _dst) = out.device_ptr_mut(&dst_stream);
            dst_ctx.bind_to_thread().w()?;
            // SAFETY: both ranges hold `bytes` bytes; the source is complete (synchronized
            // above) and stays alive until the destination stream is synchronized below.
            unsafe {
                if src_ctx.cu_ctx() == dst_ctx.cu_ctx() {
                    result::memcpy_dtod_async(dst_ptr, src_ptr, bytes, dst_stream.cu_stream())
                } else {
                    result::memcpy_peer_async(
                        dst_ctx.cu_ctx(),
                        dst_ptr,
                        src_ctx.cu_ctx(),
                        src_ptr,
                        bytes,
                        dst_stream.cu_stream(),
                    )
                }
            }
            .w()?;
        }
        dst_stream.synchronize().w()?;
        Ok(wrap(out, dst, t.shape()))
    }))
}

/// Lets each GPU of `devices` read the others' memory directly (NVLink/PCIe peer to peer),
/// where the hardware allows it; returns the ordered pairs (from, to) that have it. Copies
/// between devices without it still work ([`transfer`]), staged through host memory.
pub fn enable_peer_access(devices: &[&candle_core::Device]) -> Result<Vec<(usize, usize)>> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    let mut contexts: Vec<std::sync::Arc<CudaContext>> = Vec::new();
    for device in devices {
        if let candle_core::Device::Cuda(d) = device {
            let ctx = d.cuda_stream().context().clone();
            if !contexts.iter().any(|c| c.cu_ctx() == ctx.cu_ctx()) {
                contexts.push(ctx);
            }
        }
    }
    let mut enabled = Vec::new();
    for from in &contexts {
        for to in &contexts {
            if from.cu_ctx() == to.cu_ctx() {
                continue;
            }
            let mut can = 0;
            // SAFETY: plain driver queries and settings on live contexts.
            unsafe {
                sys::cuDeviceCanAccessPeer(&mut can, from.cu_device(), to.cu_device())
                    .result()
                    .w()?;
                if can == 0 {
                    continue;
                }
                from.bind_to_thread().w()?;
                match sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) {
                    sys::CUresult::CUDA_SUCCESS
                    | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                    error => bail!(
                        "enabling peer access {} -> {}: {error:?}",
                        from.ordinal(),
                        to.ordinal()
                    ),
                }
            }
            enabled.push((from.ordinal(), to.ordinal()));
        }
    }
    Ok(enabled)
}

/// Total memory of `device`'s GPU (`None` for the CPU).
pub fn memory_total(device: &candle_core::Device) -> Result<Option<u64>> {
    use candle_core::cuda_backend::cudarc::driver::result;
    let candle_core::Device::Cuda(d) = device else {
        return Ok(None);
    };
    d.cuda_stream().context().bind_to_thread().w()?;
    let (_free, total) = result::mem_get_info().w()?;
    Ok(Some(total as u64))
}

/// Makes `device`'s context current on this thread. cuBLAS calls and candle's per-thread
/// stream resolve against the current context, which the previous operation on this thread,
/// possibly on another device, left behind.
pub fn bind(device: &candle_core::Device) -> Result<()> {
    if let candle_core::Device::Cuda(d) = device {
        d.cuda_stream().context().bind_to_thread().w()?;
    }
    Ok(())
}

thread_local! {
    /// Page-locked host memory for [`copy_to_host`], grown on demand and reused: a pageable
    /// destination would be staged by the driver at a fraction of the bandwidth.
    static PINNED: std::cell::RefCell<Option<PinnedHostSlice<u32>>> = const { std::cell::RefCell::new(None) };
}

/// Copies `src` to the host through this thread's reused pinned buffer.
fn copy_to_host(dev: &CudaDevice, src: &CudaView<u32>) -> Result<Vec<u32>> {
    let stream = dev.cuda_stream();
    PINNED.with_borrow_mut(|slot| {
        let fits = slot.as_ref().is_some_and(|p| {
            p.len() >= src.len() && std::sync::Arc::ptr_eq(p.context(), stream.context())
        });
        if !fits {
            // Flags 0, not the write-combined default: the host reads this memory.
            // SAFETY: only the prefix a copy has just written is read below.
            *slot = Some(
                unsafe {
                    stream
                        .context()
                        .alloc_pinned_with_flags(src.len().max(1), 0)
                }
                .w()?,
            );
        }
        let Some(pinned) = slot.as_mut() else {
            bail!("pinned host buffer missing after allocation")
        };
        // The copy's size is the destination's: hand over exactly `src.len()` words. cudarc
        // records no completion event for it (candle turns event tracking off), hence the sync.
        let dst = &mut pinned.as_mut_slice().w()?[..src.len()];
        stream.memcpy_dtoh(src, dst).w()?;
        stream.synchronize().w()?;
        Ok(dst.to_vec())
    })
}
