//! RMSNorm in the conventions the served families use.

use candle_core::{DType, Device, Result, Tensor};

use super::Normed;
use crate::checkpoint::LoadError;
use crate::model::loader::Loader;
use crate::ops;
use crate::quant::{ActivationQdq, SharedInput};

/// How a norm's weight scales the normalised row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// `x̂ · w` in the compute dtype (Llama, Mistral, Qwen).
    Weight,
    /// `x̂ · (1 + w)` in f32, rounded once (Gemma 2 and 3).
    OnePlusWeight,
    /// `x̂ · w` in f32, rounded once (Gemma 4).
    WeightInF32,
}

#[derive(Clone)]
pub struct RmsNorm {
    /// `w` in the compute dtype, or `1 + w` in f32 for [`NormKind::OnePlusWeight`].
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// The norm whose weight is `{vb}.weight` `[dim]`.
    pub fn load(
        vb: &Loader,
        dim: usize,
        eps: f64,
        kind: NormKind,
    ) -> std::result::Result<Self, LoadError> {
        let weight = match kind {
            NormKind::Weight => vb.get("weight", &[dim])?,
            // `1 + w` computed in f32 on the CPU, kept in f32.
            NormKind::OnePlusWeight => {
                let w = vb.get_as("weight", &[dim], DType::F32, &Device::Cpu)?;
                (w + 1.0)?.to_device(&vb.options().device)?
            }
            NormKind::WeightInF32 => {
                vb.get_as("weight", &[dim], DType::F32, &vb.options().device)?
            }
        };
        Ok(Self { weight, eps })
    }

    /// A norm without a weight (Gemma 4's value and router norms): `x̂` in f32, rounded once.
    pub fn unit(dim: usize, eps: f64, device: &Device) -> candle_core::Result<Self> {
        Ok(Self {
            weight: Tensor::ones(dim, DType::F32, device)?,
            eps,
        })
    }

    /// The weight as the kernels take it (`1 + w` in f32 for [`NormKind::OnePlusWeight`]).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// The normalised `x`, put through `qdq` (the activation QDQ of the Linears that read it)
    /// when there is one. [`NormKind::OnePlusWeight`]'s f32 `1 + w` makes it transformers'
    /// GemmaRMSNorm: normalise in f32, multiply by `1 + w` in f32, cast back.
    pub fn forward(&self, x: &Tensor, qdq: Option<&ActivationQdq>) -> Result<Tensor> {
        ops::rms_norm(x, &self.weight, self.eps, qdq)
    }

    /// The normalised `x` as the block after it takes it: with whatever `shared` lets the
    /// norm apply for the block's Linears done in the norm's own kernel.
    pub fn forward_for(&self, x: &Tensor, shared: SharedInput) -> Result<Normed> {
        Ok(match shared {
            SharedInput::Fp8Rows(scale) => {
                Normed::Fp8(ops::rms_norm_fp8_rows(x, &self.weight, self.eps, scale)?)
            }
            SharedInput::Qdq(qdq) => Normed::Rows {
                x: self.forward(x, qdq)?,
                prequantized: true,
            },
            SharedInput::Separate => Normed::Rows {
                x: self.forward(x, None)?,
                prequantized: false,
            },
        })
    }

    /// The gated form ([`ops::gated_rms_norm`]): `x` normalised, weighted and multiplied by
    /// `silu(z)` as a Gated DeltaNet's output norm does.
    pub fn forward_gated(&self, x: &Tensor, z: &Tensor) -> Result<Tensor> {
        ops::gated_rms_norm(x, &self.weight, z, self.eps)
    }
}
