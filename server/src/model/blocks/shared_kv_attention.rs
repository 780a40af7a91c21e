//! Gemma 4's attention: per-head RMSNorms of q, k and v (v's without a weight), unscaled
//! scores, its own head size and key/value heads per layer, values that are the keys'
//! projection (`attention_k_eq_v`), and layers that compute no keys or values but attend to
//! those of an earlier layer (`num_kv_shared_layers`). The layers whose heads fit the flash
//! kernel (the sliding layers' 256, zero-padded where narrower) attend through it when the
//! model attends flash; the wider global heads (512) attend materialized.

use candle_core::{Result, Tensor};

use super::attention::FlashIndex;
use super::norm::{NormKind, RmsNorm};
use super::BatchLayout;
use crate::checkpoint::LoadError;
use crate::model::config::{Gemma4Layer, KeySource, ModelConfig};
use crate::model::loader::Loader;
use crate::model::profile::stage;
use crate::model::rope::RopeTables;
use crate::ops;
use crate::quant::QuantLinear;

#[derive(Clone)]
pub struct SharedKvAttention {
    q_proj: QuantLinear,
    q_norm: RmsNorm,
    /// `None` for a KV-shared layer.
    key_values: Option<KeyValueProjections>,
    o_proj: QuantLinear,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    sliding_window: Option<usize>,
    /// The flash kernel's head size when this layer's heads fit it (zero-padded to it), else
    /// `None`: the layer attends materialized.
    flash_head_dim: Option<usize>,
}

#[derive(Clone)]
struct KeyValueProjections {
    k_proj: QuantLinear,
    /// `None` where the values are the keys' projection.
    v_proj: Option<QuantLinear>,
    k_norm: RmsNorm,
    v_norm: RmsNorm,
}

/// A layer's keys and values, `[tokens, kv_heads * head_dim]` each: normed, not yet rotated.
pub struct KeyValues {
    pub keys: Tensor,
    pub values: Tensor,
}

impl SharedKvAttention {
    /// The attention of decoder layer `layer` (shaped as `shape` says), whose tensors `vb`
    /// names (`….self_attn`).
    pub fn load(
        vb: &Loader,
        c: &ModelConfig,
        layer: usize,
        shape: &Gemma4Layer,
    ) -> std::result::Result<Self, LoadError> {
        vb.refuse_kv_cache("Gemma 4's attention (shared KV layers)")?;
        let (h, d, kv) = (c.hidden_size, shape.head_dim, shape.num_kv_heads);
        let norm =
            |name: &str| RmsNorm::load(&vb.pp(name), d, c.rms_norm_eps, NormKind::WeightInF32);
        let key_values = match shape.keys {
            KeySource::Shared { .. } => None,
            KeySource::Own { .. } => Some(KeyValueProjections {
                k_proj: vb.linear("k_proj", (kv * d, h), c.qkv_bias)?,
                v_proj: match shape.keys_as_values {
                    true => None,
                    false => Some(vb.linear("v_proj", (kv * d, h), c.qkv_bias)?),
                },
                k_norm: norm("k_norm")?,
                v_norm: RmsNorm::unit(d, c.rms_norm_eps, &vb.options().device)?,
            }),
        };
        Ok(Self {
            q_proj: vb.linear("q_proj", (c.num_heads * d, h), c.qkv_bias)?,
            q_norm: norm("q_norm")?,
            key_values,
            o_proj: vb.linear("o_proj", (h, c.num_heads * d), c.o_bias)?,
            num_heads: c.num_heads,
            num_kv_heads: kv,
            head_dim: d,
            sliding_window: c.layer_window(layer),
            flash_head_dim: c.flash_serves_heads(d).then(|| c.attention_head_dim()),
        })
    }

    /// The projections with their names.
    pub fn linears(&self) -> Vec<(&'static str, &QuantLinear)> {
        let mut out = vec![("q_proj", &self.q_proj)];
        if let Some(kv) = &self.key_values {
            out.push(("k_proj", &kv.k_proj));
            out.extend(kv.v_proj.iter().map(|v| ("v_proj", v)));
        }
        out.push(("o_proj", &self.o_proj));
        out
    }

    /// [`Self::linears`], to replace one.
    pub fn linears_mut(&mut self) -> Vec<(&'static str, &mut QuantLinear)> {
        let mut out = vec![("q_proj", &mut self.q_proj)];
        if let Some(kv) = &mut self.key_values {
            out.push(("k_proj", &mut kv.k_proj));
            out.extend(kv.v_proj.iter_mut().map(|v| ("v_proj", v)));
        }
        out.push(("o_proj", &mut self.o_proj));
        out
    }

    /// Per-head `norm` of `x` `[tokens, heads * head_dim]`.
    fn head_norm(&self, x: &Tensor, norm: &RmsNorm) -> Result<Tensor> {
        let (tokens, width) = x.dims2()?;
        let heads = width / self.head_dim;
        norm.forward(&x.reshape((tokens, heads, self.head_dim))?, None)?
            .reshape((tokens, width))
    }

    /// This layer's own keys and values of `x` (normed hidden states); `None` for a KV-shared
    /// layer.
    pub fn key_values(&self, x: &Tensor) -> Result<Option<KeyValues>> {
        let Some(p) = &self.key_values else {
            return Ok(None);
        };
        let dev = x.device();
        stage("qkv_proj", dev, || {
            let keys = p.k_proj.forward(x)?;
            // the values are the keys' projection, normed as values (before k_norm)
            let values = match &p.v_proj {
                Some(v_proj) => v_proj.forward(x)?,
                None => keys.clone(),
            };
            Ok(Some(KeyValues {
                keys: self.head_norm(&keys, &p.k_norm)?,
                values: self.head_norm(&values, &p.v_norm)?,
            }))
        })
    }

