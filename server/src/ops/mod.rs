//! The operations that run a kernel of our own on a GPU. Each function dispatches once: to
//! `crate::cuda` where its input lies on a CUDA device, else to the CPU reference (the
//! specification that kernel is checked against). Model and quantization code call these and
//! never ask which device they run on, so a new architecture has no `cfg` in it (candle-nn's
//! `ops` is the model). Without the `cuda` feature, [`gpu`] is a module of the same signatures
//! that no tensor reaches: no CUDA device can be opened.

use candle_core::{DType, Device, Module, Result, Tensor, D};
use rayon::prelude::*;

use crate::model::config::Activation;
use crate::model::kld::{kld_row, TokenKld};
use crate::model::scoring::{score_row, RowScore};
use crate::quant::ActivationQdq;

#[cfg(feature = "cuda")]
pub(crate) use crate::cuda as gpu;
#[cfg(not(feature = "cuda"))]
#[path = "no_cuda.rs"]
pub(crate) mod gpu;
pub mod linear_attention;

pub use gpu::{FlashOptions, FlashTiling};

/// transformers' LlamaRMSNorm of `x` over its last dimension (normalise in f32, cast back, then
/// scale by `weight`), put through `qdq` (the activation QDQ of the Linears that read it) when
/// there is one. One kernel on a GPU, which rounds the norm once instead of twice (identical in
/// f32; closer to f32 in bf16/f16) and applies a per-token fp8 QDQ in the same pass.
///
/// An f32 `weight` beside a narrower `x` is GemmaRMSNorm's `1 + w`: the normalised row is
/// scaled in f32 and rounded once, as transformers does, on every device.
pub fn rms_norm(
    x: &Tensor,
    weight: &Tensor,
    eps: f64,
    qdq: Option<&ActivationQdq>,
) -> Result<Tensor> {
    let fused = fuses_qdq(qdq, x.device());
    let normed = if x.device().is_cuda() {
        gpu::rms_norm(x, weight, eps as f32, fused)?
    } else {
        let dtype = x.dtype();
        let x32 = x.to_dtype(DType::F32)?;
        let variance = x32.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = x32.broadcast_mul(&(variance + eps)?.sqrt()?.recip()?)?;
        if weight.dtype() == DType::F32 {
            normed.broadcast_mul(weight)?.to_dtype(dtype)?
        } else {
            normed.to_dtype(dtype)?.broadcast_mul(weight)?
        }
    };
    finish_qdq(normed, qdq, fused)
}

/// The gated activation `act(gate) * up` (SwiGLU, GeGLU), put through `qdq` (the down
/// projection's activation QDQ) when there is one: one kernel on a GPU, rounded as PyTorch
/// rounds it in the compute dtype, which applies a per-token fp8 QDQ in the same pass.
pub fn gated_mul(
    act: Activation,
    gate: &Tensor,
    up: &Tensor,
    qdq: Option<&ActivationQdq>,
) -> Result<Tensor> {
    let fused = fuses_qdq(qdq, gate.device());
    let product = match (gate.device().is_cuda(), act) {
        (true, Activation::Silu) => gpu::silu_mul(gate, up, fused)?,
        (true, Activation::GeluTanh) => gpu::gelu_tanh_mul(gate, up, fused)?,
        (false, Activation::Silu) => (candle_nn::Activation::Silu.forward(gate)? * up)?,
        (false, Activation::GeluTanh) => (gate.gelu()? * up)?,
    };
    finish_qdq(product, qdq, fused)
}

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
        gpu::MOE_MAX_EXPERTS
    } else {
        usize::MAX
    }
}

/// A mixture-of-experts router on its logits `[tokens, experts]`: per token its top `k`
/// experts by softmax probability in f32 (ties to the lowest id), with their probabilities,
/// renormalised to sum 1 when `norm`. A NaN among a token's probabilities is an error.
pub fn moe_route(logits: &Tensor, k: usize, norm: bool) -> Result<TopExperts> {
    let (tokens, num_experts) = logits.dims2()?;
    let (experts, weights) = if logits.device().is_cuda() {
        gpu::moe_topk(logits, k, norm)?
    } else {
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
        (experts, weights)
    };
    if let Some(at) = experts.iter().position(|&e| e as usize >= num_experts) {
        candle_core::bail!(
            "the router probabilities of token {} of {tokens} are NaN",
            at / k.max(1)
        );
    }
    Ok(TopExperts {
        k,
        experts,
        weights,
    })
}

