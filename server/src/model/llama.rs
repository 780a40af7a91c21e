//! The decoder-only models (Llama, Mistral, Qwen2, Qwen3; Qwen3-MoE and Mixtral with
//! [`super::moe`]; Gemma 2 and 3) for prefill scoring. Sequences of a batch are concatenated
//! along the token axis for every Linear; attention runs per sequence, so a sequence's result
//! does not depend on what shares its batch.

use std::ops::Range;
use std::path::Path;

use candle_core::{DType, Device, Module, Result, Tensor, D};

use super::checkpoint::{read_to_string, Checkpoint, LoadError};
use super::config::{Activation, Architecture, ModelConfig};
use super::moe::{Moe, Route};
use super::profile::stage;
use super::rope::{inv_freq, RopeTables};
use super::scoring::{score_logits, SequenceScores};
use crate::quant::dense::DenseWeight;
use crate::quant::{
    common_qdq, load_linear, quantized_inputs, ActivationQdq, LinearOptions, QuantLinear,
    QuantizationConfig, SCALE_DTYPES,
};

/// How to materialise a model.
#[derive(Debug, Clone)]
pub struct ModelOptions {
    pub linear: LinearOptions,
    /// Longest sequence that will be scored (sizes the RoPE tables).
    pub max_seq_len: usize,
    pub attention: AttentionKernel,
}

/// How attention runs. `Materialized` computes the `[heads, T, T]` scores in f32 (every device
/// and dtype; the exact f32 path); `Flash` is the fused GPU kernel (CUDA, bf16/f16 compute,
/// head_dim 64 or 128), refused at load anywhere else. `Auto` (the default) takes `Flash` where
/// it exists and `Materialized` elsewhere; the model reports which one it resolved to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    #[default]
    Auto,
    Materialized,
    Flash,
}

/// One sequence to score.
#[derive(Debug, Clone, Copy)]
pub struct ScoreInput<'a> {
    pub tokens: &'a [u32],
    pub top_k: usize,
}

/// Rows of the lm_head processed at once, so that `[rows, vocab]` f32 logits stay small.
pub(crate) const LM_HEAD_CHUNK: usize = 1024;

/// The lm_head rows of one scoring chunk for a vocabulary: [`LM_HEAD_CHUNK`], fewer where the
/// vocabulary is so large that the f32 logits would pass 512 MiB (Gemma's 262k: 512 rows).
pub(crate) fn lm_head_rows(vocab: usize) -> usize {
    ((1 << 27) / vocab.max(1)).clamp(16, LM_HEAD_CHUNK)
}

struct RmsNorm {
    weight: Tensor,
    eps: f64,
    /// Gemma's norm: `weight` holds `1 + w` in f32, the product is taken in f32 and rounded once.
    gemma: bool,
}

impl RmsNorm {
    fn load(
        ckpt: &Checkpoint,
        name: &str,
        dim: usize,
        opts: &LinearOptions,
    ) -> std::result::Result<Self, LoadError> {
        let weight = ckpt.tensor_as(
            &format!("{name}.weight"),
            SCALE_DTYPES,
            Some(&[dim]),
            opts.dtype,
            &opts.device,
        )?;
        Ok(Self {
            weight,
            eps: 0.0,
            gemma: false,
        })
    }

    /// Gemma's `(1 + w)` norm of `name`: `1 + w` computed in f32 on the CPU, kept in f32.
    fn load_gemma(
        ckpt: &Checkpoint,
        name: &str,
        dim: usize,
        eps: f64,
        opts: &LinearOptions,
    ) -> std::result::Result<Self, LoadError> {
        let w = ckpt.tensor_as(
            &format!("{name}.weight"),
            SCALE_DTYPES,
            Some(&[dim]),
            DType::F32,
            &Device::Cpu,
        )?;
        Ok(Self {
            weight: (w + 1.0)?.to_device(&opts.device)?,
            eps,
            gemma: true,
        })
    }

    /// The norm of decoder-layer block `name` in the model's convention.
    fn load_for(
        ckpt: &Checkpoint,
        name: &str,
        dim: usize,
        c: &ModelConfig,
        opts: &LinearOptions,
    ) -> std::result::Result<Self, LoadError> {
        if c.architecture.is_gemma() {
            Self::load_gemma(ckpt, name, dim, c.rms_norm_eps, opts)
        } else {
            Ok(Self::load(ckpt, name, dim, opts)?.with_eps(c.rms_norm_eps))
        }
    }

    fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// transformers' LlamaRMSNorm (normalise in f32, cast back, then scale by the weight),
    /// put through `qdq` (the activation QDQ of the Linears that read it) when there is one.
    /// One kernel on a GPU, which rounds the norm once instead of twice (identical in f32;
    /// closer to f32 in bf16/f16) and applies a per-token fp8 QDQ in the same pass.
    fn forward(&self, x: &Tensor, qdq: Option<&ActivationQdq>) -> Result<Tensor> {
        if self.gemma {
            return finish_qdq(self.gemma_reference(x)?, qdq, false);
        }
        let fused = qdq_fused_in_kernel(qdq, x.device());
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let normed = crate::cuda::rms_norm(x, &self.weight, self.eps as f32, fused)?;
            return finish_qdq(normed, qdq, fused);
        }
        finish_qdq(self.reference(x)?, qdq, fused)
    }

    /// The CPU path, op by op as transformers runs it.
    fn reference(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let x32 = x.to_dtype(DType::F32)?;
        let variance = x32.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = x32.broadcast_mul(&(variance + self.eps)?.sqrt()?.recip()?)?;
        normed.to_dtype(dtype)?.broadcast_mul(&self.weight)
    }

    /// transformers' GemmaRMSNorm: normalise in f32, multiply by `1 + w` in f32, cast back.
    /// (Candle ops on every device: the fused GPU kernel rounds the weight to the compute dtype.)
    fn gemma_reference(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let x32 = x.to_dtype(DType::F32)?;
        let variance = x32.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = x32.broadcast_mul(&(variance + self.eps)?.sqrt()?.recip()?)?;
        normed.broadcast_mul(&self.weight)?.to_dtype(dtype)
    }
}

