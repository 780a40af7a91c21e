//! Qwen3-MoE, Mixtral, Gemma 3, Gemma 2, Gemma 4, Mistral 3, Qwen3.5, Qwen3.5-MoE, Qwen3-Next,
//! DeepSeek-V3, DeepSeek-V2, Mistral 4, GLM-4.5, GLM-4.7-Flash and gpt-oss fixtures
//! scored in f32 on the CPU against the references of scripts/make_arch_fixtures.py,
//! scripts/make_gpt_oss_fixtures.py
//! (transformers, float32, per-expert Linears) and scripts/make_mistral3_fixture.py.

mod common;

use common::*;
use exactscore_server::model::{Model, SequenceScores};
use exactscore_server::quant::ActivationQuantMode::{self, Emulate, Off};
use serde_json::Value;

fn mean_nll(scores: &[SequenceScores]) -> f64 {
    let n: usize = scores.iter().map(|s| s.num_scored()).sum();
    scores.iter().map(|s| s.sum_nll()).sum::<f64>() / n as f64
}

fn block<'a>(reference: &'a Value, name: &str) -> &'a Value {
    match name {
        "sequences" => reference,
        other => &reference[other],
    }
}

/// For MoE fixtures: positions (per sparse layer) where our experts differ from the reference's
/// as a set, with the reference router's margin there (a near-tie flips under any rounding).
fn routing_report(variant: &str, model: &Model, seqs: &[Vec<u32>], reference: &Value) -> usize {
    let Some(reference_routes) = reference["routing"].as_array() else {
        return 0;
    };
    let mut differing = 0;
    let mut total = 0;
    for (s, seq) in seqs.iter().enumerate() {
        let ours = model.expert_routes(&[seq]).unwrap();
        assert!(
            !ours.is_empty(),
            "{variant}: a MoE model reported no sparse layer"
        );
        for (layer, routes) in ours {
            // a vision-language reference names the text model's layers under its prefix
            let r = match &reference_routes[s][format!("model.layers.{layer}")] {
                Value::Null => &reference_routes[s][format!("model.language_model.layers.{layer}")],
                r => r,
            };
            let experts = r["experts"].as_array().unwrap();
            assert_eq!(experts.len(), routes.len());
            for (t, (ours, theirs)) in routes.iter().zip(experts).enumerate() {
                let mut a: Vec<u64> = ours.iter().map(|(e, _)| *e as u64).collect();
                let mut b: Vec<u64> = theirs
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap())
                    .collect();
                a.sort();
                b.sort();
                total += 1;
                if a != b {
                    differing += 1;
                    println!(
                        "{variant}: seq {s} token {t} layer {layer}: experts {a:?} vs reference \
                         {b:?} (reference margin {:.2e})",
                        r["margin"][t].as_f64().unwrap()
                    );
                }
            }
        }
    }
    println!("{variant}: {differing} of {total} routed positions chose other experts");
    differing
}

/// Max |Δ logprob| <= 1e-4 per token against `block` of the reference; returns the worst.
fn assert_exact(variant: &str, act: ActivationQuantMode, block_name: &str) -> f64 {
    let reference = reference(variant);
    let model = load(variant, act);
    let seqs = sequences(&reference);
    let ours = score_all(&model, &seqs, 1);
    let expected = &block(&reference, block_name)["sequences"];
    let d = deltas(&ours, &reference_logprobs(expected));
    let (worst, max) =
        d.iter()
            .copied()
            .enumerate()
            .fold((0, 0.0), |acc, (i, x)| if x > acc.1 { (i, x) } else { acc });
    println!(
        "{variant} ({block_name}): {} tokens, max |Δ| {max:.2e} at token {worst}, mean {:.2e}",
        d.len(),
        d.iter().sum::<f64>() / d.len() as f64
    );
    routing_report(variant, &model, &seqs, block(&reference, block_name));
    assert_eq!(d.len(), 551);
    assert!(max <= 1e-4, "{variant}: max |Δlogprob| {max:e} > 1e-4");
    max
}

#[test]
fn qwen3moe_w4a16_matches_reference_per_token() {
    assert_exact("qwen3moe-w4a16-g32", Emulate, "sequences");
}

#[test]
fn qwen3moe_fp8_weights_only_matches_reference_per_token() {
    assert_exact("qwen3moe-fp8-dynamic", Off, "weights_only");
}

#[test]
fn qwen3moe_nvfp4_weights_only_matches_reference_per_token() {
    assert_exact("qwen3moe-nvfp4", Off, "weights_only");
}

#[test]
fn mixtral_w4a16_matches_reference_per_token() {
    assert_exact("mixtral-w4a16-g32", Emulate, "sequences");
}

#[test]
fn gemma3_dense_matches_reference_per_token() {
    assert_exact("gemma3-dense-bf16", Emulate, "sequences");
}

#[test]
fn gemma3_w4a16_matches_reference_per_token() {
    assert_exact("gemma3-w4a16-g32", Emulate, "sequences");
}

#[test]
fn gemma3_nvfp4a16_matches_reference_per_token() {
    assert_exact("gemma3-nvfp4a16", Emulate, "sequences");
}

#[test]
fn gemma2_dense_matches_reference_per_token() {
    assert_exact("gemma2-dense-bf16", Emulate, "sequences");
}

#[test]
fn gemma2_w4a16_matches_reference_per_token() {
    assert_exact("gemma2-w4a16-g32", Emulate, "sequences");
}

#[test]
fn gemma4_w4a16_matches_reference_per_token() {
    assert_exact("gemma4-w4a16-g32", Emulate, "sequences");
}

#[test]
fn gemma4_nvfp4a16_matches_reference_per_token() {
    assert_exact("gemma4-nvfp4a16", Emulate, "sequences");
}

#[test]
fn gemma4_moe_w4a16_matches_reference_per_token() {
    assert_exact("gemma4_moe-w4a16-g32", Emulate, "sequences");
}

#[test]
fn qwen3_5_w4a16_matches_reference_per_token() {
    assert_exact("qwen3_5-w4a16-g32", Emulate, "sequences");
}

