//! The operations that run a kernel of our own on a GPU, one file per op family. Each function
//! dispatches once: to `crate::cuda` where its input lies on a CUDA device, else to the CPU
//! reference in the same file (the specification that kernel is checked against). Model and
//! quantization code call these and never ask which device they run on, so a new architecture
//! has no `cfg` in it (candle-nn's `ops` is the model).
//!
//! A family is three sibling files: `ops/X.rs` (CPU reference, dispatch, result types, and the
//! GPU entry points it calls, declared with [`gpu_entry_points!`]), `cuda/X.rs` (the launches)
//! and `kernels/X.cu` (the kernels). This module imports neither `model` nor `quant`: they build
//! on it.

pub mod attention;
pub mod dequant;
pub mod embedding;
pub mod fp8_gemm;
pub mod gemm;
pub mod linear_attention;
pub mod minifloat;
pub mod moe;
pub mod norm;
pub mod rope;
pub mod scoring;

pub use attention::*;
pub use dequant::*;
pub use embedding::*;
pub use fp8_gemm::*;
pub use gemm::*;
pub use linear_attention::*;
pub use moe::*;
pub use norm::*;
pub use rope::*;
pub use scoring::*;

/// Declares the GPU entry points of the family `cuda::$family` that its ops file calls, as a
/// module `gpu` of functions with these signatures. With the `cuda` feature each forwards to
/// the launch of the same name (so the signatures are checked against the launches); without it
/// each returns an error, which no tensor reaches: no CUDA device can be opened in such a build.
macro_rules! gpu_entry_points {
    ($family:ident { $( $(#[$meta:meta])* fn $name:ident( $($arg:ident : $ty:ty),* $(,)? ) -> $ret:ty; )* }) => {
        #[allow(clippy::too_many_arguments, dead_code)]
        mod gpu {
            #[allow(unused_imports)]
            use super::*;
            $(
                $(#[$meta])*
                pub(super) fn $name($($arg: $ty),*) -> $ret {
                    #[cfg(feature = "cuda")]
                    {
                        crate::cuda::$family::$name($($arg),*)
                    }
                    #[cfg(not(feature = "cuda"))]
                    {
                        let _ = ($($arg,)*);
                        candle_core::bail!(
                            "this build has no CUDA kernels (built without the `cuda` feature)"
                        )
                    }
                }
            )*
        }
    };
}
pub(crate) use gpu_entry_points;

/// A clear error where a GPU-only kernel is asked to run on another device.
fn gpu_only(op: &str, x: &candle_core::Tensor) -> candle_core::Result<()> {
    if !x.device().is_cuda() {
        candle_core::bail!("{op} runs on CUDA devices only, not {:?}", x.device());
    }
    Ok(())
}
