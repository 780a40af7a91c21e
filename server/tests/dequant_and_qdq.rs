//! Dequantized weights vs `dequant_check.json`, and activation QDQ vs `act_qdq_vectors`,
//! both bit for bit.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use exactscore_server::quant::{ActivationQdq, ActivationQuantMode};
use serde_json::Value;
use sha2::{Digest, Sha256};

#[test]
fn dequantized_weights_equal_dequant_check_sha256() {
    for variant in VARIANTS.iter().filter(|v| **v != "llama-dense-bf16") {
        let text =
            std::fs::read_to_string(fixtures().join(variant).join("dequant_check.json")).unwrap();
        let checks: Value = serde_json::from_str(&text).unwrap();
        let model = load(variant, ActivationQuantMode::Emulate);
        let mut checked = 0;
        for (name, linear) in model.linears() {
            let Some(check) = checks.get(&name) else {
                continue;
            };
            let w = linear.weight().dequantize_f32().unwrap();
            let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            let sha = format!("{:x}", Sha256::digest(&bytes));
            let sum: f64 = w.iter().map(|&v| v as f64).sum();
            assert_eq!(
                sha,
                check["sha256_f32_le"].as_str().unwrap(),
                "{variant} {name}: sum {sum} vs {}",
                check["sum_f64"]
            );
            checked += 1;
        }
        assert_eq!(checked, 14, "{variant}: every quantized Linear checked");
    }
}

fn qdq_vectors(variant: &str) -> std::collections::HashMap<String, Tensor> {
    let path = fixtures().join(variant).join("act_qdq_vectors.safetensors");
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

#[test]
fn fp8_per_token_qdq_is_bit_exact() {
    let v = qdq_vectors("llama-fp8-dynamic");
    for prefix in [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
        "synthetic",
    ] {
        let input = &v[&format!("{prefix}.input")];
        assert_eq!(input.dtype(), DType::F32);
        assert_bit_exact(
            &ActivationQdq::Fp8PerToken,
            input,
            &v[&format!("{prefix}.input_qdq")],
            prefix,
        );
    }
}

#[test]
fn nvfp4_qdq_is_bit_exact() {
    let v = qdq_vectors("llama-nvfp4");
    for prefix in [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
        "synthetic",
    ] {
        let global_scale = v[&format!("{prefix}.input_global_scale")]
            .to_vec1::<f32>()
            .unwrap()[0];
        let qdq = ActivationQdq::Nvfp4 { global_scale };
        assert_bit_exact(
            &qdq,
            &v[&format!("{prefix}.input")],
            &v[&format!("{prefix}.input_qdq")],
            prefix,
        );
    }
}

#[test]
fn loaded_nvfp4_layers_carry_the_checkpoint_input_global_scale() {
    let v = qdq_vectors("llama-nvfp4");
    let stored = v["model.layers.0.self_attn.q_proj.input_global_scale"]
        .to_vec1::<f32>()
        .unwrap()[0];
    let model = load("llama-nvfp4", ActivationQuantMode::Emulate);
    let (_, q_proj) = &model.linears()[0];
    assert_eq!(
        q_proj.activation(),
        Some(&ActivationQdq::Nvfp4 {
            global_scale: stored
        })
    );
    let off = load("llama-nvfp4", ActivationQuantMode::Off);
    assert!(off.linears()[0].1.activation().is_none());
}

/// vLLM's `dynamic_scaled_int8_quant` then `q · scale`, bit for bit against the fixture
/// script's torch transcription: rows of several magnitudes, an all-zero row (zeros, not NaN),
/// ties (nearest even), and rows where a division by the scale would round differently from
/// vLLM's product by the reciprocal.
#[test]
fn int8_per_token_qdq_is_bit_exact() {
    let v = qdq_vectors("llama-w8a8-int8");
    let input = &v["synthetic.input"];
    let expected = &v["synthetic.input_qdq"];
    assert_bit_exact(&ActivationQdq::Int8PerToken, input, expected, "synthetic");
    let rows = expected.to_vec2::<f32>().unwrap();
    assert!(rows[5].iter().all(|&x| x == 0.0), "the all-zero row");
    // The ties row: absmax 127, so x itself is rounded: 0.5 → 0, 1.5 → 2, -0.5 → -0.
    let ties = &rows[6];
    assert_eq!((ties[64], ties[65], ties[63]), (0.0, 2.0, -0.0));
    assert_eq!(ties[63].to_bits(), (-0.0f32).to_bits());
}

#[test]
fn loaded_w8a8_layers_quantize_activations_per_token_unless_off() {
    let model = load("llama-w8a8-int8", ActivationQuantMode::Emulate);
    for (name, linear) in model.linears().into_iter().filter(|(n, _)| n != "lm_head") {
        assert_eq!(
            linear.activation(),
            Some(&ActivationQdq::Int8PerToken),
            "{name}"
        );
    }
    let off = load("llama-w8a8-int8", ActivationQuantMode::Off);
    assert!(off.linears()[0].1.activation().is_none());
}
