//! `/kld`'s numbers on the fixtures, f32 on the CPU: a model against itself, and the dense bf16
//! original against its quantized variants, checked against an independent f64 computation
//! from the full log-softmax rows of both models.

mod common;

use common::{load, reference, sequences};
use exactscore_server::model::{kld_batch, Model, ScoreInput, SequenceKld};
use exactscore_server::quant::ActivationQuantMode::Off;

/// Full f64 log-softmax rows `[n, vocab]` of one sequence under `model`.
fn log_softmax_rows(model: &Model, tokens: &[u32]) -> Vec<Vec<f64>> {
    let hidden = model.hidden_states(&[tokens]).unwrap();
    let logits = model.logits(&hidden).unwrap();
    logits
        .to_vec2::<f32>()
        .unwrap()
        .into_iter()
        .map(|row| {
            let row: Vec<f64> = row.into_iter().map(f64::from).collect();
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + row.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
            row.into_iter().map(|l| l - lse).collect()
        })
        .collect()
}

/// Σ_v p(v) (log p(v) − log q(v)) for every row but the last.
fn independent_kld(p_rows: &[Vec<f64>], q_rows: &[Vec<f64>]) -> Vec<f64> {
    p_rows[..p_rows.len() - 1]
        .iter()
        .zip(q_rows)
        .map(|(p, q)| p.iter().zip(q).map(|(lp, lq)| lp.exp() * (lp - lq)).sum())
        .collect()
}

/// Ids of a row sorted best first, the lowest id first on ties.
fn ranking(row: &[f64]) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..row.len()).collect();
    ids.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    ids
}

/// Bit K − 1 set when the K best ids of both rows are the same set, K = 1..=5.
fn independent_agreement(p: &[f64], q: &[f64]) -> u8 {
    let (a, b) = (ranking(p), ranking(q));
    (1..=5).fold(0, |mask, k| {
        let mut x = a[..k].to_vec();
        let mut y = b[..k].to_vec();
        x.sort_unstable();
        y.sort_unstable();
        mask | (u8::from(x == y) << (k - 1))
    })
}

fn fixture_sequences() -> Vec<Vec<u32>> {
    sequences(&reference("llama-dense-bf16"))
}

fn run(model: &Model, reference: &Model, seqs: &[Vec<u32>]) -> Vec<SequenceKld> {
    let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
    kld_batch(model, reference, &refs).unwrap()
}

#[test]
fn a_model_against_itself_diverges_by_exactly_zero() {
    let model = load("llama-w4a16-g128", Off);
    let seqs = fixture_sequences();
    let out = run(&model, &model, &seqs);
    let mut tokens = 0;
    for (seq, k) in seqs.iter().zip(&out) {
        assert_eq!(k.num_scored(), seq.len() - 1);
        for t in &k.tokens {
            assert_eq!((t.kld, t.reverse_kld), (0.0, 0.0));
            assert!(t.same_top);
            assert_eq!(t.top_k_agreement, 0b11111);
            assert_eq!(t.logprob, t.reference_logprob);
        }
        tokens += k.num_scored();
    }
    assert!(tokens > 500, "only {tokens} tokens checked");
}

