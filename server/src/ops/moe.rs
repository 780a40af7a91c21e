//! The mixture-of-experts family: the router's top-k choice and the weighted combine of the
//! experts' outputs.

use candle_core::{DType, Device, Result, Tensor};

super::gpu_entry_points!(moe {
    fn expert_rows(rows: usize, cols: usize, like: &Tensor) -> Result<Tensor>;
    fn moe_topk(logits: &Tensor, k: usize, norm: bool) -> Result<(Vec<u32>, Vec<f32>)>;
    fn moe_topk_on_device(logits: &Tensor, k: usize, norm: bool) -> Result<(Tensor, Tensor)>;
    fn moe_route_grouped(
        scores: &Tensor,
        bias: Option<&Tensor>,
        k: usize,
        groups: (usize, usize),
        norm: bool,
        scale: f32,
        top_two: bool,
        masked: f32,
        round: DType,
    ) -> Result<(Tensor, Tensor)>;
    fn moe_plan(
        ids: &Tensor,
        weights: &Tensor,
        k: usize,
        experts: usize,
        tile_rows: usize,
    ) -> Result<[Tensor; 5]>;
    fn moe_pad_plan(
        rows_token: &Tensor,
        row_weight: &Tensor,
        positions: &Tensor,
        offsets: &Tensor,
        dest_and_rows: (&[u32], &[u32]),
        padded: usize,
    ) -> Result<[Tensor; 3]>;
    fn moe_combine(
        y: &Tensor,
        weights: &Tensor,
        compute_dtype_weights: bool,
        positions: &Tensor,
        residual: &Tensor,
        shared: Option<&Tensor>,
    ) -> Result<Tensor>;
});

/// The most experts the GPU router holds per token (16 per lane of a warp: `MOE_MAX_PER_LANE`
/// in kernels/moe.cu).
const GPU_MAX_EXPERTS: usize = 512;

