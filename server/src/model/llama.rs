//! The Llama block family (Llama, Mistral, Qwen2, Qwen3) for prefill scoring. Sequences of a
//! batch are concatenated along the token axis for every Linear; attention runs per sequence,
//! so a sequence's result does not depend on what shares its batch.

use std::path::Path;

use candle_core::{DType, Device, Module, Result, Tensor, D};

use super::checkpoint::{read_to_string, Checkpoint, LoadError};
use super::config::{Architecture, ModelConfig};
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

struct RmsNorm {
    weight: Tensor,
    eps: f64,
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
        Ok(Self { weight, eps: 0.0 })
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
}

struct Mlp {
    gate_proj: QuantLinear,
    up_proj: QuantLinear,
    down_proj: QuantLinear,
}

struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

pub struct Model {
    config: ModelConfig,
    opts: ModelOptions,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: QuantLinear,
    rope: RopeTables,
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
fn flash_attention_available(device: &Device, head_dim: usize, dtype: DType) -> bool {
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
    quant: Option<QuantizationConfig>,
    opts: &'a LinearOptions,
}

impl LinearLoader<'_> {
    fn load(
        &self,
        name: &str,
        shape: (usize, usize),
        bias: bool,
    ) -> std::result::Result<QuantLinear, LoadError> {
        let scheme = match &self.quant {
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

    /// Builds the model from an opened checkpoint (files or memory).
    pub fn from_checkpoint(
        config: ModelConfig,
        ckpt: &Checkpoint,
        opts: &ModelOptions,
    ) -> std::result::Result<Self, LoadError> {
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
        let lin = &opts.linear;
        let loader = LinearLoader {
            ckpt,
            quant,
            opts: lin,
        };
        let c = &config;
        let (h, kv_dim, q_dim) = (
            c.hidden_size,
            c.num_kv_heads * c.head_dim,
            c.num_heads * c.head_dim,
        );
        // On the CPU first: converted there to the compute dtype (no GPU conversion kernel).
        let stored_embed = ckpt.tensor(
            "model.embed_tokens.weight",
            SCALE_DTYPES,
            Some(&[c.vocab_size, h]),
            &Device::Cpu,
        )?;
        let embed_tokens = stored_embed.to_dtype(lin.dtype)?.to_device(&lin.device)?;
        let o_bias = c.attention_bias
            && matches!(c.architecture, Architecture::Llama | Architecture::Mistral);
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            let head_norm = |which: &str| -> std::result::Result<Option<RmsNorm>, LoadError> {
                c.qk_norm
                    .then(|| {
                        RmsNorm::load(ckpt, &format!("{p}.self_attn.{which}"), c.head_dim, lin)
                    })
                    .transpose()
                    .map(|n| n.map(|n| n.with_eps(c.rms_norm_eps)))
            };
            layers.push(DecoderLayer {
                input_layernorm: RmsNorm::load(ckpt, &format!("{p}.input_layernorm"), h, lin)?
                    .with_eps(c.rms_norm_eps),
                self_attn: Attention {
                    q_proj: loader.load(
                        &format!("{p}.self_attn.q_proj"),
                        (q_dim, h),
                        c.attention_bias,
                    )?,
                    k_proj: loader.load(
                        &format!("{p}.self_attn.k_proj"),
                        (kv_dim, h),
                        c.attention_bias,
                    )?,
                    v_proj: loader.load(
                        &format!("{p}.self_attn.v_proj"),
                        (kv_dim, h),
                        c.attention_bias,
                    )?,
                    o_proj: loader.load(&format!("{p}.self_attn.o_proj"), (h, q_dim), o_bias)?,
                    q_norm: head_norm("q_norm")?,
                    k_norm: head_norm("k_norm")?,
                    num_heads: c.num_heads,
                    num_kv_heads: c.num_kv_heads,
                    head_dim: c.head_dim,
                    sliding_window: c.sliding_window,
                },
                post_attention_layernorm: RmsNorm::load(
                    ckpt,
                    &format!("{p}.post_attention_layernorm"),
                    h,
                    lin,
                )?
                .with_eps(c.rms_norm_eps),
                mlp: Mlp {
                    gate_proj: loader.load(
                        &format!("{p}.mlp.gate_proj"),
                        (c.intermediate_size, h),
                        c.mlp_bias,
                    )?,
                    up_proj: loader.load(
                        &format!("{p}.mlp.up_proj"),
                        (c.intermediate_size, h),
                        c.mlp_bias,
                    )?,
                    down_proj: loader.load(
                        &format!("{p}.mlp.down_proj"),
                        (h, c.intermediate_size),
                        c.mlp_bias,
                    )?,
                },
            });
        }
        let norm = RmsNorm::load(ckpt, "model.norm", h, lin)?.with_eps(c.rms_norm_eps);
        let lm_head = if c.tie_word_embeddings && !ckpt.contains("lm_head.weight") {
            // The tied head keeps the stored dtype, as an untied dense head does.
            let weight = if stored_embed.dtype() == lin.dtype {
                embed_tokens.clone()
            } else {
                stored_embed.to_device(&lin.device)?
            };
            QuantLinear::new(Box::new(DenseWeight::from_tensor(weight)), None)
        } else {
            loader.load("lm_head", (c.vocab_size, h), false)?
        };
        ckpt.refuse_unread(c.architecture.hf_name())?;
        let freqs = inv_freq(c.head_dim, c.rope_theta, &c.rope_scaling);
        let rope = RopeTables::new(&freqs, opts.max_seq_len.max(1), lin.dtype, &lin.device)?;
        let mut model = Self {
            config,
            opts: opts.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
        };
        model.set_attention(opts.attention)?;
        Ok(model)
    }

    /// Switches the attention kernel; `Flash` is refused where the kernel does not exist and
    /// `Auto` resolves to the fastest one that does.
    pub fn set_attention(&mut self, kernel: AttentionKernel) -> std::result::Result<(), LoadError> {
        let lin = &self.opts.linear;
        let flash = flash_attention_available(&lin.device, self.config.head_dim, lin.dtype);
        let kernel = match kernel {
            AttentionKernel::Auto if flash => AttentionKernel::Flash,
            AttentionKernel::Auto => AttentionKernel::Materialized,
            chosen => chosen,
        };
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
            let m = &l.mlp;
            for (n, lin) in [
                ("self_attn.q_proj", &a.q_proj),
                ("self_attn.k_proj", &a.k_proj),
                ("self_attn.v_proj", &a.v_proj),
                ("self_attn.o_proj", &a.o_proj),
                ("mlp.gate_proj", &m.gate_proj),
                ("mlp.up_proj", &m.up_proj),
                ("mlp.down_proj", &m.down_proj),
            ] {
                out.push((format!("model.layers.{i}.{n}"), lin));
            }
        }
        out.push(("lm_head".to_string(), &self.lm_head));
        out
    }

