//! `config.json` of a Hugging Face causal LM, in both key styles: transformers v4
//! (`rope_theta` + `rope_scaling`, `torch_dtype`) and v5 (`rope_parameters`, `dtype`).
//!
//! This file holds the [`ModelConfig`] the blocks read and the order in which
//! [`ModelConfig::from_json`] reads a file, asking the architecture at each step. Below it, in
//! import order: `shared.rs` (the keys every architecture reads, the range checks, the parts an
//! architecture reads itself), `rope_parameters.rs`, `architecture.rs` (what an architecture
//! brings: the `ArchitectureConfig` trait), one file per architecture (transformers' defaults,
//! the keys it refuses, its RoPE, sliding layers, experts and biases), and `registry.rs`. A new
//! architecture is one such file, its `mod` line here and one line in the registry.
mod architecture;
mod deepseek_v2;
mod deepseek_v3;
mod gemma2;
mod gemma3;
mod gemma4;
mod glm4_moe;
mod glm4_moe_lite;
mod gpt_oss;
mod llama;
mod mistral;
mod mistral3;
mod mistral4;
mod mixtral;
mod qwen2;
mod qwen3;
mod qwen3_5;
mod qwen3_5_moe;
mod qwen3_moe;
mod qwen3_next;
mod registry;
mod rope_parameters;
mod shared;
#[cfg(test)]
mod tests;
mod vision_language;

use serde_json::Value;

