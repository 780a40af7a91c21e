//! `config.json` of a Hugging Face causal LM, in both key styles: transformers v4
//! (`rope_theta` + `rope_scaling`, `torch_dtype`) and v5 (`rope_parameters`, `dtype`).

mod rope_parameters;

use serde::Deserialize;
use serde_json::Value;

pub use super::rope::{Rope, RopeScaling};
use crate::checkpoint::LoadError;
use rope_parameters::parse_rope;

/// The model families we serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Mixtral,
    Gemma2,
    Gemma3,
    /// The text part of a Gemma 3 vision-language checkpoint (`language_model.` weights).
    Gemma3Multimodal,
    /// The text part of a Mistral 3 vision-language checkpoint (Mistral Small 3.x): a Mistral
    /// under `language_model.`.
    Mistral3Multimodal,
}

impl Architecture {
    const ALL: [Self; 10] = [
        Self::Llama,
        Self::Mistral,
        Self::Qwen2,
        Self::Qwen3,
        Self::Qwen3Moe,
        Self::Mixtral,
        Self::Gemma2,
        Self::Gemma3,
        Self::Gemma3Multimodal,
        Self::Mistral3Multimodal,
    ];

    fn from_hf(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.hf_name() == name)
    }

    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
            Self::Mixtral => "MixtralForCausalLM",
            Self::Gemma2 => "Gemma2ForCausalLM",
            Self::Gemma3 => "Gemma3ForCausalLM",
            Self::Gemma3Multimodal => "Gemma3ForConditionalGeneration",
            Self::Mistral3Multimodal => "Mistral3ForConditionalGeneration",
        }
    }

    /// Gemma's block: (1 + w) norms, scaled embeddings, norms after attention and MLP.
    pub fn is_gemma(self) -> bool {
        matches!(self, Self::Gemma2 | Self::Gemma3 | Self::Gemma3Multimodal)
    }

    /// A vision-language checkpoint whose text model is served: config under `text_config`,
    /// weights under `model.language_model` (transformers 5) or `language_model.model` (4.x).
    pub fn is_vision_language(self) -> bool {
        matches!(self, Self::Gemma3Multimodal | Self::Mistral3Multimodal)
    }

    fn supported_list() -> String {
        Self::ALL.map(Self::hf_name).join(", ")
    }

    /// Tensor prefixes a checkpoint of this architecture may hold that scoring never reads:
    /// the vision tower and projector of a vision-language checkpoint (only its text model is
    /// served).
    pub fn unread_prefixes(self) -> &'static [&'static str] {
        if !self.is_vision_language() {
            return &[];
        }
        &[
            "vision_tower.",
            "multi_modal_projector.",
            "model.vision_tower.",
            "model.multi_modal_projector.",
        ]
    }
}

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// `gelu_pytorch_tanh`: GELU with the tanh approximation (GeGLU).
    GeluTanh,
}

impl Activation {
    /// The profile stage of the gated product `act(gate) * up`.
    pub fn stage_name(self) -> &'static str {
        match self {
            Self::Silu => "silu_mul",
            Self::GeluTanh => "gelu_mul",
        }
    }
}

/// A mixture-of-experts feed-forward (Qwen3-MoE, Mixtral).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub expert_intermediate_size: usize,
    /// Renormalise the top-k router probabilities to sum to 1.
    pub norm_topk_prob: bool,
    /// Which decoder layers are sparse (the others have a dense MLP of `intermediate_size`).
    pub sparse_layers: Vec<bool>,
    /// Mixtral names: `block_sparse_moe.experts.E.{w1,w3,w2}`; Qwen: `mlp.experts.E.{gate,up,down}_proj`.
    pub mixtral_names: bool,
    /// Qwen3-MoE casts the routing weights to the compute dtype before weighting the experts;
    /// Mixtral keeps them in f32.
    pub weights_in_compute_dtype: bool,
}

