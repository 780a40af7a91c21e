//! For `exactscore-bench fp8-algos`: cuBLASLt's fp8 GEMM algorithms for a problem, as its
//! heuristic ranks them and every configuration it accepts, each timed. Measured on an H200
//! (2026-11-28) for the Llama-3-8B layer with f32 sums: none beats the heuristic's first.

use std::ffi::c_void;

use candle_core::cuda_backend::cudarc::cublaslt::sys as lt_sys;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::Result;

use super::{handle, LtResult, Operands, Problem, WORKSPACE_BYTES};

impl Problem {
    /// For `exactscore-bench`: up to `count` of the heuristic's algorithms for this problem at
    /// `heuristic_rows` rows, in its order, each described (cuBLASLt's configuration ids) and
    /// with the milliseconds of one run on `ops`, the mean of `reps`; the first is the one
    /// [`Self::run`] uses when `heuristic_rows` is [`CANONICAL_ROWS`].
    ///
    /// # Safety
    /// As [`Self::run`].
    pub unsafe fn survey(
        &self,
        dev: &CudaDevice,
        ops: Operands,
        heuristic_rows: u64,
        count: usize,
        reps: usize,
    ) -> Result<Vec<(String, f64)>> {
        let stream = dev.cuda_stream();
        stream.context().bind_to_thread().w()?;
        let handle = handle(dev)?;
        let desc = self.desc(ops.w_scales, ops.x_scales)?;
        let mut timed = Vec::new();
        for found in self.heuristic(handle, &desc, heuristic_rows, count)? {
            self.run_with(dev, handle, &desc, &found.algo, ops)?;
            stream.synchronize().w()?;
            let start = std::time::Instant::now();
            for _ in 0..reps {
                self.run_with(dev, handle, &desc, &found.algo, ops)?;
            }
            stream.synchronize().w()?;
            let ms = start.elapsed().as_secs_f64() * 1e3 / reps as f64;
            timed.push((describe(&found.algo, found.wavesCount), ms));
        }
        Ok(timed)
    }

