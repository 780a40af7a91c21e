//! The linear-attention op family's CPU reference: the two sequence ops of a Gated DeltaNet layer
//! (Qwen3.5, Qwen3.5-MoE, Qwen3-Next; docs/architectures/qwen3_5.md), as transformers' torch
//! fallbacks compute them in f32:
//!
//! * [`causal_conv1d`]: `causal_conv1d_fn`, the short depthwise causal convolution over
//!   `[tokens, channels]` followed by its activation (SiLU in every released config);
//! * [`chunk_gated_delta_rule`]: `torch_chunk_gated_delta_rule`, the gated delta rule computed
//!   chunk by chunk (64 tokens) with an f32 state, including the in-kernel l2 norm of q and k
//!   and the `1/sqrt(k_dim)` query scale;
//! * [`recurrent_gated_delta_rule`]: `torch_recurrent_gated_delta_rule`, the same recurrence
//!   token by token (transformers' decode path), the plain definition the chunked form must
//!   equal up to f32 rounding.
//!
//! A sequence is scored in one pass: no conv or recurrent state comes in (zeros), the final
//! recurrent state is returned for checks only. Each function follows the torch op order
//! (which products are rounded to f32 before which sums; `cumsum` accumulated in f64 as
//! PyTorch's CPU kernel does); matrix products are summed in index order, so results agree with
//! torch to a few f32 ulps of the accumulated magnitudes, not bit for bit.
//!
//! The tensor entry points the model calls, f32 in and out, on a batch of sequences
//! concatenated (each from a zero state): [`causal_conv1d_tensor`], [`gated_delta_rule`] (the
//! chunked form, as transformers' torch fallback runs it when scoring) and
//! [`gated_delta_decay`]. On the CPU they run the references below one sequence at a time; on
//! a GPU the first two run every sequence of the batch in one launch.
//!
//! Layouts are row-major, token first: q and k `[tokens, k_heads, k_dim]`, v
//! `[tokens, v_heads, v_dim]`, g and beta `[tokens, v_heads]`, the output
//! `[tokens, v_heads, v_dim]`. With fewer k heads than v heads, value head `h` reads key/query
//! head `h / (v_heads / k_heads)`, as `repeat_interleave` on the head dimension gives it.

use candle_core::{bail, DType, Device, Result, Tensor};
use rayon::prelude::*;

super::gpu_entry_points!(linear_attention {
    fn causal_conv1d(
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        silu: bool,
        lens: &[usize],
    ) -> Result<Tensor>;
    fn gated_delta_rule(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: &Tensor,
        l2: bool,
        lens: &[usize],
    ) -> Result<Tensor>;
    fn conv_qkv(
        qkv: &Tensor,
        weight: &Tensor,
        key_dim: usize,
        lens: &[usize],
    ) -> Result<(Tensor, Tensor, Tensor)>;
});

/// Key head dimensions the GPU delta-rule kernel is built for (its state column lives in
/// registers, one kernel per size).
pub const GPU_DELTA_RULE_KEY_DIMS: [usize; 4] = [32, 64, 128, 256];

/// The activation applied after the convolution (`config.hidden_act` of the layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvActivation {
    /// `x * sigmoid(x)`, computed as PyTorch does: `x / (1 + exp(-x))`.
    Silu,
    /// No activation (`activation=None`).
    Identity,
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// The depthwise causal conv1d of `x` `[tokens, channels]` with `weight` `[channels, kernel]`
/// (transformers' `conv1d.weight.squeeze(1)`) and an optional per-channel `bias`: output
/// token `t`, channel `c` is `act(bias[c] + sum_j weight[c][j] * x[t - kernel + 1 + j][c])`,
/// tokens before the first read as zero (the left padding of `F.conv1d(padding=kernel-1)`).
pub fn causal_conv1d(
    x: &[f32],
    channels: usize,
    weight: &[f32],
    kernel: usize,
    bias: Option<&[f32]>,
    act: ConvActivation,
) -> Vec<f32> {
    assert!(channels > 0 && kernel > 0, "empty conv1d");
    assert_eq!(x.len() % channels, 0, "x is not [tokens, {channels}]");
    assert_eq!(
        weight.len(),
        channels * kernel,
        "weight is not [{channels}, {kernel}]"
    );
    if let Some(b) = bias {
        assert_eq!(b.len(), channels, "bias is not [{channels}]");
    }
    let tokens = x.len() / channels;
    let mut out = vec![0f32; x.len()];
    for t in 0..tokens {
        for c in 0..channels {
            let taps = &weight[c * kernel..(c + 1) * kernel];
            let mut acc = 0f32;
            for (j, &w) in taps.iter().enumerate() {
                // input position t - (kernel - 1) + j; negative positions are the zero padding
                if let Some(src) = (t + j).checked_sub(kernel - 1) {
                    acc += w * x[src * channels + c];
                }
            }
            if let Some(b) = bias {
                acc += b[c];
            }
            out[t * channels + c] = match act {
                ConvActivation::Silu => silu(acc),
                ConvActivation::Identity => acc,
            };
        }
    }
    out
}

