//! Launches of the int4 GEMM (kernels/int4_gemm.cuh, built in dequant.cu) that decodes a
//! mixture's int4 experts inside the product, on a plan counted on the host or laid out on the
//! GPU.
// Kernel launches are FFI: the argument lists below must match the kernel signatures.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Device, Result, Tensor};

use super::super::module::{kernel, DEQUANT, INT4_GEMM_SM90};
use super::super::{device_address, dtype_suffix, kernel_name, with_slice};
use super::stack_addresses;

static WGMMA: AtomicBool = AtomicBool::new(true);

/// Allows or forbids the wgmma kernels (kernels/int4_gemm_sm90.cu) process-wide, where they run
/// (a Hopper GPU); forbidden, every GPU takes the mma.sync ones. Both give the same bits.
pub fn int4_gemm_on_wgmma(on: bool) {
    WGMMA.store(on, Ordering::Relaxed);
}

/// Whether the wgmma kernels were built (for sm_90) and run on `device` (a Hopper GPU).
pub fn int4_gemm_wgmma_runs_on(device: &Device) -> Result<bool> {
    match device {
        Device::Cuda(dev) => INT4_GEMM_SM90.runs_on(dev),
        _ => Ok(false),
    }
}

/// Rows of x per block of `matmul_t_int4_stacked` (its two tilings), and each tiling's dynamic
/// shared memory: 3 stages of 64-wide k-tiles (x rows, 128 weight rows' int4 words, two scales
/// and zero points each), two decoded 128-row weight tiles, and room to align them to 1024 bytes
/// (wgmma's swizzle atoms; int4_gemm.cuh's ig_shared_bytes without it).
pub const INT4_GEMM_TILE_ROWS: [usize; 2] = [64, 128];
fn int4_gemm_shared_bytes(tile_rows: usize) -> usize {
    3 * (tile_rows * 64 * 2 + 128 * 8 * 4 + 2 * 128 * 8) + 2 * 128 * 64 * 2 + 1024
}

/// The tiling for blocks of `rows`: 64 rows where none has more, else 128 (each weight tile is
/// decoded once per block: 64-row blocks decode twice as often).
pub fn int4_gemm_tile_rows(rows: &[usize]) -> usize {
    if rows.iter().all(|&r| r <= 64) {
        64
    } else {
        128
    }
}

/// Whether `matmul_t_int4_stacked` takes weights of this shape `[n, k]`, width and group in
/// `dtype`: int4, k a multiple of 64 and the group of 32, n even, bf16/f16.
fn int4_gemm_takes((n, k): (usize, usize), bits: usize, group: usize, dtype: DType) -> bool {
    bits == 4
        && k.is_multiple_of(64)
        && group.is_multiple_of(32)
        && n.is_multiple_of(2)
        && dtype != DType::F32
}

/// Whether the codes, scales and zero points at `addresses` ([`stack_addresses`]) are aligned
/// for the kernel's copies: 16 bytes of codes, the 4 bytes that hold a scale or a zero point (a
/// 16-bit scale's or a byte zero point's word is found from its index, which needs them to
/// start on a word).
fn int4_gemm_aligned(addresses: &[u64]) -> bool {
    addresses
        .chunks(3)
        .all(|w| w[0].is_multiple_of(16) && w[1].is_multiple_of(4) && w[2].is_multiple_of(4))
}

/// Whether `matmul_t_int4_stacked` multiplies these weights (one shape `[n, k]` of `bits`-bit
/// codes in groups of `group`) in `dtype` ([`int4_gemm_takes`]), laid out as it reads them
/// ([`kernel_args`]).
pub fn int4_gemm_applies(
    weights: &[(&Tensor, &Tensor, Option<&Tensor>)],
    shape: (usize, usize),
    bits: usize,
    group: usize,
    dtype: DType,
) -> Result<bool> {
    Ok(int4_gemm_takes(shape, bits, group, dtype) && kernel_args(weights, shape, group)?.is_some())
}

/// The weights' addresses as the kernel takes them ([`stack_addresses`]) and their scales'
/// dtype, or `None` where it cannot read them: zero points that are not bytes (a 4-bit
/// weight's always fit one, `quant::pack_quantized`) or addresses not aligned for its copies.
fn kernel_args(
    weights: &[(&Tensor, &Tensor, Option<&Tensor>)],
    shape: (usize, usize),
    group: usize,
) -> Result<Option<(Vec<u64>, DType)>> {
    let byte_zero_points = weights
        .iter()
        .all(|(_, _, z)| z.is_none_or(|z| z.dtype() == DType::U8));
    if !byte_zero_points {
        return Ok(None);
    }
    let args = stack_addresses(weights, shape, 4, group)?;
    // (an empty stack launches nothing: its scales' dtype is never read)
    let scales = weights.first().map_or(DType::F32, |(_, s, _)| s.dtype());
    Ok(int4_gemm_aligned(&args).then_some((args, scales)))
}

