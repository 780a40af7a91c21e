//! Launches of `server/kernels/attention.cu`: RoPE and flash attention on the projections'
//! token-major layout `[tokens, heads, head_dim]`, for a whole batch of sequences at once.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Device, Result, Tensor};

use super::module::{kernel, KernelModule, ATTENTION, ATTENTION_SM90};
use super::{grid_1d, kernel_name, rows_of_vectors, vector_kernel_name, with_slice, wrap};

/// Threads per block of `flash_attention_*` (attention.cu).
const THREADS: u32 = 128;

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
        match head_dim {
            64 => &[FlashTiling::DEFAULT],
            128 => D128,
            _ => &[],
        }
    }

    /// What the model runs for `head_dim` on `device`: the wgmma kernel where it is compiled
    /// and runs, else [`Self::DEFAULT`]. Both give the same bits (`exactscore-bench check`).
    pub fn for_device(head_dim: usize, device: &Device) -> Result<Self> {
        let wgmma = Self {
            mma: FlashMma::Wgmma,
            ..Self::DEFAULT
        };
        Ok(
            if Self::compiled(head_dim).contains(&wgmma) && wgmma.runs_on(device)? {
                wgmma
            } else {
                Self::DEFAULT
            },
        )
    }

    /// Whether this tiling's kernel runs on `device`: wgmma needs a Hopper GPU (sm_90) and a
    /// build that included sm_90.
    pub fn runs_on(self, device: &Device) -> Result<bool> {
        let Device::Cuda(dev) = device else {
            return Ok(false);
        };
        Ok(match self.mma {
            FlashMma::Sync => true,
            FlashMma::Wgmma => {
                ATTENTION_SM90.is_built()
                    && dev.cuda_stream().context().compute_capability().w()? == (9, 0)
            }
        })
    }

    /// The kernel's name (without the dtype suffix) and its module.
    fn kernel(self, head_dim: usize) -> (String, &'static KernelModule) {
        let (rows, keys) = (self.rows, self.keys);
        match self.mma {
            FlashMma::Sync => (
                format!("flash_attention_d{head_dim}_r{rows}_k{keys}"),
                &ATTENTION,
            ),
            FlashMma::Wgmma => (
                format!("flash_attention_wgmma_d{head_dim}_r{rows}_k{keys}"),
                &ATTENTION_SM90,
            ),
        }
    }

    /// Dynamic shared memory of one block. `Sync`: the Q tile and one K and one V tile, rows
    /// padded by 8 for a conflict-free `ldmatrix`. `Wgmma`: the Q tile and two K and two V
    /// tiles, swizzled instead of padded, plus room to align them to 1024 bytes.
    fn shared_bytes(self, head_dim: usize, elem: usize) -> usize {
        let (rows, keys) = (self.rows, self.keys);
        match self.mma {
            FlashMma::Sync => (rows + 2 * keys) * (head_dim + 8) * elem,
            FlashMma::Wgmma => (rows + 4 * keys) * head_dim * elem + 1024,
        }
    }
}

/// Whether [`flash_attention`] has a kernel for this head size and compute dtype.
pub fn flash_attention_supported(head_dim: usize, dtype: DType) -> bool {
    matches!(head_dim, 64 | 128) && matches!(dtype, DType::BF16 | DType::F16)
}