/// `residual` plus, per token, the sum of its weighted rows of `y` (the expert outputs, one
/// row per routed token): row `r` weighted by `weights[r]` (f32 `[rows, 1]`; in the compute
/// dtype with `compute_dtype_weights`, else in f32 and rounded). `rows_token` names each row's
/// token (the CPU adds by it; the GPU kernel gathers by `positions` instead), `positions` (u32 `[tokens, k]`) each token's rows in the order they
/// are added, which is the order of the rows. Every add is rounded to the compute dtype, as an
/// `index_add` into zeros does.
pub fn moe_combine(
    y: &Tensor,
    weights: &Tensor,
    compute_dtype_weights: bool,
    rows_token: &[u32],
    positions: &Tensor,
    residual: &Tensor,
) -> Result<Tensor> {
    if y.device().is_cuda() {
        return gpu::moe_combine(y, weights, compute_dtype_weights, positions, residual);
    }
    let rows_token = Tensor::new(rows_token, y.device())?;
    let dtype = y.dtype();
    let y = if compute_dtype_weights {
        y.broadcast_mul(&weights.to_dtype(dtype)?)?
    } else {
        y.to_dtype(DType::F32)?
            .broadcast_mul(weights)?
            .to_dtype(dtype)?
    };
    residual + residual.zeros_like()?.index_add(&rows_token, &y, 0)?
}

/// Per row of two states `[rows, hidden]` on one device: (Σ a·b, Σ a², Σ b², Σ (a − b)²),
/// each in f64 over the values converted to f32 (every float dtype converts to f32, and f32 to
/// f64, exactly). Only these four numbers per row leave a GPU.
pub fn row_pair_sums(a: &Tensor, b: &Tensor) -> Result<Vec<[f64; 4]>> {
    let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
    if a.device().is_cuda() {
        return gpu::row_pair_sums(&a, &b);
    }
    let (a, b) = (a.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?);
    let sums = Tensor::stack(
        &[
            (&a * &b)?.sum(1)?,
            a.sqr()?.sum(1)?,
            b.sqr()?.sum(1)?,
            (&a - &b)?.sqr()?.sum(1)?,
        ],
        1,
    )?;
    Ok(sums
        .to_vec2::<f64>()?
        .into_iter()
        .map(|v| [v[0], v[1], v[2], v[3]])
        .collect())
}

/// Rows `ids` (u32, already checked against the table) of `table` `[rows, cols]`: the embedding
/// lookup.
pub fn gather_rows(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    if table.device().is_cuda() {
        return gpu::gather_rows(table, ids);
    }
    table.index_select(ids, 0)
}

/// Causal softmax attention of one sequence: `q`, `k`, `v` `[1, heads, len, head_dim]` (k and v
/// already repeated to the query heads), scores scaled by `scale`, soft-capped as
/// `cap * tanh(s / cap)` when `softcap` is set, keys limited to a sliding `window` when set.
/// Returns `[1, heads, len, head_dim]` in `q`'s dtype.
///
/// GPU: scores in f32 (TF32 tensor cores for bf16/f16 inputs, exact there), then scale, mask
/// and softmax in one kernel, probabilities in the compute dtype for P·V. CPU: everything in
/// f32, rounded once at the end.
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    softcap: Option<f64>,
    window: Option<usize>,
) -> Result<Tensor> {
    let dtype = q.dtype();
    if q.device().is_cuda() {
        let (q32, k32) = (q.to_dtype(DType::F32)?, k.to_dtype(DType::F32)?);
        let scores = if dtype == DType::F32 {
            q32.matmul(&k32.t()?)?
        } else {
            gpu::with_tf32(|| q32.matmul(&k32.t()?))?
        };
        // Soft-capped scores are scaled and capped first; the kernel then scales by 1.
        let (scores, scale) = match softcap {
            Some(cap) => (soft_cap(&(scores * scale)?, cap)?, 1.0),
            None => (scores, scale),
        };
        let probs = gpu::causal_softmax(&scores, scale as f32, window, dtype)?;
        return probs.matmul(v);
    }
    let (q, k, v) = (
        q.to_dtype(DType::F32)?,
        k.to_dtype(DType::F32)?,
        v.to_dtype(DType::F32)?,
    );
    let mut scores = (q.matmul(&k.t()?)? * scale)?;
    if let Some(cap) = softcap {
        scores = soft_cap(&scores, cap)?;
    }
    let mask = causal_mask(q.dims()[2], window, q.device())?;
    let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    probs.matmul(&v)?.to_dtype(dtype)
}

