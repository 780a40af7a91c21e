//! One projection of a stack of int4 experts (a Qwen3-30B-A3B layer's 128 experts) timed alone:
//! the kernel that decodes the int4 weights inside the GEMM, in each tiling, against dequantizing
//! the stack into memory and one batched cuBLAS GEMM, with both results compared. Counts the
//! useful FLOPs (2·rows·n·k). Scales are bf16, as checkpoints store them (the kernel's packed
//! bf16 decoding); once the same values held in f32, whose products must be the same bits; and
//! once arbitrary f32 values (its f32 decoding); and once with zero points (a signed byte each,
//! as asymmetric weights hold them). A third shape has an odd number of groups per row (Gemma
//! 4's experts' down projection at group 64), so that the rows' 16-bit scales and byte zero
//! points start anywhere in a 4-byte word. The int4 kernel runs on mma.sync and, on a Hopper GPU,
//! on wgmma, whose output must be mma.sync's bit for bit.

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use exactscore_server::cuda::dequant::{
    dequant_int_stacked, int4_gemm_on_wgmma, int4_gemm_wgmma_runs_on,
    matmul_t_int4_stacked_into_rows, INT4_GEMM_TILE_ROWS,
};
use exactscore_server::ops::matmul_t_stacked_into_rows;

/// xorshift64*: random int4 codes without a dependency.
fn random_words(len: usize, mut state: u64) -> Vec<i32> {
    (0..len)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) as u32 as i32
        })
        .collect()
}

/// Median milliseconds of `iters` synchronized runs of `f`, after one warm-up.
fn time_ms(device: &Device, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    device.synchronize()?;
    let mut ms = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        f()?;
        device.synchronize()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[iters / 2])
}

pub fn run(device: &Device, experts: usize, rows: &[usize], group: usize) -> Result<()> {
    println!("| projection [n, k] | experts × rows | scales | path | ms | useful TFLOP/s | max |Δ| / max |ref| | = mma.sync |");
    println!("|---|---|---|---|---|---|---|---|");
    let shapes = [
        ("gate or up", 768usize, 2048usize, group),
        ("down", 2048, 768, group),
        ("down, 11 groups a row", 2816, 704, 64),
    ];
    for (name, n, k, group) in shapes {
        let codes: Vec<Tensor> = (0..experts)
            .map(|e| {
                Tensor::from_vec(
                    random_words(n * k / 8, 0x9e37_79b9 + e as u64),
                    (n, k / 8),
                    device,
                )
            })
            .collect::<candle_core::Result<_>>()?;
        let f32_scales: Vec<Tensor> = (0..experts)
            .map(|_| Tensor::rand(0.5e-2f32, 1.5e-2, (n, k / group), device))
            .collect::<candle_core::Result<_>>()?;
        let bf16_scales: Vec<Tensor> = f32_scales
            .iter()
            .map(|s| s.to_dtype(DType::BF16))
            .collect::<candle_core::Result<_>>()?;
        let bf16_in_f32: Vec<Tensor> = bf16_scales
            .iter()
            .map(|s| s.to_dtype(DType::F32))
            .collect::<candle_core::Result<_>>()?;
        // asymmetric weights' zero points, a signed byte each as the weights hold them
        let zero_points: Vec<Tensor> = (0..experts)
            .map(|e| {
                let bytes = random_words(n * (k / group), 0x5bd1_e995 + e as u64)
                    .into_iter()
                    .map(|w| ((w as u32 % 16) as i32 - 8) as i8 as u8)
                    .collect::<Vec<u8>>();
                Tensor::from_vec(bytes, (n, k / group), device)
            })
            .collect::<candle_core::Result<_>>()?;
        // one input per row count, shared by the kinds of scales
        let inputs: Vec<Tensor> = rows
            .iter()
            .map(|&m| Tensor::randn(0f32, 1.0, (experts * m, k), device)?.to_dtype(DType::BF16))
            .collect::<candle_core::Result<_>>()?;
        let mut stored_bf16 = Vec::new();
        for (kind, scales, zps, rows) in [
            ("bf16", &bf16_scales, None, rows),
            ("bf16 in f32", &bf16_in_f32, None, &rows[..1]),
            ("f32", &f32_scales, None, &rows[..1]),
            (
                "bf16, zero points",
                &bf16_scales,
                Some(&zero_points),
                &rows[..1],
            ),
        ] {
            let weights: Vec<_> = codes
                .iter()
                .zip(scales)
                .enumerate()
                .map(|(e, (c, s))| (c, s, zps.map(|z| &z[e])))
                .collect();
            for (&m, x) in rows.iter().zip(&inputs) {
                let outs = time_row(device, (name, n, k), (x, experts, m), group, kind, &weights)?;
                match kind {
                    "bf16" if m == rows[0] => stored_bf16 = outs,
                    "bf16 in f32" if !bitwise(&outs, &stored_bf16)? => {
                        anyhow::bail!(
                            "{name}: bf16 scales held in f32 give other bits than stored in bf16"
                        )
                    }
                    _ => {}
                }
            }
        }
    }
    Ok(())
}

