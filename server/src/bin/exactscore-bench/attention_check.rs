//! The flash-attention kernel against an f32 reference computed with plain tensor ops on the
//! same (bf16/f16-rounded) inputs: head sizes 64 and 128, GQA, several sequences of different
//! lengths in one launch (block edges, a 1-token sequence), with and without a sliding window;
//! every compiled tiling, which must give the default's bits wherever its key steps are the
//! same. Then each tiling's time on the Llama-3-8B attention shape.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, D};
use exactscore_server::model::causal_mask;
use exactscore_server::ops::{flash_attention, rope_rotate_half, FlashOptions, FlashTiling};
use half::bf16;

/// f32 causal attention of one sequence `[len, heads, dim]` → `[len, heads * dim]`.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, window: Option<usize>) -> Result<Tensor> {
    let (len, hq, dim) = q.dims3()?;
    let hkv = k.dims()[1];
    let group = hq / hkv;
    let expand = |t: &Tensor| -> Result<Tensor> {
        Ok(t.transpose(0, 1)?
            .unsqueeze(1)?
            .expand((hkv, group, len, dim))?
            .reshape((hq, len, dim))?)
    };
    let q = q.to_dtype(DType::F32)?.transpose(0, 1)?.contiguous()?;
    let (k, v) = (
        expand(&k.to_dtype(DType::F32)?)?,
        expand(&v.to_dtype(DType::F32)?)?,
    );
    let scores = (q.matmul(&k.t()?)? / (dim as f64).sqrt())?;
    let mask = causal_mask(len, window, q.device())?;
    let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    Ok(probs
        .matmul(&v)?
        .transpose(0, 1)?
        .reshape((len, hq * dim))?)
}

/// (max |Δ| / max |ref|, mean |Δ| / mean |ref|) of `got` against `want`.
fn relative_error(got: &Tensor, want: &Tensor) -> Result<(f64, f64)> {
    let d = (got.to_dtype(DType::F32)? - want)?.abs()?;
    let w = want.abs()?;
    let max = |t: &Tensor| -> Result<f64> {
        Ok(t.flatten_all()?.max(D::Minus1)?.to_scalar::<f32>()? as f64)
    };
    let mean = |t: &Tensor| -> Result<f64> { Ok(t.mean_all()?.to_scalar::<f32>()? as f64) };
    Ok((max(&d)? / max(&w)?, mean(&d)? / mean(&w)?))
}

