//! The attention family: causal softmax attention (materialized, with soft-capping and sliding
//! windows), and on a GPU RoPE and flash attention over the projections' token-major layout.

use candle_core::{DType, Device, Result, Tensor};

use super::gpu_only;

super::gpu_entry_points!(attention {
    /// `a · b` with cuBLAS f32 GEMMs on TF32 tensor cores.
    fn matmul_tf32(a: &Tensor, b: &Tensor) -> Result<Tensor>;
    fn causal_softmax(scores: &Tensor, scale: f32, window: Option<usize>, dtype: DType) -> Result<Tensor>;
    fn rope_rotate_half(x: &Tensor, positions: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor>;
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
    let mut scores = (q.matmul(&k.t()?)? * scale)?;
    if let Some(cap) = softcap {
        scores = soft_cap(&scores, cap)?;
    }
    let mask = causal_mask(q.dims()[2], window, q.device())?;
    // Each `[heads, T, T]` tensor is freed once the next exists, so at most two are alive
    // (plus the mask): the peak `ActivationBytes::estimate` counts. Keeping `scores` alive
    // through the softmax made three (3469 MiB against 2195 estimated for 2 × 8192 tokens).
    let masked = scores.broadcast_add(&mask)?;
    drop((scores, mask));
    let probs = candle_nn::ops::softmax_last_dim(&masked)?;
    drop(masked);
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
    device.is_cuda() && flash_attention_supported(head_dim, dtype)
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
        // Head sizes of 192 (MLA's nope + rope keys) and 256 (Qwen3.5, Gemma): one MMA row
        // tile per warp, as two would hold 2 x 256 / 2 accumulators per thread at 256.
        const WIDE: &[FlashTiling] = &[FlashTiling {
            rows: 64,
            ..FlashTiling::DEFAULT
        }];
        match head_dim {
            64 => &[FlashTiling::DEFAULT],
            128 => D128,
            192 | 256 => WIDE,
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
        let wgmma = Self {
            mma: FlashMma::Wgmma,
            ..Self::DEFAULT
        };
        Ok(
            if Self::compiled(head_dim).contains(&wgmma) && wgmma.runs_on(device)? {
                wgmma
            } else {
                Self::sync_for(head_dim)
            },
        )
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
