//! The Gated DeltaNet layer of Qwen3-Next and Qwen3.5 (`linear_attn`), as transformers 5.17
//! computes it (docs/architectures/qwen3_5.md §4), on the whole batch: the projections, the
//! causal conv1d, the decay and write gates and the gated delta rule
//! ([`ops::conv_qkv`], [`ops::gated_delta_decay`], [`ops::gated_delta_rule`]), the
//! gated RMSNorm and out_proj. A sequence never sees another's tokens: the convolution and the
//! recurrence start from zeros at each sequence.

use candle_core::{DType, Result, Tensor};

use super::layer_inputs;
use super::norm::{NormKind, RmsNorm};
use crate::checkpoint::LoadError;
use crate::model::config::{LinearAttentionConfig, ModelConfig};
use crate::model::loader::Loader;
use crate::model::profile::stage;
use crate::ops;
use crate::quant::QuantLinear;

/// The input projections: Qwen3.5's four, or Qwen3-Next's two grouped per key head.
#[derive(Clone)]
enum Projections {
    /// `in_proj_qkv` `[q (Hk·Dk); k (Hk·Dk); v (Hv·Dv)]`, `in_proj_z` `[Hv·Dv]`,
    /// `in_proj_b`, `in_proj_a` `[Hv]`.
    Separate {
        qkv: QuantLinear,
        z: QuantLinear,
        b: QuantLinear,
        a: QuantLinear,
    },
    /// `in_proj_qkvz`: per key head `g`, `[q_g (Dk); k_g (Dk); v (r·Dv); z (r·Dv)]` (its `r`
    /// value heads `g·r … g·r+r-1`); `in_proj_ba`: per key head `[b (r); a (r)]`.
    Grouped { qkvz: QuantLinear, ba: QuantLinear },
}

#[derive(Clone)]
pub struct GatedDeltaNet {
    proj: Projections,
    /// `conv1d.weight` `[conv_dim, 1, kernel]` in the compute dtype, as an f32 `[conv_dim,
    /// kernel]` (exact in f32; the bf16-rounded taps in bf16, as transformers convolves).
    conv_weight: Tensor,
    /// `A_log` and `dt_bias` `[Hv]` in the compute dtype (read exactly in f32, whatever they
    /// are stored in; rounded to bf16 in bf16, as transformers casts every parameter).
    a_log: Tensor,
    dt_bias: Tensor,
    /// The gated RMSNorm's plain weight `[Dv]`, shared by every value head.
    norm: RmsNorm,
    out_proj: QuantLinear,
    dims: LinearAttentionConfig,
}

impl GatedDeltaNet {
    /// The Gated DeltaNet whose tensors `vb` names (`….linear_attn`).
    pub fn load(vb: &Loader, c: &ModelConfig) -> std::result::Result<Self, LoadError> {
        vb.refuse_kv_cache("a linear-attention layer (its state is no KV cache)")?;
        let la = c
            .linear_attention
            .clone()
            .ok_or_else(|| LoadError::config("layer_types", "no linear-attention config"))?;
        if !ops::linear_attention_available(&vb.options().device, la.k_dim) {
            return Err(LoadError::config(
                "linear_key_head_dim",
                format!(
                    "{} on a GPU: the gated delta rule kernel is built for key heads of {:?} \
                     values (run on the CPU)",
                    la.k_dim,
                    ops::GPU_DELTA_RULE_KEY_DIMS
                ),
            ));
        }
        let h = c.hidden_size;
        let (key_dim, value_dim) = (la.k_heads * la.k_dim, la.v_heads * la.v_dim);
        let conv_dim = 2 * key_dim + value_dim;
        let proj = if la.grouped_projections {
            Projections::Grouped {
                qkvz: vb.linear("in_proj_qkvz", (2 * key_dim + 2 * value_dim, h), false)?,
                ba: vb.linear("in_proj_ba", (2 * la.v_heads, h), false)?,
            }
        } else {
            Projections::Separate {
                qkv: vb.linear("in_proj_qkv", (conv_dim, h), false)?,
                z: vb.linear("in_proj_z", (value_dim, h), false)?,
                b: vb.linear("in_proj_b", (la.v_heads, h), false)?,
                a: vb.linear("in_proj_a", (la.v_heads, h), false)?,
            }
        };
        let opts = vb.options();
        let conv_weight = vb
            .get_as(
                "conv1d.weight",
                &[conv_dim, 1, la.conv_kernel],
                opts.dtype,
                &candle_core::Device::Cpu,
            )?
            .to_dtype(DType::F32)?
            .reshape((conv_dim, la.conv_kernel))?
            .to_device(&opts.device)?;
        Ok(Self {
            proj,
            conv_weight,
            a_log: vb.get("A_log", &[la.v_heads])?,
            dt_bias: vb.get("dt_bias", &[la.v_heads])?,
            norm: RmsNorm::load(&vb.pp("norm"), la.v_dim, c.rms_norm_eps, NormKind::Weight)?,
            out_proj: vb.linear("out_proj", (h, value_dim), false)?,
            dims: la,
        })
    }

