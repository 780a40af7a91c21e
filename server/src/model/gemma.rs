//! Gemma 2 and Gemma 3 (text): `(1 + w)` RMSNorms in f32, embeddings scaled by √hidden,
//! GeGLU, each block's output normed before the residual add (norms after attention and
//! around the feed-forward), q/k norms (Gemma 3), `query_pre_attn_scalar`, interleaved
//! sliding-window and global layers with their own RoPE bases (Gemma 3), and attention-score
//! soft-capping (Gemma 2; the final soft-capping is the stack's, from the config).

use candle_core::{Result, Tensor};

use super::blocks::{Attention, BatchLayout, FeedForward, NormKind, RmsNorm, Route};
use super::config::ModelConfig;
use super::decoder::{Family, Layer};
use super::loader::Loader;
use super::profile::stage;
use super::rope::RopeTables;
use crate::checkpoint::LoadError;

/// The Gemma family.
pub struct Gemma;

impl Family for Gemma {
    fn load_layer(
        &self,
        vb: &Loader,
        c: &ModelConfig,
        layer: usize,
    ) -> std::result::Result<Box<dyn Layer>, LoadError> {
        Ok(Box::new(DecoderLayer::load(vb, c, layer)?))
    }

    fn norm(&self) -> NormKind {
        NormKind::OnePlusWeight
    }

    fn embed_scale(&self, c: &ModelConfig) -> Option<f64> {
        Some((c.hidden_size as f64).sqrt())
    }
}

#[derive(Clone)]
pub struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    /// On the attention's output, before the residual add.
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    mlp: FeedForward,
    post_feedforward_layernorm: RmsNorm,
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
                NormKind::OnePlusWeight,
            )
        };
        Ok(Self {
            self_attn: Attention::load(&vb.pp("self_attn"), c, layer, NormKind::OnePlusWeight)?,
            mlp: FeedForward::load(vb, c, layer)?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            pre_feedforward_layernorm: norm("pre_feedforward_layernorm")?,
            post_feedforward_layernorm: norm("post_feedforward_layernorm")?,
            input_layernorm: norm("input_layernorm")?,
        })
    }
}

impl Layer for DecoderLayer {
    /// Each block adds into a zero stream (0 + y = y exactly), whose sum is normed and then
    /// added to the residual stream.
    fn forward(
        &self,
        x: Tensor,
        batch: &BatchLayout,
        rope: &RopeTables,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor> {
        let dev = x.device().clone();
        let dev = &dev;
        let qdq = self.self_attn.input_qdq();
        let normed = stage("norm", dev, || {
            self.input_layernorm.forward(&x, qdq.flatten())
        })?;
        let out = self
            .self_attn
            .forward(normed, x.zeros_like()?, qdq.is_some(), batch, rope)?;
        let x = (x + stage("norm", dev, || {
            self.post_attention_layernorm.forward(&out, None)
        })?)?;
        let qdq = self.mlp.input_qdq();
        let normed = stage("norm", dev, || {
            self.pre_feedforward_layernorm.forward(&x, qdq.flatten())
        })?;
        let out = self
            .mlp
            .forward(normed, x.zeros_like()?, qdq.is_some(), routes)?;
        x + stage("norm", dev, || {
            self.post_feedforward_layernorm.forward(&out, None)
        })?
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
