//! Launches of kernels/dequant.cu: the packed formats' dequantization and the activation QDQ;
//! the int4 GEMM that decodes inside the product is in [`int4_gemm`].
// Kernel launches are FFI: the argument lists below must match the kernel signatures.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Result, Tensor};

mod int4_gemm;

pub use int4_gemm::*;

use super::module::{kernel, DEQUANT};
use super::{
    device_address, dtype_suffix, grid_1d, grid_row_items, grid_rows, kernel_name, rows_of_vectors,
    vector_kernel_name, with_slice, wrap,
};

/// pack-quantized int4/int8 → `[rows, cols]` in `dtype`. `scales`: `[rows, groups]` in f32, bf16
/// or f16 (as stored); `zero_points`: `[rows, groups]`, i32 or u8 holding i8, or `None`
/// (symmetric).
#[allow(clippy::too_many_arguments)]
pub fn dequant_int(
    codes: &Tensor,
    scales: &Tensor,
    zero_points: Option<&Tensor>,
    g_idx: Option<&Tensor>,
    (rows, cols): (usize, usize),
    bits: usize,
    group: usize,
    dtype: DType,
) -> Result<Tensor> {
    let words_per_row = codes.dims()[1];
    let per = 32 / bits;
    // Fast kernel when each int32 word lies inside one group (every real model without
    // act-order).
    let words_kernel = g_idx.is_none() && group.is_multiple_of(per) && cols.is_multiple_of(per);
    let groups = scales.dims()[1] as i32;
    // act-order: the group of each column, u32 on the device (or a null pointer)
    let g_idx = g_idx.map(Tensor::contiguous).transpose()?;
    let base = match (words_kernel, bits) {
        (true, 4) => "dequant_int4_words",
        (true, _) => "dequant_int8_words",
        (false, _) => "dequant_int",
    };
    let name = int_kernel_name(base, scales, zero_points, dtype)?;
    let scales = scale_address(scales)?;
    let zero_points = zero_point_address(zero_points)?;
    let launch = |gi: Option<(&CudaSlice<u32>, usize)>| -> Result<Tensor> {
        with_slice::<i32, _>(codes, |codes, co, dev| {
            with_float_type!(dtype, T => {
                let func = kernel(dev, &DEQUANT, &name)?;
                // SAFETY: the kernel writes every element.
                let out = unsafe { dev.alloc::<T>(rows * cols) }?;
                let codes = codes.slice(co..);
                let null = 0u64;
                let mut b = func.builder();
                b.arg(&codes).arg(&scales).arg(&zero_points).arg(&out);
                let (r, c, w, bi, g) = (rows as i32, cols as i32, words_per_row as i32, bits as i32, group as i32);
                b.arg(&r).arg(&c);
                if !words_kernel {
                    b.arg(&w).arg(&bi);
                }
                b.arg(&g);
                let gi_view = gi.map(|(g, go)| g.slice(go..));
                if !words_kernel {
                    match &gi_view {
                        Some(gi) => b.arg(gi),
                        None => b.arg(&null),
                    };
                    b.arg(&groups);
                }
                let config = if words_kernel {
                    grid_row_items(rows, words_per_row)
                } else {
                    grid_1d(rows * words_per_row)
                };
                // SAFETY: arguments match `dequant_int_s*` / `dequant_int{4,8}_words_s*`;
                // the scales and zero points (the caller's) outlive the launch (the stream
                // orders any later free).
                unsafe { b.launch(config) }.w()?;
                Ok(wrap(out, dev, (rows, cols)))
            })
        })
    };
    match &g_idx {
        Some(g) => with_slice::<u32, _>(g, |gi, go, _| launch(Some((gi, go)))),
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
    let (_, scales, zero_points) = weights[0];
    let name = int_kernel_name(
        &format!("dequant_int{bits}_words_stacked"),
        scales,
        zero_points,
        dtype,
    )?;
    with_slice::<i32, _>(first, |_, _, dev| {
        with_float_type!(dtype, T => {
            let func = kernel(dev, &DEQUANT, &name)?;
            let addresses = dev.clone_htod(&addresses)?;
            let n = weights.len();
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(n * rows * cols) }?;
            let (r, c, g) = (rows as i32, cols as i32, group as i32);
            let mut b = func.builder();
            b.arg(&addresses).arg(&out).arg(&r).arg(&c).arg(&g);
            let mut config = grid_row_items(rows, cols / per);
            config.grid_dim.2 = n as u32;
            // SAFETY: arguments match `dequant_int{4,8}_words_stacked_s*`; every address was
            // checked against its weight's shape above, and the weights outlive the launch
            // (the caller holds them; the stream orders it before any later free).
            unsafe { b.launch(config) }.w()?;
            Ok(Some(wrap(out, dev, (n, rows, cols))))
        })
    })
}

