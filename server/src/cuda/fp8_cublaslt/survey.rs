//! For `exactscore-bench fp8-algos`: cuBLASLt's fp8 GEMM algorithms for a problem, as its
//! heuristic ranks them and every configuration it accepts, each timed. Measured on an H200
//! (2026-11-28) for the Llama-3-8B layer with f32 sums: none beats the heuristic's first.

use std::ffi::c_void;

use candle_core::cuda_backend::cudarc::cublaslt::sys as lt_sys;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::Result;

use super::{Desc, Handle, LtResult, Operands, Problem, WORKSPACE_BYTES};

use lt_sys::cublasLtMatmulAlgoCapAttributes_t as Cap;
use lt_sys::cublasLtMatmulAlgoConfigAttributes_t as Config;
use lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS as SUCCESS;
use lt_sys::cudaDataType::{CUDA_R_32F, CUDA_R_8F_E4M3};

/// Cluster shapes tried (`cublasLtClusterShape_t`): auto, 1×1, 2×1, 4×1, 1×2, 2×2, 3×1.
const CLUSTERS: [u16; 7] = [0, 2, 3, 4, 5, 6, 17];

impl Problem {
    /// Up to `count` of the heuristic's algorithms for this problem at `heuristic_rows` rows,
    /// in its order, each described (cuBLASLt's configuration ids) and with the milliseconds of
    /// one run on `ops`, the mean of `reps`; the first is the one [`Self::run`] uses when
    /// `heuristic_rows` is `CANONICAL_ROWS`.
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
        let (handle, desc) = self.prepare(dev, ops)?;
        let mut timed = Vec::new();
        for found in self.heuristic(handle, &desc, heuristic_rows, count)? {
            let ms = self.time(dev, handle, &desc, &found.algo, ops, reps)?;
            timed.push((describe(&found.algo, found.wavesCount), ms));
        }
        Ok(timed)
    }

    /// Every configuration of every algorithm cuBLASLt has for these types (tile, stages,
    /// cluster shape, custom option, CTA swizzling; never split k) that it accepts for this
    /// problem, each described and timed as in [`Self::survey`], fastest first.
    ///
    /// # Safety
    /// As [`Self::run`].
    pub unsafe fn explore(
        &self,
        dev: &CudaDevice,
        ops: Operands,
        reps: usize,
    ) -> Result<Vec<(String, f64)>> {
        let (handle, desc) = self.prepare(dev, ops)?;
        let layouts = self.layouts(self.m)?;
        let [w, x, out] = [layouts.0[0], layouts.0[1], layouts.0[2]];
        let d = self.d_type()?;
        let compute = lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let (mut ids, mut found) = ([0i32; 64], 0);
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
            &mut found,
        )
        .result()
        .lt()?;
        let mut timed = Vec::new();
        for &id in &ids[..found.max(0) as usize] {
            let mut base = std::mem::MaybeUninit::<lt_sys::cublasLtMatmulAlgo_t>::zeroed();
            let init = lt_sys::cublasLtMatmulAlgoInit(
                handle.0,
                compute,
                CUDA_R_32F,
                CUDA_R_8F_E4M3,
                CUDA_R_8F_E4M3,
                d,
                d,
                id,
                base.as_mut_ptr(),
            );
            if init != SUCCESS {
                continue;
            }
            let base = base.assume_init();
            // 0: cuBLASLt's choice
            let tiles = [
                vec![0],
                capability_list(&base, Cap::CUBLASLT_ALGO_CAP_TILE_IDS),
            ]
            .concat();
            let stages = [
                vec![0],
                capability_list(&base, Cap::CUBLASLT_ALGO_CAP_STAGES_IDS),
            ]
            .concat();
            let mut customs = 0u32;
            let mut size = 0usize;
            let custom_max = Cap::CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX;
            let custom_at = (&mut customs as *mut u32).cast();
            lt_sys::cublasLtMatmulAlgoCapGetAttribute(&base, custom_max, custom_at, 4, &mut size);
            for (&tile, &stage) in tiles
                .iter()
                .flat_map(|t| stages.iter().map(move |s| (t, s)))
            {
                for (cluster, custom, swizzle) in CLUSTERS
                    .iter()
                    .flat_map(|&c| (0..=customs).flat_map(move |o| [(c, o, 0u32), (c, o, 1)]))
                {
                    let mut algo = base;
                    set_config(&mut algo, Config::CUBLASLT_ALGO_CONFIG_TILE_ID, &tile);
                    set_config(&mut algo, Config::CUBLASLT_ALGO_CONFIG_STAGES_ID, &stage);
                    set_config(
                        &mut algo,
                        Config::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID,
                        &cluster,
                    );
                    set_config(
                        &mut algo,
                        Config::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION,
                        &custom,
                    );
                    set_config(
                        &mut algo,
                        Config::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING,
                        &swizzle,
                    );
                    let mut check = std::mem::MaybeUninit::zeroed();
                    let status = lt_sys::cublasLtMatmulAlgoCheck(
                        handle.0,
                        desc.0,
                        w,
                        x,
                        out,
                        out,
                        &algo,
                        check.as_mut_ptr(),
                    );
                    if status != SUCCESS {
                        continue;
                    }
                    let check: lt_sys::cublasLtMatmulHeuristicResult_t = check.assume_init();
                    if check.workspaceSize > WORKSPACE_BYTES
                        || self.run_with(dev, handle, &desc, &algo, ops).is_err()
                    {
                        continue;
                    }
                    let ms = self.time(dev, handle, &desc, &algo, ops, reps)?;
                    timed.push((describe(&algo, check.wavesCount), ms));
                }
            }
        }
        timed.sort_by(|a, b| a.1.total_cmp(&b.1));
        Ok(timed)
    }

    /// Milliseconds of one run of `algo` on `ops`, the mean of `reps` after a first one.
    ///
    /// # Safety
    /// As [`Self::run_with`].
    unsafe fn time(
        &self,
        dev: &CudaDevice,
        handle: Handle,
        desc: &Desc,
        algo: &lt_sys::cublasLtMatmulAlgo_t,
        ops: Operands,
        reps: usize,
    ) -> Result<f64> {
        let stream = dev.cuda_stream();
        self.run_with(dev, handle, desc, algo, ops)?;
        stream.synchronize().w()?;
        let start = std::time::Instant::now();
        for _ in 0..reps {
            self.run_with(dev, handle, desc, algo, ops)?;
        }
        stream.synchronize().w()?;
        Ok(start.elapsed().as_secs_f64() * 1e3 / reps.max(1) as f64)
    }
}

