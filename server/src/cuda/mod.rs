//! CUDA launches of the kernels in `server/kernels/` (feature `cuda`). Each function mirrors a
//! CPU reference and is checked against it on the device.
// Kernel launches are FFI: the argument lists below must match the kernel signatures.
#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PinnedHostSlice, PushKernelArg,
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

mod attention;
mod gemm;
mod module;
pub use attention::{
    flash_attention, flash_attention_supported, rope_rotate_half, FlashMma, FlashOptions,
    FlashTiling,
};
pub use gemm::{matmul_t_add_into_rows, matmul_t_f32, matmul_t_stacked_into_rows};
use module::{kernel, EXACTSCORE, INT4_GEMM};

fn kernel_name(base: &str, dtype: DType) -> String {
    let suffix = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        _ => "f16",
    };
    format!("{base}_{suffix}")
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
/// `DEQUANT_ITEMS` in exactscore.cu.
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
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        bail!("expected a CUDA tensor, found one on {:?}", t.device())
    };
    if !layout.is_contiguous() {
        bail!("CUDA kernels need contiguous inputs");
    }
    f(T::as_cuda_slice(cuda)?, layout.start_offset(), &cuda.device)
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

/// pack-quantized int4/int8 → `[rows, cols]` in `dtype`. `scales`: f32 `[rows, groups]`;
/// `zero_points`: i32 `[rows, groups]` or `None` (symmetric).
pub fn dequant_int(
    codes: &Tensor,
    scales: &Tensor,
    zero_points: Option<&Tensor>,
    (rows, cols): (usize, usize),
    bits: usize,
    group: usize,
    dtype: DType,
) -> Result<Tensor> {
    let words_per_row = codes.dims()[1];
    let per = 32 / bits;
    // Fast kernel when each int32 word lies inside one group (every real model).
    let words_kernel = group.is_multiple_of(per) && cols.is_multiple_of(per);
    let name = match (words_kernel, bits) {
        (true, 4) => kernel_name("dequant_int4_words", dtype),
        (true, _) => kernel_name("dequant_int8_words", dtype),
        (false, _) => kernel_name("dequant_int", dtype),
    };
    let launch = |zp: Option<(&CudaSlice<i32>, usize)>| -> Result<Tensor> {
        with_slice::<i32, _>(codes, |codes, co, dev| {
            with_slice::<f32, _>(scales, |scales, so, _| {
                with_float_type!(dtype, T => {
                    let func = kernel(dev, &EXACTSCORE, &name)?;
                    // SAFETY: the kernel writes every element.
                    let out = unsafe { dev.alloc::<T>(rows * cols) }?;
                    let (codes, scales) = (codes.slice(co..), scales.slice(so..));
                    let zp_view = zp.map(|(z, zo)| z.slice(zo..));
                    let null = 0u64;
                    let mut b = func.builder();
                    b.arg(&codes);
                    b.arg(&scales);
                    match &zp_view {
                        Some(z) => b.arg(z),
                        None => b.arg(&null),
                    };
                    b.arg(&out);
                    let (r, c, w, bi, g) = (rows as i32, cols as i32, words_per_row as i32, bits as i32, group as i32);
                    b.arg(&r).arg(&c);
                    if !words_kernel {
                        b.arg(&w).arg(&bi);
                    }
                    b.arg(&g);
                    let config = if words_kernel {
                        grid_row_items(rows, words_per_row)
                    } else {
                        grid_1d(rows * words_per_row)
                    };
                    // SAFETY: arguments match `dequant_int_*` / `dequant_int{4,8}_words_*`.
                    unsafe { b.launch(config) }.w()?;
                    Ok(wrap(out, dev, (rows, cols)))
                })
            })
        })
    };
    match zero_points {
        Some(zp) => with_slice::<i32, _>(zp, |z, zo, _| launch(Some((z, zo)))),
        None => launch(None),
    }
}

/// Pack-quantized int weights of one shape, width and group (a mixture's experts) → `[weights,
/// rows, cols]` in `dtype` by one launch of the words kernel, each weight's tensors named to it
/// by address. `None` where that kernel does not apply (words that straddle groups: no real
/// model, and no weights).
pub fn dequant_int_stacked(
    weights: &[(&Tensor, &Tensor, Option<&Tensor>)],
    (rows, cols): (usize, usize),
    bits: usize,
    group: usize,
    dtype: DType,
) -> Result<Option<Tensor>> {
    let per = 32 / bits;
    let Some(&(first, _, _)) = weights.first() else {
        return Ok(None);
    };
    if !(group.is_multiple_of(per) && cols.is_multiple_of(per)) {
        return Ok(None);
    }
    let addresses = stack_addresses(weights, (rows, cols), bits, group)?;
    let name = kernel_name(&format!("dequant_int{bits}_words_stacked"), dtype);
    with_slice::<i32, _>(first, |_, _, dev| {
        with_float_type!(dtype, T => {
            let func = kernel(dev, &EXACTSCORE, &name)?;
            let addresses = dev.clone_htod(&addresses)?;
            let n = weights.len();
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(n * rows * cols) }?;
            let (r, c, g) = (rows as i32, cols as i32, group as i32);
            let mut b = func.builder();
            b.arg(&addresses).arg(&out).arg(&r).arg(&c).arg(&g);
            let mut config = grid_row_items(rows, cols / per);
            config.grid_dim.2 = n as u32;
            // SAFETY: arguments match `dequant_int{4,8}_words_stacked_*`; every address was
            // checked against its weight's shape above, and the weights outlive the launch
            // (the caller holds them; the stream orders it before any later free).
            unsafe { b.launch(config) }.w()?;
            Ok(Some(wrap(out, dev, (n, rows, cols))))
        })
    })
}

