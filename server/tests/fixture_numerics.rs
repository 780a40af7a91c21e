//! Every fixture variant scored in f32 on the CPU against the Python stack's reference.json.

mod common;

use common::*;
use exactscore_server::model::SequenceScores;
use exactscore_server::quant::ActivationQuantMode::{Emulate, Off};

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn mean_nll(scores: &[SequenceScores]) -> f64 {
    let n: usize = scores.iter().map(|s| s.num_scored()).sum();
    scores.iter().map(|s| s.sum_nll()).sum::<f64>() / n as f64
}

fn assert_exact(variant: &str, act: exactscore_server::quant::ActivationQuantMode, block: &str) {
    let reference = reference(variant);
    let model = load(variant, act);
    let seqs = sequences(&reference);
    let ours = score_all(&model, &seqs, 1);
    let expected = match block {
        "sequences" => &reference["sequences"],
        other => &reference[other]["sequences"],
    };
    let d = deltas(&ours, &reference_logprobs(expected));
    let max = d.iter().copied().fold(0.0, f64::max);
    println!(
        "{variant} ({block}): {} tokens, max |Δ| {max:.2e}, mean {:.2e}",
        d.len(),
        mean(&d)
    );
    assert_eq!(d.len(), 551);
    assert!(max <= 1e-4, "{variant}: max |Δlogprob| {max:e} > 1e-4");
}

#[test]
fn dense_matches_reference_per_token() {
    assert_exact("llama-dense-bf16", Emulate, "sequences");
}

#[test]
fn w4a16_g128_matches_reference_per_token() {
    assert_exact("llama-w4a16-g128", Emulate, "sequences");
}

#[test]
fn w4a16_asym_g64_v4_config_matches_reference_per_token() {
    assert_exact("llama-w4a16-asym-g64", Emulate, "sequences");
}

#[test]
fn w8a16_channel_matches_reference_per_token() {
    assert_exact("llama-w8a16-channel", Emulate, "sequences");
}

#[test]
fn nvfp4a16_matches_reference_per_token() {
    assert_exact("llama-nvfp4a16", Emulate, "sequences");
}

#[test]
fn nvfp4_weights_only_matches_reference_per_token() {
    assert_exact("llama-nvfp4", Off, "weights_only");
}

#[test]
fn fp8_dynamic_weights_only_matches_reference_per_token() {
    assert_exact("llama-fp8-dynamic", Off, "weights_only");
}

#[test]
fn nvfp4_with_activation_qdq_matches_reference() {
    let reference = reference("llama-nvfp4");
    let ours = score_all(&load("llama-nvfp4", Emulate), &sequences(&reference), 0);
    let d = deltas(&ours, &reference_logprobs(&reference["sequences"]));
    let within = d.iter().filter(|&&x| x <= 1e-4).count() as f64 / d.len() as f64;
    let max = d.iter().copied().fold(0.0, f64::max);
    let ref_nll = reference["mean_nll"].as_f64().unwrap();
    let rel = (mean_nll(&ours) - ref_nll).abs() / ref_nll;
    println!(
        "nvfp4 W4A4: {:.2}% within 1e-4, max {max:.3}, mean NLL rel err {rel:.2e}",
        within * 100.0
    );
    assert!(within >= 0.99, "only {within} of tokens within 1e-4");
    assert!(max <= 0.5, "max |Δ| {max}");
    assert!(rel <= 0.01, "mean NLL off by {rel}");
}

#[test]
fn fp8_dynamic_with_activation_qdq_matches_reference_statistically() {
    let reference = reference("llama-fp8-dynamic");
    let ours = score_all(
        &load("llama-fp8-dynamic", Emulate),
        &sequences(&reference),
        0,
    );
    let d = deltas(&ours, &reference_logprobs(&reference["sequences"]));
    let ref_nll = reference["mean_nll"].as_f64().unwrap();
    let nll_delta = (mean_nll(&ours) - ref_nll).abs();
    println!(
        "fp8 W8A8: mean |Δ| {:.3e}, |Δ mean NLL| {nll_delta:.2e}",
        mean(&d)
    );
    assert!(mean(&d) <= 0.1, "mean |Δ| {}", mean(&d));
    assert!(
        nll_delta <= 0.02 && nll_delta / ref_nll <= 0.01,
        "mean NLL off by {nll_delta}"
    );
}

