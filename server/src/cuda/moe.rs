//! Launches of kernels/moe.cu: the router's top-k and the combine of the experts' outputs.
// Kernel launches are FFI: the argument lists below must match the kernel signatures.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Result, Tensor};

use super::module::{kernel, MOE};
use super::{
    device_address, grid_1d, grid_rows, kernel_name, rows_of_vectors, vector_kernel_name,
    with_slice, wrap,
};

/// The router of a mixture of experts on its logits `[tokens, experts]`: per token the ids and
/// weights of its top `k` experts by f32 softmax probability (ties to the lowest id), the
/// weights renormalised to sum 1 when `norm`, flat `[tokens × k]`. A token whose
/// probabilities hold a NaN gets the id `experts`. Only these pairs leave the GPU. At most
/// 512 experts (`MOE_MAX_PER_LANE` in moe.cu), which `ops::moe_route` checks.
pub fn moe_topk(logits: &Tensor, k: usize, norm: bool) -> Result<(Vec<u32>, Vec<f32>)> {
    let (ids, weights) = moe_topk_on_device(logits, k, norm)?;
    Ok((ids.to_vec1()?, weights.to_vec1()?))
}

/// [`moe_topk`] left on the GPU: u32 ids and f32 weights, `[tokens × k]` each.
pub fn moe_topk_on_device(logits: &Tensor, k: usize, norm: bool) -> Result<(Tensor, Tensor)> {
    let logits = logits.contiguous()?;
    let (rows, experts) = logits.dims2()?;
    let name = kernel_name("moe_topk", logits.dtype());
    let (ids, weights) = with_float_type!(logits.dtype(), T => with_slice::<T, _>(&logits, |ls, lo, dev| {
        let func = kernel(dev, &MOE, &name)?;
        // SAFETY: the kernel writes every element of both.
        let (ids, weights) = unsafe { (dev.alloc::<u32>(rows * k)?, dev.alloc::<f32>(rows * k)?) };
        let ls = ls.slice(lo..);
        let (e32, k32, n32, r32) = (experts as i32, k as i32, i32::from(norm), rows as i32);
        let mut b = func.builder();
        b.arg(&ls).arg(&e32).arg(&k32).arg(&n32).arg(&ids).arg(&weights).arg(&r32);
        // SAFETY: arguments match `moe_topk_*` (one warp per token).
        unsafe { b.launch(grid_1d(rows * 32)) }.w()?;
        Ok((wrap(ids, dev, rows * k), wrap(weights, dev, rows * k)))
    }))?;
    Ok((ids, weights))
}