/// `x_z · w_zᵀ` for the int4 weights `weights` (one shape `[n, k]`, one group: a mixture's
/// experts, where [`int4_gemm_applies`]) and their blocks of `rows[z]` consecutive rows of `x`
/// (`[Σ rows, k]`, bf16/f16; any counts, 0 included), written into rows `row0..` of `out`
/// (`[.., n]`, x's dtype): one launch of `matmul_t_int4_stacked` with `tile_rows` rows per block
/// ([`INT4_GEMM_TILE_ROWS`]; `None`: [`int4_gemm_tile_rows`]), which decodes
/// each weight value as [`dequant_int_stacked`] would (the same values) and multiplies on tensor
/// cores.
#[allow(clippy::too_many_arguments)]
pub fn matmul_t_int4_stacked_into_rows(
    out: &Tensor,
    row0: usize,
    x: &Tensor,
    weights: &[(&Tensor, &Tensor, Option<&Tensor>)],
    rows: &[usize],
    (n, k): (usize, usize),
    group: usize,
    tile_rows: Option<usize>,
) -> Result<()> {
    let total: usize = rows.iter().sum();
    check_int4_gemm(out, row0, x, weights.len(), total, (n, k), group)?;
    if rows.len() != weights.len() {
        bail!(
            "matmul_t_int4_stacked_into_rows: {} row counts for {} weights",
            rows.len(),
            weights.len()
        );
    }
    let most = rows.iter().copied().max().unwrap_or(0);
    if most == 0 {
        return Ok(());
    }
    let tile_rows = tile_rows.unwrap_or_else(|| int4_gemm_tile_rows(rows));
    // The weights' addresses, then each block's first row.
    let Some((mut args, scales)) = kernel_args(weights, (n, k), group)? else {
        bail!(
            "matmul_t_int4_stacked_into_rows: weights the kernel cannot read (int4_gemm_applies)"
        );
    };
    args.extend(std::iter::once(0).chain(rows.iter().scan(0u64, |end, &r| {
        *end += r as u64;
        Some(*end)
    })));
    let grid = (
        n.div_ceil(128) as u32,
        most.div_ceil(tile_rows) as u32,
        weights.len() as u32,
    );
    launch_int4_gemm(
        out,
        row0,
        x,
        (&args, scales),
        None,
        tile_rows,
        grid,
        n,
        k,
        group,
    )
}

/// [`matmul_t_int4_stacked_into_rows`] on a plan made on the GPU (`ops::moe_plan`): the
/// experts' rows at `offsets` (i64 `[weights + 1]`, `total` rows in all) and the blocks at
/// `tiles` (u32 `[1 + 2 · max]`: the count, then (expert, first row) pairs of `tile_rows`
/// rows), so that no count is read back to the host. The grid holds `max` tiles; those past the
/// count return at once.
#[allow(clippy::too_many_arguments)]
pub fn matmul_t_int4_tiled_into_rows(
    out: &Tensor,
    row0: usize,
    x: &Tensor,
    weights: &[(&Tensor, &Tensor, Option<&Tensor>)],
    (offsets, tiles, total): (&Tensor, &Tensor, usize),
    (n, k): (usize, usize),
    group: usize,
    tile_rows: usize,
) -> Result<()> {
    check_int4_gemm(out, row0, x, weights.len(), total, (n, k), group)?;
    let max_tiles = tiles.elem_count().saturating_sub(1) / 2;
    if offsets.dims() != [weights.len() + 1]
        || offsets.dtype() != DType::I64
        || tiles.dtype() != DType::U32
    {
        bail!(
            "matmul_t_int4_tiled_into_rows: offsets {:?} {:?}, tiles {:?} for {} weights",
            offsets.dims(),
            offsets.dtype(),
            tiles.dims(),
            weights.len()
        );
    }
    if total == 0 || max_tiles == 0 {
        return Ok(());
    }
    let Some((args, scales)) = kernel_args(weights, (n, k), group)? else {
        bail!("matmul_t_int4_tiled_into_rows: weights the kernel cannot read (int4_gemm_applies)");
    };
    let grid = (n.div_ceil(128) as u32, max_tiles as u32, 1);
    launch_int4_gemm(
        out,
        row0,
        x,
        (&args, scales),
        Some((offsets, tiles)),
        tile_rows,
        grid,
        n,
        k,
        group,
    )
}