#[test]
fn qwen3_5_w4a16_linear_attention_quantized_matches_reference_per_token() {
    assert_exact("qwen3_5-w4a16-g32-linattn", Emulate, "sequences");
}

#[test]
fn qwen3_5_nvfp4_weights_only_matches_reference_per_token() {
    assert_exact("qwen3_5-nvfp4", Off, "weights_only");
}

#[test]
fn qwen3_5_moe_w4a16_matches_reference_per_token() {
    assert_exact("qwen3_5_moe-w4a16-g32", Emulate, "sequences");
}

#[test]
fn qwen3_5_moe_fp8_weights_only_matches_reference_per_token() {
    assert_exact("qwen3_5_moe-fp8-dynamic", Off, "weights_only");
}

#[test]
fn qwen3_next_w4a16_matches_reference_per_token() {
    assert_exact("qwen3_next-w4a16-g32", Emulate, "sequences");
}

#[test]
fn qwen3_next_fp8_weights_only_matches_reference_per_token() {
    assert_exact("qwen3_next-fp8-dynamic", Off, "weights_only");
}

#[test]
fn deepseek_v3_w4a16_matches_reference_per_token() {
    assert_exact("deepseek_v3-w4a16-g32", Emulate, "sequences");
}

#[test]
fn deepseek_v2_w4a16_matches_reference_per_token() {
    assert_exact("deepseek_v2-w4a16-g32", Emulate, "sequences");
}

#[test]
fn deepseek_v2_fp8_weights_only_matches_reference_per_token() {
    assert_exact("deepseek_v2-fp8-dynamic", Off, "weights_only");
}

#[test]
fn mistral4_w4a16_matches_reference_per_token() {
    assert_exact("mistral4-w4a16-g32", Emulate, "sequences");
}

#[test]
fn glm4_moe_lite_w4a16_matches_reference_per_token() {
    assert_exact("glm4_moe_lite-w4a16-g32", Emulate, "sequences");
}

#[test]
fn glm4_moe_w4a16_matches_reference_per_token() {
    assert_exact("glm4_moe-w4a16-g32", Emulate, "sequences");
}

#[test]
fn deepseek_v3_fp8_weights_only_matches_reference_per_token() {
    assert_exact("deepseek_v3-fp8-dynamic", Off, "weights_only");
}

/// With activation quantization the reference is discontinuous (a rounding flip anywhere moves
/// a token a lot); its mean NLL is stable: within 1e-3 relative.
fn assert_mean_nll(variant: &str) {
    let reference = reference(variant);
    let model = load(variant, Emulate);
    let seqs = sequences(&reference);
    let ours = score_all(&model, &seqs, 1);
    let d = deltas(&ours, &reference_logprobs(&reference["sequences"]));
    let ref_nll = reference["mean_nll"].as_f64().unwrap();
    let rel = (mean_nll(&ours) - ref_nll).abs() / ref_nll;
    let within = d.iter().filter(|&&x| x <= 1e-4).count() as f64 / d.len() as f64;
    println!(
        "{variant} with activation QDQ: mean NLL rel err {rel:.2e}, {:.1}% of tokens within \
         1e-4, max |Δ| {:.3}",
        within * 100.0,
        d.iter().copied().fold(0.0, f64::max)
    );
    routing_report(variant, &model, &seqs, &reference);
    assert!(rel <= 1e-3, "{variant}: mean NLL off by {rel:e} (relative)");
}

#[test]
fn qwen3moe_nvfp4_w4a4_mean_nll_matches_reference() {
    assert_mean_nll("qwen3moe-nvfp4");
}

#[test]
fn qwen3moe_fp8_dynamic_per_token_mean_nll_matches_reference() {
    assert_mean_nll("qwen3moe-fp8-dynamic");
}

#[test]
fn deepseek_v3_fp8_dynamic_per_token_mean_nll_matches_reference() {
    assert_mean_nll("deepseek_v3-fp8-dynamic");
}

#[test]
fn deepseek_v2_fp8_dynamic_per_token_mean_nll_matches_reference() {
    assert_mean_nll("deepseek_v2-fp8-dynamic");
}

/// The tensors of `file` as a vision-language checkpoint holds its text model: `model.*` under
/// `base.*`, the lm_head as `head`.
fn text_model_under(
    file: &str,
    base: &str,
    head: &str,
) -> std::collections::HashMap<String, exactscore_server::checkpoint::HostTensor> {
    tensors_of(file, |name| match name {
        "lm_head.weight" => format!("{head}.weight"),
        _ => format!("{base}.{}", name.strip_prefix("model.").unwrap()),
    })
}

fn tensors_of(
    file: &str,
    rename: impl Fn(&str) -> String,
) -> std::collections::HashMap<String, exactscore_server::checkpoint::HostTensor> {
    let bytes = std::fs::read(fixtures().join(file)).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let t = exactscore_server::checkpoint::HostTensor {
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                data: view.data().to_vec(),
            };
            (rename(&name), t)
        })
        .collect()
}

/// transformers 5 (`model.language_model.`, `lm_head`) and 4.x (`language_model.model.`,
/// `language_model.lm_head`) layouts of a vision-language checkpoint's text model.
const TEXT_LAYOUTS: [(&str, &str); 2] = [
    ("model.language_model", "lm_head"),
    ("language_model.model", "language_model.lm_head"),
];

