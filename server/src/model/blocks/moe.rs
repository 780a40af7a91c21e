//! Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): a router picks `top_k` experts per
//! token; each expert is a gated MLP. Tokens are grouped by expert, and an expert's weights are
//! dequantized right before its GEMMs and dropped after: never all experts at once (a 30B-A3B
//! checkpoint is ~60 GB in bf16).

use candle_core::{DType, Result, Tensor};

use super::mlp::{Mlp, PROJ_NAMES};
use crate::checkpoint::LoadError;
use crate::model::config::{ModelConfig, MoeConfig};
use crate::model::loader::Loader;
use crate::model::profile::{self, stage};
use crate::ops;
use crate::quant::QuantLinear;

#[derive(Clone)]
pub struct Moe {
    /// The router `[experts, hidden]`, in the compute dtype (llm-compressor leaves it unquantized).
    router: Tensor,
    /// Gated MLPs whose Linears may be in any supported format.
    experts: Vec<Mlp>,
    cfg: MoeConfig,
}

/// The experts a token goes to, with their routing weights (f32), best first.
pub type Route = Vec<(usize, f32)>;

impl Moe {
    /// The sparse block of the decoder layer whose tensors `vb` names (`model.layers.N`):
    /// Qwen3-MoE's `mlp.{gate, experts.E.{gate,up,down}_proj}` or Mixtral's
    /// `block_sparse_moe.{gate, experts.E.{w1,w3,w2}}`.
    pub fn load(
        vb: &Loader,
        c: &ModelConfig,
        cfg: &MoeConfig,
    ) -> std::result::Result<Self, LoadError> {
        let (h, inter) = (c.hidden_size, cfg.expert_intermediate_size);
        let (block, names) = if cfg.mixtral_names {
            ("block_sparse_moe", ["w1", "w3", "w2"])
        } else {
            ("mlp", PROJ_NAMES)
        };
        let vb = vb.pp(block);
        let router = vb.get("gate.weight", &[cfg.num_experts, h])?;
        let experts = (0..cfg.num_experts)
            .map(|e| {
                let expert = vb.pp("experts").pp(e);
                Mlp::load(&expert, names, (h, inter), false, c.hidden_act)
            })
            .collect::<std::result::Result<Vec<_>, LoadError>>()?;
        Ok(Self {
            router,
            experts,
            cfg: cfg.clone(),
        })
    }

    /// Every token's experts, as transformers picks them: router logits in the compute dtype,
    /// softmax in f32, the `top_k` largest (ties to the lower index), renormalised in f32 when
    /// `norm_topk_prob`.
    pub fn route(&self, x: &Tensor) -> Result<Vec<Route>> {
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
    /// `routes`: where to record every token's experts (tests and diagnostics). Each expert's
    /// MLP is profiled under the MLP's stages.
    pub fn forward(
        &self,
        x: &Tensor,
        residual: Tensor,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor> {
        let dev = x.device().clone();
        let dtype = x.dtype();
        let hidden = x.dims()[1];
        let route = stage("router", &dev, || self.route(x))?;
        // tokens grouped by expert: (token, routing weight)
        let mut groups: Vec<Vec<(u32, f32)>> = vec![Vec::new(); self.experts.len()];
        for (t, r) in route.iter().enumerate() {
            for &(e, w) in r {
                groups[e].push((t as u32, w));
            }
        }
        profile::record_expert_load(groups.iter().map(Vec::len));
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
            let xs = stage("experts", &dev, || ops::gather_rows(x, &idx))?;
            // The expert's output alone: added into a zero stream (0 + y = y exactly).
            let y = expert.forward(xs, Tensor::zeros((n, hidden), dtype, &dev)?, false)?;
            out = stage("experts", &dev, || {
                // Qwen3-MoE weights the expert in the compute dtype; Mixtral in f32, then rounds.
                let y = if self.cfg.weights_in_compute_dtype {
                    y.broadcast_mul(&w.to_dtype(dtype)?)?
                } else {
                    y.to_dtype(DType::F32)?.broadcast_mul(&w)?.to_dtype(dtype)?
                };
                out.index_add(&idx, &y, 0)
            })?;
        }
        if let Some(routes) = routes {
            routes.extend(route);
        }
        residual + out
    }

    /// Every Linear of the experts with its name suffix (`experts.E.gate_proj` ...).
    pub fn linears(&self) -> impl Iterator<Item = (String, &QuantLinear)> {
        self.experts.iter().enumerate().flat_map(|(e, x)| {
            x.linears()
                .into_iter()
                .map(move |(n, l)| (format!("experts.{e}.{n}"), l))
        })
    }

    /// [`Self::linears`], to replace one.
    pub fn linears_mut(&mut self) -> impl Iterator<Item = (String, &mut QuantLinear)> {
        self.experts.iter_mut().enumerate().flat_map(|(e, x)| {
            x.linears_mut()
                .into_iter()
                .map(move |(n, l)| (format!("experts.{e}.{n}"), l))
        })
    }
}