/// Rows of x per block of `matmul_t_int4_stacked` (its two tilings), and each tiling's dynamic
/// shared memory: 3 stages of 64-wide k-tiles (x rows, 128 weight rows' int4 words, two scales
/// and zero points each), and two decoded 128-row weight tiles.
pub const INT4_GEMM_TILE_ROWS: [usize; 2] = [64, 128];
fn int4_gemm_shared_bytes(tile_rows: usize) -> usize {
    3 * (tile_rows * 64 * 2 + 128 * 8 * 4 + 2 * 128 * 8) + 2 * 128 * 64 * 2
}

/// The tiling for blocks of `rows`: 64 rows where none has more, else 128 (each weight tile is
/// decoded once per block: 64-row blocks decode twice as often).
pub fn int4_gemm_tile_rows(rows: &[usize]) -> usize {
    if rows.iter().all(|&r| r <= 64) {
        64
    } else {
        128
    }
}

/// Whether `matmul_t_int4_stacked` takes weights of this shape `[n, k]`, width and group in
/// `dtype`: int4, k a multiple of 64 and the group of 32, n even, bf16/f16.
fn int4_gemm_takes((n, k): (usize, usize), bits: usize, group: usize, dtype: DType) -> bool {
    bits == 4
        && k.is_multiple_of(64)
        && group.is_multiple_of(32)
        && n.is_multiple_of(2)
        && dtype != DType::F32
}

/// Whether the codes at `addresses` ([`stack_addresses`]) are aligned for the kernel's 16-byte
/// copies.
fn int4_codes_aligned(addresses: &[u64]) -> bool {
    addresses
        .iter()
        .step_by(3)
        .all(|codes| codes.is_multiple_of(16))
}

/// Whether `matmul_t_int4_stacked` multiplies these weights (one shape `[n, k]` of `bits`-bit
/// codes in groups of `group`) in `dtype` ([`int4_gemm_takes`]), their codes aligned for its
/// 16-byte copies.
pub fn int4_gemm_applies(
    weights: &[(&Tensor, &Tensor, Option<&Tensor>)],
    shape: (usize, usize),
    bits: usize,
    group: usize,
    dtype: DType,
) -> Result<bool> {
    Ok(int4_gemm_takes(shape, bits, group, dtype)
        && int4_codes_aligned(&stack_addresses(weights, shape, bits, group)?))
}

