//! `exactscore-bench`: the GPU path measured against the CPU reference and against the clock.
//!
//! * `check --fixtures DIR --device cuda:0`: every fixture variant (Llama, Qwen3-MoE, Mixtral,
//!   Gemma 3, Gemma 2) scored on the device vs the CPU f32 path (f32 and bf16 compute, bf16 also
//!   with the flash-attention kernel where the model has it), batch invariance, dequantization
//!   and activation QDQ bit-exactness, and the flash kernel alone against an f32 reference at
//!   head sizes 64 and 128. Prints tables; fails on any miss.
//! * `speed --shape llama3-8b --formats w4a16,nvfp4,fp8,bf16 --batch 1,2,4`: scores 2048-token
//!   windows of a random-weight model of that shape (built in memory, no file; shapes in
//!   `random_model.rs`: Llama 3 8B/70B, Mistral Large, Qwen3-30B-A3B, Gemma 3 27B,
//!   Qwen3.5-35B-A3B, Qwen3-Next-80B-A3B, Qwen3.5-27B, DeepSeek-V2-Lite, GLM-4.7-Flash,
//!   GLM-4.5-Air, Gemma 4 26B-A4B and 31B, tiny ones),
//!   through the same `Model::score` the server uses, and prints ms/window, tokens/s, fraction
//!   of the measured cuBLAS bf16 ceiling and peak GPU memory (also over the checkpoint's stored
//!   weight bytes), for each `--attention` kernel; `--profile` adds a per-stage line and, for a
//!   mixture of experts, how many tokens each expert received.
//! * `kld --shape llama3-8b --format w4a16 --batch 1,4`: `/kld` (served model + bf16 reference,
//!   two forwards and the fused divergence) timed next to `/score` on the same windows; `check`
//!   also judges the divergence kernel and the GPU `/kld` path on the fixtures.
//! * `diff --shape llama3-8b --format w4a16 --windows 4 --modules 7`: `/diff` (both models layer
//!   by layer, per-layer errors, the final divergence) timed next to `/score`, and the cost of
//!   attributing the first `--modules` modules, per module per window; `check` also judges the
//!   GPU `/diff` path (its f64 sums on the same states, the whole path) on the fixtures.
//! * `plan --config docs/configs/deepseek-v3-671b.json --format w4a16 --gpus 8`: a memory
//!   plan from a config.json alone (no weights): the GPUs a DeepSeek-style model needs at
//!   W4A16, FP8-block and bf16, and its stages, with the server's own placement.
//! * `jit --model DIR` (run with an empty `CUDA_CACHE_PATH`): which of candle's PTX modules the
//!   first forward JIT-compiles and what each module costs; the rest of start-up is SASS.
//! * `write-checkpoint --shape llama3-8b --format w4a16 --out DIR --tokenizer TOKDIR`: the same
//!   random model as a Hugging Face directory on disk, for end-to-end runs through the server.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::{Parser, Subcommand};
use exactscore_server::model::profile as stages;
use exactscore_server::model::{AttentionKernel, Model, ModelOptions, ScoreInput, SequenceScores};
use exactscore_server::quant::{ActivationQdq, ActivationQuantMode, Fp8Matmul, LinearOptions};
use serde_json::Value;

#[cfg(feature = "cuda")]
mod attention_check;
mod diff_bench;
#[cfg(feature = "cuda")]
mod fp8_gemm_check;
#[cfg(feature = "cuda")]
mod head_norm_check;
#[cfg(feature = "cuda")]
mod jit_report;
mod kld_bench;
mod memory_plan;
#[cfg(feature = "cuda")]
mod mla_inputs_check;
#[cfg(feature = "cuda")]
mod moe_gemm_bench;
#[cfg(feature = "cuda")]
mod norm_bench;
mod pipeline_bench;
mod qdq_check;
mod random_model;
mod stored_reference_check;