/// The quantized variant's per-token KLD from the dense original, against the f64 computation
/// from both models' full rows; also the served model's logprobs against `/score`'s.
fn assert_kld_matches_independent_f64(variant: &str) {
    let dense = load("llama-dense-bf16", Off);
    let quantized = load(variant, Off);
    let seqs = fixture_sequences();
    let out = run(&quantized, &dense, &seqs);
    let (mut worst, mut total, mut same_top, mut n) = (0f64, 0f64, 0usize, 0usize);
    let (mut worst_reverse, mut worst_top_p, mut total_reverse) = (0f64, 0f64, 0f64);
    let mut agreement = [0usize; 5];
    for (seq, k) in seqs.iter().zip(&out) {
        let p = log_softmax_rows(&dense, seq);
        let q = log_softmax_rows(&quantized, seq);
        let expected = independent_kld(&p, &q);
        let expected_reverse = independent_kld(&q, &p);
        assert_eq!(k.tokens.len(), expected.len());
        let scores = quantized
            .score(&[ScoreInput {
                stored: exactscore_server::model::StoredRequest::NONE,
                tokens: seq,
                top_k: 0,
            }])
            .unwrap();
        for (i, (t, e)) in k.tokens.iter().zip(&expected).enumerate() {
            worst = worst.max((t.kld - e).abs());
            total += t.kld;
            let target = seq[i + 1] as usize;
            assert!((t.reference_logprob as f64 - p[i][target]).abs() < 1e-6);
            assert_eq!(Some(t.logprob), scores[0].rows[i].target_logprob);
            let argmax = |row: &[f64]| {
                (0..row.len()).fold(0, |best, v| if row[v] > row[best] { v } else { best })
            };
            assert_eq!(
                t.same_top,
                argmax(&p[i]) == argmax(&q[i]),
                "{variant} row {i}"
            );
            same_top += usize::from(t.same_top);
            n += 1;
            worst_reverse = worst_reverse.max((t.reverse_kld - expected_reverse[i]).abs());
            total_reverse += t.reverse_kld;
            let top_p = p[i].iter().copied().fold(f64::NEG_INFINITY, f64::max).exp();
            worst_top_p = worst_top_p.max((t.reference_top_p - top_p).abs());
            assert_eq!(
                t.top_k_agreement,
                independent_agreement(&p[i], &q[i]),
                "{variant} row {i}"
            );
            for (k, count) in agreement.iter_mut().enumerate() {
                *count += usize::from(t.top_k_agreement & (1 << k) != 0);
            }
        }
    }
    let mean = total / n as f64;
    println!(
        "{variant}: {n} tokens, mean KLD {mean:.6} (reverse {:.6}), same top {:.1} %, top-K \
         agreement {:?}, max |Δ| vs f64 {worst:.2e} (reverse {worst_reverse:.2e}, top p \
         {worst_top_p:.2e})",
        total_reverse / n as f64,
        100.0 * same_top as f64 / n as f64,
        agreement.map(|a| format!("{:.1} %", 100.0 * a as f64 / n as f64)),
    );
    assert!(worst <= 1e-6, "{variant}: max |Δ| {worst:e}");
    assert!(
        worst_reverse <= 1e-6,
        "{variant}: reverse max |Δ| {worst_reverse:e}"
    );
    assert!(
        worst_top_p <= 1e-7,
        "{variant}: top p max |Δ| {worst_top_p:e}"
    );
    // Not every position agrees on its top 5, nor none: the check saw both outcomes.
    assert!(
        agreement[4] > 0 && agreement[4] < n,
        "{variant}: {agreement:?}"
    );
    // A quantized model must differ from the original, and not wildly.
    assert!(mean > 1e-5 && mean < 1.0, "{variant}: mean KLD {mean}");
}

#[test]
fn w4a16_kld_from_dense_matches_f64() {
    assert_kld_matches_independent_f64("llama-w4a16-g128");
}

#[test]
fn nvfp4a16_kld_from_dense_matches_f64() {
    assert_kld_matches_independent_f64("llama-nvfp4a16");
}

#[test]
fn fp8_dynamic_kld_from_dense_matches_f64() {
    assert_kld_matches_independent_f64("llama-fp8-dynamic");
}

#[test]
fn long_sequences_are_chunked_and_batches_do_not_change_results() {
    let long_context = |variant: &str| {
        let mut opts = common::options(candle_core::DType::F32, Off);
        opts.max_seq_len = 1100;
        Model::load(&common::fixtures().join(variant), &opts).unwrap()
    };
    let dense = long_context("llama-dense-bf16");
    let quantized = long_context("llama-w4a16-g128");
    let seqs = fixture_sequences();
    // Longer than one lm_head chunk (1024 rows): the chunk boundary must not show.
    let long: Vec<u32> = seqs.iter().flatten().copied().cycle().take(1100).collect();
    let out = run(&quantized, &dense, std::slice::from_ref(&long));
    let expected = independent_kld(
        &log_softmax_rows(&dense, &long),
        &log_softmax_rows(&quantized, &long),
    );
    assert_eq!(out[0].tokens.len(), 1099);
    for (t, e) in out[0].tokens.iter().zip(&expected) {
        assert!((t.kld - e).abs() <= 1e-6, "{} vs {e}", t.kld);
    }
    // Alone or beside others, a sequence's divergences are the same bits.
    let batch = run(&quantized, &dense, &seqs);
    for (i, seq) in seqs.iter().enumerate() {
        let alone = run(&quantized, &dense, std::slice::from_ref(seq));
        assert_eq!(alone[0], batch[i], "sequence {i}");
    }
}
