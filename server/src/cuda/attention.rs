//! Launches of `server/kernels/attention.cu`: RoPE and flash attention on the projections'
//! token-major layout `[tokens, heads, head_dim]`, for a whole batch of sequences at once.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Result, Tensor};

use super::module::{kernel, ATTENTION};
use super::{grid_1d, kernel_name, with_slice, wrap};

/// Query rows per block and threads per block of `flash_attention_*` (attention.cu).
const ROWS_PER_BLOCK: usize = 64;
const THREADS: u32 = 128;

/// Whether [`flash_attention`] has a kernel for this head size and compute dtype.
pub fn flash_attention_supported(head_dim: usize, dtype: DType) -> bool {
    matches!(head_dim, 64 | 128) && matches!(dtype, DType::BF16 | DType::F16)
}

/// RoPE (`rotate_half` convention) of `x` `[tokens, heads, head_dim]`; `positions[token]` indexes
/// the `cos`/`sin` tables `[max_len, head_dim / 2]` (same dtype as `x`).
pub fn rope_rotate_half(
    x: &Tensor,
    positions: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let (tokens, heads, dim) = x.dims3()?;
    let half = dim / 2;
    let pairs = tokens * heads * half;
    let name = kernel_name("rope_rotate_half", x.dtype());
    with_float_type!(x.dtype(), T => with_slice::<T, _>(x, |xs, xo, dev| {
        with_slice::<i32, _>(positions, |ps, po, _| {
            with_slice::<T, _>(cos, |cs, co, _| {
                with_slice::<T, _>(sin, |ss, so, _| {
                    let func = kernel(dev, &ATTENTION, &name)?;
                    // SAFETY: the kernel writes every element.
                    let out = unsafe { dev.alloc::<T>(x.elem_count()) }?;
                    let (xs, ps, cs, ss) = (xs.slice(xo..), ps.slice(po..), cs.slice(co..), ss.slice(so..));
                    let (h32, half32, pairs64) = (heads as i32, half as i32, pairs as i64);
                    let mut b = func.builder();
                    b.arg(&xs).arg(&out).arg(&ps).arg(&cs).arg(&ss).arg(&h32).arg(&half32).arg(&pairs64);
                    // SAFETY: arguments match `rope_rotate_half_*`.
                    unsafe { b.launch(grid_1d(pairs)) }.w()?;
                    Ok(wrap(out, dev, (tokens, heads, dim)))
                })
            })
        })
    }))
}

/// Causal softmax attention of `q` `[tokens, hq, d]` over `k`, `v` `[tokens, hkv, d]` for the
/// sequences whose token ranges are `starts[i]..starts[i + 1]` (i32, on the device); `max_len`
/// is the longest of them. Returns `[tokens, hq * d]` in the compute dtype. Scores and the
/// softmax state stay in f32 on chip; nothing of size T×T is written.
pub fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    starts: &Tensor,
    max_len: usize,
    scale: f32,
    window: Option<usize>,
) -> Result<Tensor> {
    let (tokens, hq, dim) = q.dims3()?;
    let (_, hkv, _) = k.dims3()?;
    if !flash_attention_supported(dim, q.dtype()) || hq % hkv != 0 || v.dims3()? != k.dims3()? {
        bail!(
            "flash attention: unsupported shapes q {:?} k {:?} v {:?} ({:?})",
            q.dims(),
            k.dims(),
            v.dims(),
            q.dtype()
        );
    }
    let sequences = starts.elem_count() - 1;
    let name = kernel_name(&format!("flash_attention_d{dim}"), q.dtype());
    let config = LaunchConfig {
        grid_dim: (
            max_len.div_ceil(ROWS_PER_BLOCK) as u32,
            hq as u32,
            sequences as u32,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    with_float_type!(q.dtype(), T => with_slice::<T, _>(q, |qs, qo, dev| {
        with_slice::<T, _>(k, |ks, ko, _| {
            with_slice::<T, _>(v, |vs, vo, _| {
                with_slice::<i32, _>(starts, |ss, so, _| {
                    let func = kernel(dev, &ATTENTION, &name)?;
                    // SAFETY: every row of every sequence is written by exactly one block.
                    let out = unsafe { dev.alloc::<T>(tokens * hq * dim) }?;
                    let (qs, ks, vs, ss) = (qs.slice(qo..), ks.slice(ko..), vs.slice(vo..), ss.slice(so..));
                    let (hq32, hkv32) = (hq as i32, hkv as i32);
                    let scale_log2 = scale * std::f32::consts::LOG2_E;
                    let w32 = window.map_or(0, |w| w as i32);
                    let mut b = func.builder();
                    b.arg(&qs).arg(&ks).arg(&vs).arg(&out).arg(&ss).arg(&hq32).arg(&hkv32).arg(&scale_log2).arg(&w32);
                    // SAFETY: arguments match `flash_attention_d{64,128}_*`.
                    unsafe { b.launch(config) }.w()?;
                    Ok(wrap(out, dev, (tokens, hq * dim)))
                })
            })
        })
    }))
}
