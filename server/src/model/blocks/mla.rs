//! Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, Mistral 4), as transformers'
//! `DeepseekV3Attention` computes it (Mistral 4's then scales the queries by position). The
//! queries come from `q_proj`, or from a low-rank `q_a_proj` → RMSNorm → `q_b_proj`; keys and
//! values from one latent per token (`kv_a_proj_with_mqa` → RMSNorm → `kv_b_proj`), whose last
//! `qk_rope_head_dim` features are a rotary key part that every head shares. For scoring there is no cache to keep small, so the
//! latent is expanded to per-head keys (`qk_nope + qk_rope` features) and values
//! (`v_head_dim`). Where the batch attends through the flash kernel, the heads are zero-padded
//! to its head size ([`ModelConfig::attention_head_dim`]: DeepSeek's 192-wide keys and 128-wide
//! values both to 192), which adds exact zeros to every score and only zero columns to the
//! output; elsewhere attention runs materialised ([`ops::causal_attention`] takes a value head
//! of any width), one sequence at a time.

use candle_core::{Result, Tensor};

use super::attention::{BatchLayout, FlashIndex};
use super::norm::{NormKind, RmsNorm};
use super::{forward_fp8_rows_all, layer_inputs, Normed};
use crate::checkpoint::LoadError;
use crate::model::config::{MlaConfig, ModelConfig};
use crate::model::loader::Loader;
use crate::model::profile::stage;
use crate::model::rope::RopeTables;
use crate::ops;
use crate::quant::{shared_input, QuantLinear, SharedInput};

/// The latent norms are built with `DeepseekV3RMSNorm`'s default eps, not `rms_norm_eps`.
const LATENT_NORM_EPS: f64 = 1e-6;

#[derive(Clone)]
pub struct LatentAttention {
    query: Query,
    kv_a_proj_with_mqa: QuantLinear,
    kv_a_layernorm: RmsNorm,
    kv_b_proj: QuantLinear,
    o_proj: QuantLinear,
    num_heads: usize,
    cfg: MlaConfig,
}

/// Where the queries come from.
#[derive(Clone)]
enum Query {
    /// `q_lora_rank: null`.
    Direct(QuantLinear),
    LowRank {
        q_a_proj: QuantLinear,
        q_a_layernorm: RmsNorm,
        q_b_proj: QuantLinear,
    },
}

impl LatentAttention {
    /// The attention whose tensors `vb` names (`model.layers.N.self_attn`). `attention_bias`
    /// gives `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj` a bias, as the class builds them.
    pub fn load(
        vb: &Loader,
        c: &ModelConfig,
        cfg: &MlaConfig,
    ) -> std::result::Result<Self, LoadError> {
        vb.refuse_kv_cache("multi-head latent attention (vLLM's MLA caches the latent)")?;
        let (h, heads) = (c.hidden_size, c.num_heads);
        let qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim;
        let norm =
            |name: &str, dim| RmsNorm::load(&vb.pp(name), dim, LATENT_NORM_EPS, NormKind::Weight);
        let query = match cfg.q_lora_rank {
            None => Query::Direct(vb.linear("q_proj", (heads * qk, h), false)?),
            Some(rank) => Query::LowRank {
                q_a_proj: vb.linear("q_a_proj", (rank, h), c.qkv_bias)?,
                q_a_layernorm: norm("q_a_layernorm", rank)?,
                q_b_proj: vb.linear("q_b_proj", (heads * qk, rank), false)?,
            },
        };
        let latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim;
        Ok(Self {
            query,
            kv_a_proj_with_mqa: vb.linear("kv_a_proj_with_mqa", (latent, h), c.qkv_bias)?,
            kv_a_layernorm: norm("kv_a_layernorm", cfg.kv_lora_rank)?,
            kv_b_proj: vb.linear(
                "kv_b_proj",
                (
                    heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                    cfg.kv_lora_rank,
                ),
                false,
            )?,
            o_proj: vb.linear("o_proj", (h, heads * cfg.v_head_dim), c.o_bias)?,
            num_heads: heads,
            cfg: cfg.clone(),
        })
    }