/// `[len, len]` additive mask: 0 where key j is visible from query i, -inf elsewhere.
pub fn causal_mask(len: usize, window: Option<usize>, device: &Device) -> Result<Tensor> {
    let window = window.unwrap_or(usize::MAX);
    let mask: Vec<f32> = (0..len)
        .flat_map(|i| {
            (0..len).map(move |j| {
                if j <= i && i - j < window {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Tensor::from_vec(mask, (len, len), device)
}

/// `cap * tanh(x / cap)` (Gemma's soft-capping), in `x`'s dtype.
pub fn soft_cap(x: &Tensor, cap: f64) -> Result<Tensor> {
    (x / cap)?.tanh()? * cap
}

/// Whether the fused flash-attention kernel exists for this device, head size and dtype.
pub fn flash_attention_available(device: &Device, head_dim: usize, dtype: DType) -> bool {
    device.is_cuda() && gpu::flash_attention_supported(head_dim, dtype)
}

/// RoPE (`rotate_half` convention) of `x` `[tokens, heads, head_dim]` at `positions[token]` of
/// the `cos`/`sin` tables, for [`flash_attention`]: a GPU kernel only.
pub fn rope_rotate_half(
    x: &Tensor,
    positions: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    gpu_only("rope_rotate_half", x)?;
    gpu::rope_rotate_half(x, positions, cos, sin)
}

/// Causal attention of a whole batch in the projections' `[tokens, heads, head_dim]` layout
/// (see `cuda::flash_attention`): a GPU kernel only; `Model::set_attention` refuses it
/// elsewhere.
pub fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    starts: &Tensor,
    max_len: usize,
    opts: &FlashOptions,
) -> Result<Tensor> {
    gpu_only("flash_attention", q)?;
    gpu::flash_attention(q, k, v, starts, max_len, opts)
}

/// Scores every row of `logits` `[rows, vocab]` (any float dtype; scored in f32): with the fused
/// kernel on a GPU, so only a few numbers per row leave it; row by row on the CPU.
/// `targets[i]`: the next token of row i, if known.
pub fn score_rows(logits: &Tensor, targets: &[Option<u32>], top_k: usize) -> Result<Vec<RowScore>> {
    if logits.device().is_cuda() {
        let t: Vec<i32> = targets.iter().map(|t| t.map_or(-1, |t| t as i32)).collect();
        let s = gpu::score_rows(logits, &t, top_k)?;
        return Ok((0..targets.len())
            .map(|i| RowScore {
                target_logprob: targets[i].map(|_| s.target_logprob[i]),
                argmax: (s.argmax[i], s.argmax_logprob[i]),
                top_k: (0..top_k)
                    .map(|j| (s.top_ids[i * top_k + j], s.top_logprobs[i * top_k + j]))
                    .collect(),
            })
            .collect());
    }
    let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    Ok(rows
        .iter()
        .zip(targets)
        .map(|(row, &target)| score_row(row, target, top_k))
        .collect())
}

/// Per-row divergence of `logits` from `reference_logits` (same shape, any float dtype, scored
/// in f32): with the fused kernel on a GPU (the reference's logits brought to the model's
/// device); row by row in f64 on the CPU.
pub fn kld_rows(
    reference_logits: &Tensor,
    logits: &Tensor,
    targets: &[u32],
) -> Result<Vec<TokenKld>> {
    if logits.device().is_cuda() {
        let reference_logits = crate::device::transfer(reference_logits, logits.device())?;
        // Two compute dtypes (`--reference-dtype`): both rows in f32, which holds either
        // exactly; the kernel scores in f32 whatever it reads.
        let k = if reference_logits.dtype() != logits.dtype() {
            let f32 = |t: &Tensor| t.to_dtype(DType::F32);
            gpu::kld_rows(&f32(&reference_logits)?, &f32(logits)?, targets)?
        } else {
            gpu::kld_rows(&reference_logits, logits, targets)?
        };
        return Ok((0..targets.len())
            .map(|i| TokenKld {
                kld: k.kld[i],
                reverse_kld: k.reverse_kld[i],
                logprob: k.logprob[i],
                reference_logprob: k.reference_logprob[i],
                same_top: k.argmax[i] == k.reference_argmax[i],
                top_k_agreement: k.top_k_agreement[i],
                reference_top_p: k.reference_top_p[i],
            })
            .collect());
    }
    let reference_rows = reference_logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    // Rows are independent, each summed in its own order: the same bits on any thread count.
    Ok(reference_rows
        .par_iter()
        .zip(&rows)
        .zip(targets)
        .map(|((r, m), &t)| kld_row(r, m, t))
        .collect())
}

/// `qdq` of `x` (`[tokens, k]`, any float dtype), computed in f32 and returned in x's dtype:
/// one kernel on a GPU; row by row on the CPU ([`ActivationQdq::qdq_row`]).
pub fn activation_qdq(x: &Tensor, qdq: &ActivationQdq) -> Result<Tensor> {
    if x.device().is_cuda() {
        return match *qdq {
            ActivationQdq::Fp8PerToken => gpu::qdq_fp8(x, None),
            ActivationQdq::Fp8Static { scale } => gpu::qdq_fp8(x, Some(scale)),
            ActivationQdq::Nvfp4 { global_scale } => gpu::qdq_nvfp4(x, global_scale),
        };
    }
    let (rows, k) = x.dims2()?;
    let mut values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    for row in values.chunks_mut(k) {
        qdq.qdq_row(row);
    }
    Tensor::from_vec(values, (rows, k), &Device::Cpu)?
        .to_device(x.device())?
        .to_dtype(x.dtype())
}

/// A quantized weight's tensors as its GPU dequantization kernel reads them.
pub enum Packed<'a> {
    /// pack-quantized int4/int8 words, f32 scales `[out, groups]`, i32 zero points.
    Int {
        codes: &'a Tensor,
        scale: &'a Tensor,
        zero_point: Option<&'a Tensor>,
        bits: usize,
        group: usize,
    },
    /// fp4 codes two per byte, fp8 scales per 16 weights, the global scale.
    Nvfp4 {
        packed: &'a Tensor,
        scale: &'a Tensor,
        global_scale: f32,
    },
    /// fp8 codes, f32 scales per `block` (rows, columns).
    Fp8 {
        weight: &'a Tensor,
        scale: &'a Tensor,
        block: (usize, usize),
    },
}

/// The weight `[out, in]` of `packed` in `dtype`: by its GPU kernel where the packed tensors lie
/// on a GPU (bit-exact with the reference), else by `reference` (the format's CPU
/// specification, `QuantizedWeight::dequantize_reference`).
pub fn dequantize(
    packed: Packed<'_>,
    shape: (usize, usize),
    dtype: DType,
    reference: impl FnOnce() -> Result<Tensor>,
) -> Result<Tensor> {
    let on_gpu = match &packed {
        Packed::Int { codes, .. } => codes.device().is_cuda(),
        Packed::Nvfp4 { packed, .. } => packed.device().is_cuda(),
        Packed::Fp8 { weight, .. } => weight.device().is_cuda(),
    };
    if !on_gpu {
        return reference();
    }
    match packed {
        Packed::Int {
            codes,
            scale,
            zero_point,
            bits,
            group,
        } => gpu::dequant_int(codes, scale, zero_point, shape, bits, group, dtype),
        Packed::Nvfp4 {
            packed,
            scale,
            global_scale,
        } => gpu::dequant_nvfp4(packed, scale, global_scale, shape, dtype),
        Packed::Fp8 {
            weight,
            scale,
            block,
        } => gpu::dequant_fp8(weight, scale, shape, block, dtype),
    }
}

/// Weights of one shape `[out, in]` (a mixture's experts) as one `[weights, out, in]` tensor in
/// `dtype`: pack-quantized int weights of one width and group on a GPU by one launch
/// (bit-identical to [`dequantize`] of each); anything else by `each(i)`, stacked.
pub fn dequantize_stacked(
    packed: &[Option<Packed<'_>>],
    shape: (usize, usize),
    dtype: DType,
    each: impl Fn(usize) -> Result<Tensor>,
) -> Result<Tensor> {
    if let Some((ints, bits, group)) = gpu_ints(packed) {
        if let Some(stacked) = gpu::dequant_int_stacked(&ints, shape, bits, group, dtype)? {
            return Ok(stacked);
        }
    }
    let each: Vec<Tensor> = (0..packed.len()).map(each).collect::<Result<_>>()?;
    Tensor::stack(&each, 0)
}

/// A stack's weights as (codes, scales, zero points) with their width and group, when every one
/// is pack-quantized on a GPU with the same width, group and zero-point presence.
#[allow(clippy::type_complexity)]
fn gpu_ints<'a>(
    packed: &[Option<Packed<'a>>],
) -> Option<(
    Vec<(&'a Tensor, &'a Tensor, Option<&'a Tensor>)>,
    usize,
    usize,
)> {
    let mut ints = Vec::with_capacity(packed.len());
    let mut format = None;
    for p in packed {
        let Some(Packed::Int {
            codes,
            scale,
            zero_point,
            bits,
            group,
        }) = p
        else {
            return None;
        };
        let this = (*bits, *group, zero_point.is_some());
        if !codes.device().is_cuda() || *format.get_or_insert(this) != this {
            return None;
        }
        ints.push((*codes, *scale, *zero_point));
    }
    format.map(|(bits, group, _)| (ints, bits, group))
}

/// Whether a stack of weights (`packed`, one shape `[n, k]`: a mixture's experts) multiplies in
/// `dtype` by the kernel that decodes int4 weights inside the GEMM
/// ([`matmul_t_int4_stacked_into_rows`]): pack-quantized int4 on a GPU, in a layout it reads.
pub fn decodes_int4_in_gemm(
    packed: &[Option<Packed<'_>>],
    shape: (usize, usize),
    dtype: DType,
) -> Result<bool> {
    match gpu_ints(packed) {
        Some((ints, bits, group)) => gpu::int4_gemm_applies(&ints, shape, bits, group, dtype),
        None => Ok(false),
    }
}

/// Writes `x_z · w_zᵀ` for each weight of a stack that [`decodes_int4_in_gemm`] and its block of
/// `rows[z]` consecutive rows of `x` (`[Σ rows, k]`) into rows `row0..` of `out`, by one launch
/// of the kernel that decodes the int4 weights inside the GEMM (the products of the dequantized
/// weights, without writing them to memory).
pub fn matmul_t_int4_stacked_into_rows(
    out: &Tensor,
    row0: usize,
    x: &Tensor,
    packed: &[Option<Packed<'_>>],
    shape: (usize, usize),
    rows: &[usize],
) -> Result<()> {
    let Some((ints, _, group)) = gpu_ints(packed) else {
        candle_core::bail!("matmul_t_int4_stacked_into_rows: weights that are not int4 on a GPU");
    };
    gpu::matmul_t_int4_stacked_into_rows(out, row0, x, &ints, rows, shape, group, None)
}

/// Whether a mixture's experts run as batched GEMMs over their stacked weights
/// (`Mlp::forward_stacked`: a few launches per layer instead of several per expert) rather than
/// one by one: on a GPU in bf16/f16. f32 keeps one GEMM per expert, on the GPU kernel that sums
/// every output in one order (`quant::gemm`).
pub fn stacks_experts(x: &Tensor) -> bool {
    x.device().is_cuda() && x.dtype() != DType::F32
}

/// Whether [`matmul_t_add_into_rows`] can add into `out`: a contiguous GPU tensor in bf16/f16.
pub fn adds_into_rows(out: &Tensor) -> bool {
    out.device().is_cuda() && out.is_contiguous() && matches!(out.dtype(), DType::BF16 | DType::F16)
}

/// Adds `x · wᵀ` to rows `row0..` of `out` in place, in the GEMM's epilogue (rounded once): a
/// GPU kernel only, for an `out` that [`adds_into_rows`] accepts.
pub fn matmul_t_add_into_rows(out: &Tensor, row0: usize, x: &Tensor, w: &Tensor) -> Result<()> {
    gpu_only("matmul_t_add_into_rows", out)?;
    gpu::matmul_t_add_into_rows(out, row0, x, w)
}

/// Writes `x_i · w_iᵀ` for each weight of `w` (`[g, n, k]`) and its `m`-row block of `x`
/// (`[g · m, k]`) into rows `row0..row0 + g · m` of `out`, as one batched GEMM: a GPU kernel
/// only, for an `out` that [`adds_into_rows`] accepts.
pub fn matmul_t_stacked_into_rows(out: &Tensor, row0: usize, x: &Tensor, w: &Tensor) -> Result<()> {
    gpu_only("matmul_t_stacked_into_rows", out)?;
    gpu::matmul_t_stacked_into_rows(out, row0, x, w)
}

/// Whether the kernel that produces a Linear input (RMSNorm, SwiGLU) applies `qdq` in its own
/// pass: the per-token fp8 QDQ, which needs nothing but the row the GPU kernel already holds.
fn fuses_qdq(qdq: Option<&ActivationQdq>, device: &Device) -> bool {
    device.is_cuda() && qdq == Some(&ActivationQdq::Fp8PerToken)
}

/// `x` through `qdq`, unless the kernel that produced it applied it already (`fused`).
fn finish_qdq(x: Tensor, qdq: Option<&ActivationQdq>, fused: bool) -> Result<Tensor> {
    match qdq {
        Some(qdq) if !fused => qdq.apply(&x),
        _ => Ok(x),
    }
}

/// A clear error where a GPU-only kernel is asked to run on another device.
fn gpu_only(op: &str, x: &Tensor) -> Result<()> {
    if !x.device().is_cuda() {
        candle_core::bail!("{op} runs on CUDA devices only, not {:?}", x.device());
    }
    Ok(())
}
