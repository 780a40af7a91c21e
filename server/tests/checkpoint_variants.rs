//! Checkpoint shapes and architectures without their own Python reference, checked against the
//! Llama fixture they must reduce to: a sharded copy, Qwen2 with zero q/k/v biases, Mistral with
//! a sliding window longer than the text, and the window actually applied when shorter (Qwen2's
//! only in its window layers). Qwen3 must find its q/k norms, and `attention_bias` is read only
//! where the architecture reads it.

mod common;

use candle_core::DType;
use common::*;
use exactscore_server::model::{Model, SequenceScores};
use exactscore_server::quant::ActivationQuantMode;
use safetensors::Dtype;

const BASE: &str = "llama-w4a16-g128";

fn score(dir: &std::path::Path, seqs: &[Vec<u32>]) -> Vec<SequenceScores> {
    let model = Model::load(dir, &options(DType::F32, ActivationQuantMode::Emulate))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    score_all(&model, seqs, 2)
}

fn base_scores() -> (Vec<Vec<u32>>, Vec<SequenceScores>) {
    let seqs = sequences(&reference(BASE));
    let scores = score(&fixtures().join(BASE), &seqs);
    (seqs, scores)
}

fn architecture(name: &'static str) -> impl FnOnce(&mut serde_json::Value) {
    move |c| c["architectures"] = serde_json::json!([name])
}

#[test]
fn sharded_checkpoint_scores_identically() {
    let (seqs, want) = base_scores();
    let dir = edited_copy(BASE, 3, |_| {}, |_| {});
    assert!(dir.path().join("model.safetensors.index.json").exists());
    assert!(!dir.path().join("model.safetensors").exists());
    assert_eq!(score(dir.path(), &seqs), want);
}

/// Adds zero f32 biases of the attention projections `projs` to every layer of the BASE
/// fixture's tensors.
fn zero_attention_biases(projs: &'static [&'static str]) -> impl FnOnce(&mut Tensors) {
    let config = load_config(BASE);
    move |t| {
        for layer in 0..config.num_layers {
            for &proj in projs {
                let out = match proj {
                    "q_proj" => config.num_heads * config.head_dim,
                    "k_proj" | "v_proj" => config.num_kv_heads * config.head_dim,
                    _ => config.hidden_size,
                };
                let name = format!("model.layers.{layer}.self_attn.{proj}.bias");
                t.insert(name, (Dtype::F32, vec![out], vec![0u8; out * 4]));
            }
        }
    }
}

#[test]
fn qwen2_with_zero_biases_scores_like_llama() {
    let (seqs, want) = base_scores();
    let dir = edited_copy(
        BASE,
        1,
        zero_attention_biases(&["q_proj", "k_proj", "v_proj"]),
        architecture("Qwen2ForCausalLM"),
    );
    assert_eq!(score(dir.path(), &seqs), want);
    // And the biases are really read: without them the load names the first one.
    let missing = edited_copy(BASE, 1, |_| {}, architecture("Qwen2ForCausalLM"));
    let err = Model::load(missing.path(), &options(DType::F32, Default::default()))
        .err()
        .expect("Qwen2 without q/k/v biases loaded");
    assert!(err.to_string().contains("self_attn.q_proj.bias"), "{err}");
}

