//! `/diff`'s numbers on the fixtures, f32 on the CPU: the per-layer cosine error and SQNR
//! against an independent f64 computation from both models' hidden states, a model against
//! itself, `reference_until`, and module attribution against the test's own swap-and-score
//! (a reference checkpoint with one module's weights replaced, loaded and scored as a whole).

mod common;

use std::collections::HashMap;

use common::{fixtures, load, options, reference, sequences};
use exactscore_server::checkpoint::{Checkpoint, HostTensor};
use exactscore_server::model::diff::{attributable_modules, SQNR_CAP_DB};
use exactscore_server::model::{
    diff_batch, kld_batch, DiffOptions, Model, ModelConfig, SequenceDiff,
};
use exactscore_server::quant::ActivationQuantMode::Off;

const SERVED: &str = "llama-w4a16-g128";
const REFERENCE: &str = "llama-dense-bf16";

fn fixture_sequences() -> Vec<Vec<u32>> {
    sequences(&reference(REFERENCE))
}

fn run(
    served: &Model,
    reference: &Model,
    seqs: &[Vec<u32>],
    options: &DiffOptions,
) -> Vec<SequenceDiff> {
    let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
    diff_batch(served, reference, &refs, options).unwrap()
}

/// The residual stream after every decoder layer, `[layer][position][hidden]`, one layer at a
/// time through the public stage API.
fn layer_states(model: &Model, tokens: &[u32]) -> Vec<Vec<Vec<f32>>> {
    let mut x = model.embed(&[tokens]).unwrap();
    (0..model.config().num_layers)
        .map(|i| {
            x = model
                .forward_layers(i..i + 1, x.clone(), &[tokens.len()])
                .unwrap();
            x.to_vec2::<f32>().unwrap()
        })
        .collect()
}

/// (1 − cos, SQNR dB) of two rows, in plain f64 loops.
fn independent_error(served: &[f32], reference: &[f32]) -> (f64, f64) {
    let (mut dot, mut ss, mut rr, mut noise) = (0f64, 0f64, 0f64, 0f64);
    for (&s, &r) in served.iter().zip(reference) {
        let (s, r) = (f64::from(s), f64::from(r));
        dot += s * r;
        ss += s * s;
        rr += r * r;
        noise += (s - r) * (s - r);
    }
    let sqnr = if noise == 0.0 {
        SQNR_CAP_DB
    } else {
        10.0 * (rr / noise).log10()
    };
    (1.0 - dot / (ss * rr).sqrt(), sqnr)
}

#[test]
fn per_layer_errors_equal_an_independent_f64_computation() {
    let (served, reference) = (load(SERVED, Off), load(REFERENCE, Off));
    let seqs = fixture_sequences();
    let out = run(&served, &reference, &seqs, &DiffOptions::default());
    let (mut worst_cos, mut worst_sqnr, mut positions) = (0f64, 0f64, 0);
    for (seq, diff) in seqs.iter().zip(&out) {
        let (s, r) = (layer_states(&served, seq), layer_states(&reference, seq));
        assert_eq!(diff.layers.len(), 2);
        for (layer, error) in diff.layers.iter().enumerate() {
            assert_eq!(error.cos_error.len(), seq.len());
            let (mut cos_sum, mut sqnr_sum) = (0f64, 0f64);
            for p in 0..seq.len() {
                let (cos, sqnr) = independent_error(&s[layer][p], &r[layer][p]);
                worst_cos = worst_cos.max((error.cos_error[p] - cos).abs());
                worst_sqnr = worst_sqnr.max((error.sqnr_db[p] - sqnr).abs());
                (cos_sum, sqnr_sum) = (cos_sum + cos, sqnr_sum + sqnr);
                positions += 1;
            }
            let n = seq.len() as f64;
            assert!((error.mean_cos_error() - cos_sum / n).abs() <= 1e-9);
            assert!((error.mean_sqnr_db() - sqnr_sum / n).abs() <= 1e-9);
        }
        // Quantization error: present, and not noise either.
        let last = &diff.layers[1];
        assert!(
            last.mean_cos_error() > 1e-4 && last.mean_sqnr_db() < 40.0,
            "{last:?}"
        );
    }
    println!(
        "{positions} layer positions: max |Δ| vs f64 cos error {worst_cos:.2e}, SQNR {worst_sqnr:.2e} dB"
    );
    assert!(worst_cos <= 1e-9 && worst_sqnr <= 1e-9);
    // The final KLD is /kld's, bit for bit.
    let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
    let kld = kld_batch(&served, &reference, &refs).unwrap();
    for (diff, k) in out.iter().zip(&kld) {
        assert_eq!(&diff.kld, k);
    }
    for (i, l) in out[0].layers.iter().enumerate() {
        println!(
            "layer {i}: mean cos error {:.6e}, mean SQNR {:.3} dB",
            l.mean_cos_error(),
            l.mean_sqnr_db()
        );
    }
}