/// Whether two lists of tensors are equal bit for bit (f32 tensors, no NaN).
fn bitwise(a: &[Tensor], b: &[Tensor]) -> Result<bool> {
    if a.len() != b.len() {
        return Ok(false);
    }
    for (a, b) in a.iter().zip(b) {
        if (a - b)?.abs()?.max_all()?.to_scalar::<f32>()? != 0.0 {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Times one row of the table (every path, every tiling) and returns the mma.sync kernel's
/// outputs in f32, one per tiling.
#[allow(clippy::type_complexity)]
fn time_row(
    device: &Device,
    (name, n, k): (&str, usize, usize),
    (x, experts, m): (&Tensor, usize, usize),
    group: usize,
    kind: &str,
    weights: &[(&Tensor, &Tensor, Option<&Tensor>)],
) -> Result<Vec<Tensor>> {
    let flops = 2.0 * (experts * m * n * k) as f64;
    let reference = Tensor::zeros((experts * m, n), DType::BF16, device)?;
    let dequantized = time_ms(device, 5, || {
        let w = dequant_int_stacked(weights, (n, k), 4, group, DType::BF16)?
            .expect("int4 stacks dequantize in one launch");
        matmul_t_stacked_into_rows(&reference, 0, x, &w)?;
        Ok(())
    })?;
    println!(
        "| {name} [{n}, {k}] | {experts} × {m} | {kind} | dequantize + cuBLAS | {dequantized:.3} | {:.0} | |",
        flops / dequantized / 1e9
    );
    let reference = reference.to_dtype(DType::F32)?;
    let scale = reference.abs()?.max_all()?.to_scalar::<f32>()?;
    let kernels: &[(&str, bool)] = match int4_gemm_wgmma_runs_on(device)? {
        true => &[("mma.sync", false), ("wgmma", true)],
        false => &[("mma.sync", false)],
    };
    let (mut same_kernels, mut outputs) = (true, Vec::new());
    for tile in INT4_GEMM_TILE_ROWS {
        let mut sync_out: Option<Tensor> = None;
        for &(kernel, wgmma) in kernels {
            int4_gemm_on_wgmma(wgmma);
            let out = Tensor::zeros((experts * m, n), DType::BF16, device)?;
            let ms = time_ms(device, 5, || {
                matmul_t_int4_stacked_into_rows(
                    &out,
                    0,
                    x,
                    weights,
                    &vec![m; experts],
                    (n, k),
                    group,
                    Some(tile),
                )?;
                Ok(())
            })?;
            let out = out.to_dtype(DType::F32)?;
            let error = (&out - &reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let same = match &sync_out {
                None => {
                    sync_out = Some(out);
                    String::new()
                }
                Some(sync) => {
                    let same = bitwise(std::slice::from_ref(sync), &[out])?;
                    same_kernels &= same;
                    same.to_string()
                }
            };
            println!(
                "| {name} [{n}, {k}] | {experts} × {m} | {kind} | int4 {kernel}, {tile} rows per block | {ms:.3} | {:.0} | {:.1e} | {same} |",
                flops / ms / 1e9,
                error / scale
            );
            // The same products summed in another order; a misread scale or zero point is off
            // by whole multiples of a scale.
            if error > 1e-2 * scale {
                anyhow::bail!("{name} ({kind}): int4 {kernel} off the dequantized GEMM by {error}");
            }
        }
        outputs.extend(sync_out);
    }
    int4_gemm_on_wgmma(true);
    if !same_kernels {
        anyhow::bail!("the wgmma int4 GEMM differs from mma.sync's");
    }
    Ok(outputs)
}
