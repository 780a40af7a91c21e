//! The feed-forward of a decoder layer: a gated MLP ([`Mlp`]), or a mixture of such experts
//! ([`Moe`]).

use candle_core::{Result, Tensor};

use super::mlp::{Mlp, PROJ_NAMES};
use super::moe::{Moe, Route};
use super::Normed;
use crate::checkpoint::LoadError;
use crate::model::config::ModelConfig;
use crate::model::loader::Loader;
use crate::quant::{QuantLinear, SharedInput};

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

    /// What the feed-forward's input norm may apply for it (see [`Mlp::shared_input`]);
    /// nothing for experts, which each apply their own QDQ to their tokens.
    pub fn shared_input(&self) -> SharedInput<'_> {
        match self {
            Self::Dense(m) => m.shared_input(),
            Self::Sparse(_) => SharedInput::Separate,
        }
    }

    /// `residual` plus the feed-forward of `input` (normed for [`Self::shared_input`]).
    /// `routes`: where a sparse block records every token's experts.
    pub fn forward(
        &self,
        input: Normed,
        residual: Tensor,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor> {
        match self {
            Self::Dense(m) => m.forward(input, residual),
            Self::Sparse(moe) => moe.forward(&input.into_rows()?, residual, routes),
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
