//! The fp8 tensor-core GEMM (`ops/fp8_gemm.rs`): the row quantization kernels
//! (kernels/fp8_gemm.cu) and cuBLASLt's fp8 GEMM with outer-vector scales, `out[i, j] =
//! round(x_scale[i] · w_scale[j] · Σ_k x[i, k] · w[j, k] (+ out[i, j]))` with f32 sums, or
//! with block scales (Hopper), `round(Σ_b x_scale[b, i] · w_scale[j / 128, b] · Σ_{k in b}
//! x[i, k] · w[j, k] (+ out[i, j]))` over the blocks b of 128 inputs.
//! The GEMM itself runs through cuBLASLt (`fp8_cublaslt.rs`).

use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Device, Result, Shape, Tensor};

use super::fp8_cublaslt::{Operands, Problem, Scaling};
use super::module::{kernel, FP8_GEMM};
use super::{device_address, kernel_name, with_slice, wrap};

/// With block scales, the rows of a problem are a multiple of this.
const BLOCK_ROWS: usize = 4;

/// Whether `device` has fp8 tensor cores that cuBLASLt's fp8 GEMM drives (compute capability
/// 8.9: Ada, 9.0: Hopper, and newer).
pub fn fp8_gemm_supported(device: &Device) -> Result<bool> {
    let Device::Cuda(dev) = device else {
        return Ok(false);
    };
    let ctx = dev.cuda_stream().context().clone();
    let major = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .w()?;
    let minor = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        .w()?;
    Ok(major * 10 + minor >= 89)
}

/// e4m3 codes (`[m, k]`, u8) and one f32 scale per row of `x` (`[m, k]`, bf16/f16, k a
/// multiple of 8): per token (absmax / 448) or `static_scale`.
pub fn quantize_fp8_rows(x: &Tensor, static_scale: Option<f32>) -> Result<(Tensor, Tensor)> {
    let (m, _) = x.dims2()?;
    // a warp per row, eight rows per block
    quantize(
        x,
        "quantize_fp8_rows",
        8,
        m,
        m.div_ceil(8),
        static_scale.unwrap_or(0.0),
    )
}

/// e4m3 codes (`[m, k]`, u8) and f32 scales `[k / 128, m]` of `x` (`[m, k]`, bf16/f16, k a
/// multiple of 128): one scale per row and 128 values, max(absmax, 1e-10) / 448, rounded up to
/// a power of two where `power_of_two`.
pub fn quantize_fp8_row_groups(x: &Tensor, power_of_two: bool) -> Result<(Tensor, Tensor)> {
    let (m, k) = x.dims2()?;
    // half a warp per group of 128, sixteen groups per block
    let blocks = (m * (k / 128)).div_ceil(16);
    quantize(
        x,
        "quantize_fp8_row_groups",
        128,
        (k / 128, m),
        blocks,
        i32::from(power_of_two),
    )
}

