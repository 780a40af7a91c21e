//! The fp8 tensor-core GEMM (`ops/fp8_gemm.rs`): the row quantization kernels
//! (kernels/fp8_gemm.cu) and cuBLASLt's fp8 GEMM with outer-vector scales, `out[i, j] =
//! round(x_scale[i] · w_scale[j] · Σ_k x[i, k] · w[j, k] (+ out[i, j]))` with f32 sums, or
//! with block scales (Hopper), `round(Σ_b x_scale[b, i] · w_scale[j / 128, b] · Σ_{k in b}
//! x[i, k] · w[j, k] (+ out[i, j]))` over the blocks b of 128 inputs.
//!
//! The algorithm is chosen once per weight shape, output dtype, scaling and accumulation, for a
//! fixed number of rows ([`CANONICAL_ROWS`]) and among those that do not split k, and then used
//! for every call: the kernel, and so each row's summation order, does not follow the batch.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys as lt_sys};
use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{bail, DType, Device, Result, Tensor};

use super::module::{kernel, FP8_GEMM};
use super::{device_address, kernel_name, with_slice, wrap};

/// Rows of the problem the algorithm is chosen for (four windows of 2048).
const CANONICAL_ROWS: u64 = 8192;
/// With block scales, the rows of a problem are a multiple of this.
const BLOCK_ROWS: usize = 4;

/// cuBLASLt's workspace (its recommendation for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// Whether `device` has fp8 tensor cores that cuBLASLt's fp8 GEMM drives (compute capability
/// 8.9: Ada, 9.0: Hopper, and newer).
pub fn fp8_gemm_supported(device: &Device) -> Result<bool> {
    let Device::Cuda(dev) = device else {
        return Ok(false);
    };
    let ctx = dev.cuda_stream().context().clone();
    let major = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .w()?;
    let minor = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        .w()?;
    Ok(major * 10 + minor >= 89)
}