/// Per-layer attention: which layers use the sliding window, and the RoPE of those layers
/// when it differs from the global one (Gemma 3's local base).
#[derive(Debug, Clone, PartialEq)]
pub struct SlidingLayers {
    pub sliding: Vec<bool>,
    pub local_rope: Option<Rope>,
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    /// RoPE of every layer (of the global ones where `sliding_layers` has a local RoPE).
    pub rope: Rope,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (always in Qwen2; `attention_bias` where the
    /// architecture reads it).
    pub qkv_bias: bool,
    /// o_proj carries a bias (`attention_bias` in Llama, Qwen3 and Gemma; never in Qwen2).
    pub o_bias: bool,
    /// The dense MLP's projections carry a bias (`mlp_bias`, read by Llama only).
    pub mlp_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Mistral-style sliding-window attention: a token sees at most this many positions.
    pub sliding_window: Option<usize>,
    /// Only these layers slide (Gemma's `layer_types`); `None`: every layer, when there is a window.
    pub sliding_layers: Option<SlidingLayers>,
    pub hidden_act: Activation,
    /// Present for mixture-of-experts models.
    pub moe: Option<MoeConfig>,
    /// Attention scores are scaled by `1 / sqrt(this)` (Gemma's `query_pre_attn_scalar`);
    /// `None`: by `1 / sqrt(head_dim)`.
    pub query_pre_attn_scalar: Option<f64>,
    /// `cap * tanh(x / cap)` on the attention scores (Gemma 2).
    pub attn_logit_softcapping: Option<f64>,
    /// `cap * tanh(x / cap)` on the final logits (Gemma 2; Gemma 3 where set).
    pub final_logit_softcapping: Option<f64>,
    /// dtype the checkpoint was saved in (informational; compute dtype is chosen separately).
    pub checkpoint_dtype: String,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The raw `quantization_config`, parsed by `quant::compressed_tensors`.
    pub quantization_config: Option<Value>,
}

/// The keys we read; everything else in config.json is ignored.
#[derive(Deserialize)]
struct RawConfig {
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    hidden_act: Option<String>,
    hidden_activation: Option<String>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    sliding_window: Option<Value>,
    use_sliding_window: Option<bool>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
    quantization_config: Option<Value>,
}

fn required<T>(value: Option<T>, field: &str) -> Result<T, LoadError> {
    value.ok_or_else(|| LoadError::config(field, "missing"))
}

/// A size from config.json, checked before anything is allocated from it: a corrupt or
/// hostile file must fail here, not ask for 10^15 layers. The bounds are far above any real
/// model (Llama 3.1 405B: 126 layers, hidden 16384, intermediate 53248, vocab 128256).
fn size(value: usize, field: &str, max: usize) -> Result<usize, LoadError> {
    if value == 0 || value > max {
        return Err(LoadError::config(
            field,
            format!("{value} is out of range (1..={max})"),
        ));
    }
    Ok(value)
}

/// A float from config.json that the math divides by, takes the root or the power of: NaN, ±∞,
/// 0 and negative values would turn every logit into NaN (`rms_norm_eps: -1` is a square root
/// of a negative number for a row of zeros; `rope_theta: 0` makes every frequency infinite).
/// The model computes in f32, so the value must also be finite and non-zero as an f32.
fn positive_finite(value: f64, field: &str) -> Result<f64, LoadError> {
    let as_f32 = value as f32;
    if !(as_f32.is_finite() && as_f32 > 0.0) {
        return Err(LoadError::config(
            field,
            format!("{value} is out of range (finite and > 0 in f32)"),
        ));
    }
    Ok(value)
}

fn token_ids(value: Option<&Value>) -> Vec<u32> {
    match value {
        Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(|v| v.as_u64().map(|v| v as u32))
            .collect(),
        _ => Vec::new(),
    }
}

/// transformers' defaults (5.17) for the keys we read that a config may leave out and that
/// change the math: an absent key means what transformers' config class makes of it (an
/// explicit `null` is read as the file says). Sizes and vocabularies have no default here: a
/// config without them is refused.
fn transformers_defaults(architecture: Architecture) -> Value {
    use serde_json::json;
    match architecture {
        Architecture::Llama => json!({
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        }),
        Architecture::Mistral | Architecture::Mistral3Multimodal => json!({
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 131072,
            "num_key_value_heads": 8, "sliding_window": 4096,
        }),
        Architecture::Qwen2 | Architecture::Qwen3 => json!({
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768,
            "num_key_value_heads": 32,
        }),
        Architecture::Qwen3Moe => json!({
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768,
            "num_key_value_heads": 4,
        }),
        Architecture::Mixtral => json!({
            "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 131072,
            "num_key_value_heads": 8,
        }),
        Architecture::Gemma2 => json!({
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
            "tie_word_embeddings": true, "max_position_embeddings": 8192, "head_dim": 256,
        }),
        Architecture::Gemma3 | Architecture::Gemma3Multimodal => json!({
            "vocab_size": 262208, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
            "tie_word_embeddings": true, "max_position_embeddings": 131072, "head_dim": 256,
            "final_logit_softcapping": null, "attn_logit_softcapping": null,
        }),
    }
}

/// The text model's keys: for a vision-language checkpoint those of `text_config` (plus the
/// top-level quantization and token ids), with transformers' defaults under whatever the file
/// says.
fn text_config(mut root: Value, architecture: Architecture) -> Result<Value, LoadError> {
    if architecture.is_vision_language() {
        let mut text = root
            .get("text_config")
            .filter(|t| t.is_object())
            .cloned()
            .ok_or_else(|| LoadError::config("text_config", "missing or not an object"))?;
        // transformers builds Mistral 3's text model from `text_config.model_type` (another
        // one, Ministral 3's, is another architecture), and ties its lm_head by the top-level
        // flag (default true) where the checkpoint has none; the text model's own is not read.
        if architecture == Architecture::Mistral3Multimodal {
            match text.get("model_type") {
                None | Some(Value::Null) => {}
                Some(t) if t == "mistral" => {}
                Some(other) => {
                    return Err(LoadError::config(
                        "text_config.model_type",
                        format!("{other} is not supported (supported: \"mistral\")"),
                    ))
                }
            }
            text["tie_word_embeddings"] = root
                .get("tie_word_embeddings")
                .cloned()
                .unwrap_or(Value::Bool(true));
        }
        for key in [
            "quantization_config",
            "bos_token_id",
            "eos_token_id",
            "dtype",
            "torch_dtype",
            "tie_word_embeddings",
        ] {
            if let (Some(v), None) = (root.get(key), text.get(key)) {
                text[key] = v.clone();
            }
        }
        root = text;
    }
    let mut merged = transformers_defaults(architecture);
    for (k, v) in root.as_object().into_iter().flatten() {
        merged[k.as_str()] = v.clone();
    }
    Ok(merged)
}

/// `Some(None)` for an explicit `null`, `None` when the key is absent.
fn optional_f64(root: &Value, key: &str) -> Result<Option<f64>, LoadError> {
    match root.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|v| v.is_finite() && *v > 0.0)
            .map(Some)
            .ok_or_else(|| LoadError::config(key, format!("{v} is not a positive number"))),
    }
}