    /// For `exactscore-bench`: every configuration of every algorithm cuBLASLt has for these
    /// types (tile, stages, cluster shape, custom option, CTA swizzling; never split k) that it
    /// accepts for this problem, each described and timed as in [`Self::survey`], fastest first.
    ///
    /// # Safety
    /// As [`Self::run`].
    pub unsafe fn explore(
        &self,
        dev: &CudaDevice,
        ops: Operands,
        reps: usize,
    ) -> Result<Vec<(String, f64)>> {
        use lt_sys::cublasLtMatmulAlgoCapAttributes_t as Cap;
        use lt_sys::cublasLtMatmulAlgoConfigAttributes_t as C;
        use lt_sys::cudaDataType::{CUDA_R_32F, CUDA_R_8F_E4M3};
        let stream = dev.cuda_stream();
        stream.context().bind_to_thread().w()?;
        let handle = handle(dev)?;
        let desc = self.desc(ops.w_scales, ops.x_scales)?;
        let layouts = self.layouts(self.m)?;
        let [w, x, out] = [layouts.0[0], layouts.0[1], layouts.0[2]];
        let compute = lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let d = self.d_type()?;
        let mut ids = [0i32; 64];
        let mut n_ids = 0;
        lt_sys::cublasLtMatmulAlgoGetIds(
            handle.0,
            compute,
            CUDA_R_32F,
            CUDA_R_8F_E4M3,
            CUDA_R_8F_E4M3,
            d,
            d,
            64,
            ids.as_mut_ptr(),
            &mut n_ids,
        )
        .result()
        .lt()?;
        let cap_list = |algo: &lt_sys::cublasLtMatmulAlgo_t, attr| -> Vec<u32> {
            let mut size = 0usize;
            lt_sys::cublasLtMatmulAlgoCapGetAttribute(
                algo,
                attr,
                std::ptr::null_mut(),
                0,
                &mut size,
            );
            let mut values = vec![0u32; size / 4];
            lt_sys::cublasLtMatmulAlgoCapGetAttribute(
                algo,
                attr,
                values.as_mut_ptr().cast(),
                size,
                &mut size,
            );
            values
        };
        let cap_u32 = |algo: &lt_sys::cublasLtMatmulAlgo_t, attr| -> u32 {
            let (mut value, mut size) = (0u32, 0usize);
            lt_sys::cublasLtMatmulAlgoCapGetAttribute(
                algo,
                attr,
                (&mut value as *mut u32).cast(),
                4,
                &mut size,
            );
            value
        };
        let mut timed = Vec::new();
        for &id in &ids[..n_ids.max(0) as usize] {
            let mut base = std::mem::MaybeUninit::<lt_sys::cublasLtMatmulAlgo_t>::zeroed();
            if lt_sys::cublasLtMatmulAlgoInit(
                handle.0,
                compute,
                CUDA_R_32F,
                CUDA_R_8F_E4M3,
                CUDA_R_8F_E4M3,
                d,
                d,
                id,
                base.as_mut_ptr(),
            ) != lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            {
                continue;
            }
            let base = base.assume_init();
            let mut tiles = cap_list(&base, Cap::CUBLASLT_ALGO_CAP_TILE_IDS);
            let mut stages = cap_list(&base, Cap::CUBLASLT_ALGO_CAP_STAGES_IDS);
            tiles.push(0);
            stages.push(0);
            let customs = cap_u32(&base, Cap::CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX);
            for &tile in &tiles {
                for &stage in &stages {
                    for cluster in [0u16, 2, 3, 4, 5, 6, 17] {
                        for custom in 0..=customs {
                            for swizzle in [0u32, 1] {
                                let mut algo = base;
                                let set = |algo: &mut lt_sys::cublasLtMatmulAlgo_t,
                                           attr,
                                           v: *const c_void,
                                           size| {
                                    lt_sys::cublasLtMatmulAlgoConfigSetAttribute(
                                        algo, attr, v, size,
                                    )
                                };
                                set(
                                    &mut algo,
                                    C::CUBLASLT_ALGO_CONFIG_TILE_ID,
                                    (&tile as *const u32).cast(),
                                    4,
                                );
                                set(
                                    &mut algo,
                                    C::CUBLASLT_ALGO_CONFIG_STAGES_ID,
                                    (&stage as *const u32).cast(),
                                    4,
                                );
                                set(
                                    &mut algo,
                                    C::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID,
                                    (&cluster as *const u16).cast(),
                                    2,
                                );
                                set(
                                    &mut algo,
                                    C::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION,
                                    (&custom as *const u32).cast(),
                                    4,
                                );
                                set(
                                    &mut algo,
                                    C::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING,
                                    (&swizzle as *const u32).cast(),
                                    4,
                                );
                                let mut result = std::mem::MaybeUninit::<
                                    lt_sys::cublasLtMatmulHeuristicResult_t,
                                >::zeroed();
                                if lt_sys::cublasLtMatmulAlgoCheck(
                                    handle.0,
                                    desc.0,
                                    w,
                                    x,
                                    out,
                                    out,
                                    &algo,
                                    result.as_mut_ptr(),
                                ) != lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                                {
                                    continue;
                                }
                                let result = result.assume_init();
                                if result.workspaceSize > WORKSPACE_BYTES {
                                    continue;
                                }
                                if self.run_with(dev, handle, &desc, &algo, ops).is_err() {
                                    continue;
                                }
                                stream.synchronize().w()?;
                                let start = std::time::Instant::now();
                                for _ in 0..reps {
                                    self.run_with(dev, handle, &desc, &algo, ops)?;
                                }
                                stream.synchronize().w()?;
                                let ms = start.elapsed().as_secs_f64() * 1e3 / reps as f64;
                                timed.push((describe(&algo, result.wavesCount), ms));
                            }
                        }
                    }
                }
            }
        }
        timed.sort_by(|a, b| a.1.total_cmp(&b.1));
        Ok(timed)
    }
}

/// An algorithm's configuration as cuBLASLt numbers it (`cublasLtMatmulAlgoConfigAttributes_t`),
/// and the heuristic's estimate of its waves.
fn describe(algo: &lt_sys::cublasLtMatmulAlgo_t, waves: f32) -> String {
    use lt_sys::cublasLtMatmulAlgoConfigAttributes_t as C;
    let get = |attr| {
        let (mut value, mut size) = (0u64, 0usize);
        // SAFETY: a valid algorithm; the first call asks for the attribute's size (at most 8
        // bytes for every configuration attribute), the second reads it.
        let status = unsafe {
            let ask = lt_sys::cublasLtMatmulAlgoConfigGetAttribute(
                algo,
                attr,
                std::ptr::null_mut(),
                0,
                &mut size,
            );
            if ask != lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS || size > 8 {
                ask
            } else {
                lt_sys::cublasLtMatmulAlgoConfigGetAttribute(
                    algo,
                    attr,
                    (&mut value as *mut u64).cast(),
                    size,
                    &mut size,
                )
            }
        };
        if status == lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            value.to_string()
        } else {
            format!("{status:?}")
        }
    };
    format!(
        "id {} tile {} stages {} cluster {} inner {} swizzle {} custom {} waves {:.2}",
        get(C::CUBLASLT_ALGO_CONFIG_ID),
        get(C::CUBLASLT_ALGO_CONFIG_TILE_ID),
        get(C::CUBLASLT_ALGO_CONFIG_STAGES_ID),
        get(C::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
        get(C::CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID),
        get(C::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
        get(C::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
        waves
    )
}
