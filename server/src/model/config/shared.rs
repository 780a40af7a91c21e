//! What every architecture's reading shares: the parts of a [`super::ModelConfig`] an
//! architecture reads itself (the [`Activation`] of `ops`, [`MoeConfig`], [`SlidingLayers`], the biases and
//! Gemma's score shaping), the keys every architecture reads (`SharedKeys`), and the range
//! checks on what a config.json says.

use serde::Deserialize;
use serde_json::Value;

use crate::checkpoint::LoadError;
use crate::model::rope::Rope;
pub use crate::ops::{Activation, GroupScore};
use crate::ops::{GroupedRouting, RouterScores};

/// A mixture-of-experts feed-forward (Qwen3-MoE, Mixtral, DeepSeek-V3).
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
    /// A shared expert of this width beside the routed ones (Qwen3-Next, Qwen3.5-MoE,
    /// DeepSeek-V3, GLM-4.5).
    pub shared_expert_intermediate_size: Option<usize>,
    /// Qwen's `shared_expert`, weighted by `sigmoid(shared_expert_gate(x))`; else DeepSeek's
    /// `shared_experts`, added with weight 1.
    pub shared_expert_gate: bool,
    /// How the router picks and weighs a token's experts.
    pub router: MoeRouter,
    /// gpt-oss's block: `mlp.router` with a bias, and experts with biases stored fused
    /// (`experts.gate_up_proj`, gate and up interleaved, bf16 or native MXFP4) whose gated
    /// activation is the clamped SwiGLU.
    pub gpt_oss_experts: bool,
}

/// A mixture-of-experts router.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MoeRouter {
    /// Softmax over the experts' logits, the top k (Qwen, Mixtral).
    Softmax,
    /// DeepSeek-V3's: logits and scores in f32, `sigmoid` scores; the choice adds
    /// `e_score_correction_bias` and keeps only the experts of the `topk_group` best of
    /// `n_group` groups (a group scores the sum of its two best); the weights are the chosen
    /// experts' scores without the bias, renormalised where `norm_topk_prob`, times
    /// `routed_scaling_factor`.
    SigmoidGrouped {
        n_group: usize,
        topk_group: usize,
        routed_scaling_factor: f64,
    },
    /// DeepSeek-V2's (`DeepseekV2TopkRouter`) and Mistral 4's (`Mistral4TopkRouter`): softmax
    /// scores; only the experts of the `topk_group` best of `n_group` groups (by
    /// `group_score`) are chosen, the others masked to 0.0; the weights are the chosen scores,
    /// renormalised where `norm_topk_prob`, times `routed_scaling_factor`. DeepSeek-V2 computes
    /// the logits and scores in f32, Mistral 4 in the compute dtype (`in_compute_dtype`).
    SoftmaxGrouped {
        n_group: usize,
        topk_group: usize,
        group_score: GroupScore,
        routed_scaling_factor: f64,
        in_compute_dtype: bool,
    },
}

impl MoeRouter {
    /// The group-limited routing of `k` experts a token, `None` for [`MoeRouter::Softmax`].
    pub fn grouped(&self, k: usize, norm: bool) -> Option<GroupedRouting> {
        let (n_group, topk_group, routed_scaling_factor, scores, group_score) = match *self {
            MoeRouter::Softmax => return None,
            MoeRouter::SigmoidGrouped {
                n_group,
                topk_group,
                routed_scaling_factor,
            } => (
                n_group,
                topk_group,
                routed_scaling_factor,
                RouterScores::Sigmoid,
                GroupScore::TopTwoSum,
            ),
            MoeRouter::SoftmaxGrouped {
                n_group,
                topk_group,
                group_score,
                routed_scaling_factor,
                ..
            } => (
                n_group,
                topk_group,
                routed_scaling_factor,
                RouterScores::Softmax,
                group_score,
            ),
        };
        Some(GroupedRouting {
            k,
            n_group,
            topk_group,
            norm,
            routed_scaling_factor,
            scores,
            group_score,
        })
    }
}

/// Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): q through an optional low-rank
/// `q_a_proj` → norm → `q_b_proj`, k and v from one shared latent (`kv_a_proj_with_mqa` →
/// norm → `kv_b_proj`) plus one rotary key part shared by every head.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaConfig {
    /// `None`: a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// DeepSeek's `rope_interleave`: the rotary dimensions pair up as `(x0, x1), (x2, x3), …`.
    pub rope_interleave: bool,
    /// The attention-score scale: `qk_head_dim ** -0.5`, times `mscale(factor,
    /// mscale_all_dim) ** 2` under YaRN.
    pub softmax_scale: f64,
    /// Mistral 4's position-dependent query scale.
    pub query_scaling: Option<Llama4QueryScaling>,
}

/// Llama 4's query scaling (`get_llama_4_attn_scale`, Mistral 4): the query of position `p`
/// times `1 + beta * log(1 + floor(p / original_max_position_embeddings))`, computed in f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama4QueryScaling {
    pub beta: f64,
    pub original_max_position_embeddings: f64,
}

impl Llama4QueryScaling {
    /// The scale of position `p`, as torch computes it in f32.
    pub fn scale(&self, p: usize) -> f32 {
        let blocks = (p as f32 / self.original_max_position_embeddings as f32).floor();
        1.0 + self.beta as f32 * (1.0 + blocks).ln()
    }
}

/// The Gated DeltaNet (linear-attention) layers of a hybrid model (Qwen3-Next, Qwen3.5).
#[derive(Debug, Clone, PartialEq)]
pub struct LinearAttentionConfig {
    /// Per layer: a Gated DeltaNet (`linear_attention`), else gated full attention.
    pub linear_layers: Vec<bool>,
    /// `linear_conv_kernel_dim`.
    pub conv_kernel: usize,
    /// `linear_num_key_heads`, `linear_num_value_heads` (a multiple of it).
    pub k_heads: usize,
    pub v_heads: usize,
    /// `linear_key_head_dim`, `linear_value_head_dim`.
    pub k_dim: usize,
    pub v_dim: usize,
    /// Qwen3-Next's `in_proj_qkvz` / `in_proj_ba`, grouped per key head; else Qwen3.5's
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    pub grouped_projections: bool,
}

/// Per-layer attention: which layers use the sliding window, and the RoPE of those layers
/// when it differs from the global one (Gemma 3's local base).
#[derive(Debug, Clone, PartialEq)]
pub struct SlidingLayers {
    pub sliding: Vec<bool>,
    pub local_rope: Option<Rope>,
}

/// Which Linears of a decoder layer carry a bias.
pub(super) struct ProjectionBiases {
    pub(super) qkv: bool,
    pub(super) o: bool,
    pub(super) mlp: bool,
}

impl ProjectionBiases {
    /// q/k/v and o_proj as `attention_bias` says (absent: none), the MLP without.
    pub(super) fn attention_bias(keys: &SharedKeys) -> Self {
        let attention_bias = keys.attention_bias.unwrap_or(false);
        Self {
            qkv: attention_bias,
            o: attention_bias,
            mlp: false,
        }
    }

    /// [`Self::attention_bias`], and the MLP as `mlp_bias` says (absent: none).
    pub(super) fn attention_and_mlp_bias(keys: &SharedKeys) -> Self {
        Self {
            mlp: keys.mlp_bias.unwrap_or(false),
            ..Self::attention_bias(keys)
        }
    }

    /// transformers' Mistral and Mixtral build no bias whatever the config says.
    pub(super) const NONE: Self = Self {
        qkv: false,
        o: false,
        mlp: false,
    };
}

/// Gemma's changes to the attention and final scores; none elsewhere.
#[derive(Default)]
pub(super) struct ScoreShaping {
    pub(super) query_pre_attn_scalar: Option<f64>,
    pub(super) attn_logit_softcapping: Option<f64>,
    pub(super) final_logit_softcapping: Option<f64>,
}