/// `x_z · w_zᵀ` for the int4 weights `weights` (one shape `[n, k]`, one group: a mixture's
/// experts, where [`int4_gemm_applies`]) and their blocks of `rows[z]` consecutive rows of `x`
/// (`[Σ rows, k]`, bf16/f16; any counts, 0 included), written into rows `row0..` of `out`
/// (`[.., n]`, x's dtype): one launch of `matmul_t_int4_stacked` with `tile_rows` rows per block
/// ([`INT4_GEMM_TILE_ROWS`]; `None`: [`int4_gemm_tile_rows`]), which decodes
/// each weight value as [`dequant_int_stacked`] would (the same values) and multiplies on tensor
/// cores.
#[allow(clippy::too_many_arguments)]
pub fn matmul_t_int4_stacked_into_rows(
    out: &Tensor,
    row0: usize,
    x: &Tensor,
    weights: &[(&Tensor, &Tensor, Option<&Tensor>)],
    rows: &[usize],
    (n, k): (usize, usize),
    group: usize,
    tile_rows: Option<usize>,
) -> Result<()> {
    let dtype = x.dtype();
    let total: usize = rows.iter().sum();
    let (x_rows, x_k) = x.dims2()?;
    let (out_rows, out_n) = out.dims2()?;
    if x_k != k
        || x_rows != total
        || rows.len() != weights.len()
        || out_n != n
        || row0 + total > out_rows
        || out.dtype() != dtype
        || !out.is_contiguous()
        || !int4_gemm_takes((n, k), 4, group, dtype)
    {
        bail!(
            "matmul_t_int4_stacked_into_rows: x {:?} ({dtype:?}) for {} weights [{n}, {k}] g{group} \
             of {total} rows into rows {row0}.. of {:?}",
            x.dims(),
            weights.len(),
            out.dims()
        );
    }
    let most = rows.iter().copied().max().unwrap_or(0);
    if most == 0 {
        return Ok(());
    }
    let tile_rows = tile_rows.unwrap_or_else(|| int4_gemm_tile_rows(rows));
    if !INT4_GEMM_TILE_ROWS.contains(&tile_rows) {
        bail!("matmul_t_int4_stacked_into_rows: {tile_rows} rows per tile");
    }
    // The weights' addresses, then each block's first row.
    let mut args = stack_addresses(weights, (n, k), 4, group)?;
    if !int4_codes_aligned(&args) {
        bail!("matmul_t_int4_stacked_into_rows: codes not 16-byte aligned");
    }
    args.extend(std::iter::once(0).chain(rows.iter().scan(0u64, |end, &r| {
        *end += r as u64;
        Some(*end)
    })));
    let x = x.contiguous()?;
    let name = kernel_name(&format!("matmul_t_int4_stacked_m{tile_rows}"), dtype);
    let shared = int4_gemm_shared_bytes(tile_rows);
    with_float_type!(dtype, T => {
        if !device_address::<T>(&x)?.is_multiple_of(16) {
            bail!("matmul_t_int4_stacked_into_rows: x is not 16-byte aligned");
        }
        let y = device_address::<T>(out)? + (row0 * n * std::mem::size_of::<T>()) as u64;
        with_slice::<T, _>(&x, |xs, xo, dev| {
            let func = kernel(dev, &INT4_GEMM, &name)?;
            func.allow_shared_bytes(shared)?;
            let args = dev.clone_htod(&args)?;
            let xs = xs.slice(xo..);
            let (n32, k32, g32) = (n as i32, k as i32, group as i32);
            let mut b = func.builder();
            b.arg(&args).arg(&xs).arg(&y).arg(&n32).arg(&k32).arg(&g32);
            let config = LaunchConfig {
                grid_dim: (
                    n.div_ceil(128) as u32,
                    most.div_ceil(tile_rows) as u32,
                    weights.len() as u32,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: shared as u32,
            };
            // SAFETY: arguments match `matmul_t_int4_stacked_m*`; the weights' shapes, x's and
            // out's were checked above, and `out` (contiguous, x's dtype) holds rows
            // row0..row0 + Σ rows of n values, which the kernel alone writes. The weights and
            // out outlive the launch (the caller holds them; the stream orders any later free).
            unsafe { b.launch(config) }.w()?;
            Ok(())
        })
    })
}

/// The device addresses of a stack's (codes, scales, zero points or 0), three per weight, as the
/// `_stacked` kernels take them; every weight must be `[rows, cols]` of `bits`-bit codes in
/// groups of `group`.
fn stack_addresses(
    weights: &[(&Tensor, &Tensor, Option<&Tensor>)],
    (rows, cols): (usize, usize),
    bits: usize,
    group: usize,
) -> Result<Vec<u64>> {
    let per = 32 / bits;
    let mut addresses = Vec::with_capacity(3 * weights.len());
    for &(codes, scales, zero_points) in weights {
        if codes.dims() != [rows, cols / per] || scales.dims() != [rows, cols / group] {
            bail!(
                "stacked int{bits} weights: codes {:?} and scales {:?} for a [{rows}, {cols}] weight",
                codes.dims(),
                scales.dims()
            );
        }
        addresses.push(device_address::<i32>(codes)?);
        addresses.push(device_address::<f32>(scales)?);
        addresses.push(match zero_points {
            Some(z) => device_address::<i32>(z)?,
            None => 0,
        });
    }
    Ok(addresses)
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

/// nvfp4 → `[rows, cols]` in `dtype` (values rounded to bf16 first, as the reference does).
pub fn dequant_nvfp4(
    packed: &Tensor,
    scales: &Tensor,
    global_scale: f32,
    (rows, cols): (usize, usize),
    dtype: DType,
) -> Result<Tensor> {
    let name = kernel_name("dequant_nvfp4", dtype);
    with_slice::<u8, _>(packed, |packed, po, dev| {
        with_slice::<u8, _>(scales, |scales, so, _| {
            with_float_type!(dtype, T => {
                let func = kernel(dev, &EXACTSCORE, &name)?;
                // SAFETY: the kernel writes every element.
                let out = unsafe { dev.alloc::<T>(rows * cols) }?;
                let (packed, scales) = (packed.slice(po..), scales.slice(so..));
                let (r, c) = (rows as i32, cols as i32);
                let mut b = func.builder();
                b.arg(&packed).arg(&scales).arg(&global_scale).arg(&out).arg(&r).arg(&c);
                // SAFETY: arguments match `dequant_nvfp4_*` (one thread per 16 weights).
                unsafe { b.launch(grid_1d(rows * cols / 16)) }.w()?;
                Ok(wrap(out, dev, (rows, cols)))
            })
        })
    })
}

/// float-quantized fp8 → `[rows, cols]` in `dtype`; `scales`: f32, one per `block`.
pub fn dequant_fp8(
    codes: &Tensor,
    scales: &Tensor,
    (rows, cols): (usize, usize),
    block: (usize, usize),
    dtype: DType,
) -> Result<Tensor> {
    if cols % 8 != 0 {
        bail!("the fp8 dequantization kernel needs in_features divisible by 8, got {cols}");
    }
    let name = kernel_name("dequant_fp8", dtype);
    with_slice::<u8, _>(codes, |codes, co, dev| {
        with_slice::<f32, _>(scales, |scales, so, _| {
            with_float_type!(dtype, T => {
                let func = kernel(dev, &EXACTSCORE, &name)?;
                // SAFETY: the kernel writes every element.
                let out = unsafe { dev.alloc::<T>(rows * cols) }?;
                let (codes, scales) = (codes.slice(co..), scales.slice(so..));
                let args = [rows, cols, block.0, block.1, cols.div_ceil(block.1)].map(|v| v as i32);
                let mut b = func.builder();
                b.arg(&codes).arg(&scales).arg(&out);
                for a in &args {
                    b.arg(a);
                }
                // SAFETY: arguments match `dequant_fp8_*` (items: groups of 8 weights).
                unsafe { b.launch(grid_row_items(rows, cols / 8)) }.w()?;
                Ok(wrap(out, dev, (rows, cols)))
            })
        })
    })
}

/// fp8 QDQ of `x` `[rows, k]`: per-token dynamic when `static_scale` is `None`.
pub fn qdq_fp8(x: &Tensor, static_scale: Option<f32>) -> Result<Tensor> {
    let x = x.contiguous()?;
    let (rows, k) = x.dims2()?;
    let vectors = rows_of_vectors(k, &[&x]);
    let name = vector_kernel_name("qdq_fp8_token", vectors, x.dtype());
    with_float_type!(x.dtype(), T => with_slice::<T, _>(&x, |xs, xo, dev| {
        let func = kernel(dev, &EXACTSCORE, &name)?;
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<T>(rows * k) }?;
        let xs = xs.slice(xo..);
        let (k32, scale) = (k as i32, static_scale.unwrap_or(0.0));
        let mut b = func.builder();
        b.arg(&xs).arg(&out).arg(&k32).arg(&scale);
        // SAFETY: arguments match `qdq_fp8_token_*` / `qdq_fp8_token_v8_*` (256-thread blocks,
        // aligned vectors checked above).
        unsafe { b.launch(grid_rows(rows)) }.w()?;
        Ok(wrap(out, dev, (rows, k)))
    }))
}

/// NVFP4 QDQ of `x` `[rows, k]` (k a multiple of 16) against `global_scale`.
pub fn qdq_nvfp4(x: &Tensor, global_scale: f32) -> Result<Tensor> {
    let x = x.contiguous()?;
    let (rows, k) = x.dims2()?;
    if k % 16 != 0 {
        bail!("NVFP4 activations need a multiple of 16 features, got {k}");
    }
    // The kernel reads 16-value vectors: a view that starts mid-vector is copied first.
    let x = if (x.layout().start_offset() * x.dtype().size_in_bytes()) % 16 != 0 {
        x.copy()?
    } else {
        x
    };
    let name = kernel_name("qdq_nvfp4", x.dtype());
    with_float_type!(x.dtype(), T => with_slice::<T, _>(&x, |xs, xo, dev| {
        let func = kernel(dev, &EXACTSCORE, &name)?;
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<T>(rows * k) }?;
        let xs = xs.slice(xo..);
        let groups = (rows * k / 16) as i64;
        let mut b = func.builder();
        b.arg(&xs).arg(&out).arg(&groups).arg(&global_scale);
        // SAFETY: arguments match `qdq_nvfp4_*`.
        unsafe { b.launch(grid_1d(groups as usize)) }.w()?;
        Ok(wrap(out, dev, (rows, k)))
    }))
}

