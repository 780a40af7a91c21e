//! Compiles every op family's server/kernels/*.cu with nvcc when the `cuda` feature is on, each
//! into one fatbin (loaded by `cuda/module.rs`): machine code (SASS) for every architecture in $EXACTSCORE_CUDA_ARCHS
//! (default `80,89,90`: A100, L40S/RTX 4090, H100/H200) and $CUDA_COMPUTE_CAP, plus PTX of the
//! newest one so that later GPUs can still JIT it. Machine code loads without the driver's PTX
//! JIT, which costs seconds on a fresh machine. kernels/*_sm90.cu (Hopper's wgmma) are built
//! for sm_90a alone, when 90 is among the architectures.
//! nvcc comes from $NVCC or PATH (a CUDA toolkit, or `scripts/cuda-env.sh` without one).

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=EXACTSCORE_CUDA_ARCHS");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let archs = architectures();
    let newest = *archs.last().expect("at least one architecture");
    let mut gencode: Vec<String> = archs
        .iter()
        .map(|a| format!("-gencode=arch=compute_{a},code=sm_{a}"))
        .collect();
    gencode.push(format!(
        "-gencode=arch=compute_{newest},code=compute_{newest}"
    ));
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
    for name in families() {
        let src = format!("kernels/{name}.cu");
        let fatbin = out.join(format!("{name}.fatbin"));
        let status = std::process::Command::new(&nvcc)
            .args(["--fatbin", "-O3", "-std=c++17"])
            .args(&gencode)
            .arg("-o")
            .arg(&fatbin)
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
    // The wgmma kernels exist for sm_90 alone (arch-specific sm_90a machine code, no PTX).
    for name in hopper_families() {
        let fatbin = out.join(format!("{name}.fatbin"));
        if !archs.contains(&90) {
            std::fs::write(&fatbin, []).expect("OUT_DIR is writable");
            continue;
        }
        let status = std::process::Command::new(&nvcc)
            .args(["--fatbin", "-O3", "-std=c++17"])
            .arg("-gencode=arch=compute_90a,code=sm_90a")
            .arg("-o")
            .arg(&fatbin)
            .arg(format!("kernels/{name}.cu"))
            .status()
            .expect("nvcc ran a moment ago");
        assert!(status.success(), "nvcc failed on kernels/{name}.cu");
    }
}

/// Sorted, deduplicated compute capabilities (`90`, `89`, ...) to build machine code for.
fn architectures() -> Vec<u32> {
    // `90a`-style suffixes (arch-specific features, which these kernels do not use) are dropped.
    let parse = |var: &str, value: &str| -> u32 {
        value
            .trim()
            .trim_end_matches(|c: char| c.is_ascii_alphabetic())
            .parse()
            .unwrap_or_else(|_| panic!("{var}: `{value}` is not a compute capability like 90"))
    };
    let list = std::env::var("EXACTSCORE_CUDA_ARCHS").unwrap_or_else(|_| "80,89,90".into());
    let mut archs: Vec<u32> = list
        .split(',')
        .filter(|a| !a.trim().is_empty())
        .map(|a| parse("EXACTSCORE_CUDA_ARCHS", a))
        .collect();
    if let Ok(cap) = std::env::var("CUDA_COMPUTE_CAP") {
        archs.push(parse("CUDA_COMPUTE_CAP", &cap));
    }
    archs.sort_unstable();
    archs.dedup();
    archs
}

/// The op families' kernel files: every `kernels/*.cu` but the sm_90a-only ones, built apart.
fn families() -> Vec<String> {
    kernel_stems()
        .into_iter()
        .filter(|s| !s.ends_with("_sm90"))
        .collect()
}

/// The sm_90a-only kernel files, `kernels/*_sm90.cu`.
fn hopper_families() -> Vec<String> {
    kernel_stems()
        .into_iter()
        .filter(|s| s.ends_with("_sm90"))
        .collect()
}

/// Every `kernels/*.cu`'s stem, sorted.
fn kernel_stems() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("kernels")
        .expect("server/kernels is readable")
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            name.strip_suffix(".cu").map(str::to_string)
        })
        .collect();
    names.sort();
    names
}