/// The keys every architecture reads, type-checked for all of them (`mlp_bias` and
/// `use_sliding_window` too, which only some use); an architecture reads its other keys from
/// the file as it is. Everything else in config.json is ignored.
#[derive(Deserialize)]
pub(super) struct SharedKeys {
    pub(super) vocab_size: Option<usize>,
    pub(super) hidden_size: Option<usize>,
    pub(super) intermediate_size: Option<usize>,
    pub(super) num_hidden_layers: Option<usize>,
    pub(super) num_attention_heads: Option<usize>,
    pub(super) num_key_value_heads: Option<usize>,
    pub(super) head_dim: Option<usize>,
    pub(super) rms_norm_eps: Option<f64>,
    pub(super) hidden_act: Option<String>,
    pub(super) hidden_activation: Option<String>,
    pub(super) rope_theta: Option<f64>,
    pub(super) rope_scaling: Option<Value>,
    pub(super) rope_parameters: Option<Value>,
    pub(super) max_position_embeddings: Option<usize>,
    pub(super) tie_word_embeddings: Option<bool>,
    pub(super) attention_bias: Option<bool>,
    pub(super) mlp_bias: Option<bool>,
    pub(super) sliding_window: Option<Value>,
    pub(super) use_sliding_window: Option<bool>,
    pub(super) torch_dtype: Option<String>,
    pub(super) dtype: Option<String>,
    pub(super) bos_token_id: Option<Value>,
    pub(super) eos_token_id: Option<Value>,
    pub(super) quantization_config: Option<Value>,
}

impl SharedKeys {
    /// The keys of `root`; an error names the member of a wrong type (`num_hidden_layers: -1`
    /// is not a size).
    pub(super) fn read(root: &Value) -> Result<Self, LoadError> {
        serde_path_to_error::deserialize(root.clone()).map_err(|e| {
            let field = match e.path().to_string() {
                path if path == "." => "config.json".to_string(),
                path => path,
            };
            LoadError::config(field, e.into_inner().to_string())
        })
    }
}

pub(super) fn required<T>(value: Option<T>, field: &str) -> Result<T, LoadError> {
    value.ok_or_else(|| LoadError::config(field, "missing"))
}

/// A [`size`] the config must give.
pub(super) fn required_size(
    value: Option<usize>,
    field: &str,
    max: usize,
) -> Result<usize, LoadError> {
    size(required(value, field)?, field, max)
}

/// A size from config.json, checked before anything is allocated from it: a corrupt or
/// hostile file must fail here, not ask for 10^15 layers. The bounds are far above any real
/// model (Llama 3.1 405B: 126 layers, hidden 16384, intermediate 53248, vocab 128256).
pub(super) fn size(value: usize, field: &str, max: usize) -> Result<usize, LoadError> {
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
pub(super) fn positive_finite(value: f64, field: &str) -> Result<f64, LoadError> {
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
pub(super) fn optional_f64(root: &Value, key: &str) -> Result<Option<f64>, LoadError> {
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
pub(super) fn optional_usize(root: &Value, key: &str) -> Result<Option<usize>, LoadError> {
    match root.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|v| Some(v as usize))
            .ok_or_else(|| LoadError::config(key, format!("{v} is not an integer"))),
    }
}

/// Gemma's logit soft-capping keys, refused by the architectures that do not apply them.
pub(super) const SOFTCAPPING_KEYS: [&str; 2] =
    ["attn_logit_softcapping", "final_logit_softcapping"];

/// Those of `keys` that `root` sets to something other than `null` or `false`.
pub(super) fn keys_set(root: &Value, keys: &[&'static str]) -> Vec<&'static str> {
    let set = |key: &str| root.get(key).is_some_and(|v| !v.is_null() && v != false);
    keys.iter().copied().filter(|k| set(k)).collect()
}

/// The gate activation `name` (`silu` when absent), one of `supported`; `field` is the key that
/// an error names.
pub(super) fn gate_activation(
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

/// The experts' counts and sizes (`experts_key`, `num_experts_per_tok`, `inter_key`) of a
/// mixture sparse in every layer, with neither Mixtral's names nor Qwen's weighting: each
/// architecture changes what its mixture does otherwise.
pub(super) fn experts(
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
        shared_expert_intermediate_size: None,
        shared_expert_gate: true,
        router: MoeRouter::Softmax,
        gpt_oss_experts: false,
    })
}
