//! `/kld` on the device: the fused kernel against the CPU reference on the same logits, the
//! whole GPU path against the CPU path on the fixtures, and its speed next to `/score`'s.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use exactscore_server::model::kld::kld_logits;
use exactscore_server::model::{
    kld_batch, AttentionKernel, Model, ScoreInput, SequenceKld, TokenKld,
};
use exactscore_server::quant::ActivationQuantMode;

use crate::{gpu_used_bytes, options, random_model, sequences};

/// Each dense bf16 fixture with the quantized variants of the same model judged against it.
const PAIRS: &[(&str, &[&str])] = &[
    (
        "llama-dense-bf16",
        &["llama-w4a16-g128", "llama-nvfp4a16", "llama-fp8-dynamic"],
    ),
    ("gemma3-dense-bf16", &["gemma3-w4a16-g32"]),
];

fn flat(k: &[SequenceKld]) -> Vec<TokenKld> {
    k.iter().flat_map(|s| s.tokens.iter().copied()).collect()
}

fn max_kld_diff(a: &[TokenKld], b: &[TokenKld]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x.kld - y.kld).abs())
        .fold(0.0, f64::max)
}

/// The largest difference of the f64 outputs besides the KLD (reverse KLD, reference top
/// probability), and whether every top-K agreement mask is equal.
fn extras_diff(a: &[TokenKld], b: &[TokenKld]) -> (f64, f64, bool) {
    a.iter()
        .zip(b)
        .fold((0.0, 0.0, true), |(r, p, same), (x, y)| {
            (
                r.max((x.reverse_kld - y.reverse_kld).abs()),
                p.max((x.reference_top_p - y.reference_top_p).abs()),
                same && x.top_k_agreement == y.top_k_agreement && x.same_top == y.same_top,
            )
        })
}

fn mean_kld(a: &[TokenKld]) -> f64 {
    a.iter().map(|t| t.kld).sum::<f64>() / a.len().max(1) as f64
}

/// Prints one table row per fixture pair; returns how many rows failed.
pub fn check(fixtures: &Path, device: &Device) -> Result<usize> {
    let load = |variant: &str, device: &Device, dtype| {
        let attention = AttentionKernel::Materialized;
        let opts = options(device, dtype, ActivationQuantMode::Off, 512, attention);
        Model::load(&fixtures.join(variant), &opts).with_context(|| variant.to_string())
    };
    println!("KLD(dense bf16 ‖ variant) on the device vs the CPU f32 path; kernel vs the CPU reference on the same GPU logits.");
    println!("| variant | CPU f32 mean KLD | GPU f32 max abs Δ | GPU bf16 mean KLD | kernel vs CPU on bf16 logits: max abs Δ KLD / logprob, same-top equal | kernel vs CPU: max abs Δ reverse KLD / top p, top-K masks equal | f32 reference vs bf16 model: max abs Δ KLD vs CPU | self-KLD = 0 | |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut failures = 0;
    let mut same_device = None;
    for &(reference, quantized) in PAIRS {
        let seqs = fixture_sequences(fixtures, reference)?;
        failures += check_pair(reference, quantized, &seqs, &load, device, &mut same_device)?;
    }
    // With a second GPU: the reference there, its logits brought over by a peer copy, must give
    // the same bits as on one GPU.
    let (reference, quantized) = PAIRS[0];
    let seqs = fixture_sequences(fixtures, reference)?;
    let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
    if let (Ok(second), Some(expected)) = (
        exactscore_server::device::cuda(1),
        same_device.filter(|_| device.is_cuda()),
    ) {
        let split = kld_batch(
            &load(quantized[0], device, DType::F32)?,
            &load(reference, &second, DType::F32)?,
            &refs,
        )?;
        let bitwise = split == expected;
        failures += usize::from(!bitwise);
        println!(
            "| {} with the reference on {second:?}: bitwise equal to one GPU = {bitwise} | | | | | | | {} |",
            quantized[0],
            if bitwise { "ok" } else { "FAIL" }
        );
    }
    Ok(failures)
}

/// The token ids of a fixture's reference sequences.
fn fixture_sequences(fixtures: &Path, variant: &str) -> Result<Vec<Vec<u32>>> {
    let reference_json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        fixtures.join(variant).join("reference.json"),
    )?)?;
    Ok(sequences(&reference_json))
}

