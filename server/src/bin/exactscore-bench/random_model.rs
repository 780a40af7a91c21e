//! Random-weight checkpoints of real model shapes, built in memory in any supported format,
//! so the benchmark exercises the same loader and engine as a real checkpoint.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

use anyhow::{bail, Result};
use exactscore_server::checkpoint::{Checkpoint, HostTensor};
use exactscore_server::model::{Model, ModelConfig};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

/// The architecture a shape is built as, with what only it has.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arch {
    /// `LlamaForCausalLM` with Llama 3's RoPE schedule.
    Llama,
    /// `Qwen3MoeForCausalLM`: q/k norms, and every layer a mixture of `experts` gated MLPs of
    /// `expert_intermediate` features, `per_token` of them per token, renormalised.
    Qwen3Moe {
        experts: usize,
        per_token: usize,
        expert_intermediate: usize,
    },
    /// `Gemma3ForCausalLM`: five sliding-window layers of `window` tokens, then a global one;
    /// global RoPE at `rope_theta` with linear scaling 8, local RoPE at 10000; scores scaled by
    /// `1 / sqrt(query_pre_attn_scalar)`; GeGLU; tied embeddings.
    Gemma3 {
        query_pre_attn_scalar: usize,
        window: usize,
    },
    /// `Qwen3NextForCausalLM` (tensors under `model.`): the hybrid layers of `Hybrid` with
    /// Qwen3-Next's head-grouped `in_proj_qkvz` / `in_proj_ba`, and every layer a mixture of
    /// experts with a shared expert (`norm_topk_prob`; the dense `intermediate` is in the config
    /// but no layer uses it, `mlp_only_layers` being empty).
    Qwen3Next { hybrid: Hybrid, moe: SharedMoe },
    /// `Qwen3_5ForConditionalGeneration`, text model only (tensors under
    /// `model.language_model.`, keys under `text_config`): the hybrid layers with Qwen3.5's
    /// separate `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`, a dense MLP of
    /// `intermediate` in every layer.
    Qwen3_5 { hybrid: Hybrid },
    /// `Qwen3_5MoeForConditionalGeneration`, text model only: Qwen3.5's hybrid layers, every
    /// layer a mixture of experts with a shared expert (always renormalised; no dense MLP).
    Qwen3_5Moe { hybrid: Hybrid, moe: SharedMoe },
}

/// What the Qwen3-Next family's layers share (docs/architectures/qwen3_5.md): every
/// `full_attention_interval`-th layer (`(i + 1) % interval == 0`) gated full attention (q_proj
/// `[query; gate]` per head, q/k norms, rotary on the first `rotary_fraction` of each head),
/// the others a Gated DeltaNet of `k_heads` key heads of `k_dim` and `v_heads` value heads of
/// `v_dim` with a causal conv1d of `conv_kernel` taps; `(1 + w)` RMSNorms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hybrid {
    pub full_attention_interval: usize,
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub conv_kernel: usize,
    /// `partial_rotary_factor`.
    pub rotary_fraction: f64,
}

/// A mixture of `experts` gated MLPs of `expert_intermediate` features, `per_token` of them
/// per token, beside a shared expert of `shared_intermediate` features weighted by
/// `sigmoid(shared_expert_gate(x))`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SharedMoe {
    pub experts: usize,
    pub per_token: usize,
    pub expert_intermediate: usize,
    pub shared_intermediate: usize,
}

impl Hybrid {
    /// `linear_attn` Linears' widths: the q and k channels (`Hk·Dk` each), the value channels
    /// (`Hv·Dv`): `conv_dim = 2·key + value`.
    fn key_dim(&self) -> usize {
        self.k_heads * self.k_dim
    }

    fn value_dim(&self) -> usize {
        self.v_heads * self.v_dim
    }

    fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    pub name: &'static str,
    pub arch: Arch,
    pub hidden: usize,
    /// The dense MLP's (Qwen3-MoE's and Qwen3-Next's configs carry one too; their layers are
    /// all sparse here). 0: none in the config (Qwen3.5-MoE's class deletes the key).
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rope_theta: f64,
}

const fn shape(
    name: &'static str,
    arch: Arch,
    [hidden, intermediate, layers, heads, kv_heads, head_dim, vocab]: [usize; 7],
    rope_theta: f64,
) -> Shape {
    Shape {
        name,
        arch,
        hidden,
        intermediate,
        layers,
        heads,
        kv_heads,
        head_dim,
        vocab,
        rope_theta,
    }
}

/// The hybrid layers of Qwen3-Next-80B-A3B and Qwen3.5-35B-A3B (their config.json:
/// `full_attention_interval` 4, `linear_num_key_heads` 16, `linear_num_value_heads` 32,
/// `linear_key_head_dim` = `linear_value_head_dim` = 128, `linear_conv_kernel_dim` 4,
/// `partial_rotary_factor` 0.25); Qwen3.5-27B has 48 value heads.
const QWEN3_NEXT_LAYERS: Hybrid = Hybrid {
    full_attention_interval: 4,
    k_heads: 16,
    v_heads: 32,
    k_dim: 128,
    v_dim: 128,
    conv_kernel: 4,
    rotary_fraction: 0.25,
};

const TINY_HYBRID: Hybrid = Hybrid {
    full_attention_interval: 4,
    k_heads: 2,
    v_heads: 4,
    k_dim: 32,
    v_dim: 32,
    conv_kernel: 4,
    rotary_fraction: 0.25,
};

const TINY_SHARED_MOE: SharedMoe = SharedMoe {
    experts: 8,
    per_token: 2,
    expert_intermediate: 128,
    shared_intermediate: 128,
};