/// The dimensions of one gated-delta-rule call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaRuleDims {
    pub tokens: usize,
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
}

/// The inputs of one gated-delta-rule call (layouts in the module documentation), and whether
/// q and k are l2-normalised first (`use_qk_l2norm_in_kernel`, true in every Gated DeltaNet).
#[derive(Debug, Clone, Copy)]
pub struct DeltaRuleInputs<'a> {
    pub dims: DeltaRuleDims,
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
    pub l2norm: bool,
}

impl DeltaRuleInputs<'_> {
    fn check(&self) {
        let (d, q, k, v, g, beta) = (&self.dims, self.q, self.k, self.v, self.g, self.beta);
        assert!(
            d.k_heads > 0 && d.v_heads.is_multiple_of(d.k_heads),
            "v_heads {} is not a multiple of k_heads {}",
            d.v_heads,
            d.k_heads
        );
        assert!(d.k_dim > 0 && d.v_dim > 0, "empty head dimension");
        assert_eq!(
            q.len(),
            d.tokens * d.k_heads * d.k_dim,
            "q is not [T, Hk, Dk]"
        );
        assert_eq!(
            k.len(),
            d.tokens * d.k_heads * d.k_dim,
            "k is not [T, Hk, Dk]"
        );
        assert_eq!(
            v.len(),
            d.tokens * d.v_heads * d.v_dim,
            "v is not [T, Hv, Dv]"
        );
        assert_eq!(g.len(), d.tokens * d.v_heads, "g is not [T, Hv]");
        assert_eq!(beta.len(), d.tokens * d.v_heads, "beta is not [T, Hv]");
    }
}

/// The output `[tokens, v_heads, v_dim]` and the final recurrent state `[v_heads, k_dim, v_dim]`.
#[derive(Debug, Clone, PartialEq)]
pub struct DeltaRuleOutput {
    pub out: Vec<f32>,
    pub state: Vec<f32>,
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |acc, (x, y)| acc + x * y)
}