/// Prints one table row per case; fails when any case is off by more than bf16/f16 rounding.
pub fn run(device: &Device) -> Result<()> {
    println!("| flash attention case | max |Δ| / max |ref| | mean |Δ| / mean |ref| | |");
    println!("|---|---|---|---|");
    let lens = [700usize, 2048, 1, 65];
    let tokens: usize = lens.iter().sum();
    let starts: Vec<i32> = std::iter::once(0)
        .chain(lens.iter().scan(0i32, |e, &l| {
            *e += l as i32;
            Some(*e)
        }))
        .collect();
    let starts_t = Tensor::new(starts.as_slice(), device)?;
    let mut failures = 0;
    for dtype in [DType::BF16, DType::F16] {
        for dim in [64usize, 128, 192, 256] {
            for window in [None, Some(256usize)] {
                let (hq, hkv) = (8, 2);
                // Peaked softmax (scores of a few units) like a trained model's.
                let q = (Tensor::randn(0f32, 1.0, (tokens, hq, dim), device)? * 2.0)?
                    .to_dtype(dtype)?;
                let k = Tensor::randn(0f32, 1.0, (tokens, hkv, dim), device)?.to_dtype(dtype)?;
                let v = Tensor::randn(0f32, 1.0, (tokens, hkv, dim), device)?.to_dtype(dtype)?;
                let plain = FlashOptions {
                    window,
                    ..FlashOptions::plain(dim)
                };
                let run = |tiling| {
                    let opts = FlashOptions { tiling, ..plain };
                    flash_attention(&q, &k, &v, &starts_t, 2048, &opts)
                };
                let default = run(FlashTiling::sync_for(dim))?;
                for &tiling in FlashTiling::compiled(dim) {
                    if !tiling.runs_on(device)? {
                        continue;
                    }
                    let got = run(tiling)?;
                    let (mut worst_max, mut worst_mean) = (0f64, 0f64);
                    for (i, &len) in lens.iter().enumerate() {
                        let s = starts[i] as usize;
                        let want = reference(
                            &q.narrow(0, s, len)?,
                            &k.narrow(0, s, len)?,
                            &v.narrow(0, s, len)?,
                            window,
                        )?;
                        let (mx, mn) = relative_error(&got.narrow(0, s, len)?, &want)?;
                        worst_max = worst_max.max(mx);
                        worst_mean = worst_mean.max(mn);
                    }
                    // bf16 keeps 8 significant bits (f16 11): P and the output are rounded once
                    // each. A row's arithmetic does not depend on the rows tiling, nor on the
                    // MMA instructions (mma.sync and wgmma accumulate in the same order).
                    let same_bits = host_f32(&got)? == host_f32(&default)?;
                    let ok = worst_max <= 0.02
                        && worst_mean <= 0.005
                        && (same_bits || tiling.keys != FlashTiling::DEFAULT.keys);
                    failures += usize::from(!ok);
                    println!(
                        "| {dtype:?} d{dim} {}x{} {:?} window {window:?} lens {lens:?} GQA {hq}/{hkv} | {worst_max:.2e} | {worst_mean:.2e} | {}{} |",
                        tiling.rows,
                        tiling.keys,
                        tiling.mma,
                        if ok { "ok" } else { "FAIL" },
                        if same_bits { ", default's bits" } else { "" }
                    );
                }
            }
        }
    }
    // RoPE kernel vs PyTorch's rounding in bf16, transcribed on the CPU (bitwise expected), and
    // how far candle's rope (FMA-contracted) lies from it.
    let (len, heads, dim) = (300usize, 4usize, 128usize);
    let half = dim / 2;
    let x = Tensor::randn(0f32, 1.0, (len, heads, dim), device)?.to_dtype(DType::BF16)?;
    let (cos, sin) = rope_tables(len, half, DType::BF16, device)?;
    let positions = Tensor::new((0..len as i32).collect::<Vec<_>>().as_slice(), device)?;
    let ours = host_f32(&rope_rotate_half(&x, &positions, &cos, &sin)?)?;
    let (xs, cs, ss) = (host_f32(&x)?, host_f32(&cos)?, host_f32(&sin)?);
    let round = |v: f32| bf16::from_f32(v).to_f32();
    let mut reference = vec![0f32; len * heads * dim];
    for (row, out) in reference.chunks_mut(dim).enumerate() {
        let (src, table) = (&xs[row * dim..(row + 1) * dim], (row / heads) * half);
        for i in 0..half {
            let (c, s, x1, x2) = (cs[table + i], ss[table + i], src[i], src[i + half]);
            out[i] = round(round(x1 * c) - round(x2 * s));
            out[i + half] = round(round(x2 * c) + round(x1 * s));
        }
    }
    let same = ours
        .iter()
        .zip(&reference)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    let candle = host_f32(
        &candle_nn::rotary_emb::rope(&x.transpose(0, 1)?.contiguous()?.unsqueeze(0)?, &cos, &sin)?
            .squeeze(0)?
            .transpose(0, 1)?
            .contiguous()?,
    )?;
    let candle_differs = candle
        .iter()
        .zip(&reference)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    failures += usize::from(!same);
    println!(
        "| RoPE kernel vs PyTorch rounding (CPU), bf16 d128: bitwise = {same}; candle's rope differs in {candle_differs} of {} values | | | {} |",
        reference.len(),
        if same { "ok" } else { "FAIL" }
    );
    // Soft-capping in one kernel against candle's three ops on the same device, bitwise:
    // logits of Gemma's range and beyond the cap, zeros of both signs, ±∞.
    let mut values: Vec<f32> = (0..1 << 16)
        .map(|i| (i as f32 - 32768.0) * 0.0031)
        .collect();
    values.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, 1e-30, -1e-30]);
    let x = Tensor::new(values.as_slice(), device)?;
    let mut soft_cap_same = Vec::new();
    for (dtype, cap) in [(DType::F32, 30.0), (DType::BF16, 30.0), (DType::BF16, 50.0)] {
        let x = x.to_dtype(dtype)?;
        let fused = host_f32(&exactscore_server::ops::soft_cap(&x, cap)?)?;
        let composed = host_f32(&exactscore_server::ops::soft_cap_composed(&x, cap)?)?;
        let differ = fused
            .iter()
            .zip(&composed)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        soft_cap_same.push(format!("{dtype:?} cap {cap}: {differ} differ"));
        failures += usize::from(differ > 0);
    }
    println!(
        "| soft-cap kernel vs candle's three ops, bitwise over {} values: {} | | | {} |",
        values.len(),
        soft_cap_same.join(", "),
        if soft_cap_same.iter().all(|s| s.contains(": 0 differ")) {
            "ok"
        } else {
            "FAIL"
        }
    );
    if failures > 0 {
        bail!("{failures} flash-attention check(s) failed");
    }
    Ok(())
}

