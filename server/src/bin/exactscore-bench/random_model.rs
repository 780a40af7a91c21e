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
}

#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    pub name: &'static str,
    pub arch: Arch,
    pub hidden: usize,
    /// The dense MLP's (Qwen3-MoE's config carries one too; its layers are all sparse here).
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

    /// (name suffix, out, in) of every Linear in one decoder layer (every expert's).
    fn linears(&self) -> Vec<(String, usize, usize)> {
        let (h, q, kv) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        );
        let mut out = vec![
            ("self_attn.q_proj".to_string(), q, h),
            ("self_attn.k_proj".to_string(), kv, h),
            ("self_attn.v_proj".to_string(), kv, h),
            ("self_attn.o_proj".to_string(), h, q),
        ];
        let mlp = |prefix: &str, i: usize| {
            [
                (format!("{prefix}.gate_proj"), i, h),
                (format!("{prefix}.up_proj"), i, h),
                (format!("{prefix}.down_proj"), h, i),
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
            Arch::Llama | Arch::Gemma3 { .. } => out.extend(mlp("mlp", self.intermediate)),
        }
        out
    }

    /// Matmul FLOPs of one window: 2·(weights a token multiplies)·T for the Linears (the
    /// router and `per_token` experts of a sparse layer; lm_head included) plus the two
    /// attention products over the full T×T score matrix (what the implementation computes).
    pub fn flops_per_window(&self, ctx: usize) -> f64 {
        let q = self.heads * self.head_dim;
        let attention = 2 * self.hidden * (q + self.kv_heads * self.head_dim);
        let mlp = match self.arch {
            Arch::Qwen3Moe {
                experts,
                per_token,
                expert_intermediate,
            } => self.hidden * (experts + 3 * per_token * expert_intermediate),
            Arch::Llama | Arch::Gemma3 { .. } => 3 * self.hidden * self.intermediate,
        };
        let linear = ((attention + mlp) * self.layers + self.vocab * self.hidden) as f64;
        let t = ctx as f64;
        2.0 * linear * t + 4.0 * self.layers as f64 * t * t * q as f64
    }

    /// The embedding doubles as the lm_head (Gemma).
    fn tied(&self) -> bool {
        matches!(self.arch, Arch::Gemma3 { .. })
    }

    /// Norms' stored weight: 1 (`x̂ · w`), or 0 for Gemma's `x̂ · (1 + w)`: the same scale.
    fn norm_weight(&self) -> f32 {
        match self.arch {
            Arch::Gemma3 { .. } => 0.0,
            Arch::Llama | Arch::Qwen3Moe { .. } => 1.0,
        }
    }

    /// The norms of one decoder layer: (name suffix, size).
    /// Binary orders of magnitude by which decoder Linear `name`'s scales are drawn below a
    /// trained layer's: 16 for the Linears that write a mixture's residual stream (`o_proj`,
    /// the experts' `down_proj`), else 0. With a trained layer's scales the random layers add a
    /// component common to every position (their attention is near uniform), the router sees
    /// nearly one state for every token, and a 2048-token window reaches about 20 of 128
    /// experts per layer, where a trained router reaches nearly all. Scaled below the
    /// residual's bf16 resolution, these layers leave each token's embedding as the router's
    /// input, and the random router spreads the tokens over the experts as a trained one does.
    /// The kernels' work does not depend on the values (the mantissas stay random).
    fn scale_shift(&self, name: &str) -> u16 {
        let writes_residual = name.ends_with("o_proj") || name.ends_with("down_proj");
        match self.arch {
            Arch::Qwen3Moe { .. } if writes_residual => 16,
            _ => 0,
        }
    }

    fn norms(&self) -> Vec<(&'static str, usize)> {
        let (h, d) = (self.hidden, self.head_dim);
        let mut norms = vec![("input_layernorm", h), ("post_attention_layernorm", h)];
        if let Arch::Gemma3 { .. } = self.arch {
            norms.extend([
                ("pre_feedforward_layernorm", h),
                ("post_feedforward_layernorm", h),
            ]);
        }
        if self.arch != Arch::Llama {
            norms.extend([("self_attn.q_norm", d), ("self_attn.k_norm", d)]);
        }
        norms
    }

    /// config.json of this shape, as transformers 5 writes it (transformers loads it), with
    /// `quant` as its `quantization_config`.
    fn config(&self, quant: Option<serde_json::Value>) -> serde_json::Value {
        let mut config = json!({
            "vocab_size": self.vocab, "hidden_size": self.hidden,
            "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim, "dtype": "bfloat16", "quantization_config": quant,
        });
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
        };
        for (k, v) in extra.as_object().into_iter().flatten() {
            config[k] = v.clone();
        }
        config
    }
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
/// copy of layer `l % distinct`): a 70B bf16 model in seconds instead of minutes, for timings
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
    };
    let config = shape.config(quantization_config(format, ignore)?);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut t: HashMap<String, HostTensor> = HashMap::new();
    let f32_bytes = |v: f32| v.to_le_bytes().to_vec();
    let norm = |size: usize| constant(Dtype::F32, vec![size], shape.norm_weight(), f32_bytes);
    t.insert(
        "model.embed_tokens.weight".into(),
        rng.bf16(vec![shape.vocab, shape.hidden]),
    );
    if !shape.tied() {
        t.insert(
            "lm_head.weight".into(),
            rng.bf16(vec![shape.vocab, shape.hidden]),
        );
    }
    t.insert("model.norm.weight".into(), norm(shape.hidden));
    let drawn = distinct.unwrap_or(shape.layers).clamp(1, shape.layers);
    for l in 0..shape.layers {
        let p = format!("model.layers.{l}");
        if l >= drawn {
            let source = format!("model.layers.{}.", l % drawn);
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
        for (name, size) in shape.norms() {
            t.insert(format!("{p}.{name}.weight"), norm(size));
        }
        if let Arch::Qwen3Moe { experts, .. } = shape.arch {
            // The router, in bf16 like the embeddings: its logits spread the tokens over the
            // experts.
            t.insert(
                format!("{p}.mlp.gate.weight"),
                rng.bf16(vec![experts, shape.hidden]),
            );
        }
        for (name, out, inp) in shape.linears() {
            let n = format!("{p}.{name}");
            let shift = shape.scale_shift(&name);
            match format {
                "bf16" => {
                    t.insert(format!("{n}.weight"), rng.bf16(vec![out, inp]));
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
    /// real loader and scores a window longer than Gemma's sliding window.
    #[test]
    fn tiny_moe_and_gemma3_load_and_score() -> Result<()> {
        for (name, format) in [
            ("tiny-moe", "w4a16"),
            ("tiny-gemma3", "w4a16"),
            ("tiny-moe", "fp8"),
        ] {
            let shape = Shape::named(name)?;
            let (config, ckpt) = build(&shape, format, None)?;
            let opts = ModelOptions {
                linear: LinearOptions {
                    device: Device::Cpu,
                    dtype: DType::F32,
                    activation_quant: ActivationQuantMode::Emulate,
                },
                max_seq_len: 300,
                attention: AttentionKernel::Auto,
            };
            let model = Model::from_checkpoint(config, &ckpt, &opts)?;
            let tokens: Vec<u32> = (0..300).map(|i| (i * 7919 % shape.vocab) as u32).collect();
            let scores = model.score(&[ScoreInput {
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
            match shape.arch {
                Arch::Qwen3Moe { per_token, .. } => {
                    assert_eq!(routes.len(), shape.layers);
                    assert!(routes.iter().all(|(_, r)| r.len() == 16
                        && r.iter().all(|experts| experts.len() == per_token)));
                }
                _ => assert!(routes.is_empty()),
            }
        }
        Ok(())
    }
}
