//! The linear-attention CPU reference (ops::linear_attention) against transformers' torch
//! functions (tests/fixtures/linear_attention, scripts/make_linear_attention_vectors.py): the
//! causal conv1d, the chunked gated delta rule (outputs and final state) at lengths that are and
//! are not multiples of the 64-token chunk, and the chunked form against the token-by-token
//! recurrence.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};
use exactscore_server::ops::linear_attention::{
    causal_conv1d, causal_conv1d_tensor, chunk_gated_delta_rule, gated_delta_rule,
    recurrent_gated_delta_rule, ConvActivation, DeltaRuleDims, DeltaRuleInputs,
};
use serde_json::Value;

fn vectors(name: &str) -> (HashMap<String, Tensor>, Vec<Value>) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/linear_attention")
        .join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let cases = meta.metadata().as_ref().unwrap()["cases"].clone();
    let cases: Vec<Value> = serde_json::from_str(&cases).unwrap();
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    (tensors, cases)
}

fn data(t: &HashMap<String, Tensor>, key: &str) -> Vec<f32> {
    t[key].flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// max |a - b| / (1 + |b|) over the elements, and max |b|.
fn rel_err(a: &[f32], b: &[f32]) -> (f64, f64) {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold((0f64, 0f64), |(e, m), (&x, &y)| {
        let d = (x as f64 - y as f64).abs() / (1.0 + (y as f64).abs());
        (e.max(d), m.max((y as f64).abs()))
    })
}

#[test]
fn conv1d_matches_transformers() {
    let (t, cases) = vectors("conv1d.safetensors");
    assert_eq!(cases.len(), 5);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let act = if case["activation"].is_null() {
            ConvActivation::Identity
        } else {
            assert_eq!(case["activation"], "silu");
            ConvActivation::Silu
        };
        let (channels, kernel) = (
            case["channels"].as_u64().unwrap() as usize,
            case["kernel"].as_u64().unwrap() as usize,
        );
        let x = data(&t, &format!("{name}.x"));
        let ours = causal_conv1d(
            &x,
            channels,
            &data(&t, &format!("{name}.w")),
            kernel,
            None,
            act,
        );
        let (err, _) = rel_err(&ours, &data(&t, &format!("{name}.out")));
        assert!(err <= 1e-6, "{name}: conv1d error {err:e}");
        // the tensor boundary gives the same numbers
        let via = causal_conv1d_tensor(
            &t[&format!("{name}.x")],
            &t[&format!("{name}.w")],
            None,
            act,
            &[x.len() / channels],
        )
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
        assert_eq!(via, ours, "{name}: tensor boundary");
    }
}

struct DeltaCase {
    name: String,
    dims: DeltaRuleDims,
    l2: bool,
}

fn delta_cases() -> (HashMap<String, Tensor>, Vec<DeltaCase>) {
    let (t, meta) = vectors("delta_rule.safetensors");
    let cases = meta
        .iter()
        .map(|c| {
            let n = |k: &str| c[k].as_u64().unwrap() as usize;
            DeltaCase {
                name: c["name"].as_str().unwrap().to_string(),
                dims: DeltaRuleDims {
                    tokens: n("tokens"),
                    k_heads: n("k_heads"),
                    v_heads: n("v_heads"),
                    k_dim: n("k_dim"),
                    v_dim: n("v_dim"),
                },
                l2: c["l2norm"].as_bool().unwrap(),
            }
        })
        .collect();
    (t, cases)
}

fn inputs(t: &HashMap<String, Tensor>, name: &str) -> [Vec<f32>; 5] {
    ["q", "k", "v", "g", "beta"].map(|k| data(t, &format!("{name}.{k}")))
}

fn call<'a>(c: &DeltaCase, x: &'a [Vec<f32>; 5]) -> DeltaRuleInputs<'a> {
    DeltaRuleInputs {
        dims: c.dims,
        q: &x[0],
        k: &x[1],
        v: &x[2],
        g: &x[3],
        beta: &x[4],
        l2norm: c.l2,
    }
}

