//! Qwen3-Next, Qwen3.5 and Qwen3.5-MoE: pre-norm decoder layers with `(1 + w)` RMSNorms whose
//! token mixer is either a Gated DeltaNet (`linear_attn`, [`GatedDeltaNet`]) or gated full
//! attention (`self_attn`: q/k norms, partial rotary, a sigmoid output gate), as `layer_types`
//! says; the feed-forward is a dense MLP or a mixture of experts with a gated shared expert.
//! `x + mixer(norm(x))`, then `x + ffn(norm(x))` (docs/architectures/qwen3_5.md).

use candle_core::{Result, Tensor};

use super::blocks::{Attention, BatchLayout, FeedForward, GatedDeltaNet, NormKind, RmsNorm, Route};
use super::config::ModelConfig;
use super::decoder::{attention_linears, Family, Layer};
use super::loader::Loader;
use super::profile::stage;
use super::rope::RopeTables;
use crate::checkpoint::LoadError;
use crate::quant::QuantLinear;

/// The Qwen3-Next family.
pub struct Qwen3Next;

impl Family for Qwen3Next {
    fn load_layer(
        &self,
        vb: &Loader,
        c: &ModelConfig,
        layer: usize,
    ) -> std::result::Result<Box<dyn Layer>, LoadError> {
        let linear = c
            .linear_attention
            .as_ref()
            .is_some_and(|l| l.linear_layers[layer]);
        let mixer = if linear {
            Mixer::Linear(GatedDeltaNet::load(&vb.pp("linear_attn"), c)?)
        } else {
            Mixer::Attention(Attention::load(&vb.pp("self_attn"), c, layer, self.norm())?)
        };
        let mlp = FeedForward::load(vb, c, layer)?;
        let norm =
            |name: &str| RmsNorm::load(&vb.pp(name), c.hidden_size, c.rms_norm_eps, self.norm());
        Ok(Box::new(HybridLayer {
            mixer,
            mlp,
            input_layernorm: norm("input_layernorm")?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
        }))
    }

    fn norm(&self) -> NormKind {
        NormKind::OnePlusWeight
    }
}

/// A layer's token mixer.
#[derive(Clone)]
enum Mixer {
    Attention(Attention),
    Linear(GatedDeltaNet),
}

#[derive(Clone)]
struct HybridLayer {
    mixer: Mixer,
    mlp: FeedForward,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl Layer for HybridLayer {
    fn forward(
        &self,
        x: Tensor,
        batch: &BatchLayout,
        rope: &RopeTables,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor> {
        let dev = x.device().clone();
        let dev = &dev;
        let x = match &self.mixer {
            Mixer::Attention(attn) => {
                // What q/k/v share, a QDQ or fp8 codes, the norm that feeds them applies.
                let normed = stage("norm", dev, || {
                    self.input_layernorm.forward_for(&x, attn.shared_input())
                })?;
                attn.forward(normed, x, batch, rope)?
            }
            Mixer::Linear(gdn) => {
                let normed = stage("norm", dev, || self.input_layernorm.forward(&x, None))?;
                gdn.forward(normed, x, batch.lens())?
            }
        };
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
        let mixer: Vec<(String, &QuantLinear)> = match &self.mixer {
            Mixer::Attention(attn) => attention_linears(attn).collect(),
            Mixer::Linear(gdn) => gdn
                .linears()
                .into_iter()
                .map(|(n, l)| (format!("linear_attn.{n}"), l))
                .collect(),
        };
        mixer.into_iter().chain(self.mlp.linears()).collect()
    }

    fn linears_mut(&mut self) -> Vec<(String, &mut QuantLinear)> {
        let mut out: Vec<(String, &mut QuantLinear)> = match &mut self.mixer {
            Mixer::Attention(attn) => attn
                .linears_mut()
                .into_iter()
                .map(|(n, l)| (format!("self_attn.{n}"), l))
                .collect(),
            Mixer::Linear(gdn) => gdn
                .linears_mut()
                .into_iter()
                .map(|(n, l)| (format!("linear_attn.{n}"), l))
                .collect(),
        };
        out.extend(self.mlp.linears_mut());
        out
    }

    fn clone_box(&self) -> Box<dyn Layer> {
        Box::new(self.clone())
    }
}
