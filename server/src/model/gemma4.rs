//! Gemma 4 (text): Gemma's sandwich of norms around the attention and the feed-forward, with
//! plain-weight RMSNorms in f32 (`x̂ · w`, not Gemma 2/3's `1 + w`), embeddings scaled by
//! √hidden, [`SharedKvAttention`] (per-layer heads, keys as values, KV-shared layers, unscaled
//! scores), the full and sliding layers each with their own RoPE tables (the full layers'
//! proportional), a routed mixture beside the dense MLP where the config enables it, per-layer
//! inputs (PLE) and a per-layer output scale (`layer_scalar`) (docs/architectures/gemma4.md).
//!
//! What a layer hands the next is a stream wider than the residual (see
//! [`Gemma4Text::stream_width`]): the residual stream, every layer's per-layer input (computed
//! once from the tokens, [`PerLayerInputs`]), then the keys and values that KV-shared layers
//! read, appended by the layer that computes them. Pipeline stages, `/diff` and the engine
//! carry it as they carry any hidden state; [`super::Model::residual`] is its first
//! `hidden_size` columns.

use candle_core::{DType, Device, Result, Tensor};

use super::blocks::{
    BatchLayout, FeedForward, KeyValues, Mlp, Moe, NormKind, Normed, RmsNorm, Route,
    SharedKvAttention, PROJ_NAMES,
};
use super::config::{
    Activation, Gemma4Moe, Gemma4Text, KeySource, ModelConfig, MoeConfig, MoeRouter,
};
use super::decoder::{Family, Layer};
use super::loader::Loader;
use super::profile::stage;
use super::rope::RopeTables;
use crate::checkpoint::LoadError;
use crate::ops;
use crate::quant::QuantLinear;

/// The Gemma 4 family.
pub struct Gemma4;

/// The Gemma 4 parts of a config (present for every Gemma 4 architecture).
fn text(c: &ModelConfig) -> std::result::Result<&Gemma4Text, LoadError> {
    c.gemma4
        .as_ref()
        .ok_or_else(|| LoadError::config("architectures", "not a Gemma 4 text model"))
}

impl Family for Gemma4 {
    fn load_layer(
        &self,
        vb: &Loader,
        c: &ModelConfig,
        layer: usize,
    ) -> std::result::Result<Box<dyn Layer>, LoadError> {
        let g = text(c)?;
        let shape = &g.layers[layer];
        let h = c.hidden_size;
        let norm = |name: &str| RmsNorm::load(&vb.pp(name), h, c.rms_norm_eps, self.norm());
        let mlp = Mlp::load(
            &vb.pp("mlp"),
            PROJ_NAMES,
            (h, shape.intermediate_size),
            c.mlp_bias,
            c.hidden_act,
        )?;
        let moe = g
            .moe
            .map(|m| MoeBranch::load(vb, c, &m, self.norm()))
            .transpose()?;
        let per_layer_input = g
            .per_layer_input
            .map(|width| -> std::result::Result<_, LoadError> {
                Ok(PerLayerInputGate {
                    gate: vb.linear("per_layer_input_gate", (width, h), false)?,
                    projection: vb.linear("per_layer_projection", (h, width), false)?,
                    norm: norm("post_per_layer_input_norm")?,
                    act: c.hidden_act,
                    at: h + layer * width,
                    width,
                })
            })
            .transpose()?;
        Ok(Box::new(Gemma4DecoderLayer {
            self_attn: SharedKvAttention::load(&vb.pp("self_attn"), c, layer, shape)?,
            mlp: FeedForward::Dense(mlp),
            moe,
            per_layer_input,
            input_layernorm: norm("input_layernorm")?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            pre_feedforward_layernorm: norm("pre_feedforward_layernorm")?,
            post_feedforward_layernorm: norm("post_feedforward_layernorm")?,
            layer_scalar: vb.get("layer_scalar", &[1])?,
            hidden: h,
            keys: shape.keys,
            kv_width: shape.num_kv_heads * shape.head_dim,
            sliding: shape.sliding,
        }))
    }

    fn norm(&self) -> NormKind {
        NormKind::WeightInF32
    }

    fn embed_scale(&self, c: &ModelConfig) -> Option<f64> {
        Some((c.hidden_size as f64).sqrt())
    }
}

/// The per-layer inputs of every layer, `[tokens, layers * width]`, from the tokens and their
/// scaled embeddings: `(norm(projection(embeds) / √hidden) + embed_per_layer(ids) · √width)
/// / √2`, the norm over each layer's `width` columns.
pub struct PerLayerInputs {
    /// `[vocab, layers * width]` in the compute dtype.
    embed: Tensor,
    projection: QuantLinear,
    norm: RmsNorm,
    layers: usize,
    width: usize,
    hidden: usize,
}

