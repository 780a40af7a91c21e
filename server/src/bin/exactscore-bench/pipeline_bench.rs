//! One model across devices through the engine the server runs (stage threads, micro-batches,
//! as many concurrent batches as the server's workers): for each layout of devices, the
//! logprobs of the same windows must equal the first layout's bit for bit, and its throughput is
//! printed next to the first's. With a reference model, `/kld` over the same windows is timed
//! (its layout may span GPUs that no single one could hold it on).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use exactscore_server::checkpoint::Checkpoint;
use exactscore_server::engine::{Cancel, Engine, MicroBatching, ModelEngine};
use exactscore_server::model::placement;
use exactscore_server::model::{AttentionKernel, Model, ModelConfig, ScoreInput, SequenceScores};
use exactscore_server::quant::ActivationQuantMode;

use crate::{options, parse_device, random_model};

/// What to measure.
pub struct PipelineRun {
    pub shape: String,
    pub formats: Vec<String>,
    /// Device lists; the first is the baseline every other is compared with.
    pub layouts: Vec<String>,
    pub windows: usize,
    pub ctx: usize,
    pub iters: usize,
    pub dtype: DType,
    pub distinct_layers: Option<usize>,
    /// Fail when a layout's throughput falls below this fraction of the baseline's.
    pub min_ratio: f64,
    pub reference: Option<ReferenceRun>,
}

/// A reference model for `/kld`, in its own layout.
pub struct ReferenceRun {
    pub shape: String,
    pub format: String,
    pub layout: String,
    pub split: Option<Vec<usize>>,
}

fn devices(layout: &str) -> Result<Vec<Device>> {
    layout.split(',').map(|d| parse_device(d.trim())).collect()
}

/// The model of `config`/`ckpt` as stages on `devices`, balanced (or `split`).
fn load(
    config: &ModelConfig,
    ckpt: &Checkpoint,
    devices: Vec<Device>,
    split: Option<&[usize]>,
    dtype: DType,
    ctx: usize,
    batch_tokens: usize,
) -> Result<Model> {
    let opts = options(
        &devices[0],
        dtype,
        ActivationQuantMode::Emulate,
        ctx,
        AttentionKernel::Auto,
    );
    let inputs = placement::PlacementInputs {
        config,
        ckpt,
        dtype,
        batch_tokens,
        max_seq: ctx,
        flash: devices.iter().all(Device::is_cuda) && dtype != DType::F32,
    };
    let plans = placement::plan_on(&inputs, &devices, split)?;
    let stages = devices
        .into_iter()
        .zip(&plans)
        .map(|(d, p)| (d, p.layers.clone()))
        .collect();
    Ok(Model::from_checkpoint_placed(
        config.clone(),
        ckpt,
        &opts,
        stages,
    )?)
}

/// Scores `windows` `iters` times from as many threads as the engine computes batches at once
/// (the server's worker count); returns the scores of the first pass and the seconds per pass.
fn timed_scores(
    engine: &Arc<ModelEngine>,
    windows: &[Vec<u32>],
    iters: usize,
) -> Result<(Vec<SequenceScores>, f64)> {
    let inputs: Vec<ScoreInput<'_>> = windows
        .iter()
        .map(|t| ScoreInput {
            stored: exactscore_server::model::StoredRequest::NONE,
            tokens: t,
            top_k: 0,
        })
        .collect();
    // Warm-up (JIT, allocator) and the answer; never cancelled, so every sequence is answered.
    let first: Option<Vec<SequenceScores>> = engine
        .score(&inputs, &Cancel::never())?
        .into_iter()
        .collect();
    let first = first.ok_or_else(|| anyhow::anyhow!("a sequence went unanswered"))?;
    let threads = engine.concurrency();
    let t = Instant::now();
    std::thread::scope(|scope| -> Result<()> {
        let runs: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| -> Result<()> {
                    for _ in 0..iters {
                        engine.score(&inputs, &Cancel::never())?;
                    }
                    Ok(())
                })
            })
            .collect();
        for run in runs {
            run.join()
                .map_err(|_| anyhow::anyhow!("a scoring thread panicked"))??;
        }
        Ok(())
    })?;
    let per_pass = t.elapsed().as_secs_f64() / (iters * threads) as f64;
    Ok((first, per_pass))
}

fn same_bits(a: &[SequenceScores], b: &[SequenceScores]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.rows.len() == y.rows.len()
                && x.rows.iter().zip(&y.rows).all(|(r, s)| {
                    r.target_logprob.map(f32::to_bits) == s.target_logprob.map(f32::to_bits)
                        && r.argmax.0 == s.argmax.0
                        && r.argmax.1.to_bits() == s.argmax.1.to_bits()
                })
        })
}