    /// The projections with their names under the layer's `linear_attn`.
    pub fn linears(&self) -> Vec<(&'static str, &QuantLinear)> {
        let mut out = match &self.proj {
            Projections::Separate { qkv, z, b, a } => vec![
                ("in_proj_qkv", qkv),
                ("in_proj_z", z),
                ("in_proj_b", b),
                ("in_proj_a", a),
            ],
            Projections::Grouped { qkvz, ba } => vec![("in_proj_qkvz", qkvz), ("in_proj_ba", ba)],
        };
        out.push(("out_proj", &self.out_proj));
        out
    }

    /// [`Self::linears`], to replace one.
    pub fn linears_mut(&mut self) -> Vec<(&'static str, &mut QuantLinear)> {
        let mut out = match &mut self.proj {
            Projections::Separate { qkv, z, b, a } => vec![
                ("in_proj_qkv", qkv),
                ("in_proj_z", z),
                ("in_proj_b", b),
                ("in_proj_a", a),
            ],
            Projections::Grouped { qkvz, ba } => vec![("in_proj_qkvz", qkvz), ("in_proj_ba", ba)],
        };
        out.push(("out_proj", &mut self.out_proj));
        out
    }

    /// `(qkv [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv])` of the normed `x`, the
    /// channels of `qkv` in Qwen3.5's order `[q; k; v]` whichever layout the checkpoint has.
    fn project(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let d = &self.dims;
        let t = x.dims()[0];
        let (key_dim, value_dim) = (d.k_heads * d.k_dim, d.v_heads * d.v_dim);
        match &self.proj {
            Projections::Separate { qkv, z, b, a } => Ok((
                qkv.forward(x)?,
                z.forward(x)?.reshape((t, d.v_heads, d.v_dim))?,
                b.forward(x)?,
                a.forward(x)?,
            )),
            Projections::Grouped { qkvz, ba } => {
                let r = d.v_heads / d.k_heads;
                let (dk, rv) = (d.k_dim, r * d.v_dim);
                let m = qkvz.forward(x)?.reshape((t, d.k_heads, 2 * dk + 2 * rv))?;
                let part = |start, len, width| -> Result<Tensor> {
                    m.narrow(2, start, len)?.contiguous()?.reshape((t, width))
                };
                let qkv = Tensor::cat(
                    &[
                        part(0, dk, key_dim)?,
                        part(dk, dk, key_dim)?,
                        part(2 * dk, rv, value_dim)?,
                    ],
                    1,
                )?;
                let z = part(2 * dk + rv, rv, value_dim)?.reshape((t, d.v_heads, d.v_dim))?;
                let ba = ba.forward(x)?.reshape((t, d.k_heads, 2 * r))?;
                let half = |start| -> Result<Tensor> {
                    ba.narrow(2, start, r)?
                        .contiguous()?
                        .reshape((t, d.v_heads))
                };
                Ok((qkv, z, half(0)?, half(r)?))
            }
        }
    }

    /// The core output `[tokens, Hv, Dv]` (compute dtype) of the sequences of lengths `lens`
    /// from the projections: conv1d + SiLU, split into q/k/v, `beta = sigmoid(b)` (compute
    /// dtype), `g = -exp(A_log) * softplus(a + dt_bias)` (f32), the gated delta rule in f32;
    /// the conv and the rule start each sequence from a zero state.
    fn core(&self, qkv: &Tensor, b: &Tensor, a: &Tensor, lens: &[usize]) -> Result<Tensor> {
        let d = &self.dims;
        let (tokens, dtype) = (qkv.dims()[0], qkv.dtype());
        let (q, k, v) = ops::conv_qkv(qkv, &self.conv_weight, d.k_heads * d.k_dim, lens)?;
        let q = q.reshape((tokens, d.k_heads, d.k_dim))?;
        let k = k.reshape((tokens, d.k_heads, d.k_dim))?;
        let v = v.reshape((tokens, d.v_heads, d.v_dim))?;
        // beta in the compute dtype (its sigmoid rounds there), then f32 for the rule
        let beta = ops::sigmoid(b)?.to_dtype(DType::F32)?;
        let g = ops::gated_delta_decay(a, &self.dt_bias, &self.a_log)?;
        ops::gated_delta_rule(&q, &k, &v, &g, &beta, true, lens)?.to_dtype(dtype)
    }

    /// `residual` plus the Gated DeltaNet of `x` (`[tokens of all sequences, hidden]`, normed),
    /// sequences of lengths `lens` concatenated.
    pub fn forward(&self, x: Tensor, residual: Tensor, lens: &[usize]) -> Result<Tensor> {
        let dev = x.device().clone();
        let dev = &dev;
        let d = &self.dims;
        let tokens = x.dims()[0];
        let (qkv, z, b, a) = stage("linear_attn_proj", dev, || self.project(&x))?;
        drop(x);
        let core = stage("linear_attention", dev, || self.core(&qkv, &b, &a, lens))?;
        drop((qkv, b, a));
        let gated = stage("gated_norm", dev, || {
            self.norm
                .forward_gated(&core, &z)?
                .reshape((tokens, d.v_heads * d.v_dim))
        })?;
        drop((core, z));
        let [o_in] = layer_inputs([&self.out_proj], &gated, false)?;
        stage("out_proj", dev, || {
            self.out_proj.add_to_residual(residual, &o_in)
        })
    }
}
