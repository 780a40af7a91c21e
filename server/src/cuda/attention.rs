//! Launches of `server/kernels/attention.cu` and `attention_sm90.cu`: flash attention on the
//! projections' token-major layout `[tokens, heads, head_dim]`, for a whole batch of sequences
//! at once, and the materialized path's causal softmax and soft-capping.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Device, Result, Tensor};

use super::module::{kernel, KernelModule, ATTENTION, ATTENTION_SM90};
use super::{grid_1d, grid_rows, kernel_name, with_slice, with_view, wrap};

/// Threads per block of `flash_attention_*` (attention.cu).
const THREADS: u32 = 128;

/// Whether the wgmma flash kernel was built (for sm_90) and runs on `device` (a Hopper GPU).
pub fn wgmma_runs_on(device: &Device) -> Result<bool> {
    let Device::Cuda(dev) = device else {
        return Ok(false);
    };
    ATTENTION_SM90.runs_on(dev)
}

/// K and V buffers of the wgmma kernel for `head_dim` (attention_sm90.cu's `WG_ENTRIES`): two
/// at 128; one at 192 and 256, where two would leave room for one block per SM at 256.
fn wgmma_kv_buffers(head_dim: usize) -> usize {
    if head_dim == 128 {
        2
    } else {
        1
    }
}

/// The flash kernel of a tiling (`rows` x `keys`, wgmma or mma.sync) for `head_dim`: its name
/// (without the dtype suffix), module, and dynamic shared memory per block. `mma.sync`: the Q
/// tile and one K and one V tile, rows padded by 8 for a conflict-free `ldmatrix`. wgmma: the Q
/// tile and [`wgmma_kv_buffers`] K and V tiles, swizzled instead of padded, plus room to align
/// them to 1024 bytes.
fn flash_kernel(
    (rows, keys, wgmma): (usize, usize, bool),
    head_dim: usize,
    elem: usize,
) -> (String, &'static KernelModule, usize) {
    if wgmma {
        (
            format!("flash_attention_wgmma_d{head_dim}_r{rows}_k{keys}"),
            &ATTENTION_SM90,
            (rows + 2 * wgmma_kv_buffers(head_dim) * keys) * head_dim * elem + 1024,
        )
    } else {
        (
            format!("flash_attention_d{head_dim}_r{rows}_k{keys}"),
            &ATTENTION,
            (rows + 2 * keys) * (head_dim + 8) * elem,
        )
    }
}

/// `a · b` with cuBLAS f32 GEMMs on TF32 tensor cores. Used for Q·Kᵀ in bf16/f16 compute:
/// bf16 and f16 values are exact in TF32, so the scores keep f32 accumulation and f32 output
/// (as fused bf16 attention kernels do), at tensor-core speed.
pub fn matmul_tf32(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let before = candle_core::cuda_backend::gemm_reduced_precision_f32();
    candle_core::cuda_backend::set_gemm_reduced_precision_f32(true);
    let result = a.matmul(b);
    candle_core::cuda_backend::set_gemm_reduced_precision_f32(before);
    result
}