/// Every token's experts, flat: token `t`'s are `experts[t * k..][..k]`, with their router
/// weights at the same places.
#[derive(Debug, Clone, PartialEq)]
pub struct TopExperts {
    pub k: usize,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

/// The most experts a router may choose from on `device`.
pub fn moe_max_experts(device: &Device) -> usize {
    if device.is_cuda() {
        GPU_MAX_EXPERTS
    } else {
        usize::MAX
    }
}

/// A mixture-of-experts router on its logits `[tokens, experts]`: per token its top `k`
/// experts by softmax probability in f32 (ties to the lowest id), with their probabilities,
/// renormalised to sum 1 when `norm`. A NaN among a token's probabilities is an error.
pub fn moe_route(logits: &Tensor, k: usize, norm: bool) -> Result<TopExperts> {
    let num_experts = logits.dims2()?.1;
    let (experts, weights) = if logits.device().is_cuda() {
        if num_experts > GPU_MAX_EXPERTS {
            candle_core::bail!(
                "the GPU router handles up to {GPU_MAX_EXPERTS} experts, the model has {num_experts}"
            );
        }
        gpu::moe_topk(logits, k, norm)?
    } else {
        route_on_cpu(logits, k, norm)?
    };
    TopExperts::refusing_nan(k, experts, weights, num_experts)
}

impl TopExperts {
    /// The router kernels' choice, refused where a token got the id `num_experts` (its
    /// router saw a NaN).
    fn refusing_nan(
        k: usize,
        experts: Vec<u32>,
        weights: Vec<f32>,
        num_experts: usize,
    ) -> Result<Self> {
        if let Some(at) = experts.iter().position(|&e| e as usize >= num_experts) {
            candle_core::bail!(
                "the router probabilities of token {} of {} are NaN",
                at / k.max(1),
                experts.len() / k.max(1)
            );
        }
        Ok(Self {
            k,
            experts,
            weights,
        })
    }
}

/// The experts' rows of a routed batch laid out on the GPU ([`moe_plan`]), as the host lays them
/// out from [`TopExperts`]: expert `e`'s rows are the (token, choice) pairs that chose it, in
/// token order, at `offsets[e]..offsets[e + 1]`.
pub struct ExpertPlan {
    /// Each row's token, u32 `[rows]`.
    pub rows_token: Tensor,
    /// Each row's router weight, f32 `[rows]`.
    pub row_weight: Tensor,
    /// u32 `[tokens, k]`: each token's rows in ascending expert order (what [`moe_combine`]
    /// reads); `u32::MAX` for a token whose router probabilities were NaN.
    pub positions: Tensor,
    /// i64 `[experts + 1]`.
    pub offsets: Tensor,
    /// The blocks of `tile_rows` rows of the int4 GEMM: u32 `[1 + 2 · max]`, the count, then
    /// (expert, first row) pairs.
    pub tiles: Tensor,
    pub tile_rows: usize,
    /// Every routed (token, choice) pair: tokens × k.
    pub rows: usize,
}

/// The router of [`moe_route`] with its choice left on the GPU: u32 ids and f32 weights,
/// `[tokens × k]` each. GPU only; a NaN among a token's probabilities gives it no expert (its
/// output stays non-finite, which the engine reports) instead of an error here.
pub fn moe_route_on_device(logits: &Tensor, k: usize, norm: bool) -> Result<(Tensor, Tensor)> {
    super::gpu_only("moe_route_on_device", logits)?;
    let experts = logits.dims2()?.1;
    if experts > GPU_MAX_EXPERTS {
        candle_core::bail!(
            "the GPU router handles up to {GPU_MAX_EXPERTS} experts, the model has {experts}"
        );
    }
    gpu::moe_topk_on_device(logits, k, norm)
}

/// The [`ExpertPlan`] of a routed batch (ids and weights from [`moe_route_on_device`]) over
/// `experts` experts, in blocks of `tile_rows` rows. GPU only.
pub fn moe_plan(
    ids: &Tensor,
    weights: &Tensor,
    k: usize,
    experts: usize,
    tile_rows: usize,
) -> Result<ExpertPlan> {
    super::gpu_only("moe_plan", ids)?;
    let [rows_token, row_weight, positions, offsets, tiles] =
        gpu::moe_plan(ids, weights, k, experts, tile_rows)?;
    Ok(ExpertPlan {
        rows: rows_token.elem_count(),
        rows_token,
        row_weight,
        positions,
        offsets,
        tiles,
        tile_rows,
    })
}

/// `plan`'s rows padded for experts that multiply as batched GEMMs over groups of one row
/// count: expert `e`'s rows moved to `dest[e]..`, then `rows[e]` minus its count padding rows
/// that repeat its first token and weigh 0; `padded` rows in all. Returns the padded rows'
/// tokens (u32 `[padded]`) and weights (f32 `[padded]`) and the positions pointing at them
/// (u32 `[tokens, k]`): the host plan's padded layout (`Moe::experts_stacked`), made where the
/// plan is, so that only the counts leave the GPU. GPU only.
pub fn moe_pad_plan(
    plan: &ExpertPlan,
    dest: &[u32],
    rows: &[u32],
    padded: usize,
) -> Result<[Tensor; 3]> {
    super::gpu_only("moe_pad_plan", &plan.rows_token)?;
    gpu::moe_pad_plan(
        &plan.rows_token,
        &plan.row_weight,
        &plan.positions,
        &plan.offsets,
        (dest, rows),
        padded,
    )
}

/// A group-limited router ([`moe_route_grouped`]): DeepSeek-V3's (sigmoid scores, a
/// correction bias), DeepSeek-V2's and Mistral 4's (softmax scores).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupedRouting {
    pub k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm: bool,
    pub routed_scaling_factor: f64,
    pub scores: RouterScores,
    pub group_score: GroupScore,
}

/// The router's per-expert scores from its logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterScores {
    /// DeepSeek-V3's `sigmoid`; the experts of dropped groups are masked to -inf in the choice
    /// (the correction bias may make a choice score negative).
    Sigmoid,
    /// DeepSeek-V2's and Mistral 4's `softmax`; the experts of dropped groups are masked to 0.0
    /// (`masked_fill(~mask, 0.0)`).
    Softmax,
}

/// What a group of experts scores when the router keeps the best `topk_group` groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupScore {
    /// The sum of its two best choice scores (DeepSeek-V3, Mistral 4).
    TopTwoSum,
    /// Its best choice score (DeepSeek-V2's `group_limited_greedy`).
    Max,
}

