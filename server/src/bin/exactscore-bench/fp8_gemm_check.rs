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
    quantize_fp8_rows, rms_norm, rms_norm_fp8_rows, Activation, Fp8Columns, Fp8InputScale, Fp8Rows,
};

use crate::{bits_equal, time_ms};

const PER_TOKEN: Fp8InputScale = Fp8InputScale::PerToken;
const STATIC: Fp8InputScale = Fp8InputScale::Static(0.037);
/// A power of two: every quotient is exact, and on the e4m3 grid or one of its midpoints
/// whenever the input is (the encoding's exact-division branch).
const STATIC_POWER_OF_TWO: Fp8InputScale = Fp8InputScale::Static(0.03125);

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
    // The quantization kernels vs the CPU reference.
    // bf16 / f16, per token / static (any, a power of two) / per group of 128 (scales as they
    // are and rounded up to powers of two), k = 4096 and 17,408.
    let mut quantize_cases = Vec::new();
    let groups = |power_of_two| Fp8InputScale::PerTokenGroup128 { power_of_two };
    for dtype in [DType::BF16, DType::F16] {
        for scale in [
            PER_TOKEN,
            STATIC,
            STATIC_POWER_OF_TWO,
            groups(false),
            groups(true),
        ] {
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
            for (k, scale) in [(14336, PER_TOKEN), (17408, PER_TOKEN), (1024, STATIC)] {
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
    // RMSNorm writing the codes of the Linears it feeds = the norm, then the quantization:
    // rows of 4096 (8 a block), 8192 and 12288 (6 and 4), 576 (lanes past the row's end) and
    // 65536 (normed, then quantized), bf16 and f32 weights (Gemma's `1 + w`).
    for dtype in [DType::BF16, DType::F16] {
        let cases = [
            (4096, PER_TOKEN),
            (8192, STATIC),
            (12288, PER_TOKEN),
            (576, PER_TOKEN),
            (65536, PER_TOKEN),
        ];
        for (k, scale) in cases {
            let x = (input(37, k, dtype, device)? * 3.0)?;
            for weight_dtype in [dtype, DType::F32] {
                let weight = (Tensor::randn(0f32, 0.5, k, &Device::Cpu)? + 1.0)?
                    .to_dtype(weight_dtype)?
                    .to_device(device)?;
                let fused = rms_norm_fp8_rows(&x, &weight, 1e-6, scale)?;
                let apart = quantize_fp8_rows(&rms_norm(&x, &weight, 1e-6, None)?, scale)?;
                quantize_cases.push(
                    bits_equal(&fused.codes, &apart.codes)?
                        && bits_equal(&fused.scales, &apart.scales)?,
                );
            }
        }
    }
    let quantize_exact = quantize_cases.iter().all(|&same| same);
    let mut ok = quantize_exact;
    let mut report = format!(
        "row quantization = CPU bitwise, and fused into SwiGLU / GeGLU and RMSNorm = apart, \
         {quantize_exact} {quantize_cases:?}"
    );
    for fast_accum in [false, true] {
        let gemm = check_gemm(device, fast_accum)?;
        // Hopper's fp8 accumulator loses bits over long sums (1.9e-3 to 7.9e-2 measured at
        // k = 14336 on fresh random inputs each run, against 1.8e-3 to 3.4e-3 promoted to f32):
        // judged against gross errors only (a wrong scale or layout is off by ~1).
        let bound = if fast_accum { 2e-1 } else { 1e-2 };
        ok &= gemm.invariant && gemm.worst_rel <= bound;
        report += &format!(
            "; {}: GEMM vs f32 sums of the same codes max rel {:.1e} (k up to 14336; emulated \
             bf16 GEMM {:.1e}), rows alone = among 300 (1..=130, fresh and into a residual) and \
             a window alone = among 8, bitwise {}; {}",
            if fast_accum {
                "fast accumulation"
            } else {
                "f32 sums"
            },
            gemm.worst_rel,
            gemm.worst_emulated_rel,
            gemm.invariant,
            gemm.timing,
        );
    }
    let block = check_block_gemm(device)?;
    ok &= block.invariant && block.worst_rel <= 1e-2;
    report += &format!(
        "; block fp8 (128 x 128 weight blocks, rows per 128 inputs): GEMM vs f32 sums max rel \
         {:.1e} (1..=300 rows, k 128 to 14336), rows alone = among 300 (1, 3, 4, 37, 129; \
         fresh and added into a residual) bitwise {}; {}",
        block.worst_rel, block.invariant, block.timing
    );
    // The SwiGLU writing the down projection's codes, against writing bf16 (a window of the
    // Llama-3-8B MLP).
    let gate = Tensor::randn(0f32, 1.0, (2048, 14336), device)?.to_dtype(DType::BF16)?;
    let up = Tensor::randn(0f32, 1.0, (2048, 14336), device)?.to_dtype(DType::BF16)?;
    let time = |f: &dyn Fn() -> candle_core::Result<Tensor>| time_ms(device, f);
    let codes_ms =
        time(&|| gated_mul_fp8_rows(Activation::Silu, &gate, &up, PER_TOKEN).map(|q| q.codes))?;
    let bf16_ms = time(&|| gated_mul(Activation::Silu, &gate, &up, None))?;
    report += &format!(
        "; SwiGLU [2048, 14336] writing codes {codes_ms:.3} ms, writing bf16 {bf16_ms:.3} ms"
    );
    println!(
        "| fp8 tensor cores: {report} | {} |",
        if ok { "ok" } else { "FAIL" }
    );
    Ok(usize::from(!ok))
}

struct GemmCheck {
    worst_rel: f32,
    worst_emulated_rel: f32,
    invariant: bool,
    timing: String,
}

/// The GEMM summing as `fast_accum` says: against f32 sums of the decoded codes, row
/// invariance, and its time on the Llama-3-8B MLP shape against bf16 cuBLAS.
fn check_gemm(device: &Device, fast_accum: bool) -> Result<GemmCheck> {
    // The GEMM against f32 sums of the decoded codes, and row invariance.
    let (mut worst_rel, mut worst_emulated_rel, mut invariant) = (0f32, 0f32, true);
    for (n, k) in [(256, 128), (1024, 4096), (200, 512), (512, 14336)] {
        let x = input(300, k, DType::BF16, device)?;
        let q = quantize_fp8_rows(&x, PER_TOKEN)?;
        let w_values = input(n, k, DType::BF16, device)?;
        let w = quantize_fp8_rows(&w_values, PER_TOKEN)?;
        let columns = Fp8Columns {
            codes: &w.codes,
            scales: &w.scales,
            fast_accum,
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
    let q = quantize_fp8_rows(&x, PER_TOKEN)?;
    let w = quantize_fp8_rows(&w_values, PER_TOKEN)?;
    let columns = Fp8Columns {
        codes: &w.codes,
        scales: &w.scales,
        fast_accum,
    };
    let all = fp8_matmul_t(&q, &columns, DType::BF16)?;
    for window in [0, 5] {
        let alone = fp8_matmul_t(&rows_of(&q, window * 2048, 2048)?, &columns, DType::BF16)?;
        invariant &= bits_equal(&alone, &all.narrow(0, window * 2048, 2048)?)?;
    }
    let time = |f: &dyn Fn() -> candle_core::Result<Tensor>| time_ms(device, f);
    let fp8_ms = time(&|| fp8_matmul_t(&q, &columns, DType::BF16))?;
    let quantize_ms = time(&|| quantize_fp8_rows(&x, PER_TOKEN).map(|q| q.codes))?;
    let bf16_ms = time(&|| x.matmul(&w_values.t()?))?;
    let tflops = |ms: f64| 2.0 * (m * n * k) as f64 / ms / 1e9;
    // The same rows in chunks, as the MLP multiplies them (2,048 rows at a time), and the
    // down projection's shape.
    let mut chunked = Vec::new();
    for rows in [2048, 4096, 8192] {
        let chunks = (0..m)
            .step_by(rows)
            .map(|start| rows_of(&q, start, rows))
            .collect::<Result<Vec<_>>>()?;
        let ms = time(&|| {
            let mut last = None;
            for chunk in &chunks {
                last = Some(fp8_matmul_t(chunk, &columns, DType::BF16)?);
            }
            Ok(last.expect("at least one chunk"))
        })?;
        chunked.push(format!("{rows}-row chunks {:.0}", tflops(ms)));
    }
    let down_w = quantize_fp8_rows(&w_values.t()?.contiguous()?, PER_TOKEN)?;
    let down_x = quantize_fp8_rows(
        &Tensor::randn(0f32, 1.0, (2048, n), device)?.to_dtype(DType::BF16)?,
        PER_TOKEN,
    )?;
    let down = Fp8Columns {
        codes: &down_w.codes,
        scales: &down_w.scales,
        fast_accum,
    };
    let down_ms = time(&|| fp8_matmul_t(&down_x, &down, DType::BF16))?;
    chunked.push(format!(
        "down [2048, {n}] x [{k}, {n}]ᵀ {:.0}",
        2.0 * (2048 * n * k) as f64 / down_ms / 1e9
    ));
    let timing = format!(
        "[{m}, {k}] x [{n}, {k}]ᵀ: {fp8_ms:.2} ms ({:.0} TFLOP/s; {} TFLOP/s) + quantizing the \
         rows {quantize_ms:.3} ms, vs bf16 cuBLAS {bf16_ms:.2} ms ({:.0} TFLOP/s)",
        tflops(fp8_ms),
        chunked.join(", "),
        tflops(bf16_ms)
    );
    Ok(GemmCheck {
        worst_rel,
        worst_emulated_rel,
        invariant,
        timing,
    })
}

/// Random e4m3 codes (`[n, k]`, no NaN) and one scale in [1e-3, 1e-2] per 128 × 128 block, as
/// the GEMM reads them (each row of scales padded to a multiple of 4: here with more random
/// scales, which the GEMM must not read).
fn block_weight(n: usize, k: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let bytes = Tensor::rand(0f32, 254.0, (n, k), &Device::Cpu)?.to_vec2::<f32>()?;
    // 0..=253 onto the codes without 0x7f and 0xff
    let codes: Vec<u8> = bytes
        .iter()
        .flatten()
        .map(|&b| {
            let b = b as u8;
            if b >= 0x7f {
                b + 1
            } else {
                b
            }
        })
        .collect();
    let codes = Tensor::from_vec(codes, (n, k), device)?;
    let scales = Tensor::rand(
        1e-3f32,
        1e-2,
        (n / 128, (k / 128).next_multiple_of(4)),
        device,
    )?;
    Ok((codes, scales))
}

/// `codes · scales` in f32 on the CPU, one scale per `[rows_per_scale, 128]` tile, the scales
/// given as `[row tiles, k / 128]`.
fn decode_blocks(codes: &Tensor, scales: &Tensor, rows_per_scale: usize) -> Result<Tensor> {
    let codes = codes.to_device(&Device::Cpu)?.to_vec2::<u8>()?;
    let scales = scales.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
    let k = codes[0].len();
    let values: Vec<f32> = codes
        .iter()
        .enumerate()
        .flat_map(|(i, row)| {
            let scales = &scales[i / rows_per_scale];
            row.iter().enumerate().map(move |(j, &c)| {
                exactscore_server::ops::minifloat::fp8_e4m3_to_f32(c) * scales[j / 128]
            })
        })
        .collect();
    Ok(Tensor::from_vec(values, (codes.len(), k), &Device::Cpu)?)
}

/// Rows `start..start + len` of rows quantized per group (scales `[k / 128, m]`), copied.
fn group_rows_of(q: &Fp8Rows, start: usize, len: usize) -> Result<Fp8Rows> {
    Ok(Fp8Rows {
        codes: q.codes.narrow(0, start, len)?.force_contiguous()?,
        scales: q.scales.narrow(1, start, len)?.force_contiguous()?,
    })
}

struct BlockCheck {
    worst_rel: f32,
    invariant: bool,
    timing: String,
}

/// Block FP8 on the tensor cores: activations quantized per row and 128 inputs, the weight per
/// 128 × 128 block, against f32 sums of the decoded values; rows alone vs among all.
fn check_block_gemm(device: &Device) -> Result<BlockCheck> {
    let groups = Fp8InputScale::PerTokenGroup128 {
        power_of_two: false,
    };
    let (mut worst_rel, mut invariant) = (0f32, true);
    for (m, n, k) in [
        (300, 256, 512),
        (37, 128, 1024),
        (3, 256, 2048),
        (1, 128, 512),
        (300, 512, 14336),
        (300, 128, 128),
        (37, 256, 256),
        (300, 384, 384),
        (300, 128, 640),
    ] {
        let x = input(m.max(4), k, DType::BF16, device)?.narrow(0, 0, m)?;
        let q = quantize_fp8_rows(&x, groups)?;
        let (w_codes, w_scales) = block_weight(n, k, device)?;
        let columns = Fp8Columns {
            codes: &w_codes,
            scales: &w_scales,
            fast_accum: false,
        };
        let all = fp8_matmul_t(&q, &columns, DType::BF16)?;
        let x_values = decode_blocks(&q.codes, &q.scales.t()?, 1)?;
        let reference = x_values.matmul(&decode_blocks(&w_codes, &w_scales, 128)?.t()?)?;
        let scale = reference.abs()?.max_all()?.to_scalar::<f32>()?;
        let error = (all.to_dtype(DType::F32)?.to_device(&Device::Cpu)? - &reference)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        worst_rel = worst_rel.max(error / scale.max(f32::MIN_POSITIVE));
        if m < 300 {
            continue;
        }
        // rows alone (other than multiples of 4: padded) = among 300, fresh and added
        for rows in [1, 3, 4, 37, 129] {
            let part = fp8_matmul_t(&group_rows_of(&q, m - rows, rows)?, &columns, DType::BF16)?;
            invariant &= bits_equal(&part, &all.narrow(0, m - rows, rows)?)?;
        }
        let residual = input(m, n, DType::BF16, device)?;
        let whole = residual.copy()?;
        fp8_matmul_t_add_into_rows(&whole, 0, &q, &columns)?;
        for (start, rows) in [(12, 16), (40, 37), (299, 1)] {
            let part = residual.copy()?;
            fp8_matmul_t_add_into_rows(&part, start, &group_rows_of(&q, start, rows)?, &columns)?;
            invariant &= bits_equal(
                &part.narrow(0, start, rows)?,
                &whole.narrow(0, start, rows)?,
            )?;
        }
    }
    let (m, n, k) = (8 * 2048, 14336, 4096);
    let x = Tensor::randn(0f32, 1.0, (m, k), device)?.to_dtype(DType::BF16)?;
    let (w_codes, w_scales) = block_weight(n, k, device)?;
    let columns = Fp8Columns {
        codes: &w_codes,
        scales: &w_scales,
        fast_accum: false,
    };
    let q = quantize_fp8_rows(&x, groups)?;
    let all = fp8_matmul_t(&q, &columns, DType::BF16)?;
    let alone = fp8_matmul_t(&group_rows_of(&q, 5 * 2048, 2048)?, &columns, DType::BF16)?;
    invariant &= bits_equal(&alone, &all.narrow(0, 5 * 2048, 2048)?)?;
    let time = |f: &dyn Fn() -> candle_core::Result<Tensor>| time_ms(device, f);
    let gemm_ms = time(&|| fp8_matmul_t(&q, &columns, DType::BF16))?;
    let quantize_ms = time(&|| quantize_fp8_rows(&x, groups).map(|q| q.codes))?;
    let timing = format!(
        "[{m}, {k}] x [{n}, {k}]ᵀ: {gemm_ms:.2} ms ({:.0} TFLOP/s) + quantizing the rows \
         {quantize_ms:.3} ms",
        2.0 * (m * n * k) as f64 / gemm_ms / 1e9
    );
    Ok(BlockCheck {
        worst_rel,
        invariant,
        timing,
    })
}

/// `exactscore-bench fp8-algos`: cuBLASLt's candidate algorithms for each fp8 GEMM of the
/// Llama-3-8B layer at the rows the server runs it with (the attention projections on eight
/// windows at once, the MLP's in 2,048-row chunks), as its heuristic ranks them for several row
/// counts, each timed; the server runs the first of the ranking at 8,192 rows.
pub fn survey(device: &Device, fast_accum: bool, count: usize) -> Result<()> {
    use exactscore_server::cuda::fp8_gemm::fp8_matmul_t_survey;
    println!(
        "| projection [n, k] | rows | ranked for rows | rank | configuration | ms | TFLOP/s |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (name, n, k, m) in [
        ("q/o", 4096, 4096, 16384),
        ("k/v", 1024, 4096, 16384),
        ("gate/up", 14336, 4096, 2048),
        ("gate and up as one", 2 * 14336, 4096, 2048),
        ("down", 4096, 14336, 2048),
    ] {
        let x = quantize_fp8_rows(
            &Tensor::randn(0f32, 1.0, (m, k), device)?.to_dtype(DType::BF16)?,
            PER_TOKEN,
        )?;
        let w = quantize_fp8_rows(
            &Tensor::randn(0f32, 0.02, (n, k), device)?.to_dtype(DType::BF16)?,
            PER_TOKEN,
        )?;
        for ranked_for in [Some(8192), None] {
            let found = fp8_matmul_t_survey(
                &x.codes, &x.scales, &w.codes, &w.scales, fast_accum, ranked_for, count,
            )?;
            let ranked_for = ranked_for.map_or("all, fastest first".to_string(), |r| r.to_string());
            for (rank, (config, ms)) in found.iter().enumerate() {
                let tflops = 2.0 * (m * n * k) as f64 / ms / 1e9;
                println!("| {name} [{n}, {k}] | {m} | {ranked_for} | {rank} | {config} | {ms:.3} | {tflops:.0} |");
            }
        }
    }
    Ok(())
}