impl PerLayerInputs {
    /// Loads `{vb}.embed_tokens_per_layer`, `.per_layer_model_projection` and
    /// `.per_layer_projection_norm` (`vb`: the text model, `model`), where the config has them.
    pub fn load(vb: &Loader, c: &ModelConfig) -> std::result::Result<Option<Self>, LoadError> {
        let Some(width) = c.gemma4.as_ref().and_then(|g| g.per_layer_input) else {
            return Ok(None);
        };
        let (layers, h) = (c.num_layers, c.hidden_size);
        let all = layers * width;
        // On the CPU first: converted there to the compute dtype (no GPU conversion kernel).
        let embed = vb
            .get_as(
                "embed_tokens_per_layer.weight",
                &[c.vocab_size, all],
                vb.options().dtype,
                &Device::Cpu,
            )?
            .to_device(&vb.options().device)?;
        Ok(Some(Self {
            embed,
            projection: vb.linear("per_layer_model_projection", (all, h), false)?,
            norm: RmsNorm::load(
                &vb.pp("per_layer_projection_norm"),
                width,
                c.rms_norm_eps,
                NormKind::WeightInF32,
            )?,
            layers,
            width,
            hidden: h,
        }))
    }

    /// The per-layer inputs of tokens `ids` whose scaled embeddings are `embeds`.
    pub fn forward(&self, ids: &Tensor, embeds: &Tensor) -> Result<Tensor> {
        let tokens = embeds.dims()[0];
        let dtype = embeds.dtype();
        // each scalar rounded to the compute dtype where transformers keeps it as a tensor
        let scalar = |v: f64| Tensor::new(v as f32, embeds.device())?.to_dtype(dtype);
        let projected = (self.projection.forward(embeds)? * (self.hidden as f64).powf(-0.5))?;
        let projected = self
            .norm
            .forward(&projected.reshape((tokens, self.layers, self.width))?, None)?
            .reshape((tokens, self.layers * self.width))?;
        let identity = ops::gather_rows(&self.embed, ids)?
            .broadcast_mul(&scalar((self.width as f64).sqrt())?)?;
        (projected + identity)? * 0.5f64.sqrt()
    }
}

/// A layer's per-layer input: `x + norm(projection(act(gate(x)) · input))`.
#[derive(Clone)]
struct PerLayerInputGate {
    gate: QuantLinear,
    projection: QuantLinear,
    norm: RmsNorm,
    act: Activation,
    /// The layer's input: `width` stream columns from `at`.
    at: usize,
    width: usize,
}

/// Gemma 4's router: `softmax(proj(norm(x) · scale / √hidden))`, its top k renormalised, each
/// times its expert's `per_expert_scale`.
#[derive(Clone)]
struct Router {
    /// `[experts, hidden]`, in the compute dtype (left unquantized).
    proj: Tensor,
    /// `[hidden]`, in the compute dtype.
    scale: Tensor,
    per_expert_scale: Vec<f32>,
    /// The same as a column `[experts + 1, 1]` of f32 on the model's device (routing there),
    /// its last row NaN: the id `experts` is what the device router gives a token whose scores
    /// were NaN, and the gather reads every id it is given.
    per_expert_scale_on_device: Tensor,
    norm: RmsNorm,
    top_k: usize,
    hidden: usize,
}

impl Router {
    fn load(vb: &Loader, c: &ModelConfig, m: &Gemma4Moe) -> std::result::Result<Self, LoadError> {
        let h = c.hidden_size;
        // in the compute dtype as the model holds it, then f32 as transformers multiplies the
        // (f32) routing weights by it
        let per_expert_scale = vb
            .get_as(
                "per_expert_scale",
                &[m.num_experts],
                vb.options().dtype,
                &Device::Cpu,
            )?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        let device = &vb.options().device;
        Ok(Self {
            proj: vb.get("proj.weight", &[m.num_experts, h])?,
            scale: vb.get("scale", &[h])?,
            per_expert_scale_on_device: Tensor::new(
                [per_expert_scale.as_slice(), &[f32::NAN]]
                    .concat()
                    .as_slice(),
                device,
            )?
            .reshape((m.num_experts + 1, 1))?,
            per_expert_scale,
            norm: RmsNorm::unit(h, c.rms_norm_eps, &vb.options().device)?,
            top_k: m.top_k,
            hidden: h,
        })
    }

    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let normed = self.norm.forward(x, None)?.broadcast_mul(&self.scale)?;
        let scaled = (normed * (self.hidden as f64).powf(-0.5))?;
        ops::matmul_t(&scaled, &self.proj)
    }

    fn route(&self, x: &Tensor) -> Result<ops::TopExperts> {
        let mut top = ops::moe_route(&self.logits(x)?, self.top_k, true)?;
        for (w, &e) in top.weights.iter_mut().zip(&top.experts) {
            *w *= self.per_expert_scale[e as usize];
        }
        Ok(top)
    }

    /// [`Self::route`] left on the GPU: ids and f32 weights `[tokens · k]`, the weights times
    /// their experts' scales there (the same f32 products).
    fn route_on_device(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let (ids, weights) = ops::moe_route_on_device(&self.logits(x)?, self.top_k, true)?;
        let scales = ops::gather_rows(&self.per_expert_scale_on_device, &ids)?;
        let scales = scales.reshape(weights.shape())?;
        Ok((ids, (weights * scales)?))
    }
}

