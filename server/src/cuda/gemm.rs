//! `out[rows] += x · wᵀ` in the GEMM itself, for a Linear whose output is added to the residual
//! stream: cuBLAS adds the product to what the rows hold in its epilogue (beta = 1), in f32, and
//! rounds the sum once; no output buffer and no separate pass over the stream. Row chunks of one
//! input fill one output this way. cuBLAS is called as candle's `x.matmul(&w.t())` calls it for
//! bf16/f16 (same operand order, leading dimensions, compute type and algorithm), beta aside.
//!
//! And [`matmul_t_f32`]: the f32 Linears through ExactScore's own GEMM kernel, whose summation
//! order does not depend on the shape (cuBLAS's does), so that f32 scores are batch-invariant.

use candle_core::cuda_backend::cudarc::cublas::{result::gemm_strided_batched_ex, sys, CudaBlas};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr,
};
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{
    gemm_reduced_precision_bf16, gemm_reduced_precision_f16, CudaStorageSlice, WrapErr,
};
use candle_core::{bail, CpuStorage, CudaStorage, DType, InplaceOp3, Layout, Result, Tensor};

use super::module::{kernel, GEMM};
use super::{kernel_name, with_slice, wrap};

/// `x · wᵀ` (`x`: `[m, k]`, `w`: `[n, k]` f32) in f32 with every output summed by fused
/// multiply-adds over k in order (`matmul_t_f32` in gemm.cu; its CPU reference is
/// [`crate::ops::gemm::matmul_t_sequential_fma`]): a row's result is the same bits whatever
/// other rows share the call. `x` in bf16 or f16 is read as the f32 values it holds (a router's
/// f32 logits of the hidden states): inside the narrow kernels, else cast first.
pub fn matmul_t_f32(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let m = x.dims().first().copied().unwrap_or(0);
    matmul_t_f32_tiled(x, w, narrow_tiling(m))
}

/// Rows and columns a thread of the narrow kernels makes (`matmul_t_f32_narrow{rows}x{cols}`:
/// blocks of 16 · rows x 16 · cols outputs), in the order tried.
pub const NARROW_TILINGS: [(usize, usize); 5] = [(4, 4), (2, 4), (2, 2), (1, 4), (1, 2)];

/// The narrow tiling for `m` rows of 64 outputs: the most outputs a thread that still give the
/// batch [`NARROW_MIN_BLOCKS`] blocks, or the fewest.
fn narrow_tiling(m: usize) -> (usize, usize) {
    let blocks = |(rows, cols): (usize, usize)| m.div_ceil(16 * rows) * (64 / (16 * cols));
    NARROW_TILINGS
        .into_iter()
        .find(|&tiling| blocks(tiling) >= NARROW_MIN_BLOCKS)
        .unwrap_or((1, 2))
}

/// Blocks below which a narrow tiling leaves SMs idle: about one per SM. On an H200, 64 experts
/// over hidden 2048 from bf16 rows (ms, 2048 / 16384 rows): 4x4 0.112 / 0.196, 2x4 0.079 / 0.258,
/// 2x2 0.055 / 0.304, 1x4 0.062 / 0.456, 1x2 0.072 / 0.554; at 64 blocks 2048 rows took 2x4.
const NARROW_MIN_BLOCKS: usize = 128;