/// The device addresses of a stack's (codes, scales, zero points or 0), three per weight, as the
/// `_stacked` kernels take them; every weight must be `[rows, cols]` of `bits`-bit codes in
/// groups of `group`, its scales and zero points (or none) as the first one's.
fn stack_addresses(
    weights: &[(&Tensor, &Tensor, Option<&Tensor>)],
    (rows, cols): (usize, usize),
    bits: usize,
    group: usize,
) -> Result<Vec<u64>> {
    let per = 32 / bits;
    let mut addresses = Vec::with_capacity(3 * weights.len());
    for &(codes, scales, zero_points) in weights {
        let zp_dtype = |z: Option<&Tensor>| z.map(Tensor::dtype);
        if codes.dims() != [rows, cols / per]
            || scales.dims() != [rows, cols / group]
            || scales.dtype() != weights[0].1.dtype()
            || zp_dtype(zero_points) != zp_dtype(weights[0].2)
        {
            bail!(
                "stacked int{bits} weights: codes {:?} and scales {:?} ({:?}) for a [{rows}, {cols}] \
                 weight, zero points {:?} where the first's are {:?}",
                codes.dims(),
                scales.dims(),
                scales.dtype(),
                zp_dtype(zero_points),
                zp_dtype(weights[0].2),
            );
        }
        addresses.push(device_address::<i32>(codes)?);
        addresses.push(scale_address(scales)?);
        addresses.push(zero_point_address(zero_points)?);
    }
    Ok(addresses)
}

/// The name of the int kernel `base` for the scales' dtype, the zero points' and the output's:
/// `{base}_s{scales}[_z8]_{dtype}` (`_z8`: byte zero points; i32 ones and none take the
/// plain kernel).
fn int_kernel_name(
    base: &str,
    scales: &Tensor,
    zero_points: Option<&Tensor>,
    dtype: DType,
) -> Result<String> {
    if !matches!(scales.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        bail!("int weights with {:?} scales", scales.dtype());
    }
    let bytes = match zero_points.map(Tensor::dtype) {
        Some(DType::U8) => "_z8",
        None | Some(DType::I32) => "",
        Some(other) => bail!("int weights with {other:?} zero points"),
    };
    Ok(kernel_name(
        &format!("{base}_s{}{bytes}", dtype_suffix(scales.dtype())),
        dtype,
    ))
}

/// The device address of a weight's scales (f32, bf16 or f16).
fn scale_address(scales: &Tensor) -> Result<u64> {
    with_float_type!(scales.dtype(), S => device_address::<S>(scales))
}

/// The device address of a weight's zero points (u8 or i32), 0 where it has none.
fn zero_point_address(zero_points: Option<&Tensor>) -> Result<u64> {
    match zero_points {
        None => Ok(0),
        Some(z) if z.dtype() == DType::U8 => device_address::<u8>(z),
        Some(z) => device_address::<i32>(z),
    }
}

