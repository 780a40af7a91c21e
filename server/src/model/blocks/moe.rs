//! Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): a router picks `top_k` experts per
//! token; each expert is a gated MLP. Tokens are grouped by expert, and an expert's weights are
//! dequantized right before its GEMMs and dropped after: never all experts at once (a 30B-A3B
//! checkpoint is ~60 GB in bf16).

use candle_core::{Result, Tensor};

use super::mlp::{Mlp, PROJ_NAMES};
use crate::checkpoint::LoadError;
use crate::model::config::{ModelConfig, MoeConfig};
use crate::model::loader::Loader;
use crate::model::profile::{self, stage};
use crate::ops::{self, TopExperts};
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
        let max = ops::moe_max_experts(&vb.options().device);
        if cfg.num_experts > max {
            return Err(LoadError::config(
                "num_experts",
                format!(
                    "{} experts; the GPU router handles up to {max}",
                    cfg.num_experts
                ),
            ));
        }
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
    /// `norm_topk_prob` ([`ops::moe_route`]).
    pub fn route(&self, x: &Tensor) -> Result<TopExperts> {
        let logits = x.matmul(&self.router.t()?)?;
        ops::moe_route(&logits, self.cfg.experts_per_token, self.cfg.norm_topk_prob)
    }

    /// `residual` plus the weighted sum of each token's experts. The routed tokens are sorted
    /// by expert and gathered once; each expert runs on its contiguous rows (its weights
    /// dequantized right before its GEMMs, one expert's alive at a time); the outputs are
    /// weighted and added back per token in ascending expert order by one kernel.
    pub fn forward(
        &self,
        x: &Tensor,
        residual: Tensor,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor> {
        let dev = x.device().clone();
        let dtype = x.dtype();
        let hidden = x.dims()[1];
        let top = stage("router", &dev, || self.route(x))?;
        let plan = ExpertRows::new(&top, self.experts.len());
        profile::record_expert_load(plan.ranges.iter().map(|r| r.len()));
        let (rows_token, positions, weights, xs) = stage("experts", &dev, || {
            let rows_token = Tensor::new(plan.token.as_slice(), &dev)?;
            let tokens = plan.positions.len() / top.k.max(1);
            let positions = Tensor::from_slice(&plan.positions, (tokens, top.k), &dev)?;
            let weights = Tensor::from_slice(&plan.weight, (plan.token.len(), 1), &dev)?;
            let xs = ops::gather_rows(x, &rows_token)?;
            Ok((rows_token, positions, weights, xs))
        })?;
        let mut ys = Vec::new();
        for (expert, rows) in self.experts.iter().zip(&plan.ranges) {
            if rows.is_empty() {
                continue;
            }
            let n = rows.len();
            let xs = xs.narrow(0, rows.start, n)?;
            ys.push(expert.forward(xs, Tensor::zeros((n, hidden), dtype, &dev)?, false)?);
        }
        let out = stage("experts", &dev, || {
            ops::moe_combine(
                &Tensor::cat(&ys, 0)?,
                &weights,
                self.cfg.weights_in_compute_dtype,
                &rows_token,
                &positions,
                &residual,
            )
        })?;
        if let Some(routes) = routes {
            let pairs = top.experts.iter().map(|&e| e as usize).zip(top.weights);
            let pairs: Vec<(usize, f32)> = pairs.collect();
            routes.extend(pairs.chunks(top.k.max(1)).map(<[_]>::to_vec));
        }
        Ok(out)
    }

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

/// The routed tokens sorted by expert: one row per (token, expert) pair.
struct ExpertRows {
    /// Each row's token.
    token: Vec<u32>,
    /// Each row's router weight.
    weight: Vec<f32>,
    /// Each expert's rows.
    ranges: Vec<std::ops::Range<usize>>,
    /// `[tokens, k]`: each token's rows, in ascending expert order.
    positions: Vec<u32>,
}

impl ExpertRows {
    fn new(top: &TopExperts, experts: usize) -> Self {
        let k = top.k;
        let mut groups: Vec<Vec<(u32, f32)>> = vec![Vec::new(); experts];
        for (i, (&e, &w)) in top.experts.iter().zip(&top.weights).enumerate() {
            groups[e as usize].push(((i / k) as u32, w));
        }
        let mut rows = ExpertRows {
            token: Vec::with_capacity(top.experts.len()),
            weight: Vec::with_capacity(top.experts.len()),
            ranges: Vec::with_capacity(experts),
            positions: vec![0; top.experts.len()],
        };
        let mut filled = vec![0usize; top.experts.len() / k.max(1)];
        for group in groups {
            let start = rows.token.len();
            for (t, w) in group {
                let t = t as usize;
                rows.positions[t * k + filled[t]] = rows.token.len() as u32;
                filled[t] += 1;
                rows.token.push(t as u32);
                rows.weight.push(w);
            }
            rows.ranges.push(start..rows.token.len());
        }
        rows
    }
}
