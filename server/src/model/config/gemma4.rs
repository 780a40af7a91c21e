//! Gemma 4's text model: `Gemma4ForCausalLM` (model_type `gemma4_text`, tensors under
//! `model.`) and the text model of `Gemma4ForConditionalGeneration` (keys under `text_config`,
//! tensors under `model.language_model.`; the vision and audio towers and their embedders are
//! never read). What transformers 5.17's `Gemma4TextConfig` and `Gemma4TextModel` make of the
//! keys (docs/architectures/gemma4.md):
//!
//! * `layer_types` (default: every 6th layer full), the last layer forced to full attention;
//!   sliding layers attend within `sliding_window` with `rope_parameters.sliding_attention`,
//!   full layers with `rope_parameters.full_attention` (proportional RoPE by default).
//! * Per-layer heads: `per_layer_config` (written by transformers 5.17: `head_dim` and
//!   `num_key_value_heads` per layer index), or, without it, every full layer with
//!   `global_head_dim` (default 512) and, where `attention_k_eq_v`,
//!   `num_global_key_value_heads` key/value heads.
//! * `attention_k_eq_v`: full layers have no v_proj; the values are the keys' projection.
//! * `num_kv_shared_layers`: the last N layers compute no keys or values; each reads those of
//!   the last unshared layer of its own type. Their MLPs are twice as wide where
//!   `use_double_wide_mlp`.
//! * `hidden_size_per_layer_input` (> 0): per-layer input embeddings (PLE), one slice per layer.
//! * `enable_moe_block`: a routed mixture (`num_experts`, `top_k_experts`,
//!   `moe_intermediate_size`) beside the dense MLP of every layer.
//! * `final_logit_softcapping`; no attention soft-capping (the text attention never applies
//!   one); attention scores unscaled (q and k are RMS-normed per head).
//!
//! Refused: `use_bidirectional_attention: "all"` (not a causal LM), a `per_layer_config` that
//! overrides other keys or differs within a layer type, `vocab_size_per_layer_input` other
//! than `vocab_size`, KV-shared layers of a type no unshared layer has.

use serde_json::{json, Value};

use super::architecture::{ArchitectureConfig, DecoderFamily};
use super::gemma2::gemma_activation;
use super::rope_parameters::parse_rope;
use super::shared::{
    keys_set, optional_f64, optional_usize, required_size, Activation, ScoreShaping, SharedKeys,
    SlidingLayers,
};
use super::vision_language;
use super::ModelConfig;
use crate::checkpoint::LoadError;
use crate::model::rope::Rope;

pub(super) struct Gemma4 {
    pub(super) vision_language: bool,
}

/// Tensor prefixes of a `Gemma4ForConditionalGeneration` checkpoint that scoring never reads.
const UNREAD_PREFIXES: [&str; 4] = [
    "model.vision_tower.",
    "model.audio_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
];

/// The multimodal placeholder ids a `Gemma4ForConditionalGeneration` text model embeds as the
/// pad token (with transformers' defaults).
const PLACEHOLDER_KEYS: [(&str, u64); 3] = [
    ("image_token_id", 258_880),
    ("video_token_id", 258_884),
    ("audio_token_id", 258_881),
];

/// The Gemma 4 text model's own structure, beyond what [`ModelConfig`] says of every model.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Text {
    pub layers: Vec<Gemma4Layer>,
    /// The per-layer input width (`hidden_size_per_layer_input`), when the model has PLE.
    pub per_layer_input: Option<usize>,
    pub moe: Option<Gemma4Moe>,
    /// The head size of the sliding layers (their RoPE tables' width).
    pub sliding_head_dim: usize,
    /// Columns of the stream a decoder layer passes on: the residual stream (`hidden_size`),
    /// then the per-layer inputs (`num_layers * hidden_size_per_layer_input`), then the keys
    /// and values the KV-shared layers read (see [`KeySource`]).
    pub stream_width: usize,
    /// Token ids embedded as `pad_token_id` (the ForConditionalGeneration's placeholders of
    /// images, videos and audio, which a text-only forward replaces by padding).
    pub placeholders: Vec<u32>,
    pub pad_token_id: Option<u32>,
}

/// One decoder layer's attention and MLP sizes and where its keys and values come from.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Layer {
    pub sliding: bool,
    pub head_dim: usize,
    pub num_kv_heads: usize,
    /// No v_proj: the values are the keys' projection (full layers with `attention_k_eq_v`).
    pub keys_as_values: bool,
    pub keys: KeySource,
    pub intermediate_size: usize,
}

