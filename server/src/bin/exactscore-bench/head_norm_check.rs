//! `check`'s norm rows: RMSNorm's kernels that run a few lanes per row (q/k norms) or a warp
//! per row, and the gated RMSNorm's lanes per row (Gated DeltaNet heads), against their
//! block-per-row kernels, and the fused per-head norm + RoPE kernel
//! (`ops::head_norm_rope`) against the composition it replaced in the flash path (norm, then
//! RoPE on the rotary part, the rest passed through), bit for bit, on the head shapes of Llama,
//! Qwen3, GLM-4.5 (partial rotary), Qwen3.5 / Qwen3-Next (partial rotary, f32 `1 + w`) and odd
//! widths.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use exactscore_server::cuda::norm::{gated_rms_norm_block_per_row, rms_norm_block_per_row};
use exactscore_server::cuda::rope::head_norm_rope as fused_kernel;
use exactscore_server::ops::{gated_rms_norm, rms_norm, rope_rotate_half, rotate_leading};

use crate::bits_equal;

/// `[tokens, heads, dim]` random values of `dtype` and a norm weight (`f32_weight`: in f32).
fn inputs(
    device: &Device,
    (tokens, heads, dim): (usize, usize, usize),
    dtype: DType,
    f32_weight: bool,
) -> Result<(Tensor, Tensor)> {
    let x = Tensor::randn(0f32, 2.0, (tokens, heads, dim), device)?.to_dtype(dtype)?;
    let weight = Tensor::rand(0.5f32, 1.5, dim, device)?;
    let weight = match f32_weight {
        true => weight,
        false => weight.to_dtype(dtype)?,
    };
    Ok((x, weight))
}

/// A norm as served against its block-per-row kernel (`norms` gives both of `x` and a weight)
/// over `widths` × dtypes × weights in the dtype or in f32: prints one line per case, returns
/// the number whose bits differ.
fn against_block_per_row(
    device: &Device,
    name: &str,
    widths: &[usize],
    norms: impl Fn(&Tensor, &Tensor) -> Result<(Tensor, Tensor)>,
) -> Result<usize> {
    println!("| {name}, as served vs a block per row | dtype | weight | bitwise | |");
    println!("|---|---|---|---|---|");
    let mut failures = 0;
    for &dim in widths {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for f32_weight in [false, true] {
                if f32_weight && dtype == DType::F32 {
                    continue;
                }
                let rows = if dim <= 256 { 300 } else { 70 };
                let (x, weight) = inputs(device, (rows, 3, dim), dtype, f32_weight)?;
                let (served, block) = norms(&x, &weight)?;
                let same = bits_equal(&served, &block)?;
                failures += usize::from(!same);
                println!(
                    "| {dim} wide | {dtype:?} | {:?} | {same} | {} |",
                    weight.dtype(),
                    if same { "ok" } else { "FAIL" }
                );
            }
        }
    }
    Ok(failures)
}

/// Prints one line per case; returns the number of cases whose bits differ.
pub fn run(device: &Device) -> Result<usize> {
    println!(
        "| RMSNorm, lanes or a warp per row vs a block per row | dtype | weight | bitwise | |"
    );
    println!("|---|---|---|---|---|");
    let eps = 1e-6;
    let mut failures = 0;
    // head widths (lanes per row), then rows of a warp each, past 2,048 several vectors a thread
    let widths = [64, 80, 128, 256, 264, 2048, 2816, 3000, 8192];
    failures += against_block_per_row(device, "RMSNorm", &widths, |x, w| {
        Ok((
            rms_norm(x, w, eps, None)?,
            rms_norm_block_per_row(x, w, eps as f32)?,
        ))
    })?;
    failures +=
        against_block_per_row(device, "gated RMSNorm", &[16, 64, 100, 128, 256], |x, w| {
            let z = Tensor::randn(0f32, 2.0, x.dims(), device)?.to_dtype(x.dtype())?;
            Ok((
                gated_rms_norm(x, w, &z, eps)?,
                gated_rms_norm_block_per_row(x, w, &z, eps as f32)?,
            ))
        })?;
    println!("| per-head norm + RoPE, fused vs composed | dtype | bitwise | |");
    println!("|---|---|---|---|");
    let lens = [37usize, 1, 130];
    let tokens: usize = lens.iter().sum();
    let pos: Vec<i32> = lens.iter().flat_map(|&l| 0..l as i32).collect();
    let positions = Tensor::new(pos.as_slice(), device)?;
    // (heads, dim, rotary dims, norm: None, Some(false) in the dtype, Some(true) in f32)
    for (heads, dim, rot, norm) in [
        (8, 128, 128, None),
        (32, 128, 128, Some(false)),
        (4, 128, 64, Some(false)),
        (6, 256, 64, Some(true)),
        (2, 256, 256, Some(true)),
        (3, 64, 64, Some(false)),
        (5, 80, 32, Some(true)),
    ] {
        for dtype in [DType::BF16, DType::F16] {
            let (x, weight) = inputs(device, (tokens, heads, dim), dtype, norm == Some(true))?;
            let table = || -> Result<Tensor> {
                Ok(Tensor::randn(0f32, 1.0, (256, rot / 2), device)?.to_dtype(dtype)?)
            };
            let (cos, sin) = (table()?, table()?);
            let norm_args = norm.map(|_| (&weight, eps));
            let Some(fused) = fused_kernel(&x, norm_args, rot, &positions, &cos, &sin)? else {
                bail!("head_norm_rope: no fused kernel for {heads} heads of {dim}, {rot} rotary");
            };
            let normed = match norm {
                Some(_) => rms_norm_block_per_row(&x, &weight, eps as f32)?,
                None => x.clone(),
            };
            let composed = rotate_leading(&normed, rot, |x| {
                rope_rotate_half(x, &positions, &cos, &sin)
            })?;
            let same = bits_equal(&fused, &composed)?;
            failures += usize::from(!same);
            println!(
                "| {heads} heads of {dim}, {rot} rotary, norm {} | {dtype:?} | {same} | {} |",
                match norm {
                    None => "none",
                    Some(false) => "in the dtype",
                    Some(true) => "f32",
                },
                if same { "ok" } else { "FAIL" }
            );
        }
    }
    Ok(failures)
}
