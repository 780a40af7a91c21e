//! Compiles server/kernels/{exactscore,attention}.cu to PTX (one module each) with nvcc when the `cuda` feature is on.
//! nvcc comes from $NVCC or PATH (a CUDA toolkit, or `scripts/cuda-env.sh` without one); the
//! target architecture from $CUDA_COMPUTE_CAP (default 90: H100/H200).

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
    for name in ["exactscore", "attention"] {
        let src = format!("kernels/{name}.cu");
        let ptx = out.join(format!("{name}.ptx"));
        let status = std::process::Command::new(&nvcc)
            .args([
                "--ptx",
                "-O3",
                "-std=c++17",
                &format!("-arch=compute_{cap}"),
                "-o",
            ])
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run nvcc ({nvcc}): {e}. The cuda feature needs a CUDA toolkit: put its \
                     bin/ on PATH or set NVCC=/path/to/nvcc, and CUDA_COMPUTE_CAP to the GPU's \
                     compute capability (default 90). Without a toolkit: \
                     `source scripts/cuda-env.sh` (README.md, GPU build)"
                )
            });
        assert!(status.success(), "nvcc failed on {src}");
    }
}