#[test]
fn a_model_against_itself_has_no_error_at_any_layer() {
    let model = load(SERVED, Off);
    let seqs = fixture_sequences();
    for diff in run(&model, &model, &seqs, &DiffOptions::default()) {
        for layer in &diff.layers {
            assert!(layer.cos_error.iter().all(|&c| c == 0.0));
            assert!(layer.sqnr_db.iter().all(|&s| s == SQNR_CAP_DB));
        }
        assert!(diff.kld.tokens.iter().all(|t| t.kld == 0.0));
    }
}

#[test]
fn the_reference_state_from_the_last_layer_on_gives_exactly_zero_kld() {
    let (served, reference) = (load(SERVED, Off), load(REFERENCE, Off));
    let seqs = fixture_sequences();
    let plain = run(&served, &reference, &seqs, &DiffOptions::default());
    let last = DiffOptions {
        reference_until: Some(1),
        ..DiffOptions::default()
    };
    for diff in run(&served, &reference, &seqs, &last) {
        assert!(diff.kld.tokens.iter().all(|t| t.kld == 0.0 && t.same_top));
    }
    // From layer 0 on: layer 0's comparison is unchanged (taken before the hand-over); layer 1's
    // is the served layer 1 on the reference's layer-0 state against the reference's layer 1.
    let first = DiffOptions {
        reference_until: Some(0),
        ..DiffOptions::default()
    };
    let out = run(&served, &reference, &seqs, &first);
    for ((seq, diff), plain) in seqs.iter().zip(&out).zip(&plain) {
        assert_eq!(diff.layers[0], plain.layers[0]);
        let mut x = reference.embed(&[seq]).unwrap();
        x = reference.forward_layers(0..1, x, &[seq.len()]).unwrap();
        let r1 = reference
            .forward_layers(1..2, x.clone(), &[seq.len()])
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let s1 = served
            .forward_layers(1..2, x, &[seq.len()])
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for p in 0..seq.len() {
            let (cos, sqnr) = independent_error(&s1[p], &r1[p]);
            assert!((diff.layers[1].cos_error[p] - cos).abs() <= 1e-9);
            assert!((diff.layers[1].sqnr_db[p] - sqnr).abs() <= 1e-9);
        }
        // Less error reaches the output than without the hand-over.
        let sum = |d: &SequenceDiff| d.kld.sum_kld();
        assert!(sum(diff) < sum(plain), "{} vs {}", sum(diff), sum(plain));
    }
}

/// The dense reference checkpoint with module `name`'s weight replaced by `weight` (f32).
fn swapped_reference(name: &str, weight: &[f32], shape: (usize, usize)) -> Model {
    let dir = fixtures().join(REFERENCE);
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: HashMap<String, HostTensor> = file
        .tensors()
        .into_iter()
        .map(|(n, view)| {
            let t = HostTensor {
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                data: view.data().to_vec(),
            };
            (n, t)
        })
        .collect();
    let swapped = HostTensor {
        dtype: safetensors::Dtype::F32,
        shape: vec![shape.0, shape.1],
        data: weight.iter().flat_map(|w| w.to_le_bytes()).collect(),
    };
    assert!(tensors.insert(format!("{name}.weight"), swapped).is_some());
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    Model::from_checkpoint(
        ModelConfig::from_json(&config).unwrap(),
        &Checkpoint::from_memory(tensors),
        &options(candle_core::DType::F32, Off),
    )
    .unwrap()
}

#[test]
fn attribution_equals_swapping_each_module_into_the_reference_checkpoint() {
    let (served, reference) = (load(SERVED, Off), load(REFERENCE, Off));
    let modules = attributable_modules(&served, &reference);
    // Two layers of q, k, v, o, gate, up, down; the lm_head is dense bf16 in both.
    assert_eq!(modules.len(), 14, "{modules:?}");
    assert!(modules.iter().all(|m| m.starts_with("model.layers.")));
    let seqs = fixture_sequences();
    let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
    let options = DiffOptions {
        attribute: modules.clone(),
        ..DiffOptions::default()
    };
    let out = run(&served, &reference, &seqs, &options);
    let (mut worst, mut module_total) = (0f64, 0f64);
    let mut per_module = Vec::new();
    for (m, name) in modules.iter().enumerate() {
        let w = served.linear(name).unwrap().weight();
        let swapped = swapped_reference(name, &w.dequantize_f32().unwrap(), w.shape());
        let own = kld_batch(&swapped, &reference, &refs).unwrap();
        let mut total = 0f64;
        for (diff, k) in out.iter().zip(&own) {
            worst = worst.max((diff.modules[m] - k.sum_kld()).abs());
            total += diff.modules[m];
        }
        assert!(total > 0.0, "{name}: no divergence");
        per_module.push((name.clone(), total));
        module_total += total;
    }
    let full: f64 = out.iter().map(|d| d.kld.sum_kld()).sum();
    let ratio = module_total / full;
    per_module.sort_by(|a, b| b.1.total_cmp(&a.1));
    let positions: usize = out.iter().map(|d| d.kld.num_scored()).sum();
    for (name, total) in &per_module[..3] {
        println!("{name}: mean KLD {:.6}", total / positions as f64);
    }
    println!(
        "14 modules: Σ module KLD / full KLD = {ratio:.4} (full mean KLD {:.6}); max |Δ| vs the \
         swapped checkpoint {worst:.2e}",
        full / positions as f64
    );
    assert!(worst <= 1e-12, "max |Δ| {worst:e}");
    assert!(ratio > 0.3 && ratio < 3.0, "additivity ratio {ratio}");
}