/// Max |Δ| of `tensors` loaded with `config` against the sequences of `reference`.
fn max_delta(
    config: &str,
    tensors: std::collections::HashMap<String, exactscore_server::checkpoint::HostTensor>,
    reference: &Value,
    act: ActivationQuantMode,
) -> f64 {
    use exactscore_server::checkpoint::Checkpoint;
    use exactscore_server::model::ModelConfig;
    let model = Model::from_checkpoint(
        ModelConfig::from_json(config).unwrap(),
        &Checkpoint::from_memory(tensors),
        &options(candle_core::DType::F32, act),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let d = deltas(
        &score_all(&model, &sequences(reference), 1),
        &reference_logprobs(&reference["sequences"]),
    );
    d.iter().copied().fold(0.0, f64::max)
}

/// A Gemma 3 vision-language checkpoint's text model: the gemma3-w4a16-g32 tensors renamed to
/// the transformers 5 and 4.x layouts, its config nested as `text_config`, score exactly as
/// the text-only checkpoint's reference.
#[test]
fn gemma3_conditional_generation_text_weights_match_reference() {
    let dir = fixtures().join("gemma3-w4a16-g32");
    let mut text: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let quantization = text.as_object_mut().unwrap().remove("quantization_config");
    text.as_object_mut().unwrap().remove("architectures");
    let config = serde_json::json!({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text,
        "quantization_config": quantization,
    })
    .to_string();
    let reference = reference("gemma3-w4a16-g32");
    // Tied: the checkpoint has no lm_head under either name.
    for (base, head) in TEXT_LAYOUTS {
        let tensors = text_model_under("gemma3-w4a16-g32/model.safetensors", base, head);
        let max = max_delta(&config, tensors, &reference, Emulate);
        println!("Gemma3ForConditionalGeneration, {base}.*: max |Δ| {max:.2e}");
        assert!(max <= 1e-4, "{base}: max |Δlogprob| {max:e}");
    }
}

/// Mistral 3 (Mistral Small 3.x): tests/fixtures/mistral3 (scripts/make_mistral3_fixture.py)
/// holds the config transformers wrote, the vision tower and projector, and the reference of
/// the whole checkpoint; the text model is llama-dense-bf16's weights as a Mistral with a
/// 64-token sliding window. The top-level `tie_word_embeddings` is true, but the checkpoint has
/// its own lm_head, which transformers (and we) must use.
#[test]
fn mistral3_conditional_generation_text_weights_match_reference() {
    let config = std::fs::read_to_string(fixtures().join("mistral3/config.json")).unwrap();
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("mistral3/reference.json")).unwrap(),
    )
    .unwrap();
    for (base, head) in TEXT_LAYOUTS {
        let mut tensors = text_model_under("llama-dense-bf16/model.safetensors", base, head);
        let vision = tensors_of("mistral3/vision.safetensors", |name| match base {
            "model.language_model" => format!("model.{name}"),
            _ => name.to_string(),
        });
        assert!(vision.len() >= 10);
        tensors.extend(vision);
        let max = max_delta(&config, tensors, &reference, Off);
        println!("Mistral3ForConditionalGeneration, {base}.*: max |Δ| {max:.2e}");
        assert!(max <= 1e-4, "{base}: max |Δlogprob| {max:e}");
    }
}

/// Mistral 3's wrapper of a Mistral 4 or DeepSeek-V3 text model (transformers' `Mistral3Config`
/// builds any `text_config.model_type` through `AutoConfig`, and `Mistral3Model` its text model
/// through `AutoModel`): the mistral4-w4a16-g32 and deepseek_v3-w4a16-g32 tensors in
/// transformers 5's layout (both newer than the 4.x one; the quantization's ignore list names
/// `lm_head` as 5 writes it), the config nested as `text_config`, score exactly as the
/// text-only checkpoint's reference.
#[test]
fn mistral3_wrapper_of_latent_attention_text_weights_match_reference() {
    for variant in ["mistral4-w4a16-g32", "deepseek_v3-w4a16-g32"] {
        let mut text = config_of(variant);
        let quantization = text.as_object_mut().unwrap().remove("quantization_config");
        text.as_object_mut().unwrap().remove("architectures");
        let config = serde_json::json!({
            "architectures": ["Mistral3ForConditionalGeneration"],
            "text_config": text,
            "quantization_config": quantization,
            "tie_word_embeddings": false,
        });
        let parsed = exactscore_server::model::ModelConfig::from_json(&config.to_string()).unwrap();
        assert_eq!(
            parsed.architecture.hf_name(),
            "Mistral3ForConditionalGeneration"
        );
        assert!(parsed.mla.is_some() && parsed.architecture.is_vision_language());
        let reference = reference(variant);
        let (base, head) = TEXT_LAYOUTS[0];
        let tensors = text_model_under(&format!("{variant}/model.safetensors"), base, head);
        let max = max_delta(&config.to_string(), tensors, &reference, Emulate);
        println!("Mistral3ForConditionalGeneration ({variant}), {base}.*: max |Δ| {max:.2e}");
        assert!(max <= 1e-4, "{variant} {base}: max |Δlogprob| {max:e}");
    }
}

/// DeepSeek-V2's `mlp_bias` (tests/fixtures/deepseek_v2-mlp-bias, a float32 checkpoint written
/// by scripts/audit_config_variants_mla.py --fixture): biases on the dense MLP and on the shared
/// experts (both `DeepseekV2MLP`), none on the routed experts. Zeroing the shared experts'
/// biases must move the scores, so that they are shown to be read.
#[test]
fn deepseek_v2_mlp_bias_matches_reference() {
    let variant = "deepseek_v2-mlp-bias";
    let config = config_of(variant).to_string();
    let reference = reference(variant);
    let max = max_delta(&config, weights(variant), &reference, Off);
    println!("{variant}: max |Δ| {max:.2e}");
    assert!(max <= 1e-4, "max |Δlogprob| {max:e}");
    let mut unbiased = weights(variant);
    for (name, t) in unbiased.iter_mut() {
        if name.contains("shared_experts.") && name.ends_with(".bias") {
            t.data.fill(0);
        }
    }
    let moved = max_delta(&config, unbiased, &reference, Off);
    println!("{variant}, shared experts' biases zeroed: max |Δ| {moved:.2e}");
    assert!(
        moved > 1e-2,
        "the shared experts' biases barely matter: {moved:e}"
    );
}