#[derive(Parser)]
#[command(about = "ExactScore GPU numerics check and throughput benchmark")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Which of candle's PTX modules a first forward JIT-compiles (run with an empty
    /// CUDA_CACHE_PATH), and what each module's JIT costs.
    #[cfg(feature = "cuda")]
    Jit {
        #[arg(long, default_value = "tests/fixtures/llama-w4a16-g128")]
        model: PathBuf,
        #[arg(long, default_value = "cuda:0")]
        device: String,
    },
    /// Each compiled flash-attention tiling timed alone on the Llama-3-8B, GLM-4.7-Flash and
    /// DeepSeek-V3 attention shapes.
    #[cfg(feature = "cuda")]
    Attention {
        /// 2048-token windows per launch.
        #[arg(long, value_delimiter = ',', default_value = "1,4")]
        windows: Vec<usize>,
        #[arg(long, default_value = "cuda:0")]
        device: String,
    },
    /// cuBLASLt's candidate algorithms for the fp8 GEMMs of the Llama-3-8B layer, timed.
    #[cfg(feature = "cuda")]
    Fp8Algos {
        /// Hopper's fast accumulation instead of f32 sums.
        #[arg(long)]
        fast_accum: bool,
        /// Candidates per ranking.
        #[arg(long, default_value_t = 8)]
        count: usize,
        #[arg(long, default_value = "cuda:0")]
        device: String,
    },
    /// RMSNorm's kernels (a warp, lanes or a block per row) and the per-head norm + RoPE,
    /// fused and composed, timed on a batch's shapes.
    #[cfg(feature = "cuda")]
    Norms {
        /// Rows (tokens) of each shape.
        #[arg(long, default_value_t = 16384)]
        tokens: usize,
        #[arg(long, default_value = "cuda:0")]
        device: String,
    },
    /// One projection of a stack of int4 experts, decoded inside the GEMM vs dequantized first.
    #[cfg(feature = "cuda")]
    MoeGemm {
        #[arg(long, default_value_t = 128)]
        experts: usize,
        /// Rows per expert (a 2048-token window gives each of 128 top-8 experts ~128).
        #[arg(long, value_delimiter = ',', default_value = "128,192,1024")]
        rows: Vec<usize>,
        #[arg(long, default_value_t = 128)]
        group: usize,
        #[arg(long, default_value = "cuda:0")]
        device: String,
    },
    /// GPU vs CPU numerics on the fixture checkpoints.
    Check {
        #[arg(long, default_value = "tests/fixtures")]
        fixtures: PathBuf,
        #[arg(long, default_value = "cuda:0")]
        device: String,
        /// Check only these fixtures (comma-separated names; default: every one). A name that
        /// is not one of the repository's fixtures is checked as well, if `--fixtures` holds a
        /// checkpoint of that name with a reference.json in their layout (the real SmolLM2
        /// checkpoints of scripts/make_real_smollm2.py).
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
    },
    /// Scoring throughput on a random-weight model of a real shape.
    Speed {
        /// A shape of random_model.rs: llama3-8b, llama3-70b, mistral-large-123b,
        /// qwen3-30b-a3b, gemma3-27b, qwen3.5-35b-a3b, qwen3-next-80b-a3b, qwen3.5-27b,
        /// deepseek-v2-lite, glm-4.7-flash, glm-4.5-air, gemma4-26b-a4b, gemma4-31b, or tiny,
        /// tiny-moe, tiny-gemma3, tiny-qwen3.5-moe, tiny-qwen3-next, tiny-qwen3.5,
        /// tiny-deepseek-v2, tiny-glm4-moe-lite, tiny-glm4-moe, tiny-gemma4, tiny-gemma4-moe
        /// (CPU runs).
        #[arg(long, default_value = "llama3-8b")]
        shape: String,
        /// Comma list of w4a16, nvfp4, nvfp4a16, fp8, fp8-block, bf16; a suffix -emulated or
        /// -fast-accum loads fp8 weights with `--fp8-matmul emulated` /
        /// `tensor-cores-fast-accum`.
        #[arg(long, value_delimiter = ',', default_value = "w4a16")]
        formats: Vec<String>,
        /// Windows per forward pass.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
        batch: Vec<usize>,
        #[arg(long, default_value_t = 2048)]
        ctx: usize,
        #[arg(long, default_value_t = 5)]
        iters: usize,
        #[arg(long, default_value = "bf16")]
        dtype: String,
        #[arg(long, default_value = "cuda:0")]
        device: String,
        /// Comma list of attention kernels to time: materialized, flash.
        #[arg(long, value_delimiter = ',', default_value = "materialized")]
        attention: Vec<String>,
        /// After timing, one more forward with the device synchronized around every stage,
        /// printed as a per-stage table (ms per window).
        #[arg(long)]
        profile: bool,
        /// After timing, the largest batch's windows scored by the same weights in f32, and
        /// each format's per-token |Δ| against that (max / mean).
        #[arg(long)]
        against_f32: bool,
        /// After timing, the first window scored alone against the same window in each timed
        /// batch: bitwise or not, and the largest per-token |Δ|.
        #[arg(long)]
        invariance: bool,
        /// The budget of a mixture's routed rows per pass, in MiB (default 512): larger
        /// batches run their tokens in chunks.
        #[arg(long)]
        routed_row_mib: Option<usize>,
    },
    /// `/kld` throughput next to `/score`: a random model of a real shape in `--format` and a
    /// bf16 reference of the same shape, both on the device.
    Kld {
        #[arg(long, default_value = "llama3-8b")]
        shape: String,
        #[arg(long, default_value = "w4a16")]
        format: String,
        #[arg(long, value_delimiter = ',', default_value = "1,4")]
        batch: Vec<usize>,
        #[arg(long, default_value_t = 2048)]
        ctx: usize,
        #[arg(long, default_value_t = 5)]
        iters: usize,
        #[arg(long, default_value = "bf16")]
        dtype: String,
        #[arg(long, default_value = "cuda:0")]
        device: String,
        /// Fail when /kld tokens/s falls below this fraction of /score's at any batch.
        #[arg(long, default_value_t = 0.0)]
        min_ratio: f64,
    },
    /// `/diff` next to `/score` (random model of a real shape in `--format`, bf16 reference),
    /// and the time per module per window of attributing the first `--modules` modules.
    Diff {
        #[arg(long, default_value = "llama3-8b")]
        shape: String,
        #[arg(long, default_value = "w4a16")]
        format: String,
        #[arg(long, default_value_t = 4)]
        windows: usize,
        #[arg(long, default_value_t = 2048)]
        ctx: usize,
        #[arg(long, default_value_t = 3)]
        iters: usize,
        /// Modules attributed (from layer 0 on: each runs the whole stack after it).
        #[arg(long, default_value_t = 7)]
        modules: usize,
        #[arg(long, default_value = "bf16")]
        dtype: String,
        #[arg(long, default_value = "cuda:0")]
        device: String,
        /// Fail when /diff tokens/s falls below this fraction of /score's.
        #[arg(long, default_value_t = 0.0)]
        min_ratio: f64,
    },
    /// One model across devices through the server's engine: each layout's logprobs bitwise
    /// equal to the first layout's, and its throughput; optionally `/kld` against a reference
    /// model in a layout of its own.
    Pipeline {
        #[arg(long, default_value = "llama3-8b")]
        shape: String,
        #[arg(long, value_delimiter = ',', default_value = "w4a16")]
        formats: Vec<String>,
        /// Device lists separated by `;` (the first is the baseline), e.g.
        /// `cuda:0;cuda:0,cuda:0;cuda:0,cuda:1`.
        #[arg(long, default_value = "cuda:0;cuda:0,cuda:0")]
        layouts: String,
        /// 2048-token windows per batch.
        #[arg(long, default_value_t = 8)]
        windows: usize,
        #[arg(long, default_value_t = 2048)]
        ctx: usize,
        /// Batches per worker thread.
        #[arg(long, default_value_t = 3)]
        iters: usize,
        #[arg(long, default_value = "bf16")]
        dtype: String,
        /// Draw only this many decoder layers and repeat them (fast builds of large shapes).
        #[arg(long)]
        distinct_layers: Option<usize>,
        /// Fail when a layout's throughput is below this fraction of the first's.
        #[arg(long, default_value_t = 0.0)]
        min_ratio: f64,
        /// Shape of a reference model for `/kld` (time `/kld` of the first format and layout).
        #[arg(long)]
        reference_shape: Option<String>,
        #[arg(long, default_value = "bf16")]
        reference_format: String,
        /// Devices of the reference model.
        #[arg(long, default_value = "cuda:0")]
        reference_layout: String,
        /// Layers per stage of the reference model (default: balanced).
        #[arg(long, value_delimiter = ',')]
        reference_split: Option<Vec<usize>>,
    },
    /// Writes a random-weight checkpoint of a real shape to disk (config.json, model.safetensors
    /// and the tokenizer files copied from `--tokenizer`).
    WriteCheckpoint {
        #[arg(long, default_value = "llama3-8b")]
        shape: String,
        /// One of w4a16, nvfp4, nvfp4a16, fp8, bf16.
        #[arg(long, default_value = "w4a16")]
        format: String,
        #[arg(long)]
        out: PathBuf,
        /// Directory holding tokenizer.json (and optionally tokenizer_config.json).
        #[arg(long)]
        tokenizer: PathBuf,
        /// Draw only this many decoder layers and repeat them (fast writes of large shapes).
        #[arg(long)]
        distinct_layers: Option<usize>,
    },
    /// A memory plan from a config.json alone (DeepSeek-V3, DeepSeek-V2, GLM-4.7-Flash) or of
    /// a bench shape: the GPUs the model needs in each format, and its stages on `--gpus` GPUs
    /// of `--gpu-gib` GiB; fails where they do not fit.
    Plan {
        #[arg(long, conflicts_with = "shape", required_unless_present = "shape")]
        config: Option<PathBuf>,
        /// A shape of random_model.rs instead of a config.json.
        #[arg(long)]
        shape: Option<String>,
        /// w4a16, fp8-block, fp8, nvfp4, nvfp4a16 or bf16.
        #[arg(long, default_value = "w4a16")]
        format: String,
        #[arg(long, default_value_t = 8)]
        gpus: usize,
        /// Each GPU's memory (H100: 80, H200: 141).
        #[arg(long, default_value_t = 80.0)]
        gpu_gib: f64,
        /// Tokens per batch (`--max-batch-tokens`): 8 windows of 2048 by default.
        #[arg(long, default_value_t = 16384)]
        batch_tokens: usize,
        #[arg(long, default_value_t = 2048)]
        max_seq: usize,
    },
}

fn main() -> Result<()> {
    match Args::parse().command {
        Command::Check {
            fixtures,
            device,
            only,
        } => check(&fixtures, &parse_device(&device)?, &only),
        #[cfg(feature = "cuda")]
        Command::Jit { model, device } => jit_report::report(&model, &parse_device(&device)?),
        #[cfg(feature = "cuda")]
        Command::Attention { windows, device } => {
            let device = parse_device(&device)?;
            windows
                .iter()
                .try_for_each(|&w| attention_check::timing(&device, w))
        }
        #[cfg(feature = "cuda")]
        Command::Fp8Algos {
            fast_accum,
            count,
            device,
        } => fp8_gemm_check::survey(&parse_device(&device)?, fast_accum, count),
        #[cfg(feature = "cuda")]
        Command::Norms { tokens, device } => norm_bench::run(&parse_device(&device)?, tokens),
        #[cfg(feature = "cuda")]
        Command::MoeGemm {
            experts,
            rows,
            group,
            device,
        } => moe_gemm_bench::run(&parse_device(&device)?, experts, &rows, group),
        Command::Speed {
            shape,
            formats,
            batch,
            ctx,
            iters,
            dtype,
            device,
            attention,
            profile,
            against_f32,
            invariance,
            routed_row_mib,
        } => {
            if let Some(mib) = routed_row_mib {
                exactscore_server::model::blocks::set_routed_row_bytes(mib << 20);
            }
            speed(
                &shape,
                &formats,
                &batch,
                ctx,
                iters,
                parse_dtype(&dtype)?,
                &parse_device(&device)?,
                &attention
                    .iter()
                    .map(|a| parse_attention(a))
                    .collect::<Result<Vec<_>>>()?,
                SpeedReport {
                    profile,
                    against_f32,
                    invariance,
                },
            )
        }
        Command::Kld {
            shape,
            format,
            batch,
            ctx,
            iters,
            dtype,
            device,
            min_ratio,
        } => kld_bench::speed(
            &shape,
            &format,
            &batch,
            ctx,
            iters,
            parse_dtype(&dtype)?,
            &parse_device(&device)?,
            min_ratio,
        ),
        Command::Diff {
            shape,
            format,
            windows,
            ctx,
            iters,
            modules,
            dtype,
            device,
            min_ratio,
        } => diff_bench::speed(
            &shape,
            &format,
            windows,
            ctx,
            iters,
            modules,
            parse_dtype(&dtype)?,
            &parse_device(&device)?,
            min_ratio,
        ),
        Command::Pipeline {
            shape,
            formats,
            layouts,
            windows,
            ctx,
            iters,
            dtype,
            distinct_layers,
            min_ratio,
            reference_shape,
            reference_format,
            reference_layout,
            reference_split,
        } => pipeline_bench::run(&pipeline_bench::PipelineRun {
            shape,
            formats,
            layouts: layouts.split(';').map(str::to_string).collect(),
            windows,
            ctx,
            iters,
            dtype: parse_dtype(&dtype)?,
            distinct_layers,
            min_ratio,
            reference: reference_shape.map(|shape| pipeline_bench::ReferenceRun {
                shape,
                format: reference_format,
                layout: reference_layout,
                split: reference_split,
            }),
        }),
        Command::Plan {
            config,
            shape,
            format,
            gpus,
            gpu_gib,
            batch_tokens,
            max_seq,
        } => memory_plan::run(
            &match (config, shape) {
                (Some(path), _) => memory_plan::Planned::read(&path)?,
                (None, shape) => memory_plan::Planned::shape(&shape.unwrap_or_default())?,
            },
            &memory_plan::Request {
                format: &format,
                gpus,
                gpu_gib,
                batch_tokens,
                max_seq,
            },
        ),
        Command::WriteCheckpoint {
            shape,
            format,
            out,
            tokenizer,
            distinct_layers,
        } => write_checkpoint(&shape, &format, distinct_layers, &out, &tokenizer),
    }
}