struct Attention {
    q_proj: QuantLinear,
    k_proj: QuantLinear,
    v_proj: QuantLinear,
    o_proj: QuantLinear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    sliding_window: Option<usize>,
    /// Scores are scaled by `1 / sqrt(this)`: `head_dim`, or Gemma's `query_pre_attn_scalar`.
    query_scalar: f64,
    /// Gemma 2's `cap * tanh(scores / cap)` before the mask.
    softcap: Option<f64>,
    /// Rotates with the local RoPE tables (Gemma 3's sliding layers).
    local_rope: bool,
}

struct Mlp {
    gate_proj: QuantLinear,
    up_proj: QuantLinear,
    down_proj: QuantLinear,
    act: Activation,
}

/// The feed-forward of a decoder layer.
enum FeedForward {
    Dense(Mlp),
    Sparse(Moe),
}

/// Gemma's extra norms: on the attention output, before and after the feed-forward (then
/// `post_attention_layernorm` is the first of them, not the feed-forward's input norm).
struct GemmaNorms {
    post_attention: RmsNorm,
    pre_feedforward: RmsNorm,
    post_feedforward: RmsNorm,
}

struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    /// The feed-forward's input norm (Llama's `post_attention_layernorm`); unused with `gemma`.
    post_attention_layernorm: Option<RmsNorm>,
    gemma: Option<GemmaNorms>,
    mlp: FeedForward,
}

pub struct Model {
    config: ModelConfig,
    /// `linear.device` is the first stage's device.
    opts: ModelOptions,
    /// On the first stage's device.
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    /// `norm` and `lm_head` are on the last stage's device.
    norm: RmsNorm,
    lm_head: QuantLinear,
    stages: Vec<Stage>,
    /// Gemma scales the embeddings by `sqrt(hidden)`, rounded to the compute dtype.
    embed_scale: Option<f64>,
}

/// A run of consecutive decoder layers on one device: a pipeline stage of the model.
struct Stage {
    device: Device,
    layers: Range<usize>,
    /// The RoPE tables on this stage's device.
    rope: RopeTables,
    /// The sliding layers' tables where they differ (Gemma 3's local base).
    local_rope: Option<RopeTables>,
}

/// Where the sequences of a batch lie on the concatenated token axis.
struct BatchLayout {
    lens: Vec<usize>,
    /// Present when attention runs through the flash kernel, which reads the layout from the
    /// device.
    flash: Option<FlashIndex>,
}

/// The batch layout as the flash kernel reads it (i32, on the device). Only a CUDA build reads
/// it: without the feature `Flash` is refused at load.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct FlashIndex {
    /// Prefix offsets of the sequences, `[sequences + 1]`.
    starts: Tensor,
    /// Every token's position within its sequence (indexes the RoPE tables).
    positions: Tensor,
    max_len: usize,
    /// The kernel variant for this device, resolved once per forward rather than per layer.
    #[cfg(feature = "cuda")]
    tiling: crate::cuda::FlashTiling,
}

impl FlashIndex {
    fn new(lens: &[usize], head_dim: usize, device: &Device) -> Result<Self> {
        #[cfg(not(feature = "cuda"))]
        let _ = head_dim; // only the GPU kernels have variants
        let starts: Vec<i32> = std::iter::once(0)
            .chain(lens.iter().scan(0, |end, &len| {
                *end += len as i32;
                Some(*end)
            }))
            .collect();
        let positions: Vec<i32> = lens.iter().flat_map(|&len| 0..len as i32).collect();
        Ok(Self {
            starts: Tensor::new(starts.as_slice(), device)?,
            positions: Tensor::new(positions.as_slice(), device)?,
            max_len: lens.iter().copied().max().unwrap_or(0),
            #[cfg(feature = "cuda")]
            tiling: crate::cuda::FlashTiling::for_device(head_dim, device)?,
        })
    }
}

/// Whether the fused flash-attention kernel exists for this device, head size and dtype.
pub(crate) fn flash_attention_available(device: &Device, head_dim: usize, dtype: DType) -> bool {
    #[cfg(feature = "cuda")]
    {
        device.is_cuda() && crate::cuda::flash_attention_supported(head_dim, dtype)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, head_dim, dtype);
        false
    }
}

/// Loads the Linear modules of a checkpoint, resolving each one's quantization scheme.
struct LinearLoader<'a> {
    ckpt: &'a Checkpoint,
    quant: Option<&'a QuantizationConfig>,
    opts: &'a LinearOptions,
}

impl LinearLoader<'_> {
    fn load(
        &self,
        name: &str,
        shape: (usize, usize),
        bias: bool,
    ) -> std::result::Result<QuantLinear, LoadError> {
        let scheme = match self.quant {
            Some(q) => q.scheme_for(name, "Linear")?,
            None => None,
        };
        load_linear(self.ckpt, name, shape, bias, scheme, self.opts)
    }
}

impl Model {
    /// Loads the checkpoint directory `dir` (config.json + safetensors).
    pub fn load(dir: &Path, opts: &ModelOptions) -> std::result::Result<Self, LoadError> {
        let config = ModelConfig::from_json(&read_to_string(&dir.join("config.json"))?)?;
        Self::from_checkpoint(config, &Checkpoint::open(dir)?, opts)
    }