    /// The Linears that read the layer's normed input: the first query projection and
    /// `kv_a_proj_with_mqa`.
    fn input_linears(&self) -> [&QuantLinear; 2] {
        let q = match &self.query {
            Query::Direct(q_proj) => q_proj,
            Query::LowRank { q_a_proj, .. } => q_a_proj,
        };
        [q, &self.kv_a_proj_with_mqa]
    }

    /// What the layer's input norm may apply for the Linears that read it ([`shared_input`]).
    pub fn shared_input(&self) -> SharedInput<'_> {
        shared_input(&self.input_linears())
    }

    /// The projections with their names.
    pub fn linears(&self) -> Vec<(&'static str, &QuantLinear)> {
        let mut out = match &self.query {
            Query::Direct(q_proj) => vec![("q_proj", q_proj)],
            Query::LowRank {
                q_a_proj, q_b_proj, ..
            } => vec![("q_a_proj", q_a_proj), ("q_b_proj", q_b_proj)],
        };
        out.extend([
            ("kv_a_proj_with_mqa", &self.kv_a_proj_with_mqa),
            ("kv_b_proj", &self.kv_b_proj),
            ("o_proj", &self.o_proj),
        ]);
        out
    }

    /// [`Self::linears`], to replace one.
    pub fn linears_mut(&mut self) -> Vec<(&'static str, &mut QuantLinear)> {
        let mut out = match &mut self.query {
            Query::Direct(q_proj) => vec![("q_proj", q_proj)],
            Query::LowRank {
                q_a_proj, q_b_proj, ..
            } => vec![("q_a_proj", q_a_proj), ("q_b_proj", q_b_proj)],
        };
        out.extend([
            ("kv_a_proj_with_mqa", &mut self.kv_a_proj_with_mqa),
            ("kv_b_proj", &mut self.kv_b_proj),
            ("o_proj", &mut self.o_proj),
        ]);
        out
    }

    /// `residual` plus the attention of `input` (`[tokens of all sequences, hidden]`, normed
    /// for [`Self::shared_input`]) over the sequences of `batch`.
    pub fn forward(
        &self,
        input: Normed,
        residual: Tensor,
        batch: &BatchLayout,
        rope: &RopeTables,
    ) -> Result<Tensor> {
        let dev = input.device().clone();
        let dev = &dev;
        // the first query projection (the whole query, or its low-rank half) and the latent
        let [q_first, kv_a] = self.input_linears();
        let [q_first, latent] = match input {
            Normed::Fp8(rows) => stage("qkv_proj", dev, || {
                forward_fp8_rows_all([q_first, kv_a], &rows)
            })?,
            Normed::Rows { x, prequantized } => {
                let [q_in, kv_in] = layer_inputs([q_first, kv_a], &x, prequantized)?;
                drop(x);
                stage("qkv_proj", dev, || {
                    Ok([
                        q_first.forward_quantized(&q_in)?,
                        kv_a.forward_quantized(&kv_in)?,
                    ])
                })?
            }
        };
        let q = match &self.query {
            Query::Direct(_) => q_first,
            Query::LowRank {
                q_a_layernorm,
                q_b_proj,
                ..
            } => stage("qkv_proj", dev, || {
                q_b_proj.forward(&q_a_layernorm.forward(&q_first, None)?)
            })?,
        };
        let (rank, rope_dim) = (self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim);
        // its own stage: `--profile` shows the latent's expansion apart from the projections
        // of the input, and the attention core ("attention") apart from both
        let (kv, k_rot) = stage("kv_b_proj", dev, || {
            let nope = latent.narrow(1, 0, rank)?.contiguous()?;
            let kv = self
                .kv_b_proj
                .forward(&self.kv_a_layernorm.forward(&nope, None)?)?;
            Ok((kv, latent.narrow(1, rank, rope_dim)?.contiguous()?))
        })?;
        let out = match batch.flash() {
            Some(index) => self.flash_attend(&q, &kv, &k_rot, index, batch.lens(), rope)?,
            None => self.attend_each_sequence(&q, &kv, &k_rot, batch, rope)?,
        };
        let [o_in] = layer_inputs([&self.o_proj], &out, false)?;
        stage("o_proj", dev, || {
            self.o_proj.add_to_residual(residual, &o_in)
        })
    }

    /// The materialised path, one sequence at a time; returns `[tokens, heads * v]`.
    fn attend_each_sequence(
        &self,
        q: &Tensor,
        kv: &Tensor,
        k_rot: &Tensor,
        batch: &BatchLayout,
        rope: &RopeTables,
    ) -> Result<Tensor> {
        stage("attention", q.device(), || {
            let mut outputs = Vec::with_capacity(batch.lens().len());
            let mut offset = 0;
            for &len in batch.lens() {
                let seq = |t: &Tensor| t.narrow(0, offset, len);
                let (q, kv, k_rot) = (seq(q)?, seq(kv)?, seq(k_rot)?);
                outputs.push(self.attend(&q, &kv, &k_rot, rope, batch.blocks())?);
                offset += len;
            }
            Tensor::cat(&outputs, 0)
        })
    }

    /// One sequence: `q` `[len, heads * qk]`, `kv` `[len, heads * (nope + v)]`, the shared
    /// `k_rot` `[len, rope]`; returns `[len, heads * v]`.
    fn attend(
        &self,
        q: &Tensor,
        kv: &Tensor,
        k_rot: &Tensor,
        rope: &RopeTables,
        blocks: ops::AttentionBlocks,
    ) -> Result<Tensor> {
        let MlaConfig {
            qk_nope_head_dim: nope,
            qk_rope_head_dim: rot,
            v_head_dim: v_dim,
            ..
        } = self.cfg;
        let (len, heads) = (q.dims()[0], self.num_heads);
        // [len, heads, d] -> [1, heads, len, d]
        let by_head = |t: &Tensor, d: usize| -> Result<Tensor> {
            t.reshape((len, heads, d))?
                .transpose(0, 1)?
                .contiguous()?
                .unsqueeze(0)
        };
        let q = by_head(q, nope + rot)?;
        let kv = by_head(kv, nope + v_dim)?;
        let q_rot = self.rotate(&q.narrow(3, nope, rot)?, rope)?;
        let k_rot = self
            .rotate(&k_rot.reshape((1, 1, len, rot))?, rope)?
            .broadcast_as((1, heads, len, rot))?;
        let q = Tensor::cat(&[&q.narrow(3, 0, nope)?, &q_rot], 3)?.contiguous()?;
        let q = self.scale_queries(q, 0..len, (1, 1, len, 1))?;
        let k = Tensor::cat(&[&kv.narrow(3, 0, nope)?, &k_rot], 3)?.contiguous()?;
        let v = kv.narrow(3, nope, v_dim)?.contiguous()?;
        ops::causal_attention(&q, &k, &v, self.cfg.softmax_scale, None, None, None, blocks)?
            .transpose(1, 2)?
            .reshape((len, heads * v_dim))
    }

    /// The whole batch through the flash kernel: `q` `[tokens, heads * qk]`, `kv` `[tokens,
    /// heads * (nope + v)]`, the shared `k_rot` `[tokens, rope]`, every head zero-padded to the
    /// kernel's head size; returns `[tokens, heads * v]`.
    fn flash_attend(
        &self,
        q: &Tensor,
        kv: &Tensor,
        k_rot: &Tensor,
        index: &FlashIndex,
        lens: &[usize],
        rope: &RopeTables,
    ) -> Result<Tensor> {
        let MlaConfig {
            qk_nope_head_dim: nope,
            qk_rope_head_dim: rot,
            v_head_dim: v_dim,
            ..
        } = self.cfg;
        let (tokens, heads, dev) = (q.dims()[0], self.num_heads, q.device().clone());
        let width = ops::flash_head_dim_holding((nope + rot).max(v_dim))
            .ok_or_else(|| candle_core::Error::Msg("no flash head size holds MLA's".into()))?;
        let (cos, sin) = rope.tables();
        let positions = lens.iter().flat_map(|&len| 0..len);
        let shape = ops::MlaHeads {
            heads,
            nope,
            rope: rot,
            value: v_dim,
            width,
            interleave: self.cfg.rope_interleave,
        };
        let (q, k, v) = stage("rope", &dev, || {
            let scale = self.query_scales(positions, tokens, &dev, q.dtype())?;
            ops::mla_flash_inputs(
                q,
                kv,
                k_rot,
                &index.positions,
                cos,
                sin,
                scale.as_ref(),
                shape,
            )
        })?;
        let opts = ops::FlashOptions {
            scale: self.cfg.softmax_scale as f32,
            window: None,
            tiling: index.tiling,
        };
        stage("attention", &dev, || {
            ops::flash_attention(&q, &k, &v, &index.starts, index.max_len, &opts)?
                .reshape((tokens, heads, width))?
                .narrow(2, 0, v_dim)?
                .contiguous()?
                .reshape((tokens, heads * v_dim))
        })
    }

    /// Mistral 4's queries times the scale of their positions, in the compute dtype, as
    /// transformers multiplies them (both attention paths call this); `shape` puts the
    /// positions on `q`'s token axis.
    fn scale_queries(
        &self,
        q: Tensor,
        positions: impl Iterator<Item = usize>,
        shape: impl candle_core::shape::ShapeWithOneHole,
    ) -> Result<Tensor> {
        let Some(scaling) = &self.cfg.query_scaling else {
            return Ok(q);
        };
        let scale: Vec<f32> = positions.map(|p| scaling.scale(p)).collect();
        let scale = Tensor::from_vec(scale, shape, q.device())?;
        q.broadcast_mul(&scale.to_dtype(q.dtype())?)
    }

    /// [`Self::scale_queries`]'s scales `[tokens]` in `dtype` (`None` without query scaling),
    /// for the fused flash-input kernel, which multiplies as `broadcast_mul` does.
    fn query_scales(
        &self,
        positions: impl Iterator<Item = usize>,
        tokens: usize,
        device: &candle_core::Device,
        dtype: candle_core::DType,
    ) -> Result<Option<Tensor>> {
        let Some(scaling) = &self.cfg.query_scaling else {
            return Ok(None);
        };
        let scale: Vec<f32> = positions.map(|p| scaling.scale(p)).collect();
        Tensor::from_vec(scale, tokens, device)?
            .to_dtype(dtype)
            .map(Some)
    }

    /// RoPE of `x` `[1, heads, len, rope]`. DeepSeek's interleaved layout pairs `(x0, x1),
    /// (x2, x3), …`; transformers rotates the pairs and writes `[evens'; odds']`, which is
    /// `rotate_half` RoPE of `[evens; odds]`: the de-interleaved copy is rotated here, in the
    /// same layout for q and k (their dot product is all that reads it).
    fn rotate(&self, x: &Tensor, rope: &RopeTables) -> Result<Tensor> {
        let x = x.contiguous()?;
        let x = if self.cfg.rope_interleave {
            let (b, h, len, d) = x.dims4()?;
            x.reshape((b, h, len, d / 2, 2))?
                .transpose(3, 4)?
                .contiguous()?
                .reshape((b, h, len, d))?
        } else {
            x
        };
        rope.apply(&x)
    }
}