/// FLA's / transformers' `l2norm`: `x * rsqrt(sum(x * x) + 1e-6)`.
fn l2norm(x: &mut [f32]) {
    let inv = 1.0 / (dot(x, x) + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Per value head: its key/query rows (l2-normalised when asked), values, decays and betas,
/// each `[tokens, dim]` or `[tokens]`.
struct HeadInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

fn head_inputs(x: &DeltaRuleInputs, h: usize) -> HeadInputs {
    let (d, q, k, v, g, beta) = (&x.dims, x.q, x.k, x.v, x.g, x.beta);
    let kh = h / (d.v_heads / d.k_heads);
    let (dk, dv) = (d.k_dim, d.v_dim);
    let mut hq = Vec::with_capacity(d.tokens * dk);
    let mut hk = Vec::with_capacity(d.tokens * dk);
    let mut hv = Vec::with_capacity(d.tokens * dv);
    for t in 0..d.tokens {
        let row = (t * d.k_heads + kh) * dk;
        let (mut qr, mut kr) = (q[row..row + dk].to_vec(), k[row..row + dk].to_vec());
        if x.l2norm {
            l2norm(&mut qr);
            l2norm(&mut kr);
        }
        hq.extend_from_slice(&qr);
        hk.extend_from_slice(&kr);
        let vrow = (t * d.v_heads + h) * dv;
        hv.extend_from_slice(&v[vrow..vrow + dv]);
    }
    let g = (0..d.tokens).map(|t| g[t * d.v_heads + h]).collect();
    let beta = (0..d.tokens).map(|t| beta[t * d.v_heads + h]).collect();
    HeadInputs {
        q: hq,
        k: hk,
        v: hv,
        g,
        beta,
    }
}

/// `torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size, use_qk_l2norm_in_kernel=l2)`
/// with a zero initial state. Per value head and chunk of `chunk_size` tokens (the sequence
/// zero-padded to a multiple of it):
///
/// 1. `q *= k_dim^-0.5` (after the l2 norm); `k_beta = k * beta`, `v_beta = v * beta`;
/// 2. `cum = cumsum(g)` inside the chunk; `decay[i][j] = exp(cum[i] - cum[j])` for `j <= i`,
///    else 0;
/// 3. `A[i][j] = (k_beta[i] . k[j]) * decay[i][j]` and `attn[i][j] = (q[i] . k[j]) *
///    decay[i][j]`; `u = (I + strict_lower(A))^-1 v_beta` and `w = (I + strict_lower(A))^-1
///    (k_beta * exp(cum))` by forward substitution (`solve_triangular(unitriangular=True)`);
/// 4. with the state `S` `[k_dim, v_dim]` of the chunks before: `v_new = u - w S`,
///    `out = (q * exp(cum)) S + attn v_new`,
///    `S = S * exp(cum[last]) + (k * exp(cum[last] - cum))^T v_new`.
pub fn chunk_gated_delta_rule(inputs: &DeltaRuleInputs, chunk_size: usize) -> DeltaRuleOutput {
    inputs.check();
    assert!(chunk_size > 0, "chunk_size 0");
    per_head(inputs, |h| chunk_head(inputs, h, chunk_size))
}

/// Runs `head` for every value head (in parallel: heads are independent, so the result does
/// not depend on the thread count) and gathers their `[tokens, v_dim]` outputs and states.
fn per_head<F>(inputs: &DeltaRuleInputs, head: F) -> DeltaRuleOutput
where
    F: Fn(usize) -> (Vec<f32>, Vec<f32>) + Sync + Send,
{
    let d = inputs.dims;
    let heads: Vec<(Vec<f32>, Vec<f32>)> = (0..d.v_heads).into_par_iter().map(&head).collect();
    let mut out = vec![0f32; d.tokens * d.v_heads * d.v_dim];
    let mut state = Vec::with_capacity(d.v_heads * d.k_dim * d.v_dim);
    for (h, (o, s)) in heads.into_iter().enumerate() {
        for t in 0..d.tokens {
            let at = (t * d.v_heads + h) * d.v_dim;
            out[at..at + d.v_dim].copy_from_slice(&o[t * d.v_dim..(t + 1) * d.v_dim]);
        }
        state.extend_from_slice(&s);
    }
    DeltaRuleOutput { out, state }
}

/// One value head of [`chunk_gated_delta_rule`]: its output `[tokens, v_dim]` and final state.
fn chunk_head(inputs: &DeltaRuleInputs, h: usize, chunk_size: usize) -> (Vec<f32>, Vec<f32>) {
    let d = inputs.dims;
    let (dk, dv, c) = (d.k_dim, d.v_dim, chunk_size);
    // torch multiplies by the python float k_dim ** -0.5, rounded to f32
    let scale = (dk as f64).powf(-0.5) as f32;
    let chunks = d.tokens.div_ceil(c);
    let mut out = vec![0f32; d.tokens * dv];
    let mut state = vec![0f32; dk * dv];
    {
        let mut x = head_inputs(inputs, h);
        x.q.iter_mut().for_each(|e| *e *= scale);
        for ci in 0..chunks {
            let start = ci * c;
            let len = (d.tokens - start).min(c); // rows past `len` are the zero padding
            let qs = &x.q[start * dk..(start + len) * dk];
            let ks = &x.k[start * dk..(start + len) * dk];
            let vs = &x.v[start * dv..(start + len) * dv];
            let gs = &x.g[start..start + len];
            let bs = &x.beta[start..start + len];
            let k_beta: Vec<f32> = (0..len * dk).map(|e| ks[e] * bs[e / dk]).collect();
            let v_beta: Vec<f32> = (0..len * dv).map(|e| vs[e] * bs[e / dv]).collect();
            // cumsum accumulates in f64 and rounds each prefix (PyTorch's CPU cumsum); the
            // padding's zeros leave the prefix of the last real token as cum[last]
            let mut acc = 0f64;
            let cum: Vec<f32> = gs
                .iter()
                .map(|&v| {
                    acc += v as f64;
                    acc as f32
                })
                .collect();
            let cum_last = acc as f32;
            let decay = |i: usize, j: usize| (cum[i] - cum[j]).exp();
            // u = (I + L)^-1 v_beta, w = (I + L)^-1 (k_beta * exp(cum)), L = strict_lower(A)
            let mut u = v_beta;
            let mut w: Vec<f32> = (0..len * dk)
                .map(|e| k_beta[e] * cum[e / dk].exp())
                .collect();
            for i in 0..len {
                for j in 0..i {
                    let a =
                        dot(&k_beta[i * dk..(i + 1) * dk], &ks[j * dk..(j + 1) * dk]) * decay(i, j);
                    for e in 0..dv {
                        u[i * dv + e] -= a * u[j * dv + e];
                    }
                    for e in 0..dk {
                        w[i * dk + e] -= a * w[j * dk + e];
                    }
                }
            }
            // v_new = u - w S
            let mut v_new = u;
            for i in 0..len {
                for e in 0..dv {
                    let ws: f32 = (0..dk).fold(0f32, |s, r| s + w[i * dk + r] * state[r * dv + e]);
                    v_new[i * dv + e] -= ws;
                }
            }
            // out = (q * exp(cum)) S + attn v_new
            for i in 0..len {
                let qd: Vec<f32> = qs[i * dk..(i + 1) * dk]
                    .iter()
                    .map(|&e| e * cum[i].exp())
                    .collect();
                let attn: Vec<f32> = (0..len)
                    .map(|j| {
                        if j > i {
                            0.0
                        } else {
                            dot(&qs[i * dk..(i + 1) * dk], &ks[j * dk..(j + 1) * dk]) * decay(i, j)
                        }
                    })
                    .collect();
                for e in 0..dv {
                    let inter = (0..dk).fold(0f32, |s, r| s + qd[r] * state[r * dv + e]);
                    let intra = (0..len).fold(0f32, |s, j| s + attn[j] * v_new[j * dv + e]);
                    out[(start + i) * dv + e] = inter + intra;
                }
            }
            // S = S * exp(cum[last]) + (k * exp(cum[last] - cum))^T v_new
            let chunk_decay = cum_last.exp();
            let kd: Vec<f32> = (0..len * dk)
                .map(|e| ks[e] * (cum_last - cum[e / dk]).exp())
                .collect();
            for r in 0..dk {
                for e in 0..dv {
                    let upd = (0..len).fold(0f32, |s, i| s + kd[i * dk + r] * v_new[i * dv + e]);
                    state[r * dv + e] = state[r * dv + e] * chunk_decay + upd;
                }
            }
        }
    }
    (out, state)
}

/// `torch_recurrent_gated_delta_rule(..., use_qk_l2norm_in_kernel=l2)` with a zero initial
/// state: per value head and token, `q /= sqrt(k_dim)` (after the l2 norm), `S *= exp(g)`,
/// `delta = (v - k^T S) * beta`, `S += k delta^T`, `out = q^T S`.
pub fn recurrent_gated_delta_rule(inputs: &DeltaRuleInputs) -> DeltaRuleOutput {
    inputs.check();
    per_head(inputs, |h| recurrent_head(inputs, h))
}

/// One value head of [`recurrent_gated_delta_rule`]: its output `[tokens, v_dim]` and state.
fn recurrent_head(inputs: &DeltaRuleInputs, h: usize) -> (Vec<f32>, Vec<f32>) {
    let d = inputs.dims;
    let (dk, dv) = (d.k_dim, d.v_dim);
    let root = (dk as f64).sqrt() as f32;
    let mut out = vec![0f32; d.tokens * dv];
    let mut s = vec![0f32; dk * dv];
    {
        let x = head_inputs(inputs, h);
        for t in 0..d.tokens {
            let qt: Vec<f32> = x.q[t * dk..(t + 1) * dk]
                .iter()
                .map(|&e| e / root)
                .collect();
            let kt = &x.k[t * dk..(t + 1) * dk];
            let vt = &x.v[t * dv..(t + 1) * dv];
            let decay = x.g[t].exp();
            s.iter_mut().for_each(|e| *e *= decay);
            for e in 0..dv {
                let kv_mem = (0..dk).fold(0f32, |acc, r| acc + s[r * dv + e] * kt[r]);
                let delta = (vt[e] - kv_mem) * x.beta[t];
                for r in 0..dk {
                    s[r * dv + e] += kt[r] * delta;
                }
            }
            for e in 0..dv {
                out[t * dv + e] = (0..dk).fold(0f32, |acc, r| acc + s[r * dv + e] * qt[r]);
            }
        }
    }
    (out, s)
}

fn f32_data(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

/// Whether the linear-attention ops run on `device` for key heads of `k_dim` values: always on
/// the CPU, on a GPU for [`GPU_DELTA_RULE_KEY_DIMS`].
pub fn linear_attention_available(device: &Device, k_dim: usize) -> bool {
    !device.is_cuda() || GPU_DELTA_RULE_KEY_DIMS.contains(&k_dim)
}

/// The causal depthwise conv1d ([`causal_conv1d`]) of the sequences of lengths `lens`,
/// concatenated, each from a zero history, on tensors:
///
/// * `x` `[tokens, channels]` f32 (row-major: token `t`, channel `c` at `t * channels + c`);
/// * `weight` `[channels, kernel]` f32, or `[channels, 1, kernel]` (the stored
///   `conv1d.weight`, same memory order): tap `j` of channel `c` multiplies token
///   `t - kernel + 1 + j`;
/// * `bias` `[channels]` f32, if any (Gated DeltaNet has none);
/// * `act` applied to every output.
///
/// Returns `[tokens, channels]` f32 on `x`'s device. On the CPU this is the reference above; a
/// GPU rounds the products and sums in the same order (the same bits before the activation;
/// SiLU's `exp` may differ in the last bit).
pub fn causal_conv1d_tensor(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    act: ConvActivation,
    lens: &[usize],
) -> Result<Tensor> {
    let (tokens, channels) = x.dims2()?;
    check_lens(lens, tokens)?;
    let kernel = *weight.dims().last().unwrap_or(&0);
    if weight.elem_count() != channels * kernel || weight.dims()[0] != channels || kernel == 0 {
        bail!(
            "conv1d weight {:?} does not match {channels} channels",
            weight.dims()
        );
    }
    if let Some(b) = bias {
        if b.dims() != [channels] {
            bail!("conv1d bias {:?} is not [{channels}]", b.dims());
        }
    }
    if x.device().is_cuda() {
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        let bias = bias.map(f32).transpose()?;
        let silu = act == ConvActivation::Silu;
        return gpu::causal_conv1d(&f32(x)?, &f32(weight)?, bias.as_ref(), silu, lens);
    }
    let (bias, weight) = (bias.map(f32_data).transpose()?, f32_data(weight)?);
    per_sequence([x], lens, |len, [x]| {
        let out = causal_conv1d(
            &f32_data(&x)?,
            channels,
            &weight,
            kernel,
            bias.as_deref(),
            act,
        );
        Tensor::from_vec(out, (len, channels), x.device())
    })
}

/// The Gated DeltaNet's conv1d of its packed `qkv` projection `[tokens, 2 key_dim + value_dim]`
/// in the compute dtype (SiLU, no bias, each sequence of `lens` from a zero history): computed
/// in f32, rounded to the compute dtype as the layer's output is, then split into q and k
/// `[tokens, key_dim]` and v `[tokens, value_dim]`, each f32, as the delta rule takes them. One
/// kernel on a GPU.
pub fn conv_qkv(
    qkv: &Tensor,
    weight: &Tensor,
    key_dim: usize,
    lens: &[usize],
) -> Result<(Tensor, Tensor, Tensor)> {
    let (tokens, channels) = qkv.dims2()?;
    if 2 * key_dim > channels || weight.dims()[0] != channels {
        bail!(
            "conv_qkv: {channels} channels, key_dim {key_dim}, weight {:?}",
            weight.dims()
        );
    }
    check_lens(lens, tokens)?;
    if qkv.device().is_cuda() {
        return gpu::conv_qkv(qkv, &weight.to_dtype(DType::F32)?, key_dim, lens);
    }
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let conv = causal_conv1d_tensor(&f32(qkv)?, weight, None, ConvActivation::Silu, lens)?
        .to_dtype(qkv.dtype())?;
    let part = |start, width| f32(&conv.narrow(1, start, width)?);
    Ok((
        part(0, key_dim)?,
        part(key_dim, key_dim)?,
        part(2 * key_dim, channels - 2 * key_dim)?,
    ))
}

/// `lens` cover `tokens` exactly.
fn check_lens(lens: &[usize], tokens: usize) -> Result<()> {
    if lens.iter().sum::<usize>() != tokens {
        bail!("sequence lengths {lens:?} do not add up to {tokens} tokens");
    }
    Ok(())
}

/// `f` on each sequence's rows of every one of `inputs` (lengths `lens`; `f` gets the length
/// and the rows in the order of `inputs`), its outputs concatenated: the CPU references take
/// one sequence at a time.
fn per_sequence<const N: usize>(
    inputs: [&Tensor; N],
    lens: &[usize],
    f: impl Fn(usize, [Tensor; N]) -> Result<Tensor>,
) -> Result<Tensor> {
    let mut outputs = Vec::with_capacity(lens.len());
    let mut offset = 0;
    for &len in lens {
        let rows = inputs.map(|t| t.narrow(0, offset, len));
        let rows = rows.into_iter().collect::<Result<Vec<_>>>()?;
        let rows: [Tensor; N] = rows.try_into().expect("N rows for N inputs");
        outputs.push(f(len, rows)?);
        offset += len;
    }
    Tensor::cat(&outputs, 0)
}

/// The chunk size of the gated delta rule (transformers' `chunk_size=64`).
pub const DELTA_RULE_CHUNK: usize = 64;

/// The gated delta rule of the sequences of lengths `lens` (concatenated), each with a zero
/// initial state, on tensors, as
/// transformers' `torch_chunk_gated_delta_rule` (chunks of [`DELTA_RULE_CHUNK`] tokens)
/// computes it ([`chunk_gated_delta_rule`]). All f32, row-major, token first:
///
/// * `q`, `k` `[tokens, k_heads, k_dim]` (not yet l2-normalised nor scaled);
/// * `v` `[tokens, v_heads, v_dim]`, `v_heads` a multiple of `k_heads`: value head `h` reads
///   key/query head `h / (v_heads / k_heads)` (`repeat_interleave`);
/// * `g` `[tokens, v_heads]`: the log of each token's state decay (`<= 0`);
/// * `beta` `[tokens, v_heads]`: the write strength;
/// * `use_qk_l2norm`: q and k are l2-normalised in the kernel (eps 1e-6), as every Gated
///   DeltaNet asks; the query is then scaled by `k_dim^-0.5`.
///
/// Returns the output `[tokens, v_heads, v_dim]` f32 on `q`'s device. On the CPU this is the
/// reference above; a GPU computes it token by token (transformers' recurrent form: the same
/// recurrence regrouped, equal up to f32 rounding), for the key dimensions in
/// [`GPU_DELTA_RULE_KEY_DIMS`], every sequence side by side in one launch; a sequence reads
/// only its own tokens, so nothing else in a batch can move its bits.
pub fn gated_delta_rule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    use_qk_l2norm: bool,
    lens: &[usize],
) -> Result<Tensor> {
    let (tokens, k_heads, k_dim) = q.dims3()?;
    check_lens(lens, tokens)?;
    let (vt, v_heads, v_dim) = v.dims3()?;
    if k.dims() != q.dims()
        || vt != tokens
        || g.dims() != [tokens, v_heads]
        || g.dims() != beta.dims()
    {
        bail!(
            "gated delta rule shapes: q {:?} k {:?} v {:?} g {:?} beta {:?}",
            q.dims(),
            k.dims(),
            v.dims(),
            g.dims(),
            beta.dims()
        );
    }
    if k_heads == 0 || !v_heads.is_multiple_of(k_heads) || k_dim == 0 || v_dim == 0 {
        bail!("{v_heads} value heads are not a multiple of {k_heads} key heads");
    }
    if q.device().is_cuda() {
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        let (q, k, v, g, beta) = (f32(q)?, f32(k)?, f32(v)?, f32(g)?, f32(beta)?);
        return gpu::gated_delta_rule(&q, &k, &v, &g, &beta, use_qk_l2norm, lens);
    }
    per_sequence([q, k, v, g, beta], lens, |len, [q, k, v, g, beta]| {
        let (qd, kd, vd) = (f32_data(&q)?, f32_data(&k)?, f32_data(&v)?);
        let (gd, bd) = (f32_data(&g)?, f32_data(&beta)?);
        let inputs = DeltaRuleInputs {
            dims: DeltaRuleDims {
                tokens: len,
                k_heads,
                v_heads,
                k_dim,
                v_dim,
            },
            q: &qd,
            k: &kd,
            v: &vd,
            g: &gd,
            beta: &bd,
            l2norm: use_qk_l2norm,
        };
        let res = chunk_gated_delta_rule(&inputs, DELTA_RULE_CHUNK);
        Tensor::from_vec(res.out, (len, v_heads, v_dim), q.device())
    })
}

/// torch's `F.softplus(x)` (beta 1, threshold 20) in f32: `x` above 20, else `log1p(exp(x))`.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// The Gated DeltaNet's per-token decay `g = -exp(A_log) * softplus(a + dt_bias)`, all in f32
/// as transformers computes it (`A_log.float().exp()`, `a.float() + dt_bias` promoted to f32):
/// `a` `[tokens, v_heads]`, `dt_bias` and `a_log` `[v_heads]`, any float dtype; returns
/// `[tokens, v_heads]` f32. On the CPU `softplus` is torch's (`log1p(exp(x))` below the
/// threshold 20); on a CUDA device it is composed of candle ops as `log(1 + exp(x))`, which
/// differs from `log1p` by at most an ulp of 1 where `exp(x)` is small.
pub fn gated_delta_decay(a: &Tensor, dt_bias: &Tensor, a_log: &Tensor) -> Result<Tensor> {
    let (tokens, heads) = a.dims2()?;
    if dt_bias.dims() != [heads] || a_log.dims() != [heads] {
        bail!(
            "decay gate shapes: a {:?} dt_bias {:?} A_log {:?}",
            a.dims(),
            dt_bias.dims(),
            a_log.dims()
        );
    }
    if a.device().is_cuda() {
        let x = a
            .to_dtype(DType::F32)?
            .broadcast_add(&dt_bias.to_dtype(DType::F32)?)?;
        let soft = x.gt(20f64)?.where_cond(&x, &(x.exp()? + 1.0)?.log()?)?;
        let decay = a_log.to_dtype(DType::F32)?.exp()?.neg()?;
        return soft.broadcast_mul(&decay);
    }
    let (a, dt, al) = (f32_data(a)?, f32_data(dt_bias)?, f32_data(a_log)?);
    let g = (0..tokens * heads)
        .map(|i| -al[i % heads].exp() * softplus(a[i] + dt[i % heads]))
        .collect();
    Tensor::from_vec(g, (tokens, heads), &Device::Cpu)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv1d_is_causal_and_depthwise() {
        // one channel, kernel [1, 2, 3]: y[t] = x[t-2] + 2 x[t-1] + 3 x[t]
        let x = [1.0, 10.0, 100.0];
        let y = causal_conv1d(&x, 1, &[1.0, 2.0, 3.0], 3, None, ConvActivation::Identity);
        assert_eq!(y, vec![3.0, 32.0, 321.0]);
        // two channels do not mix
        let x = [1.0, 0.0, 0.0, 1.0];
        let y = causal_conv1d(
            &x,
            2,
            &[5.0, 7.0, 11.0, 13.0],
            2,
            None,
            ConvActivation::Identity,
        );
        assert_eq!(y, vec![7.0, 0.0, 5.0, 13.0]);
    }

    #[test]
    fn one_token_delta_rule() {
        // S = k (v beta)^T from zero; out = q^T S / sqrt(dk) = (q.k) v beta / sqrt(dk)
        let dims = DeltaRuleDims {
            tokens: 1,
            k_heads: 1,
            v_heads: 1,
            k_dim: 4,
            v_dim: 2,
        };
        let (q, k, v) = ([1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [2.0, -4.0]);
        let inputs = DeltaRuleInputs {
            dims,
            q: &q,
            k: &k,
            v: &v,
            g: &[-0.5],
            beta: &[0.5],
            l2norm: false,
        };
        let r = recurrent_gated_delta_rule(&inputs);
        assert_eq!(r.out, vec![0.5, -1.0]);
        let c = chunk_gated_delta_rule(&inputs, 64);
        assert_eq!(c.out, r.out);
        assert_eq!(c.state, r.state);
    }
}
