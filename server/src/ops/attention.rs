//! The attention family: causal softmax attention (materialized, with soft-capping and sliding
//! windows), and on a GPU flash attention over the projections' token-major layout (RoPE before
//! it: [`super::rope`]).

use candle_core::{DType, Device, Result, Tensor};

use super::gpu_only;

super::gpu_entry_points!(attention {
    /// `a · b` with cuBLAS f32 GEMMs on TF32 tensor cores.
    fn matmul_tf32(a: &Tensor, b: &Tensor) -> Result<Tensor>;
    fn causal_softmax(scores: &Tensor, scale: f32, window: Option<usize>, dtype: DType) -> Result<Tensor>;
    fn soft_cap(x: &Tensor, cap: f64) -> Result<Tensor>;
    /// `tile`: rows and keys per block, and whether the kernel is the wgmma one.
    fn flash_attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        starts: &Tensor,
        max_len: usize,
        scale: f32,
        window: Option<usize>,
        tile: (usize, usize, bool),
    ) -> Result<Tensor>;
    /// Whether a wgmma kernel was built and `device` runs it (a Hopper GPU).
    fn wgmma_runs_on(device: &Device) -> Result<bool>;
});

/// Causal softmax attention of one sequence: `q`, `k`, `v` `[1, heads, len, head_dim]` (k and v
/// already repeated to the query heads), scores scaled by `scale`, soft-capped as
/// `cap * tanh(s / cap)` when `softcap` is set, keys limited to a sliding `window` when set.
/// `sinks` (f32 `[heads]`, gpt-oss's attention sinks): one more logit per head that joins each
/// row's softmax denominator and is then dropped, so a row's weights sum to less than 1.
/// Returns `[1, heads, len, head_dim]` in `q`'s dtype.
///
/// GPU: scores in f32 (TF32 tensor cores for bf16/f16 inputs, exact there), then scale, mask
/// and softmax in one kernel, probabilities in the compute dtype for P·V. CPU: everything in
/// f32, rounded once at the end, in the query-row and head blocks of `blocks`: memory linear
/// in `len`, and every output the same bits whatever the blocks (see [`AttentionBlocks`]).
/// With sinks the GPU runs candle's ops (no kernel of ours has them): scores, mask and softmax
/// in f32 as on the CPU, one sequence at once.
#[allow(clippy::too_many_arguments)]
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    softcap: Option<f64>,
    sinks: Option<&Tensor>,
    window: Option<usize>,
    blocks: AttentionBlocks,
) -> Result<Tensor> {
    let dtype = q.dtype();
    if q.device().is_cuda() && sinks.is_some() {
        let (q, k, v) = (
            q.to_dtype(DType::F32)?,
            k.to_dtype(DType::F32)?,
            v.to_dtype(DType::F32)?,
        );
        let len = q.dims4()?.2;
        return attend_rows(&q, &k, &v, 0..len, scale, softcap, sinks, window)?.to_dtype(dtype);
    }
    if q.device().is_cuda() {
        let (q32, k32) = (q.to_dtype(DType::F32)?, k.to_dtype(DType::F32)?);
        let scores = if dtype == DType::F32 {
            q32.matmul(&k32.t()?)?
        } else {
            gpu::matmul_tf32(&q32, &k32.t()?)?
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
    let (_, heads, len, dim) = q.dims4()?;
    let (rows, group) = blocks.shape(heads, len, dim);
    let mut head_blocks = Vec::with_capacity(heads.div_ceil(group));
    for h0 in (0..heads).step_by(group) {
        let g = group.min(heads - h0);
        let (q, k, v) = (
            q.narrow(1, h0, g)?,
            k.narrow(1, h0, g)?,
            v.narrow(1, h0, g)?,
        );
        let mut row_blocks = Vec::with_capacity(len.div_ceil(rows));
        for start in (0..len).step_by(rows) {
            let end = len.min(start + rows);
            // A short last block takes earlier rows along (computed twice, kept once): fewer
            // rows than `min_block_rows` would take other GEMM kernels, other bits.
            let first = start.min(end.saturating_sub(blocks.min_rows(len, dim)));
            let q = q.narrow(2, first, end - first)?.contiguous()?;
            let sinks = sinks.map(|s| s.narrow(0, h0, g)).transpose()?;
            let out = attend_rows(
                &q,
                &k,
                &v,
                first..end,
                scale,
                softcap,
                sinks.as_ref(),
                window,
            )?;
            row_blocks.push(out.narrow(2, start - first, end - start)?);
        }
        head_blocks.push(Tensor::cat(&row_blocks, 2)?);
    }
    Tensor::cat(&head_blocks, 1)?.to_dtype(dtype)
}

/// The CPU attention of the query rows `rows` (`q`: `[1, heads, rows, head_dim]`, f32) over all
/// `len` keys of `k`, `v`; the keys after a row are masked, not cut, so that P·V sums over the
/// same depth, in the same blocks, as for the whole sequence.
#[allow(clippy::too_many_arguments)]
fn attend_rows(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    rows: std::ops::Range<usize>,
    scale: f64,
    softcap: Option<f64>,
    sinks: Option<&Tensor>,
    window: Option<usize>,
) -> Result<Tensor> {
    let mut scores = (q.matmul(&k.t()?)? * scale)?;
    if let Some(cap) = softcap {
        scores = soft_cap(&scores, cap)?;
    }
    let mask = causal_mask_rows(rows, k.dims()[2], window, q.device())?;
    // Each `[heads, rows, len]` tensor is freed once the next exists, so at most two are alive
    // (plus the mask): the peak `ActivationBytes::estimate` counts. Keeping `scores` alive
    // through the softmax made three (3469 MiB against 2195 estimated for 2 × 8192 tokens).
    let masked = scores.broadcast_add(&mask)?;
    drop((scores, mask));
    let probs = match sinks {
        None => candle_nn::ops::softmax_last_dim(&masked)?,
        // transformers' eager_attention_forward: the sink as a last column of the scores,
        // softmax, the column dropped.
        Some(sinks) => {
            let (b, heads, rows, len) = masked.dims4()?;
            let column = sinks
                .to_dtype(DType::F32)?
                .reshape((1, heads, 1, 1))?
                .broadcast_as((b, heads, rows, 1))?
                .contiguous()?;
            let with_sink = Tensor::cat(&[&masked, &column], 3)?;
            drop(masked);
            // two `[heads, rows, len]`-sized tensors alive at once, as without sinks
            let probs = candle_nn::ops::softmax_last_dim(&with_sink)?;
            drop(with_sink);
            probs.narrow(3, 0, len)?.contiguous()?
        }
    };
    probs.matmul(v)
}

/// How the CPU attention of one sequence is cut: blocks of query rows (all heads, or for very
/// long sequences a group of heads) whose `[heads, rows, len]` f32 scores hold about
/// `score_elements` floats, so that its memory grows linearly with the length. Each query
/// row's scores, softmax and P·V are the same operations on the same numbers in any block:
/// the CPU GEMM sums each output in an order that depends on its depth alone once a call has
/// [`super::gemm::cpu_rows`] rows (a block never has fewer), and the softmax works row by
/// row; so the blocks change no bit (`server/tests/long_context.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionBlocks {
    pub score_elements: usize,
}

impl Default for AttentionBlocks {
    /// 2^22 scores: 16 MiB of f32 per `[heads, rows, len]` tensor, under glibc's 32 MiB mmap
    /// threshold, so a block reuses the heap instead of faulting fresh pages in (2^24: 15 %
    /// more CPU time and 95 MiB more at 8192 tokens of the tiny fixture).
    fn default() -> Self {
        Self {
            score_elements: 1 << 22,
        }
    }
}

impl AttentionBlocks {
    /// (query rows, heads) per block for `heads` heads of `len` tokens of `head_dim`.
    pub fn shape(self, heads: usize, len: usize, head_dim: usize) -> (usize, usize) {
        let min_rows = self.min_rows(len, head_dim);
        let all_heads = self.score_elements / (heads * len).max(1);
        if all_heads >= min_rows {
            return (all_heads.min(len), heads);
        }
        let rows = (self.score_elements / len.max(1)).clamp(min_rows.min(len), len.max(1));
        let group = (self.score_elements / (rows * len).max(1)).clamp(1, heads.max(1));
        (rows, group)
    }

    /// The fewest query rows of a block of a `len`-token sequence: both products (scores:
    /// `len` outputs over depth `head_dim`; P·V: `head_dim` outputs over depth `len`) take the
    /// CPU GEMM's general kernel.
    pub fn min_rows(self, len: usize, head_dim: usize) -> usize {
        super::gemm::cpu_rows(len, head_dim).max(super::gemm::cpu_rows(head_dim, len))
    }

    /// The f32 elements of the largest `[heads, rows, len]` tensor of a block.
    pub fn block_elements(self, heads: usize, len: usize, head_dim: usize) -> usize {
        let (rows, group) = self.shape(heads, len, head_dim);
        rows * group * len
    }
}

/// `[len, len]` additive mask: 0 where key j is visible from query i, -inf elsewhere.
pub fn causal_mask(len: usize, window: Option<usize>, device: &Device) -> Result<Tensor> {
    causal_mask_rows(0..len, len, window, device)
}

/// The rows `rows` of [`causal_mask`] of a `len`-token sequence: `[rows, len]`.
pub fn causal_mask_rows(
    rows: std::ops::Range<usize>,
    len: usize,
    window: Option<usize>,
    device: &Device,
) -> Result<Tensor> {
    let window = window.unwrap_or(usize::MAX);
    let count = rows.len();
    // Row i sees keys i + 1 - min(window, i + 1) ..= i. Filled in runs: a long sequence's mask
    // rows are most of what the attention writes besides its scores.
    let mut mask = Vec::with_capacity(count * len);
    for i in rows {
        let seen = window.min(i + 1);
        mask.resize(mask.len() + i + 1 - seen, f32::NEG_INFINITY);
        mask.resize(mask.len() + seen, 0.0);
        mask.resize(mask.len() + len - i - 1, f32::NEG_INFINITY);
    }
    Tensor::from_vec(mask, (count, len), device)
}

/// `cap * tanh(x / cap)` (Gemma's soft-capping), in `x`'s dtype.
pub fn soft_cap(x: &Tensor, cap: f64) -> Result<Tensor> {
    if x.device().is_cuda() {
        // one pass instead of three over a logits chunk (Gemma 4: 4 % of a window's time)
        return gpu::soft_cap(x, cap);
    }
    soft_cap_composed(x, cap)
}

/// [`soft_cap`] as candle's three ops (the CPU's, and the GPU kernel's reference in `check`).
pub fn soft_cap_composed(x: &Tensor, cap: f64) -> Result<Tensor> {
    (x / cap)?.tanh()? * cap
}

/// Whether the fused flash-attention kernel exists for this device, head size and dtype.
/// The smallest head size the flash kernel is compiled for that holds `dim` features: a head
/// zero-padded to it attends as the unpadded head would (each dot product gains exact zeros, and
/// the output gains zero columns).
pub fn flash_head_dim_holding(dim: usize) -> Option<usize> {
    (dim.max(1)..=FLASH_MAX_HEAD_DIM).find(|&d| !FlashTiling::compiled(d).is_empty())
}

/// The largest head size any flash tiling is compiled for.
const FLASH_MAX_HEAD_DIM: usize = 256;

pub fn flash_attention_available(device: &Device, head_dim: usize, dtype: DType) -> bool {
    device.is_cuda() && flash_attention_supported(head_dim, dtype)
}

/// Causal attention of a whole batch in the projections' `[tokens, heads, head_dim]` layout
/// (see `cuda::attention::flash_attention`): a GPU kernel only; `Model::set_attention` refuses it
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
    let (dim, tiling) = (q.dims3()?.2, opts.tiling);
    if !flash_attention_supported(dim, q.dtype()) {
        candle_core::bail!(
            "flash attention: no kernel for head_dim {dim} in {:?}",
            q.dtype()
        );
    }
    if !FlashTiling::compiled(dim).contains(&tiling) {
        candle_core::bail!("flash attention: no kernel for {tiling:?} at head_dim {dim}");
    }
    let wgmma = tiling.mma == FlashMma::Wgmma;
    let tile = (tiling.rows, tiling.keys, wgmma);
    gpu::flash_attention(q, k, v, starts, max_len, opts.scale, opts.window, tile)
}