#[test]
fn activation_quant_changes_the_result_when_emulated() {
    // Guards against QDQ silently not being applied: the two modes must differ.
    let reference = reference("llama-fp8-dynamic");
    let seqs = sequences(&reference);
    let on = score_all(&load("llama-fp8-dynamic", Emulate), &seqs[..1], 0);
    let off = score_all(&load("llama-fp8-dynamic", Off), &seqs[..1], 0);
    assert_ne!(on, off);
}

#[test]
fn argmax_matches_reference_top1() {
    for variant in ["llama-dense-bf16", "llama-w4a16-g128", "llama-nvfp4a16"] {
        let reference = reference(variant);
        let ours = score_all(&load(variant, Emulate), &sequences(&reference), 5);
        for (s, r) in ours.iter().zip(reference["sequences"].as_array().unwrap()) {
            let top1: Vec<u32> = r["top1_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let mine: Vec<u32> = s.rows.iter().map(|row| row.argmax.0).collect();
            assert_eq!(mine, top1, "{variant}");
            for row in &s.rows {
                assert_eq!(row.top_k[0], row.argmax);
                assert!(row.top_k.windows(2).all(|w| w[0].1 >= w[1].1));
            }
        }
    }
}

#[test]
fn batch_invariance_is_bitwise() {
    for variant in ["llama-w4a16-g128", "llama-nvfp4"] {
        let model = load(variant, Emulate);
        let seqs = sequences(&reference(variant));
        let batched = score_all(&model, &seqs, 3);
        for (i, seq) in seqs.iter().enumerate() {
            let alone = score_all(&model, std::slice::from_ref(seq), 3);
            assert_eq!(
                alone[0], batched[i],
                "{variant}: sequence {i} differs alone vs batched"
            );
        }
        // Another batch composition: reversed order with a duplicate.
        let mut mixed: Vec<Vec<u32>> = seqs.iter().rev().cloned().collect();
        mixed.push(seqs[1].clone());
        let mixed_scores = score_all(&model, &mixed, 3);
        assert_eq!(mixed_scores[4], batched[1]);
        assert_eq!(mixed_scores[0], batched[3]);
        // Over 4096 tokens: the MLP runs the batch in 2048-row chunks whose edges cut through
        // sequences (and quantizes each chunk's activations on its own).
        let long = repeated_past(&seqs, 4096);
        for (i, scores) in score_all(&model, &long, 3).iter().enumerate() {
            assert_eq!(
                *scores,
                batched[i % seqs.len()],
                "{variant}: sequence {i} of the long batch differs"
            );
        }
    }
}

/// `seqs` repeated, whole, until they hold more than `tokens` tokens.
fn repeated_past(seqs: &[Vec<u32>], tokens: usize) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    while out.iter().map(Vec::len).sum::<usize>() <= tokens {
        out.extend(seqs.iter().cloned());
    }
    out
}

#[test]
fn dense_hidden_states_match_debug_activations() {
    let model = load("llama-dense-bf16", Emulate);
    let path = fixtures().join("llama-dense-bf16/debug_activations_seq0.safetensors");
    let acts = candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap();
    let ids: Vec<u32> = acts["input_ids"]
        .to_dtype(candle_core::DType::U32)
        .unwrap()
        .to_vec1()
        .unwrap();
    let hidden = model.hidden_states(&[&ids]).unwrap();
    let diff = (hidden - &acts["norm.out"])
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(diff < 1e-4, "final norm output differs by {diff}");
}
