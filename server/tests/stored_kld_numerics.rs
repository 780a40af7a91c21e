//! A stored reference on the fixtures, f32 on the CPU: the dense bf16 original saved at several
//! K, each quantized variant bounded against it, and the bounds set against the exact
//! co-resident divergence (`kld_batch`) at every position.

mod common;

use std::sync::Arc;

use common::{load, reference, sequences};
use exactscore_server::model::stored_kld::{BoundedKld, StoredSequence};
use exactscore_server::model::{
    kld_batch, Model, ScoreInput, SequenceScores, StoredOutput, StoredRequest,
};
use exactscore_server::quant::ActivationQuantMode::Off;

fn score(model: &Model, tokens: &[u32], stored: &StoredRequest) -> SequenceScores {
    let input = ScoreInput {
        tokens,
        top_k: 0,
        stored,
    };
    model.score(&[input]).unwrap().remove(0)
}

/// The reference's stored rows of `tokens` at `k`, every position.
fn save(reference: &Model, tokens: &[u32], k: usize) -> StoredSequence {
    let StoredOutput::Reference(rows) = score(reference, tokens, &StoredRequest::Save { k }).stored
    else {
        panic!("no reference rows")
    };
    assert_eq!(rows.len(), tokens.len() - 1);
    StoredSequence {
        start: 0,
        k,
        ids: rows.iter().flat_map(|r| r.ids.clone()).collect(),
        logprobs: rows.iter().flat_map(|r| r.logprobs.clone()).collect(),
        tail_logmass: rows.iter().map(|r| r.tail_logmass).collect(),
    }
}

fn bound(model: &Model, tokens: &[u32], stored: StoredSequence) -> Vec<BoundedKld> {
    let request = StoredRequest::Bound(Arc::new(stored));
    match score(model, tokens, &request).stored {
        StoredOutput::Bounded(rows) => rows,
        other => panic!("{other:?}"),
    }
}

/// Per K: the quantized model bounded against the dense one stored at K, every position's exact
/// divergence inside its bounds; returns the summed widths, which must fall with K.
fn sweep(dense: &Model, quantized: &Model, variant: &str, seqs: &[Vec<u32>]) -> Vec<f64> {
    let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
    let exact = kld_batch(quantized, dense, &refs).unwrap();
    let mut widths = Vec::new();
    for k in [8, 32, 64, 256] {
        let (mut n, mut sum_exact, mut sum_low, mut sum_high, mut sum_est) =
            (0usize, 0f64, 0f64, 0f64, 0f64);
        let mut nll_delta = 0f32;
        for (tokens, exact) in seqs.iter().zip(&exact) {
            let rows = bound(quantized, tokens, save(dense, tokens, k));
            assert_eq!(rows.len(), exact.tokens.len());
            for (b, e) in rows.iter().zip(&exact.tokens) {
                assert!(
                    b.lower <= e.kld && e.kld <= b.upper,
                    "{variant} k {k}: exact {} outside [{}, {}]",
                    e.kld,
                    b.lower,
                    b.upper
                );
                nll_delta = nll_delta.max((b.logprob - e.logprob).abs());
                n += 1;
                sum_exact += e.kld;
                (sum_low, sum_high, sum_est) =
                    (sum_low + b.lower, sum_high + b.upper, sum_est + b.estimate);
            }
        }
        // The served log-probabilities are /kld's, bit for bit.
        assert_eq!(nll_delta, 0.0);
        let mean = |x: f64| x / n as f64;
        println!(
            "{variant} k {k:>3}: mean KLD {:.6} in [{:.6}, {:.6}] (width {:.2e}), estimate {:.6}, {n} positions",
            mean(sum_exact),
            mean(sum_low),
            mean(sum_high),
            mean(sum_high - sum_low),
            mean(sum_est),
        );
        widths.push(sum_high - sum_low);
    }
    assert!(
        widths.windows(2).all(|w| w[1] < w[0]),
        "{variant}: {widths:?}"
    );
    widths
}

/// Opt-in, the real SmolLM2-135M pair (scripts/make_real_smollm2.py):
/// `EXACTSCORE_REAL_MODELS=DIR cargo test --release --test stored_kld_numerics -- --ignored --nocapture`.
#[test]
#[ignore]
fn smollm2_bounds_by_k() {
    let root = std::path::PathBuf::from(
        std::env::var("EXACTSCORE_REAL_MODELS").expect("set EXACTSCORE_REAL_MODELS"),
    );
    let load_real = |variant: &str| {
        let opts = common::options(candle_core::DType::F32, Off);
        Model::load(&root.join(variant), &opts).unwrap()
    };
    let dense = load_real("smollm2-135m-dense-bf16");
    let quantized = load_real("smollm2-135m-w4a16-g64");
    let text = std::fs::read_to_string(root.join("smollm2-135m-dense-bf16/reference.json"));
    let seqs = sequences(&serde_json::from_str(&text.unwrap()).unwrap());
    sweep(&dense, &quantized, "smollm2-135m-w4a16-g64", &seqs);
}

#[test]
fn bounds_contain_the_co_resident_divergence_and_narrow_with_k() {
    let dense = load("llama-dense-bf16", Off);
    let seqs = sequences(&reference("llama-dense-bf16"));
    for variant in ["llama-w4a16-g128", "llama-nvfp4a16"] {
        let quantized = load(variant, Off);
        sweep(&dense, &quantized, variant, &seqs);
    }
}

#[test]
fn stored_rows_from_a_later_position_bound_only_those() {
    let dense = load("llama-dense-bf16", Off);
    let quantized = load("llama-w4a16-g128", Off);
    let tokens = &sequences(&reference("llama-dense-bf16"))[0];
    let full = save(&dense, tokens, 16);
    let all = bound(&quantized, tokens, full.clone());
    let (start, rows) = (5, 7);
    let part = StoredSequence {
        start,
        k: 16,
        ids: full.ids[start * 16..(start + rows) * 16].to_vec(),
        logprobs: full.logprobs[start * 16..(start + rows) * 16].to_vec(),
        tail_logmass: full.tail_logmass[start..start + rows].to_vec(),
    };
    assert_eq!(bound(&quantized, tokens, part), all[start..start + rows]);
}
