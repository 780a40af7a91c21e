//! Launches of `server/kernels/attention.cu`: RoPE and flash attention on the projections'
//! token-major layout `[tokens, heads, head_dim]`, for a whole batch of sequences at once.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Device, Result, Tensor};

use super::module::{kernel, KernelModule, ATTENTION, ATTENTION_SM90};
use super::{
    grid_1d, grid_rows, kernel_name, rows_of_vectors, vector_kernel_name, with_slice, with_view,
    wrap,
};

/// Threads per block of `flash_attention_*` (attention.cu).
const THREADS: u32 = 128;

/// Whether the wgmma flash kernel was built (for sm_90) and runs on `device` (a Hopper GPU).
pub fn wgmma_runs_on(device: &Device) -> Result<bool> {
    let Device::Cuda(dev) = device else {
        return Ok(false);
    };
    Ok(
        ATTENTION_SM90.is_built()
            && dev.cuda_stream().context().compute_capability().w()? == (9, 0),
    )
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
    // 16-byte vectors of 8 pairs when the halves and the tables' rows allow them.
    let per_thread = if rows_of_vectors(half, &[x, cos, sin]) {
        8
    } else {
        1
    };
    let groups = tokens * heads * half / per_thread;
    let name = vector_kernel_name("rope_rotate_half", per_thread == 8, x.dtype());
    with_float_type!(x.dtype(), T => with_slice::<T, _>(x, |xs, xo, dev| {
        with_slice::<i32, _>(positions, |ps, po, _| {
            with_slice::<T, _>(cos, |cs, co, _| {
                with_slice::<T, _>(sin, |ss, so, _| {
                    let func = kernel(dev, &ATTENTION, &name)?;
                    // SAFETY: the kernel writes every element.
                    let out = unsafe { dev.alloc::<T>(x.elem_count()) }?;
                    let (xs, ps, cs, ss) = (xs.slice(xo..), ps.slice(po..), cs.slice(co..), ss.slice(so..));
                    let (h32, half32, groups64) = (heads as i32, half as i32, groups as i64);
                    let mut b = func.builder();
                    b.arg(&xs).arg(&out).arg(&ps).arg(&cs).arg(&ss).arg(&h32).arg(&half32).arg(&groups64);
                    // SAFETY: arguments match `rope_rotate_half_*`.
                    unsafe { b.launch(grid_1d(groups)) }.w()?;
                    Ok(wrap(out, dev, (tokens, heads, dim)))
                })
            })
        })
    }))
}

/// The widest head `head_norm_rope*` (attention.cu) takes: 32 lanes of 8 values.
const HEAD_NORM_ROPE_DIM: usize = 256;

