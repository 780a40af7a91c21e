//! RMSNorm's kernels and the per-head norm + RoPE timed alone on a batch's shapes: the kernel
//! the server runs against the block-per-row kernel (and, for the heads, against the path it
//! does not take: the fused kernel for full rotary, the composition for partial), in effective
//! GB/s (bytes read and written once).

use anyhow::Result;

use crate::time_ms;
use candle_core::{DType, Device, Tensor};
use exactscore_server::cuda::norm::{gated_rms_norm_block_per_row, rms_norm_block_per_row};
use exactscore_server::cuda::rope::head_norm_rope as fused_kernel;
use exactscore_server::ops::{
    gated_rms_norm, head_norm_rope, quantize_fp8_rows, rms_norm, rms_norm_fp8_rows,
    rope_rotate_half, rotate_leading, Fp8InputScale,
};

fn row(what: &str, shape: &str, bytes: usize, ms: f64) {
    println!(
        "| {what} | {shape} | {ms:.3} | {:.0} |",
        bytes as f64 / ms / 1e6
    );
}

pub fn run(device: &Device, tokens: usize) -> Result<()> {
    let (dtype, eps) = (DType::BF16, 1e-6);
    println!("| kernel | shape (bf16) | ms | GB/s |");
    println!("|---|---|---|---|");
    for cols in [2048usize, 2816, 4096, 5120, 8192] {
        let x = Tensor::randn(0f32, 1.0, (tokens, cols), device)?.to_dtype(dtype)?;
        let w = Tensor::rand(0.5f32, 1.5, cols, device)?.to_dtype(dtype)?;
        let bytes = 2 * x.elem_count() * 2;
        let shape = format!("[{tokens}, {cols}]");
        row(
            "RMSNorm, served",
            &shape,
            bytes,
            time_ms(device, &|| rms_norm(&x, &w, eps, None))?,
        );
        let block = time_ms(device, &|| rms_norm_block_per_row(&x, &w, eps as f32))?;
        row("RMSNorm, a block per row", &shape, bytes, block);
        // the input of Linears on the fp8 tensor cores: codes written by the norm, or the
        // normed rows quantized after it (bytes: x read once, the codes written once)
        let code_bytes = x.elem_count() * 3;
        let fused = || Ok(rms_norm_fp8_rows(&x, &w, eps, Fp8InputScale::PerToken)?.codes);
        row(
            "RMSNorm writing fp8 codes",
            &shape,
            code_bytes,
            time_ms(device, &fused)?,
        );
        let apart = || {
            let normed = rms_norm(&x, &w, eps, None)?;
            Ok(quantize_fp8_rows(&normed, Fp8InputScale::PerToken)?.codes)
        };
        row(
            "RMSNorm, then fp8 codes",
            &shape,
            code_bytes,
            time_ms(device, &apart)?,
        );
    }
    // Gated DeltaNet's output norm: Qwen3.5-27B's 48 value heads of 128
    let x = Tensor::randn(0f32, 1.0, (tokens, 48, 128), device)?.to_dtype(dtype)?;
    let z = Tensor::randn(0f32, 1.0, (tokens, 48, 128), device)?.to_dtype(dtype)?;
    let w = Tensor::rand(0.5f32, 1.5, 128, device)?;
    let (bytes, shape) = (3 * x.elem_count() * 2, format!("[{tokens}, 48, 128]"));
    let gated = || gated_rms_norm(&x, &w, &z, eps);
    row(
        "gated RMSNorm, served",
        &shape,
        bytes,
        time_ms(device, &gated)?,
    );
    let block = || gated_rms_norm_block_per_row(&x, &w, &z, eps as f32);
    row(
        "gated RMSNorm, a block per row",
        &shape,
        bytes,
        time_ms(device, &block)?,
    );
    let positions = Tensor::new(
        (0..tokens as i32)
            .map(|t| t % 2048)
            .collect::<Vec<_>>()
            .as_slice(),
        device,
    )?;
    // (heads, dim, rotary dims, f32 weight): Qwen3's q, Llama's q, Qwen3.5's full-attention q
    for (heads, dim, rot, f32_weight) in [(32, 128, 128, false), (16, 256, 64, true)] {
        let x = Tensor::randn(0f32, 1.0, (tokens, heads, dim), device)?.to_dtype(dtype)?;
        let w = Tensor::rand(0.5f32, 1.5, dim, device)?;
        let w = if f32_weight { w } else { w.to_dtype(dtype)? };
        let table = Tensor::randn(0f32, 1.0, (2048, rot / 2), device)?.to_dtype(dtype)?;
        let bytes = 2 * x.elem_count() * 2;
        let shape = format!("[{tokens}, {heads}, {dim}], {rot} rotary");
        let norm = Some((&w, eps));
        let served = || head_norm_rope(&x, norm, rot, &positions, &table, &table);
        row(
            "head norm + RoPE, served",
            &shape,
            bytes,
            time_ms(device, &served)?,
        );
        // the path ops::head_norm_rope does not take for this shape: the fused kernel for full
        // rotary, the composition for partial
        let (other, ms) = match rot == dim {
            true => {
                let fused = || -> candle_core::Result<Tensor> {
                    fused_kernel(&x, norm, rot, &positions, &table, &table)?.ok_or_else(|| {
                        candle_core::Error::Msg("no fused kernel for the shape".into())
                    })
                };
                ("head norm + RoPE, fused kernel", time_ms(device, &fused)?)
            }
            false => {
                let composed = || {
                    rotate_leading(&rms_norm(&x, &w, eps, None)?, rot, |x| {
                        rope_rotate_half(x, &positions, &table, &table)
                    })
                };
                let what = "head norm, then RoPE (rotary part copied out and back)";
                (what, time_ms(device, &composed)?)
            }
        };
        row(other, &shape, bytes, ms);
        let narrow = || rms_norm(&x, &w, eps, None);
        row(
            "head norm alone, lanes per row",
            &shape,
            bytes,
            time_ms(device, &narrow)?,
        );
        let block = || rms_norm_block_per_row(&x, &w, eps as f32);
        row(
            "head norm alone, a block per row",
            &shape,
            bytes,
            time_ms(device, &block)?,
        );
    }
    Ok(())
}