/// One table row per variant of `quantized` against `reference`; returns how many failed.
/// `same_device`: the first pair's f32 divergences on one GPU, for the two-GPU row.
fn check_pair(
    reference: &str,
    quantized: &[&str],
    seqs: &[Vec<u32>],
    load: &dyn Fn(&str, &Device, DType) -> Result<Model>,
    device: &Device,
    same_device: &mut Option<Vec<SequenceKld>>,
) -> Result<usize> {
    let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
    let mut failures = 0;
    for &variant in quantized {
        let cpu = kld_batch(
            &load(variant, &Device::Cpu, DType::F32)?,
            &load(reference, &Device::Cpu, DType::F32)?,
            &refs,
        )?;
        let (q32, r32) = (
            load(variant, device, DType::F32)?,
            load(reference, device, DType::F32)?,
        );
        let g32 = kld_batch(&q32, &r32, &refs)?;
        let self_zero = flat(&kld_batch(&q32, &q32, &refs)?).iter().all(|t| {
            t.kld == 0.0 && t.reverse_kld == 0.0 && t.same_top && t.top_k_agreement == 0b11111
        });
        let (q16, r16) = (
            load(variant, device, DType::BF16)?,
            load(reference, device, DType::BF16)?,
        );
        let g16 = flat(&kld_batch(&q16, &r16, &refs)?);
        // The kernel alone: the same bf16 logits through it and through the CPU reference.
        let (mut kernel_kld, mut kernel_lp, mut same_equal) = (0f64, 0f64, true);
        let (mut kernel_reverse, mut kernel_top_p, mut masks_equal) = (0f64, 0f64, true);
        let mut mixed_kld = 0f64;
        for s in seqs {
            let n = s.len() - 1;
            let logits = q16.logits(&q16.hidden_states(&[s])?.narrow(0, 0, n)?)?;
            let ref_logits = r16.logits(&r16.hidden_states(&[s])?.narrow(0, 0, n)?)?;
            let gpu = kld_logits(&ref_logits, &logits, &s[1..])?;
            let host = kld_logits(
                &ref_logits.to_device(&Device::Cpu)?,
                &logits.to_device(&Device::Cpu)?,
                &s[1..],
            )?;
            kernel_kld = kernel_kld.max(max_kld_diff(&gpu, &host));
            for (g, h) in gpu.iter().zip(&host) {
                kernel_lp = kernel_lp
                    .max((g.logprob - h.logprob).abs() as f64)
                    .max((g.reference_logprob - h.reference_logprob).abs() as f64);
                same_equal &= g.same_top == h.same_top;
            }
            let (reverse, top_p, masks) = extras_diff(&gpu, &host);
            kernel_reverse = kernel_reverse.max(reverse);
            kernel_top_p = kernel_top_p.max(top_p);
            masks_equal &= masks;
            // `--reference-dtype f32` beside a bf16 model: the rows of two dtypes meet in f32.
            let ref_f32 = r32.logits(&r32.hidden_states(&[s])?.narrow(0, 0, n)?)?;
            let gpu = kld_logits(&ref_f32, &logits, &s[1..])?;
            let host = kld_logits(
                &ref_f32.to_device(&Device::Cpu)?,
                &logits.to_device(&Device::Cpu)?,
                &s[1..],
            )?;
            mixed_kld = mixed_kld.max(max_kld_diff(&gpu, &host));
        }
        same_device.get_or_insert_with(|| g32.clone());
        let (cpu, g32) = (flat(&cpu), flat(&g32));
        let max32 = max_kld_diff(&g32, &cpu);
        // f32 logits on the GPU differ from the CPU's by ~1e-5 (cuBLAS summation order); the
        // kernel itself must agree with the f64 reference to rounding.
        let ok = max32 <= 1e-4
            && kernel_kld <= 1e-9
            && kernel_lp <= 1e-5
            && same_equal
            && kernel_reverse <= 1e-9
            && kernel_top_p <= 1e-9
            && masks_equal
            && mixed_kld <= 1e-9
            && self_zero;
        failures += usize::from(!ok);
        println!(
            "| {variant} (‖ {reference}) | {:.6} | {max32:.2e} | {:.6} | {kernel_kld:.1e} / {kernel_lp:.1e}, {same_equal} | {kernel_reverse:.1e} / {kernel_top_p:.1e}, {masks_equal} | {mixed_kld:.1e} | {self_zero} | {} |",
            mean_kld(&cpu),
            mean_kld(&g16),
            if ok { "ok" } else { "FAIL" }
        );
    }
    Ok(failures)
}