/// A capability of `algo` that is a list of u32 ids (tiles, stages); empty where not given.
///
/// # Safety
/// `attr` is a list-valued capability.
unsafe fn capability_list(algo: &lt_sys::cublasLtMatmulAlgo_t, attr: Cap) -> Vec<u32> {
    let mut size = 0usize;
    lt_sys::cublasLtMatmulAlgoCapGetAttribute(algo, attr, std::ptr::null_mut(), 0, &mut size);
    let mut values = vec![0u32; size / 4];
    let at = values.as_mut_ptr().cast();
    if lt_sys::cublasLtMatmulAlgoCapGetAttribute(algo, attr, at, size, &mut size) != SUCCESS {
        values.clear();
    }
    values
}

/// Sets one configuration attribute of `algo` (a rejected value shows in the check after).
///
/// # Safety
/// `T` is the attribute's documented type.
unsafe fn set_config<T>(algo: &mut lt_sys::cublasLtMatmulAlgo_t, attr: Config, value: &T) {
    let at = (value as *const T).cast::<c_void>();
    lt_sys::cublasLtMatmulAlgoConfigSetAttribute(algo, attr, at, std::mem::size_of::<T>());
}

/// An algorithm's configuration as cuBLASLt numbers it (`cublasLtMatmulAlgoConfigAttributes_t`),
/// and the heuristic's estimate of its waves.
fn describe(algo: &lt_sys::cublasLtMatmulAlgo_t, waves: f32) -> String {
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
            if ask != SUCCESS || size > 8 {
                ask
            } else {
                let at = (&mut value as *mut u64).cast();
                lt_sys::cublasLtMatmulAlgoConfigGetAttribute(algo, attr, at, size, &mut size)
            }
        };
        match status {
            SUCCESS => value.to_string(),
            error => format!("{error:?}"),
        }
    };
    format!(
        "id {} tile {} stages {} cluster {} inner {} swizzle {} custom {} waves {:.2}",
        get(Config::CUBLASLT_ALGO_CONFIG_ID),
        get(Config::CUBLASLT_ALGO_CONFIG_TILE_ID),
        get(Config::CUBLASLT_ALGO_CONFIG_STAGES_ID),
        get(Config::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
        get(Config::CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID),
        get(Config::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
        get(Config::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
        waves
    )
}
