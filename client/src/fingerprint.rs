//! What, besides the dataset and the windows, changes a run's numbers: a server's model, its
//! reference, their formats and dtypes, the activation-quantization emulation, the KV-cache
//! quantization, the attention kernel, the device kind and the server version, all read from
//! `/info`. A partial file records it so that `--resume` cannot mix numbers of two configurations, and the servers of one run
//! must agree on it.
//!
//! The checkpoints are identified by `/info`'s `checkpoint_sha256` (config, tokenizer, every
//! safetensors header and the first 64 KiB of every tensor) besides their name, architecture,
//! shape, formats and bits per weight; servers older than that field give none, and a partial
//! file written before it records none, so such a file resumes only against such a server.

use std::collections::BTreeMap;

use exactscore_api::{ModelInfo, ReferenceInfo};
use serde::{Deserialize, Serialize};

/// The numbers-changing configuration of one server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fingerprint {
    pub model: String,
    pub architecture: String,
    pub vocab_size: usize,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub formats: BTreeMap<String, String>,
    pub bits_per_weight: f64,
    pub dtype: String,
    pub activation_quant: BTreeMap<String, String>,
    pub activation_quant_mode: String,
    /// `/info`'s `kv_cache`: the KV-cache quantization emulated or simulated, if any (absent
    /// from partial files written before it, as from servers without one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache: Option<String>,
    pub attention: String,
    /// `cpu`, `cuda`: the kinds of the devices, not their count.
    pub device_kinds: Vec<String>,
    pub version: String,
    /// `/info`'s `checkpoint_sha256`.
    #[serde(default)]
    pub checkpoint_sha256: Option<String>,
    pub reference: Option<ReferenceFingerprint>,
}

/// The numbers-changing configuration of a server's reference model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReferenceFingerprint {
    pub model: String,
    pub architecture: String,
    pub formats: BTreeMap<String, String>,
    pub bits_per_weight: f64,
    pub dtype: Option<String>,
    pub num_layers: usize,
    pub hidden_size: usize,
    /// The reference's `checkpoint_sha256`.
    #[serde(default)]
    pub checkpoint_sha256: Option<String>,
}

fn device_kinds(devices: &[String]) -> Vec<String> {
    let mut kinds: Vec<String> = devices
        .iter()
        .map(|d| d.split(':').next().unwrap_or(d).to_string())
        .collect();
    kinds.sort();
    kinds.dedup();
    kinds
}

impl From<&ReferenceInfo> for ReferenceFingerprint {
    fn from(r: &ReferenceInfo) -> Self {
        Self {
            model: r.model.clone(),
            architecture: r.architecture.clone(),
            formats: r.formats.clone(),
            bits_per_weight: r.bits_per_weight,
            dtype: r.dtype.clone(),
            num_layers: r.num_layers,
            hidden_size: r.hidden_size,
            checkpoint_sha256: r.checkpoint_sha256.clone(),
        }
    }
}

impl From<&ModelInfo> for Fingerprint {
    fn from(i: &ModelInfo) -> Self {
        Self {
            model: i.model.clone(),
            architecture: i.architecture.clone(),
            vocab_size: i.vocab_size,
            num_layers: i.num_layers,
            hidden_size: i.hidden_size,
            formats: i.formats.clone(),
            bits_per_weight: i.bits_per_weight,
            dtype: i.dtype.clone(),
            activation_quant: i.activation_quant.clone(),
            activation_quant_mode: i.activation_quant_mode.clone(),
            kv_cache: i.kv_cache.clone(),
            attention: i.attention.clone(),
            device_kinds: device_kinds(&i.devices),
            version: i.version.clone(),
            checkpoint_sha256: i.checkpoint_sha256.clone(),
            reference: i.reference.as_ref().map(ReferenceFingerprint::from),
        }
    }
}

