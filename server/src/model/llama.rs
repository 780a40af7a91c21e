//! Llama and the architectures built like it: Mistral, Qwen2 and Qwen3, and Qwen3-MoE, Mixtral
//! and gpt-oss, whose feed-forward is a mixture of experts in some or all layers. A pre-norm
//! decoder layer: `x + attn(norm(x))`, then `x + ffn(norm(x))`; the config says which Linears
//! carry biases, whether q and k are normed per head, and where a layer is sparse.

use candle_core::{Result, Tensor};

use super::blocks::{BatchLayout, NormKind, RmsNorm, Route};
use super::config::ModelConfig;
use super::decoder::{DecoderLayer, Family, Layer, LayerNorms};
use super::loader::Loader;
use super::profile::stage;
use super::rope::RopeTables;
use crate::checkpoint::LoadError;

/// The Llama family, its norms' weights as `norm` holds them: in the compute dtype, or in f32
/// where transformers keeps them there (gpt-oss's `_keep_in_fp32_modules`).
pub struct Llama {
    pub norm: NormKind,
}

impl Family for Llama {
    fn load_layer(
        &self,
        vb: &Loader,
        c: &ModelConfig,
        layer: usize,
    ) -> std::result::Result<Box<dyn Layer>, LoadError> {
        let layer = DecoderLayer::load(vb, c, layer, self.norm(), |norm| {
            let post_attention_layernorm = norm("post_attention_layernorm")?;
            Ok(Norms {
                input_layernorm: norm("input_layernorm")?,
                post_attention_layernorm,
            })
        })?;
        Ok(Box::new(layer))
    }

    fn norm(&self) -> NormKind {
        self.norm
    }
}

/// The norms before the attention and before the feed-forward.
#[derive(Clone)]
pub struct Norms {
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl LayerNorms for Norms {
    /// The attention's and the feed-forward's last Linears add their outputs into the stream
    /// (see [`crate::quant::RowChunks`]); every other tensor is dropped as soon as it is
    /// consumed: the forward's peak memory is what is alive at once.
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
        // What q/k/v (gate/up) share, a QDQ or fp8 codes, the norm that feeds them applies.
        let normed = stage("norm", dev, || {
            norms
                .input_layernorm
                .forward_for(&x, layer.self_attn.shared_input())
        })?;
        let x = layer.self_attn.forward(normed, x, batch, rope)?;
        let normed = stage("norm", dev, || {
            norms
                .post_attention_layernorm
                .forward_for(&x, layer.mlp.shared_input())
        })?;
        layer.mlp.forward(normed, x, routes)
    }
}