/// Every shape `Shape::named` knows: real models' (public configs) and tiny ones of each
/// architecture for CPU runs.
pub const SHAPES: &[Shape] = &[
    shape(
        "llama3-8b",
        Arch::Llama,
        [4096, 14336, 32, 32, 8, 128, 128256],
        5e5,
    ),
    shape(
        "llama3-70b",
        Arch::Llama,
        [8192, 28672, 80, 64, 8, 128, 128256],
        5e5,
    ),
    shape(
        "mistral-large-123b",
        Arch::Llama,
        [12288, 28672, 88, 96, 8, 128, 32768],
        1e6,
    ),
    // Qwen3-30B-A3B: 128 experts of 768, 8 per token.
    shape(
        "qwen3-30b-a3b",
        Arch::Qwen3Moe {
            experts: 128,
            per_token: 8,
            expert_intermediate: 768,
        },
        [2048, 6144, 48, 32, 4, 128, 151936],
        1e6,
    ),
    // Gemma 3 27B (text): windows of 1024 tokens.
    shape(
        "gemma3-27b",
        Arch::Gemma3 {
            query_pre_attn_scalar: 168,
            window: 1024,
        },
        [5376, 21504, 62, 32, 16, 128, 262208],
        1e6,
    ),
    // Qwen/Qwen3.5-35B-A3B (config.json of the release, text_config): 40 layers, 3 Gated
    // DeltaNet layers (16 key heads, 32 value heads, of 128; conv1d of 4) then one gated
    // full-attention layer (16/2 heads of 256, a quarter rotary); every layer 256 experts of
    // 512 with 8 per token and a shared expert of 512; vocab 248320, untied; RoPE 1e7.
    shape(
        "qwen3.5-35b-a3b",
        Arch::Qwen3_5Moe {
            hybrid: QWEN3_NEXT_LAYERS,
            moe: SharedMoe {
                experts: 256,
                per_token: 8,
                expert_intermediate: 512,
                shared_intermediate: 512,
            },
        },
        [2048, 0, 40, 16, 2, 256, 248320],
        1e7,
    ),
    // Qwen/Qwen3-Next-80B-A3B-Instruct (config.json): 48 layers, the same hybrid layers as
    // Qwen3.5-35B-A3B (`full_attention_interval` 4, no `layer_types`); 512 experts of 512 with
    // 10 per token and a shared expert of 512; `intermediate_size` 5120 (no dense layer); vocab
    // 151936, untied; RoPE 1e7.
    shape(
        "qwen3-next-80b-a3b",
        Arch::Qwen3Next {
            hybrid: QWEN3_NEXT_LAYERS,
            moe: SharedMoe {
                experts: 512,
                per_token: 10,
                expert_intermediate: 512,
                shared_intermediate: 512,
            },
        },
        [2048, 5120, 48, 16, 2, 256, 151936],
        1e7,
    ),
    // Qwen/Qwen3.5-27B (config.json, text_config): 64 layers, 3 Gated DeltaNet layers (16 key
    // heads, 48 value heads, of 128) then one gated full-attention layer (24/4 heads of 256);
    // a dense MLP of 17408 in every layer; vocab 248320, untied; RoPE 1e7.
    shape(
        "qwen3.5-27b",
        Arch::Qwen3_5 {
            hybrid: Hybrid {
                v_heads: 48,
                ..QWEN3_NEXT_LAYERS
            },
        },
        [5120, 17408, 64, 24, 4, 256, 248320],
        1e7,
    ),
    shape("tiny", Arch::Llama, [256, 512, 2, 4, 2, 64, 2000], 5e5),
    shape(
        "tiny-moe",
        Arch::Qwen3Moe {
            experts: 8,
            per_token: 2,
            expert_intermediate: 128,
        },
        [256, 512, 2, 4, 2, 64, 2000],
        1e6,
    ),
    // Six layers: five sliding, one global, as the 27B's pattern.
    shape(
        "tiny-gemma3",
        Arch::Gemma3 {
            query_pre_attn_scalar: 64,
            window: 128,
        },
        [256, 512, 6, 4, 2, 64, 2000],
        1e6,
    ),
    // The three hybrid families at toy size, with the big ones' structure: 4 layers (three
    // Gated DeltaNet, one full), 2 key heads and 4 value heads (a head repeat), a quarter
    // rotary, experts with a shared expert.
    shape(
        "tiny-qwen3.5-moe",
        Arch::Qwen3_5Moe {
            hybrid: TINY_HYBRID,
            moe: TINY_SHARED_MOE,
        },
        [256, 0, 4, 4, 2, 64, 2000],
        1e7,
    ),
    shape(
        "tiny-qwen3-next",
        Arch::Qwen3Next {
            hybrid: TINY_HYBRID,
            moe: TINY_SHARED_MOE,
        },
        [256, 512, 4, 4, 2, 64, 2000],
        1e7,
    ),
    shape(
        "tiny-qwen3.5",
        Arch::Qwen3_5 {
            hybrid: TINY_HYBRID,
        },
        [256, 512, 4, 4, 2, 64, 2000],
        1e7,
    ),
];

impl Shape {
    pub fn named(name: &str) -> Result<Self> {
        match SHAPES.iter().find(|s| s.name == name) {
            Some(shape) => Ok(shape.clone()),
            None => bail!(
                "unknown shape {name} (known: {})",
                SHAPES.iter().map(|s| s.name).collect::<Vec<_>>().join(", ")
            ),
        }
    }

    /// The hybrid layers of the Qwen3-Next family.
    fn hybrid(&self) -> Option<&Hybrid> {
        match &self.arch {
            Arch::Qwen3Next { hybrid, .. }
            | Arch::Qwen3_5 { hybrid }
            | Arch::Qwen3_5Moe { hybrid, .. } => Some(hybrid),
            Arch::Llama | Arch::Qwen3Moe { .. } | Arch::Gemma3 { .. } => None,
        }
    }

    /// The mixture with a shared expert of Qwen3-Next and Qwen3.5-MoE.
    fn shared_moe(&self) -> Option<&SharedMoe> {
        match &self.arch {
            Arch::Qwen3Next { moe, .. } | Arch::Qwen3_5Moe { moe, .. } => Some(moe),
            _ => None,
        }
    }

    /// Decoder layer `l` is a Gated DeltaNet (linear attention), not full attention.
    pub fn is_linear_attention(&self, l: usize) -> bool {
        self.hybrid()
            .is_some_and(|h| !(l + 1).is_multiple_of(h.full_attention_interval))
    }