/// e4m3 codes (`[m, k]`, u8) and one f32 scale per row of `x` (`[m, k]`, bf16/f16, k a
/// multiple of 8): per token (absmax / 448) or `static_scale`.
pub fn quantize_fp8_rows(x: &Tensor, static_scale: Option<f32>) -> Result<(Tensor, Tensor)> {
    let x = x.contiguous()?;
    let (m, k) = x.dims2()?;
    if !k.is_multiple_of(8) || !x.layout().start_offset().is_multiple_of(8) {
        bail!("quantize_fp8_rows: k = {k} and the start offset must be multiples of 8");
    }
    if x.dtype() == DType::F32 {
        bail!("quantize_fp8_rows: bf16 or f16 rows, not f32");
    }
    with_float_type!(x.dtype(), T => with_slice::<T, _>(&x, |xs, xo, dev| {
        let func = kernel(dev, &FP8_GEMM, &kernel_name("quantize_fp8_rows", x.dtype()))?;
        let stream = dev.cuda_stream();
        // SAFETY: the kernel writes every code and every scale.
        let codes = unsafe { stream.alloc::<u8>(m * k) }.w()?;
        let scales = unsafe { stream.alloc::<f32>(m) }.w()?;
        if m > 0 {
            let xs = xs.slice(xo..);
            let (m32, k32, s) = (m as i32, k as i32, static_scale.unwrap_or(0.0));
            let mut b = func.builder();
            b.arg(&xs).arg(&codes).arg(&scales).arg(&m32).arg(&k32).arg(&s);
            // a warp per row, eight rows per block
            let config = LaunchConfig {
                grid_dim: (m.div_ceil(8) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: x holds m rows of k values, codes m * k bytes, scales m floats.
            unsafe { b.launch(config) }.w()?;
        }
        Ok((wrap(codes, dev, (m, k)), wrap(scales, dev, m)))
    }))
}

/// e4m3 codes (`[m, k]`, u8) and f32 scales `[k / 128, m]` of `x` (`[m, k]`, bf16/f16, k a
/// multiple of 128): one scale per row and 128 values, max(absmax, 1e-10) / 448, rounded up to
/// a power of two where `power_of_two`.
pub fn quantize_fp8_row_groups(x: &Tensor, power_of_two: bool) -> Result<(Tensor, Tensor)> {
    let x = x.contiguous()?;
    let (m, k) = x.dims2()?;
    if !k.is_multiple_of(128) || !x.layout().start_offset().is_multiple_of(8) {
        bail!("quantize_fp8_row_groups: k = {k} must be a multiple of 128, the start offset of 8");
    }
    if x.dtype() == DType::F32 {
        bail!("quantize_fp8_row_groups: bf16 or f16 rows, not f32");
    }
    let halves = m * (k / 128);
    with_float_type!(x.dtype(), T => with_slice::<T, _>(&x, |xs, xo, dev| {
        let name = kernel_name("quantize_fp8_row_groups", x.dtype());
        let func = kernel(dev, &FP8_GEMM, &name)?;
        let stream = dev.cuda_stream();
        // SAFETY: the kernel writes every code and every scale.
        let codes = unsafe { stream.alloc::<u8>(m * k) }.w()?;
        let scales = unsafe { stream.alloc::<f32>(halves) }.w()?;
        if m > 0 {
            let xs = xs.slice(xo..);
            let (m32, k32, pow2) = (m as i32, k as i32, i32::from(power_of_two));
            let mut b = func.builder();
            b.arg(&xs).arg(&codes).arg(&scales).arg(&m32).arg(&k32).arg(&pow2);
            // half a warp per group of 128, sixteen groups per block of 256
            let config = LaunchConfig {
                grid_dim: (halves.div_ceil(16) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: x holds m rows of k values, codes m * k bytes, scales m * k / 128 floats.
            unsafe { b.launch(config) }.w()?;
        }
        Ok((wrap(codes, dev, (m, k)), wrap(scales, dev, (k / 128, m))))
    }))
}

/// `x · wᵀ` with the scales applied, as a new `[m, n]` tensor in `dtype` (bf16/f16).
pub fn fp8_matmul_t(
    x_codes: &Tensor,
    x_scales: &Tensor,
    w_codes: &Tensor,
    w_scales: &Tensor,
    dtype: DType,
    fast_accum: bool,
) -> Result<Tensor> {
    let (m, _) = x_codes.dims2()?;
    let (n, _) = w_codes.dims2()?;
    let Device::Cuda(dev) = x_codes.device() else {
        bail!("fp8_matmul_t: the codes are not on a CUDA device");
    };
    let out = with_float_type!(dtype, T => {
        // SAFETY: the GEMM below writes every element (beta = 0).
        let slice = unsafe { dev.cuda_stream().alloc::<T>(m * n) }.w()?;
        wrap(slice, dev, (m, n))
    });
    fp8_matmul_t_into_rows(
        &out, 0, x_codes, x_scales, w_codes, w_scales, false, fast_accum,
    )?;
    Ok(out)
}

/// [`fp8_matmul_t`] written into rows `row0..row0 + m` of `out` (`[rows, n]`, contiguous,
/// bf16/f16), added to what they hold where `accumulate` (one rounding of the sum). The scales
/// are per row and column (`[m]`, `[n]`) or per block (`[k / 128, m]` and the weight's
/// `[n / 128, k / 128 padded to a multiple of 4]`, k and n multiples of 128; row counts that
/// are no multiple of 4 run padded; summed in f32 whatever `fast_accum` says).
#[allow(clippy::too_many_arguments)]
pub fn fp8_matmul_t_into_rows(
    out: &Tensor,
    row0: usize,
    x_codes: &Tensor,
    x_scales: &Tensor,
    w_codes: &Tensor,
    w_scales: &Tensor,
    accumulate: bool,
    fast_accum: bool,
) -> Result<()> {
    let (m, k) = x_codes.dims2()?;
    // Block scales: cuBLASLt takes a multiple of 4 rows (each group's row scales 16-byte
    // aligned). Other chunks run padded with zero rows on a copy of their output rows: a row's
    // sums and its one rounding do not depend on the rows beside it.
    if x_scales.rank() == 2 && !m.is_multiple_of(BLOCK_ROWS) && out.dim(0)? >= row0 + m {
        let pad = m.next_multiple_of(BLOCK_ROWS) - m;
        let groups = x_scales.dim(0)?;
        let dev = x_codes.device();
        let codes = Tensor::cat(&[x_codes, &Tensor::zeros((pad, k), DType::U8, dev)?], 0)?;
        let scales = Tensor::cat(
            &[x_scales, &Tensor::zeros((groups, pad), DType::F32, dev)?],
            1,
        )?;
        let rows = out.narrow(0, row0, m)?;
        let padded = Tensor::cat(
            &[
                &rows,
                &Tensor::zeros((pad, rows.dim(1)?), out.dtype(), dev)?,
            ],
            0,
        )?;
        fp8_matmul_t_into_rows(
            &padded, 0, &codes, &scales, w_codes, w_scales, accumulate, fast_accum,
        )?;
        return out.slice_set(&padded.narrow(0, 0, m)?, 0, row0);
    }
    let (n, w_k) = w_codes.dims2()?;
    let (rows, out_n) = out.dims2()?;
    let contiguous = [out, x_codes, x_scales, w_codes, w_scales]
        .iter()
        .all(|t| t.is_contiguous());
    // cuBLASLt takes 16-byte aligned operands and scale vectors.
    let aligned = [x_codes, w_codes]
        .iter()
        .all(|t| t.layout().start_offset().is_multiple_of(16))
        && [x_scales, w_scales]
            .iter()
            .all(|t| t.layout().start_offset().is_multiple_of(4))
        && (out.layout().start_offset() + row0 * n).is_multiple_of(8);
    let scaling = if x_scales.dims() == [m] && w_scales.dims() == [n] {
        Some(Scaling::PerRowAndColumn)
    } else if x_scales.dims() == [k / 128, m]
        // rows of weight scales padded to 16 bytes (ops::fp8_block_scales_for_gemm)
        && w_scales.dims() == [n / 128, (k / 128).next_multiple_of(4)]
        && k.is_multiple_of(128)
        && n.is_multiple_of(128)
        && m.is_multiple_of(BLOCK_ROWS)
    {
        Some(Scaling::Blocks)
    } else {
        None
    };
    if w_k != k
        || out_n != n
        || row0 + m > rows
        || scaling.is_none()
        || !contiguous
        || !aligned
        || !k.is_multiple_of(16)
        || [x_codes, w_codes].iter().any(|t| t.dtype() != DType::U8)
        || [x_scales, w_scales].iter().any(|t| t.dtype() != DType::F32)
    {
        bail!(
            "fp8_matmul_t: x {:?} (scales {:?}) and w {:?} (scales {:?}) into rows {row0}.. of \
             {:?} (u8 codes, f32 scales per row and column or per block, contiguous and 16-byte \
             aligned, k a multiple of 16)",
            x_codes.dims(),
            x_scales.dims(),
            w_codes.dims(),
            w_scales.dims(),
            out.dims()
        );
    }
    if m == 0 {
        return Ok(());
    }
    let d_type = match out.dtype() {
        DType::BF16 => lt_sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => lt_sys::cudaDataType::CUDA_R_16F,
        other => bail!("fp8_matmul_t: a bf16 or f16 output, not {other:?}"),
    };
    let Device::Cuda(dev) = out.device() else {
        bail!("fp8_matmul_t: the output is not on a CUDA device");
    };
    let elem = out.dtype().size_in_bytes() as u64;
    let out_at = device_address_any(out)? + (row0 * n) as u64 * elem;
    let problem = Problem {
        m: m as u64,
        n: n as u64,
        k: k as u64,
        d_type,
        beta: if accumulate { 1.0 } else { 0.0 },
        scaling: scaling.unwrap_or(Scaling::PerRowAndColumn),
        fast_accum,
    };
    // SAFETY: every address holds what `problem` says (shapes checked above).
    unsafe {
        problem.run(
            dev,
            Operands {
                w: device_address::<u8>(w_codes)?,
                x: device_address::<u8>(x_codes)?,
                w_scales: device_address::<f32>(w_scales)?,
                x_scales: device_address::<f32>(x_scales)?,
                out: out_at,
            },
        )
    }
}

/// The device address of a contiguous bf16/f16 tensor's first element.
fn device_address_any(t: &Tensor) -> Result<u64> {
    match t.dtype() {
        DType::BF16 => device_address::<half::bf16>(t),
        _ => device_address::<half::f16>(t),
    }
}

struct Operands {
    w: u64,
    x: u64,
    w_scales: u64,
    x_scales: u64,
    out: u64,
}

/// One GEMM in cuBLASLt's column-major terms: `out[n, m] = op(w)[n, k] · x[k, m]` with `w`
/// transposed (the "TN" layout fp8 needs: both operands k-major).
struct Problem {
    m: u64,
    n: u64,
    k: u64,
    d_type: lt_sys::cudaDataType,
    beta: f32,
    scaling: Scaling,
    /// Hopper's fast fp8 accumulation (`CUBLASLT_MATMUL_DESC_FAST_ACCUM`); else the partial
    /// sums are promoted to f32.
    fast_accum: bool,
}

/// Where the scales apply.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Scaling {
    /// One per row of `x` and one per row of `w` (`OUTER_VEC_32F`).
    PerRowAndColumn,
    /// One per row of `x` and 128 inputs (`VEC128_32F`), one per 128 × 128 block of `w`
    /// (`BLK128x128_32F`).
    Blocks,
}

/// The values of `CUBLASLT_MATMUL_DESC_TRANSA/B` (a `cublasOperation_t`, an int32).
const CUBLAS_OP_N: i32 = 0;
const CUBLAS_OP_T: i32 = 1;

/// cuBLASLt's errors as candle's.
trait LtResult<T> {
    fn lt(self) -> Result<T>;
}

impl<T> LtResult<T> for std::result::Result<T, lt::CublasError> {
    fn lt(self) -> Result<T> {
        self.map_err(|e| candle_core::Error::msg(format!("cuBLASLt: {e:?}")))
    }
}

/// cuBLASLt objects freed when dropped.
struct Desc(lt_sys::cublasLtMatmulDesc_t);
struct Layouts(Vec<lt_sys::cublasLtMatrixLayout_t>);
struct Pref(lt_sys::cublasLtMatmulPreference_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by `Problem::desc`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}

impl Drop for Layouts {
    fn drop(&mut self) {
        for &layout in &self.0 {
            // SAFETY: created by `Problem::layouts`, destroyed once.
            let _ = unsafe { lt::destroy_matrix_layout(layout) };
        }
    }
}

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created in `Problem::algorithm`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

/// # Safety
/// `value` is of the type cuBLASLt documents for `attr`.
unsafe fn set_desc<T>(
    desc: &Desc,
    attr: lt_sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<()> {
    lt::set_matmul_desc_attribute(
        desc.0,
        attr,
        (value as *const T).cast(),
        std::mem::size_of::<T>(),
    )
    .lt()
}

impl Problem {
    /// The descriptor: f32 compute and scales, `w` transposed, the scale modes of
    /// `self.scaling`, fast accumulation or not (never with block scales: their sums are f32).
    fn desc(&self, w_scales: u64, x_scales: u64) -> Result<Desc> {
        use lt_sys::cublasLtMatmulDescAttributes_t as A;
        let desc = Desc(
            lt::create_matmul_desc(
                lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt_sys::cudaDataType::CUDA_R_32F,
            )
            .lt()?,
        );
        use lt_sys::cublasLtMatmulMatrixScale_t as S;
        let (w_mode, x_mode) = match self.scaling {
            Scaling::PerRowAndColumn => (
                S::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F,
                S::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F,
            ),
            Scaling::Blocks => (
                S::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                S::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
            ),
        };
        let fast_accum = self.fast_accum && self.scaling == Scaling::PerRowAndColumn;
        // SAFETY: each value has the attribute's documented type.
        unsafe {
            set_desc(&desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &CUBLAS_OP_T)?;
            set_desc(&desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &CUBLAS_OP_N)?;
            set_desc(&desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &w_mode)?;
            set_desc(&desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &x_mode)?;
            set_desc(
                &desc,
                A::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                &i8::from(fast_accum),
            )?;
            set_desc(&desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scales)?;
            set_desc(&desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scales)?;
        }
        Ok(desc)
    }

    /// Layouts of `w`, `x` and the output (also C) for `m` rows, each column-major with
    /// its rows contiguous.
    fn layouts(&self, m: u64) -> Result<Layouts> {
        let e4m3 = lt_sys::cudaDataType::CUDA_R_8F_E4M3;
        let (n, k) = (self.n, self.k);
        let mut made = Layouts(Vec::with_capacity(3));
        for (data_type, rows, cols) in [(e4m3, k, n), (e4m3, k, m), (self.d_type, n, m)] {
            made.0
                .push(lt::create_matrix_layout(data_type, rows, cols, rows as i64).lt()?);
        }
        Ok(made)
    }

    /// The algorithm for this weight shape, output and accumulation (see the module documentation), chosen
    /// on first use on each GPU and kept.
    /// `desc` has the scale pointers set (cuBLASLt needs them to choose).
    fn algorithm(
        &self,
        dev: &CudaDevice,
        handle: Handle,
        desc: &Desc,
    ) -> Result<lt_sys::cublasLtMatmulAlgo_t> {
        type Key = (usize, u64, u64, u32, bool, Scaling, bool);
        static CHOSEN: OnceLock<Mutex<HashMap<Key, lt_sys::cublasLtMatmulAlgo_t>>> =
            OnceLock::new();
        let ctx = dev.cuda_stream().context().cu_ctx() as usize;
        let key = (
            ctx,
            self.n,
            self.k,
            self.d_type as u32,
            self.beta != 0.0,
            self.scaling,
            self.fast_accum,
        );
        if let Some(algo) = CHOSEN
            .get_or_init(Default::default)
            .lock()
            .unwrap()
            .get(&key)
        {
            return Ok(*algo);
        }
        let layouts = self.layouts(CANONICAL_ROWS)?;
        let pref = Pref(lt::create_matmul_pref().lt()?);
        let workspace = WORKSPACE_BYTES as u64;
        let no_split_k = lt_sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_NONE as u32;
        use lt_sys::cublasLtMatmulPreferenceAttributes_t as P;
        // SAFETY: live descriptors; values of the documented types (u64, u32).
        let heuristic = unsafe {
            lt::set_matmul_pref_attribute(
                pref.0,
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace as *const u64).cast(),
                8,
            )
            .lt()?;
            lt::set_matmul_pref_attribute(
                pref.0,
                P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                (&no_split_k as *const u32).cast(),
                4,
            )
            .lt()?;
            let [w, x, out] = [layouts.0[0], layouts.0[1], layouts.0[2]];
            lt::get_matmul_algo_heuristic(handle.0, desc.0, w, x, out, out, pref.0)
        };
        let algo = match heuristic {
            Ok(h) => h.algo,
            Err(e) => bail!(
                "cuBLASLt has no fp8 GEMM for a [{}, {}] weight on this GPU: {e:?}",
                self.n,
                self.k
            ),
        };
        CHOSEN
            .get_or_init(Default::default)
            .lock()
            .unwrap()
            .insert(key, algo);
        Ok(algo)
    }

    /// # Safety
    /// The operands hold an `[n, k]` and an `[m, k]` e4m3 matrix, `n` and `m` f32 scales and
    /// `m` rows of `n` output values.
    unsafe fn run(&self, dev: &CudaDevice, ops: Operands) -> Result<()> {
        let stream = dev.cuda_stream();
        // cuBLASLt resolves the stream against the current context.
        stream.context().bind_to_thread().w()?;
        let handle = handle(dev)?;
        let desc = self.desc(ops.w_scales, ops.x_scales)?;
        let algo = self.algorithm(dev, handle, &desc)?;
        let layouts = self.layouts(self.m)?;
        let workspace = stream.alloc::<u8>(WORKSPACE_BYTES).w()?;
        let (workspace_at, _guard) = workspace.device_ptr(&stream);
        let [w, x, out] = [layouts.0[0], layouts.0[1], layouts.0[2]];
        let (alpha, beta) = (1f32, self.beta);
        lt::matmul(
            handle.0,
            desc.0,
            (&alpha as *const f32).cast(),
            (&beta as *const f32).cast(),
            ops.w as *const c_void,
            w,
            ops.x as *const c_void,
            x,
            ops.out as *const c_void,
            out,
            ops.out as *mut c_void,
            out,
            &algo,
            workspace_at as *mut c_void,
            WORKSPACE_BYTES,
            stream.cu_stream() as lt_sys::cudaStream_t,
        )
        .lt()
    }
}

/// A cuBLASLt handle (one per CUDA context, kept for the process).
#[derive(Clone, Copy)]
struct Handle(lt_sys::cublasLtHandle_t);
// SAFETY: a cuBLASLt handle may be used from any thread, one call at a time per stream; every
// call passes the calling thread's stream.
unsafe impl Send for Handle {}

fn handle(dev: &CudaDevice) -> Result<Handle> {
    static HANDLES: OnceLock<Mutex<HashMap<usize, Handle>>> = OnceLock::new();
    let ctx = dev.cuda_stream().context().cu_ctx() as usize;
    let mut map = HANDLES.get_or_init(Default::default).lock().unwrap();
    if let Some(h) = map.get(&ctx) {
        return Ok(*h);
    }
    let h = Handle(lt::create_handle().lt()?);
    map.insert(ctx, h);
    Ok(h)
}
