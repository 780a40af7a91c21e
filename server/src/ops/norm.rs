//! The norm and activation family: RMSNorm and the gated activations (SwiGLU, GeGLU), each able
//! to apply the per-token fp8 QDQ of the Linear that reads its output in the same GPU pass.

use candle_core::{DType, Device, Module, Result, Tensor, D};

use super::dequant::{activation_qdq, ActivationQdq};
use super::fp8_gemm::{quantize_fp8_rows, Fp8InputScale, Fp8Rows};

super::gpu_entry_points!(norm {
    fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32, fp8_qdq: bool) -> Result<Tensor>;
    fn silu_mul(gate: &Tensor, up: &Tensor, fp8_qdq: bool) -> Result<Tensor>;
    fn gelu_tanh_mul(gate: &Tensor, up: &Tensor, fp8_qdq: bool) -> Result<Tensor>;
    fn gated_rms_norm(x: &Tensor, weight: &Tensor, z: &Tensor, eps: f32) -> Result<Tensor>;
    fn rms_norm_fp8_rows(
        x: &Tensor,
        weight: &Tensor,
        eps: f32,
        static_scale: Option<f32>,
    ) -> Result<(Tensor, Tensor)>;
    fn gated_mul_fp8_rows(
        base: &str,
        gate: &Tensor,
        up: &Tensor,
        static_scale: Option<f32>,
    ) -> Result<(Tensor, Tensor)>;
});

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// `gelu_pytorch_tanh`: GELU with the tanh approximation (GeGLU).
    GeluTanh,
    /// gpt-oss's clamped SwiGLU (`GptOssExperts._apply_gate`): the gate clamped to at most
    /// [`CLAMPED_SWIGLU_LIMIT`], up to ±limit, then `(up + 1) * gate * sigmoid(alpha * gate)`.
    ClampedSwiglu,
}

/// gpt-oss's `limit` and `alpha`: constants of transformers' `GptOssExperts`, not config keys.
pub const CLAMPED_SWIGLU_LIMIT: f64 = 7.0;
pub const CLAMPED_SWIGLU_ALPHA: f64 = 1.702;

impl Activation {
    /// The profile stage of the gated product `act(gate) * up`.
    pub fn stage_name(self) -> &'static str {
        match self {
            Self::Silu => "silu_mul",
            Self::GeluTanh => "gelu_mul",
            Self::ClampedSwiglu => "clamped_swiglu",
        }
    }
}

/// transformers' LlamaRMSNorm of `x` over its last dimension (normalise in f32, cast back, then
/// scale by `weight`), put through `qdq` (the activation QDQ of the Linears that read it) when
/// there is one. One kernel on a GPU, which rounds the norm once instead of twice (identical in
/// f32; closer to f32 in bf16/f16) and applies a per-token fp8 QDQ in the same pass.
///
/// An f32 `weight` beside a narrower `x` is GemmaRMSNorm's `1 + w`: the normalised row is
/// scaled in f32 and rounded once, as transformers does, on every device.
pub fn rms_norm(
    x: &Tensor,
    weight: &Tensor,
    eps: f64,
    qdq: Option<&ActivationQdq>,
) -> Result<Tensor> {
    let fused = fuses_qdq(qdq, x.device());
    let normed = if x.device().is_cuda() {
        gpu::rms_norm(x, weight, eps as f32, fused)?
    } else {
        let dtype = x.dtype();
        let x32 = x.to_dtype(DType::F32)?;
        let variance = x32.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = x32.broadcast_mul(&(variance + eps)?.sqrt()?.recip()?)?;
        if weight.dtype() == DType::F32 {
            normed.broadcast_mul(weight)?.to_dtype(dtype)?
        } else {
            normed.to_dtype(dtype)?.broadcast_mul(weight)?
        }
    };
    finish_qdq(normed, qdq, fused)
}

/// [`rms_norm`] without a QDQ, quantized to e4m3 codes ([`quantize_fp8_rows`] with `scale`):
/// the input of Linears on the fp8 tensor cores. On a GPU in bf16/f16 with one scale per row,
/// the norm writes the codes and scales itself (the same bits, no normed rows in memory).
pub fn rms_norm_fp8_rows(
    x: &Tensor,
    weight: &Tensor,
    eps: f64,
    scale: Fp8InputScale,
) -> Result<Fp8Rows> {
    match scale.per_row() {
        Some(static_scale) if x.device().is_cuda() && x.dtype() != DType::F32 => {
            let (codes, scales) = gpu::rms_norm_fp8_rows(x, weight, eps as f32, static_scale)?;
            Ok(Fp8Rows { codes, scales })
        }
        _ => quantize_fp8_rows(&rms_norm(x, weight, eps, None)?, scale),
    }
}