/// [`matmul_t_f32`] with outputs at most 64 wide made by the narrow kernel of `tiling` (one of
/// [`NARROW_TILINGS`]): every tiling gives the same bits.
pub fn matmul_t_f32_tiled(x: &Tensor, w: &Tensor, tiling: (usize, usize)) -> Result<Tensor> {
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let (m, k) = x.dims2()?;
    let (n, w_k) = w.dims2()?;
    if w_k != k
        || !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
        || w.dtype() != DType::F32
        || !NARROW_TILINGS.contains(&tiling)
    {
        bail!(
            "matmul_t_f32: x {:?} {:?} and w {:?} {:?} (w f32, the same k), tiling {tiling:?}",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    if m == 0 || n == 0 {
        return Tensor::zeros((m, n), DType::F32, x.device());
    }
    // Tiles (rows, columns) per block of 256 threads: 128 x 128, or `tiling` for outputs at
    // most 64 wide (a router), which would leave most of a 128-wide tile idle. Every kernel
    // sums each output in the same order: the choice changes no bit.
    let narrow = n <= 64;
    if !narrow && x.dtype() != DType::F32 {
        return matmul_t_f32(&x.to_dtype(DType::F32)?, &w);
    }
    let (rows_per_thread, cols_per_thread) = tiling;
    let (tile_m, tile_n) = if narrow {
        (16 * rows_per_thread, 16 * cols_per_thread)
    } else {
        (128, 128)
    };
    with_float_type!(x.dtype(), T => with_slice::<T, _>(&x, |xs, xo, dev| {
        with_slice::<f32, _>(&w, |ws, wo, _| {
            // vector loads of 4: k and both start offsets multiples of 4 (aligned rows).
            let vec4 = k.is_multiple_of(4) && xo.is_multiple_of(4) && wo.is_multiple_of(4);
            let suffix = if vec4 { "_v4" } else { "" };
            let name = match narrow {
                false => format!("matmul_t_f32{suffix}"),
                true => kernel_name(
                    &format!("matmul_t_f32_narrow{rows_per_thread}x{cols_per_thread}{suffix}"),
                    x.dtype(),
                ),
            };
            let func = kernel(dev, &GEMM, &name)?;
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<f32>(m * n) }?;
            let (xs, ws) = (xs.slice(xo..), ws.slice(wo..));
            let (m32, n32, k32) = (m as i32, n as i32, k as i32);
            let mut b = func.builder();
            b.arg(&xs).arg(&ws).arg(&out).arg(&m32).arg(&n32).arg(&k32);
            let config = LaunchConfig {
                grid_dim: (n.div_ceil(tile_n) as u32, m.div_ceil(tile_m) as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: arguments match the `matmul_t_f32*` kernels (x's type in the narrow
            // ones' names); x holds m * k values, w n * k, out m * n.
            unsafe { b.launch(config) }.w()?;
            Ok(wrap(out, dev, (m, n)))
        })
    }))
}

/// Adds `x · wᵀ` (`x`: `[m, k]`, `w`: `[n, k]`, both contiguous, bf16 or f16) to rows
/// `row0..row0 + m` of `out` (`[rows, n]`, contiguous, same dtype), in place.
pub fn matmul_t_add_into_rows(out: &Tensor, row0: usize, x: &Tensor, w: &Tensor) -> Result<()> {
    out.inplace_op3(
        x,
        w,
        &MatmulTIntoRows {
            row0,
            accumulate: true,
        },
    )
}

/// Writes `x_i · w_iᵀ` for each of the `g` weights `w` (`[g, n, k]`) and their `m`-row blocks
/// of `x` (`[g · m, k]`) into rows `row0..row0 + g · m` of `out` (`[rows, n]`): one batched
/// GEMM, each block as candle's `x.matmul(&w.t())` computes it, straight into place.
pub fn matmul_t_stacked_into_rows(out: &Tensor, row0: usize, x: &Tensor, w: &Tensor) -> Result<()> {
    out.inplace_op3(
        x,
        w,
        &MatmulTIntoRows {
            row0,
            accumulate: false,
        },
    )
}

struct MatmulTIntoRows {
    row0: usize,
    /// Add to what the rows hold (beta = 1), else overwrite them (beta = 0).
    accumulate: bool,
}

impl InplaceOp3 for MatmulTIntoRows {
    fn name(&self) -> &'static str {
        "matmul-t-into-rows"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<()> {
        bail!("matmul_t_*_into_rows run on CUDA devices only")
    }

    fn cuda_fwd(
        &self,
        out: &mut CudaStorage,
        out_l: &Layout,
        x: &CudaStorage,
        x_l: &Layout,
        w: &CudaStorage,
        w_l: &Layout,
    ) -> Result<()> {
        let (x_rows, k) = x_l.shape().dims2()?;
        let (batch, n, w_k) = match *w_l.dims() {
            [n, k] => (1, n, k),
            [g, n, k] => (g, n, k),
            _ => bail!(
                "matmul_t_*_into_rows: w {:?} is not [n, k] or [g, n, k]",
                w_l.dims()
            ),
        };
        let (rows, out_n) = out_l.shape().dims2()?;
        let contiguous = [out_l, x_l, w_l].iter().all(|l| l.is_contiguous());
        let m = x_rows / batch.max(1);
        if w_k != k || out_n != n || m * batch != x_rows || self.row0 + x_rows > rows || !contiguous
        {
            bail!(
                "matmul_t_*_into_rows: x {:?} w {:?} into rows {}.. of {:?} (all contiguous)",
                x_l.dims(),
                w_l.dims(),
                self.row0,
                out_l.dims()
            );
        }
        let shape = Gemm {
            m,
            n,
            k,
            batch,
            beta: if self.accumulate { 1.0 } else { 0.0 },
            out_offset: out_l.start_offset() + self.row0 * n,
        };
        // Only candle's default (f32-accumulating) GEMM is mirrored.
        let reduced = match out.slice {
            CudaStorageSlice::BF16(_) => gemm_reduced_precision_bf16(),
            _ => gemm_reduced_precision_f16(),
        };
        if reduced {
            bail!("matmul_t_*_into_rows: reduced-precision bf16/f16 GEMMs are not mirrored");
        }
        // cuBLAS resolves candle's per-thread stream against the current context.
        out.device.cuda_stream().context().bind_to_thread().w()?;
        let blas = out.device.cublas_handle();
        let (x_o, w_o) = (x_l.start_offset(), w_l.start_offset());
        // SAFETY (both arms): the shapes were checked against the three buffers above.
        match (&mut out.slice, &x.slice, &w.slice) {
            (CudaStorageSlice::BF16(o), CudaStorageSlice::BF16(x), CudaStorageSlice::BF16(w)) => unsafe {
                shape.run(
                    &blas,
                    o,
                    x.slice(x_o..),
                    w.slice(w_o..),
                    sys::cudaDataType_t::CUDA_R_16BF,
                )
            },
            (CudaStorageSlice::F16(o), CudaStorageSlice::F16(x), CudaStorageSlice::F16(w)) => unsafe {
                shape.run(
                    &blas,
                    o,
                    x.slice(x_o..),
                    w.slice(w_o..),
                    sys::cudaDataType_t::CUDA_R_16F,
                )
            },
            _ => bail!("matmul_t_*_into_rows: bf16 or f16 operands of one dtype"),
        }
    }
}

struct Gemm {
    m: usize,
    n: usize,
    k: usize,
    /// Products: the i-th multiplies rows `i·m..` of x by weight i into rows `i·m..` of out.
    batch: usize,
    /// 1: add to `out`; 0: overwrite it.
    beta: f32,
    out_offset: usize,
}

impl Gemm {
    /// candle's call for `x.matmul(&w.t())` with `beta`: cuBLAS sees the column-major product
    /// `out[n, m] = op(w)[n, k] · x[k, m] + beta · out[n, m]` with `w` transposed, f32
    /// accumulation, `batch` times with strides of one block.
    ///
    /// # Safety
    /// `x` holds `batch * m * k` values, `w` `batch * n * k`, `out` `out_offset + batch * m * n`.
    unsafe fn run<T: DeviceRepr>(
        &self,
        blas: &CudaBlas,
        out: &mut CudaSlice<T>,
        x: CudaView<'_, T>,
        w: CudaView<'_, T>,
        data_type: sys::cudaDataType_t,
    ) -> Result<()> {
        let Self { m, n, k, batch, .. } = *self;
        let stream = out.stream().clone();
        let mut c = out.slice_mut(self.out_offset..self.out_offset + batch * m * n);
        let (a, _a) = w.device_ptr(&stream);
        let (b, _b) = x.device_ptr(&stream);
        let (c, _c) = c.device_ptr_mut(&stream);
        let (alpha, beta) = (1f32, self.beta);
        gemm_strided_batched_ex(
            *blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_T,
            sys::cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            m as i32,
            k as i32,
            (&alpha as *const f32).cast(),
            a as *const _,
            data_type,
            k as i32,
            (n * k) as i64,
            b as *const _,
            data_type,
            k as i32,
            (m * k) as i64,
            (&beta as *const f32).cast(),
            c as *mut _,
            data_type,
            n as i32,
            (m * n) as i64,
            batch as i32,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
        )
        .w()
    }
}
