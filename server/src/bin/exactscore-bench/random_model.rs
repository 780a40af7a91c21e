//! Random-weight checkpoints of real model shapes, built in memory in any supported format,
//! so the benchmark exercises the same loader and engine as a real checkpoint.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

use anyhow::{bail, Result};
use exactscore_server::checkpoint::{Checkpoint, HostTensor};
use exactscore_server::model::placement::PartBytes;
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
    /// `DeepseekV3ForCausalLM`: latent attention with a low-rank query, DeepSeek-V3's sigmoid
    /// router with `e_score_correction_bias` over `groups` groups, YaRN RoPE.
    DeepseekV3 { mla: Mla, moe: DeepseekMoe },
    /// `DeepseekV2ForCausalLM`: latent attention, DeepSeek's mixture with a softmax router
    /// (`topk_method` `greedy`, never renormalised), YaRN RoPE (docs/architectures/deepseek.md).
    DeepseekV2 { mla: Mla, moe: DeepseekMoe },
    /// `Glm4MoeLiteForCausalLM` (GLM-4.7-Flash): latent attention, DeepSeek-V3's sigmoid router
    /// with `e_score_correction_bias`, the layer kinds in `mlp_layer_types`.
    Glm4MoeLite { mla: Mla, moe: DeepseekMoe },
    /// `Glm4MoeForCausalLM` (GLM-4.5): grouped-query attention with q/k/v bias and RoPE on the
    /// first `rotary_fraction` of each head, DeepSeek-V3's sigmoid router.
    Glm4Moe {
        moe: DeepseekMoe,
        rotary_fraction: f64,
    },
    /// `Gemma4ForCausalLM` (text): five sliding-window layers of `window` tokens, then a global
    /// one of `global_head_dim` heads whose keys are its values (`attention_k_eq_v`: no v_proj)
    /// with `global_kv_heads` of them; a dense GeGLU MLP in every layer, beside `experts` where
    /// the layers have them; plain-weight norms; tied embeddings; no per-layer inputs.
    Gemma4 {
        window: usize,
        global_head_dim: usize,
        global_kv_heads: usize,
        experts: Option<Gemma4Experts>,
    },
}

/// Multi-head latent attention (`DeepseekV3Attention`): queries through `q_proj`, or through a
/// rank-`q_lora_rank` bottleneck where it is not 0; keys and values expanded from a
/// `kv_lora_rank` latent by `kv_b_proj`; `qk_nope + qk_rope` wide queries and keys (the shape's
/// `head_dim` is `qk_rope`), `v_dim` wide values; as many key/value heads as query heads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mla {
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_dim: usize,
}

/// DeepSeek's mixture: the first `dense_layers` layers a dense MLP of the shape's
/// `intermediate`, the others `experts` routed MLPs of `expert_intermediate`, `per_token` of
/// them per token from the best `kept_groups` of `groups` groups, beside `shared` shared
/// experts (one MLP of `shared · expert_intermediate`); the router's weights times
/// `routed_scaling`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeepseekMoe {
    pub experts: usize,
    pub per_token: usize,
    pub expert_intermediate: usize,
    pub shared: usize,
    pub dense_layers: usize,
    pub groups: usize,
    pub kept_groups: usize,
    pub routed_scaling: f64,
}

/// Gemma 4's mixture: `experts` GeGLU MLPs of `expert_intermediate`, `per_token` per token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemma4Experts {
    pub experts: usize,
    pub per_token: usize,
    pub expert_intermediate: usize,
}

