//! End to end: `exactscore report` (`report_dir::run_report`) on the tiny W4A16 fixture served
//! with its dense bf16 original as the reference, a bf16 noise-floor server and `--diff`: the
//! directory holds every file, `report.json` and `model-index.yaml` pass their schemas
//! (`client/schemas/`) and mutated copies do not, and every number equals the one the `kld` and
//! `diff` runners give on their own.

use std::path::{Path, PathBuf};

use exactscore_client::record::Record;
use exactscore_client::report_dir::{self, run_report, ReportOptions};
use exactscore_client::{run_diff, run_ppl, DiffConfig, PplConfig, Task};
use serde_json::{json, Value};

mod common;

use common::{fixture, start};

const SERVED: &str = "llama-w4a16-g128";
const REFERENCE: &str = "llama-dense-bf16";

fn schema(name: &str) -> jsonschema::Validator {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../client/schemas")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    jsonschema::validator_for(&serde_json::from_str(&text).unwrap()).unwrap()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn read_yaml(path: &Path) -> Value {
    serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Each mutation of `valid` must fail `validator`, naming where.
fn assert_rejected(validator: &jsonschema::Validator, valid: &Value, mutations: &[(&str, Value)]) {
    assert!(validator.is_valid(valid));
    for (pointer, value) in mutations {
        let mut bad = valid.clone();
        match value {
            Value::Null if pointer.ends_with('!') => {
                // `path!`: the field removed.
                let path = pointer.trim_end_matches('!');
                let (parent, key) = path.rsplit_once('/').unwrap();
                bad.pointer_mut(parent)
                    .unwrap()
                    .as_object_mut()
                    .unwrap()
                    .remove(key)
                    .unwrap_or_else(|| panic!("{path} not in the valid document"));
            }
            v => match bad.pointer_mut(pointer) {
                Some(slot) => *slot = v.clone(),
                None => {
                    // A field the document does not have: added.
                    let (parent, key) = pointer.rsplit_once('/').unwrap();
                    let object = bad.pointer_mut(parent).unwrap().as_object_mut().unwrap();
                    object.insert(key.to_string(), v.clone());
                }
            },
        }
        assert!(
            !validator.is_valid(&bad),
            "a document with {pointer} = {value} passed the schema"
        );
    }
}

fn config(server: &str, dataset: exactscore_client::dataset::DatasetSpec) -> PplConfig {
    let mut c = PplConfig::new(vec![server.to_string()], dataset);
    (c.ctx, c.stride, c.max_windows) = (64, 32, Some(4));
    c
}

#[tokio::test]
async fn report_directory_holds_the_runners_numbers_and_passes_its_schemas() {
    let reference_dir = fixture(REFERENCE);
    let reference_dir = reference_dir.to_str().unwrap();
    let quantized = start(SERVED, &["--reference-model", reference_dir]).await;
    let floor_args = [
        "--dtype",
        "bf16",
        "--reference-model",
        reference_dir,
        "--reference-dtype",
        "f32",
    ];
    let floor = start(REFERENCE, &floor_args).await;
    let tmp = tempfile::tempdir().unwrap();
    let spec = common::dataset(tmp.path());
    let out = tmp.path().join("report");

    let mut cfg = config(&quantized.base, spec.clone());
    cfg.noise_floor_server = Some(floor.base.clone());
    let options = ReportOptions {
        out: out.clone(),
        diff_windows: Some(2),
        plot_format: "png".into(),
        name: Some("org/tiny-w4a16".into()),
    };
    let record = run_report(cfg.clone(), options).await.unwrap();

    // Every file, and no partial file left behind.
    for f in [
        "report.json",
        "README.md",
        "model-index.yaml",
        "run.json",
        "diff.json",
        "kld.png",
        "layers.png",
    ] {
        let len = std::fs::metadata(out.join(f)).map_or(0, |m| m.len());
        assert!(len > 0, "{f} missing or empty");
    }
    assert!(!out.join(report_dir::PARTIAL_FILE).exists());

    // The record is the runners' numbers: a plain `kld` run with the same noise floor and a
    // plain `diff` run give the same bits.
    cfg.task = Task::Kld;
    let direct = run_ppl(cfg.clone()).await.unwrap();
    assert_eq!(record.kld.as_ref(), direct.kld.as_ref());
    assert_eq!(record.perplexity.value, direct.stats.perplexity);
    assert_eq!(record.perplexity.stderr, direct.stats.perplexity_stderr);
    assert_eq!(record.dataset, direct.dataset);
    assert_eq!(record.windows.windows, 4);
    let floor_kld = &direct.noise_floor.as_ref().unwrap().kld;
    let nf = record.noise_floor.as_ref().unwrap();
    assert_eq!(nf.mean_kld, floor_kld.mean_kld);
    assert_eq!(nf.dtype, "bf16");
    let k = record.kld.as_ref().unwrap();
    assert!(k.mean_kld > nf.mean_kld, "W4A16 below the bf16 floor?");
    let mut d = DiffConfig::new(quantized.base.clone(), spec.clone());
    (d.ctx, d.windows) = (64, 2);
    let diff = run_diff(d).await.unwrap();
    let layers = record.layers.as_ref().unwrap();
    assert_eq!(layers.layers, diff.layers);
    assert_eq!(layers.kld, diff.kld);
    let info = common::info(&quantized.base).await;
    let reference = record.reference.as_ref().unwrap();
    assert_eq!(record.model.checkpoint_sha256, info.checkpoint_sha256);
    assert_eq!(
        reference.checkpoint_sha256,
        info.reference.as_ref().unwrap().checkpoint_sha256
    );
    assert_eq!(record.model.bits_per_weight, info.bits_per_weight);
    assert_eq!(record.versions.server, info.version);
    // The dataset hash is the text's.
    let text = std::fs::read(spec.path().unwrap()).unwrap();
    assert_eq!(
        record.dataset.sha256,
        exactscore_client::dataset::sha256_hex(&text)
    );
    // run.json is an `exactscore kld --json` report that `compare` reads.
    let run = exactscore_client::Report::from_path(&out.join("run.json")).unwrap();
    assert_eq!(run.kld, direct.kld);

    // The reproduction commands: every option that chose the numbers, never a key.
    let r = &record.reproduce;
    for part in [
        format!("--server {}", quantized.base),
        "--method exl3 --ctx 64 --stride 32 --max-windows 4 --tokenize local".into(),
        format!("--noise-floor-server {}", floor.base),
        "--diff --diff-windows 2".into(),
        format!("--out {}", out.display()),
    ] {
        assert!(r.report.contains(&part), "{part:?} not in {}", r.report);
    }
    assert!(r.run.starts_with("exactscore kld "), "{}", r.run);
    assert!(r.diff.as_ref().unwrap().contains("--ctx 64 --windows 2"));
    assert!(
        r.server.contains(&format!("--model {SERVED} "))
            && r.server.contains(&format!("--reference-model {REFERENCE}")),
        "{}",
        r.server
    );
    assert!(r
        .noise_floor_server
        .as_ref()
        .unwrap()
        .contains("--dtype bf16"));

    // What was written is what was returned, and both files pass their schemas.
    let written = read_json(&out.join("report.json"));
    let back: Record = serde_json::from_value(written.clone()).unwrap();
    assert_eq!(back, record);
    let report_schema = schema("report.schema.json");
    let errors: Vec<String> = report_schema
        .iter_errors(&written)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "report.json: {errors:?}");
    assert_rejected(
        &report_schema,
        &written,
        &[
            ("/reproduce!", Value::Null),
            ("/kld/mean_kld", json!(-0.5)),
            ("/kld/same_top", json!(1.5)),
            ("/dataset/sha256", json!("not-a-hash")),
            ("/model/checkpoint_sha256", json!("ABC")),
            ("/perplexity/value", json!(0.9)),
            ("/windows/method", json!("sliding")),
            ("/files/diff", Value::Null),
            ("/reproduce/noise_floor_server", Value::Null),
            ("/reference", Value::Null),
            ("/schema", json!("exactscore-report/0")),
            ("/hardware/devices", json!(["tpu"])),
            ("/versions/server!", Value::Null),
            ("/extra", json!(1)),
        ],
    );

    let index = read_yaml(&out.join("model-index.yaml"));
    let index_schema = schema("model-index.schema.json");
    let errors: Vec<String> = index_schema
        .iter_errors(&index)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "model-index.yaml: {errors:?}");
    let result = &index["model-index"][0]["results"][0];
    assert_eq!(index["model-index"][0]["name"], "org/tiny-w4a16");
    assert_eq!(result["metrics"][0]["type"], "perplexity");
    assert_eq!(
        result["metrics"][0]["value"],
        json!(direct.stats.perplexity)
    );
    assert_eq!(result["metrics"][1]["type"], "kl_divergence");
    assert_eq!(result["metrics"][1]["value"], json!(k.mean_kld));
    assert_eq!(result["metrics"][1]["args"]["reference"], REFERENCE);
    assert_eq!(result["dataset"]["name"], "sample.txt");
    assert_rejected(
        &index_schema,
        &index,
        &[
            ("/model-index/0/results/0/metrics/0/verified", json!(true)),
            ("/model-index/0/results/0/metrics/0/value", json!(0.5)),
            (
                "/model-index/0/results/0/metrics/0/type",
                json!("kl_divergence"),
            ),
            ("/model-index/0/results/0/metrics/1/value", json!("small")),
            (
                "/model-index/0/results/0/metrics/1/args/reference!",
                Value::Null,
            ),
            ("/model-index/0/results/0/dataset/type!", Value::Null),
            ("/model-index/0/results/0/task/type", json!("translation")),
            ("/model-index/0/name", json!("")),
        ],
    );

    // The card shows the numbers and links its plots relatively.
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    for part in [
        "](kld.png)".to_string(),
        "](layers.png)".to_string(),
        format!("| Perplexity | {:.4} ± ", direct.stats.perplexity),
        format!("| Mean KLD (nats/token) | {:.6} ± ", k.mean_kld),
        r.report.clone(),
    ] {
        assert!(card.contains(&part), "{part:?} not in the card:\n{card}");
    }
}