/// A group-limited router on its logits `[tokens, experts]` (DeepSeek-V3's
/// `DeepseekV3TopkRouter`, DeepSeek-V2's `DeepseekV2TopkRouter`, Mistral 4's
/// `Mistral4TopkRouter`), as transformers computes it: scores `sigmoid` or `softmax` of the
/// logits; the choice reads `scores + bias` (DeepSeek-V3's `e_score_correction_bias`, f32
/// `[experts]`) or the scores, keeps the `topk_group` best groups by [`GroupScore`], masks the
/// others' experts ([`RouterScores`]) and takes the `k` best (ties to the lowest id, groups and
/// experts alike); the weights are the chosen experts' scores, divided by their sum + 1e-20 when
/// `norm`, times `routed_scaling_factor`. Every step is rounded to the logits' dtype, as torch
/// computes a router that runs in the compute dtype (Mistral 4's; the others' logits are f32);
/// torch breaks exact ties among bf16 scores in an order of its own. A NaN score is an error.
/// This is the CPU reference of the GPU kernel ([`moe_route_grouped_on_device`]), which a GPU
/// tensor's routing runs (its choice read back: 16384 tokens of GLM-4.7-Flash took 82 ms a layer
/// on the host).
pub fn moe_route_grouped(
    logits: &Tensor,
    bias: Option<&Tensor>,
    routing: &GroupedRouting,
) -> Result<TopExperts> {
    let (tokens, num_experts) = logits.dims2()?;
    if logits.device().is_cuda() {
        let (ids, weights) = moe_route_grouped_on_device(logits, bias, routing)?;
        let (ids, weights) = (ids.to_vec1()?, weights.to_vec1()?);
        return TopExperts::refusing_nan(routing.k, ids, weights, num_experts);
    }
    let round = rounding_to(logits.dtype());
    let (scores, masked_score) = grouped_router_scores(logits, routing)?;
    let bias = match bias {
        Some(b) => b
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .to_vec1::<f32>()?,
        None => vec![0.0; num_experts],
    };
    let (k, groups, per_group) = (routing.k, routing.n_group, num_experts / routing.n_group);
    let scale = routing.routed_scaling_factor as f32;
    let (mut experts, mut weights) = (
        Vec::with_capacity(tokens * k),
        Vec::with_capacity(tokens * k),
    );
    for (t, s) in scores
        .to_device(&Device::Cpu)?
        .to_vec2::<f32>()?
        .into_iter()
        .enumerate()
    {
        if s.iter().any(|v| v.is_nan()) {
            candle_core::bail!("the router scores of token {t} of {tokens} are NaN");
        }
        let s: Vec<f32> = s.into_iter().map(round).collect();
        let choice: Vec<f32> = s.iter().zip(&bias).map(|(s, b)| s + b).collect();
        let group_score = |g: usize| {
            let mut best = choice[g * per_group..(g + 1) * per_group].to_vec();
            best.sort_by(|a, b| b.total_cmp(a));
            match routing.group_score {
                GroupScore::TopTwoSum => round(best[0] + best[1]),
                GroupScore::Max => best[0],
            }
        };
        let group_scores: Vec<f32> = (0..groups).map(group_score).collect();
        let kept = top_indices(&group_scores, routing.topk_group);
        let masked: Vec<f32> = (0..num_experts)
            .map(|e| match kept.contains(&(e / per_group)) {
                true => choice[e],
                false => masked_score,
            })
            .collect();
        let top = top_indices(&masked, k);
        let chosen: Vec<f32> = top.iter().map(|&e| s[e]).collect();
        let denominator = match routing.norm {
            true => round(chosen.iter().sum::<f32>()) + 1e-20,
            false => 1.0,
        };
        experts.extend(top.iter().map(|&e| e as u32));
        weights.extend(chosen.iter().map(|w| round(round(w / denominator) * scale)));
    }
    Ok(TopExperts {
        k,
        experts,
        weights,
    })
}

/// A group-limited router's scores (f32, on the logits' device) and what its dropped groups'
/// experts score.
fn grouped_router_scores(logits: &Tensor, routing: &GroupedRouting) -> Result<(Tensor, f32)> {
    let f32_logits = logits.to_dtype(DType::F32)?;
    Ok(match routing.scores {
        RouterScores::Sigmoid => (candle_nn::ops::sigmoid(&f32_logits)?, f32::NEG_INFINITY),
        RouterScores::Softmax => (candle_nn::ops::softmax_last_dim(&f32_logits)?, 0.0),
    })
}

