//! Launches of kernels/linear_attention.cu: the causal conv1d and the gated delta rule of Gated
//! DeltaNet layers, in f32, over a batch of sequences (`lens`, concatenated) in one launch.
// Kernel launches are FFI: the argument lists below must match the kernel signatures.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Result, Tensor};

use super::module::{kernel, LINEAR_ATTENTION};
use super::{grid_1d, kernel_name, with_slice, wrap, THREADS};

/// Warps per block of `gated_delta_rule_k*_f32` (`DELTA_WARPS`) and value columns a block owns
/// (`BLOCK_COLS`).
const DELTA_WARPS: usize = 4;
const BLOCK_COLS: usize = 16;

/// The sequences' token ranges `starts[i] .. starts[i + 1]` (i32) on the device of `like`.
fn starts(lens: &[usize], like: &Tensor) -> Result<Tensor> {
    let starts: Vec<i32> = std::iter::once(0)
        .chain(lens.iter().scan(0i32, |end, &len| {
            *end += len as i32;
            Some(*end)
        }))
        .collect();
    Tensor::new(starts.as_slice(), like.device())
}

fn f32_contiguous(name: &str, t: &Tensor) -> Result<Tensor> {
    if t.dtype() != DType::F32 {
        bail!("linear attention: {name} must be f32, got {:?}", t.dtype());
    }
    t.contiguous()
}

/// The depthwise causal conv1d of `x` `[tokens, channels]` with `weight` `[channels, kernel]`
/// (or `[channels, 1, kernel]`) and an optional `bias` `[channels]`, followed by SiLU when
/// `silu`; each of the sequences of lengths `lens` from its own zero history.
pub fn causal_conv1d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    silu: bool,
    lens: &[usize],
) -> Result<Tensor> {
    let (x, weight) = (f32_contiguous("x", x)?, f32_contiguous("weight", weight)?);
    // shapes checked by ops::causal_conv1d_tensor
    let (tokens, channels) = x.dims2()?;
    let kernel_size = weight.elem_count() / channels.max(1);
    let has_bias = i32::from(bias.is_some());
    // Without a bias the kernel is handed the weight in its place and told to skip it.
    let bias = match bias {
        Some(b) => f32_contiguous("bias", b)?,
        None => weight.clone(),
    };
    let starts = starts(lens, &x)?;
    with_slice::<f32, _>(&x, |xs, xo, dev| {
        with_slice::<f32, _>(&weight, |ws, wo, _| {
            with_slice::<f32, _>(&bias, |bs, bo, _| {
                with_slice::<i32, _>(&starts, |ss, so, _| {
                    let func = kernel(dev, &LINEAR_ATTENTION, "causal_conv1d_f32")?;
                    let n = tokens * channels;
                    // SAFETY: the kernel writes every element.
                    let out = unsafe { dev.alloc::<f32>(n) }?;
                    let (xs, ws, bs) = (xs.slice(xo..), ws.slice(wo..), bs.slice(bo..));
                    let dims = [tokens, channels, kernel_size].map(|d| d as i32);
                    let mut b = func.builder();
                    b.arg(&xs).arg(&ws).arg(&bs).arg(&has_bias).arg(&out);
                    for d in &dims {
                        b.arg(d);
                    }
                    let act = i32::from(silu);
                    let (ss, sequences) = (ss.slice(so..), lens.len() as i32);
                    b.arg(&act).arg(&ss).arg(&sequences);
                    // SAFETY: arguments match `causal_conv1d_f32` (one thread per output element).
                    unsafe { b.launch(grid_1d(n)) }.w()?;
                    Ok(wrap(out, dev, (tokens, channels)))
                })
            })
        })
    })
}

/// The Gated DeltaNet conv1d (SiLU, no bias) of the packed projection `qkv` `[tokens,
/// channels]` in its compute dtype, each sequence of `lens` from a zero history, rounded to that
/// dtype, split into q and k `[tokens, key_dim]` and v `[tokens, channels - 2 key_dim]`, all f32.
pub fn conv_qkv(
    qkv: &Tensor,
    weight: &Tensor,
    key_dim: usize,
    lens: &[usize],
) -> Result<(Tensor, Tensor, Tensor)> {
    let (qkv, weight) = (qkv.contiguous()?, f32_contiguous("weight", weight)?);
    // shapes checked by ops::conv_qkv
    let (tokens, channels) = qkv.dims2()?;
    let kernel_size = weight.elem_count() / channels.max(1);
    let value_dim = channels - 2 * key_dim;
    let starts = starts(lens, &qkv)?;
    let name = kernel_name("conv_qkv", qkv.dtype());
    with_float_type!(qkv.dtype(), T => with_slice::<T, _>(&qkv, |xs, xo, dev| {
        with_slice::<f32, _>(&weight, |ws, wo, _| {
            with_slice::<i32, _>(&starts, |ss, so, _| {
                let func = kernel(dev, &LINEAR_ATTENTION, &name)?;
                // SAFETY: the kernel writes every element of the three (one thread per input
                // element, each to one of them).
                let q = unsafe { dev.alloc::<f32>(tokens * key_dim) }?;
                let k = unsafe { dev.alloc::<f32>(tokens * key_dim) }?;
                let v = unsafe { dev.alloc::<f32>(tokens * value_dim) }?;
                let (xs, ws, ss) = (xs.slice(xo..), ws.slice(wo..), ss.slice(so..));
                let dims = [tokens, channels, kernel_size, key_dim].map(|d| d as i32);
                let mut b = func.builder();
                b.arg(&xs).arg(&ws).arg(&q).arg(&k).arg(&v);
                for d in &dims {
                    b.arg(d);
                }
                let sequences = lens.len() as i32;
                b.arg(&ss).arg(&sequences);
                // SAFETY: arguments match `conv_qkv_*` (one thread per input element).
                unsafe { b.launch(grid_1d(tokens * channels)) }.w()?;
                Ok((
                    wrap(q, dev, (tokens, key_dim)),
                    wrap(k, dev, (tokens, key_dim)),
                    wrap(v, dev, (tokens, value_dim)),
                ))
            })
        })
    }))
}