fn write_checkpoint(
    shape: &str,
    format: &str,
    distinct_layers: Option<usize>,
    out: &Path,
    tokenizer: &Path,
) -> Result<()> {
    let shape = random_model::Shape::named(shape)?;
    let t = Instant::now();
    random_model::write(&shape, format, distinct_layers, out)?;
    let copy = |file: &str| {
        let src = tokenizer.join(file);
        std::fs::copy(&src, out.join(file)).with_context(|| format!("copying {}", src.display()))
    };
    copy("tokenizer.json")?;
    if tokenizer.join("tokenizer_config.json").exists() {
        copy("tokenizer_config.json")?;
    }
    println!(
        "wrote {} ({format}) to {} in {:.1} s",
        shape.name,
        out.display(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

fn parse_device(s: &str) -> Result<Device> {
    Ok(match s {
        "cpu" => Device::Cpu,
        s => match s.strip_prefix("cuda:") {
            Some(i) => exactscore_server::device::cuda(i.parse()?)?,
            None => bail!("device `{s}`: expected cpu or cuda:N"),
        },
    })
}

fn parse_dtype(s: &str) -> Result<DType> {
    Ok(match s {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => bail!("dtype `{other}`: expected f32, bf16 or f16"),
    })
}

fn parse_attention(s: &str) -> Result<AttentionKernel> {
    Ok(match s {
        "materialized" => AttentionKernel::Materialized,
        "flash" => AttentionKernel::Flash,
        other => bail!("attention `{other}`: expected materialized or flash"),
    })
}

fn options(
    device: &Device,
    dtype: DType,
    act: ActivationQuantMode,
    max_seq_len: usize,
    attention: AttentionKernel,
) -> ModelOptions {
    ModelOptions {
        linear: LinearOptions {
            device: device.clone(),
            dtype,
            activation_quant: act,
            kv_cache: Default::default(),
            fp8_matmul: Default::default(),
            fused_fp8_scales: Default::default(),
        },
        max_seq_len,
        attention,
    }
}

// ---- check ---------------------------------------------------------------------------------

fn sequences(reference: &Value) -> Vec<Vec<u32>> {
    reference["sequences"]
        .as_array()
        .map(|seqs| {
            seqs.iter()
                .map(|s| {
                    s["token_ids"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|t| t.as_u64().unwrap() as u32)
                        .collect()
                })
                .collect()
        })
        .unwrap_or_default()
}

fn score(model: &Model, seqs: &[Vec<u32>]) -> Result<Vec<SequenceScores>> {
    let batch: Vec<ScoreInput> = seqs
        .iter()
        .map(|t| ScoreInput {
            stored: exactscore_server::model::StoredRequest::NONE,
            tokens: t,
            top_k: 5,
        })
        .collect();
    Ok(model.score(&batch)?)
}

/// (max, mean) of per-token |Δlogprob|.
fn diff(a: &[SequenceScores], b: &[SequenceScores]) -> (f64, f64) {
    let d: Vec<f64> = a
        .iter()
        .zip(b)
        .flat_map(|(x, y)| {
            x.token_logprobs()
                .zip(y.token_logprobs())
                .map(|(p, q)| (p as f64 - q as f64).abs())
                .collect::<Vec<_>>()
        })
        .collect();
    (
        d.iter().copied().fold(0.0, f64::max),
        d.iter().sum::<f64>() / d.len().max(1) as f64,
    )
}

/// Fraction of rows whose argmax id, and whose top-k id list, agree between two runs.
fn ranking_agreement(a: &[SequenceScores], b: &[SequenceScores]) -> (f64, f64) {
    let rows: Vec<_> = a
        .iter()
        .zip(b)
        .flat_map(|(x, y)| x.rows.iter().zip(&y.rows))
        .collect();
    let share = |same: usize| same as f64 / rows.len().max(1) as f64;
    let argmax = rows
        .iter()
        .filter(|(x, y)| x.argmax.0 == y.argmax.0)
        .count();
    let ids =
        |r: &exactscore_server::model::RowScore| r.top_k.iter().map(|t| t.0).collect::<Vec<_>>();
    let top_k = rows.iter().filter(|(x, y)| ids(x) == ids(y)).count();
    (share(argmax), share(top_k))
}

fn bits_equal(a: &Tensor, b: &Tensor) -> Result<bool> {
    let a = a
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let b = b
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok(a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()))
}

/// Every fixture `check` scores on the device.
const CHECKED: &[&str] = &[
    "llama-dense-bf16",
    "llama-w4a16-g128",
    "llama-w4a16-asym-g64",
    "llama-w8a16-channel",
    "llama-nvfp4a16",
    "llama-nvfp4",
    "llama-fp8-dynamic",
    // native GPTQ (held as pack-quantized int), act-order (g_idx), MXFP4 (as NVFP4 scales)
    "llama-gptq-int4-g128",
    "llama-gptq-v2-int3-actorder-asym",
    "llama-gptq-dynamic",
    "llama-w4a16-actorder-g64",
    "llama-mxfp4a16",
    // Hugging Face FP8 with 128 x 128 block scales
    "llama-fp8-block",
    "llama-fp8-block-ue8m0",
    // native AWQ (held as pack-quantized int4 with zero points)
    "llama-awq-int4-g64",
    "llama-autoround-int4-g64-sym",
    "llama-autoround-awq-int4-g64",
    "qwen3moe-w4a16-g32",
    "qwen3moe-fp8-dynamic",
    "qwen3moe-nvfp4",
    "mixtral-w4a16-g32",
    "gemma3-dense-bf16",
    "gemma3-w4a16-g32",
    "gemma3-nvfp4a16",
    "gemma2-dense-bf16",
    "gemma2-w4a16-g32",
    // Qwen3.5 / Qwen3.5-MoE / Qwen3-Next (hybrid linear attention)
    "qwen3_5-w4a16-g32",
    "qwen3_5-w4a16-g32-linattn",
    "qwen3_5-nvfp4",
    "qwen3_5_moe-w4a16-g32",
    "qwen3_5_moe-fp8-dynamic",
    "qwen3_next-w4a16-g32",
    "qwen3_next-fp8-dynamic",
    // MLA and DeepSeek-style routing (sigmoid, correction bias, groups)
    "deepseek_v3-w4a16-g32",
    "deepseek_v3-fp8-dynamic",
    "glm4_moe_lite-w4a16-g32",
    "glm4_moe-w4a16-g32",
    "deepseek_v2-w4a16-g32",
    "deepseek_v2-fp8-dynamic",
    "mistral4-w4a16-g32",
    // gpt-oss: attention sinks (materialized), clamped SwiGLU experts in bf16 and native MXFP4
    "gpt_oss-dense-bf16",
    "gpt_oss-mxfp4",
    // compressed-tensors W8A8-INT8 (int8 per-token activations) and FP8 static per tensor
    // (fused shards requantized as vLLM serves them); ModelOpt NVFP4 and FP8
    "llama-w8a8-int8",
    "llama-fp8-static-tensor",
    "llama-modelopt-nvfp4",
    "llama-modelopt-fp8",
    "llama-modelopt-mixed",
    // quantized and exported by nvidia-modelopt 0.47 itself
    "llama-modelopt-export-nvfp4",
    "llama-modelopt-export-fp8",
    // an fp8 KV-cache scheme, per tensor and per KV head (emulated: the default)
    "llama-kv-fp8-tensor",
    "llama-kv-fp8-head",
    // Gemma 4 (per-layer inputs, KV-shared layers, MoE; materialized attention)
    "gemma4-w4a16-g32",
    "gemma4-nvfp4a16",
    "gemma4_moe-w4a16-g32",
];

fn check(fixtures: &Path, device: &Device, only: &[String]) -> Result<()> {
    let mut rows = Vec::new();
    let mut tensor_core_rows = Vec::new();
    let mut failures = 0;
    let chosen = |variant: &str| only.is_empty() || only.iter().any(|o| o == variant);
    let others = only
        .iter()
        .map(String::as_str)
        .filter(|o| !CHECKED.contains(o));
    let variants: Vec<&str> = CHECKED
        .iter()
        .copied()
        .filter(|v| chosen(v))
        .chain(others)
        .collect();
    for &variant in &variants {
        // A fixture whose check cannot run (a model without GPU kernels yet) is one failure
        // row; the others are still checked.
        let mut one = || -> Result<()> {
            let dir = fixtures.join(variant);
            let reference: Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json"))?)?;
            let config = exactscore_server::model::ModelConfig::from_json(
                &std::fs::read_to_string(dir.join("config.json"))?,
            )?;
            // The flash kernel cannot soft-cap scores (Gemma 2) nor add sinks (gpt-oss), and
            // exists only on a GPU: models without it have only the materialized kernel, whose
            // bf16 rows then stand in for the flash columns.
            let flash = config.flash_attention_possible()
                && exactscore_server::ops::flash_attention_available(
                    device,
                    config.attention_head_dim(),
                    DType::BF16,
                );
            let seqs = sequences(&reference);
            // Activation-quantized fixtures: their reference has a weights-only run beside the
            // emulated one (the compressed-tensors fixtures) or an emulated one beside the
            // weights-only `sequences` (the Hugging Face FP8 fixture).
            let has_act = reference.get("weights_only").is_some()
                || reference.get("reference_emulated").is_some();
            // A KV-cache scheme is emulated by default: its fp8 roundings flip with the last
            // bits upstream, as activation QDQ does, so such rows are reported, not judged per
            // token (f32 on an H100: 3.0e-4 and 1.0e-2 max, 2.4e-6 and 2.1e-5 mean).
            let config_json: Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
            let kv_emulated = config_json["quantization_config"]["kv_cache_scheme"].is_object();
            let modes: &[ActivationQuantMode] = if has_act {
                &[ActivationQuantMode::Off, ActivationQuantMode::Emulate]
            } else {
                &[ActivationQuantMode::Emulate]
            };
            // The activation QDQ the emulated CPU model applies (the QDQ vectors' scheme).
            let mut emulated_qdq = None;
            for &act in modes {
                let load = |device: &Device, dtype, attention| {
                    Model::load(&dir, &options(device, dtype, act, 512, attention))
                };
                let cpu = load(&Device::Cpu, DType::F32, AttentionKernel::Materialized)?;
                if act == ActivationQuantMode::Emulate {
                    emulated_qdq = cpu
                        .linears()
                        .iter()
                        .find_map(|(_, l)| l.activation().cloned());
                }
                let gpu32 = load(device, DType::F32, AttentionKernel::Materialized)?;
                let gpu16 = load(device, DType::BF16, AttentionKernel::Materialized)?;
                let flash16 = match flash {
                    true => load(device, DType::BF16, AttentionKernel::Flash)?,
                    false => load(device, DType::BF16, AttentionKernel::Materialized)?,
                };
                let cpu_scores = score(&cpu, &seqs)?;
                let g32 = score(&gpu32, &seqs)?;
                let g16 = score(&gpu16, &seqs)?;
                let f16 = score(&flash16, &seqs)?;
                let (max32, mean32) = diff(&g32, &cpu_scores);
                let (max16, mean16) = diff(&g16, &cpu_scores);
                let (max_flash, mean_flash) = diff(&f16, &cpu_scores);
                // Where bf16 multiplies fp8 layers on the tensor cores, the emulated bf16 path's
                // error beside theirs.
                if gpu16.linears().iter().any(|(_, l)| l.on_fp8_tensor_cores()) {
                    let attention = AttentionKernel::Materialized;
                    let mut errors = Vec::new();
                    for fp8_matmul in [Fp8Matmul::TensorCoresFastAccum, Fp8Matmul::Emulated] {
                        let mut opts = options(device, DType::BF16, act, 512, attention);
                        opts.linear.fp8_matmul = fp8_matmul;
                        let scores = score(&Model::load(&dir, &opts)?, &seqs)?;
                        let (max, mean) = diff(&scores, &cpu_scores);
                        errors.push(format!("{max:.2e} / {mean:.2e}"));
                    }
                    tensor_core_rows.push(format!(
                        "| {variant} act={act:?} | {max16:.2e} / {mean16:.2e} | {} |",
                        errors.join(" | ")
                    ));
                }
                // Greedy flags and top-k come from the same GPU rows: their ids must match the CPU.
                let (argmax_agree, top_k_agree) = ranking_agreement(&g32, &cpu_scores);
                let ref_bf16_mean = reference["bf16_run"]["diff_stats_vs_f32"]["mean"]
                    .as_f64()
                    .unwrap_or(f64::NAN);
                // Batch invariance: each sequence alone vs inside the batch (bitwise, and max |Δ|).
                let (mut bitwise, mut inv32, mut inv16) = (true, 0f64, 0f64);
                let mut flash_bitwise = true;
                for (i, s) in seqs.iter().enumerate() {
                    let (a32, a16) = (
                        score(&gpu32, std::slice::from_ref(s))?,
                        score(&gpu16, std::slice::from_ref(s))?,
                    );
                    bitwise &= a32[0] == g32[i] && a16[0] == g16[i];
                    flash_bitwise &= score(&flash16, std::slice::from_ref(s))?[0] == f16[i];
                    inv32 = inv32.max(diff(&a32, &g32[i..=i]).0);
                    inv16 = inv16.max(diff(&a16, &g16[i..=i]).0);
                }
                // A batch of over 4096 tokens (the MLP's 2048-row chunks cut through sequences).
                let mut long = Vec::new();
                while long.iter().map(Vec::len).sum::<usize>() <= 4096 {
                    long.extend(seqs.iter().cloned());
                }
                let long_scores = score(&flash16, &long)?;
                flash_bitwise &= (0..long.len()).all(|i| long_scores[i] == f16[i % seqs.len()]);
                // A mixture's experts planned on the host instead of the GPU: the same bits.
                exactscore_server::model::blocks::plan_experts_on_device(false);
                let host_planned = score(&flash16, &seqs);
                exactscore_server::model::blocks::plan_experts_on_device(true);
                flash_bitwise &= host_planned? == f16;
                // Dequantization on the device vs the CPU reference, bit for bit.
                let mut dequant_exact = true;
                for (_, linear) in gpu32.linears() {
                    let w = linear.weight();
                    let gpu_w = w.dequantize(DType::F32, device)?;
                    let (o, i) = w.shape();
                    let cpu_w = Tensor::from_vec(w.dequantize_f32()?, (o, i), &Device::Cpu)?;
                    dequant_exact &= bits_equal(&gpu_w, &cpu_w)?;
                }
                // Weights of one shape and format dequantized in one launch (a mixture's experts,
                // stacked) vs one at a time, bit for bit, in both compute dtypes.
                let mut same_kind: std::collections::BTreeMap<_, Vec<_>> = Default::default();
                let mut stacked_gemm_error = 0f32;
                for (_, linear) in gpu32.linears() {
                    let w = linear.weight();
                    same_kind
                        .entry((w.shape(), w.describe()))
                        .or_default()
                        .push(linear);
                }
                for linears in same_kind.values().filter(|l| l.len() > 1) {
                    let linears = &linears[..linears.len().min(16)];
                    for dtype in [DType::F32, DType::BF16] {
                        let stacked =
                            exactscore_server::quant::dequantize_stacked(linears, dtype, device)?;
                        let each = linears
                            .iter()
                            .map(|l| l.weight().dequantize(dtype, device))
                            .collect::<candle_core::Result<Vec<_>>>()?;
                        dequant_exact &= bits_equal(&stacked, &Tensor::stack(&each, 0)?)?;
                    }
                    // The stacked GEMM in bf16 against f32 products of the same weights: 37 rows
                    // each, or, where the int4 weights decode inside the GEMM (which takes each
                    // weight's own count), 0..210 rows, so that every tiling and tail runs.
                    let g = linears.len();
                    let (n, k) = linears[0].weight().shape();
                    let rows: Vec<usize> =
                        if exactscore_server::quant::decodes_in_gemm(linears, 100, DType::BF16)? {
                            (0..g).map(|i| (i * 53 + 37) % 211).collect()
                        } else {
                            vec![37; g]
                        };
                    let total: usize = rows.iter().sum();
                    let x = Tensor::randn(0f32, 1.0, (total, k), device)?.to_dtype(DType::BF16)?;
                    let out = Tensor::zeros((total, n), DType::BF16, device)?;
                    exactscore_server::quant::matmul_t_stacked_into_rows(
                        linears,
                        &x,
                        exactscore_server::ops::StackRows::Counts(&rows),
                        &out,
                        0,
                    )?;
                    let w =
                        exactscore_server::quant::dequantize_stacked(linears, DType::F32, device)?;
                    let x32 = x.to_dtype(DType::F32)?;
                    let mut blocks = Vec::with_capacity(g);
                    let mut first = 0;
                    for (i, &r) in rows.iter().enumerate() {
                        blocks.push(x32.narrow(0, first, r)?.matmul(&w.get(i)?.t()?)?);
                        first += r;
                    }
                    let reference = Tensor::cat(&blocks, 0)?;
                    let scale = reference.abs()?.max_all()?.to_scalar::<f32>()?;
                    let error = (out.to_dtype(DType::F32)? - &reference)?
                        .abs()?
                        .max_all()?
                        .to_scalar::<f32>()?;
                    stacked_gemm_error =
                        stacked_gemm_error.max(error / scale.max(f32::MIN_POSITIVE));
                }
                let label = format!(
                    "{variant}{}{}",
                    if has_act {
                        format!(" act={act:?}")
                    } else {
                        String::new()
                    },
                    if flash { "" } else { " (no flash)" }
                );
                let label = match kv_emulated {
                    true => format!("{label} kv=Emulate"),
                    false => label,
                };
                let weights_only = (!has_act || act == ActivationQuantMode::Off) && !kv_emulated;
                // Weights-only: f32 within 1e-4 of the CPU, alone vs batched within 1e-4, bf16 error
                // within the reference's own bf16-vs-f32 spread (+50 %). Activation-quantized rows
                // are reported, not judged per token (rounding flips, see README). Every dense
                // row: a sequence's scores are the same bits alone and batched, in f32 and bf16,
                // and with flash in batches of any length. A mixture of experts multiplies each
                // expert's rows in one GEMM, whose row count changes with the batch: judged on
                // the flash kernel (the GPU's default), its materialized bf16 column reported
                // (`qwen3_5_moe-fp8-dynamic` with emulation moved by 8.6e-6 there in one run of
                // two).
                let sparse = config.moe.is_some();
                let ok = dequant_exact
                    && stacked_gemm_error <= 1e-2
                    && flash_bitwise
                    && (bitwise || sparse)
                    && (!weights_only
                        || (max32 <= 1e-4
                            && inv32 <= 1e-4
                            && argmax_agree >= 0.99
                            && top_k_agree >= 0.99
                            // fixtures without a bf16 reference run (the other formats'):
                            // bf16 reported, f32 and the dequantization judged
                            && (ref_bf16_mean.is_nan()
                                || (mean16 <= 1.5 * ref_bf16_mean
                                    && mean_flash <= 1.5 * ref_bf16_mean))));
                failures += usize::from(!ok);
                rows.push(format!(
                "| {label:<38} | {max32:9.2e} | {mean32:9.2e} | {:5.1}% / {:5.1}% | {max16:9.2e} | {mean16:9.2e} | {max_flash:9.2e} | {mean_flash:9.2e} | {ref_bf16_mean:9.2e} | {inv32:8.1e} / {inv16:8.1e} | {bitwise:5} / {flash_bitwise:5} | {dequant_exact:5} | {stacked_gemm_error:8.1e} | {} |",
                100.0 * argmax_agree,
                100.0 * top_k_agree,
                if ok { "ok" } else { "FAIL" }
            ));
            }
            if has_act && dir.join("act_qdq_vectors.safetensors").exists() {
                let scheme = emulated_qdq
                    .with_context(|| format!("{variant}: no Linear quantizes its activations"))?;
                let (row, exact) = qdq_row(&dir, variant, &scheme, device)?;
                failures += usize::from(!exact);
                rows.push(row);
            }
            Ok(())
        };
        if let Err(e) = one() {
            failures += 1;
            rows.push(format!("| {variant:<38} | error: {e} | FAIL |"));
        }
    }
    println!("All |Δ| are per-token log-prob differences against the CPU f32 path. (no flash): the model has only the materialized kernel, whose bf16 rows fill the flash columns. Every row fails unless each sequence scores the same bits alone and batched through the flash kernel (the GPU default), with a mixture's experts planned on the GPU or the host, and, for dense models, the materialized one; mixture-of-experts rows report the materialized column without judging it.");
    println!("| variant | f32 max |Δ| | f32 mean | f32 argmax / top-5 ids = CPU | bf16 max |Δ| | bf16 mean | bf16 flash max |Δ| | bf16 flash mean | reference bf16 mean | alone vs batched max |Δ| f32 / bf16 | bitwise (flash) | dequant bitwise | stacked GEMM bf16 max rel | |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!("{r}");
    }
    if !tensor_core_rows.is_empty() {
        println!("bf16 per-token |Δ| against the CPU f32 path of fp8 layers on the tensor cores (f32 sums: the rows above; fast accumulation) and emulated (`--fp8-matmul emulated`), max / mean:");
        println!("| variant | tensor cores | fast accumulation | emulated |");
        println!("|---|---|---|---|");
        for r in tensor_core_rows {
            println!("{r}");
        }
    }
    failures += kld_bench::check(fixtures, device)?;
    failures += diff_bench::check(fixtures, device)?;
    if device.is_cuda() {
        failures += stored_reference_check::run(device)?;
        failures += qdq_check::run(device)?;
    }
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        if let Err(e) = attention_check::run(device) {
            failures += 1;
            println!("{e}");
        }
        failures += usize::from(!gemm_f32_check(device)?);
        failures += usize::from(!linear_attention_check(device)?);
        failures += mla_inputs_check::run(device)?;
        failures += head_norm_check::run(device)?;
        failures += fp8_gemm_check::run(device)?;
    }
    if failures > 0 {
        bail!("{failures} check(s) failed");
    }
    Ok(())
}

/// Milliseconds per call of `f` on `device`: the mean of ten after one to warm up.
#[cfg(feature = "cuda")]
fn time_ms(device: &Device, f: &dyn Fn() -> candle_core::Result<Tensor>) -> Result<f64> {
    f()?;
    device.synchronize()?;
    let start = Instant::now();
    for _ in 0..10 {
        f()?;
    }
    device.synchronize()?;
    Ok(start.elapsed().as_secs_f64() / 10.0 * 1e3)
}

/// The f32 GEMM kernel of the Linears: bitwise equal to its CPU reference (a fused
/// multiply-add chain over k per output), every row alone equal to the same row among 300
/// (row counts 1..=130, with edges of both dimensions inside tiles; 2100 and 5003 rows for a
/// router's narrow kernels), and its time against cuBLAS's on the Llama-3-8B MLP shape and a
/// router's.
#[cfg(feature = "cuda")]
fn gemm_f32_check(device: &Device) -> Result<bool> {
    use exactscore_server::ops::gemm::matmul_t_sequential_fma;
    let (mut reference_exact, mut invariant) = (true, true);
    // (64, 2048) and (48, 130): the narrow kernel (a router's 64 experts), with and without
    // float4 loads.
    for (n, k) in [(200, 130), (257, 1000), (1024, 4096), (64, 2048), (48, 130)] {
        let x = Tensor::randn(0f32, 1.0, (300, k), device)?;
        let w = Tensor::randn(0f32, 1.0, (n, k), device)?;
        let all = exactscore_server::cuda::gemm::matmul_t_f32(&x, &w)?;
        let cpu = matmul_t_sequential_fma(
            &x.flatten_all()?.to_vec1::<f32>()?,
            &w.flatten_all()?.to_vec1::<f32>()?,
            (300, n, k),
        );
        reference_exact &= bits_equal(&all, &Tensor::from_vec(cpu, (300, n), &Device::Cpu)?)?;
        for rows in 1..=130 {
            let part =
                exactscore_server::cuda::gemm::matmul_t_f32(&x.narrow(0, 300 - rows, rows)?, &w)?;
            invariant &= bits_equal(&part, &all.narrow(0, 300 - rows, rows)?)?;
        }
        if n <= 64 {
            // Longer batches take the narrow kernels of 2 and 4 rows per thread: the same
            // bits as the reference, and their last 300 rows as those rows alone.
            for m in [2100, 5003] {
                let x_long = Tensor::randn(0f32, 1.0, (m, k), device)?;
                let long = exactscore_server::cuda::gemm::matmul_t_f32(&x_long, &w)?;
                let cpu = matmul_t_sequential_fma(
                    &x_long.flatten_all()?.to_vec1::<f32>()?,
                    &w.flatten_all()?.to_vec1::<f32>()?,
                    (m, n, k),
                );
                reference_exact &=
                    bits_equal(&long, &Tensor::from_vec(cpu, (m, n), &Device::Cpu)?)?;
                // every narrow tiling: the same bits
                for tiling in exactscore_server::cuda::gemm::NARROW_TILINGS {
                    let tiled =
                        exactscore_server::cuda::gemm::matmul_t_f32_tiled(&x_long, &w, tiling)?;
                    reference_exact &= bits_equal(&tiled, &long)?;
                }
                let tail = x_long.narrow(0, m - 300, 300)?;
                let alone = exactscore_server::cuda::gemm::matmul_t_f32(&tail, &w)?;
                invariant &= bits_equal(&alone, &long.narrow(0, m - 300, 300)?)?;
                // bf16 / f16 rows read as f32 inside the kernel = cast first
                for dtype in [DType::BF16, DType::F16] {
                    let half = x_long.to_dtype(dtype)?;
                    let direct = exactscore_server::cuda::gemm::matmul_t_f32(&half, &w)?;
                    let cast = exactscore_server::cuda::gemm::matmul_t_f32(
                        &half.to_dtype(DType::F32)?,
                        &w,
                    )?;
                    reference_exact &= bits_equal(&direct, &cast)?;
                }
            }
        }
    }
    let (m, n, k) = (2048, 14336, 4096);
    let x = Tensor::randn(0f32, 1.0, (m, k), device)?;
    let w = Tensor::randn(0f32, 1.0, (n, k), device)?;
    let time = |f: &dyn Fn() -> candle_core::Result<Tensor>| time_ms(device, f);
    let ours = time(&|| exactscore_server::cuda::gemm::matmul_t_f32(&x, &w))?;
    let cublas = time(&|| x.matmul(&w.t()?))?;
    let tflops = |ms: f64| 2.0 * (m * n * k) as f64 / ms / 1e9;
    // A DeepSeek-style f32 router over one window: 64 experts, hidden 2048.
    let router = Tensor::randn(0f32, 1.0, (64, 2048), device)?;
    let hidden = Tensor::randn(0f32, 1.0, (2048, 2048), device)?;
    let router_ms = time(&|| exactscore_server::cuda::gemm::matmul_t_f32(&hidden, &router))?;
    let router_cublas = time(&|| hidden.matmul(&router.t()?))?;
    let batch = Tensor::randn(0f32, 1.0, (16384, 2048), device)?;
    let batch_ms = time(&|| exactscore_server::cuda::gemm::matmul_t_f32(&batch, &router))?;
    let batch_cublas = time(&|| batch.matmul(&router.t()?))?;
    println!(
        "| f32 GEMM kernel: = CPU reference bitwise {reference_exact}; rows alone = rows among \
         300, 1..=130 rows, bitwise {invariant}; [{m}, {k}] x [{n}, {k}]ᵀ: {ours:.2} ms \
         ({:.1} TFLOP/s) vs cuBLAS {cublas:.2} ms ({:.1} TFLOP/s); router [2048, 2048] x \
         [64, 2048]ᵀ: {router_ms:.3} ms vs cuBLAS {router_cublas:.3} ms; [16384, 2048]: \
         {batch_ms:.3} ms vs cuBLAS {batch_cublas:.3} ms |",
        tflops(ours),
        tflops(cublas)
    );
    // Each narrow tiling on a router's bf16 rows, one window and eight.
    let mut tilings = String::new();
    for tiling in exactscore_server::cuda::gemm::NARROW_TILINGS {
        let ms = [&hidden, &batch].map(|x| {
            let x = x.to_dtype(DType::BF16)?;
            time(&|| exactscore_server::cuda::gemm::matmul_t_f32_tiled(&x, &router, tiling))
        });
        let [one, eight] = ms;
        tilings += &format!(" {}x{} {:.3} / {:.3};", tiling.0, tiling.1, one?, eight?);
    }
    println!("| router GEMM from bf16 rows by narrow tiling (rows x columns a thread), ms at 2048 / 16384 rows:{tilings} |");
    router_timing(device, &batch, &router)?;
    Ok(reference_exact && invariant)
}

/// The pieces of a DeepSeek-style router's stage on `hidden` (bf16 in the model) and its f32
/// weight `router` (64 experts, sigmoid, top 4 of one group, as GLM-4.7-Flash routes): the cast
/// to f32 and the GEMM, or the GEMM from the bf16 rows, the choice on the device, and the choice
/// read back as the host plan reads it.
#[cfg(feature = "cuda")]
fn router_timing(device: &Device, hidden: &Tensor, router: &Tensor) -> Result<()> {
    use exactscore_server::ops::{self, GroupScore, GroupedRouting, RouterScores};
    let routing = GroupedRouting {
        k: 4,
        n_group: 1,
        topk_group: 1,
        norm: true,
        routed_scaling_factor: 1.8,
        scores: RouterScores::Sigmoid,
        group_score: GroupScore::TopTwoSum,
    };
    let bias = Tensor::randn(0f32, 0.01, router.dims()[0], device)?;
    let x = hidden.to_dtype(DType::BF16)?;
    let logits = exactscore_server::cuda::gemm::matmul_t_f32(hidden, router)?;
    let time = |f: &dyn Fn() -> candle_core::Result<Tensor>| time_ms(device, f);
    let cast = time(&|| x.to_dtype(DType::F32))?;
    let gemm = time(&|| exactscore_server::cuda::gemm::matmul_t_f32(hidden, router))?;
    let from_bf16 = time(&|| exactscore_server::cuda::gemm::matmul_t_f32(&x, router))?;
    let choice = time(&|| {
        ops::moe_route_grouped_on_device(&logits, Some(&bias), &routing).map(|(ids, _)| ids)
    })?;
    let read_back = time(&|| {
        let top = ops::moe_route_grouped(&logits, Some(&bias), &routing)?;
        Tensor::new(top.weights.as_slice(), &Device::Cpu)
    })?;
    println!(
        "| router of {} tokens, ms: bf16 -> f32 {cast:.3}, GEMM {gemm:.3} (from the bf16 rows \
         {from_bf16:.3}), sigmoid + choice on the device {choice:.3}, the same read back for \
         the host plan {read_back:.3} |",
        hidden.dims()[0]
    );
    Ok(())
}

/// The linear-attention ops on the device against the CPU reference: the causal conv1d, and
/// the gated delta rule (token by token on the GPU, chunked on the CPU) at lengths that do and
/// do not fill the 64-token chunks, with grouped key heads, on batches of two sequences (the
/// GPU runs them in one launch, the CPU one after the other); within 2e-5 relative. Each
/// sequence of a batch bitwise equal to it alone on the GPU. Also the time of one
/// Qwen3.5-35B-A3B layer's delta rule over 2048 tokens, alone and 8 sequences in one launch.
#[cfg(feature = "cuda")]
fn linear_attention_check(device: &Device) -> Result<bool> {
    use exactscore_server::ops::linear_attention::{
        causal_conv1d_tensor, conv_qkv, gated_delta_rule, ConvActivation,
    };
    let rel = |a: &Tensor, b: &Tensor| -> Result<f32> {
        let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
        let error = (a.to_device(&Device::Cpu)? - b)?.abs()?.max_all()?;
        Ok(error.to_scalar::<f32>()? / scale)
    };
    let inputs = |tokens, k_heads, v_heads, k_dim, v_dim| -> Result<Vec<Tensor>> {
        let q = Tensor::randn(0f32, 1.0, (tokens, k_heads, k_dim), &Device::Cpu)?;
        let k = Tensor::randn(0f32, 1.0, (tokens, k_heads, k_dim), &Device::Cpu)?;
        let v = Tensor::randn(0f32, 1.0, (tokens, v_heads, v_dim), &Device::Cpu)?;
        // decays in (-1.5, 0) and betas in (0, 1), as the layer's gates give them
        let g = (Tensor::rand(0f32, 1.0, (tokens, v_heads), &Device::Cpu)? * -1.5)?;
        let beta = Tensor::rand(0f32, 1.0, (tokens, v_heads), &Device::Cpu)?;
        Ok(vec![q, k, v, g, beta])
    };
    let to_device = |x: &[Tensor]| -> Result<Vec<Tensor>> {
        Ok(x.iter()
            .map(|t| t.to_device(device))
            .collect::<candle_core::Result<_>>()?)
    };
    let host = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.flatten_all()?.to_vec1::<f32>()?) };
    let (mut worst_delta, mut isolated) = (0f32, true);
    for (tokens, k_heads, v_heads, k_dim, v_dim) in [
        (1, 1, 1, 32, 8),
        (200, 2, 4, 128, 64),
        (300, 4, 4, 64, 128),
        (130, 1, 2, 256, 32),
    ] {
        let x = inputs(tokens, k_heads, v_heads, k_dim, v_dim)?;
        let lens = [tokens / 3, tokens - tokens / 3];
        let lens: Vec<usize> = lens.into_iter().filter(|&l| l > 0).collect();
        let cpu = gated_delta_rule(&x[0], &x[1], &x[2], &x[3], &x[4], true, &lens)?;
        let on = to_device(&x)?;
        let gpu = gated_delta_rule(&on[0], &on[1], &on[2], &on[3], &on[4], true, &lens)?;
        worst_delta = worst_delta.max(rel(&gpu, &cpu)?);
        let last = lens[lens.len() - 1];
        let tail: Vec<Tensor> = on
            .iter()
            .map(|t| t.narrow(0, tokens - last, last))
            .collect::<candle_core::Result<_>>()?;
        let alone = gated_delta_rule(
            &tail[0],
            &tail[1],
            &tail[2],
            &tail[3],
            &tail[4],
            true,
            &[last],
        )?;
        isolated &= host(&alone)? == host(&gpu.narrow(0, tokens - last, last)?)?;
    }
    let x = Tensor::randn(0f32, 1.0, (300, 96), &Device::Cpu)?;
    let w = Tensor::randn(0f32, 0.5, (96, 1, 4), &Device::Cpu)?;
    let bias = Tensor::randn(0f32, 0.5, 96, &Device::Cpu)?;
    let mut conv = 0f32;
    for (bias, act) in [
        (None, ConvActivation::Silu),
        (Some(&bias), ConvActivation::Identity),
    ] {
        let lens = [100, 1, 199];
        let cpu = causal_conv1d_tensor(&x, &w, bias, act, &lens)?;
        let on_device = bias.map(|b| b.to_device(device)).transpose()?;
        let (xd, wd) = (x.to_device(device)?, w.to_device(device)?);
        let gpu = causal_conv1d_tensor(&xd, &wd, on_device.as_ref(), act, &lens)?;
        conv = conv.max(rel(&gpu, &cpu)?);
        let alone = causal_conv1d_tensor(
            &xd.narrow(0, 101, 199)?,
            &wd,
            on_device.as_ref(),
            act,
            &[199],
        )?;
        isolated &= host(&alone)? == host(&gpu.narrow(0, 101, 199)?)?;
    }
    // the fused conv + rounding + split of a bf16 layer: at most one bf16 step from the CPU's
    // (SiLU's exp may differ in its last f32 bit)
    let qkv = Tensor::randn(0f32, 1.0, (300, 96), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let lens = [100, 1, 199];
    let (cpu_parts, gpu_parts) = (
        conv_qkv(&qkv, &w, 24, &lens)?,
        conv_qkv(&qkv.to_device(device)?, &w.to_device(device)?, 24, &lens)?,
    );
    let mut fused = 0f32;
    for (c, g) in [
        (&cpu_parts.0, &gpu_parts.0),
        (&cpu_parts.1, &gpu_parts.1),
        (&cpu_parts.2, &gpu_parts.2),
    ] {
        fused = fused.max(rel(g, c)?);
    }
    let mut ms = Vec::new();
    for sequences in [1, 8] {
        let on = to_device(&inputs(sequences * 2048, 16, 32, 128, 128)?)?;
        let lens = vec![2048; sequences];
        let run = || gated_delta_rule(&on[0], &on[1], &on[2], &on[3], &on[4], true, &lens);
        run()?;
        device.synchronize()?;
        let start = Instant::now();
        for _ in 0..10 {
            run()?;
        }
        device.synchronize()?;
        ms.push(start.elapsed().as_secs_f64() / 10.0 * 1e3 / sequences as f64);
    }
    let ok = worst_delta <= 2e-5 && conv <= 1e-6 && fused <= 1.0 / 128.0 && isolated;
    println!(
        "| linear attention on device vs CPU: gated delta rule max rel {worst_delta:.1e} \
         (<= 2e-5), conv1d max rel {conv:.1e} (<= 1e-6), bf16 conv_qkv max rel {fused:.1e} \
         (<= one bf16 step), a sequence batched = alone bitwise \
         {isolated}; delta rule [2048 tokens, 16/32 heads, 128/128] {:.2} ms alone, {:.2} ms \
         per sequence 8 in one launch | {} |",
        ms[0],
        ms[1],
        if ok { "ok" } else { "FAIL" }
    );
    Ok(ok)
}