    /// The prefix of the text model's tensors: `model.language_model` in a Qwen3.5
    /// `ForConditionalGeneration` checkpoint, as the releases store it, else `model`.
    fn text_prefix(&self) -> &'static str {
        match self.arch {
            Arch::Qwen3_5 { .. } | Arch::Qwen3_5Moe { .. } => "model.language_model",
            _ => "model",
        }
    }

    /// (name suffix, out, in, quantized) of every Linear in decoder layer `l` (every
    /// expert's), and whether the formats quantize it: as llm-compressor's Qwen3.5 /
    /// Qwen3-Next examples (`ignore: [lm_head, re:.*mlp.gate$, re:.*shared_expert_gate$,
    /// re:.*linear_attn.*]`), the `linear_attn` Linears and the shared-expert gate stay bf16.
    fn linears(&self, l: usize) -> Vec<(String, usize, usize, bool)> {
        let h = self.hidden;
        let (q, kv) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let mut out = Vec::new();
        match self.hybrid() {
            Some(la) if self.is_linear_attention(l) => {
                let (key, value, v_heads) = (la.key_dim(), la.value_dim(), la.v_heads);
                let projections: &[(&str, usize)] = match self.arch {
                    // grouped per key head: [q; k; v; z] and [b; a]
                    Arch::Qwen3Next { .. } => &[
                        ("in_proj_qkvz", 2 * key + 2 * value),
                        ("in_proj_ba", 2 * v_heads),
                    ],
                    _ => &[
                        ("in_proj_qkv", 2 * key + value),
                        ("in_proj_z", value),
                        ("in_proj_b", v_heads),
                        ("in_proj_a", v_heads),
                    ],
                };
                for &(name, rows) in projections {
                    out.push((format!("linear_attn.{name}"), rows, h, false));
                }
                out.push(("linear_attn.out_proj".to_string(), h, value, false));
            }
            hybrid => {
                // the output gate doubles q_proj: [query; gate] per head
                let q_rows = if hybrid.is_some() { 2 * q } else { q };
                out.extend([
                    ("self_attn.q_proj".to_string(), q_rows, h, true),
                    ("self_attn.k_proj".to_string(), kv, h, true),
                    ("self_attn.v_proj".to_string(), kv, h, true),
                    ("self_attn.o_proj".to_string(), h, q, true),
                ]);
            }
        }
        let mlp = |prefix: &str, i: usize| {
            [
                (format!("{prefix}.gate_proj"), i, h, true),
                (format!("{prefix}.up_proj"), i, h, true),
                (format!("{prefix}.down_proj"), h, i, true),
            ]
        };
        match self.arch {
            Arch::Qwen3Moe {
                experts,
                expert_intermediate,
                ..
            } => {
                for e in 0..experts {
                    out.extend(mlp(&format!("mlp.experts.{e}"), expert_intermediate));
                }
            }
            Arch::Qwen3Next { moe, .. } | Arch::Qwen3_5Moe { moe, .. } => {
                for e in 0..moe.experts {
                    out.extend(mlp(&format!("mlp.experts.{e}"), moe.expert_intermediate));
                }
                out.extend(mlp("mlp.shared_expert", moe.shared_intermediate));
                out.push(("mlp.shared_expert_gate".to_string(), 1, h, false));
            }
            Arch::Llama | Arch::Gemma3 { .. } | Arch::Qwen3_5 { .. } => {
                out.extend(mlp("mlp", self.intermediate))
            }
        }
        out
    }

    /// FLOPs of one window of `T = ctx` tokens, summed over the layers:
    ///
    /// - Linears: 2·T·(the weights a token multiplies): q/k/v/o (q_proj twice as wide with
    ///   the output gate), or a Gated DeltaNet's projections `H·(2·Hk·Dk + 3·Hv·Dv + 2·Hv)`
    ///   (`in_proj_qkv(z)`, `in_proj_z`, `in_proj_b`/`a`, `out_proj`); the dense MLP `3·H·I`, or
    ///   the router `H·E`, `per_token` experts `3·H·Im` each, and a shared expert `3·H·Is` and
    ///   its gate `H`; lm_head `V·H` (whole windows, as the server scores them);
    /// - full attention: the two products over the full T×T score matrix (what the
    ///   implementation computes): `4·T²·Hq·hd`;
    /// - a Gated DeltaNet: the conv1d `2·K·conv_dim·T`, and the delta rule as its
    ///   token-by-token definition (`o = Sᵀq`, `Sᵀk`, `S += k δᵀ`: three `Dk×Dv`
    ///   multiply-adds per token and value head): `6·T·Hv·Dk·Dv`. The chunked form the server
    ///   runs does this plus `O(T·C·(Dk + Dv))` per head within chunks of C = 64 (not counted:
    ///   the figure stays the model's work, not one algorithm's).
    pub fn flops_per_window(&self, ctx: usize) -> f64 {
        let (h, t) = (self.hidden, ctx as f64);
        let (q, kv) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let mlp = match self.arch {
            Arch::Qwen3Moe {
                experts,
                per_token,
                expert_intermediate,
            } => h * (experts + 3 * per_token * expert_intermediate),
            Arch::Qwen3Next { moe, .. } | Arch::Qwen3_5Moe { moe, .. } => {
                h * (moe.experts
                    + 3 * moe.per_token * moe.expert_intermediate
                    + 3 * moe.shared_intermediate
                    + 1)
            }
            Arch::Llama | Arch::Gemma3 { .. } | Arch::Qwen3_5 { .. } => 3 * h * self.intermediate,
        };
        let mut flops = 2.0 * t * (self.vocab * h) as f64;
        for l in 0..self.layers {
            let (linear, mixing) = match self.hybrid() {
                Some(la) if self.is_linear_attention(l) => (
                    h * (2 * la.key_dim() + 3 * la.value_dim() + 2 * la.v_heads),
                    2.0 * t * (la.conv_kernel * la.conv_dim()) as f64
                        + 6.0 * t * (la.v_heads * la.k_dim * la.v_dim) as f64,
                ),
                hybrid => {
                    let q_rows = if hybrid.is_some() { 2 * q } else { q };
                    (h * (q_rows + 2 * kv + q), 4.0 * t * t * q as f64)
                }
            };
            flops += 2.0 * t * (linear + mlp) as f64 + mixing;
        }
        flops
    }

    /// The embedding doubles as the lm_head (Gemma).
    fn tied(&self) -> bool {
        matches!(self.arch, Arch::Gemma3 { .. })
    }

    /// Norms' stored weight: 1 (`x̂ · w`), or 0 for Gemma's and the Qwen3-Next family's
    /// `x̂ · (1 + w)`: the same scale.
    fn norm_weight(&self) -> f32 {
        match self.arch {
            Arch::Llama | Arch::Qwen3Moe { .. } => 1.0,
            _ => 0.0,
        }
    }

    /// Binary orders of magnitude by which decoder Linear `name`'s scales are drawn below a
    /// trained layer's: 16 for the Linears that write a mixture's residual stream (`o_proj`,
    /// a Gated DeltaNet's `out_proj`, the experts' and the shared expert's `down_proj`), else
    /// 0. With a trained layer's scales the random layers add a component common to every
    /// position (their attention is near uniform), the router sees nearly one state for every
    /// token, and a 2048-token window reaches about 20 of 128 experts per layer, where a
    /// trained router reaches nearly all. Scaled below the residual's bf16 resolution, these
    /// layers leave each token's embedding as the router's input, and the random router
    /// spreads the tokens over the experts as a trained one does. The kernels' work does not
    /// depend on the values (the mantissas stay random). bf16 Linears are drawn that much
    /// smaller too.
    fn scale_shift(&self, name: &str) -> u16 {
        let writes_residual =
            name.ends_with("o_proj") || name.ends_with("down_proj") || name.ends_with("out_proj");
        match self.arch {
            Arch::Qwen3Moe { .. } | Arch::Qwen3Next { .. } | Arch::Qwen3_5Moe { .. }
                if writes_residual =>
            {
                16
            }
            _ => 0,
        }
    }

    /// The norms of decoder layer `l`: (name suffix, size).
    fn norms(&self, l: usize) -> Vec<(&'static str, usize)> {
        let (h, d) = (self.hidden, self.head_dim);
        let mut norms = vec![("input_layernorm", h), ("post_attention_layernorm", h)];
        if let Arch::Gemma3 { .. } = self.arch {
            norms.extend([
                ("pre_feedforward_layernorm", h),
                ("post_feedforward_layernorm", h),
            ]);
        }
        if self.arch != Arch::Llama && !self.is_linear_attention(l) {
            norms.extend([("self_attn.q_norm", d), ("self_attn.k_norm", d)]);
        }
        norms
    }

    /// config.json of this shape, as transformers 5 writes it (transformers loads it), with
    /// `quant` as its `quantization_config`.
    fn config(&self, quant: Option<serde_json::Value>) -> serde_json::Value {
        let mut config = json!({
            "vocab_size": self.vocab, "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
        });
        if self.intermediate > 0 {
            config["intermediate_size"] = json!(self.intermediate);
        }
        let extra = match self.arch {
            Arch::Llama => json!({
                "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
                "rope_parameters": {"rope_type": "llama3", "rope_theta": self.rope_theta,
                    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192},
                "max_position_embeddings": 131072,
            }),
            Arch::Qwen3Moe {
                experts,
                per_token,
                expert_intermediate,
            } => json!({
                "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
                "max_position_embeddings": 40960, "num_experts": experts,
                "num_experts_per_tok": per_token, "moe_intermediate_size": expert_intermediate,
                "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "use_sliding_window": false, "tie_word_embeddings": false,
            }),
            Arch::Gemma3 {
                query_pre_attn_scalar,
                window,
            } => {
                let layer_types: Vec<&str> = (0..self.layers)
                    .map(|i| match (i + 1) % 6 {
                        0 => "full_attention",
                        _ => "sliding_attention",
                    })
                    .collect();
                json!({
                    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                    "rms_norm_eps": 1e-6,
                    "hidden_activation": "gelu_pytorch_tanh",
                    "query_pre_attn_scalar": query_pre_attn_scalar, "sliding_window": window,
                    "layer_types": layer_types,
                    "rope_parameters": {
                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                            "rope_theta": self.rope_theta},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                    "max_position_embeddings": 131072, "tie_word_embeddings": true,
                    "final_logit_softcapping": null, "attn_logit_softcapping": null,
                })
            }
            Arch::Qwen3Next { hybrid, moe } => {
                // As the release: the layer kinds from `full_attention_interval` alone.
                let mut c = self.hybrid_config(&hybrid, false);
                c["architectures"] = json!(["Qwen3NextForCausalLM"]);
                c["model_type"] = json!("qwen3_next");
                for (k, v) in json!({
                    "num_experts": moe.experts, "num_experts_per_tok": moe.per_token,
                    "moe_intermediate_size": moe.expert_intermediate,
                    "shared_expert_intermediate_size": moe.shared_intermediate,
                    "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
                })
                .as_object()
                .into_iter()
                .flatten()
                {
                    c[k] = v.clone();
                }
                c
            }
            Arch::Qwen3_5 { hybrid } => {
                let mut c = self.hybrid_config(&hybrid, true);
                c["model_type"] = json!("qwen3_5_text");
                c
            }
            Arch::Qwen3_5Moe { hybrid, moe } => {
                let mut c = self.hybrid_config(&hybrid, true);
                c["model_type"] = json!("qwen3_5_moe_text");
                for (k, v) in json!({
                    "num_experts": moe.experts, "num_experts_per_tok": moe.per_token,
                    "moe_intermediate_size": moe.expert_intermediate,
                    "shared_expert_intermediate_size": moe.shared_intermediate,
                })
                .as_object()
                .into_iter()
                .flatten()
                {
                    c[k] = v.clone();
                }
                c
            }
        };
        for (k, v) in extra.as_object().into_iter().flatten() {
            config[k] = v.clone();
        }
        let composite = match self.arch {
            Arch::Qwen3_5 { .. } => Some(("Qwen3_5ForConditionalGeneration", "qwen3_5")),
            Arch::Qwen3_5Moe { .. } => Some(("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe")),
            _ => None,
        };
        match composite {
            // The text model's keys under `text_config`; the top level names the composite
            // class and carries the tie flag (the one transformers reads), the quantization and
            // the dtype. No `vision_config` (the class's default): there is no vision tower.
            Some((class, model_type)) => json!({
                "architectures": [class], "model_type": model_type, "text_config": config,
                "tie_word_embeddings": false, "dtype": "bfloat16", "quantization_config": quant,
                "image_token_id": 248056, "video_token_id": 248057,
                "vision_start_token_id": 248053, "vision_end_token_id": 248054,
            }),
            None => {
                config["dtype"] = json!("bfloat16");
                config["quantization_config"] = quant.unwrap_or(serde_json::Value::Null);
                config
            }
        }
    }

    /// The keys the Qwen3-Next family's text configs share, as the releases write them
    /// (docs/architectures/qwen3_5.md §2). `layer_types`: the Qwen3.5 releases list the layer
    /// kinds (and carry mrope's sections, which text scoring does not read); Qwen3-Next's
    /// gives only `full_attention_interval`.
    fn hybrid_config(&self, la: &Hybrid, qwen3_5: bool) -> serde_json::Value {
        let mut rope = json!({"rope_type": "default", "rope_theta": self.rope_theta,
            "partial_rotary_factor": la.rotary_fraction});
        let mut c = json!({
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
            "attention_bias": false, "attn_output_gate": true,
            "full_attention_interval": la.full_attention_interval,
            "linear_conv_kernel_dim": la.conv_kernel, "linear_key_head_dim": la.k_dim,
            "linear_value_head_dim": la.v_dim, "linear_num_key_heads": la.k_heads,
            "linear_num_value_heads": la.v_heads, "tie_word_embeddings": false,
        });
        if qwen3_5 {
            let layer_types: Vec<&str> = (0..self.layers)
                .map(|l| match self.is_linear_attention(l) {
                    true => "linear_attention",
                    false => "full_attention",
                })
                .collect();
            c["layer_types"] = json!(layer_types);
            // [11, 11, 10] for the releases' 32 rotary frequencies
            let half = (self.head_dim as f64 * la.rotary_fraction) as usize / 2;
            rope["mrope_section"] = json!([half.div_ceil(3), (half + 1) / 3, half / 3]);
            rope["mrope_interleaved"] = json!(true);
        }
        c["rope_parameters"] = rope;
        c
    }

    /// The period of the drawn layers with `distinct` of them drawn: a multiple of the full
    /// attention interval for a hybrid shape, so that every copy is of a layer of its kind.
    fn drawn_layers(&self, distinct: Option<usize>) -> usize {
        let drawn = distinct.unwrap_or(self.layers).max(1);
        let drawn = match self.hybrid() {
            Some(la) => drawn.div_ceil(la.full_attention_interval) * la.full_attention_interval,
            None => drawn,
        };
        drawn.min(self.layers)
    }
}