pub fn run(r: &PipelineRun) -> Result<()> {
    let shape = random_model::Shape::named(&r.shape)?;
    let windows: Vec<Vec<u32>> = (0..r.windows)
        .map(|w| {
            (0..r.ctx)
                .map(|i| (((w * r.ctx + i) * 7919) % shape.vocab) as u32)
                .collect()
        })
        .collect();
    let batch_tokens = r.windows * r.ctx;
    println!(
        "pipeline: shape {}, {} windows of {} per batch, compute {:?}, {} iterations per worker",
        shape.name, r.windows, r.ctx, r.dtype, r.iters
    );
    println!("| format | layout | stages (layers) | workers | ms/window | tokens/s | vs first | logprobs bitwise = first | |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut failures = 0;
    for format in &r.formats {
        let t = Instant::now();
        let (config, ckpt) = random_model::build(&shape, format, r.distinct_layers)?;
        eprintln!("built {format} in {:.1} s", t.elapsed().as_secs_f64());
        let mut first: Option<(Vec<SequenceScores>, f64)> = None;
        for layout in &r.layouts {
            let model = load(
                &config,
                &ckpt,
                devices(layout)?,
                None,
                r.dtype,
                r.ctx,
                batch_tokens,
            )?;
            let stages: Vec<String> = (0..model.stage_count())
                .map(|k| model.stage_layers(k).len().to_string())
                .collect();
            let engine = Arc::new(ModelEngine::new(model, None, MicroBatching::PerDevice)?);
            let (scores, secs) = timed_scores(&engine, &windows, r.iters)?;
            let (same, ratio) = match &first {
                None => (true, 1.0),
                Some((base, base_secs)) => (same_bits(base, &scores), base_secs / secs),
            };
            let ok = same && ratio >= r.min_ratio || first.is_none();
            failures += usize::from(!ok);
            println!(
                "| {format} | {layout} | {} | {} | {:.1} | {:.0} | {ratio:.2}x | {same} | {} |",
                stages.join("+"),
                engine.concurrency(),
                secs * 1e3 / r.windows as f64,
                (r.windows * r.ctx) as f64 / secs,
                if ok { "ok" } else { "FAIL" }
            );
            if first.is_none() {
                first = Some((scores, secs));
            }
            drop(engine);
            release(layout)?;
        }
    }
    if let Some(reference) = &r.reference {
        kld(r, reference, &shape, &windows, batch_tokens)?;
    }
    if failures > 0 {
        bail!("{failures} layouts differ from the first or are too slow");
    }
    Ok(())
}

/// `/kld` of the first format on the first layout against `reference` on its own layout.
fn kld(
    r: &PipelineRun,
    reference: &ReferenceRun,
    shape: &random_model::Shape,
    windows: &[Vec<u32>],
    batch_tokens: usize,
) -> Result<()> {
    let ref_shape = random_model::Shape::named(&reference.shape)?;
    let t = Instant::now();
    let (ref_config, ref_ckpt) =
        random_model::build(&ref_shape, &reference.format, r.distinct_layers)?;
    let reference_model = load(
        &ref_config,
        &ref_ckpt,
        devices(&reference.layout)?,
        reference.split.as_deref(),
        r.dtype,
        r.ctx,
        batch_tokens,
    )?;
    drop(ref_ckpt);
    let ref_load_s = t.elapsed().as_secs_f64();
    let (config, ckpt) = random_model::build(shape, &r.formats[0], r.distinct_layers)?;
    let model = load(
        &config,
        &ckpt,
        devices(&r.layouts[0])?,
        None,
        r.dtype,
        r.ctx,
        batch_tokens,
    )?;
    drop(ckpt);
    let stages: Vec<String> = (0..reference_model.stage_count())
        .map(|k| {
            format!(
                "{:?}:{}",
                reference_model.stage_device(k).location(),
                reference_model.stage_layers(k).len()
            )
        })
        .collect();
    let engine = ModelEngine::new(model, Some(reference_model), MicroBatching::PerDevice)?;
    let refs: Vec<&[u32]> = windows.iter().map(Vec::as_slice).collect();
    let first: Option<Vec<_>> = engine.kld(&refs, &Cancel::never())?.into_iter().collect();
    let first = first.ok_or_else(|| anyhow::anyhow!("a sequence went unanswered"))?;
    let t = Instant::now();
    for _ in 0..r.iters {
        engine.kld(&refs, &Cancel::never())?;
    }
    let secs = t.elapsed().as_secs_f64() / r.iters as f64;
    let tokens: usize = first.iter().map(|s| s.num_scored()).sum();
    let mean = first.iter().map(|s| s.sum_kld()).sum::<f64>() / tokens.max(1) as f64;
    println!(
        "kld: served {} {} on {}; reference {} {} on {} (stages {}, built and loaded in {ref_load_s:.0} s): \
         {:.1} ms/window, {:.0} tokens/s, mean KLD {mean:.4} over {tokens} positions",
        shape.name,
        r.formats[0],
        r.layouts[0],
        ref_shape.name,
        reference.format,
        reference.layout,
        stages.join(" "),
        secs * 1e3 / windows.len() as f64,
        (windows.len() * r.ctx) as f64 / secs,
    );
    Ok(())
}

/// Hands the memory the pool kept back to the driver, so that the next layout starts empty.
fn release(layout: &str) -> Result<()> {
    for device in devices(layout)? {
        exactscore_server::device::release_freed_memory(&device)?;
    }
    Ok(())
}
