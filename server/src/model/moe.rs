//! Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): a router picks `top_k` experts per
//! token; each expert is a gated MLP. Tokens are grouped by expert, and an expert's weights are
//! dequantized right before its GEMMs and dropped after: never all experts at once (a 30B-A3B
//! checkpoint is ~60 GB in bf16).

use candle_core::{DType, Result, Tensor, D};

use super::checkpoint::{Checkpoint, LoadError};
use super::config::{Activation, ModelConfig, MoeConfig};
use super::profile::stage;
use crate::quant::{QuantLinear, SCALE_DTYPES};

/// One expert: a gated MLP whose Linears may be in any supported format.
pub(crate) struct Expert {
    pub(crate) gate_proj: QuantLinear,
    pub(crate) up_proj: QuantLinear,
    pub(crate) down_proj: QuantLinear,
}

pub(crate) struct Moe {
    /// The router `[experts, hidden]`, in the compute dtype (llm-compressor leaves it unquantized).
    router: Tensor,
    pub(crate) experts: Vec<Expert>,
    cfg: MoeConfig,
    act: Activation,
}

/// The experts a token goes to, with their routing weights (f32), best first.
pub type Route = Vec<(usize, f32)>;

/// Loads the Linear `name` of `(out, in)` features in its checkpoint's format.
pub(crate) type LinearLoad<'a> =
    &'a dyn Fn(&str, (usize, usize)) -> std::result::Result<QuantLinear, LoadError>;

impl Moe {
    /// The sparse block of decoder layer `prefix` (`model.layers.N`).
    pub(crate) fn load(
        ckpt: &Checkpoint,
        load_linear: LinearLoad<'_>,
        c: &ModelConfig,
        cfg: &MoeConfig,
        prefix: &str,
        opts: &crate::quant::LinearOptions,
    ) -> std::result::Result<Self, LoadError> {
        let (h, inter) = (c.hidden_size, cfg.expert_intermediate_size);
        let (block, [gate, up, down]) = if cfg.mixtral_names {
            ("block_sparse_moe", ["w1", "w3", "w2"])
        } else {
            ("mlp", ["gate_proj", "up_proj", "down_proj"])
        };
        let router = ckpt.tensor_as(
            &format!("{prefix}.{block}.gate.weight"),
            SCALE_DTYPES,
            Some(&[cfg.num_experts, h]),
            opts.dtype,
            &opts.device,
        )?;
        let experts = (0..cfg.num_experts)
            .map(|e| {
                let p = format!("{prefix}.{block}.experts.{e}");
                Ok(Expert {
                    gate_proj: load_linear(&format!("{p}.{gate}"), (inter, h))?,
                    up_proj: load_linear(&format!("{p}.{up}"), (inter, h))?,
                    down_proj: load_linear(&format!("{p}.{down}"), (h, inter))?,
                })
            })
            .collect::<std::result::Result<Vec<_>, LoadError>>()?;
        Ok(Self {
            router,
            experts,
            cfg: cfg.clone(),
            act: c.hidden_act,
        })
    }

    /// Every token's experts, as transformers picks them: router logits in the compute dtype,
    /// softmax in f32, the `top_k` largest (ties to the lower index), renormalised in f32 when
    /// `norm_topk_prob`.
    pub(crate) fn route(&self, x: &Tensor) -> Result<Vec<Route>> {
        let logits = x.matmul(&self.router.t()?)?;
        let probs = candle_nn::ops::softmax_last_dim(&logits.to_dtype(DType::F32)?)?;
        let probs: Vec<Vec<f32>> = probs.to_device(&candle_core::Device::Cpu)?.to_vec2()?;
        Ok(probs
            .into_iter()
            .map(|p| {
                let mut order: Vec<usize> = (0..p.len()).collect();
                // stable: equal probabilities keep the lower expert first, as torch.topk does
                order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
                let mut top: Route = order[..self.cfg.experts_per_token]
                    .iter()
                    .map(|&e| (e, p[e]))
                    .collect();
                if self.cfg.norm_topk_prob {
                    let sum: f32 = top.iter().map(|(_, w)| w).sum();
                    top.iter_mut().for_each(|(_, w)| *w /= sum);
                }
                top
            })
            .collect())
    }

    /// `residual` plus the experts' weighted outputs for `x` (`[tokens, hidden]`, normed).
    /// `routes`: where to record every token's experts (tests and diagnostics).
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        residual: Tensor,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor> {
        let dev = x.device().clone();
        let dtype = x.dtype();
        let tokens = x.dims()[0];
        let route = stage("router", &dev, || self.route(x))?;
        // tokens grouped by expert: (token, routing weight)
        let mut groups: Vec<Vec<(u32, f32)>> = vec![Vec::new(); self.experts.len()];
        for (t, r) in route.iter().enumerate() {
            for &(e, w) in r {
                groups[e].push((t as u32, w));
            }
        }
        crate::model::profile::record_expert_load(groups.iter().map(Vec::len));
        let mut out = Tensor::zeros(x.dims(), dtype, &dev)?;
        for (expert, group) in self.experts.iter().zip(&groups) {
            if group.is_empty() {
                continue;
            }
            let n = group.len();
            let idx: Vec<u32> = group.iter().map(|(t, _)| *t).collect();
            let w: Vec<f32> = group.iter().map(|(_, w)| *w).collect();
            let idx = Tensor::from_vec(idx, n, &dev)?;
            let w = Tensor::from_vec(w, (n, 1), &dev)?;
            let y = stage("experts", &dev, || {
                let xs = x.index_select(&idx, 0)?;
                let gate = expert.gate_proj.forward(&xs)?;
                let up = expert.up_proj.forward(&xs)?;
                let act = match self.act {
                    Activation::Silu => candle_nn::ops::silu(&gate)?,
                    Activation::GeluTanh => gate.gelu()?,
                };
                expert.down_proj.forward(&(act * up)?)
            })?;
            // Qwen3-MoE weights the expert in the compute dtype; Mixtral in f32, then rounds.
            let y = if self.cfg.weights_in_compute_dtype {
                y.broadcast_mul(&w.to_dtype(dtype)?)?
            } else {
                y.to_dtype(DType::F32)?.broadcast_mul(&w)?.to_dtype(dtype)?
            };
            out = out.index_add(&idx, &y, 0)?;
        }
        debug_assert_eq!(out.dim(D::Minus1)?, residual.dim(D::Minus1)?);
        debug_assert_eq!(out.dims()[0], tokens);
        if let Some(routes) = routes {
            routes.extend(route);
        }
        residual + out
    }

    /// Every Linear of the experts with its name suffix (`experts.E.gate_proj` ...).
    pub(crate) fn linears(&self) -> impl Iterator<Item = (String, &QuantLinear)> {
        self.experts.iter().enumerate().flat_map(|(e, x)| {
            [
                ("gate_proj", &x.gate_proj),
                ("up_proj", &x.up_proj),
                ("down_proj", &x.down_proj),
            ]
            .into_iter()
            .map(move |(n, l)| (format!("experts.{e}.{n}"), l))
        })
    }
}