/// transformers' RMSNorm of `x` over the last dimension, in one pass: the normalised,
/// weighted rows. With `fp8_qdq`, they then go through the per-token fp8 QDQ (as [`qdq_fp8`]
/// without a static scale), in the same kernel when the rows allow vectors.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32, fp8_qdq: bool) -> Result<Tensor> {
    let x = x.contiguous()?;
    let dims = x.dims().to_vec();
    let cols = *dims.last().unwrap_or(&0);
    let rows = x.elem_count() / cols.max(1);
    // An f32 weight beside a narrower x: multiplied in f32 (GemmaRMSNorm's `1 + w`).
    let f32_weight = weight.dtype() == DType::F32 && x.dtype() != DType::F32;
    if weight.dims() != [cols] || !(weight.dtype() == x.dtype() || f32_weight) {
        bail!(
            "rms_norm: x {dims:?} {:?}, weight {:?} {:?}",
            x.dtype(),
            weight.dims(),
            weight.dtype()
        );
    }
    let vectors = rows_of_vectors(cols, &[&x, weight]);
    let base = if f32_weight {
        "rms_norm_f32w"
    } else {
        "rms_norm"
    };
    let variant = match (vectors, fp8_qdq) {
        (true, true) => format!("{base}_v8_fp8_qdq"),
        (true, false) => format!("{base}_v8"),
        (false, _) => base.to_string(),
    };
    let name = kernel_name(&variant, x.dtype());
    with_float_type!(x.dtype(), T => with_slice::<T, _>(&x, |xs, xo, dev| {
        with_float_type!(weight.dtype(), W => with_slice::<W, _>(weight, |ws, wo, _| {
            let func = kernel(dev, &EXACTSCORE, &name)?;
            // SAFETY: the kernel writes every element of `out`.
            let out = unsafe { dev.alloc::<T>(rows * cols) }?;
            let (xs, ws) = (xs.slice(xo..), ws.slice(wo..));
            let c32 = cols as i32;
            let mut b = func.builder();
            b.arg(&xs).arg(&ws).arg(&out).arg(&c32).arg(&eps);
            // SAFETY: arguments match `rms_norm{,_f32w}{,_v8,_v8_fp8_qdq}_*` (one 256-thread
            // block per row; aligned vectors checked above; the weight's type by `f32_weight`).
            unsafe { b.launch(grid_rows(rows)) }.w()?;
            let out = wrap(out, dev, dims.clone());
            if fp8_qdq && !vectors { qdq_fp8(&out, None) } else { Ok(out) }
        }))
    }))
}