/// [`moe_route_grouped`] with its choice left on the GPU (the same steps in a kernel; ids and
/// weights as [`moe_route_on_device`] gives them). GPU only; a NaN score gives its token no
/// expert (its output stays non-finite, which the engine reports).
pub fn moe_route_grouped_on_device(
    logits: &Tensor,
    bias: Option<&Tensor>,
    routing: &GroupedRouting,
) -> Result<(Tensor, Tensor)> {
    super::gpu_only("moe_route_grouped_on_device", logits)?;
    let (scores, masked) = grouped_router_scores(logits, routing)?;
    gpu::moe_route_grouped(
        &scores,
        bias,
        routing.k,
        (routing.n_group, routing.topk_group),
        routing.norm,
        routing.routed_scaling_factor as f32,
        routing.group_score == GroupScore::TopTwoSum,
        masked,
        logits.dtype(),
    )
}

/// Rounds an f32 to `dtype` (and back), as a torch op in that dtype rounds its f32 result.
fn rounding_to(dtype: DType) -> fn(f32) -> f32 {
    match dtype {
        DType::BF16 => |v| half::bf16::from_f32(v).to_f32(),
        DType::F16 => |v| half::f16::from_f32(v).to_f32(),
        _ => |v| v,
    }
}

/// The indices of the `k` largest values, largest first; equal values keep the lower index first.
fn top_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]));
    order.truncate(k);
    order
}

/// The CPU reference of the router kernel: a token with a NaN probability gets the id
/// `experts` everywhere, which [`moe_route`] refuses.
fn route_on_cpu(logits: &Tensor, k: usize, norm: bool) -> Result<(Vec<u32>, Vec<f32>)> {
    let num_experts = logits.dims2()?.1;
    let probs = candle_nn::ops::softmax_last_dim(&logits.to_dtype(DType::F32)?)?;
    let (mut experts, mut weights) = (Vec::new(), Vec::new());
    for p in probs.to_vec2::<f32>()? {
        if p.iter().any(|v| v.is_nan()) {
            experts.extend(std::iter::repeat_n(num_experts as u32, k));
            weights.extend(std::iter::repeat_n(f32::NAN, k));
            continue;
        }
        // A stable sort: equal probabilities keep the lower id first.
        let mut order: Vec<usize> = (0..p.len()).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        let top = &order[..k];
        let sum: f32 = top.iter().map(|&e| p[e]).sum();
        experts.extend(top.iter().map(|&e| e as u32));
        weights.extend(top.iter().map(|&e| if norm { p[e] / sum } else { p[e] }));
    }
    Ok((experts, weights))
}

/// A `[rows, cols]` tensor in `like`'s dtype and device for the experts' GEMMs to write their
/// rows into. Not cleared on the GPU (a memset of every routed row cost more than 1 ms a window
/// on GLM-4.7-Flash): the GEMMs write every row a plan places, and the rows a plan leaves
/// unplaced (a NaN token's entries) are never read back ([`moe_combine`] skips them). Zeros
/// elsewhere.
pub fn expert_rows(rows: usize, cols: usize, like: &Tensor) -> Result<Tensor> {
    if like.device().is_cuda() {
        return gpu::expert_rows(rows, cols, like);
    }
    Tensor::zeros((rows, cols), like.dtype(), like.device())
}

/// `residual` plus, per token, the sum of its weighted rows of `y` (the expert outputs, one
/// row per routed token), plus `shared` (a shared expert's output, `[tokens, cols]`) where
/// given: row `r` weighted by `weights[r]` (f32 `[rows, 1]`; in the compute dtype with
/// `compute_dtype_weights`, else in f32 and rounded). `rows_token` names each row's token (the
/// CPU adds by it; the GPU kernel gathers by `positions` instead), `positions` (u32
/// `[tokens, k]`) each token's rows in the order they are added, which is the order of the rows.
/// Every add is rounded to the compute dtype, as transformers' `index_add` into zeros, then the
/// shared expert's add and the residual's do.
pub fn moe_combine(
    y: &Tensor,
    weights: &Tensor,
    compute_dtype_weights: bool,
    rows_token: &Tensor,
    positions: &Tensor,
    residual: &Tensor,
    shared: Option<&Tensor>,
) -> Result<Tensor> {
    if y.device().is_cuda() {
        return gpu::moe_combine(
            y,
            weights,
            compute_dtype_weights,
            positions,
            residual,
            shared,
        );
    }
    let dtype = y.dtype();
    let y = if compute_dtype_weights {
        y.broadcast_mul(&weights.to_dtype(dtype)?)?
    } else {
        y.to_dtype(DType::F32)?
            .broadcast_mul(weights)?
            .to_dtype(dtype)?
    };
    let routed = residual.zeros_like()?.index_add(rows_token, &y, 0)?;
    match shared {
        Some(shared) => residual + (routed + shared)?,
        None => residual + routed,
    }
}
