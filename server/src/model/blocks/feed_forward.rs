//! The feed-forward of a decoder layer: a gated MLP ([`Mlp`]), or a mixture of such experts
//! ([`Moe`]).

use candle_core::{Result, Tensor};

use super::mlp::{Mlp, PROJ_NAMES};
use super::moe::{Moe, Route};
use crate::checkpoint::LoadError;
use crate::model::config::ModelConfig;
use crate::model::loader::Loader;
use crate::quant::{ActivationQdq, QuantLinear};

/// The feed-forward of a decoder layer.
#[derive(Clone)]
pub enum FeedForward {
    Dense(Mlp),
    Sparse(Box<Moe>),
}

impl FeedForward {
    /// The feed-forward of decoder layer `layer`, whose tensors `vb` names: a mixture of
    /// experts where the config makes the layer sparse, else the dense `mlp`.
    pub fn load(
        vb: &Loader,
        c: &ModelConfig,
        layer: usize,
    ) -> std::result::Result<Self, LoadError> {
        Ok(match &c.moe {
            Some(moe) if c.is_sparse_layer(layer) => Self::Sparse(Box::new(Moe::load(vb, c, moe)?)),
            _ => Self::Dense(Mlp::load(
                &vb.pp("mlp"),
                PROJ_NAMES,
                (c.hidden_size, c.intermediate_size),
                c.mlp_bias,
                c.hidden_act,
            )?),
        })
    }

    /// The activation QDQ the feed-forward's input norm may apply once (see
    /// [`Mlp::input_qdq`]); none for experts, which each apply their own to their tokens.
    pub fn input_qdq(&self) -> Option<Option<&ActivationQdq>> {
        match self {
            Self::Dense(m) => m.input_qdq(),
            Self::Sparse(_) => None,
        }
    }

    /// `residual` plus the feed-forward of `x` (normed). `prequantized`: `x` has been through
    /// [`Self::input_qdq`]. `routes`: where a sparse block records every token's experts.
    pub fn forward(
        &self,
        x: Tensor,
        residual: Tensor,
        prequantized: bool,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor> {
        match self {
            Self::Dense(m) => m.forward(x, residual, prequantized),
            Self::Sparse(moe) => moe.forward(&x, residual, routes),
        }
    }

    pub fn is_sparse(&self) -> bool {
        matches!(self, Self::Sparse(_))
    }

    /// Every Linear with its name under the layer (`mlp.gate_proj`, `mlp.experts.3.up_proj`).
    pub fn linears(&self) -> Vec<(String, &QuantLinear)> {
        match self {
            Self::Dense(m) => m
                .linears()
                .into_iter()
                .map(|(n, l)| (format!("mlp.{n}"), l))
                .collect(),
            Self::Sparse(moe) => moe
                .linears()
                .map(|(n, l)| (format!("mlp.{n}"), l))
                .collect(),
        }
    }

    /// [`Self::linears`], to replace one.
    pub fn linears_mut(&mut self) -> Vec<(String, &mut QuantLinear)> {
        match self {
            Self::Dense(m) => m
                .linears_mut()
                .into_iter()
                .map(|(n, l)| (format!("mlp.{n}"), l))
                .collect(),
            Self::Sparse(moe) => moe
                .linears_mut()
                .map(|(n, l)| (format!("mlp.{n}"), l))
                .collect(),
        }
    }
}
