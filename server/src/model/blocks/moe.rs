//! Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral, Qwen3-Next, Qwen3.5-MoE, DeepSeek-V3,
//! GLM-4.5): a router picks `top_k` experts per token (by softmax, or DeepSeek's group-limited
//! sigmoid scores); each expert is a gated MLP; Qwen3-Next adds a shared expert that every token
//! goes through, weighted by `sigmoid(shared_expert_gate(x))`, DeepSeek shared experts with
//! weight 1. Tokens are
//! grouped by expert, and experts' weights are dequantized right before their GEMMs and dropped
//! after: never all experts at once (a 30B-A3B checkpoint is ~60 GB in bf16). On a GPU in
//! bf16/f16 the experts run stacked, a group at a time, so that a layer costs a few launches
//! rather than several per expert.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use candle_core::{DType, Result, Tensor};

use super::mlp::{forward_stacked, stack_decodes_in_gemm, stackable, Mlp, PROJ_NAMES};
use super::Normed;
use crate::checkpoint::LoadError;
use crate::model::config::{ModelConfig, MoeConfig, MoeRouter};
use crate::model::loader::Loader;
use crate::model::profile::{self, stage};
use crate::ops::{self, StackRows, TopExperts};
use crate::quant::QuantLinear;

/// Whether a mixture may plan its experts' rows on the GPU ([`Moe::plans_on_device`]); off,
/// every mixture plans on the host. On by default; `exactscore-bench check` turns it off to
/// show that both plans give the same bits.
static DEVICE_PLANS: AtomicBool = AtomicBool::new(true);

/// Allows or forbids planning the experts' rows on the GPU, process-wide.
pub fn plan_experts_on_device(on: bool) {
    DEVICE_PLANS.store(on, Ordering::Relaxed);
}

/// The most bytes of routed rows (tokens × experts per token × hidden, in the compute dtype)
/// that one pass of [`Moe::forward_routed`] gathers. Those rows in and out, and the experts'
/// intermediate rows, are most of a large batch's activations (1.8 GB at eight windows of
/// Gemma 4 26B-A4B, 1.28× its weights at the peak); larger batches run their tokens in equal
/// chunks. A chunk gives each expert fewer rows, as a smaller batch does: the same bits
/// (`exactscore-bench check`, and `speed --invariance` on the real shapes).
static ROUTED_ROW_BYTES: AtomicUsize = AtomicUsize::new(512 << 20);

/// Sets the budget of [`ROUTED_ROW_BYTES`], process-wide (tests force small chunks with it).
pub fn set_routed_row_bytes(bytes: usize) {
    ROUTED_ROW_BYTES.store(bytes, Ordering::Relaxed);
}

/// The most tokens one routed pass gathers: [`ROUTED_ROW_BYTES`] of rows of `per_token` ×
/// `hidden` values of `dtype_bytes` (at least one token).
fn tokens_per_pass(per_token: u64, hidden: u64, dtype_bytes: u64) -> usize {
    let row = (per_token * hidden * dtype_bytes).max(1);
    (ROUTED_ROW_BYTES.load(Ordering::Relaxed) as u64 / row).max(1) as usize
}

/// What one routed pass of a mixture holds beyond its input, for the memory plan: the gathered
/// rows of at most [`ROUTED_ROW_BYTES`] (all `tokens` where they fit), the experts' outputs over
/// them, gate, up and their product, and one stack of dequantized experts.
pub fn routed_pass_bytes(
    tokens: u64,
    per_token: u64,
    experts: u64,
    hidden: u64,
    expert_intermediate: u64,
    dtype_bytes: u64,
) -> u64 {
    let per_pass = tokens_per_pass(per_token, hidden, dtype_bytes) as u64;
    let rows = tokens.min(per_pass) * per_token;
    let stack = (experts * 3 * expert_intermediate * hidden * dtype_bytes).min(STACK_BYTES as u64);
    rows * (2 * hidden + 3 * expert_intermediate) * dtype_bytes + stack
}