    /// Builds the model from an opened checkpoint (files or memory), all on
    /// `opts.linear.device`.
    pub fn from_checkpoint(
        config: ModelConfig,
        ckpt: &Checkpoint,
        opts: &ModelOptions,
    ) -> std::result::Result<Self, LoadError> {
        let all = vec![(opts.linear.device.clone(), 0..config.num_layers)];
        Self::from_checkpoint_placed(config, ckpt, opts, all)
    }

    /// Builds the model as pipeline stages: `stages[k]` = (device, the decoder layers it
    /// holds), consecutive ranges covering every layer. The embedding goes with the first
    /// stage, the final norm and the lm_head with the last; `opts.linear.device` is ignored.
    pub fn from_checkpoint_placed(
        config: ModelConfig,
        ckpt: &Checkpoint,
        opts: &ModelOptions,
        stages: Vec<(Device, Range<usize>)>,
    ) -> std::result::Result<Self, LoadError> {
        check_stages(&stages, config.num_layers)?;
        let stage_options = |k: usize| LinearOptions {
            device: stages[k].0.clone(),
            ..opts.linear.clone()
        };
        let (first, last) = (stage_options(0), stage_options(stages.len() - 1));
        let quant = config
            .quantization_config
            .as_ref()
            .map(QuantizationConfig::parse)
            .transpose()?;
        if let Some(q) = &quant {
            if q.scheme_for("model.embed_tokens", "Embedding")?.is_some() {
                return Err(LoadError::Unsupported {
                    layer: "model.embed_tokens".into(),
                    field: "config_groups.targets".into(),
                    reason: "quantized embeddings are not supported".into(),
                });
            }
        }
        let c = &config;
        let base = text_prefix(ckpt, c.architecture);
        let h = c.hidden_size;
        // On the CPU first: converted there to the compute dtype (no GPU conversion kernel).
        let stored_embed = ckpt.tensor(
            &format!("{base}embed_tokens.weight"),
            SCALE_DTYPES,
            Some(&[c.vocab_size, h]),
            &Device::Cpu,
        )?;
        let embed_tokens = stored_embed
            .to_dtype(first.dtype)?
            .to_device(&first.device)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for (k, (_, range)) in stages.iter().enumerate() {
            let lin = stage_options(k);
            let loader = LinearLoader {
                ckpt,
                quant: quant.as_ref(),
                opts: &lin,
            };
            for i in range.clone() {
                layers.push(DecoderLayer::load(
                    ckpt,
                    &loader,
                    c,
                    &format!("{base}layers.{i}"),
                    i,
                )?);
            }
        }
        let norm = RmsNorm::load_for(ckpt, &format!("{base}norm"), h, c, &last)?;
        let head_name = match base.strip_suffix("model.") {
            Some(outer) if !outer.is_empty() => format!("{outer}lm_head"), // language_model.lm_head
            _ => "lm_head".to_string(),
        };
        let lm_head = if c.tie_word_embeddings && !ckpt.contains(&format!("{head_name}.weight")) {
            // The tied head keeps the stored dtype, as an untied dense head does; it shares the
            // embedding's memory where both are one tensor on one device.
            let weight = if stored_embed.dtype() == last.dtype && stages.len() == 1 {
                embed_tokens.clone()
            } else {
                stored_embed.to_device(&last.device)?
            };
            QuantLinear::new(Box::new(DenseWeight::from_tensor(weight)), None)
        } else {
            LinearLoader {
                ckpt,
                quant: quant.as_ref(),
                opts: &last,
            }
            .load(&head_name, (c.vocab_size, h), false)?
        };
        ckpt.refuse_unread(c.architecture.hf_name(), c.architecture.unread_prefixes())?;
        let max_len = opts.max_seq_len.max(1);
        let freqs = inv_freq(c.head_dim, c.rope_theta, &c.rope_scaling);
        let local_freqs = c
            .sliding_layers
            .as_ref()
            .and_then(|s| s.local_rope.as_ref())
            .map(|(theta, scaling)| inv_freq(c.head_dim, *theta, scaling));
        let stages = stages
            .into_iter()
            .map(|(device, layers)| {
                let tables = |f: &[f32]| RopeTables::new(f, max_len, first.dtype, &device);
                let rope = tables(&freqs)?;
                let local_rope = local_freqs.as_deref().map(tables).transpose()?;
                // Weights were copied on this thread's stream; the stage computes on its own.
                device.synchronize()?;
                Ok(Stage {
                    device,
                    layers,
                    rope,
                    local_rope,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed_scale = c
            .architecture
            .is_gemma()
            .then(|| (c.hidden_size as f64).sqrt());
        let mut model = Self {
            config,
            opts: ModelOptions {
                linear: first,
                ..opts.clone()
            },
            embed_tokens,
            layers,
            norm,
            lm_head,
            stages,
            embed_scale,
        };
        model.set_attention(opts.attention)?;
        Ok(model)
    }
}

/// `stages` cover `0..layers` with consecutive, non-empty ranges.
fn check_stages(
    stages: &[(Device, Range<usize>)],
    layers: usize,
) -> std::result::Result<(), LoadError> {
    let mut next = 0;
    let mut in_order = !stages.is_empty();
    for (_, range) in stages {
        in_order &= range.start == next && !range.is_empty();
        next = range.end;
    }
    if !in_order || next != layers {
        return Err(LoadError::config(
            "layer split",
            format!(
                "stages {:?} do not cover the {layers} decoder layers in order, each with at \
                 least one",
                stages.iter().map(|(_, r)| r.clone()).collect::<Vec<_>>()
            ),
        ));
    }
    Ok(())
}

/// Where the text model's tensors sit: `model.` (`model.embed_tokens`, `model.layers.N`), or,
/// in a Gemma 3 vision-language checkpoint, `model.language_model.` (transformers 5) or
/// `language_model.model.` (4.x).
fn text_prefix(ckpt: &Checkpoint, architecture: Architecture) -> String {
    if architecture == Architecture::Gemma3Multimodal {
        for prefix in ["model.language_model.", "language_model.model."] {
            if ckpt.contains(&format!("{prefix}embed_tokens.weight")) {
                return prefix.to_string();
            }
        }
    }
    "model.".to_string()
}

impl DecoderLayer {
    /// Decoder layer `i`, whose tensors are named `{p}.*`.
    fn load(
        ckpt: &Checkpoint,
        loader: &LinearLoader<'_>,
        c: &ModelConfig,
        p: &str,
        i: usize,
    ) -> std::result::Result<Self, LoadError> {
        let lin = loader.opts;
        let (h, kv_dim, q_dim) = (
            c.hidden_size,
            c.num_kv_heads * c.head_dim,
            c.num_heads * c.head_dim,
        );
        let o_bias = c.attention_bias
            && matches!(c.architecture, Architecture::Llama | Architecture::Mistral);
        let norm =
            |name: &str, dim: usize| RmsNorm::load_for(ckpt, &format!("{p}.{name}"), dim, c, lin);
        let head_norm = |which: &str| -> std::result::Result<Option<RmsNorm>, LoadError> {
            c.qk_norm
                .then(|| norm(&format!("self_attn.{which}"), c.head_dim))
                .transpose()
        };
        let linear = |name: &str, shape: (usize, usize), bias: bool| {
            loader.load(&format!("{p}.{name}"), shape, bias)
        };
        let self_attn = Attention {
            q_proj: linear("self_attn.q_proj", (q_dim, h), c.attention_bias)?,
            k_proj: linear("self_attn.k_proj", (kv_dim, h), c.attention_bias)?,
            v_proj: linear("self_attn.v_proj", (kv_dim, h), c.attention_bias)?,
            o_proj: linear("self_attn.o_proj", (h, q_dim), o_bias)?,
            q_norm: head_norm("q_norm")?,
            k_norm: head_norm("k_norm")?,
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            sliding_window: c.layer_window(i),
            query_scalar: c.query_pre_attn_scalar.unwrap_or(c.head_dim as f64),
            softcap: c.attn_logit_softcapping,
            local_rope: c
                .sliding_layers
                .as_ref()
                .is_some_and(|s| s.sliding[i] && s.local_rope.is_some()),
        };
        let mlp = match &c.moe {
            Some(moe) if c.is_sparse_layer(i) => {
                let load = |name: &str, shape| loader.load(name, shape, false);
                FeedForward::Sparse(Moe::load(ckpt, &load, c, moe, p, lin)?)
            }
            _ => FeedForward::Dense(Mlp {
                gate_proj: linear("mlp.gate_proj", (c.intermediate_size, h), c.mlp_bias)?,
                up_proj: linear("mlp.up_proj", (c.intermediate_size, h), c.mlp_bias)?,
                down_proj: linear("mlp.down_proj", (h, c.intermediate_size), c.mlp_bias)?,
                act: c.hidden_act,
            }),
        };
        let (post_attention_layernorm, gemma) = if c.architecture.is_gemma() {
            let gemma = GemmaNorms {
                post_attention: norm("post_attention_layernorm", h)?,
                pre_feedforward: norm("pre_feedforward_layernorm", h)?,
                post_feedforward: norm("post_feedforward_layernorm", h)?,
            };
            (None, Some(gemma))
        } else {
            (Some(norm("post_attention_layernorm", h)?), None)
        };
        Ok(DecoderLayer {
            input_layernorm: norm("input_layernorm", h)?,
            self_attn,
            post_attention_layernorm,
            gemma,
            mlp,
        })
    }
}

impl Model {
    /// Switches the attention kernel; `Flash` is refused where the kernel does not exist and
    /// `Auto` resolves to the fastest one that does.
    pub fn set_attention(&mut self, kernel: AttentionKernel) -> std::result::Result<(), LoadError> {
        let lin = &self.opts.linear;
        // The flash kernel has no soft-capping of the scores (Gemma 2): such models attend
        // through the materialised path.
        let softcap = self.config.attn_logit_softcapping.is_some();
        let flash = !softcap
            && self.stages.iter().all(|stage| {
                flash_attention_available(&stage.device, self.config.head_dim, lin.dtype)
            });
        let kernel = match kernel {
            AttentionKernel::Auto if flash => AttentionKernel::Flash,
            AttentionKernel::Auto => AttentionKernel::Materialized,
            chosen => chosen,
        };
        if kernel == AttentionKernel::Flash && softcap {
            return Err(LoadError::config(
                "attention",
                format!(
                    "the flash kernel cannot soft-cap attention scores ({} has \
                     attn_logit_softcapping); use the materialized kernel",
                    self.config.architecture.hf_name()
                ),
            ));
        }
        if kernel == AttentionKernel::Flash && !flash {
            return Err(LoadError::Config {
                field: "attention".into(),
                reason: format!(
                    "the flash kernel needs a CUDA device, bf16 or f16 compute and head_dim 64 \
                     or 128 (have {:?}, {:?}, head_dim {})",
                    lin.device, lin.dtype, self.config.head_dim
                ),
            });
        }
        self.opts.attention = kernel;
        Ok(())
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn options(&self) -> &ModelOptions {
        &self.opts
    }

    /// Every Linear with its module name, lm_head last.
    pub fn linears(&self) -> Vec<(String, &QuantLinear)> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            let a = &l.self_attn;
            for (n, lin) in [
                ("self_attn.q_proj", &a.q_proj),
                ("self_attn.k_proj", &a.k_proj),
                ("self_attn.v_proj", &a.v_proj),
                ("self_attn.o_proj", &a.o_proj),
            ] {
                out.push((format!("model.layers.{i}.{n}"), lin));
            }
            match &l.mlp {
                FeedForward::Dense(m) => {
                    for (n, lin) in [
                        ("mlp.gate_proj", &m.gate_proj),
                        ("mlp.up_proj", &m.up_proj),
                        ("mlp.down_proj", &m.down_proj),
                    ] {
                        out.push((format!("model.layers.{i}.{n}"), lin));
                    }
                }
                FeedForward::Sparse(moe) => {
                    for (n, lin) in moe.linears() {
                        out.push((format!("model.layers.{i}.mlp.{n}"), lin));
                    }
                }
            }
        }
        out.push(("lm_head".to_string(), &self.lm_head));
        out
    }

    /// Pipeline stages: each holds a run of decoder layers on its own device.
    pub fn stage_count(&self) -> usize {
        self.stages.len()
    }

    /// The device of stage `k`.
    pub fn stage_device(&self, k: usize) -> &Device {
        &self.stages[k].device
    }

    /// The decoder layers of stage `k`.
    pub fn stage_layers(&self, k: usize) -> Range<usize> {
        self.stages[k].layers.clone()
    }

    /// Final-norm hidden states `[sum of lengths, hidden]` of the sequences, concatenated: every
    /// stage in turn on this thread, the hidden state carried from one device to the next.
    pub fn hidden_states(&self, sequences: &[&[u32]]) -> Result<Tensor> {
        self.hidden_states_routed(sequences, None)
    }

    /// The experts every token chose in every sparse layer (`[layer][token]`, tokens of the
    /// sequences concatenated), best first with their routing weights; empty for dense models.
    pub fn expert_routes(&self, sequences: &[&[u32]]) -> Result<Vec<(usize, Vec<Route>)>> {
        let mut routes = Vec::new();
        self.hidden_states_routed(sequences, Some(&mut routes))?;
        Ok(routes)
    }

    fn hidden_states_routed(
        &self,
        sequences: &[&[u32]],
        mut routes: Option<&mut Vec<(usize, Vec<Route>)>>,
    ) -> Result<Tensor> {
        let lens: Vec<usize> = sequences.iter().map(|s| s.len()).collect();
        let mut x = self.embed(sequences)?;
        for k in 0..self.stages.len() {
            if k > 0 {
                x = crate::device::transfer(&x, &self.stages[k].device)?;
            }
            x = self.forward_stage_routed(k, x, &lens, routes.as_deref_mut())?;
        }
        self.final_norm(&x)
    }

    /// The embedded tokens `[sum of lengths, hidden]` on the first stage's device, after
    /// checking every sequence against the model's limits.
    pub fn embed(&self, sequences: &[&[u32]]) -> Result<Tensor> {
        let longest = sequences.iter().map(|s| s.len()).max().unwrap_or(0);
        let max_len = self.stages[0].rope.max_len();
        if longest > max_len {
            candle_core::bail!("sequence of {longest} tokens exceeds max_seq_len {max_len}");
        }
        let ids: Vec<u32> = sequences.iter().flat_map(|s| s.iter().copied()).collect();
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= self.config.vocab_size) {
            candle_core::bail!(
                "token id {bad} is outside the vocabulary ({})",
                self.config.vocab_size
            );
        }
        let device = &self.stages[0].device;
        crate::device::bind(device)?;
        let ids = Tensor::new(ids.as_slice(), device)?;
        stage("embed", device, || {
            let x = embed(&self.embed_tokens, &ids)?;
            match self.embed_scale {
                // the scale rounded to the compute dtype, as transformers multiplies
                Some(s) => x.broadcast_mul(&Tensor::new(s as f32, device)?.to_dtype(x.dtype())?),
                None => Ok(x),
            }
        })
    }

    /// Stage `k`'s decoder layers over the residual stream `x` (on that stage's device) of
    /// sequences of lengths `lens`, concatenated.
    pub fn forward_stage(&self, k: usize, x: Tensor, lens: &[usize]) -> Result<Tensor> {
        self.forward_stage_routed(k, x, lens, None)
    }

    fn forward_stage_routed(
        &self,
        k: usize,
        mut x: Tensor,
        lens: &[usize],
        mut routes: Option<&mut Vec<(usize, Vec<Route>)>>,
    ) -> Result<Tensor> {
        let Stage {
            device,
            layers,
            rope,
            local_rope,
        } = &self.stages[k];
        crate::device::bind(device)?;
        // `set_attention` never leaves `Auto` in the options.
        let flash = match self.opts.attention {
            AttentionKernel::Flash => Some(FlashIndex::new(lens, self.config.head_dim, device)?),
            AttentionKernel::Materialized | AttentionKernel::Auto => None,
        };
        let batch = BatchLayout {
            lens: lens.to_vec(),
            flash,
        };
        for i in layers.clone() {
            let layer = &self.layers[i];
            let rope = match local_rope {
                Some(local) if layer.self_attn.local_rope => local,
                _ => rope,
            };
            let mut layer_routes = Vec::new();
            let record = routes.is_some().then_some(&mut layer_routes);
            x = layer.forward(x, &batch, rope, record)?;
            if let (Some(routes), FeedForward::Sparse(_)) = (routes.as_deref_mut(), &layer.mlp) {
                routes.push((i, layer_routes));
            }
        }
        Ok(x)
    }

    /// The final norm of the last stage's output (on the last stage's device).
    pub fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        crate::device::bind(x.device())?;
        stage("norm", x.device(), || self.norm.forward(x, None))
    }

    /// Logits `[rows, vocab]` (compute dtype) of final-norm hidden states `[rows, hidden]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let logits = stage("lm_head", hidden.device(), || self.lm_head.forward(hidden))?;
        match self.config.final_logit_softcapping {
            // transformers: logits / cap, tanh, * cap, in the logits' dtype
            Some(cap) => stage("softcap", hidden.device(), || softcap(&logits, cap)),
            None => Ok(logits),
        }
    }

