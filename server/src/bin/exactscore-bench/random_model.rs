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

pub struct Shape {
    pub name: &'static str,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub vocab: usize,
    pub rope_theta: f64,
}

impl Shape {
    pub fn named(name: &str) -> Option<Self> {
        let (hidden, intermediate, layers, heads, kv_heads, vocab, rope_theta) = match name {
            "llama3-8b" => (4096, 14336, 32, 32, 8, 128256, 500000.0),
            "llama3-70b" => (8192, 28672, 80, 64, 8, 128256, 500000.0),
            "mistral-large-123b" => (12288, 28672, 88, 96, 8, 32768, 1000000.0),
            "tiny" => (256, 512, 2, 4, 2, 2000, 500000.0),
            _ => return None,
        };
        let name = match name {
            "llama3-8b" => "llama3-8b",
            "llama3-70b" => "llama3-70b",
            "mistral-large-123b" => "mistral-large-123b",
            _ => "tiny",
        };
        Some(Self {
            name,
            hidden,
            intermediate,
            layers,
            heads,
            kv_heads,
            vocab,
            rope_theta,
        })
    }

    fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// (name suffix, out, in) of every Linear in one decoder layer.
    fn linears(&self) -> [(&'static str, usize, usize); 7] {
        let (h, i, kv) = (
            self.hidden,
            self.intermediate,
            self.kv_heads * self.head_dim(),
        );
        [
            ("self_attn.q_proj", h, h),
            ("self_attn.k_proj", kv, h),
            ("self_attn.v_proj", kv, h),
            ("self_attn.o_proj", h, h),
            ("mlp.gate_proj", i, h),
            ("mlp.up_proj", i, h),
            ("mlp.down_proj", h, i),
        ]
    }

    /// Matmul FLOPs of one window: 2·params·T for the Linears (lm_head included) plus the two
    /// attention products over the full T×T score matrix (what the implementation computes).
    pub fn flops_per_window(&self, ctx: usize) -> f64 {
        let per_layer: usize = self.linears().iter().map(|(_, o, i)| o * i).sum();
        let linear = (per_layer * self.layers + self.vocab * self.hidden) as f64;
        let t = ctx as f64;
        2.0 * linear * t + 4.0 * self.layers as f64 * t * t * self.hidden as f64
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

fn quantization_config(format: &str) -> Result<Option<serde_json::Value>> {
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
        "ignore": ["lm_head"]
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
    let quant = quantization_config(format)?;
    let config = json!({
        "architectures": ["LlamaForCausalLM"], "vocab_size": shape.vocab, "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": shape.rope_theta, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "dtype": "bfloat16", "quantization_config": quant,
    });
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut t: HashMap<String, HostTensor> = HashMap::new();
    let f32_bytes = |v: f32| v.to_le_bytes().to_vec();
    t.insert(
        "model.embed_tokens.weight".into(),
        rng.bf16(vec![shape.vocab, shape.hidden]),
    );
    t.insert(
        "lm_head.weight".into(),
        rng.bf16(vec![shape.vocab, shape.hidden]),
    );
    t.insert(
        "model.norm.weight".into(),
        constant(Dtype::F32, vec![shape.hidden], 1.0f32, f32_bytes),
    );
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
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            t.insert(
                format!("{p}.{norm}.weight"),
                constant(Dtype::F32, vec![shape.hidden], 1.0f32, f32_bytes),
            );
        }
        for (name, out, inp) in shape.linears() {
            let n = format!("{p}.{name}");
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
                        rng.bf16_in(vec![out, inp / 128], 119..121, false),
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
                        constant(Dtype::F32, vec![1], 20000.0f32, f32_bytes),
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
                        rng.bf16_in(vec![out, 1], 115..117, false),
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
