//! End to end: `POST /diff` on the real server (f32, CPU), the W4A16 fixture served against its
//! dense bf16 original: the HTTP numbers equal the model-level computation, which
//! `server/tests/diff_numerics.rs` checks against independent ones; the bad inputs and the
//! references `/diff` cannot use are refused naming the field.

use exactscore_api::{DiffResponse, ErrorBody, KldResponse};
use exactscore_server::model::{diff_batch, DiffOptions};
use serde_json::{json, Value};

mod common;

use common::{fixture, load_model, post, start, start_dir};

const SERVED: &str = "llama-w4a16-g128";
const REFERENCE: &str = "llama-dense-bf16";

fn fixture_sequences() -> Vec<Vec<u32>> {
    let mut sequences = common::reference_sequences(REFERENCE);
    sequences.truncate(2);
    sequences
}

fn error(text: &str) -> ErrorBody {
    serde_json::from_str(text).unwrap()
}

#[tokio::test]
async fn diff_over_http_equals_the_model_computation() {
    let reference_dir = fixture(REFERENCE);
    let server = start(
        SERVED,
        &["--reference-model", reference_dir.to_str().unwrap()],
    )
    .await;
    let seqs = fixture_sequences();
    let body = json!({ "tokens": seqs, "per_position": true, "attribute": true });
    let (status, text) = post(&server.base, "/diff", body).await;
    assert_eq!(status, 200, "{text}");
    let r: DiffResponse = serde_json::from_str(&text).unwrap();
    assert_eq!(r.reference_model, REFERENCE);

    let (served, reference) = (load_model(SERVED), load_model(REFERENCE));
    let modules: Vec<String> =
        exactscore_server::model::diff::attributable_modules(&served, &reference);
    let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
    let options = DiffOptions {
        attribute: modules.clone(),
        ..DiffOptions::default()
    };
    let direct = diff_batch(&served, &reference, &refs, &options).unwrap();
    for (seq, d) in r.sequences.iter().zip(&direct) {
        assert_eq!(seq.layers.len(), 2);
        for (l, e) in seq.layers.iter().zip(&d.layers) {
            assert_eq!(l.mean_cos_error, e.mean_cos_error());
            assert_eq!(l.mean_sqnr_db, e.mean_sqnr_db());
            assert_eq!(l.cos_error.as_ref(), Some(&e.cos_error));
            assert_eq!(l.sqnr_db.as_ref(), Some(&e.sqnr_db));
            assert!(!l.reference_state_after);
        }
        assert_eq!(seq.kld.sum_kld, d.kld.sum_kld());
        assert_eq!(seq.kld.num_scored, d.kld.num_scored());
        assert!(
            seq.kld.kld.is_none(),
            "the KLD summary has no per-token arrays"
        );
    }
    let a = r.attribution.expect("attribution");
    let positions: usize = direct.iter().map(|d| d.kld.num_scored()).sum();
    assert_eq!(a.positions, positions);
    assert_eq!(a.modules.len(), 14);
    for m in &a.modules {
        let i = modules.iter().position(|n| *n == m.module).unwrap();
        let sum: f64 = direct.iter().map(|d| d.modules[i]).sum();
        assert!(
            (m.mean_kld - sum / positions as f64).abs() <= 1e-12,
            "{}",
            m.module
        );
        assert_eq!(m.format, "int4 g128 sym");
    }
    assert!(a.modules.windows(2).all(|w| w[0].mean_kld >= w[1].mean_kld));
    let full: f64 = direct.iter().map(|d| d.kld.sum_kld()).sum::<f64>() / positions as f64;
    assert!((a.full_kld - full).abs() <= 1e-12);
    let ratio = a.additivity_ratio.unwrap();
    assert!((ratio - a.sum_module_kld / a.full_kld).abs() <= 1e-12);
    println!(
        "{} positions: full KLD {:.6}, Σ modules {:.6}, ratio {ratio:.4}; top {} {:.6}",
        a.positions, a.full_kld, a.sum_module_kld, a.modules[0].module, a.modules[0].mean_kld
    );

    // A pattern and a layer range choose modules; reference_until = the last layer: KLD 0.
    let body = json!({ "tokens": seqs[0], "attribute": {"layers": [1, 1], "pattern": "*.mlp.*"} });
    let (status, text) = post(&server.base, "/diff", body).await;
    assert_eq!(status, 200, "{text}");
    let r: DiffResponse = serde_json::from_str(&text).unwrap();
    let chosen: Vec<&str> = r
        .attribution
        .as_ref()
        .unwrap()
        .modules
        .iter()
        .map(|m| m.module.as_str())
        .collect();
    assert_eq!(chosen.len(), 3, "{chosen:?}");
    assert!(chosen.iter().all(|m| m.starts_with("model.layers.1.mlp.")));
    assert!(r.sequences[0].layers[0].cos_error.is_none());
    let (status, text) = post(
        &server.base,
        "/diff",
        json!({ "tokens": seqs[0], "reference_until": 1 }),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let r: DiffResponse = serde_json::from_str(&text).unwrap();
    assert_eq!(r.sequences[0].kld.sum_kld, 0.0);
    assert!(r.sequences[0]
        .layers
        .iter()
        .all(|l| l.reference_state_after));

    // Bad input: named fields.
    for (body, field, rule) in [
        (
            json!({"tokens": seqs[0], "reference_until": 2}),
            "reference_until",
            "range",
        ),
        (
            json!({"tokens": seqs[0], "attribute": {"pattern": "*.w1"}}),
            "attribute.pattern",
            "no_module_matches",
        ),
        (
            json!({"tokens": seqs[0], "attribute": {"layers": [0, 5]}}),
            "attribute.layers",
            "range",
        ),
        (
            json!({"tokens": seqs[0], "attribute": true, "reference_until": 0}),
            "attribute",
            "mutually_exclusive",
        ),
    ] {
        let (status, text) = post(&server.base, "/diff", body).await;
        assert_eq!(status, 422, "{text}");
        let e = error(&text);
        assert_eq!(
            (e.field.as_deref(), e.rule.as_deref()),
            (Some(field), Some(rule)),
            "{text}"
        );
    }
    let _ = server.stop.send(());
    server.done.await.unwrap().unwrap();
}

#[tokio::test]
async fn diff_needs_a_reference_with_the_same_layers() {
    let server = start(SERVED, &[]).await;
    let (status, text) = post(&server.base, "/diff", json!({ "tokens": [1, 2, 3] })).await;
    assert_eq!(status, 404, "{text}");
    let e = error(&text);
    assert_eq!(
        (e.kind.as_str(), e.field.as_deref()),
        ("no_reference_model", Some("reference_model"))
    );
    let _ = server.stop.send(());
    server.done.await.unwrap().unwrap();

    // The dense fixture cut to one decoder layer: same vocabulary, so /kld takes it.
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(REFERENCE)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let config_path = dir.path().join("config.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["num_hidden_layers"] = json!(1);
    std::fs::write(&config_path, config.to_string()).unwrap();
    // Without its layer-1 tensors too: start-up refuses tensors that config.json leaves unread.
    let weights = dir.path().join("model.safetensors");
    let tensors = candle_core::safetensors::load(&weights, &candle_core::Device::Cpu).unwrap();
    let kept: std::collections::HashMap<String, candle_core::Tensor> = tensors
        .into_iter()
        .filter(|(name, _)| !name.starts_with("model.layers.1."))
        .collect();
    candle_core::safetensors::save(&kept, &weights).unwrap();
    let served = fixture(SERVED);
    let args = [
        "--max-input-tokens",
        "512",
        "--reference-model",
        dir.path().to_str().unwrap(),
    ];
    let server = start_dir(&served, &args).await;
    let (status, text) = post(&server.base, "/diff", json!({ "tokens": [1, 2, 3] })).await;
    assert_eq!(status, 409, "{text}");
    let e = error(&text);
    assert_eq!(
        (e.kind.as_str(), e.field.as_deref()),
        ("incompatible_reference", Some("reference_model"))
    );
    assert!(
        e.error.contains("1 decoder layers, the served model 2"),
        "{}",
        e.error
    );
    let (status, text) = post(&server.base, "/kld", json!({ "tokens": [1, 2, 3] })).await;
    assert_eq!(status, 200, "/kld still works: {text}");
    let _: KldResponse = serde_json::from_str(&text).unwrap();
    let _ = server.stop.send(());
    server.done.await.unwrap().unwrap();
}

/// `exactscore diff` (the library's `run_diff`): the report's per-layer means, final KLD and
/// attribution equal the model-level computation over the same windows; its table and plot.
#[tokio::test]
async fn diff_runner_aggregates_equal_a_direct_computation() {
    use exactscore_api::AttributeInput;
    use exactscore_client::dataset::DatasetOptions;
    use exactscore_client::windows::{windows, Method, WindowParams};
    use exactscore_client::{run_diff, DiffConfig};

    let reference_dir = fixture(REFERENCE);
    let server = start(
        SERVED,
        &["--reference-model", reference_dir.to_str().unwrap()],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let spec = common::dataset(dir.path());
    let mut config = DiffConfig::new(server.base.clone(), spec.clone());
    (config.ctx, config.windows) = (128, 3);
    config.attribute = Some(AttributeInput::All(true));
    let report = run_diff(config).await.unwrap();
    assert_eq!((report.windows, report.tokens), (3, 3 * 128));

    let text = exactscore_client::dataset::load(&spec, &DatasetOptions::default())
        .unwrap()
        .text;
    let tok = tokenizers::Tokenizer::from_file(fixture(SERVED).join("tokenizer.json")).unwrap();
    let ids = tok.encode(text.as_str(), true).unwrap().get_ids().to_vec();
    let params = WindowParams {
        method: Method::Exl3,
        ctx: 128,
        stride: 128,
        prefix_token: None,
        max_windows: Some(3),
    };
    let seqs: Vec<Vec<u32>> = windows(ids.len(), &params)
        .unwrap()
        .iter()
        .map(|w| w.sequence(&ids))
        .collect();
    let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
    let (served, reference) = (load_model(SERVED), load_model(REFERENCE));
    let modules = exactscore_server::model::diff::attributable_modules(&served, &reference);
    let options = DiffOptions {
        attribute: modules.clone(),
        ..DiffOptions::default()
    };
    let direct = diff_batch(&served, &reference, &refs, &options).unwrap();
    let close = |got: f64, want: f64, what: &str| {
        assert!(
            (got - want).abs() <= 1e-12 * want.abs().max(1.0),
            "{what}: {got} vs {want}"
        )
    };
    for (l, layer) in report.layers.iter().enumerate() {
        let all: Vec<f64> = direct
            .iter()
            .flat_map(|d| d.layers[l].cos_error.iter().copied())
            .collect();
        close(
            layer.mean_cos_error,
            all.iter().sum::<f64>() / all.len() as f64,
            "cos",
        );
        let all: Vec<f64> = direct
            .iter()
            .flat_map(|d| d.layers[l].sqnr_db.iter().copied())
            .collect();
        close(
            layer.mean_sqnr_db,
            all.iter().sum::<f64>() / all.len() as f64,
            "sqnr",
        );
    }
    let positions: usize = direct.iter().map(|d| d.kld.num_scored()).sum();
    let n = positions as f64;
    close(
        report.kld.mean_kld,
        direct.iter().map(|d| d.kld.sum_kld()).sum::<f64>() / n,
        "mean KLD",
    );
    let same: usize = direct.iter().map(|d| d.kld.same_top_count()).sum();
    close(
        report.kld.top_k_agreement[0],
        same as f64 / n,
        "top-1 agreement",
    );
    let a = report.attribution.as_ref().unwrap();
    for m in &a.modules {
        let i = modules.iter().position(|x| *x == m.module).unwrap();
        close(
            m.mean_kld,
            direct.iter().map(|d| d.modules[i]).sum::<f64>() / n,
            &m.module,
        );
    }
    let table = report.to_table(5);
    for row in [
        "layer",
        "cos error",
        "SQNR dB",
        "final KLD",
        "module attribution: top 5 of 14",
        "additivity ratio",
    ] {
        assert!(table.contains(row), "{row} missing from\n{table}");
    }
    println!("{table}");
    let plot = dir.path().join("layers.svg");
    exactscore_client::plot::plot_diff(&[("w4a16".into(), report.clone())], &plot).unwrap();
    let svg = std::fs::read_to_string(&plot).unwrap();
    for text in [
        "Cosine error per layer",
        "SQNR per layer",
        "mean SQNR (dB)",
        "decoder layer",
    ] {
        assert!(svg.contains(text), "{text} missing from the plot");
    }
    let _ = server.stop.send(());
    server.done.await.unwrap().unwrap();
}
