//! `check`'s stored-reference rows: the GPU kernels behind `/reference` (a row's top K and its
//! tail's log-mass) and `/kld/stored` (the served model's log q of the stored tokens, its tail
//! log-mass and the worst tail the bound allows) against their CPU references in
//! `ops::scoring`, on the same logits (the CPU reads a copy of the GPU's rows).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use exactscore_server::ops::{reference_rows, served_tail_rows, ReferenceRow, TailBudget};

/// Rows of logits with what makes the kernels' cases: values on a coarse grid (ties at the
/// K-th place, broken by the lower id), a −∞ logit and a row of equal values.
fn logits(rows: usize, vocab: usize, device: &Device) -> Result<Tensor> {
    let x = (Tensor::randn(0f32, 3.0, (rows, vocab), &Device::Cpu)? * 4.0)?
        .round()?
        .affine(0.25, 0.0)?;
    let mut v = x.to_vec2::<f32>()?;
    v[0][vocab / 2] = f32::NEG_INFINITY;
    v[rows - 1].iter_mut().for_each(|l| *l = 1.5);
    Ok(Tensor::new(v, &Device::Cpu)?.to_device(device)?)
}

/// Largest |a − b| over matching pairs: equal infinities count 0, a NaN on either side ∞.
fn max_delta(pairs: impl Iterator<Item = (f64, f64)>) -> f64 {
    pairs
        .map(|(a, b)| match (a == b, (a - b).abs()) {
            (true, _) => 0.0,
            (false, d) if d.is_nan() => f64::INFINITY,
            (false, d) => d,
        })
        .fold(0.0, f64::max)
}

/// Prints one table row per (vocabulary, k, dtype); returns the number of failing rows.
pub fn run(device: &Device) -> Result<usize> {
    println!("Stored references: GPU kernels vs the CPU reference on the same logits (ids equal; log-probabilities and tail log-mass to 1e-6; served log q and worst tail relative 1e-9; each row alone = in the batch, bitwise).");
    println!("| vocab | k | dtype | reference ids equal | reference max |Δ| | served max |Δ| log q / tail | worst tail max rel | argmax equal | alone = batched | |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut failures = 0;
    for (vocab, k) in [(1000, 1), (1000, 1000), (50_000, 64), (151_936, 4096)] {
        for dtype in [DType::F32, DType::BF16] {
            let rows = 9;
            let gpu = logits(rows, vocab, device)?.to_dtype(dtype)?;
            let cpu = gpu.to_device(&Device::Cpu)?;
            let (g, c) = (reference_rows(&gpu, k)?, reference_rows(&cpu, k)?);
            let ids_equal = g.iter().zip(&c).all(|(a, b)| a.ids == b.ids);
            let reference_delta = max_delta(g.iter().zip(&c).flat_map(|(a, b)| {
                let lps = a.logprobs.iter().zip(&b.logprobs);
                lps.map(|(&x, &y)| (x as f64, y as f64))
                    .chain([(a.tail_logmass as f64, b.tail_logmass as f64)])
            }));
            // The served side against the CPU's stored rows, with budgets as the bound sets
            // them (the tail's mass, a cap of the K-th probability) and one where every tail
            // token is full.
            let ids: Vec<&[u32]> = c.iter().map(|r: &ReferenceRow| r.ids.as_slice()).collect();
            let targets: Vec<u32> = (0..rows).map(|r| ((r * 7919) % vocab) as u32).collect();
            let budgets: Vec<TailBudget> = c
                .iter()
                .enumerate()
                .map(|(r, row)| {
                    let mass = (row.tail_logmass as f64).exp();
                    let tokens = (vocab - row.ids.len()).max(1) as f64;
                    let cap = match r % 3 {
                        0 => mass / tokens,
                        _ => (*row.logprobs.last().unwrap() as f64).exp(),
                    };
                    TailBudget { mass, cap }
                })
                .collect();
            let sg = served_tail_rows(&gpu, &ids, &targets, &budgets)?;
            let sc = served_tail_rows(&cpu, &ids, &targets, &budgets)?;
            let served_delta = max_delta(sg.iter().zip(&sc).flat_map(|(a, b)| {
                a.logprobs
                    .iter()
                    .copied()
                    .zip(b.logprobs.iter().copied())
                    .chain([(a.log_tail_mass, b.log_tail_mass)])
                    .chain([(a.target_logprob as f64, b.target_logprob as f64)])
            }));
            let worst_rel = sg
                .iter()
                .zip(&sc)
                .map(|(a, b)| {
                    let scale = b.worst_tail.abs().max(f64::MIN_POSITIVE);
                    max_delta([(a.worst_tail, b.worst_tail)].into_iter()) / scale
                })
                .fold(0.0, f64::max);
            let argmax_equal = sg.iter().zip(&sc).all(|(a, b)| a.argmax == b.argmax);
            let alone = (0..rows).all(|r| {
                let row = gpu.narrow(0, r, 1).unwrap();
                reference_rows(&row, k).is_ok_and(|v| v[0] == g[r])
                    && served_tail_rows(&row, &ids[r..=r], &targets[r..=r], &budgets[r..=r])
                        .is_ok_and(|v| v[0] == sg[r])
            });
            let ok = ids_equal
                && reference_delta <= 1e-6
                && served_delta <= 1e-6
                && worst_rel <= 1e-9
                && argmax_equal
                && alone;
            failures += usize::from(!ok);
            println!(
                "| {vocab} | {k} | {dtype:?} | {ids_equal} | {reference_delta:.2e} | {served_delta:.2e} | {worst_rel:.2e} | {argmax_equal} | {alone} | {} |",
                if ok { "ok" } else { "FAIL" }
            );
        }
    }
    Ok(failures)
}
