//! The compiled kernel modules (fatbins built by `build.rs`, one per op family) and their
//! loading. Machine code for the GPU's architecture loads in milliseconds; only a GPU newer than
//! every built architecture falls back to JIT-compiling the embedded PTX.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchArgs};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::Result;

/// One fatbin of `server/kernels/`.
pub(crate) struct KernelModule {
    name: &'static str,
    image: &'static [u8],
}

/// `NAME: "file"`: the module built from `kernels/file.cu`.
macro_rules! kernel_modules {
    ($($(#[$doc:meta])* $const_name:ident: $file:literal,)*) => {
        $(
            $(#[$doc])*
            pub(crate) const $const_name: KernelModule = KernelModule {
                name: $file,
                image: include_bytes!(concat!(env!("OUT_DIR"), "/", $file, ".fatbin")),
            };
        )*
    };
}

// One module per op family.
kernel_modules! {
    ATTENTION: "attention",
    /// Hopper-only kernels (wgmma): machine code for sm_90a, empty where build.rs did not build
    /// for sm_90 (loading it then fails, and its kernels are reported missing).
    ATTENTION_SM90: "attention_sm90",
    DEQUANT: "dequant",
    /// The int4 GEMM on wgmma: as [`ATTENTION_SM90`], sm_90a only.
    INT4_GEMM_SM90: "int4_gemm_sm90",
    EMBEDDING: "embedding",
    FP8_GEMM: "fp8_gemm",
    GEMM: "gemm",
    LINEAR_ATTENTION: "linear_attention",
    MOE: "moe",
    NORM: "norm",
    ROPE: "rope",
    SCORING: "scoring",
    STORED_REFERENCE: "stored_reference",
}

impl KernelModule {
    /// Whether build.rs built machine code into this module (see [`ATTENTION_SM90`]).
    pub(crate) fn is_built(&self) -> bool {
        !self.image.is_empty()
    }

    /// Whether this module's machine code runs on `dev`: built, and for an sm_90a-only module
    /// (`*_sm90`), `dev` is a Hopper GPU (compute capability 9.0).
    pub(crate) fn runs_on(&self, dev: &CudaDevice) -> Result<bool> {
        if !self.name.ends_with("_sm90") {
            return Ok(self.is_built());
        }
        Ok(self.is_built() && dev.cuda_stream().context().compute_capability().w()? == (9, 0))
    }
}

/// A kernel ready to launch on the device's stream.
pub(crate) struct Kernel {
    func: CudaFunction,
    stream: Arc<CudaStream>,
}

impl Kernel {
    pub(crate) fn builder(&self) -> LaunchArgs<'_> {
        self.stream.launch_builder(&self.func)
    }

    /// Lets a launch use `bytes` of dynamic shared memory (beyond the default 48 KiB).
    pub(crate) fn allow_shared_bytes(&self, bytes: usize) -> Result<()> {
        self.func
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .w()
    }
}

/// Modules loaded so far, per CUDA context (keyed by its handle) and module name.
type Loaded = HashMap<(usize, &'static str), Arc<CudaModule>>;

/// The kernel `name` of `module` on `dev`; the module is loaded on first use.
pub(crate) fn kernel(dev: &CudaDevice, module: &KernelModule, name: &str) -> Result<Kernel> {
    static LOADED: OnceLock<Mutex<Loaded>> = OnceLock::new();
    let stream = dev.cuda_stream();
    let context = stream.context();
    let key = (context.cu_ctx() as usize, module.name);
    let loaded = {
        let mut map = LOADED.get_or_init(Default::default).lock().unwrap();
        match map.get(&key) {
            Some(m) => m.clone(),
            None => {
                let m = context
                    .load_module(Ptx::from_binary(module.image.to_vec()))
                    .w()?;
                map.insert(key, m.clone());
                m
            }
        }
    };
    let func = loaded.load_function(name).w()?;
    Ok(Kernel { func, stream })
}
