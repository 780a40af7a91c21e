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