/// transformers' gated RMSNorm (`Qwen3NextRMSNormGated`, `Qwen3_5RMSNormGated`: the output
/// norm of a Gated DeltaNet) of `x` over its last dimension, gated by `z` (`x`'s shape and
/// dtype), rounded where transformers rounds: the normalised row in f32 rounded to the compute
/// dtype, times `weight` (kept in f32 for an f32 weight, as the releases store it, else rounded),
/// times `silu(z)` in f32, rounded once. One kernel on a GPU.
pub fn gated_rms_norm(x: &Tensor, weight: &Tensor, z: &Tensor, eps: f64) -> Result<Tensor> {
    if x.device().is_cuda() {
        return gpu::gated_rms_norm(x, weight, z, eps as f32);
    }
    let dtype = x.dtype();
    let x32 = x.to_dtype(DType::F32)?;
    let variance = x32.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = x32
        .broadcast_mul(&(variance + eps)?.sqrt()?.recip()?)?
        .to_dtype(dtype)?;
    let weighted = if weight.dtype() == DType::F32 {
        normed.to_dtype(DType::F32)?.broadcast_mul(weight)?
    } else {
        normed
            .broadcast_mul(&weight.to_dtype(dtype)?)?
            .to_dtype(DType::F32)?
    };
    (weighted * z.to_dtype(DType::F32)?.silu()?)?.to_dtype(dtype)
}

/// The gated activation `act(gate) * up` (SwiGLU, GeGLU), put through `qdq` (the down
/// projection's activation QDQ) when there is one: one kernel on a GPU, rounded as PyTorch
/// rounds it in the compute dtype, which applies a per-token fp8 QDQ in the same pass.
pub fn gated_mul(
    act: Activation,
    gate: &Tensor,
    up: &Tensor,
    qdq: Option<&ActivationQdq>,
) -> Result<Tensor> {
    // the clamped SwiGLU has no kernel of its own to fuse the QDQ into
    let fused = act != Activation::ClampedSwiglu && fuses_qdq(qdq, gate.device());
    let product = match (gate.device().is_cuda(), act) {
        (true, Activation::Silu) => gpu::silu_mul(gate, up, fused)?,
        (true, Activation::GeluTanh) => gpu::gelu_tanh_mul(gate, up, fused)?,
        (false, Activation::Silu) => (candle_nn::Activation::Silu.forward(gate)? * up)?,
        (false, Activation::GeluTanh) => (gate.gelu()? * up)?,
        // No kernel of its own: candle's ops, which run on every device.
        (_, Activation::ClampedSwiglu) => clamped_swiglu(gate, up)?,
    };
    finish_qdq(product, qdq, fused)
}

/// [`gated_mul`] without a QDQ, quantized to e4m3 codes ([`quantize_fp8_rows`] with `scale`):
/// the down projection's input on the fp8 tensor cores. On a GPU in bf16/f16 the SwiGLU and
/// GeGLU kernels write the codes with one scale per row in the same pass (the same bits).
pub fn gated_mul_fp8_rows(
    act: Activation,
    gate: &Tensor,
    up: &Tensor,
    scale: Fp8InputScale,
) -> Result<Fp8Rows> {
    let kernel = match act {
        Activation::Silu => Some("silu_mul"),
        Activation::GeluTanh => Some("gelu_tanh_mul"),
        Activation::ClampedSwiglu => None,
    };
    match (kernel, scale.per_row()) {
        (Some(base), Some(static_scale))
            if gate.device().is_cuda() && gate.dtype() != DType::F32 =>
        {
            let (codes, scales) = gpu::gated_mul_fp8_rows(base, gate, up, static_scale)?;
            Ok(Fp8Rows { codes, scales })
        }
        _ => quantize_fp8_rows(&gated_mul(act, gate, up, None)?, scale),
    }
}

/// gpt-oss's gated product, each step rounded to the compute dtype as PyTorch rounds it:
/// `gate.clamp(max=limit)`, `up.clamp(-limit, limit)`, `glu = gate * sigmoid(gate * alpha)`,
/// `(up + 1) * glu`.
fn clamped_swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let limit = CLAMPED_SWIGLU_LIMIT;
    let gate = gate.minimum(limit)?;
    let up = up.clamp(-limit, limit)?;
    let glu = (&gate * sigmoid(&(&gate * CLAMPED_SWIGLU_ALPHA)?)?)?;
    (up + 1.0)? * glu
}

/// `sigmoid(x)` as PyTorch computes it in every dtype: in f32 (`1 / (1 + exp(-x))`), rounded
/// once to `x`'s dtype (candle's own sigmoid of a bf16 tensor rounds after each step).
pub fn sigmoid(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::F32 => candle_nn::ops::sigmoid(x),
        dtype => candle_nn::ops::sigmoid(&x.to_dtype(DType::F32)?)?.to_dtype(dtype),
    }
}

/// Whether the kernel that produces a Linear input (RMSNorm, SwiGLU) applies `qdq` in its own
/// pass: the per-token fp8 QDQ, which needs nothing but the row the GPU kernel already holds.
fn fuses_qdq(qdq: Option<&ActivationQdq>, device: &Device) -> bool {
    device.is_cuda() && qdq == Some(&ActivationQdq::Fp8PerToken)
}

/// `x` through `qdq`, unless the kernel that produced it applied it already (`fused`).
fn finish_qdq(x: Tensor, qdq: Option<&ActivationQdq>, fused: bool) -> Result<Tensor> {
    match qdq {
        Some(qdq) if !fused => activation_qdq(&x, qdq),
        _ => Ok(x),
    }
}
