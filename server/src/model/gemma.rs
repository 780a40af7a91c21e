//! Gemma 2 and Gemma 3 (text): `(1 + w)` RMSNorms in f32, embeddings scaled by √hidden,
//! GeGLU, each block's output normed before the residual add (norms after attention and
//! around the feed-forward), q/k norms (Gemma 3), `query_pre_attn_scalar`, interleaved
//! sliding-window and global layers with their own RoPE bases (Gemma 3), and attention-score
//! soft-capping (Gemma 2; the final soft-capping is the stack's, from the config).

use candle_core::{Result, Tensor};

use super::blocks::{BatchLayout, NormKind, RmsNorm, Route};
use super::config::ModelConfig;
use super::decoder::{DecoderLayer, Family, Layer, LayerNorms};
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
        let layer = DecoderLayer::load(vb, c, layer, self.norm(), |norm| {
            let post_attention_layernorm = norm("post_attention_layernorm")?;
            let pre_feedforward_layernorm = norm("pre_feedforward_layernorm")?;
            let post_feedforward_layernorm = norm("post_feedforward_layernorm")?;
            Ok(Norms {
                input_layernorm: norm("input_layernorm")?,
                post_attention_layernorm,
                pre_feedforward_layernorm,
                post_feedforward_layernorm,
            })
        })?;
        Ok(Box::new(layer))
    }

    fn norm(&self) -> NormKind {
        NormKind::OnePlusWeight
    }

    fn embed_scale(&self, c: &ModelConfig) -> Option<f64> {
        Some((c.hidden_size as f64).sqrt())
    }
}

/// The norms before the attention, on its output, and around the feed-forward.
#[derive(Clone)]
pub struct Norms {
    input_layernorm: RmsNorm,
    /// On the attention's output, before the residual add.
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
}

impl LayerNorms for Norms {
    /// Each block adds into a zero stream (0 + y = y exactly), whose sum is normed and then
    /// added to the residual stream.
    fn forward(
        layer: &DecoderLayer<Self>,
        x: Tensor,
        batch: &BatchLayout,
        rope: &RopeTables,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor> {
        let dev = x.device().clone();
        let dev = &dev;
        let norms = &layer.norms;
        let normed = stage("norm", dev, || {
            norms
                .input_layernorm
                .forward_for(&x, layer.self_attn.shared_input())
        })?;
        let out = layer
            .self_attn
            .forward(normed, x.zeros_like()?, batch, rope)?;
        let x = (x + stage("norm", dev, || {
            norms.post_attention_layernorm.forward(&out, None)
        })?)?;
        let normed = stage("norm", dev, || {
            norms
                .pre_feedforward_layernorm
                .forward_for(&x, layer.mlp.shared_input())
        })?;
        let out = layer.mlp.forward(normed, x.zeros_like()?, routes)?;
        x + stage("norm", dev, || {
            norms.post_feedforward_layernorm.forward(&out, None)
        })?
    }
}
