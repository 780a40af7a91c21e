//! Launches of kernels/norm.cu: RMSNorm and the gated activations.
// Kernel launches are FFI: the argument lists below must match the kernel signatures.

use candle_core::cuda_backend::cudarc::driver::{LaunchArgs, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Result, Tensor};

use super::module::{kernel, NORM};
use super::{dequant::qdq_fp8, grid_1d, grid_rows, kernel_name, rows_of_vectors, with_slice, wrap};

/// transformers' RMSNorm of `x` over the last dimension, in one pass: the normalised,
/// weighted rows. With `fp8_qdq`, they then go through the per-token fp8 QDQ (as [`qdq_fp8`]
/// without a static scale), in the same kernel when the rows allow vectors. Rows of vectors
/// run a warp each, or, up to [`NARROW_COLS`] values (per-head norms), a few lanes each; the
/// same bits as a block per row.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32, fp8_qdq: bool) -> Result<Tensor> {
    launch_rms_norm(x, weight, eps, fp8_qdq, true)
}

/// [`rms_norm`] with a block per row whatever the row's width: the reference that
/// `exactscore-bench check` holds the warp and lane kernels to, bit for bit.
pub fn rms_norm_block_per_row(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    launch_rms_norm(x, weight, eps, false, false)
}

/// [`rms_norm`] of `x` (`[rows, cols]`, bf16/f16) written as e4m3 codes and one f32 scale per
/// row, per token or `static_scale`: the codes that `fp8_gemm`'s `quantize_fp8_rows` gives the
/// normed rows, in the same pass (`rms_norm{,_f32w}_warp_fp8_codes`, a warp per row, the normed
/// row in shared memory: [`FP8_CODES_SHARED_BYTES`]). Other rows are normed, then quantized.
pub fn rms_norm_fp8_rows(
    x: &Tensor,
    weight: &Tensor,
    eps: f32,
    static_scale: Option<f32>,
) -> Result<(Tensor, Tensor)> {
    let x = x.contiguous()?;
    let (rows, cols) = x.dims2()?;
    let base = rms_norm_family(&x, weight, cols)?;
    if x.dtype() == DType::F32 {
        bail!("rms_norm_fp8_rows: fp8 codes of bf16 or f16 rows, not f32");
    }
    let row_bytes = cols * x.dtype().size_in_bytes();
    if !rows_of_vectors(cols, &[&x, weight]) || row_bytes > FP8_CODES_SHARED_BYTES {
        let normed = rms_norm(&x, weight, eps, false)?;
        return super::fp8_gemm::quantize_fp8_rows(&normed, static_scale);
    }
    let name = kernel_name(&format!("{base}_warp_fp8_codes"), x.dtype());
    // a warp and a normed row in shared memory per row, up to 8 rows a block
    let warps = (FP8_CODES_SHARED_BYTES / row_bytes).clamp(1, 8);
    let shared = warps * row_bytes;
    let config = LaunchConfig {
        grid_dim: (rows.div_ceil(warps).max(1) as u32, 1, 1),
        block_dim: (warps as u32 * 32, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    with_float_type!(x.dtype(), T => with_slice::<T, _>(&x, |xs, xo, dev| {
        with_float_type!(weight.dtype(), W => with_slice::<W, _>(weight, |ws, wo, _| {
            let func = kernel(dev, &NORM, &name)?;
            func.allow_shared_bytes(shared)?;
            // SAFETY: the kernel writes every code and every scale.
            let codes = unsafe { dev.alloc::<u8>(rows * cols) }?;
            let scales = unsafe { dev.alloc::<f32>(rows) }?;
            if rows > 0 {
                let (xs, ws) = (xs.slice(xo..), ws.slice(wo..));
                let (rows64, c32, s) = (rows as i64, cols as i32, static_scale.unwrap_or(0.0));
                let mut b = func.builder();
                b.arg(&xs).arg(&ws).arg(&codes).arg(&scales).arg(&rows64).arg(&c32).arg(&eps).arg(&s);
                // SAFETY: arguments match `rms_norm{,_f32w}_warp_fp8_codes_*` (a warp per row and
                // its normed row in shared memory; aligned vectors checked above, the weight's
                // type by `rms_norm_family`).
                unsafe { b.launch(config) }.w()?;
            }
            Ok((wrap(codes, dev, (rows, cols)), wrap(scales, dev, rows)))
        }))
    }))
}

/// The RMSNorm kernel family for `x`'s rows of `cols` values and `weight`: `rms_norm`, or
/// `rms_norm_f32w` for an f32 weight beside a narrower x (multiplied in f32: GemmaRMSNorm's
/// `1 + w`); an error for a weight of another length or dtype.
fn rms_norm_family(x: &Tensor, weight: &Tensor, cols: usize) -> Result<&'static str> {
    let f32_weight = weight.dtype() == DType::F32 && x.dtype() != DType::F32;
    if weight.dims() != [cols] || !(weight.dtype() == x.dtype() || f32_weight) {
        bail!(
            "rms_norm: x {:?} {:?}, weight {:?} {:?}",
            x.dims(),
            x.dtype(),
            weight.dims(),
            weight.dtype()
        );
    }
    Ok(if f32_weight {
        "rms_norm_f32w"
    } else {
        "rms_norm"
    })
}

/// Shared memory for the normed rows of a block of `rms_norm_warp_fp8_codes`: within the
/// 99 KiB a block may take on Ada (Hopper: 227), the oldest GPUs with fp8 tensor cores. Rows of
/// up to 6144 values go 8 to a block, wider ones fewer.
const FP8_CODES_SHARED_BYTES: usize = 96 << 10;

/// The widest row `rms_norm_narrow*` (norm.cu) takes: 32 lanes of 8 values; wider rows run
/// `rms_norm_warp*`.
const NARROW_COLS: usize = 256;

/// Ends a norm kernel's arguments and launches it: `lanes` threads per row (then `rows, cols,
/// eps`), or one 256-thread block per row (then `cols, eps`).
///
/// # Safety
/// `b` holds the kernel's leading arguments, and its signature ends as described.
unsafe fn launch_rows<'a>(
    mut b: LaunchArgs<'a>,
    lanes: Option<usize>,
    (rows, cols, eps): (&'a i64, &'a i32, &'a f32),
) -> Result<()> {
    match lanes {
        Some(lanes) => {
            b.arg(rows).arg(cols).arg(eps);
            // SAFETY: the caller's.
            unsafe { b.launch(grid_1d(*rows as usize * lanes)) }.w()?;
        }
        None => {
            b.arg(cols).arg(eps);
            // SAFETY: the caller's.
            unsafe { b.launch(grid_rows(*rows as usize)) }.w()?;
        }
    }
    Ok(())
}

fn launch_rms_norm(
    x: &Tensor,
    weight: &Tensor,
    eps: f32,
    fp8_qdq: bool,
    narrow_rows: bool,
) -> Result<Tensor> {
    let x = x.contiguous()?;
    let dims = x.dims().to_vec();
    let cols = *dims.last().unwrap_or(&0);
    let rows = x.elem_count() / cols.max(1);
    let base = rms_norm_family(&x, weight, cols)?;
    let vectors = rows_of_vectors(cols, &[&x, weight]);
    // threads per row (lanes of 8 values: a power of two, at least 8; or a warp) where rows
    // share a block
    let lanes =
        (narrow_rows && vectors && !fp8_qdq).then(|| (cols / 8).next_power_of_two().clamp(8, 32));
    let variant = match (lanes, vectors, fp8_qdq) {
        (Some(_), ..) if cols > NARROW_COLS => format!("{base}_warp"),
        (Some(lanes), ..) => format!("{base}_narrow{lanes}"),
        (None, true, true) => format!("{base}_v8_fp8_qdq"),
        (None, true, false) => format!("{base}_v8"),
        (None, false, _) => base.to_string(),
    };
    let name = kernel_name(&variant, x.dtype());
    with_float_type!(x.dtype(), T => with_slice::<T, _>(&x, |xs, xo, dev| {
        with_float_type!(weight.dtype(), W => with_slice::<W, _>(weight, |ws, wo, _| {
            let func = kernel(dev, &NORM, &name)?;
            // SAFETY: the kernel writes every element of `out`.
            let out = unsafe { dev.alloc::<T>(rows * cols) }?;
            let (xs, ws) = (xs.slice(xo..), ws.slice(wo..));
            let (c32, rows64) = (cols as i32, rows as i64);
            let mut b = func.builder();
            b.arg(&xs).arg(&ws).arg(&out);
            // SAFETY: `rms_norm{,_f32w}_{narrow{lanes},warp}_*` (lanes per row) and
            // `rms_norm{,_f32w}{,_v8,_v8_fp8_qdq}_*` (a block per row) take these arguments,
            // then the ones launch_rows adds; aligned vectors checked above, the weight's type by
            // `f32_weight`.
            unsafe { launch_rows(b, lanes, (&rows64, &c32, &eps)) }?;
            let out = wrap(out, dev, dims.clone());
            if fp8_qdq && !vectors { qdq_fp8(&out, None) } else { Ok(out) }
        }))
    }))
}

/// transformers' gated RMSNorm of `x` over its last dimension, gated by `z` (same shape and
/// dtype): `round(w · round(x̂) · silu(z))`, the weight's product kept in f32 for an f32 weight
/// and rounded to the compute dtype for a weight in it. A block per row, or a few lanes per row
/// of at most [`NARROW_COLS`] values (Gated DeltaNet's heads): the same bits.
pub fn gated_rms_norm(x: &Tensor, weight: &Tensor, z: &Tensor, eps: f32) -> Result<Tensor> {
    launch_gated_rms_norm(x, weight, z, eps, true)
}

/// [`gated_rms_norm`] with a block per row whatever the row's width: `check`'s reference for
/// the narrow rows' kernel.
pub fn gated_rms_norm_block_per_row(
    x: &Tensor,
    weight: &Tensor,
    z: &Tensor,
    eps: f32,
) -> Result<Tensor> {
    launch_gated_rms_norm(x, weight, z, eps, false)
}

fn launch_gated_rms_norm(
    x: &Tensor,
    weight: &Tensor,
    z: &Tensor,
    eps: f32,
    narrow_rows: bool,
) -> Result<Tensor> {
    let (x, z) = (x.contiguous()?, z.contiguous()?);
    let dims = x.dims().to_vec();
    let cols = *dims.last().unwrap_or(&0);
    let rows = x.elem_count() / cols.max(1);
    let f32_weight = weight.dtype() == DType::F32 && x.dtype() != DType::F32;
    if weight.dims() != [cols]
        || !(weight.dtype() == x.dtype() || f32_weight)
        || z.dims() != x.dims()
        || z.dtype() != x.dtype()
    {
        bail!(
            "gated_rms_norm: x {dims:?} {:?}, weight {:?} {:?}, z {:?} {:?}",
            x.dtype(),
            weight.dims(),
            weight.dtype(),
            z.dims(),
            z.dtype()
        );
    }
    let base = if f32_weight {
        "gated_rms_norm_f32w"
    } else {
        "gated_rms_norm"
    };
    // lanes per row: 8 values each, a power of two from 4 to 32
    let lanes =
        (narrow_rows && cols <= NARROW_COLS).then(|| (cols.next_power_of_two() / 8).clamp(4, 32));
    let name = match lanes {
        Some(lanes) => kernel_name(&format!("{base}_narrow{lanes}"), x.dtype()),
        None => kernel_name(base, x.dtype()),
    };
    with_float_type!(x.dtype(), T => with_slice::<T, _>(&x, |xs, xo, dev| {
        with_slice::<T, _>(&z, |zs, zo, _| {
            with_float_type!(weight.dtype(), W => with_slice::<W, _>(weight, |ws, wo, _| {
                let func = kernel(dev, &NORM, &name)?;
                // SAFETY: the kernel writes every element of `out`.
                let out = unsafe { dev.alloc::<T>(rows * cols) }?;
                let (xs, zs, ws) = (xs.slice(xo..), zs.slice(zo..), ws.slice(wo..));
                let (c32, rows64) = (cols as i32, rows as i64);
                let mut b = func.builder();
                b.arg(&xs).arg(&ws).arg(&zs).arg(&out);
                // SAFETY: `gated_rms_norm{,_f32w}{,_narrow{lanes}}_*` take these arguments, then
                // the ones launch_rows adds; the weight's type by `f32_weight`.
                unsafe { launch_rows(b, lanes, (&rows64, &c32, &eps)) }?;
                Ok(wrap(out, dev, dims.clone()))
            }))
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

/// `gate` and `up` contiguous, checked to be of one shape and dtype with rows of a multiple of
/// 8 elements; and that row length.
fn gate_and_up(base: &str, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor, usize)> {
    let (gate, up) = (gate.contiguous()?, up.contiguous()?);
    if gate.dims() != up.dims() || gate.dtype() != up.dtype() {
        bail!(
            "{base}: gate {:?} and up {:?} differ",
            gate.dims(),
            up.dims()
        );
    }
    let row = *gate.dims().last().unwrap_or(&0);
    if gate.elem_count() % 8 != 0 || row % 8 != 0 {
        bail!(
            "{base} needs rows of a multiple of 8 elements, got {:?}",
            gate.dims()
        );
    }
    Ok((gate, up, row))
}

/// Rows the fused gated activation keeps in shared memory (`k` values of the compute dtype),
/// up to what every fp8 GPU grants a block (Ada: 99 KiB); longer rows are written and then
/// quantized.
const FUSED_ROW_BYTES: usize = 96 << 10;

/// `act(gate) * up` (`gate`, `up`: `[rows, k]`, bf16/f16) by the kernel family `base`
/// (`silu_mul`, `gelu_tanh_mul`), rounded as [`silu_mul`] rounds it and written as e4m3 codes
/// and one f32 scale per row, per token or `static_scale`: the codes `fp8_gemm`'s
/// `quantize_fp8_rows` gives that product, in the same pass.
pub fn gated_mul_fp8_rows(
    base: &str,
    gate: &Tensor,
    up: &Tensor,
    static_scale: Option<f32>,
) -> Result<(Tensor, Tensor)> {
    let (gate, up, k) = gate_and_up(base, gate, up)?;
    let (rows, _) = gate.dims2()?;
    if gate.dtype() == DType::F32 {
        bail!("{base}: fp8 codes of bf16 or f16 products, not f32");
    }
    let row_bytes = k * gate.dtype().size_in_bytes();
    if row_bytes > FUSED_ROW_BYTES {
        let product = gated_mul(base, &gate, &up, false)?;
        return super::fp8_gemm::quantize_fp8_rows(&product, static_scale);
    }
    let name = kernel_name(&format!("{base}_fp8_codes"), gate.dtype());
    with_float_type!(gate.dtype(), T => with_slice::<T, _>(&gate, |gs, go, dev| {
        with_slice::<T, _>(&up, |us, uo, _| {
            if go % 8 != 0 || uo % 8 != 0 {
                bail!("{base} needs 16-byte aligned inputs");
            }
            let func = kernel(dev, &NORM, &name)?;
            func.allow_shared_bytes(row_bytes)?;
            // SAFETY: the kernel writes every code and every scale.
            let codes = unsafe { dev.alloc::<u8>(rows * k) }?;
            let scales = unsafe { dev.alloc::<f32>(rows) }?;
            if rows > 0 {
                let (gs, us) = (gs.slice(go..), us.slice(uo..));
                let (k32, s) = (k as i32, static_scale.unwrap_or(0.0));
                let mut b = func.builder();
                b.arg(&gs).arg(&us).arg(&codes).arg(&scales).arg(&k32).arg(&s);
                let config = LaunchConfig {
                    shared_mem_bytes: row_bytes as u32,
                    ..grid_rows(rows)
                };
                // SAFETY: arguments match `*_mul_fp8_codes_*` (one 256-thread block per row,
                // a row of products in shared memory).
                unsafe { b.launch(config) }.w()?;
            }
            Ok((wrap(codes, dev, (rows, k)), wrap(scales, dev, rows)))
        })
    }))
}

/// `act(gate) * up` by the kernel family `base` (`silu_mul`, `gelu_tanh_mul`).
fn gated_mul(base: &str, gate: &Tensor, up: &Tensor, fp8_qdq: bool) -> Result<Tensor> {
    let (gate, up, row) = gate_and_up(base, gate, up)?;
    let n = gate.elem_count();
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
            let func = kernel(dev, &NORM, &name)?;
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