/// The fixture's activation-QDQ vectors quantized on the device by `scheme` (the checkpoint's
/// emulated QDQ), bit for bit; an NVFP4 vector carries its own global scale.
fn qdq_row(
    dir: &Path,
    variant: &str,
    scheme: &ActivationQdq,
    device: &Device,
) -> Result<(String, bool)> {
    let v = candle_core::safetensors::load(dir.join("act_qdq_vectors.safetensors"), &Device::Cpu)?;
    let mut prefixes: Vec<&str> = v.keys().filter_map(|k| k.strip_suffix(".input")).collect();
    prefixes.sort_unstable();
    let mut exact = !prefixes.is_empty();
    for prefix in &prefixes {
        let qdq = match (scheme, v.get(&format!("{prefix}.input_global_scale"))) {
            (ActivationQdq::Nvfp4 { .. }, Some(g)) => ActivationQdq::Nvfp4 {
                global_scale: g.to_vec1::<f32>()?[0],
            },
            (ActivationQdq::Nvfp4 { .. }, None) => bail!("{variant}: {prefix} has no global scale"),
            (other, _) => other.clone(),
        };
        let input = v[&format!("{prefix}.input")].to_device(device)?;
        exact &= bits_equal(&qdq.apply(&input)?, &v[&format!("{prefix}.input_qdq")])?;
    }
    let row = format!(
        "| {variant} activation QDQ ({}) on device vs {} vectors: bit-exact = {exact} | {} |",
        scheme.describe(),
        prefixes.len(),
        if exact { "ok" } else { "FAIL" }
    );
    Ok((row, exact))
}