/// Keys that change the math in ways we do not implement: refused rather than ignored.
fn refuse_unimplemented(root: &Value, architecture: Architecture) -> Result<(), LoadError> {
    let set = |key: &str| root.get(key).is_some_and(|v| !v.is_null() && v != false);
    let mut refused: Vec<&str> = Vec::new();
    if let Some(f) = root.get("partial_rotary_factor").and_then(Value::as_f64) {
        if f != 1.0 {
            refused.push("partial_rotary_factor");
        }
    }
    if !architecture.is_gemma() {
        refused.extend(
            ["attn_logit_softcapping", "final_logit_softcapping"]
                .into_iter()
                .filter(|k| set(k)),
        );
    }
    if matches!(
        architecture,
        Architecture::Gemma3 | Architecture::Gemma3Multimodal
    ) {
        // transformers' Gemma 3 never applies it, and `use_bidirectional_attention` drops the
        // causal mask: both are refused rather than guessed at.
        refused.extend(
            ["attn_logit_softcapping", "use_bidirectional_attention"]
                .into_iter()
                .filter(|k| set(k)),
        );
    }
    if architecture == Architecture::Qwen3Moe
        && root.get("shared_expert_intermediate_size").is_some()
    {
        refused.push("shared_expert_intermediate_size");
    }
    match refused.as_slice() {
        [] => Ok(()),
        [first, ..] => Err(LoadError::config(
            *first,
            format!(
                "{} changes the model's math and is not implemented for {}",
                refused.join(", "),
                architecture.hf_name()
            ),
        )),
    }
}