/// Whether [`flash_attention`] has a kernel for this head size and compute dtype.
pub fn flash_attention_supported(head_dim: usize, dtype: DType) -> bool {
    !FlashTiling::compiled(head_dim).is_empty() && matches!(dtype, DType::BF16 | DType::F16)
}

/// The tensor-core instructions of a flash kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashMma {
    /// `mma.sync` (attention.cu): every architecture from sm_80.
    Sync,
    /// Hopper's warpgroup MMA (attention_sm90.cu): sm_90 only, head_dim 128, 128 x 64, two
    /// K/V buffers.
    Wgmma,
}

/// How the flash kernel tiles the work: query rows per block (64 per 16-row MMA tile of each of
/// its 4 warps) and keys per step of the online softmax, and its MMA instructions. Every tiling
/// gives a row the same arithmetic in the same order except for where the key steps fall (the
/// two MMA kinds accumulate in the same order: `exactscore-bench check` compares their bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlashTiling {
    pub rows: usize,
    pub keys: usize,
    pub mma: FlashMma,
}

impl FlashTiling {
    /// What the model runs: two MMA row tiles per warp (each K/V fragment feeds two MMAs).
    pub const DEFAULT: Self = Self {
        rows: 128,
        keys: 64,
        mma: FlashMma::Sync,
    };