// ---- speed ---------------------------------------------------------------------------------

fn gpu_used_bytes() -> u64 {
    #[cfg(feature = "cuda")]
    {
        if let Ok((free, total)) = candle_core::cuda_backend::cudarc::driver::result::mem_get_info()
        {
            return (total - free) as u64;
        }
    }
    0
}

/// Measured bf16 GEMM ceiling (TFLOP/s) for 8192^3 on a GPU (512^3 on the CPU, a smoke test).
fn bf16_ceiling(device: &Device) -> Result<f64> {
    let n = if device.is_cuda() { 8192 } else { 512 };
    let a = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(DType::BF16)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(DType::BF16)?;
    let _ = a.matmul(&b)?;
    device.synchronize()?;
    let iters = 10;
    let t = Instant::now();
    for _ in 0..iters {
        let _ = a.matmul(&b)?;
    }
    device.synchronize()?;
    Ok(2.0 * (n as f64).powi(3) * iters as f64 / t.elapsed().as_secs_f64() / 1e12)
}

/// What `speed` reports besides the timings.
struct SpeedReport {
    /// A per-stage profile of each timed batch.
    profile: bool,
    /// Each format's per-token error against the same weights in f32.
    against_f32: bool,
    /// The first window alone against the same window in each timed batch.
    invariance: bool,
}