/// Causal softmax attention of `q` `[tokens, hq, d]` over `k`, `v` `[tokens, hkv, d]` for the
/// sequences whose token ranges are `starts[i]..starts[i + 1]` (i32, on the device); `max_len`
/// is the longest of them. `v` may be a view whose tokens and heads lie apart by multiples of 8
/// values (MLA's values within its `[tokens, heads, nope + v]` rows), else it is copied.
/// Returns `[tokens, hq * d]` in the compute dtype. Scores and the softmax state stay in f32 on
/// chip; nothing of size T×T is written. `tile`: the tiling (`ops::FlashTiling`, which checks
/// that it was compiled for this head size).
#[allow(clippy::too_many_arguments)]
pub fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    starts: &Tensor,
    max_len: usize,
    scale: f32,
    window: Option<usize>,
    tile: (usize, usize, bool),
) -> Result<Tensor> {
    let (tokens, hq, dim) = q.dims3()?;
    let (_, hkv, _) = k.dims3()?;
    if hq % hkv != 0 || v.dims3()? != k.dims3()? {
        bail!(
            "flash attention: unsupported shapes q {:?} k {:?} v {:?} ({:?})",
            q.dims(),
            k.dims(),
            v.dims(),
            q.dtype()
        );
    }
    let in_place = match v.stride() {
        [tokens, heads, 1] => [tokens, heads, &v.layout().start_offset()]
            .iter()
            .all(|s| s.is_multiple_of(8) && **s <= i32::MAX as usize),
        _ => false,
    };
    let v = if in_place { v.clone() } else { v.contiguous()? };
    let sequences = starts.elem_count() - 1;
    let (base, module, shared) = flash_kernel(tile, dim, q.dtype().size_in_bytes());
    let name = kernel_name(&base, q.dtype());
    let config = LaunchConfig {
        // Heads fastest, so that the longest query blocks of all heads start first (flash.cuh).
        grid_dim: (hq as u32, max_len.div_ceil(tile.0) as u32, sequences as u32),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let (hq32, hkv32) = (hq as i32, hkv as i32);
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let w32 = window.map_or(0, |w| w as i32);
    with_float_type!(q.dtype(), T => with_slice::<T, _>(q, |qs, qo, dev| {
        with_slice::<T, _>(k, |ks, ko, _| {
            with_view::<T, _>(&v, |vs, vo, v_strides, _| {
                with_slice::<i32, _>(starts, |ss, so, _| {
                    let func = kernel(dev, module, &name)?;
                    let (v_stride, v_head_stride) = (v_strides[0] as i32, v_strides[1] as i32);
                    // Over 48 KiB of dynamic shared memory must be allowed explicitly.
                    func.allow_shared_bytes(shared)?;
                    // SAFETY: every row of every sequence is written by exactly one block.
                    let out = unsafe { dev.alloc::<T>(tokens * hq * dim) }?;
                    let (qs, ks, vs, ss) = (qs.slice(qo..), ks.slice(ko..), vs.slice(vo..), ss.slice(so..));
                    let mut b = func.builder();
                    b.arg(&qs).arg(&ks).arg(&vs).arg(&out).arg(&ss).arg(&hq32).arg(&hkv32).arg(&scale_log2).arg(&w32);
                    b.arg(&v_stride).arg(&v_head_stride);
                    // SAFETY: arguments match `flash_attention_d*_r*_k*_*`.
                    unsafe { b.launch(config) }.w()?;
                    Ok(wrap(out, dev, (tokens, hq * dim)))
                })
            })
        })
    }))
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
            let func = kernel(dev, &ATTENTION, &name)?;
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

/// `cap · tanh(x / cap)` in one pass, rounded as candle's `(x / cap).tanh() * cap` rounds it:
/// `mul` and `cap` are `1 / cap` and `cap` as the dtype holds them (candle's affine takes
/// `T::from_f64`).
pub fn soft_cap(x: &Tensor, cap: f64) -> Result<Tensor> {
    let x = x.contiguous()?;
    let n = x.elem_count();
    let as_dtype = |v: f64| -> f32 {
        match x.dtype() {
            DType::BF16 => half::bf16::from_f64(v).to_f32(),
            DType::F16 => half::f16::from_f64(v).to_f32(),
            _ => v as f32,
        }
    };
    let (mul, cap) = (as_dtype(1.0 / cap), as_dtype(cap));
    let name = kernel_name("soft_cap", x.dtype());
    with_float_type!(x.dtype(), T => with_slice::<T, _>(&x, |xs, xo, dev| {
        let func = kernel(dev, &ATTENTION, &name)?;
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<T>(n) }?;
        let xs = xs.slice(xo..);
        let n64 = n as i64;
        let mut b = func.builder();
        b.arg(&xs).arg(&out).arg(&n64).arg(&mul).arg(&cap);
        // SAFETY: arguments match `soft_cap_*` (a grid-stride loop over n elements).
        unsafe { b.launch(grid_1d(n.min(1 << 22))) }.w()?;
        Ok(wrap(out, dev, x.dims()))
    }))
}
