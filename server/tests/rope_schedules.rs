//! RoPE schedules against transformers (tests/fixtures/rope, scripts/make_rope_fixtures.py):
//! `inv_freq` to the ulp, the attention factor bit for bit, the cos/sin tables, and a YaRN Llama
//! scored end to end in f32.

mod common;

use candle_core::{DType, Device, IndexOp};
use common::*;
use exactscore_server::model::rope::RopeTables;
use exactscore_server::model::{Model, ModelConfig, ModelOptions};
use exactscore_server::quant::ActivationQuantMode::Off;
use serde_json::Value;

fn rope_fixture(name: &str) -> Value {
    let path = fixtures().join("rope").join(name);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn every_schedule_matches_transformers() {
    let cases = rope_fixture("cases.json");
    let cases = cases["cases"].as_object().unwrap();
    assert!(cases.len() >= 12, "{} cases", cases.len());
    for (name, case) in cases {
        let config = ModelConfig::from_json(&case["config"].to_string())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let rope = &config.rope;
        let expected_freqs = f32s(&case["inv_freq"]);
        let ours = rope.inv_freq(config.head_dim);
        // torch raises the base with SLEEF's vectorised powf, which is an ulp off the correctly
        // rounded power (glibc's, ours) for a few exponents: 1 of 64 for Qwen3's 1e6 and 128.
        assert_eq!(ours.len(), expected_freqs.len(), "{name}: inv_freq length");
        let ulps: Vec<u32> = ours
            .iter()
            .zip(&expected_freqs)
            .map(|(a, b)| a.to_bits().abs_diff(b.to_bits()))
            .collect();
        let off = ulps.iter().filter(|&&u| u > 0).count();
        assert!(
            ulps.iter().all(|&u| u <= 1) && off <= 2,
            "{name}: inv_freq ulps {ulps:?}"
        );
        let scaling = case["attention_scaling"].as_f64().unwrap() as f32;
        assert_eq!(rope.attention_factor(), scaling, "{name}: attention factor");

        // cos/sin at a few positions: angles are one f32 product each, cos and sin are libm's
        // against torch's vectorised ones (a few ulp apart), plus what an ulp of frequency
        // turns into at that position.
        let positions: Vec<usize> = case["positions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_u64().unwrap() as usize)
            .collect();
        let len = positions.iter().max().unwrap() + 1;
        let tables = RopeTables::new(rope, config.head_dim, len, DType::F32, &Device::Cpu).unwrap();
        let (cos, sin) = tables.tables();
        let mut worst = 0f32;
        for (k, &pos) in positions.iter().enumerate() {
            for (table, key) in [(cos, "cos"), (sin, "sin")] {
                let row: Vec<f32> = table.i(pos).unwrap().to_vec1().unwrap();
                // transformers' tables repeat the half-dim frequencies over both halves.
                let expected = f32s(&case[key][k]);
                assert_eq!(expected.len(), 2 * row.len(), "{name}: {key} width");
                for (j, (a, b)) in row.iter().zip(&expected).enumerate() {
                    // Each side rounds its angle: one ulp of it apart once the products differ.
                    let angle = pos as f32 * ours[j];
                    let angle_error = pos as f32 * (ours[j] - expected_freqs[j]).abs()
                        + if ours[j] == expected_freqs[j] {
                            0.0
                        } else {
                            angle * f32::EPSILON
                        };
                    let bound = (4.0 * f32::EPSILON + 1.01 * angle_error) * scaling.max(1.0);
                    assert!(
                        (a - b).abs() <= bound,
                        "{name}: {key} at position {pos}, frequency {j}: {a} vs {b}"
                    );
                    worst = worst.max((a - b).abs());
                }
            }
        }
        println!(
            "{name}: inv_freq {off} of {} an ulp off, cos/sin max |Δ| {worst:.1e}",
            ours.len()
        );
    }
}

/// The dense Llama fixture's weights with its RoPE replaced as the reference file says.
fn with_rope(reference: &Value) -> tempfile::TempDir {
    edited_copy(
        reference["weights"].as_str().unwrap(),
        1,
        |_| {},
        |c| {
            c["rope_parameters"] = reference["rope_parameters"].clone();
            c["max_position_embeddings"] = reference["max_position_embeddings"].clone();
        },
    )
}

/// Every sequence's log-probs of its tokens after the first.
fn token_logprobs(model: &Model, seqs: &[Vec<u32>]) -> Vec<Vec<f32>> {
    score_all(model, seqs, 0)
        .iter()
        .map(|s| s.token_logprobs().collect())
        .collect()
}

#[test]
fn yarn_llama_matches_transformers_per_token() {
    let reference = rope_fixture("llama-yarn.json");
    let dir = with_rope(&reference);
    let model = Model::load(dir.path(), &options(DType::F32, Off)).unwrap();
    let ours = token_logprobs(&model, &sequences(&reference));
    let expected = reference_logprobs(&reference["sequences"]);
    let plain = reference_logprobs(&self::reference("llama-dense-bf16")["sequences"]);
    let (mut max, mut moved) = (0f64, 0f64);
    for ((s, e), p) in ours.iter().zip(&expected).zip(&plain) {
        assert_eq!(s.len(), e.len());
        for ((a, b), c) in s.iter().zip(e).zip(p) {
            max = max.max((*a as f64 - b).abs());
            moved = moved.max((b - c).abs());
        }
    }
    println!("yarn: max |Δ| {max:.2e} (YaRN moves the reference by up to {moved:.2e})");
    // The fixture must tell YaRN from the checkpoint's own llama3 schedule.
    assert!(moved > 1e-2, "YaRN barely changes the reference: {moved}");
    assert!(max <= 1e-4, "max |Δlogprob| {max:e}");
}

#[test]
fn dynamic_rope_is_refused_past_the_context_it_is_fixed_for() {
    let mut reference = rope_fixture("llama-yarn.json");
    reference["rope_parameters"] =
        serde_json::json!({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0});
    let dir = with_rope(&reference);
    let opts = |max_seq_len| ModelOptions {
        max_seq_len,
        ..options(DType::F32, Off)
    };
    let err = Model::load(dir.path(), &opts(257))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("rope_parameters.rope_type") && err.contains("256") && err.contains("257"),
        "{err}"
    );
    // Up to the context, the frequencies are the plain ones: the same scores as `default`.
    let dynamic = Model::load(dir.path(), &opts(256)).unwrap();
    reference["rope_parameters"] =
        serde_json::json!({"rope_type": "default", "rope_theta": 10000.0});
    let default = Model::load(with_rope(&reference).path(), &opts(256)).unwrap();
    let seqs = sequences(&rope_fixture("llama-yarn.json"));
    assert_eq!(
        token_logprobs(&dynamic, &seqs),
        token_logprobs(&default, &seqs)
    );
}