/// Where a layer's keys and values come from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KeySource {
    /// Its own projections; `stored_at`: the stream column where it appends them (normed, before
    /// RoPE: keys then values, `kv_heads * head_dim` each) for the KV-shared layers of its type.
    Own { stored_at: Option<usize> },
    /// A KV-shared layer: those stored at this column.
    Shared { at: usize },
}

/// The mixture of experts beside every layer's dense MLP.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemma4Moe {
    pub num_experts: usize,
    pub top_k: usize,
    pub intermediate_size: usize,
}

impl ArchitectureConfig for Gemma4 {
    fn hf_name(&self) -> &'static str {
        if self.vision_language {
            "Gemma4ForConditionalGeneration"
        } else {
            "Gemma4ForCausalLM"
        }
    }

    /// `Gemma4TextConfig`'s defaults (sizes and vocabulary excepted).
    fn transformers_defaults(&self) -> Value {
        json!({
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
            "max_position_embeddings": 131072, "tie_word_embeddings": true,
            "attention_bias": false, "sliding_window": 512, "final_logit_softcapping": null,
            "hidden_size_per_layer_input": 256, "attention_k_eq_v": false,
            "num_kv_shared_layers": 0, "enable_moe_block": false, "use_double_wide_mlp": false,
            "global_head_dim": 512, "num_global_key_value_heads": null,
            "use_bidirectional_attention": null, "pad_token_id": 0,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1000000.0},
            },
        })
    }

    fn decoder_family(&self) -> DecoderFamily {
        DecoderFamily::Gemma4
    }

    fn is_vision_language(&self) -> bool {
        self.vision_language
    }

    /// The ForConditionalGeneration's `text_config`, with the top-level quantization, token
    /// ids and dtype, its tie flag (default true) and its placeholder ids.
    fn text_config(&self, root: Value) -> Result<Value, LoadError> {
        if !self.vision_language {
            return Ok(root);
        }
        let mut text = vision_language::text_config(&root)?;
        match text.get("model_type") {
            None | Some(Value::Null) => {}
            Some(t) if t == "gemma4_text" => {}
            Some(other) => {
                return Err(LoadError::config(
                    "text_config.model_type",
                    format!("{other} is not supported (supported: \"gemma4_text\")"),
                ))
            }
        }
        text["tie_word_embeddings"] = root
            .get("tie_word_embeddings")
            .cloned()
            .unwrap_or(Value::Bool(true));
        for (key, default) in PLACEHOLDER_KEYS {
            text[key] = root.get(key).cloned().unwrap_or(default.into());
        }
        Ok(vision_language::with_top_level_keys(&root, text))
    }

    /// Gemma 4's text attention never soft-caps its scores; bidirectional attention over
    /// every token is not a causal LM (`"vision"` only changes image tokens' masks, which a
    /// text-only forward has none of).
    fn unimplemented_keys(&self, root: &Value) -> Vec<&'static str> {
        let mut refused = keys_set(root, &["attn_logit_softcapping"]);
        if root.get("use_bidirectional_attention") == Some(&json!("all")) {
            refused.push("use_bidirectional_attention");
        }
        refused
    }

    fn activation(&self, keys: &SharedKeys) -> Result<Activation, LoadError> {
        gemma_activation(self.hf_name(), keys)
    }

    /// `rope_parameters.full_attention` for the full layers, `.sliding_attention` for the
    /// sliding ones.
    fn rope(&self, root: &Value, _keys: &SharedKeys) -> Result<(Rope, Option<Rope>), LoadError> {
        let params = root.get("rope_parameters").filter(|p| p.is_object());
        let of = |kind: &str| -> Result<Rope, LoadError> {
            let p = params.and_then(|p| p.get(kind)).filter(|p| p.is_object());
            let p = p.ok_or_else(|| {
                LoadError::config(
                    format!("rope_parameters.{kind}"),
                    "missing (Gemma 4 has a RoPE per layer type)",
                )
            })?;
            parse_rope(&Some(p.clone()), &None, None, root)
        };
        Ok((of("full_attention")?, Some(of("sliding_attention")?)))
    }

    fn sliding_layers(
        &self,
        root: &Value,
        num_layers: usize,
        local_rope: Option<Rope>,
    ) -> Result<Option<SlidingLayers>, LoadError> {
        Ok(Some(SlidingLayers {
            sliding: layer_types(root, num_layers)?,
            local_rope,
        }))
    }

    fn qk_norm(&self, _root: &Value) -> bool {
        true
    }

    /// Scores are not scaled (q and k are normed per head): a scalar of 1.
    fn score_shaping(&self, root: &Value) -> Result<ScoreShaping, LoadError> {
        Ok(ScoreShaping {
            query_pre_attn_scalar: Some(1.0),
            attn_logit_softcapping: None,
            final_logit_softcapping: optional_f64(root, "final_logit_softcapping")?,
        })
    }

    fn unread_prefixes(&self) -> &'static [&'static str] {
        if self.vision_language {
            &UNREAD_PREFIXES
        } else {
            &[]
        }
    }

    fn gemma4(&self, root: &Value, c: &ModelConfig) -> Result<Option<Gemma4Text>, LoadError> {
        gemma4_text(root, c, self.vision_language).map(Some)
    }
}

