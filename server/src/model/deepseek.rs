//! DeepSeek-V3 and GLM-4.7-Flash: Llama's pre-norm decoder layer, `x + attn(norm(x))` then
//! `x + ffn(norm(x))`, whose attention is multi-head latent attention ([`LatentAttention`]);
//! the feed-forward is dense or DeepSeek's mixture of experts (docs/architectures/deepseek.md).

use candle_core::{Result, Tensor};

use super::blocks::{BatchLayout, FeedForward, LatentAttention, NormKind, RmsNorm, Route};
use super::config::ModelConfig;
use super::decoder::{Family, Layer};
use super::loader::Loader;
use super::profile::stage;
use super::rope::RopeTables;
use crate::checkpoint::LoadError;
use crate::quant::QuantLinear;

/// The multi-head-latent-attention family.
pub struct Mla;

impl Family for Mla {
    fn load_layer(
        &self,
        vb: &Loader,
        c: &ModelConfig,
        layer: usize,
    ) -> std::result::Result<Box<dyn Layer>, LoadError> {
        let mla = c.mla.as_ref().ok_or_else(|| {
            LoadError::config("kv_lora_rank", "missing for multi-head latent attention")
        })?;
        let norm =
            |name: &str| RmsNorm::load(&vb.pp(name), c.hidden_size, c.rms_norm_eps, self.norm());
        Ok(Box::new(MlaLayer {
            self_attn: LatentAttention::load(&vb.pp("self_attn"), c, mla)?,
            mlp: FeedForward::load(vb, c, layer)?,
            input_layernorm: norm("input_layernorm")?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
        }))
    }

    fn norm(&self) -> NormKind {
        NormKind::Weight
    }
}

#[derive(Clone)]
struct MlaLayer {
    self_attn: LatentAttention,
    mlp: FeedForward,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl Layer for MlaLayer {
    fn forward(
        &self,
        x: Tensor,
        batch: &BatchLayout,
        rope: &RopeTables,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor> {
        let dev = x.device().clone();
        let dev = &dev;
        // What the first query projection and kv_a share, a QDQ or fp8 codes, the norm applies.
        let normed = stage("norm", dev, || {
            self.input_layernorm
                .forward_for(&x, self.self_attn.shared_input())
        })?;
        let x = self.self_attn.forward(normed, x, batch, rope)?;
        let normed = stage("norm", dev, || {
            self.post_attention_layernorm
                .forward_for(&x, self.mlp.shared_input())
        })?;
        self.mlp.forward(normed, x, routes)
    }

    fn local_rope(&self) -> bool {
        false
    }

    fn feed_forward(&self) -> &FeedForward {
        &self.mlp
    }

    fn linears(&self) -> Vec<(String, &QuantLinear)> {
        let attention = self.self_attn.linears().into_iter();
        attention
            .map(|(n, l)| (format!("self_attn.{n}"), l))
            .chain(self.mlp.linears())
            .collect()
    }

    fn linears_mut(&mut self) -> Vec<(String, &mut QuantLinear)> {
        let attention = self.self_attn.linears_mut().into_iter();
        attention
            .map(|(n, l)| (format!("self_attn.{n}"), l))
            .chain(self.mlp.linears_mut())
            .collect()
    }

    fn clone_box(&self) -> Box<dyn Layer> {
        Box::new(self.clone())
    }
}