/// A server without a reference model gives a perplexity-only report, which its schema holds
/// to the same rules; --diff is refused there by name.
#[tokio::test]
async fn a_server_without_reference_gives_a_perplexity_report() {
    let plain = start(SERVED, &[]).await;
    let tmp = tempfile::tempdir().unwrap();
    let spec = common::dataset(tmp.path());
    let out = tmp.path().join("ppl-report");
    let cfg = config(&plain.base, spec);
    let mut options = ReportOptions {
        out: out.clone(),
        diff_windows: Some(2),
        plot_format: "svg".into(),
        name: None,
    };
    let err = run_report(cfg.clone(), options.clone())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no reference model") && err.contains("--diff"),
        "{err}"
    );

    options.diff_windows = None;
    let record = run_report(cfg.clone(), options).await.unwrap();
    let direct = run_ppl(cfg).await.unwrap();
    assert_eq!(record.perplexity.value, direct.stats.perplexity);
    assert!(record.kld.is_none() && record.reference.is_none());
    assert_eq!(record.files.plots, vec!["ppl.svg".to_string()]);
    assert!(record.reproduce.run.starts_with("exactscore ppl "));
    let written = read_json(&out.join("report.json"));
    let report_schema = schema("report.schema.json");
    assert!(report_schema.is_valid(&written));
    // A KLD-less record that names a reference breaks the schema's rule.
    assert_rejected(
        &report_schema,
        &written,
        &[(
            "/reference",
            json!({"name": "x", "architecture": "LlamaForCausalLM", "checkpoint_sha256": null,
                   "formats": {"q_proj": "dense"}, "bits_per_weight": 16.0, "dtype": "f32"}),
        )],
    );
    let index = read_yaml(&out.join("model-index.yaml"));
    assert!(schema("model-index.schema.json").is_valid(&index));
    let metrics = index["model-index"][0]["results"][0]["metrics"]
        .as_array()
        .unwrap();
    assert_eq!(metrics.len(), 1);
    assert_eq!(index["model-index"][0]["name"], SERVED);
}