/// Which layers slide: `layer_types`, or every 6th layer full; the last layer is full whatever
/// the list says (transformers forces it).
fn layer_types(root: &Value, num_layers: usize) -> Result<Vec<bool>, LoadError> {
    let mut sliding = super::gemma2::layer_types(root, num_layers, |_| Ok(6))?;
    if let Some(last) = sliding.last_mut() {
        *last = false;
    }
    Ok(sliding)
}

fn flag(root: &Value, key: &str) -> Result<bool, LoadError> {
    match root.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(LoadError::config(key, format!("{other} is not a boolean"))),
    }
}

/// Each layer's (head_dim, num_key_value_heads).
fn layer_heads(
    root: &Value,
    c: &ModelConfig,
    sliding: &[bool],
) -> Result<Vec<(usize, usize)>, LoadError> {
    let mut heads = vec![(c.head_dim, c.num_kv_heads); c.num_layers];
    match root.get("per_layer_config") {
        Some(Value::Object(overrides)) => {
            for (key, o) in overrides {
                let field = format!("per_layer_config.{key}");
                let layer = key
                    .parse::<usize>()
                    .ok()
                    .filter(|&i| i < c.num_layers)
                    .ok_or_else(|| LoadError::config(&field, "is not a decoder layer index"))?;
                let o = o
                    .as_object()
                    .ok_or_else(|| LoadError::config(&field, "is not an object"))?;
                for (k, v) in o {
                    let size = v.as_u64().filter(|&v| v > 0).map(|v| v as usize);
                    match (k.as_str(), size) {
                        ("head_dim", Some(d)) if d % 2 == 0 && d <= 1 << 12 => heads[layer].0 = d,
                        ("num_key_value_heads", Some(n)) => heads[layer].1 = n,
                        _ => {
                            return Err(LoadError::config(
                                format!("{field}.{k}"),
                                format!(
                                    "{v} is not supported (a layer may override head_dim, even, \
                                     and num_key_value_heads)"
                                ),
                            ))
                        }
                    }
                }
            }
        }
        None | Some(Value::Null) => {
            let global = required_size(
                optional_usize(root, "global_head_dim")?,
                "global_head_dim",
                1 << 12,
            )?;
            if global % 2 != 0 {
                return Err(LoadError::config(
                    "global_head_dim",
                    format!("{global} must be even"),
                ));
            }
            let global_kv = match flag(root, "attention_k_eq_v")? {
                true => optional_usize(root, "num_global_key_value_heads")?,
                false => None,
            };
            for (h, _) in heads.iter_mut().zip(sliding).filter(|(_, &s)| !s) {
                *h = (global, global_kv.unwrap_or(h.1));
            }
        }
        Some(other) => {
            return Err(LoadError::config(
                "per_layer_config",
                format!("{other} is not an object"),
            ))
        }
    }
    for (i, &(_, kv)) in heads.iter().enumerate() {
        if kv == 0 || !c.num_heads.is_multiple_of(kv) {
            return Err(LoadError::config(
                "num_key_value_heads",
                format!(
                    "layer {i}: {kv} must divide num_attention_heads = {}",
                    c.num_heads
                ),
            ));
        }
    }
    // transformers builds one RoPE table per layer type from that type's heads.
    for kind in [true, false] {
        let mut of_kind = heads.iter().zip(sliding).filter(|(_, &s)| s == kind);
        if let Some((first, _)) = of_kind.next() {
            if let Some((other, _)) = of_kind.find(|(h, _)| h != &first) {
                return Err(LoadError::config(
                    "per_layer_config",
                    format!(
                        "{} layers differ in (head_dim, num_key_value_heads): {first:?} and \
                         {other:?}",
                        if kind { "sliding" } else { "full" }
                    ),
                ));
            }
        }
    }
    Ok(heads)
}