/// The routed experts beside the dense MLP, with their own norms.
#[derive(Clone)]
struct MoeBranch {
    router: Router,
    experts: Moe,
    pre_feedforward_layernorm_2: RmsNorm,
    post_feedforward_layernorm_1: RmsNorm,
    post_feedforward_layernorm_2: RmsNorm,
}

impl MoeBranch {
    fn load(
        vb: &Loader,
        c: &ModelConfig,
        m: &Gemma4Moe,
        kind: NormKind,
    ) -> std::result::Result<Self, LoadError> {
        let cfg = MoeConfig {
            num_experts: m.num_experts,
            experts_per_token: m.top_k,
            expert_intermediate_size: m.intermediate_size,
            norm_topk_prob: true,
            sparse_layers: vec![true; c.num_layers],
            mixtral_names: false,
            // f32 routing weights times the experts' outputs, as transformers promotes them
            weights_in_compute_dtype: false,
            shared_expert_intermediate_size: None,
            shared_expert_gate: false,
            router: MoeRouter::Softmax,
            gpt_oss_experts: false,
        };
        let norm = |name: &str| RmsNorm::load(&vb.pp(name), c.hidden_size, c.rms_norm_eps, kind);
        Ok(Self {
            router: Router::load(&vb.pp("router"), c, m)?,
            experts: Moe::load_experts(&vb.experts("experts"), c, &cfg)?,
            pre_feedforward_layernorm_2: norm("pre_feedforward_layernorm_2")?,
            post_feedforward_layernorm_1: norm("post_feedforward_layernorm_1")?,
            post_feedforward_layernorm_2: norm("post_feedforward_layernorm_2")?,
        })
    }