#[allow(clippy::too_many_arguments)]
fn speed(
    shape: &str,
    formats: &[String],
    batches: &[usize],
    ctx: usize,
    iters: usize,
    dtype: DType,
    device: &Device,
    attention: &[AttentionKernel],
    report: SpeedReport,
) -> Result<()> {
    // f32 scores of the largest batch per checkpoint format, shared by its variants.
    let mut f32_scores: HashMap<String, Vec<SequenceScores>> = HashMap::new();
    let shape = random_model::Shape::named(shape)?;
    let ceiling = bf16_ceiling(device)?;
    println!("device {device:?}, cuBLAS bf16 8192^3 ceiling {ceiling:.0} TFLOP/s, shape {}, ctx {ctx}, compute {dtype:?}", shape.name);
    println!("| format | attention | bits/weight | batch | ms/window | tokens/s | % of ceiling | peak GPU GiB | dequant all ms | load s | weights GiB | peak / weights |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for format in formats {
        // The pool keeps what earlier models (and the ceiling GEMM) freed: hand it back, so that
        // the peak below is this model's own.
        exactscore_server::device::release_freed_memory(device)?;
        let t_load = Instant::now();
        // `fp8-emulated`: the fp8 weights with their layers emulated rather than on the tensor
        // cores (`--fp8-matmul emulated`); `fp8-fast-accum`: on them with fast accumulation.
        let (built, fp8_matmul) = if let Some(f) = format.strip_suffix("-emulated") {
            (f, Fp8Matmul::Emulated)
        } else if let Some(f) = format.strip_suffix("-fast-accum") {
            (f, Fp8Matmul::TensorCoresFastAccum)
        } else {
            (format.as_str(), Fp8Matmul::TensorCores)
        };
        let (config, ckpt) = random_model::build(&shape, built, None)?;
        // The compressed weights as stored: what the peak memory is judged against.
        let weight_bytes = ckpt.stored_bytes_with_prefix("");
        let mut opts = options(
            device,
            dtype,
            ActivationQuantMode::Emulate,
            ctx,
            AttentionKernel::Materialized,
        );
        opts.linear.fp8_matmul = fp8_matmul;
        let mut model = Model::from_checkpoint(config.clone(), &ckpt, &opts)?;
        device.synchronize()?;
        let load_s = t_load.elapsed().as_secs_f64();
        let bpw = random_model::decoder_bits_per_weight(&model);
        // Deterministic token windows.
        let tokens: Vec<u32> = (0..ctx * batches.iter().max().unwrap_or(&1))
            .map(|i| ((i * 7919) % shape.vocab) as u32)
            .collect();
        for (&kernel, &batch) in attention
            .iter()
            .flat_map(|k| batches.iter().map(move |b| (k, b)))
        {
            model.set_attention(kernel)?;
            let windows: Vec<ScoreInput> = (0..batch)
                .map(|b| ScoreInput {
                    stored: exactscore_server::model::StoredRequest::NONE,
                    tokens: &tokens[b * ctx..(b + 1) * ctx],
                    top_k: 0,
                })
                .collect();
            model.score(&windows)?; // warm-up (PTX JIT, allocator)
            device.synchronize()?;
            let mut peak = gpu_used_bytes();
            let t = Instant::now();
            for _ in 0..iters {
                model.score(&windows)?;
                peak = peak.max(gpu_used_bytes());
            }
            device.synchronize()?;
            let secs = t.elapsed().as_secs_f64() / iters as f64;
            let tokens_per_s = (batch * ctx) as f64 / secs;
            let flops = shape.flops_per_window(ctx) * batch as f64;
            let t = Instant::now();
            for (_, l) in model.linears() {
                l.weight().dequantize(dtype, device)?;
            }
            device.synchronize()?;
            let dequant_ms = t.elapsed().as_secs_f64() * 1e3;
            let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
            println!(
                "| {format} | {kernel:?} | {bpw:.3} | {batch} | {:.1} | {:.0} | {:.0}% | {:.1} | {dequant_ms:.1} | {load_s:.1} | {:.1} | {:.2} |",
                secs * 1e3 / batch as f64,
                tokens_per_s,
                100.0 * flops / secs / 1e12 / ceiling,
                gib(peak),
                gib(weight_bytes),
                peak as f64 / weight_bytes as f64,
            );
            if report.profile {
                print_profile(&model, &windows, device)?;
            }
            if report.invariance && batch > 1 {
                let scores = |windows: &[ScoreInput]| -> Result<Vec<f32>> {
                    let first = model.score(windows)?.swap_remove(0);
                    Ok(first.token_logprobs().collect())
                };
                let (alone, batched) = (scores(&windows[..1])?, scores(&windows)?);
                let bitwise = alone.len() == batched.len()
                    && alone
                        .iter()
                        .zip(&batched)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                let max = alone
                    .iter()
                    .zip(&batched)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                println!(
                    "|   the first window alone vs among {batch}: bitwise {bitwise}, max per-token \
                     |Δ| {max:.2e} |"
                );
            }
        }
        if report.against_f32 {
            let batch = batches.iter().copied().max().unwrap_or(1);
            let seqs: Vec<Vec<u32>> = tokens
                .chunks(ctx)
                .take(batch)
                .map(<[u32]>::to_vec)
                .collect();
            if !f32_scores.contains_key(built) {
                let attention = AttentionKernel::Materialized;
                let opts = options(
                    device,
                    DType::F32,
                    ActivationQuantMode::Emulate,
                    ctx,
                    attention,
                );
                let reference = Model::from_checkpoint(config, &ckpt, &opts)?;
                f32_scores.insert(built.to_string(), score(&reference, &seqs)?);
            }
            let (max, mean) = diff(&score(&model, &seqs)?, &f32_scores[built]);
            println!(
                "|   per-token |Δ| against the same weights in f32 over {} tokens: max {max:.2e}, \
                 mean {mean:.2e} |",
                batch * ctx
            );
        }
    }
    Ok(())
}