fn gemma4_text(
    root: &Value,
    c: &ModelConfig,
    vision_language: bool,
) -> Result<Gemma4Text, LoadError> {
    let n = c.num_layers;
    let sliding = &c
        .sliding_layers
        .as_ref()
        .expect("Gemma 4 reads its layer types")
        .sliding;
    let heads = layer_heads(root, c, sliding)?;
    let shared = optional_usize(root, "num_kv_shared_layers")?.unwrap_or(0);
    if shared >= n && shared > 0 {
        return Err(LoadError::config(
            "num_kv_shared_layers",
            format!("{shared} leaves none of the {n} layers to compute keys and values"),
        ));
    }
    let first_shared = n - shared;
    let keys_as_values = flag(root, "attention_k_eq_v")?;
    let double_wide = flag(root, "use_double_wide_mlp")?;
    let per_layer_input = match optional_usize(root, "hidden_size_per_layer_input")? {
        None | Some(0) => None,
        Some(p) => Some(required_size(
            Some(p),
            "hidden_size_per_layer_input",
            1 << 16,
        )?),
    };
    if per_layer_input.is_some() {
        let v = optional_usize(root, "vocab_size_per_layer_input")?.unwrap_or(c.vocab_size);
        if v != c.vocab_size {
            return Err(LoadError::config(
                "vocab_size_per_layer_input",
                format!(
                    "{v} differs from vocab_size = {}: not implemented",
                    c.vocab_size
                ),
            ));
        }
    }
    let moe = match flag(root, "enable_moe_block")? {
        false => None,
        true => {
            let num_experts =
                required_size(optional_usize(root, "num_experts")?, "num_experts", 1 << 12)?;
            Some(Gemma4Moe {
                num_experts,
                top_k: required_size(
                    optional_usize(root, "top_k_experts")?,
                    "top_k_experts",
                    num_experts,
                )?,
                intermediate_size: required_size(
                    optional_usize(root, "moe_intermediate_size")?,
                    "moe_intermediate_size",
                    1 << 20,
                )?,
            })
        }
    };
    // The stream: residual, per-layer inputs, then each stored type's keys and values.
    let mut width = c.hidden_size + per_layer_input.map_or(0, |p| n * p);
    let mut stored_at: [Option<usize>; 2] = [None, None];
    let mut layers = Vec::with_capacity(n);
    for i in 0..n {
        let (head_dim, num_kv_heads) = heads[i];
        let kind = sliding[i] as usize;
        let keys = if i < first_shared {
            // transformers stores the keys of the last unshared layer of each type; only a
            // shared layer of that type reads them.
            let last_of_kind = (i + 1..first_shared).all(|j| sliding[j] != sliding[i]);
            let read = (first_shared..n).any(|j| sliding[j] == sliding[i]);
            let at = (last_of_kind && read).then_some(width);
            if let Some(at) = at {
                stored_at[kind] = Some(at);
                width += 2 * num_kv_heads * head_dim;
            }
            KeySource::Own { stored_at: at }
        } else {
            let at = stored_at[kind].ok_or_else(|| {
                LoadError::config(
                    "num_kv_shared_layers",
                    format!(
                        "layer {i} shares the keys of a {} layer, but none of layers \
                         0..{first_shared} is one",
                        if sliding[i] { "sliding" } else { "full" }
                    ),
                )
            })?;
            KeySource::Shared { at }
        };
        layers.push(Gemma4Layer {
            sliding: sliding[i],
            head_dim,
            num_kv_heads,
            keys_as_values: keys_as_values && !sliding[i],
            keys,
            intermediate_size: c.intermediate_size
                * if double_wide && i >= first_shared {
                    2
                } else {
                    1
                },
        });
    }
    let sliding_head_dim = layers
        .iter()
        .find(|l| l.sliding)
        .map_or(c.head_dim, |l| l.head_dim);
    let token = |key: &str| -> Result<Option<u32>, LoadError> {
        Ok(optional_usize(root, key)?.map(|v| v as u32))
    };
    let placeholders = match vision_language {
        true => PLACEHOLDER_KEYS
            .iter()
            .map(|(key, _)| token(key))
            .collect::<Result<Option<Vec<u32>>, _>>()?
            .unwrap_or_default(),
        false => Vec::new(),
    };
    let pad_token_id = token("pad_token_id")?;
    if !placeholders.is_empty() && pad_token_id.is_none_or(|p| p as usize >= c.vocab_size) {
        return Err(LoadError::config(
            "pad_token_id",
            "must be a token of the vocabulary: the image, video and audio placeholders are \
             embedded as it",
        ));
    }
    Ok(Gemma4Text {
        layers,
        per_layer_input,
        moe,
        sliding_head_dim,
        stream_width: width,
        placeholders,
        pad_token_id,
    })
}

