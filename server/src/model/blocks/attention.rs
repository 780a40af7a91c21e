//! Self-attention over the sequences of a batch, concatenated along the token axis: the q/k/v
//! projections run on the whole batch, attention itself never crosses a sequence boundary.
//! Grouped-query heads, optional per-head q/k norms, sliding windows, a configurable score
//! scale and Gemma 2's soft-capping, Qwen3-Next's per-channel output gate and partial rotary,
//! through the materialised path (every device) or the flash kernel (GPU).

use candle_core::{Device, Result, Tensor};

use super::norm::{NormKind, RmsNorm};
use super::{forward_fp8_rows_all, layer_inputs, Normed};
use crate::checkpoint::LoadError;
use crate::model::config::ModelConfig;
use crate::model::loader::Loader;
use crate::model::profile::stage;
use crate::model::rope::RopeTables;
use crate::ops;
use crate::quant::{forward_quantized_all, shared_input, KvCacheQdq, QuantLinear, SharedInput};

#[derive(Clone)]
pub struct Attention {
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
    /// RoPE rotates the first `rotary_dim` dimensions of each head (NeoX style inside them);
    /// the others pass through (Qwen3-Next's partial rotary).
    rotary_dim: usize,
    /// q_proj yields `[query (head_dim); gate (head_dim)]` per head, and the attention output
    /// is multiplied by `sigmoid(gate)` channel by channel before o_proj (Qwen3-Next, Qwen3.5).
    output_gate: bool,
    /// The KV cache's fp8 QDQ (and FlashAttention 3's of q) after RoPE, where it applies.
    kv_cache: Option<KvCacheQdq>,
    /// gpt-oss's attention sinks `self_attn.sinks` (f32 `[heads]`): one logit per head in
    /// every row's softmax denominator ([`ops::causal_attention`]); never through flash.
    sinks: Option<Tensor>,
}

impl Attention {
    /// The attention of decoder layer `layer`, whose tensors `vb` names (`….self_attn`); the
    /// per-head q/k norms, where the config has them, weigh as `norm` says.
    pub fn load(
        vb: &Loader,
        c: &ModelConfig,
        layer: usize,
        norm: NormKind,
    ) -> std::result::Result<Self, LoadError> {
        let (h, kv_dim, q_dim) = (
            c.hidden_size,
            c.num_kv_heads * c.head_dim,
            c.num_heads * c.head_dim,
        );
        let head_norm = |name: &str| -> std::result::Result<Option<RmsNorm>, LoadError> {
            c.qk_norm
                .then(|| RmsNorm::load(&vb.pp(name), c.head_dim, c.rms_norm_eps, norm))
                .transpose()
        };
        let q_out = if c.attn_output_gate { 2 * q_dim } else { q_dim };
        Ok(Self {
            q_proj: vb.linear("q_proj", (q_out, h), c.qkv_bias)?,
            k_proj: vb.linear("k_proj", (kv_dim, h), c.qkv_bias)?,
            v_proj: vb.linear("v_proj", (kv_dim, h), c.qkv_bias)?,
            o_proj: vb.linear("o_proj", (h, q_dim), c.o_bias)?,
            q_norm: head_norm("q_norm")?,
            k_norm: head_norm("k_norm")?,
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            sliding_window: c.layer_window(layer),
            query_scalar: c.query_pre_attn_scalar.unwrap_or(c.head_dim as f64),
            softcap: c.attn_logit_softcapping,
            local_rope: c
                .sliding_layers
                .as_ref()
                .is_some_and(|s| s.sliding[layer] && s.local_rope.is_some()),
            rotary_dim: c.rotary_dim,
            output_gate: c.attn_output_gate,
            kv_cache: vb.kv_cache(c.num_kv_heads)?,
            sinks: c
                .attention_sinks
                .then(|| {
                    let device = &vb.options().device;
                    vb.get_as("sinks", &[c.num_heads], candle_core::DType::F32, device)
                })
                .transpose()?,
        })
    }

    /// vLLM's fp8 KV cache on post-RoPE `q`, `k` and `v` (head axis 1): k and v as
    /// `reshape_and_cache_flash` writes them, q as FlashAttention 3 reads it
    /// (docs/kv-cache.md). `sequences`: the lengths along axis 0, where dynamic scales are
    /// computed per sequence; empty for one sequence.
    fn kv_cache_qdq(
        &self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        sequences: &[usize],
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let Some(qdq) = &self.kv_cache else {
            return Ok((q, k, v));
        };
        let each = |x: &Tensor, scales: &ops::HeadScales| -> Result<Tensor> {
            if *scales != ops::HeadScales::AbsMax || sequences.len() <= 1 {
                return ops::fp8_head_qdq(x, 1, scales);
            }
            let mut parts = Vec::with_capacity(sequences.len());
            let mut start = 0;
            for &len in sequences {
                parts.push(ops::fp8_head_qdq(&x.narrow(0, start, len)?, 1, scales)?);
                start += len;
            }
            Tensor::cat(&parts, 0)
        };
        stage("kv_cache", &q.device().clone(), || {
            Ok((
                each(&q, &qdq.query)?,
                each(&k, &qdq.key)?,
                each(&v, &qdq.value)?,
            ))
        })
    }