/// The checks both int4 GEMM launches make of their tensors.
fn check_int4_gemm(
    out: &Tensor,
    row0: usize,
    x: &Tensor,
    weights: usize,
    total: usize,
    (n, k): (usize, usize),
    group: usize,
) -> Result<()> {
    let dtype = x.dtype();
    let (x_rows, x_k) = x.dims2()?;
    let (out_rows, out_n) = out.dims2()?;
    if x_k != k
        || x_rows != total
        || out_n != n
        || row0 + total > out_rows
        || out.dtype() != dtype
        || !out.is_contiguous()
        || !int4_gemm_takes((n, k), 4, group, dtype)
    {
        bail!(
            "int4 GEMM: x {:?} ({dtype:?}) for {weights} weights [{n}, {k}] g{group} of {total} \
             rows into rows {row0}.. of {:?}",
            x.dims(),
            out.dims()
        );
    }
    Ok(())
}

/// One launch of `matmul_t_int4_{stacked,tiled}[_wgmma]_m{tile_rows}_s{scales}` (tiled where
/// `plan` gives the GPU-made offsets and tiles; `args` then holds only the weights' addresses;
/// `scales`: their dtype; wgmma on a Hopper GPU unless [`int4_gemm_on_wgmma`] forbids it).
#[allow(clippy::too_many_arguments)]
fn launch_int4_gemm(
    out: &Tensor,
    row0: usize,
    x: &Tensor,
    (args, scales): (&[u64], DType),
    plan: Option<(&Tensor, &Tensor)>,
    tile_rows: usize,
    grid_dim: (u32, u32, u32),
    n: usize,
    k: usize,
    group: usize,
) -> Result<()> {
    let dtype = x.dtype();
    if !INT4_GEMM_TILE_ROWS.contains(&tile_rows) {
        bail!("int4 GEMM: {tile_rows} rows per tile");
    }
    let x = x.contiguous()?;
    let variant = if plan.is_some() { "tiled" } else { "stacked" };
    let scales = match scales {
        DType::F32 | DType::BF16 | DType::F16 => dtype_suffix(scales),
        other => bail!("int4 GEMM: {other:?} scales"),
    };
    let shared = int4_gemm_shared_bytes(tile_rows);
    with_float_type!(dtype, T => {
        if !device_address::<T>(&x)?.is_multiple_of(16) {
            bail!("int4 GEMM: x is not 16-byte aligned");
        }
        let y = device_address::<T>(out)? + (row0 * n * std::mem::size_of::<T>()) as u64;
        let plan = plan
            .map(|(offsets, tiles)| Ok::<_, candle_core::Error>((device_address::<i64>(offsets)?, device_address::<u32>(tiles)?)))
            .transpose()?;
        with_slice::<T, _>(&x, |xs, xo, dev| {
            let func = if WGMMA.load(Ordering::Relaxed) && INT4_GEMM_SM90.runs_on(dev)? {
                let name = format!("matmul_t_int4_{variant}_wgmma_m{tile_rows}_s{scales}");
                kernel(dev, &INT4_GEMM_SM90, &kernel_name(&name, dtype))?
            } else {
                let name = format!("matmul_t_int4_{variant}_m{tile_rows}_s{scales}");
                kernel(dev, &DEQUANT, &kernel_name(&name, dtype))?
            };
            func.allow_shared_bytes(shared)?;
            let args = dev.clone_htod(args)?;
            let xs = xs.slice(xo..);
            let (n32, k32, g32) = (n as i32, k as i32, group as i32);
            let mut b = func.builder();
            b.arg(&args);
            if let Some((offsets, tiles)) = &plan {
                b.arg(offsets).arg(tiles);
            }
            b.arg(&xs).arg(&y).arg(&n32).arg(&k32).arg(&g32);
            let config = LaunchConfig {
                grid_dim,
                block_dim: (256, 1, 1),
                shared_mem_bytes: shared as u32,
            };
            // SAFETY: arguments match `matmul_t_int4_{stacked,tiled}[_wgmma]_m*_s*`; the weights' shapes,
            // x's and out's were checked by check_int4_gemm, and `out` (contiguous, x's dtype)
            // holds rows row0..row0 + Σ rows of n values, which the kernel alone writes. A
            // tiled plan's offsets and tiles come from moe_plan (every row of every expert
            // once, the tiles within the grid). The weights and out outlive the launch (the
            // caller holds them; the stream orders any later free).
            unsafe { b.launch(config) }.w()?;
            Ok(())
        })
    })
}
