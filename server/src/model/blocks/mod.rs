//! The blocks every architecture family builds its decoder layers from, each with its `load`
//! beside its `forward` (as candle-transformers' models): [`RmsNorm`], [`Attention`], [`Mlp`]
//! and [`Moe`] behind a layer's [`FeedForward`], the linear-attention [`GatedDeltaNet`] and the
//! multi-head latent attention [`LatentAttention`], and Gemma 4's [`SharedKvAttention`].
//! Device-specific work goes through [`crate::ops`]; nothing here asks which device it runs on.

mod attention;
mod feed_forward;
mod gated_delta_net;
mod mla;
mod mlp;
mod moe;
mod norm;
mod shared_kv_attention;

pub use attention::{Attention, BatchLayout};
pub use feed_forward::FeedForward;
pub use gated_delta_net::GatedDeltaNet;
pub use mla::LatentAttention;
pub use mlp::{Mlp, MLP_CHUNK, PROJ_NAMES};
pub use moe::{plan_experts_on_device, routed_pass_bytes, set_routed_row_bytes, Moe, Route};
pub use norm::{NormKind, RmsNorm};
pub use shared_kv_attention::{KeyValues, SharedKvAttention};

use candle_core::{Result, Tensor};

use crate::model::profile::stage;
use crate::quant::{quantized_inputs, QuantLinear};

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
