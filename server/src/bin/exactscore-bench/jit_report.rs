//! `jit`: which of candle's PTX modules a first forward pass JIT-compiles, and what each costs.
//! Run with an empty driver cache (`CUDA_CACHE_PATH=$(mktemp -d)`): the forward compiles what it
//! uses, then every candle module is loaded once more; a module the forward used comes from the
//! cache in milliseconds, the others pay their full JIT. Fails when the forward used any.

use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::{DType, Device};
use exactscore_server::model::{AttentionKernel, Model, ModelOptions, ScoreInput};
use exactscore_server::quant::{ActivationQuantMode, LinearOptions};

pub fn report(model_dir: &Path, device: &Device) -> Result<()> {
    let Device::Cuda(cuda) = device else {
        anyhow::bail!("jit needs a CUDA device");
    };
    let t = Instant::now();
    let options = ModelOptions {
        linear: LinearOptions {
            device: device.clone(),
            dtype: DType::BF16,
            activation_quant: ActivationQuantMode::Emulate,
            kv_cache: Default::default(),
            fp8_matmul: Default::default(),
            fused_fp8_scales: Default::default(),
        },
        max_seq_len: 2048,
        attention: AttentionKernel::Auto,
    };
    let model = Model::load(model_dir, &options)?;
    device.synchronize()?;
    let load = t.elapsed().as_secs_f64();
    let t = Instant::now();
    model.score(&[ScoreInput {
        stored: exactscore_server::model::StoredRequest::NONE,
        tokens: &[1, 2, 3],
        top_k: 1,
    }])?;
    device.synchronize()?;
    println!(
        "| {} | load {load:.2} s | first forward {:.2} s | |",
        model_dir.display(),
        t.elapsed().as_secs_f64()
    );
    println!("| candle module | PTX bytes | load after the forward, s | used by the forward |");
    println!("|---|---|---|---|");
    use candle_kernels as k;
    let context = cuda.cuda_stream().context().clone();
    let mut used = Vec::new();
    for (name, module) in [
        ("affine", k::AFFINE),
        ("binary", k::BINARY),
        ("cast", k::CAST),
        ("conv", k::CONV),
        ("fill", k::FILL),
        ("indexing", k::INDEXING),
        ("quantized", k::QUANTIZED),
        ("reduce", k::REDUCE),
        ("sort", k::SORT),
        ("ternary", k::TERNARY),
        ("unary", k::UNARY),
    ] {
        let t = Instant::now();
        context.load_module(Ptx::from_src(module.ptx()))?;
        let s = t.elapsed().as_secs_f64();
        let cached = s < 0.05;
        if cached {
            used.push(name);
        }
        println!(
            "| {name} | {} | {s:.3} | {} |",
            module.ptx().len(),
            if cached { "yes (cached)" } else { "no" }
        );
    }
    if !used.is_empty() {
        anyhow::bail!(
            "the first forward JIT-compiled candle modules {used:?}: start-up is not JIT-free"
        );
    }
    Ok(())
}