    /// Whether this layer rotates with the local RoPE tables.
    pub fn local_rope(&self) -> bool {
        self.local_rope
    }

    /// What the norm that feeds q, k and v may apply for them ([`shared_input`]).
    pub fn shared_input(&self) -> SharedInput<'_> {
        shared_input(&[&self.q_proj, &self.k_proj, &self.v_proj])
    }

    /// The projections with their names.
    pub fn linears(&self) -> [(&'static str, &QuantLinear); 4] {
        [
            ("q_proj", &self.q_proj),
            ("k_proj", &self.k_proj),
            ("v_proj", &self.v_proj),
            ("o_proj", &self.o_proj),
        ]
    }

    /// [`Self::linears`], to replace one (`/diff`'s module attribution).
    pub fn linears_mut(&mut self) -> [(&'static str, &mut QuantLinear); 4] {
        [
            ("q_proj", &mut self.q_proj),
            ("k_proj", &mut self.k_proj),
            ("v_proj", &mut self.v_proj),
            ("o_proj", &mut self.o_proj),
        ]
    }

    /// `residual` plus the attention of `input` (`[tokens of all sequences, hidden]`, normed
    /// for [`Self::shared_input`]); attention never crosses sequence boundaries.
    pub fn forward(
        &self,
        input: Normed,
        residual: Tensor,
        batch: &BatchLayout,
        rope: &RopeTables,
    ) -> Result<Tensor> {
        let dev = input.device().clone();
        let dev = &dev;
        let qkv = [&self.q_proj, &self.k_proj, &self.v_proj];
        let (x, prequantized) = match input {
            Normed::Fp8(rows) => {
                let [q, k, v] = stage("qkv_proj", dev, || forward_fp8_rows_all(qkv, &rows))?;
                drop(rows);
                return self.attend_and_project(q, k, v, residual, batch, rope);
            }
            Normed::Rows { x, prequantized } => (x, prequantized),
        };
        let [q_in, k_in, v_in] = layer_inputs(qkv, &x, prequantized)?;
        drop(x);
        let [q, k, v] = stage("qkv_proj", dev, || {
            // one at a time unless they share an fp8 quantization (as the MLP's gate and up)
            if !self.q_proj.on_fp8_tensor_cores() {
                return Ok([
                    self.q_proj.forward_quantized(&q_in)?,
                    self.k_proj.forward_quantized(&k_in)?,
                    self.v_proj.forward_quantized(&v_in)?,
                ]);
            }
            forward_quantized_all([
                (&self.q_proj, &q_in),
                (&self.k_proj, &k_in),
                (&self.v_proj, &v_in),
            ])
        })?;
        drop((q_in, k_in, v_in));
        self.attend_and_project(q, k, v, residual, batch, rope)
    }

    /// `residual` plus o_proj of the attention of the projected q, k and v.
    fn attend_and_project(
        &self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        residual: Tensor,
        batch: &BatchLayout,
        rope: &RopeTables,
    ) -> Result<Tensor> {
        let dev = q.device().clone();
        let dev = &dev;
        let (q, gate) = match self.output_gate {
            true => stage("output_gate", dev, || self.split_gate(q))?,
            false => (q, None),
        };
        let out = match &batch.flash {
            Some(index) => self.flash_attend(q, k, v, index, &batch.lens, rope)?,
            None => stage("attention", dev, || {
                self.attend_each_sequence(&q, &k, &v, batch, rope)
            })?,
        };
        let out = match gate {
            // in the compute dtype, as transformers multiplies
            Some(gate) => stage("output_gate", dev, || out * ops::sigmoid(&gate)?)?,
            None => out,
        };
        let [o_in] = layer_inputs([&self.o_proj], &out, false)?;
        stage("o_proj", dev, || {
            self.o_proj.add_to_residual(residual, &o_in)
        })
    }

    /// q_proj's output `[tokens, heads * 2 * head_dim]` split per head into the queries and the
    /// output gate, each `[tokens, heads * head_dim]`, where the layer has the gate.
    fn split_gate(&self, q: Tensor) -> Result<(Tensor, Option<Tensor>)> {
        if !self.output_gate {
            return Ok((q, None));
        }
        let (tokens, (heads, dim)) = (q.dims()[0], (self.num_heads, self.head_dim));
        let q = q.reshape((tokens, heads, 2 * dim))?;
        let half = |start| -> Result<Tensor> {
            q.narrow(2, start, dim)?
                .contiguous()?
                .reshape((tokens, heads * dim))
        };
        Ok((half(0)?, Some(half(dim)?)))
    }

    /// The materialised path, one sequence at a time; returns `[tokens, heads * head_dim]`.
    fn attend_each_sequence(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        batch: &BatchLayout,
        rope: &RopeTables,
    ) -> Result<Tensor> {
        let mut outputs = Vec::with_capacity(batch.lens.len());
        let mut offset = 0;
        for &len in &batch.lens {
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
            let (q, k, v) = self.kv_cache_qdq(q, k, v, &[])?;
            outputs.push(self.attend(&q, &k, &v, batch.blocks)?);
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
            Some(rope) => ops::rotate_leading(&x, self.rotary_dim, |x| rope.apply(x)),
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
        lens: &[usize],
        rope: &RopeTables,
    ) -> Result<Tensor> {
        let tokens = q.dims()[0];
        let split = |x: Tensor, heads: usize| x.reshape((tokens, heads, self.head_dim));
        let (cos, sin) = rope.tables();
        let v = split(v, self.num_kv_heads)?;
        let dev = q.device().clone();
        // the per-head norms, where the model has them, and RoPE
        let (q, k) = stage("rope", &dev, || {
            let rotate = |x: Tensor, heads, norm: Option<&RmsNorm>| {
                let norm = norm.map(|n| (n.weight(), n.eps()));
                let x = split(x, heads)?;
                ops::head_norm_rope(&x, norm, self.rotary_dim, &index.positions, cos, sin)
            };
            Ok((
                rotate(q, self.num_heads, self.q_norm.as_ref())?,
                rotate(k, self.num_kv_heads, self.k_norm.as_ref())?,
            ))
        })?;
        let (q, k, v) = self.kv_cache_qdq(q, k, v, lens)?;
        if self.sinks.is_some() {
            candle_core::bail!(
                "flash attention has no attention sinks (gpt-oss attends materialized)"
            );
        }
        let opts = ops::FlashOptions {
            // in f32, as before the scale became configurable (same bits on the GPU)
            scale: 1.0 / (self.query_scalar as f32).sqrt(),
            window: self.sliding_window,
            tiling: index.tiling,
        };
        stage("attention", &dev, || {
            ops::flash_attention(&q, &k, &v, &index.starts, index.max_len, &opts)
        })
    }

    /// Causal softmax attention for one sequence (see [`ops::causal_attention`]); returns
    /// `[len, heads * head_dim]`.
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        blocks: ops::AttentionBlocks,
    ) -> Result<Tensor> {
        let (_, heads, len, dim) = q.dims4()?;
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
        let window = self.sliding_window;
        let sinks = self.sinks.as_ref();
        ops::causal_attention(q, &k, &v, scale, self.softcap, sinks, window, blocks)?
            .transpose(1, 2)?
            .reshape((len, heads * dim))
    }
}

/// Where the sequences of a batch lie on the concatenated token axis.
pub struct BatchLayout {
    lens: Vec<usize>,
    /// How the materialised path cuts each sequence's attention.
    blocks: ops::AttentionBlocks,
    /// Present when attention runs through the flash kernel, which reads the layout from the
    /// device.
    flash: Option<FlashIndex>,
}

impl BatchLayout {
    /// The lengths of the sequences, in batch order.
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// How the materialised path cuts each sequence's attention.
    pub fn blocks(&self) -> ops::AttentionBlocks {
        self.blocks
    }

    /// Where the flash kernel reads the batch's layout, when attention runs through it.
    pub(super) fn flash(&self) -> Option<&FlashIndex> {
        self.flash.as_ref()
    }

    /// Sequences of lengths `lens` on `device`; `flash`: attention runs through the flash
    /// kernel (for heads of `head_dim`), else in `blocks`.
    pub fn new(
        lens: &[usize],
        flash: bool,
        blocks: ops::AttentionBlocks,
        head_dim: usize,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self {
            lens: lens.to_vec(),
            blocks,
            flash: flash
                .then(|| FlashIndex::new(lens, head_dim, device))
                .transpose()?,
        })
    }
}

/// The batch layout as the flash kernel reads it (i32, on the device).
pub(super) struct FlashIndex {
    /// Prefix offsets of the sequences, `[sequences + 1]`.
    pub(super) starts: Tensor,
    /// Every token's position within its sequence (indexes the RoPE tables).
    pub(super) positions: Tensor,
    pub(super) max_len: usize,
    /// The kernel variant for this device, resolved once per forward rather than per layer.
    pub(super) tiling: ops::FlashTiling,
}

impl FlashIndex {
    fn new(lens: &[usize], head_dim: usize, device: &Device) -> Result<Self> {
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
            tiling: ops::FlashTiling::for_device(head_dim, device)?,
        })
    }
}