/// `x` `[tokens, heads, dim]` through the per-head RMSNorm (`norm`: weight `[dim]` in `x`'s
/// dtype or f32, and eps) and RoPE on the first `rot` values in one kernel (`head_norm_rope*`):
/// `None` where the heads or the tables do not fit it (f32, dim not a multiple of 8 or over
/// [`HEAD_NORM_ROPE_DIM`], `rot` not a multiple of 16, unaligned rows).
pub fn head_norm_rope(
    x: &Tensor,
    norm: Option<(&Tensor, f64)>,
    rot: usize,
    positions: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Option<Tensor>> {
    let (tokens, heads, dim) = x.dims3()?;
    let weight = norm.map(|(w, _)| w);
    let f32_weight = weight.is_some_and(|w| w.dtype() == DType::F32);
    let weight_fits = weight.is_none_or(|w| {
        w.dims() == [dim]
            && w.is_contiguous()
            && (f32_weight || w.dtype() == x.dtype())
            && rows_of_vectors(dim, &[w])
    });
    let tables_fit = cos.dims2()?.1 == rot / 2 && sin.dims() == cos.dims();
    let aligned = rows_of_vectors(dim, &[x]) && rows_of_vectors(rot / 2, &[cos, sin]);
    if x.dtype() == DType::F32
        || !x.is_contiguous()
        || dim > HEAD_NORM_ROPE_DIM
        || rot == 0
        || rot > dim
        || !rot.is_multiple_of(16)
        || !(weight_fits && tables_fit && aligned)
    {
        return Ok(None);
    }
    let lanes = (dim / 8).next_power_of_two().max(8);
    let base = match f32_weight {
        true => format!("head_norm_rope_f32w_l{lanes}"),
        false => format!("head_norm_rope_l{lanes}"),
    };
    let name = kernel_name(&base, x.dtype());
    let eps = norm.map_or(0.0, |(_, eps)| eps as f32);
    with_float_type!(x.dtype(), T => with_slice::<T, _>(x, |xs, xo, dev| {
        with_slice::<i32, _>(positions, |ps, po, _| {
            with_slice::<T, _>(cos, |cs, co, _| {
                with_slice::<T, _>(sin, |ss, so, _| {
                    let func = kernel(dev, &ATTENTION, &name)?;
                    // SAFETY: the kernel writes every element.
                    let out = unsafe { dev.alloc::<T>(x.elem_count().max(1)) }?;
                    let (xs, ps, cs, ss) = (xs.slice(xo..), ps.slice(po..), cs.slice(co..), ss.slice(so..));
                    let rows = (tokens * heads) as i64;
                    let dims = [heads, dim, rot].map(|v| v as i32);
                    // The weight's argument: its view, or a null pointer (no norm).
                    macro_rules! launch {
                        ($weight:expr) => {{
                            let mut b = func.builder();
                            b.arg(&xs).arg($weight).arg(&out).arg(&ps).arg(&cs).arg(&ss).arg(&rows);
                            for d in &dims {
                                b.arg(d);
                            }
                            b.arg(&eps);
                            // SAFETY: arguments match `head_norm_rope{,_f32w}_l{lanes}_*` (`lanes`
                            // threads per head; shapes and alignment checked above).
                            unsafe { b.launch(grid_1d(tokens * heads * lanes)) }.w()?;
                        }};
                    }
                    match weight {
                        Some(w) => with_float_type!(w.dtype(), W => with_slice::<W, _>(w, |ws, wo, _| {
                            let view = ws.slice(wo..);
                            launch!(&view);
                            Ok(())
                        }))?,
                        None => {
                            let null = 0u64;
                            launch!(&null)
                        }
                    }
                    Ok(Some(wrap(out, dev, (tokens, heads, dim))))
                })
            })
        })
    }))
}

/// Values of each output per thread of `mla_flash_inputs` (attention.cu's `MLA_VALUES`).
const MLA_VALUES: usize = 8;

/// MLA's flash inputs (`mla_flash_inputs` in the kernels): `q` `[tokens, heads * (nope + rot)]`,
/// `kv` `[tokens, heads * (nope + v)]`, `k_rot` `[tokens, rot]`, optional per-token query
/// scales `[tokens]`; returns q, k and (where `values`) v `[tokens, heads, width]`, zero-padded.
#[allow(clippy::too_many_arguments)]
pub fn mla_flash_inputs(
    q: &Tensor,
    kv: &Tensor,
    k_rot: &Tensor,
    positions: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    query_scale: Option<&Tensor>,
    (heads, nope, rot, v_dim, width, interleave): (usize, usize, usize, usize, usize, bool),
    values: bool,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let (q, kv, k_rot) = (q.contiguous()?, kv.contiguous()?, k_rot.contiguous()?);
    let tokens = q.dims()[0];
    if q.dims() != [tokens, heads * (nope + rot)]
        || kv.dims() != [tokens, heads * (nope + v_dim)]
        || k_rot.dims() != [tokens, rot]
        || rot % 2 != 0
        || width < (nope + rot).max(v_dim)
        || !width.is_multiple_of(MLA_VALUES)
        || tokens * heads * width / MLA_VALUES > i32::MAX as usize
    {
        bail!(
            "mla_flash_inputs: q {:?}, kv {:?}, k_rot {:?} for {heads} heads of {nope} + {rot} / \
             {v_dim} in {width}",
            q.dims(),
            kv.dims(),
            k_rot.dims()
        );
    }
    let n = tokens * heads * width;
    let threads = n / MLA_VALUES;
    let scale = query_scale
        .map(|s| s.to_dtype(q.dtype())?.contiguous())
        .transpose()?;
    let name = kernel_name("mla_flash_inputs", q.dtype());
    with_float_type!(q.dtype(), T => with_slice::<T, _>(&q, |qs, qo, dev| {
        with_slice::<T, _>(&kv, |kvs, kvo, _| {
            with_slice::<T, _>(&k_rot, |krs, kro, _| {
                with_slice::<i32, _>(positions, |ps, po, _| {
                    with_slice::<T, _>(cos, |cs, co, _| {
                        with_slice::<T, _>(sin, |ss, so, _| {
                            let func = kernel(dev, &ATTENTION, &name)?;
                            // SAFETY: the kernel writes every element of the outputs.
                            let (qo_, ko_) = unsafe { (dev.alloc::<T>(n.max(1))?, dev.alloc::<T>(n.max(1))?) };
                            let vo_ = values.then(|| unsafe { dev.alloc::<T>(n.max(1)) }).transpose()?;
                            let (qs, kvs, krs) = (qs.slice(qo..), kvs.slice(kvo..), krs.slice(kro..));
                            let (ps, cs, ss) = (ps.slice(po..), cs.slice(co..), ss.slice(so..));
                            let dims = [tokens, heads, nope, rot, v_dim, width].map(|v| v as i32);
                            let interleave = i32::from(interleave);
                            // 16-byte loads: every chunk of 8 in one part and one rotary half,
                            // every row aligned
                            let aligned = [nope, v_dim, qo, kvo, kro, co, so]
                                .iter()
                                .all(|v| v.is_multiple_of(MLA_VALUES));
                            let vec = i32::from(aligned && rot.is_multiple_of(2 * MLA_VALUES));
                            let null = 0u64;
                            // The scales' argument: their view, or a null pointer; the values'
                            // output, or a null pointer.
                            macro_rules! launch {
                                ($scales:expr) => {{
                                    let mut b = func.builder();
                                    b.arg(&qs).arg(&kvs).arg(&krs).arg(&ps).arg(&cs).arg(&ss);
                                    b.arg($scales).arg(&qo_).arg(&ko_);
                                    match &vo_ {
                                        Some(vo_) => b.arg(vo_),
                                        None => b.arg(&null),
                                    };
                                    for d in &dims {
                                        b.arg(d);
                                    }
                                    b.arg(&interleave).arg(&vec);
                                    // SAFETY: arguments match `mla_flash_inputs_*` (one thread
                                    // per 8 values of each output, 16-byte aligned as `width`
                                    // is a multiple of 8).
                                    unsafe { b.launch(grid_1d(threads)) }.w()?;
                                }};
                            }
                            match &scale {
                                Some(scale) => with_slice::<T, _>(scale, |sc, sco, _| {
                                    let view = sc.slice(sco..);
                                    launch!(&view);
                                    Ok(())
                                })?,
                                None => launch!(&null),
                            }
                            let shape = (tokens, heads, width);
                            let v = vo_.map(|vo_| wrap(vo_, dev, shape));
                            Ok((wrap(qo_, dev, shape), wrap(ko_, dev, shape), v))
                        })
                    })
                })
            })
        })
    }))
}

/// Causal softmax attention of `q` `[tokens, hq, d]` over `k`, `v` `[tokens, hkv, d]` for the
/// sequences whose token ranges are `starts[i]..starts[i + 1]` (i32, on the device); `max_len`
/// is the longest of them. `v` may be a view whose tokens and heads lie apart by multiples of 8
/// values (MLA's values within its `[tokens, heads, nope + v]` rows), else it is copied. Returns `[tokens, hq * d]` in the compute dtype. Scores and the
/// softmax state stay in f32 on chip; nothing of size T×T is written. `tile`: the tiling
/// (`ops::FlashTiling`, which checks that it was compiled for this head size).
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
