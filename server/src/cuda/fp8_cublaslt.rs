//! cuBLASLt's fp8 GEMM for `fp8_gemm.rs` (raw sys calls: cudarc wraps no fp8 scale modes).
//!
//! The algorithm is chosen once per weight shape, output dtype, scaling and accumulation, for a
//! fixed number of rows ([`CANONICAL_ROWS`]) and among those that do not split k, and then used
//! for every call: the kernel, and so each row's summation order, does not follow the batch.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

mod survey;

use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys as lt_sys};
use candle_core::cuda_backend::cudarc::driver::DevicePtr;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{bail, DType, Result};

/// Rows of the problem the algorithm is chosen for (four windows of 2048).
const CANONICAL_ROWS: u64 = 8192;
/// cuBLASLt's workspace (its recommendation for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// Device addresses of a GEMM's operands.
#[derive(Clone, Copy)]
pub(super) struct Operands {
    pub w: u64,
    pub x: u64,
    pub w_scales: u64,
    pub x_scales: u64,
    pub out: u64,
}

/// One GEMM in cuBLASLt's column-major terms: `out[n, m] = op(w)[n, k] · x[k, m]` with `w`
/// transposed (the "TN" layout fp8 needs: both operands k-major).
pub(super) struct Problem {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// bf16 or f16.
    pub out_dtype: DType,
    pub beta: f32,
    pub scaling: Scaling,
    /// Hopper's fast fp8 accumulation (`CUBLASLT_MATMUL_DESC_FAST_ACCUM`); else the partial
    /// sums are promoted to f32.
    pub fast_accum: bool,
}

/// Where the scales apply.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(super) enum Scaling {
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
        for (data_type, rows, cols) in [(e4m3, k, n), (e4m3, k, m), (self.d_type()?, n, m)] {
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
        type Key = (usize, u64, u64, DType, bool, Scaling, bool);
        static CHOSEN: OnceLock<Mutex<HashMap<Key, lt_sys::cublasLtMatmulAlgo_t>>> =
            OnceLock::new();
        let ctx = dev.cuda_stream().context().cu_ctx() as usize;
        let key = (
            ctx,
            self.n,
            self.k,
            self.out_dtype,
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
        let algo = match self.heuristic(handle, desc, CANONICAL_ROWS, 1) {
            Ok(found) => found[0].algo,
            Err(e) => bail!(
                "cuBLASLt has no fp8 GEMM for a [{}, {}] weight on this GPU: {e}",
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

    /// Up to `count` of cuBLASLt's algorithms for this problem at `rows` rows, best first by its
    /// heuristic, among those that do not split k.
    fn heuristic(
        &self,
        handle: Handle,
        desc: &Desc,
        rows: u64,
        count: usize,
    ) -> Result<Vec<lt_sys::cublasLtMatmulHeuristicResult_t>> {
        let layouts = self.layouts(rows)?;
        let pref = Pref(lt::create_matmul_pref().lt()?);
        let workspace = WORKSPACE_BYTES as u64;
        let no_split_k = lt_sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_NONE as u32;
        use lt_sys::cublasLtMatmulPreferenceAttributes_t as P;
        let mut found = Vec::with_capacity(count);
        let mut returned = 0;
        // SAFETY: live descriptors; values of the documented types (u64, u32); `found` has room
        // for `count` results and cuBLASLt writes `returned` of them.
        unsafe {
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
            lt_sys::cublasLtMatmulAlgoGetHeuristic(
                handle.0,
                desc.0,
                w,
                x,
                out,
                out,
                pref.0,
                count as i32,
                found.as_mut_ptr(),
                &mut returned,
            )
            .result()
            .lt()?;
            found.set_len(returned.max(0) as usize);
        }
        if found.is_empty() {
            bail!("no algorithm (CUBLAS_STATUS_NOT_SUPPORTED)");
        }
        Ok(found)
    }

    fn d_type(&self) -> Result<lt_sys::cudaDataType> {
        Ok(match self.out_dtype {
            DType::BF16 => lt_sys::cudaDataType::CUDA_R_16BF,
            DType::F16 => lt_sys::cudaDataType::CUDA_R_16F,
            other => bail!("fp8_matmul_t: a bf16 or f16 output, not {other:?}"),
        })
    }

    /// # Safety
    /// The operands hold an `[n, k]` and an `[m, k]` e4m3 matrix, the scales `scaling` says
    /// and `m` rows of `n` output values.
    pub unsafe fn run(&self, dev: &CudaDevice, ops: Operands) -> Result<()> {
        let (handle, desc) = self.prepare(dev, ops)?;
        let algo = self.algorithm(dev, handle, &desc)?;
        self.run_with(dev, handle, &desc, &algo, ops)
    }

    /// The handle and descriptor for running this problem on `ops` from this thread.
    fn prepare(&self, dev: &CudaDevice, ops: Operands) -> Result<(Handle, Desc)> {
        // cuBLASLt resolves the stream against the current context.
        dev.cuda_stream().context().bind_to_thread().w()?;
        Ok((handle(dev)?, self.desc(ops.w_scales, ops.x_scales)?))
    }

    /// # Safety
    /// As [`Self::run`]; `algo` is one cuBLASLt gave or accepted for this problem (its
    /// heuristic's, or one that `cublasLtMatmulAlgoCheck` passed).
    unsafe fn run_with(
        &self,
        dev: &CudaDevice,
        handle: Handle,
        desc: &Desc,
        algo: &lt_sys::cublasLtMatmulAlgo_t,
        ops: Operands,
    ) -> Result<()> {
        let stream = dev.cuda_stream();
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
            algo,
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
