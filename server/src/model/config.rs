//! `config.json` of a Hugging Face causal LM, in both key styles: transformers v4
//! (`rope_theta` + `rope_scaling`, `torch_dtype`) and v5 (`rope_parameters`, `dtype`).
//!
//! This file holds what every architecture shares: the [`ModelConfig`] the blocks read, the keys
//! every architecture reads (`SharedKeys`), the range checks, and the order in which
//! [`ModelConfig::from_json`] reads a file. What one architecture knows (transformers' defaults,
//! the keys it refuses, its RoPE, sliding layers, experts and biases) is an
//! `ArchitectureConfig` in its own file below. A new architecture is one such file, its `mod`
//! line here and one line in the registry (`architecture.rs`).

mod architecture;
mod gemma2;
mod gemma3;
mod llama;
mod mistral;
mod mistral3;
mod mixtral;
mod qwen2;
mod qwen3;
mod qwen3_moe;
mod rope_parameters;
#[cfg(test)]
mod tests;
mod vision_language;

use serde::Deserialize;
use serde_json::Value;

pub use super::rope::{Rope, RopeScaling};
use crate::checkpoint::LoadError;
use architecture::ArchitectureConfig;
pub use architecture::{Architecture, DecoderFamily};

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

/// Which Linears of a decoder layer carry a bias.
struct ProjectionBiases {
    qkv: bool,
    o: bool,
    mlp: bool,
}

impl ProjectionBiases {
    /// q/k/v and o_proj as `attention_bias` says (absent: none), the MLP without.
    fn attention_bias(keys: &SharedKeys) -> Self {
        let attention_bias = keys.attention_bias.unwrap_or(false);
        Self {
            qkv: attention_bias,
            o: attention_bias,
            mlp: false,
        }
    }

    /// transformers' Mistral and Mixtral build no bias whatever the config says.
    const NONE: Self = Self {
        qkv: false,
        o: false,
        mlp: false,
    };
}

