//! Llama and the architectures built like it: Mistral, Qwen2 and Qwen3, and Qwen3-MoE and
//! Mixtral, whose feed-forward is a mixture of experts in some or all layers. A pre-norm
//! decoder layer: `x + attn(norm(x))`, then `x + ffn(norm(x))`; the config says which Linears
//! carry biases, whether q and k are normed per head, and where a layer is sparse.

use candle_core::{Result, Tensor};

use super::blocks::{Attention, BatchLayout, FeedForward, NormKind, RmsNorm, Route};
use super::config::ModelConfig;
use super::decoder::{Family, Layer};
use super::loader::Loader;
use super::profile::stage;
use super::rope::RopeTables;
use crate::checkpoint::LoadError;

/// The Llama family.
pub struct Llama;

impl Family for Llama {
    fn load_layer(
        &self,
        vb: &Loader,
        c: &ModelConfig,
        layer: usize,
    ) -> std::result::Result<Box<dyn Layer>, LoadError> {
        Ok(Box::new(DecoderLayer::load(vb, c, layer)?))
    }

    fn norm(&self) -> NormKind {
        NormKind::Weight
    }
}

#[derive(Clone)]
pub struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: FeedForward,
}

impl DecoderLayer {
    /// Decoder layer `layer`, whose tensors `vb` names (`model.layers.N`).
    pub fn load(
        vb: &Loader,
        c: &ModelConfig,
        layer: usize,
    ) -> std::result::Result<Self, LoadError> {
        let norm = |name: &str| {
            RmsNorm::load(
                &vb.pp(name),
                c.hidden_size,
                c.rms_norm_eps,
                NormKind::Weight,
            )
        };
        Ok(Self {
            self_attn: Attention::load(&vb.pp("self_attn"), c, layer, NormKind::Weight)?,
            mlp: FeedForward::load(vb, c, layer)?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            input_layernorm: norm("input_layernorm")?,
        })
    }
}

impl Layer for DecoderLayer {
    /// The attention's and the feed-forward's last Linears add their outputs into the stream
    /// (see [`crate::quant::RowChunks`]); every other tensor is dropped as soon as it is
    /// consumed: the forward's peak memory is what is alive at once.
    fn forward(
        &self,
        x: Tensor,
        batch: &BatchLayout,
        rope: &RopeTables,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor> {
        let dev = x.device().clone();
        let dev = &dev;
        // A QDQ that q/k/v (gate/up) share is applied by the norm that feeds them.
        let qdq = self.self_attn.input_qdq();
        let normed = stage("norm", dev, || {
            self.input_layernorm.forward(&x, qdq.flatten())
        })?;
        let x = self
            .self_attn
            .forward(normed, x, qdq.is_some(), batch, rope)?;
        let qdq = self.mlp.input_qdq();
        let normed = stage("norm", dev, || {
            self.post_attention_layernorm.forward(&x, qdq.flatten())
        })?;
        self.mlp.forward(normed, x, qdq.is_some(), routes)
    }

    fn attention(&self) -> &Attention {
        &self.self_attn
    }

    fn feed_forward(&self) -> &FeedForward {
        &self.mlp
    }

    fn attention_mut(&mut self) -> &mut Attention {
        &mut self.self_attn
    }

    fn feed_forward_mut(&mut self) -> &mut FeedForward {
        &mut self.mlp
    }

    fn clone_box(&self) -> Box<dyn Layer> {
        Box::new(self.clone())
    }
}