/// The little-endian bytes of `v` rounded toward zero to bf16 (exact for 0 and 1).
fn bf16_bytes(v: f32) -> Vec<u8> {
    ((v.to_bits() >> 16) as u16).to_le_bytes().to_vec()
}

/// xorshift64*: fast, deterministic filler for gigabytes of weights.
struct Rng(u64);

impl Rng {
    fn fill(&mut self, buf: &mut [u8], map: impl Fn(u8) -> u8) {
        for chunk in buf.chunks_mut(8) {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let v = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
            for (b, r) in chunk.iter_mut().zip(v) {
                *b = map(r);
            }
        }
    }

    fn tensor(&mut self, dtype: Dtype, shape: Vec<usize>, map: impl Fn(u8) -> u8) -> HostTensor {
        let mut data = vec![0u8; shape.iter().product::<usize>() * dtype.bitsize() / 8];
        self.fill(&mut data, map);
        HostTensor { dtype, shape, data }
    }

    /// bf16 values of magnitude 2^-7..2^-4 with random sign and mantissa (never NaN/inf).
    fn bf16(&mut self, shape: Vec<usize>) -> HostTensor {
        self.bf16_in(shape, 120..123, true)
    }

    /// bf16 values with a random mantissa, a biased exponent in `exponents` (2^(e - 127)) and a
    /// random sign where `signed`.
    fn bf16_in(&mut self, shape: Vec<usize>, exponents: Range<u16>, signed: bool) -> HostTensor {
        let mut t = self.tensor(Dtype::BF16, shape, |b| b);
        let sign_mask = if signed { 0x8000 } else { 0 };
        let spread = exponents.end - exponents.start;
        for v in t.data.chunks_mut(2) {
            let bits = u16::from_le_bytes([v[0], v[1]]);
            let exponent = exponents.start + (bits >> 7) % spread;
            let bits = (bits & (sign_mask | 0x7F)) | (exponent << 7);
            v.copy_from_slice(&bits.to_le_bytes());
        }
        t
    }
}