pub use super::rope::{Rope, RopeScaling};
use crate::checkpoint::LoadError;
use architecture::ArchitectureConfig;
pub use architecture::DecoderFamily;
pub use gemma4::{Gemma4Layer, Gemma4Moe, Gemma4Text, KeySource};
pub use registry::Architecture;
use shared::{positive_finite, required_size, size, SharedKeys};
pub use shared::{
    Activation, GroupScore, LinearAttentionConfig, Llama4QueryScaling, MlaConfig, MoeConfig,
    MoeRouter, SlidingLayers,
};

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
    /// The leading dimensions of each head that RoPE rotates (`head_dim`, or
    /// `int(head_dim * partial_rotary_factor)` where the architecture reads it); the others
    /// pass through.
    pub rotary_dim: usize,
    /// q_proj yields `[query; gate]` per head and the attention output is multiplied by
    /// `sigmoid(gate)` before o_proj (Qwen3-Next, Qwen3.5).
    pub attn_output_gate: bool,
    /// The Gated DeltaNet layers of a hybrid model (Qwen3-Next, Qwen3.5).
    pub linear_attention: Option<LinearAttentionConfig>,
    /// Multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash): `head_dim` is then the
    /// query/key head (`qk_nope_head_dim + qk_rope_head_dim`) and `rotary_dim` its rotary part.
    pub mla: Option<MlaConfig>,
    /// Gemma 4's per-layer heads, KV sharing, per-layer inputs and mixture: `rope` is then the
    /// full layers' and `rotary_dim` their head size.
    pub gemma4: Option<Gemma4Text>,
    /// Multi-token-prediction layers after the last decoder layer, never read.
    pub mtp_layers: usize,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (always in Qwen2; `attention_bias` where the
    /// architecture reads it).
    pub qkv_bias: bool,
    /// o_proj carries a bias (`attention_bias` in Llama, Qwen3 and Gemma; never in Qwen2).
    pub o_bias: bool,
    /// The dense MLP's and shared experts' projections carry a bias (`mlp_bias`, read by Llama
    /// and DeepSeek-V2 only; routed experts never do).
    pub mlp_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// One learned logit per head joins every attention row's softmax (gpt-oss's
    /// `self_attn.sinks`).
    pub attention_sinks: bool,
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

/// Keys that change the math in ways we do not implement: refused rather than ignored.
fn refuse_unimplemented(root: &Value, architecture: Architecture) -> Result<(), LoadError> {
    let partial_rotary = architecture.config().partial_rotary_default().is_none()
        && root
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

/// Each parameter in its range can still combine into a frequency that is not (a theta near
/// the smallest f32 gives infinite ones, YaRN's betas at or below 0 NaN).
fn check_frequencies<'a>(
    ropes: impl IntoIterator<Item = &'a Rope>,
    head_dim: usize,
) -> Result<(), LoadError> {
    for r in ropes {
        // Gemma 4's proportional RoPE leaves the pairs after the rotated ones at frequency 0.
        if let Some(f) = r
            .inv_freq(head_dim)
            .into_iter()
            .take(r.rotated_pairs(head_dim))
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
    /// The head size attention runs at: `head_dim`, or under latent attention the query/key
    /// size and the value size zero-padded to the smallest flash head size that holds both
    /// ([`crate::ops::flash_head_dim_holding`]; their own larger size where none does).
    pub fn attention_head_dim(&self) -> usize {
        let padded = |dim: usize| crate::ops::flash_head_dim_holding(dim).unwrap_or(dim);
        match (&self.mla, &self.gemma4) {
            (Some(mla), _) => padded(self.head_dim.max(mla.v_head_dim)),
            // Gemma 4: the sliding layers' heads; its wider global layers attend materialized
            (None, Some(g)) => padded(g.sliding_head_dim),
            (None, None) => self.head_dim,
        }
    }

    /// Whether the flash kernel of [`Self::attention_head_dim`], when chosen, serves a layer
    /// with heads of `head_dim` (zero-padded to its size): every layer but Gemma 4's global ones
    /// when their heads are wider (512) than the sliding layers'.
    pub fn flash_serves_heads(&self, head_dim: usize) -> bool {
        match &self.gemma4 {
            Some(_) => {
                crate::ops::flash_head_dim_holding(head_dim) == Some(self.attention_head_dim())
            }
            None => true,
        }
    }

    /// Whether flash attention, when chosen, serves every decoder layer (no layer then
    /// materializes its `[T, T]` scores: the memory plans ask this).
    pub fn flash_serves_every_layer(&self) -> bool {
        self.gemma4
            .as_ref()
            .is_none_or(|g| g.layers.iter().all(|l| self.flash_serves_heads(l.head_dim)))
    }

    /// Whether this architecture can attend through the flash kernel at all (it still needs a
    /// GPU, bf16/f16 and a head size the kernel has, `ops::flash_attention_available`): not
    /// with soft-capped scores (Gemma 2: the kernel has no soft-cap) nor attention sinks
    /// (gpt-oss: nor sinks), which attend materialized. Gemma 4 attends flash in the layers
    /// [`Self::flash_serves_heads`] admits. The model's kernel choice and the memory plans
    /// both ask this.
    pub fn flash_attention_possible(&self) -> bool {
        self.attn_logit_softcapping.is_none() && !self.attention_sinks
    }

    /// The config.json of the checkpoint directory `dir`; where it has no
    /// `quantization_config`, an older ModelOpt export's `hf_quant_config.json` is that.
    pub fn from_dir(dir: &std::path::Path) -> Result<Self, LoadError> {
        use crate::checkpoint::read_to_string;
        let mut config = Self::from_json(&read_to_string(&dir.join("config.json"))?)?;
        let legacy = dir.join(crate::quant::modelopt::LEGACY_CONFIG);
        if config.quantization_config.is_none() && legacy.is_file() {
            let raw = serde_json::from_str(&read_to_string(&legacy)?).map_err(|e| {
                LoadError::config(crate::quant::modelopt::LEGACY_CONFIG, e.to_string())
            })?;
            config.quantization_config = Some(raw);
        }
        Ok(config)
    }

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
        let mut keys = SharedKeys::read(root)?;
        let hidden_act = arch.activation(&keys)?;
        let (rope, local_rope) = arch.rope(root, &keys)?;
        let mla = arch.mla(root, &rope)?;
        if let Some(m) = &mla {
            // Attention heads are query/key heads; the config's `head_dim` is the rotary part.
            keys.head_dim = Some(m.qk_nope_head_dim + m.qk_rope_head_dim);
        }
        let dims = Dimensions::read(&keys)?;
        if mla.is_some() && dims.num_kv_heads != dims.num_heads {
            return Err(LoadError::config(
                "num_key_value_heads",
                format!(
                    "{} with multi-head latent attention (kv_b_proj yields one key and value per \
                     head: must equal num_attention_heads = {})",
                    dims.num_kv_heads, dims.num_heads
                ),
            ));
        }
        let rotary_dim = match (&mla, arch.partial_rotary_default()) {
            (Some(m), _) => m.qk_rope_head_dim,
            (None, Some(default)) => {
                rope_parameters::partial_rotary_dim(root, dims.head_dim, default)?
            }
            (None, None) => dims.head_dim,
        };
        check_frequencies(std::iter::once(&rope).chain(&local_rope), rotary_dim)?;
        let sliding_window = arch.sliding_window(window_value(&keys)?, &keys);
        let sliding_layers = arch.sliding_layers(root, dims.num_layers, local_rope)?;
        let moe = arch.moe(root, dims.num_layers)?;
        let all_sparse = moe
            .as_ref()
            .is_some_and(|m| m.sparse_layers.iter().all(|&s| s));
        // A model without a dense layer needs no dense width (Qwen3.5-MoE has none).
        let intermediate_size = match keys.intermediate_size {
            None if all_sparse => 0,
            v => required_size(v, "intermediate_size", 1 << 20)?,
        };
        let linear_attention = arch.linear_attention(root, dims.num_layers)?;
        let biases = arch.biases(&keys);
        let vocab_size = required_size(keys.vocab_size, "vocab_size", 1 << 24)?;
        let rms_norm_eps = positive_finite(keys.rms_norm_eps.unwrap_or(1e-6), "rms_norm_eps")?;
        let max_position_embeddings = size(
            keys.max_position_embeddings.unwrap_or(4096),
            "max_position_embeddings",
            1 << 30,
        )?;
        let scores = arch.score_shaping(root)?;
        let mut config = Self {
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
            rotary_dim,
            attn_output_gate: arch.attn_output_gate(),
            linear_attention,
            mla,
            mtp_layers: arch.mtp_layers(root)?,
            max_position_embeddings,
            tie_word_embeddings: keys.tie_word_embeddings.unwrap_or(false),
            qkv_bias: biases.qkv,
            o_bias: biases.o,
            mlp_bias: biases.mlp,
            qk_norm: arch.qk_norm(root),
            attention_sinks: arch.attention_sinks(),
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
            gemma4: None,
        };
        config.gemma4 = arch.gemma4(root, &config)?;
        if let Some(g) = &config.gemma4 {
            // The global RoPE tables are the full layers' (the last layer is always one).
            config.rotary_dim = g.layers[config.num_layers - 1].head_dim;
        }
        Ok(config)
    }

    /// The head sizes of the global and the local (sliding layers') RoPE tables.
    pub fn rope_table_dims(&self) -> (usize, usize) {
        let local = self
            .gemma4
            .as_ref()
            .map_or(self.rotary_dim, |g| g.sliding_head_dim);
        (self.rotary_dim, local)
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
        if let Some(m) = &self.mla {
            return m.softmax_scale;
        }
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
