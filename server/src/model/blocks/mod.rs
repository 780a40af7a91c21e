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
use crate::ops::Fp8Rows;
use crate::quant::{quantized_inputs, QuantLinear};

/// A norm's output as the block after it takes it ([`RmsNorm::forward_for`]).
pub enum Normed {
    /// The normed rows; `prequantized`: through the reading Linears' common activation QDQ
    /// already.
    Rows { x: Tensor, prequantized: bool },
    /// The reading Linears' e4m3 codes and scales ([`crate::quant::SharedInput::Fp8Rows`]).
    Fp8(Fp8Rows),
}

impl Normed {
    /// Rows that each reading Linear quantizes itself.
    pub fn plain(x: Tensor) -> Self {
        Self::Rows {
            x,
            prequantized: false,
        }
    }

    /// Rows `start..start + len` (the MLP's row chunks).
    fn narrow(&self, start: usize, len: usize) -> Result<Self> {
        Ok(match self {
            Self::Rows { x, prequantized } => Self::Rows {
                x: x.narrow(0, start, len)?,
                prequantized: *prequantized,
            },
            Self::Fp8(rows) => Self::Fp8(Fp8Rows {
                codes: rows.codes.narrow(0, start, len)?,
                scales: rows.scales.narrow(0, start, len)?,
            }),
        })
    }

    fn rows(&self) -> usize {
        match self {
            Self::Rows { x, .. } => x.dims()[0],
            Self::Fp8(rows) => rows.codes.dims()[0],
        }
    }

    fn device(&self) -> &candle_core::Device {
        match self {
            Self::Rows { x, .. } => x.device(),
            Self::Fp8(rows) => rows.codes.device(),
        }
    }

    /// The normed rows, for a block whose Linears let the norm apply nothing for them.
    fn into_rows(self) -> Result<Tensor> {
        match self {
            Self::Rows { x, .. } => Ok(x),
            Self::Fp8(_) => candle_core::bail!("fp8 codes given to a block that reads rows"),
        }
    }
}

/// Each of `linears` (all on the fp8 tensor cores) on the same input codes.
fn forward_fp8_rows_all<const N: usize>(
    linears: [&QuantLinear; N],
    rows: &Fp8Rows,
) -> Result<[Tensor; N]> {
    let out = linears
        .iter()
        .map(|l| l.forward_fp8_rows(rows))
        .collect::<Result<Vec<_>>>()?;
    Ok(out
        .try_into()
        .unwrap_or_else(|_| unreachable!("one output per layer")))
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