    /// The attention output (after o_proj) of `x` (normed hidden states) over `kv` (this
    /// layer's own, or the shared ones).
    pub fn forward(
        &self,
        x: &Tensor,
        kv: &KeyValues,
        batch: &BatchLayout,
        rope: &RopeTables,
    ) -> Result<Tensor> {
        let dev = x.device();
        // the projection is dropped once normed (a global layer's is ~0.27 GB at eight windows)
        let q = self.head_norm(
            &stage("qkv_proj", dev, || self.q_proj.forward(x))?,
            &self.q_norm,
        )?;
        let out = match (batch.flash(), self.flash_head_dim) {
            (Some(index), Some(width)) => self.flash_attend(&q, kv, index, rope, width)?,
            _ => stage("attention", dev, || {
                self.attend_each_sequence(&q, kv, batch, rope)
            })?,
        };
        stage("o_proj", dev, || self.o_proj.forward(&out))
    }

    /// The whole batch through the flash kernel in the projections' `[tokens, heads, dim]`
    /// layout, heads zero-padded to `width` (a padded head attends as the unpadded one: its dot
    /// products gain exact zeros, its output zero columns), RoPE as the materialised path's
    /// tables give it, scores unscaled; returns `[tokens, heads * head_dim]`.
    fn flash_attend(
        &self,
        q: &Tensor,
        kv: &KeyValues,
        index: &FlashIndex,
        rope: &RopeTables,
        width: usize,
    ) -> Result<Tensor> {
        let (dev, tokens, d) = (q.device(), q.dims()[0], self.head_dim);
        let split = |x: &Tensor, heads: usize| x.reshape((tokens, heads, d));
        let pad = |x: Tensor| match width - d {
            0 => Ok(x),
            extra => x.pad_with_zeros(2, 0, extra),
        };
        let (cos, sin) = rope.tables();
        let (q, k) = stage("rope", dev, || {
            let rotate = |x: &Tensor, heads| {
                pad(ops::rope_rotate_half(
                    &split(x, heads)?,
                    &index.positions,
                    cos,
                    sin,
                )?)
            };
            Ok((
                rotate(q, self.num_heads)?,
                rotate(&kv.keys, self.num_kv_heads)?,
            ))
        })?;
        let v = pad(split(&kv.values, self.num_kv_heads)?.contiguous()?)?;
        let opts = ops::FlashOptions {
            scale: 1.0,
            window: self.sliding_window,
            tiling: index.tiling,
        };
        let out = stage("attention", dev, || {
            ops::flash_attention(&q, &k, &v, &index.starts, index.max_len, &opts)
        })?;
        match width - d {
            0 => Ok(out),
            _ => out
                .reshape((tokens, self.num_heads, width))?
                .narrow(2, 0, d)?
                .contiguous()?
                .reshape((tokens, self.num_heads * d)),
        }
    }

    /// `[len, heads * head_dim]` → `[1, heads, len, head_dim]`, rotated where `rope` is given.
    fn heads(&self, x: &Tensor, rope: Option<&RopeTables>) -> Result<Tensor> {
        let (len, width) = x.dims2()?;
        let x = x
            .reshape((len, width / self.head_dim, self.head_dim))?
            .transpose(0, 1)?
            .contiguous()?
            .unsqueeze(0)?;
        match rope {
            Some(rope) => rope.apply(&x),
            None => Ok(x),
        }
    }

    /// The materialised attention, one sequence at a time, each written into its rows of the
    /// output (not collected and concatenated: a second copy of the batch's outputs at the
    /// peak); returns `[tokens, heads * head_dim]`.
    fn attend_each_sequence(
        &self,
        q: &Tensor,
        kv: &KeyValues,
        batch: &BatchLayout,
        rope: &RopeTables,
    ) -> Result<Tensor> {
        let width = self.num_heads * self.head_dim;
        let outputs = Tensor::zeros((q.dims()[0], width), q.dtype(), q.device())?;
        let mut offset = 0;
        let group = self.num_heads / self.num_kv_heads;
        for &len in batch.lens() {
            let q = self.heads(&q.narrow(0, offset, len)?, Some(rope))?;
            let k = self.heads(&kv.keys.narrow(0, offset, len)?, Some(rope))?;
            let v = self.heads(&kv.values.narrow(0, offset, len)?, None)?;
            // GQA: query head h reads kv head h / group.
            let repeat = |t: Tensor| -> Result<Tensor> {
                if group == 1 {
                    return Ok(t);
                }
                t.unsqueeze(2)?
                    .expand((1, self.num_kv_heads, group, len, self.head_dim))?
                    .reshape((1, self.num_heads, len, self.head_dim))
            };
            let (k, v) = (repeat(k)?, repeat(v)?);
            let out = ops::causal_attention(
                &q,
                &k,
                &v,
                1.0,
                None,
                None,
                self.sliding_window,
                batch.blocks(),
            )?;
            let out = out.transpose(1, 2)?.reshape((len, width))?;
            outputs.slice_set(&out, 0, offset)?;
            offset += len;
        }
        Ok(outputs)
    }
}