/// Launches the quantization kernel `base` of kernels/fp8_gemm.cu on `x` (`[m, k]`, bf16/f16,
/// k a multiple of `k_multiple`) in `blocks` blocks of 256 threads, with `last` as its last
/// argument: codes `[m, k]` and f32 scales of shape `scales`.
fn quantize<A: DeviceRepr>(
    x: &Tensor,
    base: &str,
    k_multiple: usize,
    scales: impl Into<Shape>,
    blocks: usize,
    last: A,
) -> Result<(Tensor, Tensor)> {
    let x = x.contiguous()?;
    let (m, k) = x.dims2()?;
    let scales: Shape = scales.into();
    if !k.is_multiple_of(k_multiple) || !x.layout().start_offset().is_multiple_of(8) {
        bail!("{base}: k = {k} must be a multiple of {k_multiple}, the start offset of 8");
    }
    if x.dtype() == DType::F32 {
        bail!("{base}: bf16 or f16 rows, not f32");
    }
    with_float_type!(x.dtype(), T => with_slice::<T, _>(&x, |xs, xo, dev| {
        let func = kernel(dev, &FP8_GEMM, &kernel_name(base, x.dtype()))?;
        let stream = dev.cuda_stream();
        // SAFETY: the kernel writes every code and every scale.
        let codes = unsafe { stream.alloc::<u8>(m * k) }.w()?;
        let scale_values = unsafe { stream.alloc::<f32>(scales.elem_count()) }.w()?;
        if m > 0 {
            let xs = xs.slice(xo..);
            let (m32, k32) = (m as i32, k as i32);
            let mut b = func.builder();
            b.arg(&xs).arg(&codes).arg(&scale_values).arg(&m32).arg(&k32).arg(&last);
            let config = LaunchConfig {
                grid_dim: (blocks as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: x holds m rows of k values, codes m * k bytes, and the scales what the
            // kernel writes.
            unsafe { b.launch(config) }.w()?;
        }
        Ok((wrap(codes, dev, (m, k)), wrap(scale_values, dev, scales)))
    }))
}

/// `x · wᵀ` with the scales applied, as a new `[m, n]` tensor in `dtype` (bf16/f16).
pub fn fp8_matmul_t(
    x_codes: &Tensor,
    x_scales: &Tensor,
    w_codes: &Tensor,
    w_scales: &Tensor,
    dtype: DType,
    fast_accum: bool,
) -> Result<Tensor> {
    let (m, _) = x_codes.dims2()?;
    let (n, _) = w_codes.dims2()?;
    let Device::Cuda(dev) = x_codes.device() else {
        bail!("fp8_matmul_t: the codes are not on a CUDA device");
    };
    let out = with_float_type!(dtype, T => {
        // SAFETY: the GEMM below writes every element (beta = 0).
        let slice = unsafe { dev.cuda_stream().alloc::<T>(m * n) }.w()?;
        wrap(slice, dev, (m, n))
    });
    fp8_matmul_t_into_rows(
        &out, 0, x_codes, x_scales, w_codes, w_scales, false, fast_accum,
    )?;
    Ok(out)
}

/// [`fp8_matmul_t`] written into rows `row0..row0 + m` of `out` (`[rows, n]`, contiguous,
/// bf16/f16), added to what they hold where `accumulate` (one rounding of the sum). The scales
/// are per row and column (`[m]`, `[n]`) or per block (`[k / 128, m]` and the weight's
/// `[n / 128, k / 128 padded to a multiple of 4]`, k and n multiples of 128; row counts that
/// are no multiple of 4 run padded; summed in f32 whatever `fast_accum` says).
#[allow(clippy::too_many_arguments)]
pub fn fp8_matmul_t_into_rows(
    out: &Tensor,
    row0: usize,
    x_codes: &Tensor,
    x_scales: &Tensor,
    w_codes: &Tensor,
    w_scales: &Tensor,
    accumulate: bool,
    fast_accum: bool,
) -> Result<()> {
    let (m, k) = x_codes.dims2()?;
    // Block scales: cuBLASLt takes a multiple of 4 rows (each group's row scales 16-byte
    // aligned). Other chunks run padded with zero rows on a copy of their output rows: a row's
    // sums and its one rounding do not depend on the rows beside it.
    if x_scales.rank() == 2 && !m.is_multiple_of(BLOCK_ROWS) && out.dim(0)? >= row0 + m {
        let pad = m.next_multiple_of(BLOCK_ROWS) - m;
        let groups = x_scales.dim(0)?;
        let dev = x_codes.device();
        let codes = Tensor::cat(&[x_codes, &Tensor::zeros((pad, k), DType::U8, dev)?], 0)?;
        let scales = Tensor::cat(
            &[x_scales, &Tensor::zeros((groups, pad), DType::F32, dev)?],
            1,
        )?;
        let rows = out.narrow(0, row0, m)?;
        let padded = Tensor::cat(
            &[
                &rows,
                &Tensor::zeros((pad, rows.dim(1)?), out.dtype(), dev)?,
            ],
            0,
        )?;
        fp8_matmul_t_into_rows(
            &padded, 0, &codes, &scales, w_codes, w_scales, accumulate, fast_accum,
        )?;
        return out.slice_set(&padded.narrow(0, 0, m)?, 0, row0);
    }
    let (n, w_k) = w_codes.dims2()?;
    let (rows, out_n) = out.dims2()?;
    let contiguous = [out, x_codes, x_scales, w_codes, w_scales]
        .iter()
        .all(|t| t.is_contiguous());
    // cuBLASLt takes 16-byte aligned operands and scale vectors.
    let aligned = [x_codes, w_codes]
        .iter()
        .all(|t| t.layout().start_offset().is_multiple_of(16))
        && [x_scales, w_scales]
            .iter()
            .all(|t| t.layout().start_offset().is_multiple_of(4))
        && (out.layout().start_offset() + row0 * n).is_multiple_of(8);
    let scaling = if x_scales.dims() == [m] && w_scales.dims() == [n] {
        Some(Scaling::PerRowAndColumn)
    } else if x_scales.dims() == [k / 128, m]
        // rows of weight scales padded to 16 bytes (ops::fp8_block_scales_for_gemm)
        && w_scales.dims() == [n / 128, (k / 128).next_multiple_of(4)]
        && k.is_multiple_of(128)
        && n.is_multiple_of(128)
        && m.is_multiple_of(BLOCK_ROWS)
    {
        Some(Scaling::Blocks)
    } else {
        None
    };
    let valid = w_k == k
        && out_n == n
        && row0 + m <= rows
        && contiguous
        && aligned
        && k.is_multiple_of(16)
        && [x_codes, w_codes].iter().all(|t| t.dtype() == DType::U8)
        && [x_scales, w_scales].iter().all(|t| t.dtype() == DType::F32);
    let Some(scaling) = scaling.filter(|_| valid) else {
        bail!(
            "fp8_matmul_t: x {:?} (scales {:?}) and w {:?} (scales {:?}) into rows {row0}.. of \
             {:?} (u8 codes, f32 scales per row and column or per block, contiguous and 16-byte \
             aligned, k a multiple of 16)",
            x_codes.dims(),
            x_scales.dims(),
            w_codes.dims(),
            w_scales.dims(),
            out.dims()
        );
    };
    if m == 0 {
        return Ok(());
    }
    let Device::Cuda(dev) = out.device() else {
        bail!("fp8_matmul_t: the output is not on a CUDA device");
    };
    let elem = out.dtype().size_in_bytes() as u64;
    let out_at = device_address_any(out)? + (row0 * n) as u64 * elem;
    let problem = Problem {
        m: m as u64,
        n: n as u64,
        k: k as u64,
        out_dtype: out.dtype(),
        beta: if accumulate { 1.0 } else { 0.0 },
        scaling,
        fast_accum,
    };
    // SAFETY: every address holds what `problem` says (shapes checked above).
    unsafe {
        problem.run(
            dev,
            Operands {
                w: device_address::<u8>(w_codes)?,
                x: device_address::<u8>(x_codes)?,
                w_scales: device_address::<f32>(w_scales)?,
                x_scales: device_address::<f32>(x_scales)?,
                out: out_at,
            },
        )
    }
}

/// The device address of a contiguous bf16/f16 tensor's first element.
fn device_address_any(t: &Tensor) -> Result<u64> {
    match t.dtype() {
        DType::BF16 => device_address::<half::bf16>(t),
        _ => device_address::<half::f16>(t),
    }
}

/// For `exactscore-bench`: up to `count` of cuBLASLt's algorithms for `x · wᵀ` (scales per row
/// and column, a fresh bf16 output) as its heuristic ranks them for `heuristic_rows` rows, each
/// described and timed on these operands (`Problem::survey`; the server runs the first at
/// `CANONICAL_ROWS`), or without `heuristic_rows` the `count` fastest of every configuration
/// cuBLASLt accepts (`Problem::explore`).
pub fn fp8_matmul_t_survey(
    x_codes: &Tensor,
    x_scales: &Tensor,
    w_codes: &Tensor,
    w_scales: &Tensor,
    fast_accum: bool,
    heuristic_rows: Option<usize>,
    count: usize,
) -> Result<Vec<(String, f64)>> {
    let (m, k) = x_codes.dims2()?;
    let (n, w_k) = w_codes.dims2()?;
    let Device::Cuda(dev) = x_codes.device() else {
        bail!("fp8_matmul_t_survey: the codes are not on a CUDA device");
    };
    let parts = [x_codes, x_scales, w_codes, w_scales];
    if w_k != k
        || x_scales.dims() != [m]
        || w_scales.dims() != [n]
        || !parts
            .iter()
            .all(|t| t.is_contiguous() && t.layout().start_offset() == 0)
    {
        bail!("fp8_matmul_t_survey: contiguous [m, k] and [n, k] codes with [m] and [n] scales");
    }
    let out = Tensor::zeros((m, n), DType::BF16, x_codes.device())?;
    let problem = Problem {
        m: m as u64,
        n: n as u64,
        k: k as u64,
        out_dtype: DType::BF16,
        beta: 0.0,
        scaling: Scaling::PerRowAndColumn,
        fast_accum,
    };
    let ops = Operands {
        w: device_address::<u8>(w_codes)?,
        x: device_address::<u8>(x_codes)?,
        w_scales: device_address::<f32>(w_scales)?,
        x_scales: device_address::<f32>(x_scales)?,
        out: device_address::<half::bf16>(&out)?,
    };
    // SAFETY: every address holds what `problem` says (shapes checked above).
    unsafe {
        match heuristic_rows {
            Some(rows) => problem.survey(dev, ops, rows as u64, count, 20),
            None => Ok(problem
                .explore(dev, ops, 10)?
                .into_iter()
                .take(count)
                .collect()),
        }
    }
}