/// Rows `ids` (u32, every id < rows of `table`) of `table` `[rows, cols]`: the embedding lookup
/// without candle's `index_select`, whose module is PTX the driver would JIT-compile at start-up.
pub fn gather_rows(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let (_, cols) = table.dims2()?;
    let n = ids.elem_count();
    let name = kernel_name("gather_rows", table.dtype());
    with_float_type!(table.dtype(), T => with_slice::<T, _>(table, |ts, to, dev| {
        with_slice::<u32, _>(ids, |is, io, _| {
            let func = kernel(dev, &EXACTSCORE, &name)?;
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(n * cols) }?;
            let (ts, is) = (ts.slice(to..), is.slice(io..));
            let (c32, total) = (cols as i32, (n * cols) as i64);
            let mut b = func.builder();
            b.arg(&ts).arg(&is).arg(&out).arg(&c32).arg(&total);
            // SAFETY: arguments match `gather_rows_*`; the caller checked every id.
            unsafe { b.launch(grid_1d(n * cols)) }.w()?;
            Ok(wrap(out, dev, (n, cols)))
        })
    }))
}

/// `silu(gate) * up` in one pass (SwiGLU), rounded as PyTorch rounds it in the compute dtype;
/// with `fp8_qdq` followed in the same kernel by the per-token fp8 QDQ (as [`qdq_fp8`] without a
/// static scale).
pub fn silu_mul(gate: &Tensor, up: &Tensor, fp8_qdq: bool) -> Result<Tensor> {
    gated_mul("silu_mul", gate, up, fp8_qdq)
}

/// `gelu_tanh(gate) * up` (GeGLU), as [`silu_mul`].
pub fn gelu_tanh_mul(gate: &Tensor, up: &Tensor, fp8_qdq: bool) -> Result<Tensor> {
    gated_mul("gelu_tanh_mul", gate, up, fp8_qdq)
}

/// `act(gate) * up` by the kernel family `base` (`silu_mul`, `gelu_tanh_mul`).
fn gated_mul(base: &str, gate: &Tensor, up: &Tensor, fp8_qdq: bool) -> Result<Tensor> {
    let (gate, up) = (gate.contiguous()?, up.contiguous()?);
    if gate.dims() != up.dims() || gate.dtype() != up.dtype() {
        bail!(
            "{base}: gate {:?} and up {:?} differ",
            gate.dims(),
            up.dims()
        );
    }
    let n = gate.elem_count();
    let row = *gate.dims().last().unwrap_or(&0);
    if n % 8 != 0 || row % 8 != 0 {
        bail!(
            "{base} needs rows of a multiple of 8 elements, got {:?}",
            gate.dims()
        );
    }
    let variant = if fp8_qdq {
        format!("{base}_fp8_qdq")
    } else {
        base.to_string()
    };
    let name = kernel_name(&variant, gate.dtype());
    with_float_type!(gate.dtype(), T => with_slice::<T, _>(&gate, |gs, go, dev| {
        with_slice::<T, _>(&up, |us, uo, _| {
            if go % 8 != 0 || uo % 8 != 0 {
                bail!("{base} needs 16-byte aligned inputs");
            }
            let func = kernel(dev, &EXACTSCORE, &name)?;
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(n) }?;
            let (gs, us) = (gs.slice(go..), us.slice(uo..));
            let mut b = func.builder();
            b.arg(&gs).arg(&us).arg(&out);
            let (n64, row32) = (n as i64, row as i32);
            if fp8_qdq {
                b.arg(&row32);
                // SAFETY: arguments match `{silu,gelu_tanh}_mul_fp8_qdq_*` (one 256-thread block per row).
                unsafe { b.launch(grid_rows(n / row.max(1))) }.w()?;
            } else {
                b.arg(&n64);
                // SAFETY: arguments match `{silu,gelu_tanh}_mul_*` (one thread per 8 elements).
                unsafe { b.launch(grid_1d(n / 8)) }.w()?;
            }
            Ok(wrap(out, dev, gate.dims()))
        })
    }))
}