    /// Final-norm hidden states `[sum of lengths, hidden]` of the sequences, concatenated.
    pub fn hidden_states(&self, sequences: &[&[u32]]) -> Result<Tensor> {
        let lens: Vec<usize> = sequences.iter().map(|s| s.len()).collect();
        let longest = lens.iter().copied().max().unwrap_or(0);
        if longest > self.rope.max_len() {
            candle_core::bail!(
                "sequence of {longest} tokens exceeds max_seq_len {}",
                self.rope.max_len()
            );
        }
        let ids: Vec<u32> = sequences.iter().flat_map(|s| s.iter().copied()).collect();
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= self.config.vocab_size) {
            candle_core::bail!(
                "token id {bad} is outside the vocabulary ({})",
                self.config.vocab_size
            );
        }
        let device = &self.opts.linear.device;
        // `set_attention` never leaves `Auto` in the options.
        let flash = match self.opts.attention {
            AttentionKernel::Flash => Some(FlashIndex::new(&lens, self.config.head_dim, device)?),
            AttentionKernel::Materialized | AttentionKernel::Auto => None,
        };
        let batch = BatchLayout { lens, flash };
        let ids = Tensor::new(ids.as_slice(), device)?;
        let mut x = stage("embed", device, || embed(&self.embed_tokens, &ids))?;
        for layer in &self.layers {
            x = layer.forward(x, &batch, &self.rope)?;
        }
        stage("norm", device, || self.norm.forward(&x, None))
    }

    /// Logits `[rows, vocab]` (compute dtype) of final-norm hidden states `[rows, hidden]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        stage("lm_head", hidden.device(), || self.lm_head.forward(hidden))
    }

    /// Scores a batch. Results come back in input order.
    pub fn score(&self, batch: &[ScoreInput<'_>]) -> Result<Vec<SequenceScores>> {
        let sequences: Vec<&[u32]> = batch.iter().map(|b| b.tokens).collect();
        let hidden = self.hidden_states(&sequences)?;
        let mut offset = 0;
        let mut out = Vec::with_capacity(batch.len());
        for input in batch {
            let n = input.tokens.len();
            let mut rows = Vec::with_capacity(n);
            for start in (0..n).step_by(LM_HEAD_CHUNK) {
                let len = LM_HEAD_CHUNK.min(n - start);
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
    fn forward(&self, x: Tensor, batch: &BatchLayout, rope: &RopeTables) -> Result<Tensor> {
        let dev = x.device().clone();
        let dev = &dev;
        // A QDQ that q/k/v (gate/up) share is applied by the norm that feeds them.
        let a = &self.self_attn;
        let attn_qdq = common_qdq(&[&a.q_proj, &a.k_proj, &a.v_proj]);
        let normed = stage("norm", dev, || {
            self.input_layernorm.forward(&x, attn_qdq.flatten())
        })?;
        let x = a.forward(normed, x, attn_qdq.is_some(), batch, rope)?;
        let m = &self.mlp;
        let mlp_qdq = common_qdq(&[&m.gate_proj, &m.up_proj]);
        let normed = stage("norm", dev, || {
            self.post_attention_layernorm.forward(&x, mlp_qdq.flatten())
        })?;
        m.forward(normed, x, mlp_qdq.is_some())
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
const MLP_CHUNK: usize = 2048;

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
            let down_in = stage("silu_mul", dev, || {
                silu_mul(&gate, &up, self.down_proj.activation())
            })?;
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
        let scale = 1.0 / (self.head_dim as f32).sqrt();
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
        let scale = 1.0 / (dim as f64).sqrt();
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
        let scores = (q.matmul(&k.t()?)? * scale)?;
        let mask = causal_mask(len, self.sliding_window, q.device())?;
        let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
        probs
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((len, heads * dim))?
            .to_dtype(dtype)
    }
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