    /// `norm_1(dense) + norm_2(experts(norm(x)))`, routed on the residual stream `x`.
    fn forward(
        &self,
        x: &Tensor,
        dense: &Tensor,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor> {
        let dev = x.device();
        let normed = stage("norm", dev, || {
            self.pre_feedforward_layernorm_2.forward(x, None)
        })?;
        // Routed on the device where the experts' rows can be planned there, with no host
        // round trip; on the host where the routes are recorded.
        let experts = match routes.is_none() && self.experts.experts_plan_on_device(&normed)? {
            true => {
                let (ids, weights) = stage("router", dev, || self.router.route_on_device(x))?;
                self.experts
                    .forward_routed_on_device(&normed, &ids, &weights, x.zeros_like()?)?
            }
            false => {
                let top = stage("router", dev, || self.router.route(x))?;
                self.experts
                    .forward_routed(&normed, top, x.zeros_like()?, routes)?
            }
        };
        stage("norm", dev, || {
            self.post_feedforward_layernorm_1.forward(dense, None)?
                + self.post_feedforward_layernorm_2.forward(&experts, None)?
        })
    }
}

#[derive(Clone)]
struct Gemma4DecoderLayer {
    self_attn: SharedKvAttention,
    mlp: FeedForward,
    moe: Option<MoeBranch>,
    per_layer_input: Option<PerLayerInputGate>,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
    /// `[1]`, in the compute dtype: the layer's output is multiplied by it.
    layer_scalar: Tensor,
    hidden: usize,
    keys: KeySource,
    /// `kv_heads * head_dim`: the width of the keys, and of the values.
    kv_width: usize,
    sliding: bool,
}

impl Gemma4DecoderLayer {
    /// The keys and values stored at column `at` of the stream.
    fn stored(&self, stream: &Tensor, at: usize) -> Result<KeyValues> {
        let columns = |start| stream.narrow(1, start, self.kv_width)?.contiguous();
        Ok(KeyValues {
            keys: columns(at)?,
            values: columns(at + self.kv_width)?,
        })
    }
}

impl Layer for Gemma4DecoderLayer {
    fn forward(
        &self,
        stream: Tensor,
        batch: &BatchLayout,
        rope: &RopeTables,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor> {
        let dev = stream.device().clone();
        let dev = &dev;
        let width = stream.dims()[1];
        let x = stream.narrow(1, 0, self.hidden)?.contiguous()?;
        let normed = stage("norm", dev, || self.input_layernorm.forward(&x, None))?;
        let own = self.self_attn.key_values(&normed)?;
        let kv = match (self.keys, &own) {
            (KeySource::Shared { at }, _) => self.stored(&stream, at)?,
            (KeySource::Own { .. }, Some(kv)) => KeyValues {
                keys: kv.keys.clone(),
                values: kv.values.clone(),
            },
            (KeySource::Own { .. }, None) => candle_core::bail!("a layer without keys owns them"),
        };
        let out = self.self_attn.forward(&normed, &kv, batch, rope)?;
        // What the attention read goes now, but for keys and values a later layer reads: at
        // eight windows of 2048 these are ~0.25 GB that the feed-forward's peak would hold.
        drop((kv, normed));
        let stored = match self.keys {
            KeySource::Own {
                stored_at: Some(at),
            } => own.map(|kv| (at, kv)),
            _ => None,
        };
        let x = (&x
            + stage("norm", dev, || {
                self.post_attention_layernorm.forward(&out, None)
            })?)?;
        drop(out);
        let normed = stage("norm", dev, || {
            self.pre_feedforward_layernorm.forward(&x, None)
        })?;
        let dense = self
            .mlp
            .forward(Normed::plain(normed), x.zeros_like()?, None)?;
        let ff = match &self.moe {
            Some(moe) => moe.forward(&x, &dense, routes)?,
            None => dense,
        };
        let mut x = (&x
            + stage("norm", dev, || {
                self.post_feedforward_layernorm.forward(&ff, None)
            })?)?;
        if let Some(p) = &self.per_layer_input {
            let input = stream.narrow(1, p.at, p.width)?.contiguous()?;
            let gated = ops::gated_mul(p.act, &p.gate.forward(&x)?, &input, None)?;
            let y = p.projection.forward(&gated)?;
            x = (&x + stage("norm", dev, || p.norm.forward(&y, None))?)?;
        }
        let x = x.broadcast_mul(&self.layer_scalar)?;
        let mut parts = vec![x];
        if width > self.hidden {
            parts.push(stream.narrow(1, self.hidden, width - self.hidden)?);
        }
        if let Some((at, kv)) = stored {
            if at != width {
                candle_core::bail!("keys stored at stream column {at}, the stream has {width}");
            }
            parts.extend([kv.keys, kv.values]);
        }
        Tensor::cat(&parts, 1)
    }

    fn local_rope(&self) -> bool {
        self.sliding
    }

    fn feed_forward(&self) -> &FeedForward {
        &self.mlp
    }

    fn routes_experts(&self) -> bool {
        self.moe.is_some()
    }

    fn linears(&self) -> Vec<(String, &QuantLinear)> {
        let attention = self.self_attn.linears().into_iter();
        let experts = self.moe.iter().flat_map(|m| m.experts.linears());
        let per_layer = self.per_layer_input.iter().flat_map(|p| {
            [
                ("per_layer_input_gate".to_string(), &p.gate),
                ("per_layer_projection".to_string(), &p.projection),
            ]
        });
        attention
            .map(|(n, l)| (format!("self_attn.{n}"), l))
            .chain(self.mlp.linears())
            .chain(experts)
            .chain(per_layer)
            .collect()
    }

    fn linears_mut(&mut self) -> Vec<(String, &mut QuantLinear)> {
        let attention = self.self_attn.linears_mut().into_iter();
        let experts = self.moe.iter_mut().flat_map(|m| m.experts.linears_mut());
        let per_layer = self.per_layer_input.iter_mut().flat_map(|p| {
            [
                ("per_layer_input_gate".to_string(), &mut p.gate),
                ("per_layer_projection".to_string(), &mut p.projection),
            ]
        });
        attention
            .map(|(n, l)| (format!("self_attn.{n}"), l))
            .chain(self.mlp.linears_mut())
            .chain(experts)
            .chain(per_layer)
            .collect()
    }

    fn clone_box(&self) -> Box<dyn Layer> {
        Box::new(self.clone())
    }
}