/// The most experts [`moe_topk`]'s kernel holds per token (16 per lane of a warp).
pub const MOE_MAX_EXPERTS: usize = 512;

/// The router of a mixture of experts on its logits `[tokens, experts]`: per token the ids and
/// weights of its top `k` experts by f32 softmax probability (ties to the lowest id), the
/// weights renormalised to sum 1 when `norm`, flat `[tokens × k]`. A token whose
/// probabilities hold a NaN gets the id `experts`. Only these pairs leave the GPU.
pub fn moe_topk(logits: &Tensor, k: usize, norm: bool) -> Result<(Vec<u32>, Vec<f32>)> {
    let logits = logits.contiguous()?;
    let (rows, experts) = logits.dims2()?;
    if experts > MOE_MAX_EXPERTS {
        bail!("the GPU router handles up to {MOE_MAX_EXPERTS} experts, the model has {experts}");
    }
    let name = kernel_name("moe_topk", logits.dtype());
    let (ids, weights) = with_float_type!(logits.dtype(), T => with_slice::<T, _>(&logits, |ls, lo, dev| {
        let func = kernel(dev, &EXACTSCORE, &name)?;
        // SAFETY: the kernel writes every element of both.
        let (ids, weights) = unsafe { (dev.alloc::<u32>(rows * k)?, dev.alloc::<f32>(rows * k)?) };
        let ls = ls.slice(lo..);
        let (e32, k32, n32, r32) = (experts as i32, k as i32, i32::from(norm), rows as i32);
        let mut b = func.builder();
        b.arg(&ls).arg(&e32).arg(&k32).arg(&n32).arg(&ids).arg(&weights).arg(&r32);
        // SAFETY: arguments match `moe_topk_*` (one warp per token).
        unsafe { b.launch(grid_1d(rows * 32)) }.w()?;
        Ok((wrap(ids, dev, rows * k), wrap(weights, dev, rows * k)))
    }))?;
    Ok((ids.to_vec1()?, weights.to_vec1()?))
}

/// `residual[t] + Σ_j weights[r] · y[r]` over `r = positions[t, j]` per token `t` (u32
/// `[tokens, k]`), the sum taken in the order of `positions`: each term rounded to the
/// compute dtype from the f32 product (with `compute_dtype_weights`, from the product with the
/// weight rounded to the compute dtype first), every add rounded to it.
pub fn moe_combine(
    y: &Tensor,
    weights: &Tensor,
    compute_dtype_weights: bool,
    positions: &Tensor,
    residual: &Tensor,
) -> Result<Tensor> {
    let (y, residual) = (y.contiguous()?, residual.contiguous()?);
    let (tokens, k) = positions.dims2()?;
    let (rows, cols) = y.dims2()?;
    if residual.dims() != [tokens, cols]
        || residual.dtype() != y.dtype()
        || weights.elem_count() != rows
        || weights.dtype() != DType::F32
    {
        bail!(
            "moe_combine: y {:?}, weights {:?}, residual {:?}",
            y.dims(),
            weights.dims(),
            residual.dims()
        );
    }
    let n = tokens * cols;
    let name = kernel_name("moe_combine", y.dtype());
    with_float_type!(y.dtype(), T => with_slice::<T, _>(&y, |ys, yo, dev| {
        with_slice::<f32, _>(weights, |ws, wo, _| {
            with_slice::<u32, _>(positions, |ps, po, _| {
                with_slice::<T, _>(&residual, |rs, ro, _| {
                    let func = kernel(dev, &EXACTSCORE, &name)?;
                    // SAFETY: the kernel writes every element.
                    let out = unsafe { dev.alloc::<T>(n) }?;
                    let (ys, ws) = (ys.slice(yo..), ws.slice(wo..));
                    let (ps, rs) = (ps.slice(po..), rs.slice(ro..));
                    let (k32, c32, cw, n64) =
                        (k as i32, cols as i32, i32::from(compute_dtype_weights), n as i64);
                    let mut b = func.builder();
                    b.arg(&ys).arg(&ws).arg(&ps).arg(&rs).arg(&out);
                    b.arg(&k32).arg(&c32).arg(&cw).arg(&n64);
                    // SAFETY: arguments match `moe_combine_*` (one thread per output; every
                    // position < rows of y, built by the caller).
                    unsafe { b.launch(grid_1d(n)) }.w()?;
                    Ok(wrap(out, dev, (tokens, cols)))
                })
            })
        })
    }))
}