/// `attention_bias` means what each architecture's transformers class makes of it: Llama reads
/// q/k/v and o biases, Mistral has none whatever the config says.
#[test]
fn attention_bias_is_read_where_the_architecture_reads_it() {
    let (seqs, want) = base_scores();
    let with_bias = |c: &mut serde_json::Value| c["attention_bias"] = serde_json::json!(true);
    let all = zero_attention_biases(&["q_proj", "k_proj", "v_proj", "o_proj"]);
    let llama = edited_copy(BASE, 1, all, with_bias);
    assert_eq!(score(llama.path(), &seqs), want);
    let no_o = edited_copy(
        BASE,
        1,
        zero_attention_biases(&["q_proj", "k_proj", "v_proj"]),
        with_bias,
    );
    let err = Model::load(no_o.path(), &options(DType::F32, Default::default()))
        .err()
        .expect("Llama with attention_bias but no o_proj bias loaded");
    assert!(err.to_string().contains("self_attn.o_proj.bias"), "{err}");
    let mistral = edited_copy(
        BASE,
        1,
        |_| {},
        |c| {
            with_bias(c);
            architecture("MistralForCausalLM")(c);
            c["sliding_window"] = serde_json::Value::Null;
        },
    );
    assert_eq!(score(mistral.path(), &seqs), want);
}

#[test]
fn mistral_sliding_window_longer_than_text_changes_nothing_shorter_one_does() {
    let (seqs, want) = base_scores();
    let longest = seqs.iter().map(Vec::len).max().unwrap();
    let wide = edited_copy(
        BASE,
        1,
        |_| {},
        |c| {
            architecture("MistralForCausalLM")(c);
            c["sliding_window"] = serde_json::json!(longest);
        },
    );
    assert_eq!(score(wide.path(), &seqs), want);

    let window = 8;
    let narrow = edited_copy(
        BASE,
        1,
        |_| {},
        |c| {
            architecture("MistralForCausalLM")(c);
            c["sliding_window"] = serde_json::json!(window);
        },
    );
    let got = score(narrow.path(), &seqs);
    for (g, w) in got.iter().zip(&want) {
        // Positions that see at most `window` tokens are unchanged; later ones are not.
        assert_eq!(g.rows[..window], w.rows[..window]);
        if w.rows.len() > window + 1 {
            assert_ne!(g.rows[window..], w.rows[window..]);
        }
    }
}

/// Qwen2/Qwen3's `use_sliding_window` slides only the layers `layer_types` names (else those
/// from `max_window_layers` on), as transformers 5.17 does: a window of 8 on no layer scores
/// like Llama; on the last layer only, positions past the window change.
#[test]
fn qwen2_sliding_window_only_in_the_window_layers() {
    let (seqs, want) = base_scores();
    let qwen2_window = |max_window_layers: usize, layer_types: Option<[&'static str; 2]>| {
        move |c: &mut serde_json::Value| {
            architecture("Qwen2ForCausalLM")(c);
            c["use_sliding_window"] = serde_json::json!(true);
            c["sliding_window"] = serde_json::json!(8);
            c["max_window_layers"] = serde_json::json!(max_window_layers);
            if let Some(types) = layer_types {
                c["layer_types"] = serde_json::json!(types);
            }
        }
    };
    let biases = || zero_attention_biases(&["q_proj", "k_proj", "v_proj"]);
    for no_sliding_layer in [
        qwen2_window(2, None),
        qwen2_window(0, Some(["full_attention", "full_attention"])),
    ] {
        let dir = edited_copy(BASE, 1, biases(), no_sliding_layer);
        assert_eq!(score(dir.path(), &seqs), want);
    }
    let last_slides = edited_copy(BASE, 1, biases(), qwen2_window(1, None));
    let got = score(last_slides.path(), &seqs);
    let longest = want.iter().map(|w| w.rows.len()).max().unwrap();
    assert!(longest > 9, "a sequence longer than the window");
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.rows[..8], w.rows[..8]);
        if w.rows.len() > 9 {
            assert_ne!(g.rows[8..], w.rows[8..]);
        }
    }
}

#[test]
fn qwen3_reads_per_head_q_and_k_norms() {
    let dir = edited_copy(BASE, 1, |_| {}, architecture("Qwen3ForCausalLM"));
    let err = Model::load(dir.path(), &options(DType::F32, Default::default()))
        .err()
        .expect("Qwen3 without q_norm/k_norm loaded");
    assert!(err.to_string().contains("self_attn.q_norm.weight"), "{err}");
}