impl ModelConfig {
    pub fn from_json(text: &str) -> Result<Self, LoadError> {
        let root: Value = serde_json::from_str(text)
            .map_err(|e| LoadError::config("config.json", e.to_string()))?;
        let arch_names: Vec<String> = required(
            root.get("architectures")
                .and_then(|a| serde_json::from_value(a.clone()).ok()),
            "architectures",
        )?;
        let architecture = arch_names
            .iter()
            .find_map(|a| Architecture::from_hf(a))
            .ok_or_else(|| {
                LoadError::config(
                    "architectures",
                    format!(
                        "unsupported architecture {arch_names:?}; supported: {}",
                        Architecture::supported_list()
                    ),
                )
            })?;
        let root = text_config(root, architecture)?;
        refuse_unimplemented(&root, architecture)?;
        // The path names the member of a wrong type (`num_hidden_layers: -1` is not a size).
        let raw: RawConfig = serde_path_to_error::deserialize(root.clone()).map_err(|e| {
            let field = match e.path().to_string() {
                path if path == "." => "config.json".to_string(),
                path => path,
            };
            LoadError::config(field, e.into_inner().to_string())
        })?;
        let act_field = if architecture.is_gemma() {
            "hidden_activation"
        } else {
            "hidden_act"
        };
        let act = raw
            .hidden_activation
            .as_deref()
            .filter(|_| architecture.is_gemma())
            .or(raw.hidden_act.as_deref())
            .unwrap_or("silu");
        let hidden_act = match act {
            "silu" => Activation::Silu,
            "gelu_pytorch_tanh" if architecture.is_gemma() => Activation::GeluTanh,
            other => {
                return Err(LoadError::config(
                    act_field,
                    format!(
                        "`{other}` is not supported for {} (supported: {})",
                        architecture.hf_name(),
                        if architecture.is_gemma() {
                            "gelu_pytorch_tanh, silu"
                        } else {
                            "silu"
                        }
                    ),
                ))
            }
        };
        let hidden_size = size(
            required(raw.hidden_size, "hidden_size")?,
            "hidden_size",
            1 << 17,
        )?;
        let num_heads = size(
            required(raw.num_attention_heads, "num_attention_heads")?,
            "num_attention_heads",
            1 << 12,
        )?;
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(LoadError::config(
                "num_key_value_heads",
                format!("{num_kv_heads} must divide num_attention_heads = {num_heads}"),
            ));
        }
        // Without `head_dim` the heads split the hidden size: a remainder would be dropped.
        if raw.head_dim.is_none() && !hidden_size.is_multiple_of(num_heads) {
            return Err(LoadError::config(
                "num_attention_heads",
                format!(
                    "{num_heads} does not divide hidden_size = {hidden_size} (and no head_dim \
                     is given)"
                ),
            ));
        }
        let head_dim = size(
            raw.head_dim.unwrap_or(hidden_size / num_heads),
            "head_dim",
            1 << 12,
        )?;
        if !head_dim.is_multiple_of(2) {
            return Err(LoadError::config(
                "head_dim",
                format!("{head_dim} must be even"),
            ));
        }
        let num_layers = size(
            required(raw.num_hidden_layers, "num_hidden_layers")?,
            "num_hidden_layers",
            1 << 12,
        )?;
        let (rope, local_rope) = if architecture.is_gemma() {
            parse_gemma_rope(&root, architecture)?
        } else {
            let rope = parse_rope(
                &raw.rope_parameters,
                &raw.rope_scaling,
                raw.rope_theta,
                &root,
            )?;
            (rope, None)
        };
        // Each parameter in its range can still combine into a frequency that is not (a theta
        // near the smallest f32 gives infinite ones, YaRN's betas at or below 0 NaN).
        for r in std::iter::once(&rope).chain(&local_rope) {
            if let Some(f) = r
                .inv_freq(head_dim)
                .into_iter()
                .find(|f| !(f.is_finite() && *f > 0.0))
            {
                return Err(LoadError::config(
                    "rope_theta",
                    format!(
                        "{} with {:?} gives a RoPE frequency of {f} (must be finite and > 0)",
                        r.theta, r.scaling
                    ),
                ));
            }
        }
        // A window of 0 would leave a token nothing to attend to (a softmax over nothing).
        let window_value = match &raw.sliding_window {
            None | Some(Value::Null) => None,
            Some(v) => Some(size(
                v.as_u64().map_or(0, |v| v as usize),
                "sliding_window",
                1 << 30,
            )?),
        };
        let sliding_window = match (architecture, raw.use_sliding_window) {
            // Qwen2/3 configs carry a `sliding_window` value that is only active with the flag.
            (Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe, flag)
                if flag != Some(true) =>
            {
                None
            }
            _ => window_value,
        };
        let sliding_layers = if architecture.is_gemma() {
            Some(gemma_layer_types(
                &root,
                architecture,
                num_layers,
                local_rope,
            )?)
        } else {
            None
        };
        let intermediate_size = size(
            required(raw.intermediate_size, "intermediate_size")?,
            "intermediate_size",
            1 << 20,
        )?;
        let moe = parse_moe(&root, architecture, num_layers)?;
        // Which projections have biases is the architecture's: transformers' Mistral and
        // Mixtral have none whatever the config says, Qwen2 always has q/k/v ones.
        let attention_bias = raw.attention_bias.unwrap_or(false);
        let (qkv_bias, o_bias) = match architecture {
            Architecture::Qwen2 => (true, false),
            Architecture::Mistral | Architecture::Mistral3Multimodal | Architecture::Mixtral => {
                (false, false)
            }
            _ => (attention_bias, attention_bias),
        };
        let is_gemma = architecture.is_gemma();
        Ok(Self {
            architecture,
            vocab_size: size(
                required(raw.vocab_size, "vocab_size")?,
                "vocab_size",
                1 << 24,
            )?,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: positive_finite(raw.rms_norm_eps.unwrap_or(1e-6), "rms_norm_eps")?,
            rope,
            max_position_embeddings: size(
                raw.max_position_embeddings.unwrap_or(4096),
                "max_position_embeddings",
                1 << 30,
            )?,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias: architecture == Architecture::Llama && raw.mlp_bias.unwrap_or(false),
            qk_norm: matches!(
                architecture,
                Architecture::Qwen3
                    | Architecture::Qwen3Moe
                    | Architecture::Gemma3
                    | Architecture::Gemma3Multimodal
            ),
            sliding_window,
            sliding_layers,
            hidden_act,
            moe,
            query_pre_attn_scalar: if is_gemma {
                optional_f64(&root, "query_pre_attn_scalar")?
            } else {
                None
            },
            attn_logit_softcapping: if architecture == Architecture::Gemma2 {
                optional_f64(&root, "attn_logit_softcapping")?
            } else {
                None
            },
            final_logit_softcapping: if is_gemma {
                optional_f64(&root, "final_logit_softcapping")?
            } else {
                None
            },
            checkpoint_dtype: raw
                .dtype
                .or(raw.torch_dtype)
                .unwrap_or_else(|| "float32".into()),
            bos_token_id: token_ids(raw.bos_token_id.as_ref()).first().copied(),
            eos_token_ids: token_ids(raw.eos_token_id.as_ref()),
            quantization_config: raw.quantization_config,
        })
    }

    /// The sliding window of decoder layer `layer`, if it has one.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        match &self.sliding_layers {
            Some(s) if !s.sliding[layer] => None,
            _ => self.sliding_window,
        }
    }

    /// The attention-score scale.
    pub fn attention_scale(&self) -> f64 {
        1.0 / self
            .query_pre_attn_scalar
            .unwrap_or(self.head_dim as f64)
            .sqrt()
    }

    /// Whether decoder layer `layer` has a mixture-of-experts feed-forward.
    pub fn is_sparse_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.sparse_layers[layer])
    }
}