#[cfg(test)]
mod tests {
    use super::{Gemma4Layer, KeySource};
    use crate::model::config::{Architecture, ModelConfig, RopeScaling};
    use serde_json::{json, Value};

    /// A Google-style text config (no `per_layer_config`): 6 layers, the last 2 KV-shared.
    fn text() -> Value {
        json!({"architectures": ["Gemma4ForCausalLM"], "vocab_size": 64, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 16,
            "num_global_key_value_heads": 1, "attention_k_eq_v": true,
            "hidden_size_per_layer_input": 4, "vocab_size_per_layer_input": 64,
            "num_kv_shared_layers": 2, "use_double_wide_mlp": true, "sliding_window": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                            "sliding_attention", "sliding_attention", "sliding_attention"]})
    }

    fn read(v: &Value) -> Result<ModelConfig, String> {
        ModelConfig::from_json(&v.to_string()).map_err(|e| e.to_string())
    }

    #[test]
    fn google_style_config_reads_heads_sharing_and_the_stream() {
        let c = read(&text()).unwrap();
        assert_eq!(c.architecture, Architecture::Gemma4);
        let g = c.gemma4.as_ref().unwrap();
        let layer = |sliding, head_dim, kv, keys_as_values, keys, wide: usize| Gemma4Layer {
            sliding,
            head_dim,
            num_kv_heads: kv,
            keys_as_values,
            keys,
            intermediate_size: 32 * wide,
        };
        let own = |at| KeySource::Own { stored_at: at };
        // the last layer is forced full; layer 2 is the last unshared full layer, layer 3 the
        // last unshared sliding one: both store, after the residual (16) and PLE (6 * 4)
        let (full_at, sliding_at) = (16 + 24, 16 + 24 + 2 * 16);
        assert_eq!(
            g.layers,
            vec![
                layer(true, 8, 2, false, own(None), 1),
                layer(true, 8, 2, false, own(None), 1),
                layer(false, 16, 1, true, own(Some(full_at)), 1),
                layer(true, 8, 2, false, own(Some(sliding_at)), 1),
                layer(true, 8, 2, false, KeySource::Shared { at: sliding_at }, 2),
                layer(false, 16, 1, true, KeySource::Shared { at: full_at }, 2),
            ]
        );
        assert_eq!(g.stream_width, sliding_at + 2 * 16);
        assert_eq!(c.rope_table_dims(), (16, 8));
        assert_eq!(
            c.rope.scaling,
            RopeScaling::Proportional {
                factor: 1.0,
                partial_rotary_factor: 0.25
            }
        );
        assert_eq!(c.rope.rotated_pairs(16), 2);
        let inv = c.rope.inv_freq(16);
        assert_eq!(&inv[2..], &[0.0; 6]);
        assert_eq!(inv[1], 1.0 / 1e6f32.powf(2.0 / 16.0));
    }

    #[test]
    fn unimplemented_values_are_refused_by_name() {
        let refused = |edit: &dyn Fn(&mut Value), field: &str| {
            let mut v = text();
            edit(&mut v);
            let err = read(&v).unwrap_err();
            assert!(err.contains(field), "{field}: {err}");
        };
        refused(
            &|v| v["use_bidirectional_attention"] = "all".into(),
            "use_bidirectional_attention",
        );
        refused(
            &|v| v["vocab_size_per_layer_input"] = 32.into(),
            "vocab_size_per_layer_input",
        );
        refused(
            &|v| v["per_layer_config"] = json!({"2": {"sliding_window": 4}}),
            "per_layer_config.2.sliding_window",
        );
        refused(
            &|v| v["per_layer_config"] = json!({"0": {"head_dim": 4}}),
            "per_layer_config",
        );
        // the shared layers 4-5 include a full one; with layer 2 sliding no full layer precedes
        refused(
            &|v| v["layer_types"][2] = "sliding_attention".into(),
            "num_kv_shared_layers",
        );
        refused(
            &|v| v["num_kv_shared_layers"] = 6.into(),
            "num_kv_shared_layers",
        );
        refused(
            &|v| v["attn_logit_softcapping"] = 50.0.into(),
            "attn_logit_softcapping",
        );
        refused(
            &|v| {
                v["rope_parameters"] =
                    json!({"full_attention": {"rope_type": "default", "rope_theta": 1e6}})
            },
            "rope_parameters.sliding_attention",
        );
        refused(
            &|v| {
                v["enable_moe_block"] = true.into();
                v["num_experts"] = 4.into();
            },
            "top_k_experts",
        );
        // "vision" only changes image tokens' masks
        let mut v = text();
        v["use_bidirectional_attention"] = "vision".into();
        assert!(read(&v).is_ok());
    }
}