fn constant<T: Copy>(
    dtype: Dtype,
    shape: Vec<usize>,
    value: T,
    to_bytes: impl Fn(T) -> Vec<u8>,
) -> HostTensor {
    let n: usize = shape.iter().product();
    HostTensor {
        dtype,
        shape,
        data: (0..n).flat_map(|_| to_bytes(value)).collect(),
    }
}

/// An fp8 e4m3 byte from the random byte `b`: its mantissa, a biased exponent in `exponents`
/// (at most 14: finite, never NaN) and its sign where `signed`; as
/// [`Rng::bf16_in`] for bf16.
fn fp8_in(b: u8, exponents: Range<u8>, signed: bool) -> u8 {
    let sign = if signed { b & 0x80 } else { 0 };
    sign | (b & 0x07) | ((exponents.start + (b >> 3) % (exponents.end - exponents.start)) << 3)
}

/// The `quantization_config` of `format`; `ignore`: the Linears left unquantized.
fn quantization_config(format: &str, ignore: &[&str]) -> Result<Option<serde_json::Value>> {
    let (fmt, weights, input) = match format {
        "bf16" => return Ok(None),
        "w4a16" => (
            "pack-quantized",
            json!({"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 128}),
            None,
        ),
        "nvfp4a16" => (
            "nvfp4-pack-quantized",
            json!({"num_bits": 4, "type": "float", "symmetric": true, "strategy": "tensor_group", "group_size": 16}),
            None,
        ),
        "nvfp4" => (
            "nvfp4-pack-quantized",
            json!({"num_bits": 4, "type": "float", "symmetric": true, "strategy": "tensor_group", "group_size": 16}),
            Some(
                json!({"num_bits": 4, "type": "float", "symmetric": true, "strategy": "tensor_group", "group_size": 16, "dynamic": "local"}),
            ),
        ),
        "fp8" => (
            "float-quantized",
            json!({"num_bits": 8, "type": "float", "symmetric": true, "strategy": "channel"}),
            Some(
                json!({"num_bits": 8, "type": "float", "symmetric": true, "strategy": "token", "dynamic": true}),
            ),
        ),
        other => bail!("unknown format {other} (w4a16, nvfp4, nvfp4a16, fp8, bf16)"),
    };
    Ok(Some(json!({
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": input}},
        "ignore": ignore
    })))
}

/// A random checkpoint of `shape` in `format`, with its config, in memory. With `distinct`,
/// only that many decoder layers are drawn and the others repeat them in turn (layer `l` is a
/// copy of layer `l % distinct`; for a hybrid shape `distinct` is rounded up to a multiple of
/// its full-attention interval, so that each layer copies one of its kind): a 70B bf16 model in seconds instead of minutes, for timings
/// and bitwise comparisons that do not need every layer different.
pub fn build(
    shape: &Shape,
    format: &str,
    distinct: Option<usize>,
) -> Result<(ModelConfig, Checkpoint)> {
    let (config, tensors) = tensors(shape, format, distinct)?;
    let config = ModelConfig::from_json(&config.to_string())?;
    Ok((config, Checkpoint::from_memory(tensors)))
}

/// A random model of `shape` in `format` loaded on `device` in `dtype` for sequences of up to
/// `ctx` tokens (activation QDQ emulated, the attention kernel chosen for the device): what
/// the `kld` and `diff` benchmarks time against `/score`.
pub fn model(
    shape: &Shape,
    format: &str,
    device: &candle_core::Device,
    dtype: candle_core::DType,
    ctx: usize,
) -> Result<Model> {
    use exactscore_server::model::AttentionKernel;
    use exactscore_server::quant::ActivationQuantMode;
    let (config, ckpt) = build(shape, format, None)?;
    let opts = crate::options(
        device,
        dtype,
        ActivationQuantMode::Emulate,
        ctx,
        AttentionKernel::Auto,
    );
    Ok(Model::from_checkpoint(config, &ckpt, &opts)?)
}

/// Writes a random checkpoint of `shape` in `format` to `dir` as a Hugging Face model directory
/// (`config.json` + `model.safetensors`), so the real server can load it.
pub fn write(shape: &Shape, format: &str, distinct: Option<usize>, dir: &Path) -> Result<()> {
    let (config, tensors) = tensors(shape, format, distinct)?;
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let views = names
        .into_iter()
        .map(|n| {
            let t = &tensors[n];
            Ok((
                n.as_str(),
                TensorView::new(t.dtype, t.shape.clone(), &t.data)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))?;
    Ok(())
}

/// The config.json and the tensors of a random checkpoint of `shape` in `format` (see
/// [`build`] for `distinct`).
fn tensors(
    shape: &Shape,
    format: &str,
    distinct: Option<usize>,
) -> Result<(serde_json::Value, HashMap<String, HostTensor>)> {
    let ignore: &[&str] = match shape.arch {
        // llm-compressor leaves the router unquantized
        Arch::Qwen3Moe { .. } => &["lm_head", "re:.*mlp\\.gate$"],
        Arch::Llama | Arch::Gemma3 { .. } => &["lm_head"],
        // and, in its Qwen3.5 / Qwen3-Next examples, the shared-expert gate and every
        // `linear_attn` module (tests/fixtures/qwen3_5*/recipe.yaml)
        Arch::Qwen3Next { .. } | Arch::Qwen3_5 { .. } | Arch::Qwen3_5Moe { .. } => &[
            "lm_head",
            "re:.*mlp\\.gate$",
            "re:.*shared_expert_gate$",
            "re:.*linear_attn.*",
        ],
    };
    let config = shape.config(quantization_config(format, ignore)?);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut t: HashMap<String, HostTensor> = HashMap::new();
    let f32_bytes = |v: f32| v.to_le_bytes().to_vec();
    let norm = |size: usize| constant(Dtype::F32, vec![size], shape.norm_weight(), f32_bytes);
    let m = shape.text_prefix();
    t.insert(
        format!("{m}.embed_tokens.weight"),
        rng.bf16(vec![shape.vocab, shape.hidden]),
    );
    if !shape.tied() {
        t.insert(
            "lm_head.weight".into(),
            rng.bf16(vec![shape.vocab, shape.hidden]),
        );
    }
    t.insert(format!("{m}.norm.weight"), norm(shape.hidden));
    let drawn = shape.drawn_layers(distinct);
    for l in 0..shape.layers {
        let p = format!("{m}.layers.{l}");
        if l >= drawn {
            let source = format!("{m}.layers.{}.", l % drawn);
            let copies: Vec<(String, HostTensor)> = t
                .iter()
                .filter(|(name, _)| name.starts_with(&source))
                .map(|(name, tensor)| {
                    let suffix = &name[source.len()..];
                    let copy = HostTensor {
                        dtype: tensor.dtype,
                        shape: tensor.shape.clone(),
                        data: tensor.data.clone(),
                    };
                    (format!("{p}.{suffix}"), copy)
                })
                .collect();
            t.extend(copies);
            continue;
        }
        for (name, size) in shape.norms(l) {
            t.insert(format!("{p}.{name}.weight"), norm(size));
        }
        let experts = match shape.arch {
            Arch::Qwen3Moe { experts, .. } => Some(experts),
            _ => shape.shared_moe().map(|moe| moe.experts),
        };
        if let Some(experts) = experts {
            // The router, in bf16 like the embeddings: its logits spread the tokens over the
            // experts.
            t.insert(
                format!("{p}.mlp.gate.weight"),
                rng.bf16(vec![experts, shape.hidden]),
            );
        }
        if let Some(la) = shape.hybrid().filter(|_| shape.is_linear_attention(l)) {
            // The Gated DeltaNet's parameters that are no Linears, in the releases' stored
            // dtypes: the Qwen3.5 releases store `A_log` and the gated norm's weight in f32
            // (the others bf16); Qwen3-Next's are bf16 here, as in its fixtures (the
            // release's were not checked). `A_log` 0 and `dt_bias` 0: a decay of
            // `exp(-softplus(a))` per token; the gated norm's plain weight 1.
            let f32_stored = !matches!(shape.arch, Arch::Qwen3Next { .. });
            let (dtype, bytes): (Dtype, fn(f32) -> Vec<u8>) = if f32_stored {
                (Dtype::F32, |v: f32| v.to_le_bytes().to_vec())
            } else {
                (Dtype::BF16, bf16_bytes)
            };
            let a = format!("{p}.linear_attn");
            t.insert(
                format!("{a}.conv1d.weight"),
                rng.bf16(vec![la.conv_dim(), 1, la.conv_kernel]),
            );
            t.insert(
                format!("{a}.A_log"),
                constant(dtype, vec![la.v_heads], 0.0, bytes),
            );
            t.insert(
                format!("{a}.dt_bias"),
                constant(Dtype::BF16, vec![la.v_heads], 0.0, bf16_bytes),
            );
            t.insert(
                format!("{a}.norm.weight"),
                constant(dtype, vec![la.v_dim], 1.0, bytes),
            );
        }
        for (name, out, inp, quantized) in shape.linears(l) {
            let n = format!("{p}.{name}");
            let shift = shape.scale_shift(&name);
            match format {
                _ if format == "bf16" || !quantized => {
                    t.insert(
                        format!("{n}.weight"),
                        rng.bf16_in(vec![out, inp], 120 - shift..123 - shift, true),
                    );
                }
                "w4a16" => {
                    t.insert(
                        format!("{n}.weight_packed"),
                        rng.tensor(Dtype::I32, vec![out, inp / 8], |b| b),
                    );
                    // Group scales as a trained layer's (absmax / 7 of its groups: 2^-8..2^-6),
                    // each its own: one constant scale would leave the dequantized weights 16
                    // values, whose few toggling bits let the GEMMs draw less power (and run
                    // faster) than a real checkpoint's.
                    t.insert(
                        format!("{n}.weight_scale"),
                        rng.bf16_in(vec![out, inp / 128], 119 - shift..121 - shift, false),
                    );
                    // [out, in], as llm-compressor writes it: compressed-tensors (transformers)
                    // cannot unpack the codes without it.
                    let dims = [out as i64, inp as i64];
                    t.insert(
                        format!("{n}.weight_shape"),
                        HostTensor {
                            dtype: Dtype::I64,
                            shape: vec![2],
                            data: dims.iter().flat_map(|d| d.to_le_bytes()).collect(),
                        },
                    );
                }
                "nvfp4" | "nvfp4a16" => {
                    t.insert(
                        format!("{n}.weight_packed"),
                        rng.tensor(Dtype::U8, vec![out, inp / 2], |b| b),
                    );
                    t.insert(
                        format!("{n}.weight_scale"),
                        // Block scales in 16..240 (biased exponent 11..=14): llm-compressor's
                        // NVFP4 scales of a trained layer (block max / 6 times the global scale).
                        rng.tensor(Dtype::F8_E4M3, vec![out, inp / 16], |b| {
                            fp8_in(b, 11..15, false)
                        }),
                    );
                    t.insert(
                        format!("{n}.weight_global_scale"),
                        constant(
                            Dtype::F32,
                            vec![1],
                            20000.0 * 2f32.powi(shift.into()),
                            f32_bytes,
                        ),
                    );
                    if format == "nvfp4" {
                        t.insert(
                            format!("{n}.input_global_scale"),
                            constant(Dtype::F32, vec![1], 500.0f32, f32_bytes),
                        );
                    }
                }
                _ => {
                    t.insert(
                        format!("{n}.weight"),
                        rng.tensor(Dtype::F8_E4M3, vec![out, inp], |b| fp8_in(b, 1..15, true)),
                    );
                    // Channel scales as a trained layer's (absmax / 448: 2^-12..2^-10), each its
                    // own, like the W4A16 group scales above.
                    t.insert(
                        format!("{n}.weight_scale"),
                        rng.bf16_in(vec![out, 1], 115 - shift..117 - shift, false),
                    );
                }
            }
        }
    }
    Ok((config, t))
}

/// Average stored bits per weight over the decoder Linears (lm_head excluded).
pub fn decoder_bits_per_weight(model: &Model) -> f64 {
    let (bits, weights) = model
        .linears()
        .iter()
        .filter(|(name, _)| name != "lm_head")
        .map(|(_, l)| {
            let (o, i) = l.weight().shape();
            (
                l.weight().bits_per_weight() * (o * i) as f64,
                (o * i) as f64,
            )
        })
        .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
    bits / weights
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use exactscore_server::model::config::{Architecture, RopeScaling};
    use exactscore_server::model::{AttentionKernel, ModelOptions, ScoreInput};
    use exactscore_server::quant::{ActivationQuantMode, LinearOptions};

    fn config(name: &str) -> ModelConfig {
        let shape = Shape::named(name).unwrap();
        let quant = quantization_config("w4a16", &["lm_head"]).unwrap();
        ModelConfig::from_json(&shape.config(quant).to_string()).unwrap()
    }

    /// The benchmark shapes parse as the models they stand for (the values of their public
    /// configs), through the loader's own config parser.
    #[test]
    fn big_shapes_are_the_real_models_configs() {
        let c = config("qwen3-30b-a3b");
        assert_eq!(c.architecture, Architecture::Qwen3Moe);
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(
            (
                moe.num_experts,
                moe.experts_per_token,
                moe.expert_intermediate_size
            ),
            (128, 8, 768)
        );
        assert!(moe.norm_topk_prob && moe.sparse_layers == vec![true; 48]);
        assert_eq!(
            (c.hidden_size, c.num_layers, c.vocab_size),
            (2048, 48, 151936)
        );
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (32, 4, 128));
        assert!(c.qk_norm && c.sliding_window.is_none() && c.rope.theta == 1e6);

        let c = config("gemma3-27b");
        assert_eq!(c.architecture, Architecture::Gemma3);
        assert_eq!((c.hidden_size, c.intermediate_size), (5376, 21504));
        assert_eq!((c.num_layers, c.vocab_size), (62, 262208));
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (32, 16, 128));
        assert_eq!(c.query_pre_attn_scalar, Some(168.0));
        assert_eq!(c.sliding_window, Some(1024));
        let layers = c.sliding_layers.as_ref().unwrap();
        let globals: Vec<usize> = (0..62).filter(|&i| !layers.sliding[i]).collect();
        assert_eq!(globals, (5..62).step_by(6).collect::<Vec<_>>());
        assert_eq!(c.rope.theta, 1e6);
        assert_eq!(c.rope.scaling, RopeScaling::Linear { factor: 8.0 });
        let local = layers.local_rope.as_ref().unwrap();
        assert_eq!(
            (local.theta, &local.scaling),
            (10000.0, &RopeScaling::Default)
        );
        assert!(c.tie_word_embeddings && c.final_logit_softcapping.is_none());
    }

    /// The tiny variant of each new architecture, built as the big one is, loads through the
    /// real loader and scores a window longer than Gemma's sliding window (and than the gated
    /// delta rule's chunks of 64).
    #[test]
    fn tiny_moe_and_gemma3_load_and_score() -> Result<()> {
        for (name, format) in [
            ("tiny-moe", "w4a16"),
            ("tiny-gemma3", "w4a16"),
            ("tiny-moe", "fp8"),
            ("tiny-qwen3.5-moe", "w4a16"),
            ("tiny-qwen3-next", "w4a16"),
            ("tiny-qwen3.5", "w4a16"),
            ("tiny-qwen3.5-moe", "nvfp4"),
            ("tiny-qwen3-next", "fp8"),
            ("tiny-qwen3.5", "bf16"),
        ] {
            let shape = Shape::named(name)?;
            let (config, ckpt) = build(&shape, format, None)?;
            let opts = ModelOptions {
                linear: LinearOptions {
                    device: Device::Cpu,
                    dtype: DType::F32,
                    activation_quant: ActivationQuantMode::Emulate,
                    kv_cache: Default::default(),
                },
                max_seq_len: 300,
                attention: AttentionKernel::Auto,
            };
            let model = Model::from_checkpoint(config, &ckpt, &opts)?;
            let tokens: Vec<u32> = (0..300).map(|i| (i * 7919 % shape.vocab) as u32).collect();
            let scores = model.score(&[ScoreInput {
                stored: exactscore_server::model::StoredRequest::NONE,
                tokens: &tokens,
                top_k: 0,
            }])?;
            let logprobs: Vec<f32> = scores[0].token_logprobs().collect();
            assert_eq!(logprobs.len(), 299);
            assert!(
                logprobs.iter().all(|lp| lp.is_finite() && *lp < 0.0),
                "{name} {format}"
            );
            let routes = model.expert_routes(&[&tokens[..16]])?;
            let per_token = match shape.arch {
                Arch::Qwen3Moe { per_token, .. } => Some(per_token),
                _ => shape.shared_moe().map(|moe| moe.per_token),
            };
            match per_token {
                Some(per_token) => {
                    assert_eq!(routes.len(), shape.layers);
                    assert!(routes.iter().all(|(_, r)| r.len() == 16
                        && r.iter().all(|experts| experts.len() == per_token)));
                }
                None => assert!(routes.is_empty()),
            }
        }
        Ok(())
    }

    /// The hybrid benchmark shapes parse, through the loader's own config parser, as the
    /// published config.json of Qwen/Qwen3.5-35B-A3B, Qwen/Qwen3-Next-80B-A3B-Instruct and
    /// Qwen/Qwen3.5-27B (the values the shapes' comments cite).
    #[test]
    fn hybrid_shapes_are_the_real_models_configs() {
        let full_every_4th = |layers: usize| -> Vec<bool> {
            (0..layers).map(|l| (l + 1) % 4 != 0).collect::<Vec<_>>()
        };
        for (name, arch, layers, hidden, heads, v_heads, vocab) in [
            (
                "qwen3.5-35b-a3b",
                Architecture::Qwen3_5MoeMultimodal,
                40,
                2048,
                (16, 2),
                32,
                248320,
            ),
            (
                "qwen3-next-80b-a3b",
                Architecture::Qwen3Next,
                48,
                2048,
                (16, 2),
                32,
                151936,
            ),
            (
                "qwen3.5-27b",
                Architecture::Qwen3_5Multimodal,
                64,
                5120,
                (24, 4),
                48,
                248320,
            ),
        ] {
            let c = config(name);
            assert_eq!(c.architecture, arch, "{name}");
            assert_eq!(
                (c.num_layers, c.hidden_size, c.vocab_size),
                (layers, hidden, vocab),
                "{name}"
            );
            assert_eq!(
                (c.num_heads, c.num_kv_heads, c.head_dim),
                (heads.0, heads.1, 256)
            );
            assert_eq!((c.rotary_dim, c.rope.theta), (64, 1e7), "{name}");
            assert_eq!(c.rope.scaling, RopeScaling::Default);
            assert!(
                c.attn_output_gate && c.qk_norm && !c.tie_word_embeddings,
                "{name}"
            );
            assert!(c.sliding_window.is_none() && c.final_logit_softcapping.is_none());
            assert_eq!(c.rms_norm_eps, 1e-6);
            let la = c.linear_attention.as_ref().unwrap();
            assert_eq!(la.linear_layers, full_every_4th(layers), "{name}");
            assert_eq!(
                (la.k_heads, la.v_heads, la.k_dim, la.v_dim, la.conv_kernel),
                (16, v_heads, 128, 128, 4),
                "{name}"
            );
            assert_eq!(la.grouped_projections, arch == Architecture::Qwen3Next);
            let moe = c.moe.as_ref();
            match name {
                "qwen3.5-27b" => {
                    assert!(moe.is_none());
                    assert_eq!(c.intermediate_size, 17408);
                }
                _ => {
                    let moe = moe.unwrap();
                    let (experts, per_token) = match arch {
                        Architecture::Qwen3Next => (512, 10),
                        _ => (256, 8),
                    };
                    assert_eq!(
                        (
                            moe.num_experts,
                            moe.experts_per_token,
                            moe.expert_intermediate_size,
                            moe.shared_expert_intermediate_size
                        ),
                        (experts, per_token, 512, Some(512)),
                        "{name}"
                    );
                    assert!(moe.norm_topk_prob && moe.sparse_layers == vec![true; layers]);
                }
            }
        }
        assert_eq!(config("qwen3-next-80b-a3b").intermediate_size, 5120);
    }

    /// A hybrid shape's checkpoint written to disk: its config.json parses as the architecture
    /// the release names, and its tensors are named and typed as the releases' and the
    /// fixtures' (tests/fixtures/qwen3_5*, qwen3_next*): `model.language_model.` for Qwen3.5,
    /// the `linear_attn` modules, routers and shared-expert gates left in bf16 (`A_log` and the
    /// gated norm in f32 for Qwen3.5), everything else quantized.
    #[test]
    fn written_hybrid_checkpoints_are_the_releases_layout() -> Result<()> {
        for (name, arch, prefix) in [
            (
                "tiny-qwen3.5-moe",
                Architecture::Qwen3_5MoeMultimodal,
                "model.language_model",
            ),
            ("tiny-qwen3-next", Architecture::Qwen3Next, "model"),
            (
                "tiny-qwen3.5",
                Architecture::Qwen3_5Multimodal,
                "model.language_model",
            ),
        ] {
            let dir = tempfile::tempdir()?;
            let shape = Shape::named(name)?;
            write(&shape, "w4a16", None, dir.path())?;
            let c =
                ModelConfig::from_json(&std::fs::read_to_string(dir.path().join("config.json"))?)?;
            assert_eq!(c.architecture, arch, "{name}");
            let bytes = std::fs::read(dir.path().join("model.safetensors"))?;
            let st = safetensors::SafeTensors::deserialize(&bytes)?;
            let dtype = |n: &str| st.tensor(&format!("{prefix}.{n}")).map(|t| t.dtype());
            let qwen3_5 = arch != Architecture::Qwen3Next;
            let stored = if qwen3_5 { Dtype::F32 } else { Dtype::BF16 };
            assert_eq!(dtype("layers.0.linear_attn.A_log")?, stored);
            assert_eq!(dtype("layers.0.linear_attn.norm.weight")?, stored);
            assert_eq!(dtype("layers.0.linear_attn.dt_bias")?, Dtype::BF16);
            assert_eq!(dtype("layers.0.linear_attn.conv1d.weight")?, Dtype::BF16);
            let projections: &[&str] = if qwen3_5 {
                &[
                    "in_proj_qkv",
                    "in_proj_z",
                    "in_proj_b",
                    "in_proj_a",
                    "out_proj",
                ]
            } else {
                &["in_proj_qkvz", "in_proj_ba", "out_proj"]
            };
            for p in projections {
                assert_eq!(
                    dtype(&format!("layers.0.linear_attn.{p}.weight"))?,
                    Dtype::BF16
                );
            }
            assert!(st
                .tensor(&format!("{prefix}.layers.0.self_attn.q_proj.weight_packed"))
                .is_err());
            // q_proj [query; gate]: 2 * 4 heads * 64 rows
            let q = st.tensor(&format!("{prefix}.layers.3.self_attn.q_proj.weight_packed"))?;
            assert_eq!(q.shape(), &[512, 256 / 8]);
            // compressed-tensors needs it to unpack the codes (transformers loads the file)
            let dims = st.tensor(&format!("{prefix}.layers.3.self_attn.q_proj.weight_shape"))?;
            assert_eq!(
                (dims.dtype(), dims.data()),
                (
                    Dtype::I64,
                    &[512i64.to_le_bytes(), 256i64.to_le_bytes()].concat()[..]
                )
            );
            assert_eq!(dtype("layers.3.self_attn.q_norm.weight")?, Dtype::F32);
            if shape.shared_moe().is_some() {
                assert_eq!(dtype("layers.0.mlp.gate.weight")?, Dtype::BF16);
                assert_eq!(
                    dtype("layers.0.mlp.shared_expert_gate.weight")?,
                    Dtype::BF16
                );
                assert_eq!(
                    dtype("layers.0.mlp.shared_expert.down_proj.weight_packed")?,
                    Dtype::I32
                );
                assert_eq!(
                    dtype("layers.3.mlp.experts.7.up_proj.weight_packed")?,
                    Dtype::I32
                );
            } else {
                assert_eq!(dtype("layers.0.mlp.down_proj.weight_packed")?, Dtype::I32);
            }
            assert_eq!(st.tensor("lm_head.weight")?.dtype(), Dtype::BF16);
        }
        Ok(())
    }

    /// `flops_per_window` of a hybrid shape, by hand for tiny-qwen3.5 (3 linear, 1 full layer).
    #[test]
    fn hybrid_flops_count_both_layer_kinds() {
        let (t, h) = (100.0, 256.0);
        let linear = h * (2.0 * 64.0 + 3.0 * 128.0 + 2.0 * 4.0);
        let delta = 2.0 * 4.0 * 256.0 * t + 6.0 * t * 4.0 * 32.0 * 32.0;
        let full = h * (2.0 * 256.0 + 2.0 * 128.0 + 256.0);
        let mlp = 3.0 * h * 512.0;
        let expected = 2.0 * t * 2000.0 * h
            + 3.0 * (2.0 * t * (linear + mlp) + delta)
            + 2.0 * t * (full + mlp)
            + 4.0 * t * t * 256.0;
        let got = Shape::named("tiny-qwen3.5").unwrap().flops_per_window(100);
        assert!((got - expected).abs() < 1e-6 * expected, "{got} {expected}");
    }
}