/// `variant`'s weights-only f32 scores with `config` and `tensors` in place of its own, against
/// the weights-only reference: (mean, max) |Δ logprob|.
fn mutated_deltas(
    variant: &str,
    config: &Value,
    tensors: std::collections::HashMap<String, exactscore_server::checkpoint::HostTensor>,
) -> (f64, f64) {
    use exactscore_server::checkpoint::Checkpoint;
    use exactscore_server::model::ModelConfig;
    let reference = reference(variant);
    let model = Model::from_checkpoint(
        ModelConfig::from_json(&config.to_string()).unwrap(),
        &Checkpoint::from_memory(tensors),
        &options(candle_core::DType::F32, Off),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let d = deltas(
        &score_all(&model, &sequences(&reference), 1),
        &reference_logprobs(&reference["sequences"]),
    );
    let mean = d.iter().sum::<f64>() / d.len() as f64;
    (mean, d.iter().copied().fold(0.0, f64::max))
}

fn config_of(variant: &str) -> Value {
    let text = std::fs::read_to_string(fixtures().join(variant).join("config.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn weights(
    variant: &str,
) -> std::collections::HashMap<String, exactscore_server::checkpoint::HostTensor> {
    tensors_of(&format!("{variant}/model.safetensors"), str::to_string)
}

/// Our (mean, max) |Δ| of a mutation against the shift transformers recorded for it.
fn assert_mutation(variant: &str, mutation: &str, got: (f64, f64)) {
    let want = &reference(variant)["mutations"][mutation];
    let (mean, max) = (
        want["mean"].as_f64().unwrap(),
        want["max"].as_f64().unwrap(),
    );
    println!(
        "{variant} {mutation}: mean |Δ| {:.4e} (transformers {mean:.4e}), max {:.4e} ({max:.4e})",
        got.0, got.1
    );
    assert!(
        mean > 1e-3,
        "{variant} {mutation}: the mutation is not far away"
    );
    assert!(
        (got.0 - mean).abs() <= 1e-4 && (got.1 - max).abs() <= 1e-3,
        "{variant} {mutation}: ours {got:?}, transformers' ({mean}, {max})"
    );
}

/// Mechanisms broken on purpose, as scripts/make_arch_fixtures.py broke them in transformers,
/// land where its `mutations` say (mean and max |Δ| over the 551 tokens): our reading of each
/// mechanism is transformers', not merely close to the unbroken reference. The cheap ones: two
/// config keys, and the f32-stored A_log / gated-norm weights rounded to bf16.
#[test]
fn qwen3_next_family_mutations_land_where_transformers_put_them() {
    let check = assert_mutation;
    // norm_topk_prob read the other way (Qwen3-Next)
    let variant = "qwen3_next-w4a16-g32";
    let mut config = config_of(variant);
    config["norm_topk_prob"] = Value::Bool(true);
    check(
        variant,
        "norm_topk_prob_flipped",
        mutated_deltas(variant, &config, weights(variant)),
    );
    // every dimension of each head rotated
    for variant in ["qwen3_next-w4a16-g32", "qwen3_5-w4a16-g32"] {
        let mut config = config_of(variant);
        config["partial_rotary_factor"] = 1.0.into();
        config["rope_parameters"]["partial_rotary_factor"] = 1.0.into();
        check(
            variant,
            "full_instead_of_partial_rotary",
            mutated_deltas(variant, &config, weights(variant)),
        );
    }
    // A_log and the gated norm's weight, stored in f32, rounded to bf16
    let variant = "qwen3_5-w4a16-g32";
    let mut tensors = weights(variant);
    let mut rounded = 0;
    for (name, t) in tensors.iter_mut() {
        if name.ends_with("linear_attn.A_log") || name.ends_with("linear_attn.norm.weight") {
            assert_eq!(t.dtype, safetensors::Dtype::F32, "{name}");
            t.data = t
                .data
                .chunks_exact(4)
                .flat_map(|b| {
                    let x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    half::bf16::from_f32(x).to_le_bytes()
                })
                .collect();
            t.dtype = safetensors::Dtype::BF16;
            rounded += 1;
        }
    }
    assert_eq!(rounded, 4);
    check(
        variant,
        "f32_params_rounded_to_bf16",
        mutated_deltas(variant, &config_of(variant), tensors),
    );
}

/// `f` applied to every bf16 value of the tensors whose names `pick` chooses, stored as f32;
/// returns how many tensors it changed.
fn edit_bf16(
    tensors: &mut std::collections::HashMap<String, exactscore_server::checkpoint::HostTensor>,
    pick: impl Fn(&str) -> bool,
    f: impl Fn(f32) -> f32,
) -> usize {
    let mut edited = 0;
    for (name, t) in tensors.iter_mut().filter(|(n, _)| pick(n)) {
        assert_eq!(t.dtype, safetensors::Dtype::BF16, "{name}");
        t.data = t
            .data
            .chunks_exact(2)
            .flat_map(|b| f(half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).to_le_bytes())
            .collect();
        t.dtype = safetensors::Dtype::F32;
        edited += 1;
    }
    edited
}

/// Gemma 4's mechanisms broken on purpose, as scripts/make_arch_fixtures.py broke them in
/// transformers (config keys and tensors): ours land where its `mutations` say.
#[test]
fn gemma4_mutations_land_where_transformers_put_them() {
    let dense = "gemma4-w4a16-g32";
    let moe = "gemma4_moe-w4a16-g32";
    let with_config = |variant: &str, mutation: &str, edit: &dyn Fn(&mut Value)| {
        let mut config = config_of(variant);
        edit(&mut config);
        assert_mutation(
            variant,
            mutation,
            mutated_deltas(variant, &config, weights(variant)),
        );
    };
    let with_tensors = |variant: &str, mutation: &str, pick: &dyn Fn(&str) -> bool, value: f32| {
        let mut tensors = weights(variant);
        let layers = config_of(variant)["num_hidden_layers"].as_u64().unwrap() as usize;
        assert_eq!(
            edit_bf16(&mut tensors, pick, |_| value),
            layers,
            "{mutation}"
        );
        let config = config_of(variant);
        assert_mutation(variant, mutation, mutated_deltas(variant, &config, tensors));
    };
    for variant in [dense, moe] {
        with_config(variant, "proportional_rope_as_default", &|c| {
            c["rope_parameters"]["full_attention"] =
                serde_json::json!({"rope_type": "default", "rope_theta": 1000000.0});
        });
        with_config(variant, "final_logit_softcapping_dropped", &|c| {
            c["final_logit_softcapping"] = Value::Null
        });
        with_tensors(
            variant,
            "layer_scalar_ignored",
            &|n| n.ends_with(".layer_scalar"),
            1.0,
        );
        // every weighted norm read as (1 + w)
        let mut tensors = weights(variant);
        let norm = |n: &str| {
            n.ends_with("norm.weight")
                || n.ends_with("norm_1.weight")
                || n.ends_with("norm_2.weight")
        };
        assert!(edit_bf16(&mut tensors, norm, |w| w + 1.0) > 10);
        let config = config_of(variant);
        assert_mutation(
            variant,
            "norms_read_as_1_plus_w",
            mutated_deltas(variant, &config, tensors),
        );
    }
    with_tensors(
        dense,
        "per_layer_inputs_dropped",
        &|n| n.ends_with(".per_layer_projection.weight"),
        0.0,
    );
    with_tensors(
        moe,
        "per_expert_scale_ignored",
        &|n| n.ends_with(".router.per_expert_scale"),
        1.0,
    );
    with_tensors(
        moe,
        "router_scale_ignored",
        &|n| n.ends_with(".router.scale"),
        1.0,
    );
}

/// `variant`'s config as a `Gemma4ForConditionalGeneration`'s: its text config under
/// `text_config`, then `edit(text, root)`.
fn gemma4_conditional_config(variant: &str, edit: impl FnOnce(&mut Value, &mut Value)) -> Value {
    let mut text = config_of(variant);
    let mut quantization = text.as_object_mut().unwrap().remove("quantization_config");
    text.as_object_mut().unwrap().remove("architectures");
    // llm-compressor lists the ignored modules by name: the text model's names move too
    if let Some(Value::Array(ignore)) = quantization.as_mut().map(|q| &mut q["ignore"]) {
        for name in ignore.iter_mut() {
            if let Some(rest) = name.as_str().and_then(|n| n.strip_prefix("model.")) {
                *name = format!("model.language_model.{rest}").into();
            }
        }
    }
    let mut root = serde_json::json!({
        "architectures": ["Gemma4ForConditionalGeneration"],
        "quantization_config": quantization,
        "vision_config": {"hidden_size": 8},
    });
    edit(&mut text, &mut root);
    root["text_config"] = text;
    root
}

/// A Gemma 4 vision-language checkpoint's text model: the gemma4-w4a16-g32 tensors under
/// `model.language_model.`, its config nested as `text_config`, score exactly as the
/// text-only checkpoint's reference; an unread tower's tensors are left alone by rule.
#[test]
fn gemma4_conditional_generation_text_weights_match_reference() {
    let variant = "gemma4-w4a16-g32";
    // transformers' text-only forward replaces placeholders by the pad token: it needs one
    let config = gemma4_conditional_config(variant, |text, _| text["pad_token_id"] = 0.into());
    let (base, head) = TEXT_LAYOUTS[0];
    let mut tensors = text_model_under(&format!("{variant}/model.safetensors"), base, head);
    let norm = &tensors["model.language_model.norm.weight"];
    let tower = || exactscore_server::checkpoint::HostTensor {
        dtype: norm.dtype,
        shape: norm.shape.clone(),
        data: norm.data.clone(),
    };
    let (vision, audio) = (tower(), tower());
    tensors.insert("model.vision_tower.encoder.norm.weight".into(), vision);
    tensors.insert(
        "model.embed_audio.embedding_projection.weight".into(),
        audio,
    );
    let max = max_delta(&config.to_string(), tensors, &reference(variant), Emulate);
    println!("Gemma4ForConditionalGeneration, {base}.*: max |Δ| {max:.2e}");
    assert!(max <= 1e-4, "{base}: max |Δlogprob| {max:e}");
}

/// A Gemma 4 vision-language model embeds its image, video and audio placeholders as the pad
/// token (text-only, transformers replaces them by `pad_token_id`): a sequence holding one
/// has the hidden states of the text-only model's with pad in its place, and not those of the
/// token itself.
#[test]
fn gemma4_conditional_generation_embeds_placeholders_as_padding() {
    use exactscore_server::checkpoint::Checkpoint;
    use exactscore_server::model::ModelConfig;
    let variant = "gemma4-w4a16-g32";
    let seq = sequences(&reference(variant))[0].clone();
    let (placeholder, pad) = (seq[3], 7);
    let config = gemma4_conditional_config(variant, |text, root| {
        text["pad_token_id"] = pad.into();
        root["audio_token_id"] = placeholder.into();
    });
    let (base, head) = TEXT_LAYOUTS[0];
    let composite = Model::from_checkpoint(
        ModelConfig::from_json(&config.to_string()).unwrap(),
        &Checkpoint::from_memory(text_model_under(
            &format!("{variant}/model.safetensors"),
            base,
            head,
        )),
        &options(candle_core::DType::F32, Emulate),
    )
    .unwrap();
    let text = load(variant, Emulate);
    let padded: Vec<u32> = seq
        .iter()
        .map(|&t| if t == placeholder { pad } else { t })
        .collect();
    let hidden = |m: &Model, s: &[u32]| {
        m.hidden_states(&[s])
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let ours = hidden(&composite, &seq);
    assert_eq!(ours, hidden(&text, &padded));
    assert_ne!(ours, hidden(&text, &seq));
}

/// Qwen3.5-MoE's experts stored fused, as its bf16 releases ship them and transformers keeps
/// them (`mlp.experts.gate_up_proj` `[E, 2·I, H]`, `mlp.experts.down_proj` `[E, H, I]`): the
/// qwen3_5_moe-w4a16-g32 experts dequantized to f32 and stored fused, or per expert, score to
/// the same bits, within 1e-4 of the transformers reference.
#[test]
fn qwen3_5_moe_fused_experts_score_as_per_expert_linears() {
    use exactscore_server::checkpoint::HostTensor;
    const VARIANT: &str = "qwen3_5_moe-w4a16-g32";
    let quantized = load(VARIANT, Emulate);
    let mut config: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(VARIANT).join("config.json")).unwrap(),
    )
    .unwrap();
    config["quantization_config"]["ignore"]
        .as_array_mut()
        .unwrap()
        .push(r"re:.*mlp\.experts\..*".into());
    let base: std::collections::HashMap<String, HostTensor> =
        tensors_of(&format!("{VARIANT}/model.safetensors"), str::to_string)
            .into_iter()
            .filter(|(name, _)| !name.contains(".mlp.experts."))
            .collect();
    let f32_tensor = |shape: Vec<usize>, values: &[f32]| HostTensor {
        dtype: safetensors::Dtype::F32,
        shape,
        data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    };
    let (experts, layers) = (8, 4);
    let copy = |t: &HostTensor| HostTensor {
        dtype: t.dtype,
        shape: t.shape.clone(),
        data: t.data.clone(),
    };
    let mut per_expert: std::collections::HashMap<String, HostTensor> =
        base.iter().map(|(n, t)| (n.clone(), copy(t))).collect();
    let mut fused = base;
    for i in 0..layers {
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for e in 0..experts {
            for proj in ["gate_proj", "up_proj", "down_proj"] {
                let w = quantized
                    .linear(&format!("model.layers.{i}.mlp.experts.{e}.{proj}"))
                    .unwrap()
                    .weight();
                let (out, inp) = w.shape();
                let values = w.dequantize_f32().unwrap();
                let name = format!("model.language_model.layers.{i}.mlp.experts.{e}.{proj}.weight");
                per_expert.insert(name, f32_tensor(vec![out, inp], &values));
                match proj {
                    "down_proj" => down.extend(values),
                    _ => gate_up.extend(values),
                }
            }
        }
        let at = |name: &str| format!("model.language_model.layers.{i}.mlp.experts.{name}");
        fused.insert(
            at("gate_up_proj"),
            f32_tensor(vec![experts, 64, 64], &gate_up),
        );
        fused.insert(at("down_proj"), f32_tensor(vec![experts, 64, 32], &down));
    }
    let reference = reference(VARIANT);
    let score = |tensors| {
        use exactscore_server::checkpoint::Checkpoint;
        use exactscore_server::model::ModelConfig;
        let model = Model::from_checkpoint(
            ModelConfig::from_json(&config.to_string()).unwrap(),
            &Checkpoint::from_memory(tensors),
            &options(candle_core::DType::F32, Off),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        score_all(&model, &sequences(&reference), 1)
    };
    let (a, b) = (score(per_expert), score(fused));
    assert_eq!(a, b, "fused experts differ from per-expert Linears");
    let d = deltas(&b, &reference_logprobs(&reference["sequences"]));
    let max = d.iter().copied().fold(0.0, f64::max);
    println!("{VARIANT} with fused f32 experts: max |Δ| {max:.2e}");
    assert!(max <= 1e-4, "max |Δlogprob| {max:e}");
}

/// `Qwen3_5MoeForCausalLM` reads a `ForConditionalGeneration` checkpoint (transformers strips
/// `language_model` from the names): the qwen3_5_moe-w4a16-g32 checkpoint (`model.language_model.*`,
/// `model.visual.*`, `mtp.*`) with its text config flattened to the text-only class's scores as
/// the reference.
#[test]
fn qwen3_5_moe_text_only_class_reads_the_conditional_checkpoint() {
    const VARIANT: &str = "qwen3_5_moe-w4a16-g32";
    let full: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(VARIANT).join("config.json")).unwrap(),
    )
    .unwrap();
    let mut config = full["text_config"].clone();
    config["architectures"] = serde_json::json!(["Qwen3_5MoeForCausalLM"]);
    config["quantization_config"] = full["quantization_config"].clone();
    let tensors = tensors_of(&format!("{VARIANT}/model.safetensors"), str::to_string);
    let max = max_delta(&config.to_string(), tensors, &reference(VARIANT), Emulate);
    println!("Qwen3_5MoeForCausalLM over model.language_model.*: max |Δ| {max:.2e}");
    assert!(max <= 1e-4, "max |Δlogprob| {max:e}");
}

/// `mtp.*` is left unread by rule (the fixture holds a whole MTP layer), anything else unread
/// still fails the load naming it: a vision tensor in a Qwen3-Next checkpoint (whose class
/// ignores only `^mtp.*`) and a stray tensor beside a Gated DeltaNet.
#[test]
fn qwen3_next_unread_tensors_other_than_mtp_fail_the_load() {
    use exactscore_server::checkpoint::{Checkpoint, HostTensor};
    use exactscore_server::model::ModelConfig;
    const VARIANT: &str = "qwen3_next-w4a16-g32";
    let config = std::fs::read_to_string(fixtures().join(VARIANT).join("config.json")).unwrap();
    for stray in [
        "model.visual.pos_embed.weight",
        "model.layers.0.linear_attn.conv1d.bias",
    ] {
        let mut tensors = tensors_of(&format!("{VARIANT}/model.safetensors"), str::to_string);
        assert!(tensors.keys().any(|n| n.starts_with("mtp.layers.0.")));
        let t = HostTensor {
            dtype: safetensors::Dtype::F32,
            shape: vec![2],
            data: vec![0; 8],
        };
        tensors.insert(stray.to_string(), t);
        let err = Model::from_checkpoint(
            ModelConfig::from_json(&config).unwrap(),
            &Checkpoint::from_memory(tensors),
            &options(candle_core::DType::F32, Off),
        )
        .err()
        .unwrap_or_else(|| panic!("{stray} was ignored"))
        .to_string();
        assert!(err.contains(stray), "{err}");
    }
}

/// DeepSeek's mechanisms broken on purpose (config keys, the correction-bias buffer), as
/// scripts/make_arch_fixtures.py broke them in transformers: ours land where its `mutations`
/// say.
#[test]
fn deepseek_family_mutations_land_where_transformers_put_them() {
    let mutated = |variant: &str, mutation: &str, edit: &dyn Fn(&mut Value)| {
        let mut config = config_of(variant);
        edit(&mut config);
        assert_mutation(
            variant,
            mutation,
            mutated_deltas(variant, &config, weights(variant)),
        );
    };
    let v3 = "deepseek_v3-w4a16-g32";
    mutated(v3, "no_group_limit", &|c| {
        c["n_group"] = 1.into();
        c["topk_group"] = 1.into();
    });
    mutated(v3, "routed_scaling_factor_dropped", &|c| {
        c["routed_scaling_factor"] = 1.0.into()
    });
    // the score scale without mscale², the cos/sin factor (1 here) kept
    mutated(v3, "mscale_ignored", &|c| {
        let rope = c["rope_parameters"].as_object_mut().unwrap();
        rope.remove("mscale_all_dim");
        rope.insert("attention_factor".into(), 1.0.into());
    });
    // DeepSeek-V2: the group limit, the scaling and the mscale, as for DeepSeek-V3
    let v2 = "deepseek_v2-w4a16-g32";
    mutated(v2, "no_group_limit", &|c| {
        c["topk_method"] = "greedy".into()
    });
    mutated(v2, "routed_scaling_factor_dropped", &|c| {
        c["routed_scaling_factor"] = 1.0.into()
    });
    mutated(v2, "mscale_ignored", &|c| {
        let rope = c["rope_parameters"].as_object_mut().unwrap();
        rope.remove("mscale_all_dim");
        rope.insert("attention_factor".into(), 1.0.into());
    });
    // Mistral 4: the group limit, the scaling, the renormalisation, the mscale and the llama-4
    // query scaling
    let m4 = "mistral4-w4a16-g32";
    mutated(m4, "no_group_limit", &|c| {
        c["n_group"] = 1.into();
        c["topk_group"] = 1.into();
    });
    mutated(m4, "routed_scaling_factor_dropped", &|c| {
        c["routed_scaling_factor"] = 1.0.into()
    });
    mutated(m4, "m4_norm_topk_prob_flipped", &|c| {
        c["norm_topk_prob"] = false.into()
    });
    mutated(m4, "llama_4_scaling_dropped", &|c| {
        c["rope_parameters"]["llama_4_scaling_beta"] = 0.0.into()
    });
    mutated(m4, "mscale_ignored", &|c| {
        let rope = c["rope_parameters"].as_object_mut().unwrap();
        rope.remove("mscale_all_dim");
        rope.insert("attention_factor".into(), 1.0.into());
    });
    for variant in [v3, "glm4_moe_lite-w4a16-g32", m4] {
        mutated(variant, "rope_interleave_flipped", &|c| {
            c["rope_interleave"] = (c["rope_interleave"] != true).into()
        });
    }
    let glm = "glm4_moe-w4a16-g32";
    mutated(glm, "full_instead_of_partial_rotary_glm", &|c| {
        c["partial_rotary_factor"] = 1.0.into();
        c["rope_parameters"]["partial_rotary_factor"] = 1.0.into();
    });
    // the correction bias zeroed
    for variant in [v3, glm] {
        let mut tensors = weights(variant);
        let mut zeroed = 0;
        for (name, t) in tensors.iter_mut() {
            if name.ends_with("mlp.gate.e_score_correction_bias") {
                t.data.iter_mut().for_each(|b| *b = 0);
                zeroed += 1;
            }
        }
        assert_eq!(zeroed, 2, "{variant}");
        assert_mutation(
            variant,
            "correction_bias_ignored",
            mutated_deltas(variant, &config_of(variant), tensors),
        );
    }
}

#[test]
fn gpt_oss_dense_bf16_matches_reference_per_token() {
    assert_exact("gpt_oss-dense-bf16", Off, "sequences");
}

/// The native MXFP4 experts (`*_blocks`, `*_scales`) decoded as transformers'
/// `convert_moe_packed_tensors` decodes them.
#[test]
fn gpt_oss_mxfp4_matches_reference_per_token() {
    assert_exact("gpt_oss-mxfp4", Off, "sequences");
}

/// Each row of the last axis (`2 * inter` bf16 values) rewritten so that reading it interleaved
/// (even gate, odd up) gives its halves: gate/up read as halves, as transformers' mutation.
fn interleave_halves(t: &mut exactscore_server::checkpoint::HostTensor) {
    let width = 2 * t.shape.last().unwrap();
    let rows: Vec<u8> = t
        .data
        .chunks_exact(width)
        .flat_map(|row| {
            let (gate, up) = row.split_at(width / 2);
            gate.chunks_exact(2)
                .zip(up.chunks_exact(2))
                .flat_map(|(g, u)| [g[0], g[1], u[0], u[1]])
                .collect::<Vec<u8>>()
        })
        .collect();
    t.data = rows;
}

/// gpt-oss's mechanisms broken on purpose, as scripts/make_gpt_oss_fixtures.py broke them in
/// transformers: those a tensor or config key expresses land where its `mutations` say; those
/// only code expresses (the clamp, the router's order) move transformers' own log-probs far, so
/// the per-token test above shows that ours has them.
#[test]
fn gpt_oss_mutations_land_where_transformers_put_them() {
    let variant = "gpt_oss-dense-bf16";
    let with_tensors = |mutation: &str, edit: &dyn Fn(&mut _) -> usize, edited: usize| {
        let mut tensors = weights(variant);
        assert_eq!(edit(&mut tensors), edited, "{mutation}");
        let got = mutated_deltas(variant, &config_of(variant), tensors);
        assert_mutation(variant, mutation, got);
    };
    with_tensors(
        "sinks_dropped",
        &|t| edit_bf16(t, |n| n.ends_with("self_attn.sinks"), |_| -1e30),
        4,
    );
    // q, k, v, o, the router's, gate_up's and down's: 7 a layer
    with_tensors(
        "biases_dropped",
        &|t| edit_bf16(t, |n| n.ends_with("bias"), |_| 0.0),
        28,
    );
    with_tensors(
        "gate_up_not_interleaved",
        &|t| {
            let picked = |n: &str| n.ends_with("gate_up_proj") || n.ends_with("gate_up_proj_bias");
            t.iter_mut()
                .filter(|(n, _)| picked(n))
                .map(|(_, t)| interleave_halves(t))
                .count()
        },
        8,
    );
    let with_config = |mutation: &str, edit: &dyn Fn(&mut Value)| {
        let mut config = config_of(variant);
        edit(&mut config);
        assert_mutation(
            variant,
            mutation,
            mutated_deltas(variant, &config, weights(variant)),
        );
    };
    with_config("sliding_window_ignored", &|c| {
        c["layer_types"] = serde_json::json!(vec!["full_attention"; 4]);
    });
    with_config("yarn_ignored", &|c| {
        c["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 10000.0});
    });
    for mutation in ["clamp_dropped", "router_softmax_before_topk"] {
        let mean = reference(variant)["mutations"][mutation]["mean"]
            .as_f64()
            .unwrap();
        println!("{variant} {mutation}: transformers' mean |Δ| {mean:.4e}");
        assert!(
            mean > 1e-2,
            "{variant} {mutation}: the fixture does not exercise it"
        );
    }
}

/// llm-compressor's per-expert layout of gpt-oss (`experts.E.{gate,up,down}_proj`, each with
/// its bias: `GptOssExpertMLP`), made in memory from the fused bf16 fixture (stored as f32,
/// the same values), scores as the fused layout does.
#[test]
fn gpt_oss_per_expert_layout_matches_reference() {
    use exactscore_server::checkpoint::HostTensor;
    let variant = "gpt_oss-dense-bf16";
    let mut tensors = weights(variant);
    let (experts, h, i) = (8, 64, 64);
    let mut take = |name: String| -> Vec<f32> {
        let t = tensors.remove(&name).unwrap();
        assert_eq!(t.dtype, safetensors::Dtype::BF16, "{name}");
        t.data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()
    };
    let mut split = Vec::new();
    for layer in 0..4 {
        let p = format!("model.layers.{layer}.mlp.experts");
        let gate_up = take(format!("{p}.gate_up_proj")); // [E, H, 2I]
        let gate_up_bias = take(format!("{p}.gate_up_proj_bias")); // [E, 2I]
        let down = take(format!("{p}.down_proj")); // [E, I, H]
        let down_bias = take(format!("{p}.down_proj_bias")); // [E, H]
        let (gate_up, down) = (&gate_up, &down);
        for e in 0..experts {
            for (name, part) in [("gate_proj", 0), ("up_proj", 1)] {
                let w = (0..i)
                    .flat_map(|r| (0..h).map(move |c| gate_up[(e * h + c) * 2 * i + 2 * r + part]))
                    .collect();
                let b = (0..i)
                    .map(|r| gate_up_bias[e * 2 * i + 2 * r + part])
                    .collect();
                split.push((format!("{p}.{e}.{name}.weight"), vec![i, h], w));
                split.push((format!("{p}.{e}.{name}.bias"), vec![i], b));
            }
            let w = (0..h)
                .flat_map(|r| (0..i).map(move |c| down[(e * i + c) * h + r]))
                .collect();
            let b = down_bias[e * h..(e + 1) * h].to_vec();
            split.push((format!("{p}.{e}.down_proj.weight"), vec![h, i], w));
            split.push((format!("{p}.{e}.down_proj.bias"), vec![h], b));
        }
    }
    for (name, shape, values) in split {
        let data = values.iter().flat_map(|v: &f32| v.to_le_bytes()).collect();
        let dtype = safetensors::Dtype::F32;
        tensors.insert(name, HostTensor { dtype, shape, data });
    }
    let (mean, max) = mutated_deltas(variant, &config_of(variant), tensors);
    println!("{variant} per expert: mean |Δ| {mean:.2e}, max {max:.2e}");
    assert!(max <= 1e-4, "{variant} per expert: max |Δlogprob| {max:e}");
}

/// bf16 compute on the CPU (the norms' weights in f32, as transformers keeps gpt-oss's): every
/// log-prob finite, and no farther from the f32 reference on average than transformers' own
/// bf16 run (`bf16_run`: routing flips under bf16 make both far from f32).
#[test]
fn gpt_oss_bf16_compute_is_as_close_to_f32_as_transformers_bf16() {
    for variant in ["gpt_oss-dense-bf16", "gpt_oss-mxfp4"] {
        let reference = reference(variant);
        let model = exactscore_server::model::Model::load(
            &fixtures().join(variant),
            &options(candle_core::DType::BF16, Off),
        )
        .unwrap();
        let d = deltas(
            &score_all(&model, &sequences(&reference), 1),
            &reference_logprobs(&reference["sequences"]),
        );
        let mean = d.iter().sum::<f64>() / d.len() as f64;
        let max = d.iter().copied().fold(0.0, f64::max);
        let theirs = &reference["bf16_run"]["diff_stats_vs_f32"];
        let their_mean = theirs["mean"].as_f64().unwrap();
        println!(
            "{variant} bf16 vs f32 reference: ours mean {mean:.3e} max {max:.3e}, transformers' \
             mean {their_mean:.3e} max {:.3e}",
            theirs["max"].as_f64().unwrap()
        );
        assert!(d.iter().all(|x| x.is_finite()), "{variant}: non-finite");
        assert!(
            mean <= 1.5 * their_mean,
            "{variant}: bf16 mean |Δ| {mean:e}"
        );
    }
}

/// Each MLA, GLM and Gemma 4 fixture is served as the class its config.json names: what
/// `/info`'s `architecture` reports (`Architecture::hf_name`).
#[test]
fn issue_fixtures_are_served_as_their_classes() {
    for variant in [
        "deepseek_v3-w4a16-g32",
        "deepseek_v3-fp8-dynamic",
        "deepseek_v2-w4a16-g32",
        "deepseek_v2-fp8-dynamic",
        "mistral4-w4a16-g32",
        "glm4_moe_lite-w4a16-g32",
        "glm4_moe-w4a16-g32",
        "gemma4-w4a16-g32",
        "gemma4-nvfp4a16",
        "gemma4_moe-w4a16-g32",
    ] {
        let text = std::fs::read_to_string(fixtures().join(variant).join("config.json")).unwrap();
        let named: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            load_config(variant).architecture.hf_name(),
            named["architectures"][0].as_str().unwrap(),
            "{variant}"
        );
    }
}