/// `/kld` throughput next to `/score` on random models of a real shape: the served `format`
/// and a bf16 reference, both on `device`. Fails below `min_ratio` of `/score`'s tokens/s.
#[allow(clippy::too_many_arguments)]
pub fn speed(
    shape: &str,
    format: &str,
    batches: &[usize],
    ctx: usize,
    iters: usize,
    dtype: DType,
    device: &Device,
    min_ratio: f64,
) -> Result<()> {
    let shape = random_model::Shape::named(shape)?;
    let build = |format: &str| random_model::model(&shape, format, device, dtype, ctx);
    let model = build(format)?;
    let after_model = gpu_used_bytes();
    let reference = build("bf16")?;
    device.synchronize()?;
    let after_reference = gpu_used_bytes();
    println!(
        "shape {}, {format} served, bf16 reference, ctx {ctx}, compute {dtype:?}; resident after load: {:.1} GiB (model) + {:.1} GiB (reference)",
        shape.name,
        after_model as f64 / (1u64 << 30) as f64,
        (after_reference - after_model) as f64 / (1u64 << 30) as f64
    );
    println!("| batch | /score ms/window | /score tokens/s | /kld ms/window | /kld tokens/s | kld / score | peak GPU GiB |");
    println!("|---|---|---|---|---|---|---|");
    let tokens: Vec<u32> = (0..ctx * batches.iter().max().unwrap_or(&1))
        .map(|i| ((i * 7919) % shape.vocab) as u32)
        .collect();
    let mut worst = f64::INFINITY;
    for &batch in batches {
        let seqs: Vec<&[u32]> = (0..batch)
            .map(|b| &tokens[b * ctx..(b + 1) * ctx])
            .collect();
        let inputs: Vec<ScoreInput> = seqs
            .iter()
            .map(|&tokens| ScoreInput {
                stored: exactscore_server::model::StoredRequest::NONE,
                tokens,
                top_k: 0,
            })
            .collect();
        let time = |f: &dyn Fn() -> Result<()>| -> Result<(f64, u64)> {
            f()?; // warm-up
            device.synchronize()?;
            let mut peak = gpu_used_bytes();
            let t = Instant::now();
            for _ in 0..iters {
                f()?;
                peak = peak.max(gpu_used_bytes());
            }
            device.synchronize()?;
            Ok((t.elapsed().as_secs_f64() / iters as f64, peak))
        };
        let (score_s, score_peak) = time(&|| Ok(model.score(&inputs).map(drop)?))?;
        let (kld_s, kld_peak) = time(&|| Ok(kld_batch(&model, &reference, &seqs).map(drop)?))?;
        let tps = |s: f64| (batch * ctx) as f64 / s;
        println!(
            "| {batch} | {:.1} | {:.0} | {:.1} | {:.0} | {:.3} | {:.1} |",
            score_s * 1e3 / batch as f64,
            tps(score_s),
            kld_s * 1e3 / batch as f64,
            tps(kld_s),
            score_s / kld_s,
            score_peak.max(kld_peak) as f64 / (1u64 << 30) as f64
        );
        worst = worst.min(score_s / kld_s);
    }
    if worst < min_ratio {
        anyhow::bail!("/kld ran at {worst:.3} of /score's tokens/s, under the {min_ratio} goal");
    }
    Ok(())
}