/// nvfp4 → `[rows, cols]` in `dtype`: the fp8 scales divided by the per-tensor scale and each
/// value rounded to bf16 (compressed-tensors), or with `multiplies` times it, kept in f32
/// (ModelOpt), as the references in quant/nvfp4.rs.
pub fn dequant_nvfp4(
    packed: &Tensor,
    scales: &Tensor,
    (per_tensor, multiplies): (f32, bool),
    (rows, cols): (usize, usize),
    dtype: DType,
) -> Result<Tensor> {
    let name = kernel_name("dequant_nvfp4", dtype);
    with_slice::<u8, _>(packed, |packed, po, dev| {
        with_slice::<u8, _>(scales, |scales, so, _| {
            with_float_type!(dtype, T => {
                let func = kernel(dev, &DEQUANT, &name)?;
                // SAFETY: the kernel writes every element.
                let out = unsafe { dev.alloc::<T>(rows * cols) }?;
                let (packed, scales) = (packed.slice(po..), scales.slice(so..));
                let (r, c) = (rows as i32, cols as i32);
                let multiplies = i32::from(multiplies);
                let mut b = func.builder();
                b.arg(&packed).arg(&scales).arg(&per_tensor).arg(&multiplies);
                b.arg(&out).arg(&r).arg(&c);
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
                let func = kernel(dev, &DEQUANT, &name)?;
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
        let func = kernel(dev, &DEQUANT, &name)?;
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

/// int8 per-token QDQ of `x` `[rows, k]` (vLLM's dynamic symmetric scales).
pub fn qdq_int8_token(x: &Tensor) -> Result<Tensor> {
    qdq_rows(x, "qdq_int8_token", &[])
}

/// fp8 QDQ of `x` `[rows, k]` with one dynamic scale per token and `group` inputs (rounded up
/// to a power of two with `power_of_two`).
pub fn qdq_fp8_group(x: &Tensor, group: usize, power_of_two: bool) -> Result<Tensor> {
    if group == 0 {
        bail!("fp8 group QDQ needs a group of at least one input");
    }
    qdq_rows(x, "qdq_fp8_group", &[group as i32, i32::from(power_of_two)])
}

/// A QDQ kernel that takes one 256-thread block per row: (x, out, k, extra...).
fn qdq_rows(x: &Tensor, base: &str, extra: &[i32]) -> Result<Tensor> {
    let x = x.contiguous()?;
    let (rows, k) = x.dims2()?;
    let name = kernel_name(base, x.dtype());
    with_float_type!(x.dtype(), T => with_slice::<T, _>(&x, |xs, xo, dev| {
        let func = kernel(dev, &DEQUANT, &name)?;
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<T>((rows * k).max(1)) }?;
        let xs = xs.slice(xo..);
        let k32 = k as i32;
        let mut b = func.builder();
        b.arg(&xs).arg(&out).arg(&k32);
        for e in extra {
            b.arg(e);
        }
        if rows > 0 {
            // SAFETY: arguments match `qdq_int8_token_*` (x, out, k) / `qdq_fp8_group_*` (x,
            // out, k, group, power_of_two).
            unsafe { b.launch(grid_rows(rows)) }.w()?;
        }
        Ok(wrap(out, dev, (rows, k)))
    }))
}

/// fp8 QDQ of `x` per head: element i's head is `(i / inner) % heads`; `scales` (f32, one per
/// head, on x's device) are the scales, or with `absmax` each head's absmax (the scale is
/// absmax / 448).
pub fn qdq_fp8_heads(
    x: &Tensor,
    heads: usize,
    inner: usize,
    scales: &Tensor,
    absmax: bool,
) -> Result<Tensor> {
    let x = x.contiguous()?;
    let scales = scales.to_dtype(DType::F32)?.contiguous()?;
    let n = x.elem_count();
    if n == 0 {
        return Ok(x);
    }
    if scales.elem_count() != heads || heads * inner == 0 || n % (heads * inner) != 0 {
        bail!(
            "fp8 head QDQ: {} scales, {heads} heads of {inner} for {n} values",
            scales.elem_count()
        );
    }
    let name = kernel_name("qdq_fp8_heads", x.dtype());
    with_float_type!(x.dtype(), T => with_slice::<T, _>(&x, |xs, xo, dev| {
        with_slice::<f32, _>(&scales, |ss, so, _| {
            let func = kernel(dev, &DEQUANT, &name)?;
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(n) }?;
            let (xs, ss) = (xs.slice(xo..), ss.slice(so..));
            let (n64, h32, inner64, dynamic) = (n as i64, heads as i32, inner as i64, i32::from(absmax));
            let mut b = func.builder();
            b.arg(&xs).arg(&out).arg(&n64).arg(&h32).arg(&inner64).arg(&ss).arg(&dynamic);
            // SAFETY: arguments match `qdq_fp8_heads_*` (one thread per element).
            unsafe { b.launch(grid_1d(n)) }.w()?;
            Ok(wrap(out, dev, x.shape().clone()))
        })
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
        let func = kernel(dev, &DEQUANT, &name)?;
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