#[derive(Clone)]
pub struct Moe {
    /// The router `[experts, hidden]`, in the compute dtype (llm-compressor leaves it
    /// unquantized); in f32 for DeepSeek-V3's and DeepSeek-V2's routers, which route in f32.
    /// `None` where the family routes itself ([`Self::load_experts`]).
    router: Option<Tensor>,
    /// gpt-oss's router bias `[experts]`, in the router's dtype.
    router_bias: Option<Tensor>,
    /// DeepSeek's `e_score_correction_bias` (f32 `[experts]`) for [`MoeRouter::SigmoidGrouped`].
    correction_bias: Option<Tensor>,
    /// Gated MLPs whose Linears may be in any supported format.
    experts: Vec<Mlp>,
    cfg: MoeConfig,
    /// The experts can run stacked ([`stackable`]).
    stackable: bool,
    shared: Option<SharedExpert>,
}

/// Qwen3-Next's shared expert, `sigmoid(shared_expert_gate(x)) * shared_expert(x)`, or
/// DeepSeek's `shared_experts(x)`.
#[derive(Clone)]
struct SharedExpert {
    mlp: Mlp,
    /// `[1, hidden]`: one gate logit per token (Qwen's).
    gate: Option<QuantLinear>,
}

impl SharedExpert {
    /// The name of the shared MLP under the block.
    fn name(&self) -> &'static str {
        match self.gate {
            Some(_) => "shared_expert",
            None => "shared_experts",
        }
    }
}

/// Experts whose weights are dequantized and multiplied together, at most: enough that one
/// batched GEMM fills a GPU when each expert has a window's share of rows (128 experts, 8 per
/// token: 128 rows of a 2048-token window each).
const STACK_EXPERTS: usize = 64;
/// Dequantized expert weights alive at once, at most (64 of Qwen3-30B-A3B's experts in bf16).
const STACK_BYTES: usize = 640 << 20;
/// Padding rows an expert may always add to its group.
const STACK_PAD_ROWS: usize = 64;

/// The experts a token goes to, with their routing weights (f32), best first.
pub type Route = Vec<(usize, f32)>;

