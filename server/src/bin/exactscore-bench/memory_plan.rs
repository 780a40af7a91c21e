//! `plan`: how a model's decoder layers split over N GPUs and whether every stage fits, from
//! its config.json alone (no weights): each part's stored bytes as the checkpoint in
//! `--format` would hold them ([`Shape::part_bytes`] of the shape the config describes), and
//! the server's own activation estimate, work and split (`placement::ActivationBytes`,
//! `PartWork`, `balance`) against each GPU's memory less the server's margin.

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use exactscore_server::model::placement::{self, ActivationBytes, PartWork, StagePlan};
use exactscore_server::model::ModelConfig;

use crate::random_model::Shape;

const GIB: f64 = (1u64 << 30) as f64;

/// What a plan is asked for: `gpus` of `gpu_gib` GiB each, batches of `batch_tokens` tokens of
/// sequences up to `max_seq`, bf16 compute with the flash kernel where the server would take
/// it (as `App::load` decides: a kernel compiled for the model's attention head size).
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub format: &'a str,
    pub gpus: usize,
    pub gpu_gib: f64,
    pub batch_tokens: usize,
    pub max_seq: usize,
}

/// A model's config and the shape it describes; `label`: where they came from.
pub struct Planned {
    pub label: String,
    pub config: ModelConfig,
    pub shape: Shape,
}

impl Planned {
    /// A bench shape (its config as its bf16 checkpoint carries it).
    pub fn shape(name: &str) -> Result<Self> {
        let shape = Shape::named(name)?;
        Ok(Self {
            label: name.to_string(),
            config: shape.model_config("bf16")?,
            shape,
        })
    }

    pub fn read(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let config =
            ModelConfig::from_json(&text).with_context(|| format!("parsing {}", path.display()))?;
        let shape = Shape::from_config(&config)?;
        Ok(Self {
            label: path.display().to_string(),
            config,
            shape,
        })
    }

    /// The stages of `request`, or why they do not fit: the first stage over its limit, by
    /// how much, and what the limit is.
    pub fn stages(&self, request: &Request) -> Result<Vec<StagePlan>> {
        let parts = self.shape.part_bytes(request.format)?;
        let flash = self.config.flash_attention_possible()
            && exactscore_server::ops::flash_attention_supported(
                self.config.attention_head_dim(),
                DType::BF16,
            );
        let activation = ActivationBytes::estimate(
            &self.config,
            DType::BF16,
            request.batch_tokens,
            request.max_seq,
            flash,
            false,
        );
        let work = PartWork::of(&self.config, request.max_seq);
        let limit = placement::usable_bytes((request.gpu_gib * GIB) as u64);
        let plans = placement::balance(
            &parts,
            &activation,
            &work,
            Some(&vec![limit; request.gpus]),
            request.gpus,
        )?;
        if let Some(k) = placement::first_over(&plans, &vec![Some(limit); request.gpus]) {
            let p = &plans[k];
            let weights: u64 = parts.embed + parts.layers.iter().sum::<u64>() + parts.head;
            bail!(
                "{} GPU(s) of {} GiB do not hold {:?} at {}: stage {k} (layers {}..{}) expects \
                 {:.1} GiB ({:.1} GiB of weights), over the limit of {:.1} GiB per GPU (its \
                 memory less 8 %); the weights alone are {:.1} GiB",
                request.gpus,
                request.gpu_gib,
                self.config.architecture,
                request.format,
                p.layers.start,
                p.layers.end,
                p.expected_peak as f64 / GIB,
                p.weight_bytes as f64 / GIB,
                limit as f64 / GIB,
                weights as f64 / GIB,
            );
        }
        Ok(plans)
    }

    /// The fewest GPUs of `request.gpu_gib` whose stages all fit (`None`: not even one per
    /// layer).
    pub fn gpus_needed(&self, request: &Request) -> Option<usize> {
        (1..=self.config.num_layers)
            .find(|&gpus| self.stages(&Request { gpus, ..*request }).is_ok())
    }
}