/// A group-limited router on its f32 `scores` `[tokens, experts]` (`bias`: f32 `[experts]`),
/// as `ops::moe_route_grouped` routes on the CPU: u32 ids and f32 weights, `[tokens × k]`
/// each, left on the GPU. `(groups, topk_group)`; `top_two`: a group scores its two best;
/// `masked`: what a dropped group's experts score; `round`: the dtype every step rounds to.
#[allow(clippy::too_many_arguments)]
pub fn moe_route_grouped(
    scores: &Tensor,
    bias: Option<&Tensor>,
    k: usize,
    (groups, topk_group): (usize, usize),
    norm: bool,
    scale: f32,
    top_two: bool,
    masked: f32,
    round: DType,
) -> Result<(Tensor, Tensor)> {
    let (tokens, experts) = scores.dims2()?;
    if scores.dtype() != DType::F32
        || experts > 512
        || groups == 0
        || !experts.is_multiple_of(groups)
        || topk_group > groups
        || k > experts
        || bias.is_some_and(|b| b.dims() != [experts] || b.dtype() != DType::F32)
    {
        bail!(
            "moe_route_grouped: scores {:?} {:?}, {groups} groups keeping {topk_group}, k {k}",
            scores.dims(),
            scores.dtype()
        );
    }
    let scores = scores.contiguous()?;
    let bias = bias.map(|b| b.contiguous()).transpose()?;
    let round = match round {
        DType::BF16 => 1i32,
        DType::F16 => 2,
        _ => 0,
    };
    with_slice::<f32, _>(&scores, |ss, so, dev| {
        let func = kernel(dev, &MOE, "moe_route_grouped")?;
        // SAFETY: the kernel writes every element of both.
        let (ids, weights) =
            unsafe { (dev.alloc::<u32>(tokens * k)?, dev.alloc::<f32>(tokens * k)?) };
        let ss = ss.slice(so..);
        let bias_address = match &bias {
            Some(b) => super::device_address::<f32>(b)?,
            None => 0,
        };
        let (t32, e32, k32, g32, kg32) = (
            tokens as i32,
            experts as i32,
            k as i32,
            groups as i32,
            topk_group as i32,
        );
        let (n32, two32) = (i32::from(norm), i32::from(top_two));
        let mut b = func.builder();
        b.arg(&ss)
            .arg(&bias_address)
            .arg(&t32)
            .arg(&e32)
            .arg(&k32)
            .arg(&g32)
            .arg(&kg32);
        b.arg(&n32)
            .arg(&scale)
            .arg(&two32)
            .arg(&masked)
            .arg(&round)
            .arg(&ids)
            .arg(&weights);
        // A warp per token, MOE_GROUPED_WARPS (4) a block.
        let config = LaunchConfig {
            grid_dim: (tokens.div_ceil(4).max(1) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match `moe_route_grouped` (a warp per token; the bias, where
        // given, [experts] f32 and alive for the launch: `bias` is held until it returns and
        // the stream orders its release).
        unsafe { b.launch(config) }.w()?;
        Ok((wrap(ids, dev, tokens * k), wrap(weights, dev, tokens * k)))
    })
}

/// The experts' rows of a routed batch laid out on the GPU from the router's `ids` and
/// `weights` (`[tokens × k]`, [`moe_topk_on_device`]), as `ExpertRows` lays them out on the
/// host: (rows_token u32, row_weight f32, positions u32, each `[tokens × k]`; offsets i64
/// `[experts + 1]`; tiles u32 `[1 + 2 · max_tiles]` of `tile_rows` rows for
/// `matmul_t_int4_tiled`).
pub fn moe_plan(
    ids: &Tensor,
    weights: &Tensor,
    k: usize,
    experts: usize,
    tile_rows: usize,
) -> Result<[Tensor; 5]> {
    let entries = ids.elem_count();
    if weights.elem_count() != entries || k == 0 || !entries.is_multiple_of(k) || tile_rows == 0 {
        bail!(
            "moe_plan: ids {:?}, weights {:?}, k {k}, tile rows {tile_rows}",
            ids.dims(),
            weights.dims()
        );
    }
    let tiles_most = entries.div_ceil(tile_rows) + experts;
    with_slice::<u32, _>(ids, |is, io, dev| {
        with_slice::<f32, _>(weights, |ws, wo, _| {
            let (is, ws) = (is.slice(io..), ws.slice(wo..));
            // SAFETY (allocations): the kernels write every element the plan reads: counts and
            // offsets whole, rows and positions once per entry (positions of NaN tokens by
            // moe_plan_count), tiles up to their count.
            let counts = unsafe { dev.alloc::<u32>(experts) }?;
            let positions = unsafe { dev.alloc::<u32>(entries) }?;
            let (e32, n32) = (experts as i32, entries as i32);
            let warps = grid_1d(experts * 32);
            let count = kernel(dev, &MOE, "moe_plan_count")?;
            let mut b = count.builder();
            b.arg(&is).arg(&n32).arg(&e32).arg(&counts).arg(&positions);
            // SAFETY: arguments match `moe_plan_count` (a warp per expert).
            unsafe { b.launch(warps) }.w()?;
            let rows_token = unsafe { dev.alloc::<u32>(entries) }?;
            let row_weight = unsafe { dev.alloc::<f32>(entries) }?;
            let offsets = unsafe { dev.alloc::<i64>(experts + 1) }?;
            let tiles = unsafe { dev.alloc::<u32>(1 + 2 * tiles_most) }?;
            let (t32, k32, r32) = ((entries / k) as i32, k as i32, tile_rows as i32);
            let place = kernel(dev, &MOE, "moe_plan_place")?;
            let mut b = place.builder();
            b.arg(&is)
                .arg(&ws)
                .arg(&counts)
                .arg(&t32)
                .arg(&k32)
                .arg(&e32)
                .arg(&r32);
            b.arg(&rows_token)
                .arg(&row_weight)
                .arg(&positions)
                .arg(&offsets)
                .arg(&tiles);
            // SAFETY: arguments match `moe_plan_place` (a warp per expert); at most
            // `tiles_most` tiles (Σ ceil(count / tile_rows) <= entries / tile_rows + experts).
            unsafe { b.launch(warps) }.w()?;
            Ok([
                wrap(rows_token, dev, entries),
                wrap(row_weight, dev, entries),
                wrap(positions, dev, (entries / k, k)),
                wrap(offsets, dev, experts + 1),
                wrap(tiles, dev, 1 + 2 * tiles_most),
            ])
        })
    })
}

/// A plan's rows (`moe_plan`'s rows_token, row_weight, positions and offsets) padded per
/// expert: expert `e`'s rows to `dest[e]..dest[e] + rows[e]` of `padded` rows, the padding
/// repeating its first token with weight 0 (`moe_pad_rows`), and the positions mapped onto
/// them (`moe_pad_positions`).
pub fn moe_pad_plan(
    rows_token: &Tensor,
    row_weight: &Tensor,
    positions: &Tensor,
    offsets: &Tensor,
    (dest, rows): (&[u32], &[u32]),
    padded: usize,
) -> Result<[Tensor; 3]> {
    let experts = dest.len();
    let entries = positions.elem_count();
    let total: usize = rows.iter().map(|&r| r as usize).sum();
    if rows.len() != experts
        || offsets.elem_count() != experts + 1
        || total != padded
        || entries > i32::MAX as usize
    {
        bail!(
            "moe_pad_plan: {experts} experts' destinations, {} row counts ({total} of {padded}), \
             offsets {:?}",
            rows.len(),
            offsets.dims()
        );
    }
    let dev = rows_token.device();
    let (dest, rows) = (Tensor::new(dest, dev)?, Tensor::new(rows, dev)?);
    with_slice::<u32, _>(rows_token, |ts, to, dev| {
        // SAFETY (allocations): moe_pad_rows writes every padded row (the destinations tile
        // 0..padded) and the map entry of every plan row, moe_pad_positions every position.
        let padded_token = unsafe { dev.alloc::<u32>(padded.max(1)) }?;
        let padded_weight = unsafe { dev.alloc::<f32>(padded.max(1)) }?;
        let map = unsafe { dev.alloc::<u32>(rows_token.elem_count().max(1)) }?;
        let out = unsafe { dev.alloc::<u32>(entries.max(1)) }?;
        let ts = ts.slice(to..);
        with_slice::<f32, _>(row_weight, |ws, wo, _| {
            with_slice::<i64, _>(offsets, |os, oo, _| {
                with_slice::<u32, _>(&dest, |ds, _, _| {
                    with_slice::<u32, _>(&rows, |rs, _, _| {
                        let (ws, os) = (ws.slice(wo..), os.slice(oo..));
                        let e32 = experts as i32;
                        let pad = kernel(dev, &MOE, "moe_pad_rows")?;
                        let mut b = pad.builder();
                        b.arg(&ts).arg(&ws).arg(&os).arg(ds).arg(rs).arg(&e32);
                        b.arg(&padded_token).arg(&padded_weight).arg(&map);
                        // SAFETY: arguments match `moe_pad_rows` (a warp per expert).
                        unsafe { b.launch(grid_1d(experts * 32)) }.w()
                    })
                })
            })
        })?;
        with_slice::<u32, _>(positions, |ps, po, _| {
            let ps = ps.slice(po..);
            let n32 = entries as i32;
            let remap = kernel(dev, &MOE, "moe_pad_positions")?;
            let mut b = remap.builder();
            b.arg(&ps).arg(&map).arg(&n32).arg(&out);
            // SAFETY: arguments match `moe_pad_positions` (a thread per entry).
            unsafe { b.launch(grid_1d(entries)) }.w()
        })?;
        Ok([
            wrap(padded_token, dev, padded),
            wrap(padded_weight, dev, padded),
            wrap(out, dev, positions.dims()),
        ])
    })
}

/// A `[rows, cols]` tensor on `like`'s GPU in its dtype, not cleared (`ops::expert_rows`).
pub fn expert_rows(rows: usize, cols: usize, like: &Tensor) -> Result<Tensor> {
    let candle_core::Device::Cuda(dev) = like.device() else {
        bail!("expert_rows: {:?} is not a GPU", like.device());
    };
    with_float_type!(like.dtype(), T => {
        // SAFETY: every bit pattern is a value of T; the experts' GEMMs write every row that
        // is read later (ops::expert_rows).
        let rows_buffer = unsafe { dev.alloc::<T>(rows * cols) }?;
        Ok(wrap(rows_buffer, dev, (rows, cols)))
    })
}

/// `residual[t] + Σ_j weights[r] · y[r]` over `r = positions[t, j]` per token `t` (u32
/// `[tokens, k]`), the sum taken in the order of `positions`: each term rounded to the
/// compute dtype from the f32 product (with `compute_dtype_weights`, from the product with the
/// weight rounded to the compute dtype first), every add rounded to it.
pub fn moe_combine(
    y: &Tensor,
    weights: &Tensor,
    compute_dtype_weights: bool,
    positions: &Tensor,
    residual: &Tensor,
    shared: Option<&Tensor>,
) -> Result<Tensor> {
    let (y, residual) = (y.contiguous()?, residual.contiguous()?);
    let shared = shared.map(Tensor::contiguous).transpose()?;
    let (tokens, k) = positions.dims2()?;
    let (rows, cols) = y.dims2()?;
    if residual.dims() != [tokens, cols]
        || residual.dtype() != y.dtype()
        || weights.elem_count() != rows
        || weights.dtype() != DType::F32
        || shared
            .as_ref()
            .is_some_and(|s| s.dims() != residual.dims() || s.dtype() != y.dtype())
    {
        bail!(
            "moe_combine: y {:?}, weights {:?}, residual {:?}, shared {:?}",
            y.dims(),
            weights.dims(),
            residual.dims(),
            shared.as_ref().map(Tensor::dims)
        );
    }
    if tokens == 0 || cols == 0 {
        return Tensor::zeros((tokens, cols), y.dtype(), y.device());
    }
    let n = tokens * cols;
    let mut vectored = vec![&y, &residual];
    vectored.extend(shared.as_ref());
    let vectors = rows_of_vectors(cols, &vectored);
    let name = vector_kernel_name("moe_combine", vectors, y.dtype());
    with_float_type!(y.dtype(), T => {
        // The shared expert's output, or null.
        let shared_address = shared.as_ref().map(device_address::<T>).transpose()?.unwrap_or(0);
        with_slice::<T, _>(&y, |ys, yo, dev| {
            with_slice::<f32, _>(weights, |ws, wo, _| {
                with_slice::<u32, _>(positions, |ps, po, _| {
                    with_slice::<T, _>(&residual, |rs, ro, _| {
                        let func = kernel(dev, &MOE, &name)?;
                        // SAFETY: the kernel writes every element.
                        let out = unsafe { dev.alloc::<T>(n) }?;
                        let (ys, ws) = (ys.slice(yo..), ws.slice(wo..));
                        let (ps, rs) = (ps.slice(po..), rs.slice(ro..));
                        let (k32, c32, cw) = (k as i32, cols as i32, i32::from(compute_dtype_weights));
                        let mut b = func.builder();
                        b.arg(&ys).arg(&ws).arg(&ps).arg(&rs).arg(&shared_address).arg(&out);
                        b.arg(&k32).arg(&c32).arg(&cw);
                        // SAFETY: arguments match `moe_combine[_v8]_*` (a block per token; 16-byte
                        // vectors only where rows_of_vectors allows them; every position < rows of
                        // y, built by the caller; `shared`, when given, [tokens, cols] and alive
                        // until the launch is ordered on the stream).
                        unsafe { b.launch(grid_rows(tokens)) }.w()?;
                        Ok(wrap(out, dev, (tokens, cols)))
                    })
                })
            })
        })
    })
}