/// Gemma's changes to the attention and final scores; none elsewhere.
#[derive(Default)]
struct ScoreShaping {
    query_pre_attn_scalar: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    final_logit_softcapping: Option<f64>,
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

/// The keys every architecture reads, type-checked for all of them (`mlp_bias` and
/// `use_sliding_window` too, which only some use); an architecture reads its other keys from
/// the file as it is. Everything else in config.json is ignored.
#[derive(Deserialize)]
struct SharedKeys {
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

impl SharedKeys {
    /// The keys of `root`; an error names the member of a wrong type (`num_hidden_layers: -1`
    /// is not a size).
    fn read(root: &Value) -> Result<Self, LoadError> {
        serde_path_to_error::deserialize(root.clone()).map_err(|e| {
            let field = match e.path().to_string() {
                path if path == "." => "config.json".to_string(),
                path => path,
            };
            LoadError::config(field, e.into_inner().to_string())
        })
    }
}

/// The attention's dimensions and the depth.
struct Dimensions {
    hidden_size: usize,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    num_layers: usize,
}

impl Dimensions {
    fn read(keys: &SharedKeys) -> Result<Self, LoadError> {
        let hidden_size = required_size(keys.hidden_size, "hidden_size", 1 << 17)?;
        let num_heads = required_size(keys.num_attention_heads, "num_attention_heads", 1 << 12)?;
        let num_kv_heads = keys.num_key_value_heads.unwrap_or(num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(LoadError::config(
                "num_key_value_heads",
                format!("{num_kv_heads} must divide num_attention_heads = {num_heads}"),
            ));
        }
        // Without `head_dim` the heads split the hidden size: a remainder would be dropped.
        if keys.head_dim.is_none() && !hidden_size.is_multiple_of(num_heads) {
            return Err(LoadError::config(
                "num_attention_heads",
                format!(
                    "{num_heads} does not divide hidden_size = {hidden_size} (and no head_dim \
                     is given)"
                ),
            ));
        }
        let head_dim = size(
            keys.head_dim.unwrap_or(hidden_size / num_heads),
            "head_dim",
            1 << 12,
        )?;
        if !head_dim.is_multiple_of(2) {
            return Err(LoadError::config(
                "head_dim",
                format!("{head_dim} must be even"),
            ));
        }
        let num_layers = required_size(keys.num_hidden_layers, "num_hidden_layers", 1 << 12)?;
        Ok(Self {
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
            num_layers,
        })
    }
}

fn required<T>(value: Option<T>, field: &str) -> Result<T, LoadError> {
    value.ok_or_else(|| LoadError::config(field, "missing"))
}

/// A [`size`] the config must give.
fn required_size(value: Option<usize>, field: &str, max: usize) -> Result<usize, LoadError> {
    size(required(value, field)?, field, max)
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

/// An integer key; `None` when absent or `null`.
fn optional_usize(root: &Value, key: &str) -> Result<Option<usize>, LoadError> {
    match root.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|v| Some(v as usize))
            .ok_or_else(|| LoadError::config(key, format!("{v} is not an integer"))),
    }
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

/// Gemma's logit soft-capping keys, refused by the architectures that do not apply them.
const SOFTCAPPING_KEYS: [&str; 2] = ["attn_logit_softcapping", "final_logit_softcapping"];

/// Those of `keys` that `root` sets to something other than `null` or `false`.
fn keys_set(root: &Value, keys: &[&'static str]) -> Vec<&'static str> {
    let set = |key: &str| root.get(key).is_some_and(|v| !v.is_null() && v != false);
    keys.iter().copied().filter(|k| set(k)).collect()
}

/// Keys that change the math in ways we do not implement: refused rather than ignored.
fn refuse_unimplemented(root: &Value, architecture: Architecture) -> Result<(), LoadError> {
    let partial_rotary = root
        .get("partial_rotary_factor")
        .and_then(Value::as_f64)
        .is_some_and(|f| f != 1.0);
    let refused: Vec<&str> = partial_rotary
        .then_some("partial_rotary_factor")
        .into_iter()
        .chain(architecture.config().unimplemented_keys(root))
        .collect();
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

/// The gate activation `name` (`silu` when absent), one of `supported`; `field` is the key that
/// an error names.
fn gate_activation(
    architecture: &str,
    field: &str,
    name: Option<&str>,
    supported: &[(&str, Activation)],
) -> Result<Activation, LoadError> {
    let name = name.unwrap_or("silu");
    supported
        .iter()
        .find(|(n, _)| *n == name)
        .map(|&(_, act)| act)
        .ok_or_else(|| {
            let names: Vec<&str> = supported.iter().map(|(n, _)| *n).collect();
            LoadError::config(
                field,
                format!(
                    "`{name}` is not supported for {architecture} (supported: {})",
                    names.join(", ")
                ),
            )
        })
}

/// Each parameter in its range can still combine into a frequency that is not (a theta near
/// the smallest f32 gives infinite ones, YaRN's betas at or below 0 NaN).
fn check_frequencies<'a>(
    ropes: impl IntoIterator<Item = &'a Rope>,
    head_dim: usize,
) -> Result<(), LoadError> {
    for r in ropes {
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
    Ok(())
}

/// The file's `sliding_window`. A window of 0 would leave a token nothing to attend to (a
/// softmax over nothing).
fn window_value(keys: &SharedKeys) -> Result<Option<usize>, LoadError> {
    match &keys.sliding_window {
        None | Some(Value::Null) => Ok(None),
        Some(v) => Ok(Some(size(
            v.as_u64().map_or(0, |v| v as usize),
            "sliding_window",
            1 << 30,
        )?)),
    }
}

/// The text model's keys with transformers' defaults under whatever the file says.
fn text_keys(root: Value, config: &dyn ArchitectureConfig) -> Result<Value, LoadError> {
    let mut merged = config.transformers_defaults();
    for (k, v) in config.text_config(root)?.as_object().into_iter().flatten() {
        merged[k.as_str()] = v.clone();
    }
    Ok(merged)
}

impl ModelConfig {
    pub fn from_json(text: &str) -> Result<Self, LoadError> {
        let root: Value = serde_json::from_str(text)
            .map_err(|e| LoadError::config("config.json", e.to_string()))?;
        let architecture = Architecture::of(&root)?;
        let root = text_keys(root, architecture.config())?;
        refuse_unimplemented(&root, architecture)?;
        Self::read(architecture, &root)
    }

    /// The config of `architecture` from its text model's keys `root` (defaults included).
    fn read(architecture: Architecture, root: &Value) -> Result<Self, LoadError> {
        let arch = architecture.config();
        let keys = SharedKeys::read(root)?;
        let hidden_act = arch.activation(&keys)?;
        let dims = Dimensions::read(&keys)?;
        let (rope, local_rope) = arch.rope(root, &keys)?;
        check_frequencies(std::iter::once(&rope).chain(&local_rope), dims.head_dim)?;
        let sliding_window = arch.sliding_window(window_value(&keys)?, &keys);
        let sliding_layers = arch.sliding_layers(root, dims.num_layers, local_rope)?;
        let intermediate_size =
            required_size(keys.intermediate_size, "intermediate_size", 1 << 20)?;
        let moe = arch.moe(root, dims.num_layers)?;
        let biases = arch.biases(&keys);
        let vocab_size = required_size(keys.vocab_size, "vocab_size", 1 << 24)?;
        let rms_norm_eps = positive_finite(keys.rms_norm_eps.unwrap_or(1e-6), "rms_norm_eps")?;
        let max_position_embeddings = size(
            keys.max_position_embeddings.unwrap_or(4096),
            "max_position_embeddings",
            1 << 30,
        )?;
        let scores = arch.score_shaping(root)?;
        Ok(Self {
            architecture,
            vocab_size,
            hidden_size: dims.hidden_size,
            intermediate_size,
            num_layers: dims.num_layers,
            num_heads: dims.num_heads,
            num_kv_heads: dims.num_kv_heads,
            head_dim: dims.head_dim,
            rms_norm_eps,
            rope,
            max_position_embeddings,
            tie_word_embeddings: keys.tie_word_embeddings.unwrap_or(false),
            qkv_bias: biases.qkv,
            o_bias: biases.o,
            mlp_bias: biases.mlp,
            qk_norm: arch.qk_norm(),
            sliding_window,
            sliding_layers,
            hidden_act,
            moe,
            query_pre_attn_scalar: scores.query_pre_attn_scalar,
            attn_logit_softcapping: scores.attn_logit_softcapping,
            final_logit_softcapping: scores.final_logit_softcapping,
            checkpoint_dtype: keys
                .dtype
                .or(keys.torch_dtype)
                .unwrap_or_else(|| "float32".into()),
            bos_token_id: token_ids(keys.bos_token_id.as_ref()).first().copied(),
            eos_token_ids: token_ids(keys.eos_token_id.as_ref()),
            quantization_config: keys.quantization_config,
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

/// The experts' counts and sizes (`experts_key`, `num_experts_per_tok`, `inter_key`) of a
/// mixture sparse in every layer, with neither Mixtral's names nor Qwen's weighting: each
/// architecture changes what its mixture does otherwise.
fn experts(
    root: &Value,
    experts_key: &str,
    inter_key: &str,
    num_layers: usize,
) -> Result<MoeConfig, LoadError> {
    let num_experts = required_size(optional_usize(root, experts_key)?, experts_key, 1 << 12)?;
    let experts_per_token = required_size(
        optional_usize(root, "num_experts_per_tok")?,
        "num_experts_per_tok",
        num_experts,
    )?;
    let expert_intermediate_size =
        required_size(optional_usize(root, inter_key)?, inter_key, 1 << 20)?;
    Ok(MoeConfig {
        num_experts,
        experts_per_token,
        expert_intermediate_size,
        norm_topk_prob: false,
        sparse_layers: vec![true; num_layers],
        mixtral_names: false,
        weights_in_compute_dtype: false,
    })
}