#[test]
fn chunked_delta_rule_matches_transformers() {
    let (t, cases) = delta_cases();
    assert!(cases
        .iter()
        .any(|c| c.dims.tokens % 64 != 0 && c.dims.tokens > 64));
    assert!(cases.iter().any(|c| c.dims.tokens == 64));
    assert!(cases.iter().any(|c| c.dims.k_heads < c.dims.v_heads));
    for c in &cases {
        let x = inputs(&t, &c.name);
        let ours = chunk_gated_delta_rule(&call(c, &x), 64);
        let (err, mag) = rel_err(&ours.out, &data(&t, &format!("{}.chunked", c.name)));
        let (serr, _) = rel_err(&ours.state, &data(&t, &format!("{}.state", c.name)));
        eprintln!(
            "{}: chunked out error {err:.2e} (max |out| {mag:.2}), state error {serr:.2e}",
            c.name
        );
        assert!(err <= 1e-6, "{}: chunked output error {err:e}", c.name);
        assert!(serr <= 1e-6, "{}: final state error {serr:e}", c.name);
        // the tensor boundary gives the same numbers
        let key = |k: &str| t[&format!("{}.{k}", c.name)].clone();
        let via = gated_delta_rule(
            &key("q"),
            &key("k"),
            &key("v"),
            &key("g"),
            &key("beta"),
            c.l2,
            &[key("q").dims()[0]],
        )
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
        assert_eq!(via, ours.out, "{}: tensor boundary", c.name);
    }
}

#[test]
fn recurrent_delta_rule_matches_transformers() {
    let (t, cases) = delta_cases();
    for c in &cases {
        let x = inputs(&t, &c.name);
        let ours = recurrent_gated_delta_rule(&call(c, &x));
        let (err, _) = rel_err(&ours.out, &data(&t, &format!("{}.recurrent", c.name)));
        eprintln!("{}: recurrent out error {err:.2e}", c.name);
        assert!(err <= 1e-6, "{}: recurrent output error {err:e}", c.name);
    }
}

/// The chunked form is the recurrence reorganised: both agree within f32 noise, whatever the
/// chunk size (1 token, 7, 64, longer than the sequence).
#[test]
fn chunked_equals_recurrent() {
    let (t, cases) = delta_cases();
    for c in &cases {
        let x = inputs(&t, &c.name);
        let rec = recurrent_gated_delta_rule(&call(c, &x));
        for chunk in [1, 7, 64, 256] {
            let ch = chunk_gated_delta_rule(&call(c, &x), chunk);
            let (err, _) = rel_err(&ch.out, &rec.out);
            let (serr, _) = rel_err(&ch.state, &rec.state);
            eprintln!(
                "{} chunk {chunk}: vs recurrent {err:.2e}, state {serr:.2e}",
                c.name
            );
            assert!(err <= 5e-6, "{} chunk {chunk}: {err:e}", c.name);
            assert!(serr <= 5e-6, "{} chunk {chunk}: state {serr:e}", c.name);
        }
        // and transformers' own two forms agree as closely
        let (terr, _) = rel_err(
            &data(&t, &format!("{}.chunked", c.name)),
            &data(&t, &format!("{}.recurrent", c.name)),
        );
        assert!(
            terr <= 5e-6,
            "{}: transformers chunked vs recurrent {terr:e}",
            c.name
        );
    }
}

/// Heads run in parallel, each in a fixed order: the result is the same bits on one thread.
#[test]
fn thread_count_does_not_change_the_bits() {
    let (t, cases) = delta_cases();
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    for c in &cases {
        let x = inputs(&t, &c.name);
        let many = chunk_gated_delta_rule(&call(c, &x), 64);
        let single = one.install(|| chunk_gated_delta_rule(&call(c, &x), 64));
        assert_eq!(many, single, "{}", c.name);
        let many = recurrent_gated_delta_rule(&call(c, &x));
        let single = one.install(|| recurrent_gated_delta_rule(&call(c, &x)));
        assert_eq!(many, single, "{}", c.name);
    }
}
