//! End to end: `run_ppl` (what `exactscore ppl` runs) against real in-process servers gives the
//! perplexity computed directly with the model library, to 1e-6 relative — with one and two
//! servers, concurrency 1 and 8, and after an interrupted-then-resumed run. A wrong API key is a
//! one-line error.

mod common;

use common::{dataset, fixture, load_model, start, Running};
use exactscore_client::dataset::{DatasetOptions, DatasetSpec};
use exactscore_client::runner::{run_ppl, PplConfig};
use exactscore_client::windows::{windows, Method, WindowParams};
use exactscore_server::model::ScoreInput;

const VARIANT: &str = "llama-w4a16-g128";
const CTX: usize = 64;
const STRIDE: usize = 24;
const MAX_WINDOWS: usize = 10;

/// Perplexity computed with the model library directly: same tokens, same windows.
fn direct_perplexity(spec: &DatasetSpec, method: Method) -> f64 {
    let text = exactscore_client::dataset::load(spec, &DatasetOptions::default())
        .unwrap()
        .text;
    let tok = tokenizers::Tokenizer::from_file(fixture(VARIANT).join("tokenizer.json")).unwrap();
    // lm-eval's rolling windows encode without BOS and prepend it as the prefix token.
    let add_special = method != Method::Rolling;
    let ids = tok
        .encode(text.as_str(), add_special)
        .unwrap()
        .get_ids()
        .to_vec();
    let model = load_model(VARIANT);
    let params = WindowParams {
        method,
        ctx: CTX,
        stride: STRIDE,
        prefix_token: (method == Method::Rolling).then_some(1992),
        max_windows: Some(MAX_WINDOWS),
    };
    let (mut nll, mut count) = (0f64, 0usize);
    for w in windows(ids.len(), &params).unwrap() {
        let seq = w.sequence(&ids);
        let scores = model
            .score(&[ScoreInput {
                stored: exactscore_server::model::StoredRequest::NONE,
                tokens: &seq,
                top_k: 0,
            }])
            .unwrap();
        for p in w.scored.clone() {
            nll -= scores[0].rows[p - 1].target_logprob.unwrap() as f64;
            count += 1;
        }
    }
    (nll / count as f64).exp()
}

fn config(
    servers: &[&Running],
    spec: &DatasetSpec,
    method: Method,
    concurrency: usize,
) -> PplConfig {
    let mut c = PplConfig::new(
        servers.iter().map(|s| s.base.clone()).collect(),
        spec.clone(),
    );
    c.method = method;
    c.ctx = CTX;
    c.stride = STRIDE;
    c.max_windows = Some(MAX_WINDOWS);
    c.concurrency = concurrency;
    c
}

fn assert_close(got: f64, want: f64, what: &str) {
    let rel = (got - want).abs() / want;
    assert!(
        rel <= 1e-6,
        "{what}: client {got} vs direct {want} (rel {rel:e})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ppl_through_real_servers_equals_direct_computation() {
    let dir = tempfile::tempdir().unwrap();
    let spec = dataset(dir.path());
    let (a, b) = (start(VARIANT, &[]).await, start(VARIANT, &[]).await);
    for method in [Method::Exl3, Method::Disjoint, Method::Rolling] {
        let want = direct_perplexity(&spec, method);
        for (servers, concurrency) in [(vec![&a], 1), (vec![&a], 8), (vec![&a, &b], 8)] {
            let report = run_ppl(config(&servers, &spec, method, concurrency))
                .await
                .unwrap();
            assert_close(
                report.stats.perplexity,
                want,
                &format!(
                    "{method:?}, {} server(s), concurrency {concurrency}",
                    servers.len()
                ),
            );
        }
    }
    // Interrupted after 3 windows, then resumed from the partial file.
    let partial = dir.path().join("partial.jsonl");
    let mut first = config(&[&a, &b], &spec, Method::Exl3, 2);
    first.output = Some(partial.clone());
    first.stop_after = Some(3);
    let _ = run_ppl(first).await;
    let mut resumed = config(&[&a, &b], &spec, Method::Exl3, 2);
    resumed.output = Some(partial);
    resumed.resume = true;
    let report = run_ppl(resumed).await.unwrap();
    assert!(
        report.resumed_windows >= 3,
        "resumed {} windows",
        report.resumed_windows
    );
    assert_eq!(report.stats.windows, MAX_WINDOWS);
    assert_close(
        report.stats.perplexity,
        direct_perplexity(&spec, Method::Exl3),
        "resumed run",
    );
    for s in [a, b] {
        s.stop.send(()).unwrap();
        s.done.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_api_key_is_a_one_line_error() {
    let dir = tempfile::tempdir().unwrap();
    let spec = dataset(dir.path());
    let server = start(VARIANT, &["--api-key", "right-key"]).await;
    let mut c = config(&[&server], &spec, Method::Exl3, 1);
    c.api_key = Some("wrong-key".into());
    let err = run_ppl(c).await.unwrap_err().to_string();
    assert!(
        !err.contains('\n') && !err.is_empty(),
        "multi-line error: {err}"
    );
    assert!(
        err.contains("401") || err.to_lowercase().contains("key"),
        "{err}"
    );
    let mut c = config(&[&server], &spec, Method::Exl3, 1);
    c.api_key = Some("right-key".into());
    run_ppl(c).await.unwrap();
    server.stop.send(()).unwrap();
    server.done.await.unwrap().unwrap();
}