/// RoPE (`rotate_half` convention) of `x` `[tokens, heads, head_dim]`; `positions[token]` indexes
/// the `cos`/`sin` tables `[max_len, head_dim / 2]` (same dtype as `x`).
pub fn rope_rotate_half(
    x: &Tensor,
    positions: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let (tokens, heads, dim) = x.dims3()?;
    let half = dim / 2;
    // 16-byte vectors of 8 pairs when the halves and the tables' rows allow them.
    let per_thread = if rows_of_vectors(half, &[x, cos, sin]) {
        8
    } else {
        1
    };
    let groups = tokens * heads * half / per_thread;
    let name = vector_kernel_name("rope_rotate_half", per_thread == 8, x.dtype());
    with_float_type!(x.dtype(), T => with_slice::<T, _>(x, |xs, xo, dev| {
        with_slice::<i32, _>(positions, |ps, po, _| {
            with_slice::<T, _>(cos, |cs, co, _| {
                with_slice::<T, _>(sin, |ss, so, _| {
                    let func = kernel(dev, &ATTENTION, &name)?;
                    // SAFETY: the kernel writes every element.
                    let out = unsafe { dev.alloc::<T>(x.elem_count()) }?;
                    let (xs, ps, cs, ss) = (xs.slice(xo..), ps.slice(po..), cs.slice(co..), ss.slice(so..));
                    let (h32, half32, groups64) = (heads as i32, half as i32, groups as i64);
                    let mut b = func.builder();
                    b.arg(&xs).arg(&out).arg(&ps).arg(&cs).arg(&ss).arg(&h32).arg(&half32).arg(&groups64);
                    // SAFETY: arguments match `rope_rotate_half_*`.
                    unsafe { b.launch(grid_1d(groups)) }.w()?;
                    Ok(wrap(out, dev, (tokens, heads, dim)))
                })
            })
        })
    }))
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
    /// Scale `1 / sqrt(head_dim)`, no window, the default tiling.
    pub fn plain(head_dim: usize) -> Self {
        Self {
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
            tiling: FlashTiling::DEFAULT,
        }
    }
}

/// Causal softmax attention of `q` `[tokens, hq, d]` over `k`, `v` `[tokens, hkv, d]` for the
/// sequences whose token ranges are `starts[i]..starts[i + 1]` (i32, on the device); `max_len`
/// is the longest of them. Returns `[tokens, hq * d]` in the compute dtype. Scores and the
/// softmax state stay in f32 on chip; nothing of size T×T is written.
pub fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    starts: &Tensor,
    max_len: usize,
    opts: &FlashOptions,
) -> Result<Tensor> {
    let (tokens, hq, dim) = q.dims3()?;
    let (_, hkv, _) = k.dims3()?;
    if !flash_attention_supported(dim, q.dtype()) || hq % hkv != 0 || v.dims3()? != k.dims3()? {
        bail!(
            "flash attention: unsupported shapes q {:?} k {:?} v {:?} ({:?})",
            q.dims(),
            k.dims(),
            v.dims(),
            q.dtype()
        );
    }
    let tiling = opts.tiling;
    if !FlashTiling::compiled(dim).contains(&tiling) {
        bail!("flash attention: no kernel for {tiling:?} at head_dim {dim}");
    }
    let sequences = starts.elem_count() - 1;
    let (base, module) = tiling.kernel(dim);
    let name = kernel_name(&base, q.dtype());
    let shared = tiling.shared_bytes(dim, q.dtype().size_in_bytes());
    let config = LaunchConfig {
        // Heads fastest, so that the longest query blocks of all heads start first (flash.cuh).
        grid_dim: (
            hq as u32,
            max_len.div_ceil(tiling.rows) as u32,
            sequences as u32,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let (hq32, hkv32) = (hq as i32, hkv as i32);
    let scale_log2 = opts.scale * std::f32::consts::LOG2_E;
    let w32 = opts.window.map_or(0, |w| w as i32);
    with_float_type!(q.dtype(), T => with_slice::<T, _>(q, |qs, qo, dev| {
        with_slice::<T, _>(k, |ks, ko, _| {
            with_slice::<T, _>(v, |vs, vo, _| {
                with_slice::<i32, _>(starts, |ss, so, _| {
                    let func = kernel(dev, module, &name)?;
                    // Over 48 KiB of dynamic shared memory must be allowed explicitly.
                    func.allow_shared_bytes(shared)?;
                    // SAFETY: every row of every sequence is written by exactly one block.
                    let out = unsafe { dev.alloc::<T>(tokens * hq * dim) }?;
                    let (qs, ks, vs, ss) = (qs.slice(qo..), ks.slice(ko..), vs.slice(vo..), ss.slice(so..));
                    let mut b = func.builder();
                    b.arg(&qs).arg(&ks).arg(&vs).arg(&out).arg(&ss).arg(&hq32).arg(&hkv32).arg(&scale_log2).arg(&w32);
                    // SAFETY: arguments match `flash_attention_d*_r*_k*_*`.
                    unsafe { b.launch(config) }.w()?;
                    Ok(wrap(out, dev, (tokens, hq * dim)))
                })
            })
        })
    }))
}