    /// The tilings compiled for head size `head_dim` (attention.cu's `FLASH_ENTRIES`,
    /// attention_sm90.cu's `WG_ENTRY`).
    pub fn compiled(head_dim: usize) -> &'static [FlashTiling] {
        // 64 x 64 (one MMA row tile per warp) for comparison: 13 % slower on an H100 at 4
        // windows of Llama-3-8B (and 128 x 32 7 %, no longer built); docs/performance.md.
        const D128: &[FlashTiling] = &[
            FlashTiling::DEFAULT,
            FlashTiling {
                rows: 64,
                ..FlashTiling::DEFAULT
            },
            FlashTiling {
                mma: FlashMma::Wgmma,
                ..FlashTiling::DEFAULT
            },
        ];
        // Head sizes of 192 (MLA's nope + rope keys) and 256 (Qwen3.5, Gemma, GLM-4.7-Flash's
        // MLA): one MMA row tile per warp, as two would hold 2 x 256 / 2 accumulators per
        // thread at 256; the wgmma kernel likewise (one 64-row tile).
        const WIDE: FlashTiling = FlashTiling {
            rows: 64,
            ..FlashTiling::DEFAULT
        };
        const WIDE_TILINGS: &[FlashTiling] = &[
            WIDE,
            FlashTiling {
                mma: FlashMma::Wgmma,
                ..WIDE
            },
        ];
        match head_dim {
            64 => &[FlashTiling::DEFAULT],
            128 => D128,
            192 | 256 => WIDE_TILINGS,
            _ => &[],
        }
    }

    /// The mma.sync tiling the model runs for `head_dim` (the first compiled).
    pub fn sync_for(head_dim: usize) -> Self {
        Self::compiled(head_dim)
            .first()
            .copied()
            .unwrap_or(Self::DEFAULT)
    }

    /// What the model runs for `head_dim` on `device`: the wgmma kernel where it is compiled
    /// and runs, else [`Self::sync_for`]. Both give the same bits (`exactscore-bench check`).
    pub fn for_device(head_dim: usize, device: &Device) -> Result<Self> {
        for &tiling in Self::compiled(head_dim) {
            if tiling.mma == FlashMma::Wgmma && tiling.runs_on(device)? {
                return Ok(tiling);
            }
        }
        Ok(Self::sync_for(head_dim))
    }

    /// Whether this tiling's kernel runs on `device`: wgmma needs a Hopper GPU (sm_90) and a
    /// build that included sm_90.
    pub fn runs_on(self, device: &Device) -> Result<bool> {
        if !device.is_cuda() {
            return Ok(false);
        }
        Ok(match self.mma {
            FlashMma::Sync => true,
            FlashMma::Wgmma => gpu::wgmma_runs_on(device)?,
        })
    }
}