/// `field a vs b` for each field that differs, `a` from `left`, `b` from `right`.
pub fn differences(left: &Fingerprint, right: &Fingerprint) -> Vec<String> {
    let mut out = diff_fields("", &fields(left), &fields(right));
    match (&left.reference, &right.reference) {
        (Some(a), Some(b)) => out.extend(diff_fields("reference.", &fields(a), &fields(b))),
        (None, None) => {}
        (a, b) => {
            let name = |r: &Option<ReferenceFingerprint>| {
                r.as_ref().map_or("none".to_string(), |r| r.model.clone())
            };
            out.push(format!("reference {} vs {}", name(a), name(b)));
        }
    }
    out
}

fn diff_fields(
    prefix: &str,
    l: &BTreeMap<String, String>,
    r: &BTreeMap<String, String>,
) -> Vec<String> {
    l.iter()
        .filter(|(k, a)| r.get(*k) != Some(*a))
        .map(|(k, a)| {
            let b = r.get(k).map_or("(none)", String::as_str);
            format!("{prefix}{k} {a} vs {b}")
        })
        .collect()
}

/// Every top-level field but `reference`, as `name → JSON text`.
fn fields(f: &impl Serialize) -> BTreeMap<String, String> {
    match serde_json::to_value(f) {
        Ok(serde_json::Value::Object(m)) => m
            .into_iter()
            .filter(|(k, _)| k != "reference")
            .map(|(k, v)| (k, v.to_string()))
            .collect(),
        _ => BTreeMap::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp() -> Fingerprint {
        Fingerprint {
            model: "m".into(),
            architecture: "LlamaForCausalLM".into(),
            vocab_size: 10,
            num_layers: 2,
            hidden_size: 8,
            formats: BTreeMap::from([("q_proj".into(), "w4a16".into())]),
            bits_per_weight: 4.25,
            dtype: "f32".into(),
            activation_quant: BTreeMap::new(),
            activation_quant_mode: "off".into(),
            kv_cache: None,
            attention: "materialized".into(),
            device_kinds: vec!["cpu".into()],
            version: "0.1.0".into(),
            checkpoint_sha256: Some("ab".into()),
            reference: None,
        }
    }

    #[test]
    fn names_each_differing_field() {
        let a = fp();
        assert!(differences(&a, &a).is_empty());
        let mut b = fp();
        b.dtype = "bf16".into();
        b.reference = Some(ReferenceFingerprint {
            model: "r".into(),
            architecture: "LlamaForCausalLM".into(),
            formats: BTreeMap::new(),
            bits_per_weight: 16.0,
            dtype: Some("f32".into()),
            num_layers: 2,
            hidden_size: 8,
            checkpoint_sha256: Some("cd".into()),
        });
        let d = differences(&a, &b);
        assert_eq!(d, vec![r#"dtype "f32" vs "bf16""#, "reference none vs r"]);
        let mut c = b.clone();
        if let Some(r) = c.reference.as_mut() {
            r.dtype = Some("bf16".into());
        }
        assert_eq!(
            differences(&b, &c),
            vec![r#"reference.dtype "f32" vs "bf16""#]
        );
        // The same names and shapes, other weights.
        let mut d = c.clone();
        d.checkpoint_sha256 = Some("ef".into());
        if let Some(r) = d.reference.as_mut() {
            r.checkpoint_sha256 = Some("01".into());
        }
        assert_eq!(
            differences(&c, &d),
            vec![
                r#"checkpoint_sha256 "ab" vs "ef""#,
                r#"reference.checkpoint_sha256 "cd" vs "01""#
            ]
        );
        // An fp8 KV cache emulated on one server and not the other.
        let mut e = d.clone();
        e.kv_cache = Some("fp8 e4m3 per tensor (emulated)".into());
        assert_eq!(
            differences(&e, &d),
            vec![r#"kv_cache "fp8 e4m3 per tensor (emulated)" vs (none)"#]
        );
    }
}