impl Moe {
    /// The sparse block of the decoder layer whose tensors `vb` names (`model.layers.N`):
    /// Qwen3-MoE's `mlp.{gate, experts.E.{gate,up,down}_proj}` or Mixtral's
    /// `block_sparse_moe.{gate, experts.E.{w1,w3,w2}}`, or the experts fused as transformers
    /// keeps them (`mlp.experts.{gate_up_proj, down_proj}`, [`Mlp::load_fused`]).
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
        if cfg.gpt_oss_experts {
            return Self::load_gpt_oss(&vb, c, cfg);
        }
        let f32 =
            |name: &str, shape: &[usize]| vb.get_as(name, shape, DType::F32, &vb.options().device);
        let (router, correction_bias) = match cfg.router {
            MoeRouter::Softmax
            | MoeRouter::SoftmaxGrouped {
                in_compute_dtype: true,
                ..
            } => (vb.get("gate.weight", &[cfg.num_experts, h])?, None),
            MoeRouter::SoftmaxGrouped { .. } => (f32("gate.weight", &[cfg.num_experts, h])?, None),
            MoeRouter::SigmoidGrouped { .. } => (
                f32("gate.weight", &[cfg.num_experts, h])?,
                Some(f32("gate.e_score_correction_bias", &[cfg.num_experts])?),
            ),
        };
        let stacked = vb.experts("experts");
        let experts = if vb.checkpoint().contains(&stacked.name("gate_up_proj")) {
            Mlp::load_fused(&stacked, cfg.num_experts, (h, inter), c.hidden_act)?
        } else {
            (0..cfg.num_experts)
                .map(|e| {
                    let expert = stacked.pp(e);
                    Mlp::load(&expert, names, (h, inter), false, c.hidden_act)
                })
                .collect::<std::result::Result<Vec<_>, LoadError>>()?
        };
        let shared = cfg
            .shared_expert_intermediate_size
            .map(|inter| {
                let (name, gate) = match cfg.shared_expert_gate {
                    true => (
                        "shared_expert",
                        Some(vb.linear("shared_expert_gate", (1, h), false)?),
                    ),
                    false => ("shared_experts", None),
                };
                // DeepSeek-V2's shared experts are its dense MLP class, biases included.
                let mlp = Mlp::load(
                    &vb.pp(name),
                    PROJ_NAMES,
                    (h, inter),
                    c.mlp_bias,
                    c.hidden_act,
                )?;
                Ok::<_, LoadError>(SharedExpert { mlp, gate })
            })
            .transpose()?;
        Ok(Self {
            router: Some(router),
            router_bias: None,
            correction_bias,
            stackable: stackable(&experts),
            experts,
            cfg: cfg.clone(),
            shared,
        })
    }

    /// gpt-oss's block under `vb` (`mlp`): `router.{weight,bias}` and the fused experts
    /// ([`Mlp::load_gpt_oss`]).
    fn load_gpt_oss(
        vb: &Loader,
        c: &ModelConfig,
        cfg: &MoeConfig,
    ) -> std::result::Result<Self, LoadError> {
        let (h, experts) = (c.hidden_size, cfg.num_experts);
        let inter = cfg.expert_intermediate_size;
        let experts = Mlp::load_gpt_oss(&vb.pp("experts"), experts, (h, inter))?;
        Ok(Self {
            router: Some(vb.get("router.weight", &[cfg.num_experts, h])?),
            router_bias: Some(vb.get("router.bias", &[cfg.num_experts])?),
            correction_bias: None,
            stackable: stackable(&experts),
            experts,
            cfg: cfg.clone(),
            shared: None,
        })
    }

    /// The experts alone, `{vb}.E.{gate,up,down}_proj` or fused (`{vb}.gate_up_proj`), for a
    /// family whose router is its own (Gemma 4's): run with [`Self::forward_routed`]. `vb`
    /// comes from [`Loader::experts`].
    pub fn load_experts(
        vb: &Loader,
        c: &ModelConfig,
        cfg: &MoeConfig,
    ) -> std::result::Result<Self, LoadError> {
        let (h, inter) = (c.hidden_size, cfg.expert_intermediate_size);
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
        let experts = if vb.checkpoint().contains(&vb.name("gate_up_proj")) {
            Mlp::load_fused(vb, cfg.num_experts, (h, inter), c.hidden_act)?
        } else {
            (0..cfg.num_experts)
                .map(|e| Mlp::load(&vb.pp(e), PROJ_NAMES, (h, inter), false, c.hidden_act))
                .collect::<std::result::Result<Vec<_>, LoadError>>()?
        };
        Ok(Self {
            router: None,
            router_bias: None,
            correction_bias: None,
            stackable: stackable(&experts),
            experts,
            cfg: cfg.clone(),
            shared: None,
        })
    }

    /// Every token's experts, as transformers picks them: router logits through
    /// [`ops::matmul_t`] (whose rows do not depend on the other rows of the batch), in the
    /// compute dtype then softmax in f32, the `top_k` largest (ties to the lower index),
    /// renormalised in f32 when `norm_topk_prob` ([`ops::moe_route`]); or a group-limited
    /// router's logits and routing in the router's dtype ([`ops::moe_route_grouped`]).
    pub fn route(&self, x: &Tensor) -> Result<TopExperts> {
        let (k, norm) = (self.cfg.experts_per_token, self.cfg.norm_topk_prob);
        let Some(router) = &self.router else {
            candle_core::bail!("this mixture is routed by its decoder layer");
        };
        match self.cfg.router.grouped(k, norm) {
            Some(routing) => {
                let logits = ops::matmul_t_cast(x, router)?;
                ops::moe_route_grouped(&logits, self.correction_bias.as_ref(), &routing)
            }
            None => ops::moe_route(&self.router_logits(x, router)?, k, norm),
        }
    }

    /// `x · routerᵀ`, plus the router's bias where it has one (gpt-oss).
    fn router_logits(&self, x: &Tensor, router: &Tensor) -> Result<Tensor> {
        let logits = ops::matmul_t(x, router)?;
        match &self.router_bias {
            Some(bias) => logits.broadcast_add(bias),
            None => Ok(logits),
        }
    }

    /// `residual` plus the weighted sum of each token's experts. The routed tokens are sorted
    /// by expert; the experts run one by one on their rows ([`Self::experts_one_by_one`]) or
    /// stacked in groups ([`Self::experts_stacked`]), and their outputs are weighted and added
    /// back per token in ascending expert order by one kernel. With a shared expert, as
    /// transformers sums: the routed experts into zeros, plus the gated shared expert, then the
    /// residual.
    pub fn forward(
        &self,
        x: &Tensor,
        residual: Tensor,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor> {
        if routes.is_none() && self.plans_on_device(x)? {
            let combined = self.experts_planned_on_device(x)?;
            return self.combine(x, combined, residual);
        }
        let top = stage("router", x.device(), || self.route(x))?;
        self.forward_routed(x, top, residual, routes)
    }

    /// Whether the router's choice and the experts' rows can stay on the GPU
    /// ([`Self::experts_planned_on_device`]): the block's own router, and experts stacked in one
    /// int4 GEMM that takes each expert's own row count, which then never has to reach the host.
    fn plans_on_device(&self, x: &Tensor) -> Result<bool> {
        Ok(self.router.is_some() && self.experts_plan_on_device(x)?)
    }

    /// Whether the experts' rows can stay on the GPU whoever routes them (a model's own router
    /// then calls [`Self::forward_routed_on_device`]): experts stacked in one int4 GEMM that
    /// takes each expert's own row count, or dequantized in padded groups (only the counts
    /// leave the GPU) while the batch's routed rows fit one pass.
    pub fn experts_plan_on_device(&self, x: &Tensor) -> Result<bool> {
        let allowed = DEVICE_PLANS.load(Ordering::Relaxed);
        if !(allowed && ops::stacks_experts(x) && self.stackable) {
            return Ok(false);
        }
        if self.decodes_in_gemm(x)? {
            return Ok(true);
        }
        let (tokens, hidden) = x.dims2()?;
        let k = self.cfg.experts_per_token as u64;
        Ok(tokens <= tokens_per_pass(k, hidden as u64, x.dtype().size_in_bytes() as u64))
    }

    /// Whether the experts multiply as one int4 GEMM that decodes their weights, for `x`'s
    /// rows spread evenly over them.
    fn decodes_in_gemm(&self, x: &Tensor) -> Result<bool> {
        let all: Vec<&Mlp> = self.experts.iter().collect();
        let mean_rows = x.dims()[0] * self.cfg.experts_per_token / all.len().max(1);
        stack_decodes_in_gemm(&all, mean_rows, x.dtype())
    }

    /// The router, the experts' rows and the experts' GEMMs without a host round trip: the
    /// router's top-k and the rows' layout are made on the GPU ([`ops::moe_plan`], the layout
    /// [`ExpertRows`] gives), and the int4 GEMMs read each expert's rows from there. The same
    /// rows in the same order as the host plan, so the same bits.
    fn experts_planned_on_device(&self, x: &Tensor) -> Result<Combined> {
        let (dev, k) = (x.device(), self.cfg.experts_per_token);
        let Some(router) = &self.router else {
            candle_core::bail!("this mixture is routed by its decoder layer");
        };
        let norm = self.cfg.norm_topk_prob;
        let (ids, weights) = stage("router", dev, || match self.cfg.router.grouped(k, norm) {
            Some(routing) => {
                let logits = ops::matmul_t_cast(x, router)?;
                ops::moe_route_grouped_on_device(&logits, self.correction_bias.as_ref(), &routing)
            }
            None => ops::moe_route_on_device(&self.router_logits(x, router)?, k, norm),
        })?;
        self.experts_on_device(x, &ids, &weights)
    }

    /// [`Self::forward`] with the experts chosen on the device by the model's own router: `ids`
    /// and `weights` `[tokens · k]` as [`ops::moe_route_on_device`] gives them. Only where
    /// [`Self::experts_plan_on_device`].
    pub fn forward_routed_on_device(
        &self,
        x: &Tensor,
        ids: &Tensor,
        weights: &Tensor,
        residual: Tensor,
    ) -> Result<Tensor> {
        let combined = self.experts_on_device(x, ids, weights)?;
        self.combine(x, combined, residual)
    }

    /// The experts' rows laid out and multiplied on the device from the router's choice there.
    fn experts_on_device(&self, x: &Tensor, ids: &Tensor, weights: &Tensor) -> Result<Combined> {
        if !self.decodes_in_gemm(x)? {
            return self.experts_padded_on_device(x, ids, weights);
        }
        let (dev, k) = (x.device(), self.cfg.experts_per_token);
        let experts = self.experts.len();
        // 64-row tiles where an expert's rows are expected to fit one (a tile decodes its
        // weights once; rows past it take another tile either way).
        let tile_rows = match x.dims()[0] * k / experts.max(1) <= 32 {
            true => 64,
            false => 128,
        };
        let plan = stage("experts", dev, || {
            ops::moe_plan(ids, weights, k, experts, tile_rows)
        })?;
        if profile::enabled() {
            let offsets = plan.offsets.to_vec1::<i64>()?;
            profile::record_expert_load(offsets.windows(2).map(|w| (w[1] - w[0]) as usize));
        }
        let xs = stage("experts", dev, || ops::gather_rows(x, &plan.rows_token))?;
        let y = stage("experts", dev, || {
            ops::expert_rows(plan.rows, x.dims()[1], x)
        })?;
        let all: Vec<&Mlp> = self.experts.iter().collect();
        forward_stacked(&all, xs, StackRows::Planned(&plan), &y, 0)?;
        Ok(Combined {
            y,
            weights: plan.row_weight.reshape((plan.rows, 1))?,
            rows_token: plan.rows_token,
            positions: plan.positions,
        })
    }

    /// [`Self::experts_on_device`] for experts dequantized in groups padded to one row count:
    /// the rows planned on the GPU ([`ops::moe_plan`]), only the experts' counts read back to
    /// form the groups as [`Self::experts_stacked`] forms them, and the rows padded on the GPU
    /// ([`ops::moe_pad_plan`]). The host plan's rows in the host plan's order: the same bits.
    fn experts_padded_on_device(
        &self,
        x: &Tensor,
        ids: &Tensor,
        weights: &Tensor,
    ) -> Result<Combined> {
        let dev = x.device();
        let (k, experts) = (self.cfg.experts_per_token, self.experts.len());
        let (plan, ranges) = stage("experts", dev, || {
            // any tile size: the int4 GEMM's tiles are not read on this path
            let plan = ops::moe_plan(ids, weights, k, experts, 128)?;
            let offsets = plan.offsets.to_vec1::<i64>()?;
            let ranges: Vec<std::ops::Range<usize>> = offsets
                .windows(2)
                .map(|w| w[0] as usize..w[1] as usize)
                .collect();
            Ok((plan, ranges))
        })?;
        profile::record_expert_load(ranges.iter().map(|r| r.len()));
        let groups = self.padded_groups(&ranges, x.dims()[1], x.dtype());
        let (mut dest, mut rows) = (vec![0u32; experts], vec![0u32; experts]);
        let mut padded = 0;
        for (group, counts) in &groups {
            for (&e, &m) in group.iter().zip(counts) {
                (dest[e], rows[e]) = (padded as u32, m as u32);
                padded += m;
            }
        }
        let [rows_token, row_weight, positions] = stage("experts", dev, || {
            ops::moe_pad_plan(&plan, &dest, &rows, padded)
        })?;
        drop(plan);
        Ok(Combined {
            y: self.multiply_groups(x, &groups, &rows_token)?,
            weights: row_weight.reshape((padded, 1))?,
            rows_token,
            positions,
        })
    }

    /// The experts' outputs `[rows, hidden]` over their rows of `x`: each of `groups` (experts
    /// and their row counts, as [`Self::padded_groups`] or the int4 GEMM forms them) gathers
    /// its rows (`rows_token`, u32 on the device: every group's rows, one group after another)
    /// and runs its projections stacked ([`forward_stacked`]) into its rows of the output.
    fn multiply_groups(
        &self,
        x: &Tensor,
        groups: &[(Vec<usize>, Vec<usize>)],
        rows_token: &Tensor,
    ) -> Result<Tensor> {
        let (dev, hidden) = (x.device(), x.dims()[1]);
        // Not cleared: the groups' rows together are all of them, and each group's down
        // projection writes its rows (beta 0).
        let y = stage("experts", dev, || {
            ops::expert_rows(rows_token.elem_count(), hidden, x)
        })?;
        let mut first_row = 0;
        for (group, counts) in groups {
            let n = counts.iter().sum();
            let xs = stage("experts", dev, || {
                ops::gather_rows(x, &rows_token.narrow(0, first_row, n)?)
            })?;
            let members: Vec<&Mlp> = group.iter().map(|&e| &self.experts[e]).collect();
            forward_stacked(&members, xs, StackRows::Counts(counts), &y, first_row)?;
            first_row += n;
        }
        Ok(y)
    }

    /// The experts with rows (`ranges`, one per expert) in the groups that run as batched GEMMs
    /// over their dequantized weights ([`stack_groups`]), each with its experts' row count:
    /// the group's first (largest), to which the others are padded.
    fn padded_groups(
        &self,
        ranges: &[std::ops::Range<usize>],
        hidden: usize,
        dtype: DType,
    ) -> Vec<(Vec<usize>, Vec<usize>)> {
        let expert_bytes = 3 * self.cfg.expert_intermediate_size * hidden * dtype.size_in_bytes();
        let most = (STACK_BYTES / expert_bytes.max(1)).clamp(1, STACK_EXPERTS);
        stack_groups(ranges, most)
            .into_iter()
            .map(|group| {
                let rows = vec![ranges[group[0]].len(); group.len()];
                (group, rows)
            })
            .collect()
    }

    /// [`Self::forward`] with the experts `top` already chosen.
    pub fn forward_routed(
        &self,
        x: &Tensor,
        top: TopExperts,
        residual: Tensor,
        routes: Option<&mut Vec<Route>>,
    ) -> Result<Tensor> {
        let (tokens, hidden) = x.dims2()?;
        let dtype_bytes = x.dtype().size_in_bytes() as u64;
        let most = tokens_per_pass(top.k as u64, hidden as u64, dtype_bytes);
        if tokens > most {
            if let Some(routes) = routes {
                record_routes(&top, routes);
            }
            let chunk = tokens.div_ceil(tokens.div_ceil(most));
            let mut outs = Vec::new();
            for start in (0..tokens).step_by(chunk) {
                let len = chunk.min(tokens - start);
                let rows = start * top.k..(start + len) * top.k;
                let part = TopExperts {
                    k: top.k,
                    experts: top.experts[rows.clone()].to_vec(),
                    weights: top.weights[rows].to_vec(),
                };
                let x = x.narrow(0, start, len)?;
                outs.push(self.forward_routed(&x, part, residual.narrow(0, start, len)?, None)?);
            }
            drop(residual);
            return Tensor::cat(&outs, 0);
        }
        let plan = ExpertRows::new(&top, self.experts.len());
        profile::record_expert_load(plan.ranges.iter().map(|r| r.len()));
        let combined = if ops::stacks_experts(x) && self.stackable {
            self.experts_stacked(x, plan)?
        } else {
            self.experts_one_by_one(x, plan)?
        };
        let out = self.combine(x, combined, residual)?;
        if let Some(routes) = routes {
            record_routes(&top, routes);
        }
        Ok(out)
    }

    /// `residual` plus the experts' outputs added back per token, and the shared expert where
    /// the block has one, in one kernel: as transformers sums them, the routed experts into
    /// zeros, plus the (gated) shared expert, then the residual stream.
    fn combine(&self, x: &Tensor, combined: Combined, residual: Tensor) -> Result<Tensor> {
        let dev = x.device().clone();
        let shared = match &self.shared {
            Some(shared) => {
                let zeros = stage("experts", &dev, || residual.zeros_like())?;
                let y = shared.mlp.forward(Normed::plain(x.clone()), zeros)?;
                Some(match &shared.gate {
                    Some(gate) => stage("shared_expert_gate", &dev, || {
                        y.broadcast_mul(&ops::sigmoid(&gate.forward(x)?)?)
                    })?,
                    None => y,
                })
            }
            None => None,
        };
        stage("experts", &dev, || {
            let Combined {
                y,
                weights,
                rows_token,
                positions,
            } = combined;
            ops::moe_combine(
                &y,
                &weights,
                self.cfg.weights_in_compute_dtype,
                &rows_token,
                &positions,
                &residual,
                shared.as_ref(),
            )
        })
    }

    /// Each expert on its contiguous rows, its weights dequantized right before its GEMMs (one
    /// expert's alive at a time).
    fn experts_one_by_one(&self, x: &Tensor, plan: ExpertRows) -> Result<Combined> {
        let (dev, dtype, hidden) = (x.device(), x.dtype(), x.dims()[1]);
        let rows_token = stage("experts", dev, || Tensor::new(plan.token.as_slice(), dev))?;
        let xs = stage("experts", dev, || ops::gather_rows(x, &rows_token))?;
        let mut ys = Vec::new();
        for (expert, rows) in self.experts.iter().zip(&plan.ranges) {
            if rows.is_empty() {
                continue;
            }
            let n = rows.len();
            let xs = xs.narrow(0, rows.start, n)?;
            let zeros = Tensor::zeros((n, hidden), dtype, dev)?;
            ys.push(expert.forward(Normed::plain(xs), zeros)?);
        }
        Combined::upload(
            Tensor::cat(&ys, 0)?,
            &plan.weight,
            rows_token,
            &plan.positions,
            plan.k,
        )
    }

    /// The experts in groups, most rows first: each group's rows are padded to its first
    /// expert's count (the padding rows repeat a real token, weigh 0 and are never added back),
    /// and each projection runs as one batched GEMM over the group ([`forward_stacked`]), the
    /// outputs written in place into one buffer. Where the experts' weights decode inside the
    /// GEMM ([`stack_decodes_in_gemm`]), all of them are one group with no padding.
    fn experts_stacked(&self, x: &Tensor, plan: ExpertRows) -> Result<Combined> {
        let (dev, dtype, hidden) = (x.device(), x.dtype(), x.dims()[1]);
        let with_rows: Vec<usize> = (0..plan.ranges.len())
            .filter(|&e| !plan.ranges[e].is_empty())
            .collect();
        let all: Vec<&Mlp> = with_rows.iter().map(|&e| &self.experts[e]).collect();
        let mean_rows = plan.token.len() / with_rows.len().max(1);
        // Each group's experts, and the rows each gets: its own count, or its group's first's.
        let groups: Vec<(Vec<usize>, Vec<usize>)> =
            if stack_decodes_in_gemm(&all, mean_rows, dtype)? {
                let rows = with_rows.iter().map(|&e| plan.ranges[e].len()).collect();
                vec![(with_rows, rows)]
            } else {
                self.padded_groups(&plan.ranges, hidden, dtype)
            };
        let padded: usize = groups.iter().flat_map(|(_, rows)| rows).sum();
        // Where each of the plan's rows lands among the padded rows.
        let mut padded_row = vec![0u32; plan.token.len()];
        let (mut rows_token, mut weights) =
            (Vec::with_capacity(padded), Vec::with_capacity(padded));
        for (group, rows) in &groups {
            for (&e, &m) in group.iter().zip(rows) {
                let range = plan.ranges[e].clone();
                let pad = m - range.len();
                for r in range.clone() {
                    padded_row[r] = (rows_token.len() + r - range.start) as u32;
                }
                rows_token.extend_from_slice(&plan.token[range.clone()]);
                weights.extend_from_slice(&plan.weight[range.clone()]);
                rows_token.extend(std::iter::repeat_n(plan.token[range.start], pad));
                weights.extend(std::iter::repeat_n(0.0, pad));
            }
        }
        let positions: Vec<u32> = plan
            .positions
            .iter()
            .map(|&r| padded_row[r as usize])
            .collect();
        let rows_token = stage("experts", dev, || Tensor::new(rows_token.as_slice(), dev))?;
        let y = self.multiply_groups(x, &groups, &rows_token)?;
        Combined::upload(y, &weights, rows_token, &positions, plan.k)
    }

    /// Every Linear with its name under the block (`experts.3.up_proj`,
    /// `shared_expert.down_proj`, `shared_expert_gate`).
    pub fn linears(&self) -> impl Iterator<Item = (String, &QuantLinear)> {
        let experts = self.experts.iter().enumerate().flat_map(|(e, x)| {
            x.linears()
                .into_iter()
                .map(move |(n, l)| (format!("experts.{e}.{n}"), l))
        });
        let shared = self.shared.iter().flat_map(|s| {
            s.mlp
                .linears()
                .into_iter()
                .map(|(n, l)| (format!("{}.{n}", s.name()), l))
                .chain(s.gate.iter().map(|g| ("shared_expert_gate".to_string(), g)))
        });
        experts.chain(shared)
    }

    /// [`Self::linears`], to replace one.
    pub fn linears_mut(&mut self) -> impl Iterator<Item = (String, &mut QuantLinear)> {
        let experts = self.experts.iter_mut().enumerate().flat_map(|(e, x)| {
            x.linears_mut()
                .into_iter()
                .map(move |(n, l)| (format!("experts.{e}.{n}"), l))
        });
        let shared = self.shared.iter_mut().flat_map(|s| {
            let name = s.name();
            s.mlp
                .linears_mut()
                .into_iter()
                .map(move |(n, l)| (format!("{name}.{n}"), l))
                .chain(
                    s.gate
                        .iter_mut()
                        .map(|g| ("shared_expert_gate".to_string(), g)),
                )
        });
        experts.chain(shared)
    }
}