impl Mla {
    /// `qk_nope + qk_rope`: the query and key width.
    fn qk_dim(&self) -> usize {
        self.qk_nope + self.qk_rope
    }
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
    // deepseek-ai/DeepSeek-V3 (its config.json, checked in as
    // docs/configs/deepseek-v3-671b.json): 61 layers, the first 3 dense of 18432; 128 heads,
    // `q_lora_rank` 1536, `kv_lora_rank` 512, qk 128 + 64, v 128; 256 experts of 2048, 8 per
    // token from 4 of 8 groups (renormalised, scaling 2.5), 1 shared; vocab 129280, untied; the
    // multi-token-prediction layer is not drawn. 671 G parameters: for `plan` and pipelines
    // over several GPUs (`pipeline --distinct-layers`).
    shape(
        "deepseek-v3",
        Arch::DeepseekV3 {
            mla: Mla {
                q_lora_rank: 1536,
                kv_lora_rank: 512,
                qk_nope: 128,
                qk_rope: 64,
                v_dim: 128,
            },
            moe: DeepseekMoe {
                experts: 256,
                per_token: 8,
                expert_intermediate: 2048,
                shared: 1,
                dense_layers: 3,
                groups: 8,
                kept_groups: 4,
                routed_scaling: 2.5,
            },
        },
        [7168, 18432, 61, 128, 128, 64, 129280],
        1e4,
    ),
    // deepseek-ai/DeepSeek-V2-Lite (config.json of the release; the same values in NVIDIA
    // Megatron-Bridge's deepseek_v2_lite.yaml and MaxText's deepseek2-16b.yml): 27 layers, the
    // first dense of 10944; 16 heads, `q_lora_rank` null, `kv_lora_rank` 512, qk 128 + 64, v
    // 128; 64 experts of 1408, 6 per token (`greedy`, `norm_topk_prob` false, scaling 1.0), 2
    // shared; vocab 102400, untied; YaRN factor 40 over 4096 with mscale = mscale_all_dim =
    // 0.707, RoPE 1e4.
    shape(
        "deepseek-v2-lite",
        Arch::DeepseekV2 {
            mla: Mla {
                q_lora_rank: 0,
                kv_lora_rank: 512,
                qk_nope: 128,
                qk_rope: 64,
                v_dim: 128,
            },
            moe: DeepseekMoe {
                experts: 64,
                per_token: 6,
                expert_intermediate: 1408,
                shared: 2,
                dense_layers: 1,
                groups: 1,
                kept_groups: 1,
                routed_scaling: 1.0,
            },
        },
        [2048, 10944, 27, 16, 16, 64, 102400],
        1e4,
    ),
    // zai-org/GLM-4.7-Flash (transformers 5.17's `Glm4MoeLiteConfig` defaults are this
    // release's config; RoPE theta 1e6 from the release's config.json as vendored by
    // blap/Mod's glm_4_7_flash/config.py): 47 layers, the first dense of 10240; 20 heads,
    // `q_lora_rank` 768, `kv_lora_rank` 512, qk 192 + 64, v 256; 64 experts of 1536, 4 per token
    // (one group, renormalised, scaling 1.8), 1 shared; vocab 154880, untied.
    shape(
        "glm-4.7-flash",
        Arch::Glm4MoeLite {
            mla: Mla {
                q_lora_rank: 768,
                kv_lora_rank: 512,
                qk_nope: 192,
                qk_rope: 64,
                v_dim: 256,
            },
            moe: DeepseekMoe {
                experts: 64,
                per_token: 4,
                expert_intermediate: 1536,
                shared: 1,
                dense_layers: 1,
                groups: 1,
                kept_groups: 1,
                routed_scaling: 1.8,
            },
        },
        [2048, 10240, 47, 20, 20, 64, 154880],
        1e6,
    ),
    // zai-org/GLM-4.5-Air (transformers 5.17's `Glm4MoeConfig` defaults are this release's
    // config; RoPE 1e6 and the rest confirmed by THUDM slime's glm4.5-106B-A12B.sh): 46
    // layers, the first dense of 10944; 96 query heads, 8 key/value heads of 128, q/k/v bias,
    // no q/k norm, half the head rotary; 128 experts of 1408, 8 per token (one group,
    // renormalised, scaling 1.0), 1 shared; vocab 151552, untied. The release's one
    // multi-token-prediction layer is not loaded (not drawn).
    shape(
        "glm-4.5-air",
        Arch::Glm4Moe {
            moe: DeepseekMoe {
                experts: 128,
                per_token: 8,
                expert_intermediate: 1408,
                shared: 1,
                dense_layers: 1,
                groups: 1,
                kept_groups: 1,
                routed_scaling: 1.0,
            },
            rotary_fraction: 0.5,
        },
        [4096, 10944, 46, 96, 8, 128, 151552],
        1e6,
    ),
    // google/gemma-4-26B-A4B (text_config, as vendored by the Gemma 4 ports' tests, e.g. the
    // Swift `Gemma4MoEConfigTests` and the JAX `GEMMA4_26B_A4B` table: no copy of the
    // release's config.json was found): 30 layers, 5 sliding (1024 tokens, 8 kv heads of 256)
    // then 1 global (2 kv heads of 512, keys = values); 16 query heads; a dense MLP of 2112
    // and 128 experts of 704 with 8 per token in every layer; softcap 30; vocab 262144, tied.
    shape(
        "gemma4-26b-a4b",
        Arch::Gemma4 {
            window: 1024,
            global_head_dim: 512,
            global_kv_heads: 2,
            experts: Some(Gemma4Experts {
                experts: 128,
                per_token: 8,
                expert_intermediate: 704,
            }),
        },
        [2816, 2112, 30, 16, 8, 256, 262144],
        1e6,
    ),
    // google/gemma-4-31B (the same sources): the largest dense Gemma 4 (about 17 GB at W4A16,
    // one H100); 60 layers of the 26B's pattern, 32 query heads, 16 sliding kv heads of 256,
    // 4 global of 512; an MLP of 21504; vocab 262144, tied.
    shape(
        "gemma4-31b",
        Arch::Gemma4 {
            window: 1024,
            global_head_dim: 512,
            global_kv_heads: 4,
            experts: None,
        },
        [5376, 21504, 60, 32, 16, 256, 262144],
        1e6,
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
    // The MLA and DeepSeek-routed families at toy size with the big ones' structure: the first
    // layer dense, then experts beside shared experts.
    shape(
        "tiny-deepseek-v2",
        Arch::DeepseekV2 {
            mla: Mla {
                q_lora_rank: 0,
                kv_lora_rank: 64,
                qk_nope: 32,
                qk_rope: 16,
                v_dim: 32,
            },
            moe: TINY_DEEPSEEK_MOE,
        },
        [256, 512, 3, 4, 4, 16, 2000],
        1e4,
    ),
    shape(
        "tiny-glm4-moe-lite",
        Arch::Glm4MoeLite {
            mla: Mla {
                q_lora_rank: 64,
                kv_lora_rank: 64,
                qk_nope: 48,
                qk_rope: 16,
                v_dim: 64,
            },
            moe: TINY_DEEPSEEK_MOE,
        },
        [256, 512, 3, 4, 4, 16, 2000],
        1e6,
    ),
    shape(
        "tiny-glm4-moe",
        Arch::Glm4Moe {
            moe: TINY_DEEPSEEK_MOE,
            rotary_fraction: 0.5,
        },
        [256, 512, 3, 4, 2, 64, 2000],
        1e6,
    ),
    // Six layers (five sliding, one global), as the big ones' pattern.
    shape(
        "tiny-gemma4",
        Arch::Gemma4 {
            window: 128,
            global_head_dim: 128,
            global_kv_heads: 1,
            experts: None,
        },
        [256, 512, 6, 4, 2, 64, 2000],
        1e6,
    ),
    shape(
        "tiny-gemma4-moe",
        Arch::Gemma4 {
            window: 128,
            global_head_dim: 128,
            global_kv_heads: 1,
            experts: Some(Gemma4Experts {
                experts: 8,
                per_token: 2,
                expert_intermediate: 128,
            }),
        },
        [256, 512, 6, 4, 2, 64, 2000],
        1e6,
    ),
];

const TINY_DEEPSEEK_MOE: DeepseekMoe = DeepseekMoe {
    experts: 8,
    per_token: 2,
    expert_intermediate: 128,
    shared: 1,
    dense_layers: 1,
    groups: 1,
    kept_groups: 1,
    routed_scaling: 1.5,
};

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
            _ => None,
        }
    }

    /// The latent attention of the DeepSeek-V2 and GLM-4.7-Flash shapes.
    fn mla(&self) -> Option<&Mla> {
        match &self.arch {
            Arch::DeepseekV3 { mla, .. }
            | Arch::DeepseekV2 { mla, .. }
            | Arch::Glm4MoeLite { mla, .. } => Some(mla),
            _ => None,
        }
    }

    /// DeepSeek's mixture of the DeepSeek-V2 and GLM shapes.
    fn deepseek_moe(&self) -> Option<&DeepseekMoe> {
        match &self.arch {
            Arch::DeepseekV3 { moe, .. }
            | Arch::DeepseekV2 { moe, .. }
            | Arch::Glm4MoeLite { moe, .. }
            | Arch::Glm4Moe { moe, .. } => Some(moe),
            _ => None,
        }
    }

    /// The routed experts of layer `l` (none in a dense layer): (experts, per token).
    pub fn experts(&self, l: usize) -> Option<(usize, usize)> {
        match self.arch {
            Arch::Qwen3Moe {
                experts, per_token, ..
            } => Some((experts, per_token)),
            Arch::Gemma4 {
                experts: Some(x), ..
            } => Some((x.experts, x.per_token)),
            _ => match (self.shared_moe(), self.deepseek_moe()) {
                (Some(moe), _) => Some((moe.experts, moe.per_token)),
                (_, Some(moe)) if l >= moe.dense_layers => Some((moe.experts, moe.per_token)),
                _ => None,
            },
        }
    }

    /// Decoder layer `l` is a Gemma global (full-attention) layer: every sixth.
    fn is_global(&self, l: usize) -> bool {
        (l + 1).is_multiple_of(6)
    }

    /// (head size, key/value heads, whether it has a v_proj) of layer `l`'s attention: Gemma
    /// 4's global layers have their own, and their keys double as values.
    fn attention_heads(&self, l: usize) -> (usize, usize, bool) {
        match self.arch {
            Arch::Gemma4 {
                global_head_dim,
                global_kv_heads,
                ..
            } if self.is_global(l) => (global_head_dim, global_kv_heads, false),
            _ => (self.head_dim, self.kv_heads, true),
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
        let (head_dim, kv_heads, has_v) = self.attention_heads(l);
        let (q, kv) = (self.heads * head_dim, kv_heads * head_dim);
        let mut out = Vec::new();
        match (self.mla(), self.hybrid()) {
            (Some(mla), _) => {
                let heads = self.heads;
                let a = "self_attn";
                match mla.q_lora_rank {
                    0 => out.push((format!("{a}.q_proj"), heads * mla.qk_dim(), h, true)),
                    rank => out.extend([
                        (format!("{a}.q_a_proj"), rank, h, true),
                        (format!("{a}.q_b_proj"), heads * mla.qk_dim(), rank, true),
                    ]),
                }
                out.extend([
                    (
                        format!("{a}.kv_a_proj_with_mqa"),
                        mla.kv_lora_rank + mla.qk_rope,
                        h,
                        true,
                    ),
                    (
                        format!("{a}.kv_b_proj"),
                        heads * (mla.qk_nope + mla.v_dim),
                        mla.kv_lora_rank,
                        true,
                    ),
                    (format!("{a}.o_proj"), h, heads * mla.v_dim, true),
                ]);
            }
            (_, Some(la)) if self.is_linear_attention(l) => {
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
            (_, hybrid) => {
                // the output gate doubles q_proj: [query; gate] per head
                let q_rows = if hybrid.is_some() { 2 * q } else { q };
                out.extend([
                    ("self_attn.q_proj".to_string(), q_rows, h, true),
                    ("self_attn.k_proj".to_string(), kv, h, true),
                ]);
                if has_v {
                    out.push(("self_attn.v_proj".to_string(), kv, h, true));
                }
                out.push(("self_attn.o_proj".to_string(), h, q, true));
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
            Arch::DeepseekV3 { moe, .. }
            | Arch::DeepseekV2 { moe, .. }
            | Arch::Glm4MoeLite { moe, .. }
            | Arch::Glm4Moe { moe, .. }
                if l >= moe.dense_layers =>
            {
                for e in 0..moe.experts {
                    out.extend(mlp(&format!("mlp.experts.{e}"), moe.expert_intermediate));
                }
                let shared = moe.shared * moe.expert_intermediate;
                out.extend(mlp("mlp.shared_experts", shared));
            }
            Arch::Gemma4 { experts, .. } => {
                // the dense MLP beside the experts (`experts.{e}`, outside `mlp`)
                out.extend(mlp("mlp", self.intermediate));
                for e in 0..experts.map_or(0, |x| x.experts) {
                    let width = experts.map_or(0, |x| x.expert_intermediate);
                    out.extend(mlp(&format!("experts.{e}"), width));
                }
            }
            _ => out.extend(mlp("mlp", self.intermediate)),
        }
        out
    }

    /// The group size of this shape's W4A16 checkpoint: 128 (llm-compressor's examples) where
    /// it divides every quantized Linear's input width, else the largest power of two that
    /// does (GLM-4.5-Air's and DeepSeek-V2-Lite's dense 10944, Gemma 4 26B's 2112 and 704 are
    /// multiples of 64, not of 128; llm-compressor refuses a group that does not divide).
    pub fn w4a16_group(&self) -> usize {
        let widths: Vec<usize> = (0..self.layers.min(6))
            .flat_map(|l| self.linears(l))
            .filter(|&(_, _, _, quantized)| quantized)
            .map(|(_, _, inp, _)| inp)
            .collect();
        [128, 64, 32, 16]
            .into_iter()
            .find(|g| widths.iter().all(|w| w.is_multiple_of(*g)))
            .unwrap_or(8)
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
        if self.mla().is_some() || self.deepseek_moe().is_some() || self.is_gemma4() {
            return self.flops_from_linears(ctx);
        }
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
            _ => 3 * h * self.intermediate,
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

    /// FLOPs of one window of `T = ctx` tokens of the MLA, GLM and Gemma 4 shapes, from their
    /// Linears: 2·T·(the weights a token multiplies: every Linear of the layer, a routed
    /// expert's times `per_token / experts`, the router `H·E`), lm_head `V·H`, and the
    /// attention's two products over the full T×T scores, `2·T²·heads·(qk + v)` (MLA:
    /// `qk_nope + qk_rope` and `v_dim`; else the layer's head size twice).
    fn flops_from_linears(&self, ctx: usize) -> f64 {
        let t = ctx as f64;
        let mut flops = 2.0 * t * (self.vocab * self.hidden) as f64;
        for l in 0..self.layers {
            let routed = self.experts(l);
            let weights: f64 = self
                .linears(l)
                .iter()
                .map(|(name, out, inp, _)| {
                    let w = (out * inp) as f64;
                    let expert = name.starts_with("experts.") || name.starts_with("mlp.experts.");
                    match (expert, routed) {
                        (true, Some((experts, k))) => w * k as f64 / experts as f64,
                        _ => w,
                    }
                })
                .sum();
            let router = routed.map_or(0, |(experts, _)| experts * self.hidden) as f64;
            let (qk, v) = match self.mla() {
                Some(mla) => (mla.qk_dim(), mla.v_dim),
                None => (self.attention_heads(l).0, self.attention_heads(l).0),
            };
            flops += 2.0 * t * (weights + router) + 2.0 * t * t * (self.heads * (qk + v)) as f64;
        }
        flops
    }

    fn is_gemma4(&self) -> bool {
        matches!(self.arch, Arch::Gemma4 { .. })
    }

    /// The embedding doubles as the lm_head (Gemma).
    fn tied(&self) -> bool {
        matches!(self.arch, Arch::Gemma3 { .. } | Arch::Gemma4 { .. })
    }

    /// Norms' stored weight: 1 (`x̂ · w`), or 0 for Gemma's and the Qwen3-Next family's
    /// `x̂ · (1 + w)`: the same scale.
    fn norm_weight(&self) -> f32 {
        match self.arch {
            Arch::Gemma3 { .. } | Arch::Qwen3Next { .. } | Arch::Qwen3_5 { .. } => 0.0,
            Arch::Qwen3_5Moe { .. } => 0.0,
            _ => 1.0,
        }
    }

    /// The stored weight of norm `name`: [`Self::norm_weight`], except Gemma 4's with experts
    /// in the norms that write its residual stream (`post_attention_layernorm`,
    /// `post_feedforward_layernorm`), 2^-16: Gemma normalises the attention's and the
    /// feed-forward's outputs, so the Linears' scales cannot keep them small; as
    /// [`Self::scale_shift`] does for the others, they leave the embeddings as the routers'
    /// input.
    fn norm_value(&self, name: &str) -> f32 {
        let writes_residual =
            name == "post_attention_layernorm" || name == "post_feedforward_layernorm";
        match self.arch {
            Arch::Gemma4 {
                experts: Some(_), ..
            } if writes_residual => 2f32.powi(-16),
            _ => self.norm_weight(),
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
            Arch::Qwen3Moe { .. }
            | Arch::Qwen3Next { .. }
            | Arch::Qwen3_5Moe { .. }
            | Arch::DeepseekV3 { .. }
            | Arch::DeepseekV2 { .. }
            | Arch::Glm4MoeLite { .. }
            | Arch::Glm4Moe { .. }
                if writes_residual =>
            {
                16
            }
            _ => 0,
        }
    }

    /// The norms of decoder layer `l`: (name suffix, size).
    fn norms(&self, l: usize) -> Vec<(&'static str, usize)> {
        let (h, d) = (self.hidden, self.attention_heads(l).0);
        let mut norms = vec![("input_layernorm", h), ("post_attention_layernorm", h)];
        if let Arch::Gemma3 { .. } | Arch::Gemma4 { .. } = self.arch {
            norms.extend([
                ("pre_feedforward_layernorm", h),
                ("post_feedforward_layernorm", h),
            ]);
        }
        if let Arch::Gemma4 {
            experts: Some(_), ..
        } = self.arch
        {
            // the dense MLP's output norm, the experts' input and output norms
            norms.extend([
                ("post_feedforward_layernorm_1", h),
                ("pre_feedforward_layernorm_2", h),
                ("post_feedforward_layernorm_2", h),
            ]);
        }
        match (self.mla(), &self.arch) {
            (Some(mla), _) => {
                norms.push(("self_attn.kv_a_layernorm", mla.kv_lora_rank));
                if mla.q_lora_rank > 0 {
                    norms.push(("self_attn.q_a_layernorm", mla.q_lora_rank));
                }
            }
            // GLM-4.5-Air: `use_qk_norm` false
            (_, Arch::Llama | Arch::Glm4Moe { .. }) => {}
            _ if self.is_linear_attention(l) => {}
            _ => norms.extend([("self_attn.q_norm", d), ("self_attn.k_norm", d)]),
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
            Arch::DeepseekV3 { mla, moe } => {
                let mut c = self.deepseek_config(&moe, Some(&mla));
                extend(
                    &mut c,
                    json!({
                        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                        "rms_norm_eps": 1e-6, "max_position_embeddings": 163840,
                        "norm_topk_prob": true, "rope_interleave": true,
                        "num_nextn_predict_layers": 1,
                        "rope_parameters": {"rope_type": "yarn", "rope_theta": self.rope_theta,
                            "factor": 40.0, "original_max_position_embeddings": 4096,
                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0},
                    }),
                );
                c
            }
            Arch::DeepseekV2 { mla, moe } => {
                let mut c = self.deepseek_config(&moe, Some(&mla));
                extend(
                    &mut c,
                    json!({
                        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                        "rms_norm_eps": 1e-6, "max_position_embeddings": 163840,
                        "topk_method": "greedy", "norm_topk_prob": false, "mlp_bias": false,
                        "rope_parameters": {"rope_type": "yarn", "rope_theta": self.rope_theta,
                            "factor": 40.0, "original_max_position_embeddings": 4096,
                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707,
                            "mscale_all_dim": 0.707},
                    }),
                );
                c
            }
            Arch::Glm4MoeLite { mla, moe } => {
                let mut c = self.deepseek_config(&moe, Some(&mla));
                let kinds: Vec<&str> = (0..self.layers)
                    .map(|l| match l < moe.dense_layers {
                        true => "dense",
                        false => "sparse",
                    })
                    .collect();
                extend(
                    &mut c,
                    json!({
                        "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite",
                        "rms_norm_eps": 1e-5, "max_position_embeddings": 202752,
                        "norm_topk_prob": true, "rope_interleave": true, "mlp_layer_types": kinds,
                        "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
                    }),
                );
                // the class has no `head_dim` (the rotary width is `qk_rope_head_dim`)
                c.as_object_mut().map(|c| c.remove("head_dim"));
                c
            }
            Arch::Glm4Moe {
                moe,
                rotary_fraction,
            } => {
                let mut c = self.deepseek_config(&moe, None);
                extend(
                    &mut c,
                    json!({
                        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
                        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                        "norm_topk_prob": true, "attention_bias": true, "use_qk_norm": false,
                        "partial_rotary_factor": rotary_fraction, "num_nextn_predict_layers": 1,
                        "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                            "partial_rotary_factor": rotary_fraction},
                    }),
                );
                c
            }
            Arch::Gemma4 {
                window,
                global_head_dim,
                global_kv_heads,
                experts,
            } => {
                let layer_types: Vec<&str> = (0..self.layers)
                    .map(|l| match self.is_global(l) {
                        true => "full_attention",
                        false => "sliding_attention",
                    })
                    .collect();
                json!({
                    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
                    "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
                    "sliding_window": window, "layer_types": layer_types,
                    "global_head_dim": global_head_dim,
                    "num_global_key_value_heads": global_kv_heads, "attention_k_eq_v": true,
                    "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": self.vocab,
                    "num_kv_shared_layers": 0, "use_double_wide_mlp": false,
                    "enable_moe_block": experts.is_some(),
                    "num_experts": experts.map(|x| x.experts),
                    "top_k_experts": experts.map(|x| x.per_token),
                    "moe_intermediate_size": experts.map(|x| x.expert_intermediate),
                    "rope_parameters": {
                        "full_attention": {"rope_type": "proportional",
                            "partial_rotary_factor": 0.25, "rope_theta": self.rope_theta},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                    "max_position_embeddings": 262144, "tie_word_embeddings": true,
                    "final_logit_softcapping": 30.0, "attention_bias": false,
                })
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

    /// The keys DeepSeek's mixture and latent attention (`mla`) write, as the DeepSeek-V3
    /// family's configs do: one expert group, the dense layers first.
    fn deepseek_config(&self, moe: &DeepseekMoe, mla: Option<&Mla>) -> serde_json::Value {
        let mut c = json!({
            "hidden_act": "silu", "tie_word_embeddings": false, "attention_bias": false,
            "n_routed_experts": moe.experts, "num_experts_per_tok": moe.per_token,
            "moe_intermediate_size": moe.expert_intermediate, "n_shared_experts": moe.shared,
            "first_k_dense_replace": moe.dense_layers,
            "routed_scaling_factor": moe.routed_scaling, "n_group": moe.groups,
            "topk_group": moe.kept_groups,
        });
        if let Some(mla) = mla {
            let q_lora_rank = match mla.q_lora_rank {
                0 => serde_json::Value::Null,
                rank => json!(rank),
            };
            extend(
                &mut c,
                json!({
                    "q_lora_rank": q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
                    "qk_nope_head_dim": mla.qk_nope, "qk_rope_head_dim": mla.qk_rope,
                    "qk_head_dim": mla.qk_dim(), "v_head_dim": mla.v_dim,
                }),
            );
        }
        c
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

/// What [`Shape::from_config`] refuses the other families with.
const PLANNED_FAMILIES: &str =
    "a plan from the config alone knows DeepSeek-V3, DeepSeek-V2 and GLM-4.7-Flash";

impl Shape {
    /// The shape of a DeepSeek-style model (latent attention, DeepSeek's mixture: DeepSeek-V3,
    /// DeepSeek-V2, GLM-4.7-Flash) from its parsed config, for a memory plan without weights.
    pub fn from_config(c: &ModelConfig) -> Result<Self> {
        use exactscore_server::model::config::{Architecture, MoeRouter};
        let (Some(m), Some(moe)) = (&c.mla, &c.moe) else {
            bail!(
                "{:?}: {PLANNED_FAMILIES} (latent attention and DeepSeek's mixture)",
                c.architecture
            );
        };
        let dense_layers = moe.sparse_layers.iter().take_while(|s| !**s).count();
        if moe.sparse_layers[dense_layers..].iter().any(|s| !s) {
            bail!("sparse_layers: a dense layer after the first sparse one is not planned");
        }
        let (groups, kept_groups, routed_scaling) = match moe.router {
            MoeRouter::SigmoidGrouped {
                n_group,
                topk_group,
                routed_scaling_factor,
            }
            | MoeRouter::SoftmaxGrouped {
                n_group,
                topk_group,
                routed_scaling_factor,
                ..
            } => (n_group, topk_group, routed_scaling_factor),
            MoeRouter::Softmax => (1, 1, 1.0),
        };
        let shared =
            moe.shared_expert_intermediate_size.unwrap_or(0) / moe.expert_intermediate_size;
        let (mla, moe) = (
            Mla {
                q_lora_rank: m.q_lora_rank.unwrap_or(0),
                kv_lora_rank: m.kv_lora_rank,
                qk_nope: m.qk_nope_head_dim,
                qk_rope: m.qk_rope_head_dim,
                v_dim: m.v_head_dim,
            },
            DeepseekMoe {
                experts: moe.num_experts,
                per_token: moe.experts_per_token,
                expert_intermediate: moe.expert_intermediate_size,
                shared,
                dense_layers,
                groups,
                kept_groups,
                routed_scaling,
            },
        );
        let arch = match c.architecture {
            Architecture::DeepseekV3 => Arch::DeepseekV3 { mla, moe },
            Architecture::DeepseekV2 => Arch::DeepseekV2 { mla, moe },
            Architecture::Glm4MoeLite => Arch::Glm4MoeLite { mla, moe },
            other => bail!("{other:?}: {PLANNED_FAMILIES}"),
        };
        Ok(shape(
            "config",
            arch,
            [
                c.hidden_size,
                c.intermediate_size,
                c.num_layers,
                c.num_heads,
                c.num_heads,
                m.qk_rope_head_dim,
                c.vocab_size,
            ],
            c.rope.theta,
        ))
    }

    /// The config this shape's checkpoint in `format` carries, parsed by the loader.
    pub fn model_config(&self, format: &str) -> Result<ModelConfig> {
        let quant = quantization_config(format, &[], self.w4a16_group())?;
        Ok(ModelConfig::from_json(&self.config(quant).to_string())?)
    }

    /// The stored bytes of the embedding, each decoder layer and the head of this shape's
    /// checkpoint in `format` (as [`write`] stores it), without drawing it: what a memory
    /// plan needs. `fp8-block` (DeepSeek-V3's release: e4m3 weights with an f32 scale per
    /// 128×128 block) is counted here only; the random checkpoints have no such format.
    pub fn part_bytes(&self, format: &str) -> Result<PartBytes> {
        let group = self.w4a16_group();
        let linear = |out: usize, inp: usize, quantized: bool| -> Result<usize> {
            Ok(match format {
                _ if format == "bf16" || !quantized => 2 * out * inp,
                "w4a16" => out * inp / 2 + 2 * out * (inp / group) + 16,
                "nvfp4a16" => out * inp / 2 + out * inp / 16 + 4,
                "nvfp4" => out * inp / 2 + out * inp / 16 + 8,
                "fp8" => out * inp + 2 * out,
                "fp8-block" => out * inp + 4 * out.div_ceil(128) * inp.div_ceil(128),
                other => {
                    bail!("unknown format {other} (w4a16, nvfp4, nvfp4a16, fp8, fp8-block, bf16)")
                }
            })
        };
        let h = self.hidden;
        let mut layers = Vec::with_capacity(self.layers);
        for l in 0..self.layers {
            let mut bytes: usize = self.norms(l).iter().map(|(_, size)| 4 * size).sum();
            bytes += match (self.experts(l), &self.arch) {
                // proj, scale, per_expert_scale
                (Some((e, _)), Arch::Gemma4 { .. }) => 2 * (e * h + h + e),
                (
                    Some((e, _)),
                    Arch::DeepseekV3 { .. } | Arch::Glm4MoeLite { .. } | Arch::Glm4Moe { .. },
                ) => 2 * e * h + 4 * e,
                (Some((e, _)), _) => 2 * e * h,
                (None, _) => 0,
            };
            bytes += match self.arch {
                Arch::Gemma4 { .. } => 2,
                Arch::Glm4Moe { .. } => 2 * (self.heads + 2 * self.kv_heads) * self.head_dim,
                _ => 0,
            };
            if let Some(la) = self.hybrid().filter(|_| self.is_linear_attention(l)) {
                let f32_stored = !matches!(self.arch, Arch::Qwen3Next { .. });
                let s = if f32_stored { 4 } else { 2 };
                bytes += 2 * la.conv_dim() * la.conv_kernel + (s + 2) * la.v_heads + s * la.v_dim;
            }
            for (_, out, inp, quantized) in self.linears(l) {
                bytes += linear(out, inp, quantized)?;
            }
            layers.push(bytes as u64);
        }
        // bf16 tables; a tied head counts the embedding again, as `PartBytes::of` does
        let embed = (2 * self.vocab * h) as u64;
        Ok(PartBytes {
            embed,
            layers,
            head: 4 * h as u64 + embed,
        })
    }
}

/// `config` with `keys` added (replacing those it has).
fn extend(config: &mut serde_json::Value, keys: serde_json::Value) {
    for (k, v) in keys.as_object().into_iter().flatten() {
        config[k] = v.clone();
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

/// The `quantization_config` of `format`; `ignore`: the Linears left unquantized; `group`:
/// W4A16's group size.
fn quantization_config(
    format: &str,
    ignore: &[&str],
    group: usize,
) -> Result<Option<serde_json::Value>> {
    let (fmt, weights, input) = match format {
        "bf16" => return Ok(None),
        "w4a16" => (
            "pack-quantized",
            json!({"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": group}),
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
        // Hugging Face FP8 (the official Qwen3 / DeepSeek FP8 releases' layout), whose
        // `modules_to_not_convert` are regexes transformers matches with `re.match`.
        "fp8-block" => {
            let skipped: Vec<&str> = ignore
                .iter()
                .map(|k| k.strip_prefix("re:").unwrap_or(k))
                .collect();
            return Ok(Some(json!({
                "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": skipped
            })));
        }
        other => bail!("unknown format {other} (w4a16, nvfp4, nvfp4a16, fp8, fp8-block, bf16)"),
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
        Arch::Qwen3Moe { .. }
        | Arch::DeepseekV3 { .. }
        | Arch::DeepseekV2 { .. }
        | Arch::Glm4MoeLite { .. }
        | Arch::Glm4Moe { .. } => &["lm_head", "re:.*mlp\\.gate$"],
        Arch::Llama | Arch::Gemma3 { .. } => &["lm_head"],
        // Gemma 4's router (tests/fixtures/gemma4_moe-w4a16-g32/recipe.yaml)
        Arch::Gemma4 { .. } => &["lm_head", "re:.*router\\.proj$"],
        // and, in its Qwen3.5 / Qwen3-Next examples, the shared-expert gate and every
        // `linear_attn` module (tests/fixtures/qwen3_5*/recipe.yaml)
        Arch::Qwen3Next { .. } | Arch::Qwen3_5 { .. } | Arch::Qwen3_5Moe { .. } => &[
            "lm_head",
            "re:.*mlp\\.gate$",
            "re:.*shared_expert_gate$",
            "re:.*linear_attn.*",
        ],
    };
    let group = shape.w4a16_group();
    let config = shape.config(quantization_config(format, ignore, group)?);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut t: HashMap<String, HostTensor> = HashMap::new();
    let f32_bytes = |v: f32| v.to_le_bytes().to_vec();
    let norm = |name: &str, size: usize| {
        constant(Dtype::F32, vec![size], shape.norm_value(name), f32_bytes)
    };
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
    t.insert(format!("{m}.norm.weight"), norm("norm", shape.hidden));
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
            t.insert(format!("{p}.{name}.weight"), norm(name, size));
        }
        // The router, in bf16 like the embeddings: its logits spread the tokens over the
        // experts.
        match (shape.experts(l), &shape.arch) {
            (Some((experts, _)), Arch::Gemma4 { .. }) => {
                // `softmax(proj(norm(x) · scale / √hidden))`, each expert's weight times its
                // `per_expert_scale`: both 1 here
                let ones = |n: usize| constant(Dtype::BF16, vec![n], 1.0, bf16_bytes);
                t.insert(
                    format!("{p}.router.proj.weight"),
                    rng.bf16(vec![experts, shape.hidden]),
                );
                t.insert(format!("{p}.router.scale"), ones(shape.hidden));
                t.insert(format!("{p}.router.per_expert_scale"), ones(experts));
            }
            (Some((experts, _)), arch) => {
                t.insert(
                    format!("{p}.mlp.gate.weight"),
                    rng.bf16(vec![experts, shape.hidden]),
                );
                // DeepSeek-V3's sigmoid router (GLM's) adds a bias to the choice; 0 here
                if let Arch::DeepseekV3 { .. } | Arch::Glm4MoeLite { .. } | Arch::Glm4Moe { .. } =
                    arch
                {
                    t.insert(
                        format!("{p}.mlp.gate.e_score_correction_bias"),
                        constant(Dtype::F32, vec![experts], 0.0, f32_bytes),
                    );
                }
            }
            (None, _) => {}
        }
        if let Arch::Gemma4 { .. } = shape.arch {
            t.insert(
                format!("{p}.layer_scalar"),
                constant(Dtype::BF16, vec![1], 1.0, bf16_bytes),
            );
        }
        if let Arch::Glm4Moe { .. } = shape.arch {
            // `attention_bias`: q/k/v carry one (o_proj never)
            let (q, kv) = (
                shape.heads * shape.head_dim,
                shape.kv_heads * shape.head_dim,
            );
            for (name, width) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                t.insert(format!("{p}.self_attn.{name}.bias"), rng.bf16(vec![width]));
            }
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
                        rng.bf16_in(vec![out, inp / group], 119 - shift..121 - shift, false),
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
                "fp8-block" => {
                    t.insert(
                        format!("{n}.weight"),
                        rng.tensor(Dtype::F8_E4M3, vec![out, inp], |b| fp8_in(b, 1..15, true)),
                    );
                    // Block scales as a trained layer's (absmax / 448: 2^-12..2^-10), in f32
                    // as the releases store them.
                    let blocks = vec![out.div_ceil(128), inp.div_ceil(128)];
                    let scales = rng.bf16_in(blocks.clone(), 115 - shift..117 - shift, false);
                    let data = scales
                        .data
                        .chunks(2)
                        .flat_map(|b| f32_bytes(half::bf16::from_le_bytes([b[0], b[1]]).to_f32()))
                        .collect();
                    t.insert(
                        format!("{n}.weight_scale_inv"),
                        HostTensor {
                            dtype: Dtype::F32,
                            shape: blocks,
                            data,
                        },
                    );
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
        let quant = quantization_config("w4a16", &["lm_head"], shape.w4a16_group()).unwrap();
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
            ("tiny-deepseek-v2", "w4a16"),
            ("tiny-glm4-moe-lite", "w4a16"),
            ("tiny-glm4-moe", "w4a16"),
            ("tiny-gemma4", "w4a16"),
            ("tiny-gemma4-moe", "w4a16"),
            ("tiny-glm4-moe-lite", "fp8"),
            ("tiny-gemma4-moe", "nvfp4"),
        ] {
            let shape = Shape::named(name)?;
            let (config, ckpt) = build(&shape, format, None)?;
            let opts = ModelOptions {
                linear: LinearOptions {
                    device: Device::Cpu,
                    dtype: DType::F32,
                    activation_quant: ActivationQuantMode::Emulate,
                    kv_cache: Default::default(),
                    fp8_matmul: Default::default(),
                    fused_fp8_scales: Default::default(),
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
            let sparse: Vec<(usize, usize)> =
                (0..shape.layers).filter_map(|l| shape.experts(l)).collect();
            assert_eq!(routes.len(), sparse.len(), "{name}");
            for ((_, r), (_, per_token)) in routes.iter().zip(sparse) {
                assert!(r.len() == 16 && r.iter().all(|experts| experts.len() == per_token));
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

    /// The MLA, GLM and Gemma 4 benchmark shapes parse, through the loader's own config parser,
    /// as the published configs their comments cite: zai-org/GLM-4.7-Flash,
    /// deepseek-ai/DeepSeek-V2-Lite, zai-org/GLM-4.5-Air, google/gemma-4-26B-A4B and -31B.
    #[test]
    fn mla_glm_and_gemma4_shapes_are_the_real_models_configs() {
        let mla = |c: &ModelConfig| {
            let m = c.mla.as_ref().unwrap();
            (
                m.q_lora_rank,
                m.kv_lora_rank,
                m.qk_nope_head_dim,
                m.qk_rope_head_dim,
                m.v_head_dim,
            )
        };
        let moe = |c: &ModelConfig| {
            let m = c.moe.as_ref().unwrap();
            let dense = m.sparse_layers.iter().take_while(|s| !**s).count();
            (
                m.num_experts,
                m.experts_per_token,
                m.expert_intermediate_size,
                m.shared_expert_intermediate_size,
                dense,
            )
        };
        let c = config("glm-4.7-flash");
        assert_eq!(c.architecture, Architecture::Glm4MoeLite);
        assert_eq!(mla(&c), (Some(768), 512, 192, 64, 256));
        assert_eq!(moe(&c), (64, 4, 1536, Some(1536), 1));
        assert_eq!(
            (
                c.hidden_size,
                c.intermediate_size,
                c.num_layers,
                c.num_heads
            ),
            (2048, 10240, 47, 20)
        );
        assert_eq!((c.vocab_size, c.rope.theta), (154880, 1e6));

        let c = config("deepseek-v2-lite");
        assert_eq!(c.architecture, Architecture::DeepseekV2);
        assert_eq!(mla(&c), (None, 512, 128, 64, 128));
        assert_eq!(moe(&c), (64, 6, 1408, Some(2816), 1));
        assert!(!c.moe.as_ref().unwrap().norm_topk_prob);
        assert_eq!(
            (
                c.hidden_size,
                c.intermediate_size,
                c.num_layers,
                c.num_heads
            ),
            (2048, 10944, 27, 16)
        );
        assert!(matches!(c.rope.scaling, RopeScaling::Yarn { .. }));

        let c = config("glm-4.5-air");
        assert_eq!(c.architecture, Architecture::Glm4Moe);
        assert_eq!(moe(&c), (128, 8, 1408, Some(1408), 1));
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (96, 8, 128));
        assert_eq!((c.rotary_dim, c.rope.theta), (64, 1e6));
        assert!(c.qkv_bias && !c.o_bias && !c.qk_norm);
        assert_eq!(
            (c.hidden_size, c.num_layers, c.vocab_size),
            (4096, 46, 151552)
        );

        for (name, hidden, layers, heads, global_kv, experts) in [
            ("gemma4-26b-a4b", 2816, 30, (16, 8), 2, Some((128, 8, 704))),
            ("gemma4-31b", 5376, 60, (32, 16), 4, None),
        ] {
            let c = config(name);
            assert_eq!(c.architecture, Architecture::Gemma4, "{name}");
            assert_eq!((c.hidden_size, c.num_layers), (hidden, layers));
            assert_eq!((c.num_heads, c.vocab_size), (heads.0, 262144));
            assert_eq!(c.final_logit_softcapping, Some(30.0));
            assert!(c.tie_word_embeddings);
            let g = c.gemma4.as_ref().unwrap();
            assert!(g.per_layer_input.is_none());
            for (l, layer) in g.layers.iter().enumerate() {
                let global = (l + 1) % 6 == 0;
                let expected = match global {
                    true => (false, 512, global_kv, true),
                    false => (true, 256, heads.1, false),
                };
                assert_eq!(
                    (
                        layer.sliding,
                        layer.head_dim,
                        layer.num_kv_heads,
                        layer.keys_as_values
                    ),
                    expected,
                    "{name} layer {l}"
                );
            }
            let moe = g
                .moe
                .as_ref()
                .map(|m| (m.num_experts, m.top_k, m.intermediate_size));
            assert_eq!(moe, experts, "{name}");
        }
        // llm-compressor's group of 128 does not divide 10944, 2112 or 704
        let groups: Vec<usize> = [
            "glm-4.7-flash",
            "deepseek-v2-lite",
            "glm-4.5-air",
            "gemma4-26b-a4b",
            "gemma4-31b",
        ]
        .iter()
        .map(|n| Shape::named(n).unwrap().w4a16_group())
        .collect();
        assert_eq!(groups, [128, 64, 64, 64, 128]);
    }

    /// `part_bytes` (a memory plan's counts, no weights drawn) equals the stored bytes the
    /// loader's placement reads from the drawn checkpoint, part by part.
    #[test]
    fn part_bytes_are_the_drawn_checkpoints() -> Result<()> {
        use exactscore_server::model::placement::PartBytes;
        for (name, format) in [
            ("tiny-deepseek-v2", "w4a16"),
            ("tiny-glm4-moe-lite", "fp8"),
            ("tiny-glm4-moe", "nvfp4"),
            ("tiny-gemma4-moe", "w4a16"),
            ("tiny-gemma4", "bf16"),
            ("tiny-qwen3-next", "w4a16"),
            ("tiny-moe", "nvfp4a16"),
            ("tiny", "w4a16"),
        ] {
            let shape = Shape::named(name)?;
            let (config, ckpt) = build(&shape, format, None)?;
            assert_eq!(
                shape.part_bytes(format)?,
                PartBytes::of(&config, &ckpt),
                "{name} {format}"
            );
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