/// Prints the stages of `request` and, for w4a16, fp8-block and bf16, the H100s (80 GiB) and
/// H200s (141 GiB) the model needs; fails where `request` does not fit.
pub fn run(planned: &Planned, request: &Request) -> Result<()> {
    let gib = |b: u64| b as f64 / GIB;
    println!(
        "| {} ({:?}), {} layers | format | GPUs needed: H100 80 GiB | H200 141 GiB | weights GiB |",
        planned.label, planned.config.architecture, planned.config.num_layers
    );
    println!("|---|---|---|---|---|");
    for format in ["w4a16", "fp8-block", "bf16"] {
        let parts = planned.shape.part_bytes(format)?;
        let weights = parts.embed + parts.layers.iter().sum::<u64>() + parts.head;
        let needed = |gpu_gib: f64| {
            let r = Request {
                format,
                gpu_gib,
                ..*request
            };
            planned
                .gpus_needed(&r)
                .map_or("none".to_string(), |n| n.to_string())
        };
        println!(
            "| | {format} | {} | {} | {:.1} |",
            needed(80.0),
            needed(141.0),
            gib(weights)
        );
    }
    let plans = planned.stages(request)?;
    println!(
        "\n{} at {} on {} GPU(s) of {} GiB, {} tokens per batch of sequences up to {}:",
        planned.label,
        request.format,
        request.gpus,
        request.gpu_gib,
        request.batch_tokens,
        request.max_seq
    );
    println!("| stage | layers | weights GiB | expected peak GiB |");
    println!("|---|---|---|---|");
    for (k, p) in plans.iter().enumerate() {
        println!(
            "| {k} | {}..{} | {:.1} | {:.1} |",
            p.layers.start,
            p.layers.end,
            gib(p.weight_bytes),
            gib(p.expected_peak)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEEPSEEK_V3: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/configs/deepseek-v3-671b.json"
    );

    fn request(format: &str, gpus: usize, gpu_gib: f64) -> Request<'_> {
        Request {
            format,
            gpus,
            gpu_gib,
            batch_tokens: 16384,
            max_seq: 2048,
        }
    }

    /// DeepSeek-V3's published config.json, planned from the config alone: its parameter count
    /// is the release's (671 G without the multi-token-prediction layer, 37 G a token), one
    /// H100 is refused naming the limit, and the split fits the GPUs it says it needs.
    #[test]
    fn deepseek_v3_plan_from_its_config() -> Result<()> {
        let planned = Planned::read(Path::new(DEEPSEEK_V3))?;
        let parts = planned.shape.part_bytes("bf16")?;
        let params = (parts.embed + parts.layers.iter().sum::<u64>() + parts.head) as f64 / 2.0;
        assert!((params / 1e9 - 671.0).abs() < 0.5, "{params}");
        let err = planned
            .stages(&request("w4a16", 1, 80.0))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("over the limit of 73.6 GiB per GPU") && err.contains("stage 0"),
            "{err}"
        );
        for (format, gpu_gib) in [("w4a16", 80.0), ("fp8-block", 141.0), ("bf16", 141.0)] {
            let needed = planned.gpus_needed(&request(format, 1, gpu_gib)).unwrap();
            let plans = planned.stages(&request(format, needed, gpu_gib))?;
            let limit = placement::usable_bytes((gpu_gib * GIB) as u64);
            assert!(plans.iter().all(|p| p.expected_peak <= limit));
            assert_eq!(plans.iter().map(|p| p.layers.len()).sum::<usize>(), 61);
            assert!(planned
                .stages(&request(format, needed - 1, gpu_gib))
                .is_err());
        }
        Ok(())
    }

    /// Every bench shape can be planned (its parts as its checkpoint stores them), and the
    /// small ones fit one H100 at W4A16.
    #[test]
    fn bench_shapes_plan() -> Result<()> {
        for name in [
            "glm-4.7-flash",
            "gemma4-26b-a4b",
            "gemma4-31b",
            "deepseek-v2-lite",
        ] {
            let planned = Planned::shape(name)?;
            assert_eq!(
                planned.gpus_needed(&request("w4a16", 1, 80.0)),
                Some(1),
                "{name}"
            );
        }
        Ok(())
    }

    /// A config of another family is refused by name.
    #[test]
    fn a_plan_refuses_what_it_cannot_count() {
        let llama = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/llama-w4a16-g128/config.json"
        );
        let err = Planned::read(Path::new(llama)).err().unwrap().to_string();
        assert!(
            err.contains("Llama") && err.contains("DeepSeek-V3"),
            "{err}"
        );
    }
}