/// One forward with every stage synchronized; prints ms per window of each stage.
fn print_profile(model: &Model, windows: &[ScoreInput], device: &Device) -> Result<()> {
    stages::set_enabled(true);
    let _ = stages::take();
    let _ = stages::take_peaks();
    let _ = stages::take_expert_load();
    let t = Instant::now();
    let scored = model.score(windows);
    device.synchronize()?;
    let total = t.elapsed().as_secs_f64() * 1e3 / windows.len() as f64;
    stages::set_enabled(false);
    scored?;
    let rows = stages::take();
    let covered: f64 = rows
        .iter()
        .map(|(_, d, _)| d.as_secs_f64() * 1e3)
        .sum::<f64>()
        / windows.len() as f64;
    let line: Vec<String> = rows
        .iter()
        .map(|(name, d, calls)| {
            format!(
                "{name} {:.2} ({calls})",
                d.as_secs_f64() * 1e3 / windows.len() as f64
            )
        })
        .collect();
    println!(
        "|   profile, ms/window (calls): {} ; sum {covered:.1} of {total:.1} synchronized |",
        line.join(", ")
    );
    let mut peaks = stages::take_peaks();
    if !peaks.is_empty() {
        peaks.sort_by_key(|&(_, bytes)| std::cmp::Reverse(bytes));
        let line: Vec<String> = peaks
            .iter()
            .take(6)
            .map(|(name, bytes)| format!("{name} {:.2}", *bytes as f64 / (1u64 << 30) as f64))
            .collect();
        println!(
            "|   memory, GiB held by live tensors at each stage's peak (the highest six): {} |",
            line.join(", ")
        );
    }
    let (mut load, active_per_layer) = stages::take_expert_load();
    if !load.is_empty() {
        // Tokens each expert received in this batch, summed over the sparse layers.
        load.sort_unstable();
        let mean = load.iter().sum::<u64>() as f64 / load.len() as f64;
        println!(
            "|   expert load, tokens per expert summed over the sparse layers: min {}, median {}, \
             max {} (max / mean {:.2}), {} of {} experts never chosen; a sparse layer ran \
             {active_per_layer:.1} experts on average |",
            load[0],
            load[load.len() / 2],
            load[load.len() - 1],
            load[load.len() - 1] as f64 / mean.max(1.0),
            load.iter().filter(|&&n| n == 0).count(),
            load.len()
        );
    }
    Ok(())
}