/// q or k `[tokens, heads, dim]` as the delta rule reads them: l2-normalised when `l2`, then
/// multiplied by `scale`.
fn prepare(x: &Tensor, l2: bool, scale: f32) -> Result<Tensor> {
    let (tokens, heads, dim) = x.dims3()?;
    let rows = tokens * heads;
    with_slice::<f32, _>(x, |xs, xo, dev| {
        let func = kernel(dev, &LINEAR_ATTENTION, "delta_rule_prepare_f32")?;
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<f32>(rows * dim) }?;
        let xs = xs.slice(xo..);
        let (r32, d32, l2) = (rows as i32, dim as i32, l2 as i32);
        let mut b = func.builder();
        b.arg(&xs)
            .arg(&out)
            .arg(&r32)
            .arg(&d32)
            .arg(&l2)
            .arg(&scale);
        let warps = THREADS as usize / 32;
        let config = LaunchConfig {
            grid_dim: (rows.div_ceil(warps).max(1) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match `delta_rule_prepare_f32` (one warp per row).
        unsafe { b.launch(config) }.w()?;
        Ok(wrap(out, dev, (tokens, heads, dim)))
    })
}

/// The gated delta rule of the sequences of lengths `lens` (concatenated), each from a zero
/// state, side by side in one launch: q, k `[tokens, k_heads, k_dim]`, v
/// `[tokens, v_heads, v_dim]`, g, beta `[tokens, v_heads]`, all f32; q and k l2-normalised
/// first when `l2`. Returns `[tokens, v_heads, v_dim]` in f32, computed token by token (the
/// recurrence the CPU's chunked form regroups).
pub fn gated_delta_rule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    l2: bool,
    lens: &[usize],
) -> Result<Tensor> {
    let (q, k, v) = (
        f32_contiguous("q", q)?,
        f32_contiguous("k", k)?,
        f32_contiguous("v", v)?,
    );
    let (g, beta) = (f32_contiguous("g", g)?, f32_contiguous("beta", beta)?);
    let (tokens, k_heads, k_dim) = q.dims3()?;
    let (_, v_heads, v_dim) = v.dims3()?;
    // one kernel per key dimension: the state column lives in registers
    if ![32, 64, 128, 256].contains(&k_dim) {
        bail!("the GPU gated delta rule has kernels for key head dimensions 32, 64, 128 and 256, not {k_dim}");
    }
    // torch multiplies by the python float k_dim ** -0.5, rounded to f32
    let scale = (k_dim as f64).powf(-0.5) as f32;
    let (q, k) = (prepare(&q, l2, scale)?, prepare(&k, l2, 1.0)?);
    let starts = starts(lens, &q)?;
    with_slice::<i32, _>(&starts, |ss, so, _| {
        with_slice::<f32, _>(&q, |qs, qo, dev| {
            with_slice::<f32, _>(&k, |ks, ko, _| {
                with_slice::<f32, _>(&v, |vs, vo, _| {
                    with_slice::<f32, _>(&g, |gs, go, _| {
                        with_slice::<f32, _>(&beta, |bs, bo, _| {
                            let name = format!("gated_delta_rule_k{k_dim}_f32");
                            let func = kernel(dev, &LINEAR_ATTENTION, &name)?;
                            let n = tokens * v_heads * v_dim;
                            // SAFETY: the kernel writes every element (each block its columns of
                            // every token).
                            let out = unsafe { dev.alloc::<f32>(n) }?;
                            let (qs, ks, vs) = (qs.slice(qo..), ks.slice(ko..), vs.slice(vo..));
                            let (gs, bs) = (gs.slice(go..), bs.slice(bo..));
                            let ss = ss.slice(so..);
                            let dims = [k_heads, v_heads, v_dim].map(|d| d as i32);
                            let mut b = func.builder();
                            b.arg(&qs)
                                .arg(&ks)
                                .arg(&vs)
                                .arg(&gs)
                                .arg(&bs)
                                .arg(&out)
                                .arg(&ss);
                            for d in &dims {
                                b.arg(d);
                            }
                            let config = LaunchConfig {
                                grid_dim: (
                                    v_dim.div_ceil(BLOCK_COLS) as u32,
                                    v_heads as u32,
                                    lens.len() as u32,
                                ),
                                block_dim: (32 * DELTA_WARPS as u32, 1, 1),
                                shared_mem_bytes: 0,
                            };
                            // SAFETY: arguments match `gated_delta_rule_k*_f32`; shapes checked
                            // by the caller (ops::linear_attention), k_dim above.
                            unsafe { b.launch(config) }.w()?;
                            Ok(wrap(out, dev, (tokens, v_heads, v_dim)))
                        })
                    })
                })
            })
        })
    })
}
