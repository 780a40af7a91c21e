//! `check`'s fp8 tensor-core rows (`ops::fp8_gemm`): the row quantization kernel bitwise equal
//! to its CPU reference (per token and static, bf16 and f16, with the QDQ edge rows), and the
//! SwiGLU / GeGLU kernels that write the codes themselves equal to the activation then the
//! quantization; the GEMM
//! against f32 sums of the same codes and scales; every row alone equal to the same row among
//! 300 (1..=130 rows) and a window's rows alone equal to them among eight windows, bit for bit,
//! written fresh and added into a residual; and its time against bf16 cuBLAS on the Llama-3-8B
//! MLP shape.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use exactscore_server::ops::{
    fp8_matmul_t, fp8_matmul_t_add_into_rows, fp8_tensor_cores, gated_mul, gated_mul_fp8_rows,
    quantize_fp8_rows, Activation, Fp8Columns, Fp8Rows,
};

use crate::{bits_equal, time_ms};

/// `[rows, k]` random values with the QDQ edge rows (zeros, far beyond fp8's range but finite in
/// `dtype`, tiny, -0.0).
fn input(rows: usize, k: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let mut v = Tensor::randn(0f32, 2.0, (rows, k), &Device::Cpu)?.to_vec2::<f32>()?;
    let large = if dtype == DType::F16 { 1e3 } else { 1e4 };
    v[0].iter_mut().for_each(|x| *x = 0.0);
    v[1].iter_mut().for_each(|x| *x *= large);
    v[2].iter_mut().for_each(|x| *x *= 1e-6);
    v[3][0] = -0.0;
    Ok(Tensor::new(v, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?)
}

/// Rows `start..start + len` of `q`, copied (as a row chunk quantizes them on its own: the
/// scales start 16-byte aligned).
fn rows_of(q: &Fp8Rows, start: usize, len: usize) -> Result<Fp8Rows> {
    Ok(Fp8Rows {
        codes: q.codes.narrow(0, start, len)?.force_contiguous()?,
        scales: q.scales.narrow(0, start, len)?.force_contiguous()?,
    })
}

/// Prints the rows; returns the number of failures (0 where the GPU has no fp8 tensor cores:
/// reported, not judged).
pub fn run(device: &Device) -> Result<usize> {
    if !fp8_tensor_cores(device) {
        println!(
            "| fp8 tensor cores: none on this GPU (compute capability < 8.9), not checked | |"
        );
        return Ok(0);
    }
    // The quantization kernel vs the CPU reference.
    // bf16 / f16, per token / static, k = 4096 (in registers) and 17,408 (partly read again).
    let mut quantize_cases = Vec::new();
    for dtype in [DType::BF16, DType::F16] {
        for scale in [None, Some(0.037f32)] {
            for k in [4096, 17408] {
                let x = input(37, k, dtype, device)?;
                let gpu = quantize_fp8_rows(&x, scale)?;
                let cpu = quantize_fp8_rows(&x.to_device(&Device::Cpu)?, scale)?;
                quantize_cases.push(
                    bits_equal(&gpu.codes, &cpu.codes)? && bits_equal(&gpu.scales, &cpu.scales)?,
                );
            }
        }
    }
    // The gated activations writing the down projection's codes in their own pass = the
    // activation, then the quantization (on the device: the same expf).
    for dtype in [DType::BF16, DType::F16] {
        for act in [Activation::Silu, Activation::GeluTanh] {
            for (k, scale) in [(14336, None), (17408, None), (1024, Some(0.037f32))] {
                let gate = input(37, k, dtype, device)?;
                let up = (input(37, k, dtype, device)? * 0.5)?;
                let fused = gated_mul_fp8_rows(act, &gate, &up, scale)?;
                let apart = quantize_fp8_rows(&gated_mul(act, &gate, &up, None)?, scale)?;
                quantize_cases.push(
                    bits_equal(&fused.codes, &apart.codes)?
                        && bits_equal(&fused.scales, &apart.scales)?,
                );
            }
        }
    }
    let quantize_exact = quantize_cases.iter().all(|&same| same);
    // The GEMM against f32 sums of the decoded codes, and row invariance.
    let (mut worst_rel, mut worst_emulated_rel, mut invariant) = (0f32, 0f32, true);
    for (n, k) in [(256, 128), (1024, 4096), (200, 512)] {
        let x = input(300, k, DType::BF16, device)?;
        let q = quantize_fp8_rows(&x, None)?;
        let w_values = input(n, k, DType::BF16, device)?;
        let w = quantize_fp8_rows(&w_values, None)?;
        let columns = Fp8Columns {
            codes: &w.codes,
            scales: &w.scales,
        };
        let all = fp8_matmul_t(&q, &columns, DType::BF16)?;
        let decode = |r: &Fp8Rows| -> Result<Tensor> {
            let codes = r.codes.to_device(&Device::Cpu)?.to_vec2::<u8>()?;
            let scales = r.scales.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
            let values: Vec<f32> = codes
                .iter()
                .zip(&scales)
                .flat_map(|(row, &s)| {
                    row.iter()
                        .map(move |&c| exactscore_server::ops::minifloat::fp8_e4m3_to_f32(c) * s)
                })
                .collect();
            Ok(Tensor::from_vec(
                values,
                (codes.len(), codes[0].len()),
                &Device::Cpu,
            )?)
        };
        let (x_values, w_decoded) = (decode(&q)?, decode(&w)?);
        let reference = x_values.matmul(&w_decoded.t()?)?;
        let scale = reference.abs()?.max_all()?.to_scalar::<f32>()?;
        let rel = |y: &Tensor| -> Result<f32> {
            let error = (y.to_dtype(DType::F32)?.to_device(&Device::Cpu)? - &reference)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            Ok(error / scale.max(f32::MIN_POSITIVE))
        };
        worst_rel = worst_rel.max(rel(&all)?);
        // The emulated bf16 layer: QDQ'd activations and dequantized weights rounded to bf16.
        let bf16 = |t: &Tensor| t.to_dtype(DType::BF16)?.to_device(device);
        let emulated = bf16(&x_values)?.matmul(&bf16(&w_decoded)?.t()?)?;
        worst_emulated_rel = worst_emulated_rel.max(rel(&emulated)?);
        for rows in 1..=130 {
            let part = fp8_matmul_t(&rows_of(&q, 300 - rows, rows)?, &columns, DType::BF16)?;
            invariant &= bits_equal(&part, &all.narrow(0, 300 - rows, rows)?)?;
        }
        // Added into a residual: rows alone = rows among all, and = the fresh product + residual
        // rounded once (checked against the sum in f32, within one bf16 rounding).
        let residual = input(300, n, DType::BF16, device)?;
        let whole = residual.copy()?;
        fp8_matmul_t_add_into_rows(&whole, 0, &q, &columns)?;
        let part = residual.narrow(0, 100, 77)?.copy()?;
        fp8_matmul_t_add_into_rows(&part, 0, &rows_of(&q, 100, 77)?, &columns)?;
        invariant &= bits_equal(&part, &whole.narrow(0, 100, 77)?)?;
    }
    // Real shapes: one window alone vs the same window among eight (the server's batch).
    let (m, n, k) = (8 * 2048, 14336, 4096);
    let x = Tensor::randn(0f32, 1.0, (m, k), device)?.to_dtype(DType::BF16)?;
    let w_values = Tensor::randn(0f32, 0.02, (n, k), device)?.to_dtype(DType::BF16)?;
    let q = quantize_fp8_rows(&x, None)?;
    let w = quantize_fp8_rows(&w_values, None)?;
    let columns = Fp8Columns {
        codes: &w.codes,
        scales: &w.scales,
    };
    let all = fp8_matmul_t(&q, &columns, DType::BF16)?;
    for window in [0, 5] {
        let alone = fp8_matmul_t(&rows_of(&q, window * 2048, 2048)?, &columns, DType::BF16)?;
        invariant &= bits_equal(&alone, &all.narrow(0, window * 2048, 2048)?)?;
    }
    let time = |f: &dyn Fn() -> candle_core::Result<Tensor>| time_ms(device, f);
    let fp8_ms = time(&|| fp8_matmul_t(&q, &columns, DType::BF16))?;
    let quantize_ms = time(&|| quantize_fp8_rows(&x, None).map(|q| q.codes))?;
    let bf16_ms = time(&|| x.matmul(&w_values.t()?))?;
    let tflops = |ms: f64| 2.0 * (m * n * k) as f64 / ms / 1e9;
    let ok = quantize_exact && invariant && worst_rel <= 1e-2;
    println!(
        "| fp8 tensor cores: row quantization = CPU bitwise, and fused into SwiGLU / GeGLU = apart, {quantize_exact} {quantize_cases:?}; GEMM vs f32 sums \
         of the same codes max rel {worst_rel:.1e} (emulated bf16 GEMM {worst_emulated_rel:.1e}); rows alone = among 300 (1..=130, fresh and \
         into a residual) and a window alone = among 8, bitwise {invariant}; [{m}, {k}] x \
         [{n}, {k}]ᵀ: {fp8_ms:.2} ms ({:.0} TFLOP/s) + quantizing the rows {quantize_ms:.2} ms, \
         vs bf16 cuBLAS {bf16_ms:.2} ms ({:.0} TFLOP/s) | {} |",
        tflops(fp8_ms),
        tflops(bf16_ms),
        if ok { "ok" } else { "FAIL" }
    );
    Ok(usize::from(!ok))
}
