//! Launches of `server/kernels/rope.cu`: RoPE, the per-head norm fused with it, and MLA's flash
//! inputs, on the projections' token-major layout `[tokens, heads, head_dim]`.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Result, Tensor};

use super::module::{kernel, ROPE};
use super::{grid_1d, kernel_name, rows_of_vectors, vector_kernel_name, with_slice, wrap};

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
                    let func = kernel(dev, &ROPE, &name)?;
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

/// The widest head `head_norm_rope*` (rope.cu) takes: 32 lanes of 8 values.
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
                    let func = kernel(dev, &ROPE, &name)?;
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

/// Values of each output per thread of `mla_flash_inputs` (rope.cu's `MLA_VALUES`).
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
                            let func = kernel(dev, &ROPE, &name)?;
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