/// Per row of two f32 states `[rows, cols]`: (Σ a·b, Σ a², Σ b², Σ (a − b)²) in f64.
pub fn row_pair_sums(a: &Tensor, b: &Tensor) -> Result<Vec<[f64; 4]>> {
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    let (rows, cols) = a.dims2()?;
    if b.dims() != [rows, cols] || a.dtype() != DType::F32 || b.dtype() != DType::F32 {
        bail!("row_pair_sums needs two f32 [rows, cols] of one shape");
    }
    let sums = with_slice::<f32, _>(&a, |xs, xo, dev| {
        with_slice::<f32, _>(&b, |ys, yo, _| {
            let func = kernel(dev, &EXACTSCORE, "row_pair_sums")?;
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<f64>(rows * 4) }?;
            let (xs, ys) = (xs.slice(xo..), ys.slice(yo..));
            let c32 = cols as i32;
            let mut builder = func.builder();
            builder.arg(&xs).arg(&ys).arg(&out).arg(&c32);
            // SAFETY: arguments match `row_pair_sums` (one 256-thread block per row).
            unsafe { builder.launch(grid_rows(rows)) }.w()?;
            Ok(wrap(out, dev, (rows, 4)))
        })
    })?;
    Ok(sums
        .to_vec2::<f64>()?
        .into_iter()
        .map(|v| [v[0], v[1], v[2], v[3]])
        .collect())
}

/// Per-row scores computed on the GPU; only these vectors are copied to the host.
pub struct RowScores {
    pub target_logprob: Vec<f32>,
    pub argmax: Vec<u32>,
    pub argmax_logprob: Vec<f32>,
    /// `rows * top_k`, row-major.
    pub top_ids: Vec<u32>,
    pub top_logprobs: Vec<f32>,
}

/// Fused log-softmax + gather + argmax + top-k over `logits` `[rows, vocab]`.
/// `targets[i] < 0` means row i has no target. The kernel writes all five vectors into one
/// device buffer, which comes back in one copy into a reused pinned host buffer.
pub fn score_rows(logits: &Tensor, targets: &[i32], top_k: usize) -> Result<RowScores> {
    let logits = logits.contiguous()?;
    let (rows, vocab) = logits.dims2()?;
    if top_k > 20 {
        bail!("top_k {top_k} exceeds the kernel's maximum of 20");
    }
    // Layout of the buffer, 4-byte words: target logprob, argmax id, argmax logprob (one per
    // row each), then the top-k ids and logprobs (`rows * top_k` each).
    let top_len = rows * top_k;
    let words = 3 * rows + 2 * top_len;
    let vectors = rows_of_vectors(vocab, &[&logits]);
    let name = vector_kernel_name("score_rows", vectors, logits.dtype());
    let host = with_float_type!(logits.dtype(), T => with_slice::<T, _>(&logits, |ls, lo, dev| {
        let func = kernel(dev, &EXACTSCORE, &name)?;
        let targets = dev.clone_htod(targets)?;
        // SAFETY: the kernel writes every word: three per row, and the top-k when k > 0.
        let out = unsafe { dev.alloc::<u32>(words.max(1)) }?;
        let part = |at: usize| out.slice(at..);
        let (tl, ai, al) = (part(0), part(rows), part(2 * rows));
        let (ti, tp) = (part(3 * rows), part(3 * rows + top_len));
        let ls = ls.slice(lo..);
        let (v32, k32) = (vocab as i32, top_k as i32);
        let mut b = func.builder();
        b.arg(&ls).arg(&v32).arg(&targets).arg(&k32).arg(&tl).arg(&ai).arg(&al).arg(&ti).arg(&tp);
        // SAFETY: arguments match `score_rows_*` (f32 and i32 outputs are 4-byte words here).
        unsafe { b.launch(grid_rows(rows)) }.w()?;
        copy_to_host(dev, &out.slice(0..words))
    }))?;
    let f32s =
        |range: std::ops::Range<usize>| host[range].iter().map(|&w| f32::from_bits(w)).collect();
    Ok(RowScores {
        target_logprob: f32s(0..rows),
        argmax: host[rows..2 * rows].to_vec(),
        argmax_logprob: f32s(2 * rows..3 * rows),
        top_ids: host[3 * rows..3 * rows + top_len].to_vec(),
        top_logprobs: f32s(3 * rows + top_len..words),
    })
}

/// Per-row divergences computed on the GPU; only these vectors are copied to the host.
pub struct KldRows {
    /// KL(reference ‖ model) per row, in nats (f64).
    pub kld: Vec<f64>,
    /// The model's log p(target).
    pub logprob: Vec<f32>,
    /// The reference's log p(target).
    pub reference_logprob: Vec<f32>,
    /// The model's most likely token (lowest id on ties).
    pub argmax: Vec<u32>,
    /// The reference's most likely token (lowest id on ties).
    pub reference_argmax: Vec<u32>,
    /// KL(model ‖ reference) per row (f64).
    pub reverse_kld: Vec<f64>,
    /// The reference's probability of its most likely token (f64).
    pub reference_top_p: Vec<f64>,
    /// Bit K − 1 set when both rows' K best ids are the same set, K = 1..=5.
    pub top_k_agreement: Vec<u8>,
}