/// `/diff` on a hybrid model (Gated DeltaNet + gated attention layers): Qwen3.5 with its
/// linear-attention Linears quantized too against the checkpoint that keeps them dense. Every
/// layer compares, the linear-attention modules are attributable by their names
/// (`model.layers.N.linear_attn.*`), each contributes a finite, non-negative divergence and
/// some a positive one; the model against itself differs nowhere.
#[test]
fn hybrid_linear_attention_modules_are_attributed() {
    let served = load("qwen3_5-w4a16-g32-linattn", Off);
    let reference = load("qwen3_5-w4a16-g32", Off);
    let modules: Vec<String> = attributable_modules(&served, &reference)
        .into_iter()
        .filter(|m| m.contains(".linear_attn."))
        .collect();
    assert_eq!(modules.len(), 10, "{modules:?}");
    let seqs = sequences(&common::reference("qwen3_5-w4a16-g32"))[..2].to_vec();
    let options = DiffOptions {
        reference_until: None,
        attribute: modules.clone(),
    };
    let d = &run(&served, &reference, &seqs, &options)[1];
    assert_eq!(d.layers.len(), 4);
    assert_eq!(d.modules.len(), modules.len());
    assert!(
        d.modules.iter().all(|k| k.is_finite() && *k >= 0.0),
        "{:?}",
        d.modules
    );
    assert!(d.modules.iter().any(|&k| k > 0.0), "{:?}", d.modules);
    assert!(d.first_non_finite().is_none());
    let same = &run(&reference, &reference, &seqs, &DiffOptions::default())[0];
    assert!(same
        .layers
        .iter()
        .all(|l| l.cos_error.iter().all(|&c| c == 0.0)));
}

/// `/diff` on Gemma 4, whose layers pass on a stream wider than the residual (per-layer inputs,
/// shared keys and values): each layer's errors are those of the residual columns alone, the
/// divergence is `/kld`'s, and the modules only Gemma 4 has (the per-layer input gate, the
/// KV-shared layers' q/o projections) are attributable.
#[test]
fn gemma4_layers_compare_their_residual_stream() {
    let served = load("gemma4-nvfp4a16", Off);
    let reference = load("gemma4-w4a16-g32", Off);
    let seqs = sequences(&common::reference("gemma4-w4a16-g32"))[..2].to_vec();
    let modules = [
        "model.layers.3.per_layer_input_gate",
        "model.layers.4.self_attn.q_proj",
        "model.layers.1.self_attn.k_proj",
    ]
    .map(String::from)
    .to_vec();
    let all = attributable_modules(&served, &reference);
    assert!(modules.iter().all(|m| all.contains(m)), "{all:?}");
    let options = DiffOptions {
        reference_until: None,
        attribute: modules.clone(),
    };
    let d = run(&served, &reference, &seqs, &options);
    let hidden = served.config().hidden_size;
    let states = |m: &Model, tokens: &[u32]| -> Vec<Vec<Vec<f32>>> {
        layer_states(m, tokens)
            .into_iter()
            .map(|l| l.into_iter().map(|row| row[..hidden].to_vec()).collect())
            .collect()
    };
    for (seq, diff) in seqs.iter().zip(&d) {
        let (s, r) = (states(&served, seq), states(&reference, seq));
        assert_eq!(diff.layers.len(), 5);
        for (layer, errors) in diff.layers.iter().enumerate() {
            for (pos, (&cos, &sqnr)) in errors.cos_error.iter().zip(&errors.sqnr_db).enumerate() {
                let (want_cos, want_sqnr) = independent_error(&s[layer][pos], &r[layer][pos]);
                assert!((cos - want_cos).abs() <= 1e-9, "layer {layer} pos {pos}");
                assert!((sqnr - want_sqnr).abs() <= 1e-6, "layer {layer} pos {pos}");
            }
        }
        assert_eq!(diff.modules.len(), modules.len());
        assert!(diff.modules.iter().all(|k| k.is_finite() && *k >= 0.0));
    }
    let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
    let kld = kld_batch(&served, &reference, &refs).unwrap();
    for (diff, kld) in d.iter().zip(&kld) {
        assert_eq!(&diff.kld, kld);
    }
    assert!(d.iter().any(|diff| diff.kld.sum_kld() > 0.0));
}