    /// Scores a batch. Results come back in input order.
    pub fn score(&self, batch: &[ScoreInput<'_>]) -> Result<Vec<SequenceScores>> {
        let sequences: Vec<&[u32]> = batch.iter().map(|b| b.tokens).collect();
        let hidden = self.hidden_states(&sequences)?;
        self.score_hidden(&hidden, batch)
    }

    /// Scores a batch from its final-norm hidden states (on the last stage's device).
    pub fn score_hidden(
        &self,
        hidden: &Tensor,
        batch: &[ScoreInput<'_>],
    ) -> Result<Vec<SequenceScores>> {
        let mut offset = 0;
        let mut out = Vec::with_capacity(batch.len());
        for input in batch {
            let n = input.tokens.len();
            let mut rows = Vec::with_capacity(n);
            let chunk = lm_head_rows(self.config.vocab_size);
            for start in (0..n).step_by(chunk) {
                let len = chunk.min(n - start);
                let h = hidden.narrow(0, offset + start, len)?;
                let logits = self.logits(&h)?;
                let targets: Vec<Option<u32>> = (start..start + len)
                    .map(|i| input.tokens.get(i + 1).copied())
                    .collect();
                rows.extend(stage("scoring", h.device(), || {
                    score_logits(&logits, &targets, input.top_k)
                })?);
            }
            offset += n;
            out.push(SequenceScores { rows });
        }
        Ok(out)
    }
}

impl DecoderLayer {
    /// The residual stream `x` after this layer. The attention's and the MLP's last Linears add
    /// their outputs into the stream (see [`crate::quant::RowChunks`]); every other tensor is
    /// dropped as soon as it is consumed: the forward's peak memory is what is alive at once.
    /// `routes`: where a sparse layer records every token's experts.
    fn forward(
        &self,
        x: Tensor,
        batch: &BatchLayout,
        rope: &RopeTables,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor> {
        let dev = x.device().clone();
        let dev = &dev;
        // A QDQ that q/k/v (gate/up) share is applied by the norm that feeds them.
        let a = &self.self_attn;
        let attn_qdq = common_qdq(&[&a.q_proj, &a.k_proj, &a.v_proj]);
        let normed = stage("norm", dev, || {
            self.input_layernorm.forward(&x, attn_qdq.flatten())
        })?;
        let x = match &self.gemma {
            // Gemma normalises each block's output before the residual add.
            Some(g) => {
                let out = a.forward(
                    normed,
                    zeros_like_rows(&x)?,
                    attn_qdq.is_some(),
                    batch,
                    rope,
                )?;
                (x + stage("norm", dev, || g.post_attention.forward(&out, None))?)?
            }
            None => a.forward(normed, x, attn_qdq.is_some(), batch, rope)?,
        };
        let ffn_norm = match (&self.gemma, &self.post_attention_layernorm) {
            (Some(g), _) => &g.pre_feedforward,
            (None, Some(n)) => n,
            (None, None) => candle_core::bail!("a decoder layer without a feed-forward norm"),
        };
        let ffn = |normed: Tensor, residual: Tensor, prequantized: bool, routes| match &self.mlp {
            FeedForward::Dense(m) => m.forward(normed, residual, prequantized),
            FeedForward::Sparse(moe) => moe.forward(&normed, residual, routes),
        };
        let qdq = match &self.mlp {
            FeedForward::Dense(m) => common_qdq(&[&m.gate_proj, &m.up_proj]),
            // each expert applies its own input QDQ to its tokens
            FeedForward::Sparse(_) => None,
        };
        let normed = stage("norm", dev, || ffn_norm.forward(&x, qdq.flatten()))?;
        match &self.gemma {
            Some(g) => {
                let out = ffn(normed, zeros_like_rows(&x)?, qdq.is_some(), routes)?;
                x + stage("norm", dev, || g.post_feedforward.forward(&out, None))?
            }
            None => ffn(normed, x, qdq.is_some(), routes),
        }
    }
}

/// The inputs of `linears` from `x`: `x` itself when it has been through their common
/// activation QDQ already (`prequantized`: applied by the kernel that produced it), else each
/// layer's own QDQ.
fn layer_inputs<const N: usize>(
    linears: [&QuantLinear; N],
    x: &Tensor,
    prequantized: bool,
) -> Result<[Tensor; N]> {
    if prequantized {
        return Ok(std::array::from_fn(|_| x.clone()));
    }
    stage("act_qdq", x.device(), || quantized_inputs(linears, x))
}

/// Rows of the MLP input processed at once. The `[rows, intermediate]` activations (gate, up
/// and their product) are the largest tensors of a forward pass (3.5 residual streams each for
/// Llama-3-8B); chunks bound them, while each weight is still dequantized once per forward.
pub(crate) const MLP_CHUNK: usize = 2048;

impl Mlp {
    /// `residual` plus the MLP of `x`. `prequantized`: `x` has been through gate/up's common
    /// activation QDQ.
    fn forward(&self, x: Tensor, residual: Tensor, prequantized: bool) -> Result<Tensor> {
        let dev = x.device();
        let rows = x.dims()[0];
        let (w_gate, w_up) = stage("gate_up_proj", dev, || {
            Ok((
                self.gate_proj.dequantized_like(&x)?,
                self.up_proj.dequantized_like(&x)?,
            ))
        })?;
        let mut w_down = None;
        let mut out = self.down_proj.row_chunks_added_to(residual)?;
        for start in (0..rows).step_by(MLP_CHUNK) {
            let x = x.narrow(0, start, MLP_CHUNK.min(rows - start))?;
            let [gate_in, up_in] =
                layer_inputs([&self.gate_proj, &self.up_proj], &x, prequantized)?;
            let (gate, up) = stage("gate_up_proj", dev, || {
                Ok((
                    self.gate_proj.forward_dequantized(&gate_in, &w_gate)?,
                    self.up_proj.forward_dequantized(&up_in, &w_up)?,
                ))
            })?;
            drop((gate_in, up_in));
            let down_in = match self.act {
                Activation::Silu => stage("silu_mul", dev, || {
                    silu_mul(&gate, &up, self.down_proj.activation())
                })?,
                Activation::GeluTanh => stage("gelu_mul", dev, || {
                    finish_qdq((gate.gelu()? * &up)?, self.down_proj.activation(), false)
                })?,
            };
            drop((gate, up));
            // Dequantized once gate/up of the first chunk are gone (one weight fewer alive).
            let w = match w_down.take() {
                Some(w) => w,
                None => stage("down_proj", dev, || {
                    self.down_proj.dequantized_like(&down_in)
                })?,
            };
            stage("down_proj", dev, || out.push(&down_in, &w))?;
            w_down = Some(w);
        }
        stage("down_proj", dev, || out.finish())
    }
}

impl Attention {
    /// `residual` plus the attention of `x` (`[tokens of all sequences, hidden]`); attention
    /// never crosses sequence boundaries. `prequantized`: `x` has been through q/k/v's common
    /// activation QDQ.
    fn forward(
        &self,
        x: Tensor,
        residual: Tensor,
        prequantized: bool,
        batch: &BatchLayout,
        rope: &RopeTables,
    ) -> Result<Tensor> {
        let dev = x.device().clone();
        let dev = &dev;
        let qkv = [&self.q_proj, &self.k_proj, &self.v_proj];
        let [q_in, k_in, v_in] = layer_inputs(qkv, &x, prequantized)?;
        drop(x);
        let (q, k, v) = stage("qkv_proj", dev, || {
            Ok((
                self.q_proj.forward_quantized(&q_in)?,
                self.k_proj.forward_quantized(&k_in)?,
                self.v_proj.forward_quantized(&v_in)?,
            ))
        })?;
        drop((q_in, k_in, v_in));
        let out = match &batch.flash {
            Some(index) => self.flash_attend(q, k, v, index, rope)?,
            None => stage("attention", dev, || {
                self.attend_each_sequence(&q, &k, &v, &batch.lens, rope)
            })?,
        };
        let [o_in] = layer_inputs([&self.o_proj], &out, false)?;
        stage("o_proj", dev, || {
            self.o_proj.add_to_residual(residual, &o_in)
        })
    }

    /// The materialised path, one sequence at a time; returns `[tokens, heads * head_dim]`.
    fn attend_each_sequence(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        lens: &[usize],
        rope: &RopeTables,
    ) -> Result<Tensor> {
        let mut outputs = Vec::with_capacity(lens.len());
        let mut offset = 0;
        for &len in lens {
            let q = self.heads(
                &q.narrow(0, offset, len)?,
                self.num_heads,
                self.q_norm.as_ref(),
                Some(rope),
            )?;
            let k = self.heads(
                &k.narrow(0, offset, len)?,
                self.num_kv_heads,
                self.k_norm.as_ref(),
                Some(rope),
            )?;
            let v = self.heads(&v.narrow(0, offset, len)?, self.num_kv_heads, None, None)?;
            outputs.push(self.attend(&q, &k, &v)?);
            offset += len;
        }
        Tensor::cat(&outputs, 0)
    }

    /// `[len, heads * head_dim]` → `[1, heads, len, head_dim]`, with optional per-head norm and RoPE.
    fn heads(
        &self,
        x: &Tensor,
        heads: usize,
        norm: Option<&RmsNorm>,
        rope: Option<&RopeTables>,
    ) -> Result<Tensor> {
        let len = x.dims()[0];
        let mut x = x.reshape((len, heads, self.head_dim))?;
        if let Some(norm) = norm {
            x = norm.forward(&x, None)?;
        }
        let x = x.transpose(0, 1)?.contiguous()?.unsqueeze(0)?;
        match rope {
            Some(rope) => rope.apply(&x),
            None => Ok(x),
        }
    }

    /// The whole batch through the fused GPU kernels, in the projections' `[tokens, heads, dim]`
    /// layout: the per-head norms and RoPE (profiled as the stage `rope`), then flash attention;
    /// returns `[tokens, heads * head_dim]`.
    /// Takes q, k and v by value: the unrotated q and k are freed once rotated.
    fn flash_attend(
        &self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        index: &FlashIndex,
        rope: &RopeTables,
    ) -> Result<Tensor> {
        let tokens = q.dims()[0];
        let split = |x: Tensor, heads: usize, norm: Option<&RmsNorm>| -> Result<Tensor> {
            let x = x.reshape((tokens, heads, self.head_dim))?;
            match norm {
                Some(norm) => norm.forward(&x, None),
                None => Ok(x),
            }
        };
        let (cos, sin) = rope.tables();
        let v = split(v, self.num_kv_heads, None)?;
        // in f32, as before the scale became configurable (same bits on the GPU)
        let scale = 1.0 / (self.query_scalar as f32).sqrt();
        #[cfg(feature = "cuda")]
        {
            let dev = q.device().clone();
            // the per-head norms, where the model has them, and RoPE
            let (q, k) = stage("rope", &dev, || {
                let rotate = |x: Tensor, heads, norm| {
                    crate::cuda::rope_rotate_half(
                        &split(x, heads, norm)?,
                        &index.positions,
                        cos,
                        sin,
                    )
                };
                Ok((
                    rotate(q, self.num_heads, self.q_norm.as_ref())?,
                    rotate(k, self.num_kv_heads, self.k_norm.as_ref())?,
                ))
            })?;
            let opts = crate::cuda::FlashOptions {
                scale,
                window: self.sliding_window,
                tiling: index.tiling,
            };
            stage("attention", &dev, || {
                crate::cuda::flash_attention(&q, &k, &v, &index.starts, index.max_len, &opts)
            })
        }
        #[cfg(not(feature = "cuda"))]
        {
            // Unreachable: `Model::from_checkpoint` refuses `Flash` without CUDA.
            let _ = (q, k, v, index, cos, sin, scale, split);
            candle_core::bail!("flash attention needs the `cuda` feature")
        }
    }

    /// Causal softmax attention in f32 for one sequence; returns `[len, heads * head_dim]`.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (_, heads, len, dim) = q.dims4()?;
        let dtype = q.dtype();
        let group = heads / self.num_kv_heads;
        // GQA: query head h reads kv head h / group.
        let repeat = |t: &Tensor| -> Result<Tensor> {
            if group == 1 {
                return Ok(t.clone());
            }
            t.unsqueeze(2)?
                .expand((1, self.num_kv_heads, group, len, dim))?
                .reshape((1, heads, len, dim))
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let scale = 1.0 / self.query_scalar.sqrt();
        #[cfg(feature = "cuda")]
        if q.device().is_cuda() {
            // Scores in f32 (TF32 tensor cores for bf16/f16 inputs, exact there), fused
            // scale + mask + softmax, probabilities in the compute dtype for P·V.
            let (q32, k32) = (q.to_dtype(DType::F32)?, k.to_dtype(DType::F32)?);
            let scores = if dtype == DType::F32 {
                q32.matmul(&k32.t()?)?
            } else {
                crate::cuda::with_tf32(|| q32.matmul(&k32.t()?))?
            };
            // Soft-capped scores are scaled and capped first; the kernel then scales by 1.
            let (scores, scale) = match self.softcap {
                Some(cap) => (softcap(&(scores * scale)?, cap)?, 1.0),
                None => (scores, scale),
            };
            let probs =
                crate::cuda::causal_softmax(&scores, scale as f32, self.sliding_window, dtype)?;
            return probs
                .matmul(&v)?
                .transpose(1, 2)?
                .reshape((len, heads * dim));
        }
        let (q, k, v) = (
            q.to_dtype(DType::F32)?,
            k.to_dtype(DType::F32)?,
            v.to_dtype(DType::F32)?,
        );
        let mut scores = (q.matmul(&k.t()?)? * scale)?;
        if let Some(cap) = self.softcap {
            scores = softcap(&scores, cap)?;
        }
        let mask = causal_mask(len, self.sliding_window, q.device())?;
        let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
        probs
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((len, heads * dim))?
            .to_dtype(dtype)
    }
}

/// `cap * tanh(x / cap)` (Gemma's soft-capping), in `x`'s dtype.
fn softcap(x: &Tensor, cap: f64) -> Result<Tensor> {
    (x / cap)?.tanh()? * cap
}

/// A zero residual stream like `x`: a block whose output must be normed before the residual
/// add (Gemma) adds into it (exactly: 0 + y = y).
fn zeros_like_rows(x: &Tensor) -> Result<Tensor> {
    x.zeros_like()
}

/// Rows `ids` of the embedding table (ids already checked against the vocabulary).
fn embed(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if table.device().is_cuda() {
        return crate::cuda::gather_rows(table, ids);
    }
    table.index_select(ids, 0)
}

/// SwiGLU `silu(gate) * up`, put through `qdq` (the down projection's activation QDQ) when there
/// is one: one kernel on a GPU, which applies a per-token fp8 QDQ in the same pass.
fn silu_mul(gate: &Tensor, up: &Tensor, qdq: Option<&ActivationQdq>) -> Result<Tensor> {
    let fused = qdq_fused_in_kernel(qdq, gate.device());
    #[cfg(feature = "cuda")]
    if gate.device().is_cuda() {
        return finish_qdq(crate::cuda::silu_mul(gate, up, fused)?, qdq, fused);
    }
    let act = (candle_nn::Activation::Silu.forward(gate)? * up)?;
    finish_qdq(act, qdq, fused)
}

/// Whether the GPU kernel that produces a Linear input (RMSNorm, SwiGLU) applies `qdq` in its
/// own pass: the per-token fp8 QDQ, which needs nothing but the row the kernel already holds.
fn qdq_fused_in_kernel(qdq: Option<&ActivationQdq>, device: &Device) -> bool {
    device.is_cuda() && qdq == Some(&ActivationQdq::Fp8PerToken)
}

/// `x` through `qdq`, unless the kernel that produced it applied it already (`fused`).
fn finish_qdq(x: Tensor, qdq: Option<&ActivationQdq>, fused: bool) -> Result<Tensor> {
    match qdq {
        Some(qdq) if !fused => qdq.apply(&x),
        _ => Ok(x),
    }
}

/// `[len, len]` additive mask: 0 where key j is visible from query i, -inf elsewhere.
pub fn causal_mask(len: usize, window: Option<usize>, device: &Device) -> Result<Tensor> {
    let window = window.unwrap_or(usize::MAX);
    let mask: Vec<f32> = (0..len)
        .flat_map(|i| {
            (0..len).map(move |j| {
                if j <= i && i - j < window {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Tensor::from_vec(mask, (len, len), device)
}