/// How [`flash_attention`] runs.
#[derive(Debug, Clone, Copy)]
pub struct FlashOptions {
    /// Softmax scale (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// Sliding window: a query sees at most this many keys (itself included).
    pub window: Option<usize>,
    pub tiling: FlashTiling,
}

impl FlashOptions {
    /// Scale `1 / sqrt(head_dim)`, no window, the head size's mma.sync tiling.
    pub fn plain(head_dim: usize) -> Self {
        Self {
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
            tiling: FlashTiling::sync_for(head_dim),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks of any size give the unblocked path's bits, for lengths on both sides of the
    /// GEMM's small-kernel thresholds and of its 512-deep blocks, with a window and soft-capping.
    #[test]
    fn the_blocks_change_no_bit() -> Result<()> {
        let dev = &Device::Cpu;
        let whole = AttentionBlocks {
            score_elements: usize::MAX,
        };
        for (heads, len, dim, window, softcap) in [
            (4, 1, 16, None, None),
            (4, 70, 16, None, None),
            (3, 300, 64, Some(50), None),
            (2, 1100, 16, None, Some(30.0)),
            (4, 1300, 64, Some(700), None),
        ] {
            let q = Tensor::randn(0f32, 1.0, (1, heads, len, dim), dev)?;
            let k = Tensor::randn(0f32, 1.0, (1, heads, len, dim), dev)?;
            let v = Tensor::randn(0f32, 1.0, (1, heads, len, dim), dev)?;
            let scale = 1.0 / (dim as f64).sqrt();
            // gpt-oss's sinks where there is no soft-cap (no architecture has both)
            let sinks = Tensor::randn(0f32, 1.0, heads, dev)?;
            let sinks = softcap.is_none().then_some(&sinks);
            let attend =
                |blocks| causal_attention(&q, &k, &v, scale, softcap, sinks, window, blocks);
            let want = attend(whole)?.flatten_all()?.to_vec1::<f32>()?;
            let mut shapes = Vec::new();
            for elements in [1, 65 * len, 100 * len, 2 * 100 * len, heads * 97 * len] {
                let blocks = AttentionBlocks {
                    score_elements: elements,
                };
                shapes.push(blocks.shape(heads, len, dim));
                let got = attend(blocks)?.flatten_all()?.to_vec1::<f32>()?;
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "heads {heads} len {len} blocks {:?}", shapes.last());
            }
            if len > 300 {
                // rows and head groups both cut
                assert!(
                    shapes.iter().any(|&(r, g)| r < len && g < heads),
                    "{shapes:?}"
                );
            }
        }
        Ok(())
    }

    /// A sink is one more logit in each row's softmax, then dropped: with equal scores and
    /// values of 1, row i (i + 1 keys seen) outputs (i + 1) / (i + 1 + e^sink).
    #[test]
    fn sinks_join_the_denominator_and_are_dropped() -> Result<()> {
        let dev = &Device::Cpu;
        let (heads, len, dim) = (2, 9, 4);
        let zeros = Tensor::zeros((1, heads, len, dim), DType::F32, dev)?;
        let ones = Tensor::ones((1, heads, len, dim), DType::F32, dev)?;
        let sinks = Tensor::new(&[0.5f32, -2.0], dev)?;
        let blocks = AttentionBlocks::default();
        for window in [None, Some(3)] {
            let got = causal_attention(
                &zeros,
                &zeros,
                &ones,
                1.0,
                None,
                Some(&sinks),
                window,
                blocks,
            )?
            .squeeze(0)?
            .to_vec3::<f32>()?;
            for (h, s) in [0.5f64, -2.0].into_iter().enumerate() {
                for (i, row) in got[h].iter().enumerate() {
                    let seen = window.unwrap_or(usize::MAX).min(i + 1) as f64;
                    let want = seen / (seen + s.exp());
                    for &x in row {
                        assert!((x as f64 - want).abs() < 1e-6, "h {h} i {i}: {x} vs {want}");
                    }
                }
            }
        }
        Ok(())
    }

    /// The mask rows are the definition: 0 where `j <= i` and `i - j < window`, else -inf.
    #[test]
    fn mask_rows_follow_the_definition() -> Result<()> {
        for (len, window, rows) in [(1, None, 0..1), (9, None, 3..9), (12, Some(4), 0..12)] {
            let got = causal_mask_rows(rows.clone(), len, window, &Device::Cpu)?;
            let got = got.to_vec2::<f32>()?;
            for (r, i) in rows.enumerate() {
                for (j, &value) in got[r].iter().enumerate() {
                    let visible = j <= i && i - j < window.unwrap_or(usize::MAX);
                    let want = if visible { 0.0 } else { f32::NEG_INFINITY };
                    assert_eq!(value, want, "len {len} window {window:?} ({i}, {j})");
                }
            }
        }
        Ok(())
    }

    /// The fewest rows of a block follow the GEMM's kernel thresholds.
    #[test]
    fn block_rows_follow_the_gemm_thresholds() {
        let blocks = AttentionBlocks {
            score_elements: 4 * 100 * 201,
        };
        assert_eq!(blocks.shape(4, 201, 64), (100, 4));
        // P·V over more than 512 keys into 64 outputs: the 512-deep small kernel below 65 rows
        assert_eq!(blocks.min_rows(201, 64), 5);
        assert_eq!(blocks.min_rows(1000, 64), 65);
        assert_eq!(blocks.min_rows(10, 64), 26);
        let tight = AttentionBlocks { score_elements: 1 };
        assert_eq!(tight.shape(4, 1000, 64), (65, 1));
    }
}