/// Appends each token's (expert, weight) pairs of `top` to `routes`.
fn record_routes(top: &TopExperts, routes: &mut Vec<Route>) {
    let pairs: Vec<(usize, f32)> = top
        .experts
        .iter()
        .map(|&e| e as usize)
        .zip(top.weights.iter().copied())
        .collect();
    routes.extend(pairs.chunks(top.k.max(1)).map(<[_]>::to_vec));
}

/// The experts that have rows, in groups that run stacked: most rows first, at most `most` to a
/// group, and an expert joins the group while padding it to the group's first expert costs at
/// most a quarter of that count or [`STACK_PAD_ROWS`] rows (a GEMM tile's worth).
fn stack_groups(ranges: &[std::ops::Range<usize>], most: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..ranges.len())
        .filter(|&e| !ranges[e].is_empty())
        .collect();
    order.sort_by_key(|&e| std::cmp::Reverse(ranges[e].len()));
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for e in order {
        let rows = ranges[e].len();
        match groups.last_mut() {
            Some(group)
                if group.len() < most && {
                    let m = ranges[group[0]].len();
                    m - rows <= (m / 4).max(STACK_PAD_ROWS)
                } =>
            {
                group.push(e)
            }
            _ => groups.push(vec![e]),
        }
    }
    groups
}