/// Fused KL-divergence of `logits` from `reference_logits` (both `[rows, vocab]`, same dtype and
/// device) per row, both ways, with both models' log p(target) and argmax, the top-K agreement
/// and the reference's top probability; see `kld_rows` in the kernels. One buffer of per-row
/// numbers comes back, never a vocabulary row.
pub fn kld_rows(reference_logits: &Tensor, logits: &Tensor, targets: &[u32]) -> Result<KldRows> {
    let (reference_logits, logits) = (reference_logits.contiguous()?, logits.contiguous()?);
    let (rows, vocab) = logits.dims2()?;
    if reference_logits.dtype() != logits.dtype() || targets.len() != rows {
        bail!(
            "kld_rows: {:?} reference logits, {:?} logits, {} targets for {rows} rows",
            reference_logits.dtype(),
            logits.dtype(),
            targets.len()
        );
    }
    // Layout, 4-byte words: three f64 vectors (two words a row each: the divergence, the
    // reverse divergence, the reference's top probability), then one word a row each: the
    // model's and the reference's log p(target), both argmax ids, the agreement mask.
    let words = 11 * rows;
    let name = kernel_name("kld_rows", logits.dtype());
    let host = with_float_type!(logits.dtype(), T => with_slice::<T, _>(&reference_logits, |rs, ro, dev| {
        with_slice::<T, _>(&logits, |ls, lo, _| {
            let func = kernel(dev, &EXACTSCORE, &name)?;
            let targets: Vec<i32> = targets.iter().map(|&t| t as i32).collect();
            let targets = dev.clone_htod(&targets)?;
            // SAFETY: the kernel writes every word (thread 0 of each row's block).
            let out = unsafe { dev.alloc::<u32>(words.max(1)) }?;
            let part = |at: usize| out.slice(at * rows..);
            let (kld, reverse, ref_top_p) = (part(0), part(2), part(4));
            let (lp, rlp, top, rtop, agree) = (part(6), part(7), part(8), part(9), part(10));
            let (rs, ls) = (rs.slice(ro..), ls.slice(lo..));
            let v32 = vocab as i32;
            let mut b = func.builder();
            b.arg(&rs).arg(&ls).arg(&v32).arg(&targets);
            b.arg(&kld).arg(&reverse).arg(&ref_top_p);
            b.arg(&lp).arg(&rlp).arg(&top).arg(&rtop).arg(&agree);
            // SAFETY: arguments match `kld_rows_*`; the f64 parts start the (256-byte aligned)
            // buffer and span 8 bytes a row each, so their values are aligned.
            unsafe { b.launch(grid_rows(rows)) }.w()?;
            copy_to_host(dev, &out.slice(0..words))
        })
    }))?;
    let f32s =
        |range: std::ops::Range<usize>| host[range].iter().map(|&w| f32::from_bits(w)).collect();
    let f64s = |vector: usize| {
        (0..rows)
            .map(|i| {
                let at = vector * rows + 2 * i;
                f64::from_bits(u64::from(host[at]) | (u64::from(host[at + 1]) << 32))
            })
            .collect()
    };
    Ok(KldRows {
        kld: f64s(0),
        reverse_kld: f64s(2),
        reference_top_p: f64s(4),
        logprob: f32s(6 * rows..7 * rows),
        reference_logprob: f32s(7 * rows..8 * rows),
        argmax: host[8 * rows..9 * rows].to_vec(),
        reference_argmax: host[9 * rows..10 * rows].to_vec(),
        top_k_agreement: host[10 * rows..11 * rows]
            .iter()
            .map(|&m| m as u8)
            .collect(),
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

/// `softmax(scale * scores)` under a causal (optionally sliding-window) mask, for f32 scores
/// `[heads, t, t]`, written in `dtype`; masked entries are 0. One pass instead of scale + mask
/// add + softmax.
pub fn causal_softmax(
    scores: &Tensor,
    scale: f32,
    window: Option<usize>,
    dtype: DType,
) -> Result<Tensor> {
    let scores = scores.contiguous()?;
    let dims = scores.dims().to_vec();
    let t = *dims.last().unwrap_or(&0);
    let rows = scores.elem_count() / t.max(1);
    let name = kernel_name("causal_softmax", dtype);
    with_slice::<f32, _>(&scores, |s, so, dev| {
        with_float_type!(dtype, T => {
            let func = kernel(dev, &EXACTSCORE, &name)?;
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(rows * t) }?;
            let s = s.slice(so..);
            let (t32, w32) = (t as i32, window.map_or(0, |w| w as i32));
            let mut b = func.builder();
            b.arg(&s).arg(&out).arg(&t32).arg(&scale).arg(&w32);
            // SAFETY: arguments match `causal_softmax_*`.
            unsafe { b.launch(grid_rows(rows)) }.w()?;
            Ok(wrap(out, dev, dims))
        })
    })
}

/// Runs `f` with cuBLAS f32 GEMMs on TF32 tensor cores. Used for Q·Kᵀ in bf16/f16 compute:
/// bf16 and f16 values are exact in TF32, so the scores keep f32 accumulation and f32 output
/// (as fused bf16 attention kernels do), at tensor-core speed.
pub fn with_tf32<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    let before = candle_core::cuda_backend::gemm_reduced_precision_f32();
    candle_core::cuda_backend::set_gemm_reduced_precision_f32(true);
    let result = f();
    candle_core::cuda_backend::set_gemm_reduced_precision_f32(before);
    result
}