/// Gemma's `layer_types` (`sliding_attention` / `full_attention`); without it, the pattern
/// transformers derives: Gemma 2 alternates from a sliding layer 0, Gemma 3 slides except every
/// `sliding_window_pattern`-th layer. (Gemma 3 configs written by transformers 5 also carry a
/// stale `_sliding_window_pattern`, which transformers itself ignores when `layer_types` is set.)
fn gemma_layer_types(
    root: &Value,
    architecture: Architecture,
    num_layers: usize,
    local_rope: Option<Rope>,
) -> Result<SlidingLayers, LoadError> {
    let sliding = match root.get("layer_types") {
        Some(Value::Array(types)) => {
            if types.len() != num_layers {
                return Err(LoadError::config(
                    "layer_types",
                    format!("{} entries for {num_layers} layers", types.len()),
                ));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(LoadError::config(
                        "layer_types",
                        format!(
                            "{t} is not supported (supported: sliding_attention, full_attention)"
                        ),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?
        }
        Some(Value::Null) | None => {
            let pattern = if architecture == Architecture::Gemma2 {
                2
            } else {
                root.get("sliding_window_pattern")
                    .and_then(Value::as_u64)
                    .filter(|&p| p > 0)
                    .ok_or_else(|| {
                        LoadError::config("sliding_window_pattern", "must be a positive integer")
                    })? as usize
            };
            (0..num_layers).map(|i| (i + 1) % pattern != 0).collect()
        }
        Some(other) => {
            return Err(LoadError::config(
                "layer_types",
                format!("{other} is not a list"),
            ))
        }
    };
    if sliding.iter().any(|&s| s) && !root.get("sliding_window").is_some_and(Value::is_u64) {
        return Err(LoadError::config(
            "sliding_window",
            "sliding layers need a positive integer window",
        ));
    }
    Ok(SlidingLayers {
        sliding,
        local_rope,
    })
}

/// Gemma's RoPE: one schedule for every layer (Gemma 2), or a global one and a local one for the
/// sliding layers (Gemma 3: `rope_parameters.{full,sliding}_attention` in transformers 5;
/// `rope_theta` + `rope_scaling` for the global and `rope_local_base_freq` in 4.x files).
fn parse_gemma_rope(
    root: &Value,
    architecture: Architecture,
) -> Result<(Rope, Option<Rope>), LoadError> {
    let params = root.get("rope_parameters").filter(|p| !p.is_null());
    let v4_scaling = root.get("rope_scaling").cloned();
    let theta = root.get("rope_theta").and_then(Value::as_f64);
    if architecture == Architecture::Gemma2 {
        return Ok((
            parse_rope(&params.cloned(), &v4_scaling, theta, root)?,
            None,
        ));
    }
    let (global, local) = match params {
        Some(p) if p.get("full_attention").is_some() => (
            parse_rope(&p.get("full_attention").cloned(), &None, None, root)?,
            parse_rope(&p.get("sliding_attention").cloned(), &None, None, root)?,
        ),
        _ => {
            let global = parse_rope(&params.cloned(), &v4_scaling, theta, root)?;
            let local_theta = root.get("rope_local_base_freq").and_then(Value::as_f64);
            (global, parse_rope(&None, &None, local_theta, root)?)
        }
    };
    Ok((global, Some(local)))
}

/// The experts of Qwen3-MoE (`num_experts`, `moe_intermediate_size`, `decoder_sparse_step`,
/// `mlp_only_layers`, `norm_topk_prob`) and Mixtral (`num_local_experts`, always renormalised).
fn parse_moe(
    root: &Value,
    architecture: Architecture,
    num_layers: usize,
) -> Result<Option<MoeConfig>, LoadError> {
    let usize_key = |key: &str| -> Result<Option<usize>, LoadError> {
        match root.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|v| Some(v as usize))
                .ok_or_else(|| LoadError::config(key, format!("{v} is not an integer"))),
        }
    };
    let (experts_key, inter_key) = match architecture {
        Architecture::Qwen3Moe => ("num_experts", "moe_intermediate_size"),
        Architecture::Mixtral => ("num_local_experts", "intermediate_size"),
        _ => return Ok(None),
    };
    // transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts` (its attribute map)
    let experts_key = match (architecture, root.get(experts_key)) {
        (Architecture::Qwen3Moe, None) => "num_local_experts",
        _ => experts_key,
    };
    let num_experts = size(
        required(usize_key(experts_key)?, experts_key)?,
        experts_key,
        1 << 12,
    )?;
    let top_k = size(
        required(usize_key("num_experts_per_tok")?, "num_experts_per_tok")?,
        "num_experts_per_tok",
        num_experts,
    )?;
    let inter = size(
        required(usize_key(inter_key)?, inter_key)?,
        inter_key,
        1 << 20,
    )?;
    let sparse_layers = if architecture == Architecture::Qwen3Moe {
        let step = size(
            usize_key("decoder_sparse_step")?.unwrap_or(1),
            "decoder_sparse_step",
            1 << 12,
        )?;
        let dense: Vec<usize> = match root.get("mlp_only_layers") {
            None | Some(Value::Null) => Vec::new(),
            Some(v) => serde_json::from_value(v.clone()).map_err(|_| {
                LoadError::config(
                    "mlp_only_layers",
                    format!("{v} is not a list of layer indices"),
                )
            })?,
        };
        (0..num_layers)
            .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
            .collect()
    } else {
        vec![true; num_layers]
    };
    let norm_topk_prob = match architecture {
        Architecture::Mixtral => true,
        _ => root
            .get("norm_topk_prob")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    };
    Ok(Some(MoeConfig {
        num_experts,
        experts_per_token: top_k,
        expert_intermediate_size: inter,
        norm_topk_prob,
        sparse_layers,
        mixtral_names: architecture == Architecture::Mixtral,
        weights_in_compute_dtype: architecture == Architecture::Qwen3Moe,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const V5: &str = r#"{"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":8,
        "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,
        "rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,"low_freq_factor":1.0,
        "high_freq_factor":4.0,"original_max_position_embeddings":8192},"dtype":"bfloat16","eos_token_id":[3,4]}"#;
    const V4: &str = r#"{"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":8,
        "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,
        "rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
        "high_freq_factor":4.0,"original_max_position_embeddings":8192},"torch_dtype":"bfloat16","eos_token_id":3}"#;

    fn rope(theta: f64, scaling: RopeScaling) -> Rope {
        Rope { theta, scaling }
    }

    #[test]
    fn v4_and_v5_styles_agree() {
        let a = ModelConfig::from_json(V5).unwrap();
        let b = ModelConfig::from_json(V4).unwrap();
        assert_eq!(a.rope, b.rope);
        assert_eq!(a.rope.theta, 500000.0);
        assert_eq!(a.checkpoint_dtype, "bfloat16");
        assert_eq!(b.checkpoint_dtype, "bfloat16");
        assert_eq!(a.eos_token_ids, vec![3, 4]);
        assert_eq!(b.eos_token_ids, vec![3]);
        assert_eq!(a.head_dim, 4);
    }

    #[test]
    fn unknown_rope_type_is_refused_with_field() {
        let text = V4.replace("\"rope_type\":\"llama3\"", "\"rope_type\":\"longrope\"");
        let err = ModelConfig::from_json(&text).unwrap_err().to_string();
        assert!(
            err.contains("rope_scaling.rope_type") && err.contains("longrope"),
            "{err}"
        );
    }

    #[test]
    fn schedules_that_need_a_context_name_what_is_missing() {
        let yarn = |params: &str| {
            V5.replace(
                r#""rope_type":"llama3","rope_theta":500000.0,"factor":8.0,"low_freq_factor":1.0,
        "high_freq_factor":4.0,"original_max_position_embeddings":8192"#,
                params,
            )
        };
        for (params, field) in [
            (
                r#""rope_type":"yarn","rope_theta":1e4,"original_max_position_embeddings":64"#,
                "rope_parameters.factor",
            ),
            (
                r#""rope_type":"yarn","rope_theta":1e4,"factor":2,"original_max_position_embeddings":64,
                "attention_factor":0"#,
                "rope_parameters.attention_factor",
            ),
        ] {
            let text = yarn(params);
            assert!(text.contains(params), "{text}");
            let err = ModelConfig::from_json(&text).unwrap_err().to_string();
            assert!(err.starts_with(&format!("config field `{field}`")), "{err}");
        }
        let c = ModelConfig::from_json(&yarn(
            r#""rope_type":"yarn","rope_theta":1e4,"factor":2,"original_max_position_embeddings":64"#,
        ))
        .unwrap();
        assert_eq!(c.rope.attention_factor(), (0.1 * 2f64.ln() + 1.0) as f32);
        // Without a context anywhere, LlamaConfig's default 2048 is the original one.
        let c = ModelConfig::from_json(&yarn(r#""rope_type":"yarn","rope_theta":1e4,"factor":2"#))
            .unwrap();
        let RopeScaling::Yarn {
            original_max_position_embeddings,
            ..
        } = c.rope.scaling
        else {
            panic!("{:?}", c.rope)
        };
        assert_eq!(
            (original_max_position_embeddings, c.max_position_embeddings),
            (2048.0, 2048)
        );
    }

    #[test]
    fn mistral3_reads_its_text_config_and_refuses_other_text_models() {
        let text = r#"{"architectures":["Mistral3ForConditionalGeneration"],"text_config":
            {"model_type":"mistral","vocab_size":10,"hidden_size":32,"intermediate_size":16,
            "num_hidden_layers":1,"num_attention_heads":8,"rope_theta":1e9,
            "tie_word_embeddings":false}}"#;
        let c = ModelConfig::from_json(text).unwrap();
        assert_eq!(c.architecture, Architecture::Mistral3Multimodal);
        // MistralConfig's defaults (window, 8 KV heads); the top-level tie flag governs.
        assert_eq!((c.sliding_window, c.num_kv_heads), (Some(4096), 8));
        assert!(c.tie_word_embeddings);
        assert_eq!(c.rope.theta, 1e9);
        let err = ModelConfig::from_json(&text.replace("\"mistral\"", "\"ministral3\""))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("text_config.model_type") && err.contains("ministral3"),
            "{err}"
        );
    }

    #[test]
    fn unsupported_architecture_is_refused() {
        let text = V4.replace("LlamaForCausalLM", "GPT2LMHeadModel");
        let err = ModelConfig::from_json(&text).unwrap_err().to_string();
        assert!(
            err.contains("architectures") && err.contains("GPT2LMHeadModel"),
            "{err}"
        );
    }

    #[test]
    fn negative_or_fractional_sizes_name_their_field() {
        for (from, to, field) in [
            (
                r#""num_hidden_layers":1"#,
                r#""num_hidden_layers":-1"#,
                "num_hidden_layers",
            ),
            (r#""hidden_size":8"#, r#""hidden_size":8.5"#, "hidden_size"),
            (r#""vocab_size":10"#, r#""vocab_size":"10""#, "vocab_size"),
        ] {
            let err = ModelConfig::from_json(&V4.replace(from, to))
                .unwrap_err()
                .to_string();
            assert!(err.starts_with(&format!("config field `{field}`")), "{err}");
        }
    }

    #[test]
    fn old_type_key_and_plain_theta() {
        let text = r#"{"architectures":["MistralForCausalLM"],"vocab_size":10,"hidden_size":8,
        "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,"rope_theta":10000.0,
        "rope_scaling":null,"sliding_window":4096,"num_key_value_heads":null}"#;
        let c = ModelConfig::from_json(text).unwrap();
        assert_eq!(c.rope.scaling, RopeScaling::Default);
        // An explicit null is transformers' "as many as the query heads".
        assert_eq!(c.num_kv_heads, 2);
        assert_eq!(c.sliding_window, Some(4096));
    }
    const GEMMA3: &str = r#"{"architectures":["Gemma3ForCausalLM"],"vocab_size":10,"hidden_size":8,
        "intermediate_size":16,"num_hidden_layers":3,"num_attention_heads":2,"num_key_value_heads":1,
        "head_dim":4,"sliding_window":2,"_sliding_window_pattern":6,"query_pre_attn_scalar":48,
        "layer_types":["sliding_attention","full_attention","sliding_attention"],
        "rope_parameters":{"full_attention":{"rope_type":"linear","factor":8.0,"rope_theta":1000000.0},
        "sliding_attention":{"rope_type":"default","rope_theta":10000.0}}}"#;

    #[test]
    fn unsupported_architecture_lists_the_supported_ones() {
        let err = ModelConfig::from_json(&V4.replace("LlamaForCausalLM", "DeepseekV3ForCausalLM"))
            .unwrap_err()
            .to_string();
        for name in [
            "DeepseekV3ForCausalLM",
            "Qwen3MoeForCausalLM",
            "Gemma2ForCausalLM",
        ] {
            assert!(err.contains(name), "{err}");
        }
    }

    #[test]
    fn gemma3_layer_types_win_over_the_stale_pattern() {
        let c = ModelConfig::from_json(GEMMA3).unwrap();
        let s = c.sliding_layers.as_ref().unwrap();
        assert_eq!(s.sliding, vec![true, false, true]);
        assert_eq!(s.local_rope, Some(rope(10000.0, RopeScaling::Default)));
        assert_eq!(c.rope, rope(1000000.0, RopeScaling::Linear { factor: 8.0 }));
        assert_eq!((c.layer_window(0), c.layer_window(1)), (Some(2), None));
        assert_eq!(c.attention_scale(), 1.0 / 48f64.sqrt());
        assert_eq!(c.hidden_act, Activation::GeluTanh);
        assert!(c.qk_norm && c.tie_word_embeddings);
    }

    #[test]
    fn gemma3_v4_style_without_layer_types_uses_the_pattern() {
        let text = r#"{"architectures":["Gemma3ForConditionalGeneration"],"eos_token_id":[1,106],
            "text_config":{"hidden_size":8,"intermediate_size":16,"num_hidden_layers":7,
            "num_attention_heads":2,"num_key_value_heads":1,"head_dim":4,"sliding_window":1024,
            "rope_scaling":{"factor":8.0,"rope_type":"linear"},"query_pre_attn_scalar":168}}"#;
        let c = ModelConfig::from_json(text).unwrap();
        assert_eq!(c.architecture, Architecture::Gemma3Multimodal);
        let s = c.sliding_layers.unwrap();
        assert_eq!(s.sliding, vec![true, true, true, true, true, false, true]);
        assert_eq!(s.local_rope, Some(rope(10000.0, RopeScaling::Default)));
        assert_eq!(c.rope.scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!(c.vocab_size, 262208);
        assert_eq!(c.eos_token_ids, vec![1, 106]);
    }

    #[test]
    fn gemma2_softcaps_default_as_transformers_does() {
        let text = r#"{"architectures":["Gemma2ForCausalLM"],"vocab_size":10,"hidden_size":8,
            "intermediate_size":16,"num_hidden_layers":2,"num_attention_heads":2,"head_dim":4}"#;
        let c = ModelConfig::from_json(text).unwrap();
        assert_eq!(c.attn_logit_softcapping, Some(50.0));
        assert_eq!(c.final_logit_softcapping, Some(30.0));
        assert_eq!(c.sliding_layers.unwrap().sliding, vec![true, false]);
        let off = text.replace(
            "\"head_dim\":4",
            "\"head_dim\":4,\"final_logit_softcapping\":null",
        );
        assert_eq!(
            ModelConfig::from_json(&off)
                .unwrap()
                .final_logit_softcapping,
            None
        );
    }

    #[test]
    fn math_changing_keys_are_refused_by_name() {
        for (text, key) in [
            (
                V4.replace(
                    "\"torch_dtype\"",
                    "\"partial_rotary_factor\":0.5,\"torch_dtype\"",
                ),
                "partial_rotary_factor",
            ),
            (
                V4.replace(
                    "\"torch_dtype\"",
                    "\"final_logit_softcapping\":30.0,\"torch_dtype\"",
                ),
                "final_logit_softcapping",
            ),
            (
                GEMMA3.replace(
                    "\"sliding_window\"",
                    "\"attn_logit_softcapping\":50.0,\"sliding_window\"",
                ),
                "attn_logit_softcapping",
            ),
            (
                GEMMA3.replace(
                    "\"sliding_window\"",
                    "\"use_bidirectional_attention\":true,\"sliding_window\"",
                ),
                "use_bidirectional_attention",
            ),
            (
                GEMMA3.replace("\"rope_type\":\"linear\"", "\"rope_type\":\"longrope\""),
                "longrope",
            ),
            (
                GEMMA3.replace("\"full_attention\",", "\"chunked_attention\","),
                "chunked_attention",
            ),
        ] {
            let err = match ModelConfig::from_json(&text) {
                Ok(_) => panic!("{key} accepted: {text}"),
                Err(e) => e.to_string(),
            };
            assert!(err.contains(key), "{key}: {err}");
        }
    }

    #[test]
    fn qwen3_moe_sparse_layers() {
        let text = r#"{"architectures":["Qwen3MoeForCausalLM"],"vocab_size":10,"hidden_size":8,
            "intermediate_size":16,"num_hidden_layers":4,"num_attention_heads":2,"rope_theta":1e6,
            "num_key_value_heads":1,"num_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":4,"norm_topk_prob":true,
            "decoder_sparse_step":2,"mlp_only_layers":[3]}"#;
        let m = ModelConfig::from_json(text).unwrap().moe.unwrap();
        assert_eq!(m.sparse_layers, vec![false, true, false, false]);
        assert!(m.norm_topk_prob && m.weights_in_compute_dtype && !m.mixtral_names);
        let bad = text.replace("\"num_experts_per_tok\":2", "\"num_experts_per_tok\":9");
        let err = ModelConfig::from_json(&bad).unwrap_err().to_string();
        assert!(err.contains("num_experts_per_tok"), "{err}");
    }
}