/// The experts' outputs and how [`ops::moe_combine`] adds them back.
struct Combined {
    /// One row per routed (token, expert) pair, and any padding rows.
    y: Tensor,
    /// Each row's router weight, f32 `[rows, 1]`.
    weights: Tensor,
    /// Each row's token, u32 `[rows]`.
    rows_token: Tensor,
    /// u32 `[tokens, k]`: each token's rows of `y`, in ascending expert order.
    positions: Tensor,
}

impl Combined {
    /// The host plan's weights and positions on `y`'s device (its rows' tokens are there
    /// already: the experts' rows were gathered by them).
    fn upload(
        y: Tensor,
        weights: &[f32],
        rows_token: Tensor,
        positions: &[u32],
        k: usize,
    ) -> Result<Self> {
        let dev = y.device().clone();
        stage("experts", &dev, || {
            Ok(Self {
                weights: Tensor::from_slice(weights, (weights.len(), 1), &dev)?,
                rows_token,
                positions: Tensor::from_slice(positions, (positions.len() / k.max(1), k), &dev)?,
                y,
            })
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
    /// Experts per token.
    k: usize,
}

impl ExpertRows {
    /// A counting sort of the routes by expert, each expert's rows in token order. A vector per
    /// expert, grown route by route, took twice as long (2.2 against 1.1 ms on a 2-core machine
    /// for eight windows of Qwen3-30B-A3B, 131,072 routes): host time a layer's GPU work waits
    /// for behind the router's read-back.
    fn new(top: &TopExperts, experts: usize) -> Self {
        let (k, n) = (top.k.max(1), top.experts.len());
        let mut starts = vec![0usize; experts + 1];
        for &e in &top.experts {
            starts[e as usize + 1] += 1;
        }
        for e in 0..experts {
            starts[e + 1] += starts[e];
        }
        let ranges = starts.windows(2).map(|w| w[0]..w[1]).collect();
        let (mut token, mut weight) = (vec![0u32; n], vec![0f32; n]);
        let mut next = starts;
        for (t, (ids, ws)) in top.experts.chunks(k).zip(top.weights.chunks(k)).enumerate() {
            for (&e, &w) in ids.iter().zip(ws) {
                let r = &mut next[e as usize];
                (token[*r], weight[*r]) = (t as u32, w);
                *r += 1;
            }
        }
        // each token's rows in ascending expert order: the rows lie in expert order
        let mut positions = vec![0u32; n];
        let mut filled = vec![0u32; n / k];
        for (r, &t) in token.iter().enumerate() {
            let slot = &mut filled[t as usize];
            positions[t as usize * k + *slot as usize] = r as u32;
            *slot += 1;
        }
        ExpertRows {
            token,
            weight,
            ranges,
            positions,
            k: top.k,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(counts: &[usize]) -> Vec<std::ops::Range<usize>> {
        let mut start = 0;
        counts
            .iter()
            .map(|&n| {
                start += n;
                start - n..start
            })
            .collect()
    }

    #[test]
    fn stack_groups_sort_by_rows_and_bound_the_padding() {
        let r = ranges(&[0, 100, 90, 10, 5, 1000, 800, 700]);
        // 800 pads 1000 by 200 (within a quarter), 700 by 300 (not); 90 pads 100 by 10 and 5
        // pads 10 by 5 (within a tile); the empty expert runs nowhere.
        assert_eq!(
            stack_groups(&r, 16),
            vec![vec![5, 6], vec![7], vec![1, 2], vec![3, 4]]
        );
        assert_eq!(
            stack_groups(&ranges(&[3, 3, 3, 3, 3]), 2),
            vec![vec![0, 1], vec![2, 3], vec![4]]
        );
    }
}