/// RoPE-like `(cos, sin)` tables `[positions, half]` in `dtype` (angles spread over [0, 10)).
fn rope_tables(
    positions: usize,
    half: usize,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let angles: Vec<f32> = (0..positions * half)
        .map(|i| (i % 997) as f32 * 0.01)
        .collect();
    let angles = Tensor::from_vec(angles, (positions, half), device)?;
    Ok((
        angles.cos()?.to_dtype(dtype)?,
        angles.sin()?.to_dtype(dtype)?,
    ))
}

/// Any float tensor's values as f32 on the host, flattened (exact for bf16/f16).
fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// Each compiled tiling's time on the attention of `windows` 2048-token windows of the
/// Llama-3-8B shape (32 query heads, 8 KV heads, head_dim 128, bf16) and of GLM-4.7-Flash's and
/// DeepSeek-V3's MLA (20 heads of 256, 128 of 192: keys and values expanded from the latent,
/// values padded to the keys' width): the median of 20 launches, each synchronized, and the rate
/// on the causal half (2·2·T²/2·d per head).
pub fn timing(device: &Device, windows: usize) -> Result<()> {
    let len = 2048usize;
    let tokens = windows * len;
    let starts: Vec<i32> = (0..=windows as i32).map(|i| i * len as i32).collect();
    let starts = Tensor::new(starts.as_slice(), device)?;
    println!("| shape | flash tiling (rows x keys), {windows} windows | ms per layer | TFLOP/s on the causal half |");
    println!("|---|---|---|---|");
    for (shape, hq, hkv, dim) in [
        ("Llama-3-8B", 32usize, 8usize, 128usize),
        ("GLM-4.7-Flash", 20, 20, 256),
        ("DeepSeek-V3", 128, 128, 192),
    ] {
        let q = Tensor::randn(0f32, 2.0, (tokens, hq, dim), device)?.to_dtype(DType::BF16)?;
        let k = Tensor::randn(0f32, 1.0, (tokens, hkv, dim), device)?.to_dtype(DType::BF16)?;
        let v = Tensor::randn(0f32, 1.0, (tokens, hkv, dim), device)?.to_dtype(DType::BF16)?;
        let flops = (4 * len * len * dim * hq * windows) as f64 / 2.0;
        for &tiling in FlashTiling::compiled(dim) {
            if !tiling.runs_on(device)? {
                continue;
            }
            let opts = FlashOptions {
                tiling,
                ..FlashOptions::plain(dim)
            };
            let run = || {
                flash_attention(&q, &k, &v, &starts, len, &opts).and_then(|o| {
                    device.synchronize()?;
                    Ok(o)
                })
            };
            run()?;
            let mut times: Vec<f64> = (0..20)
                .map(|_| {
                    let t = std::time::Instant::now();
                    run().map(|_| t.elapsed().as_secs_f64())
                })
                .collect::<candle_core::Result<_>>()?;
            times.sort_by(f64::total_cmp);
            let median = times[times.len() / 2];
            println!(
                "| {shape} d{dim} | {}x{} {:?} | {:.3} | {:.0} |",
                tiling.rows,
                tiling.keys,
                tiling.mma,
                median * 1e3,
                flops / median / 1e12
            );
        }
    }
    Ok(())
}
