//! `run_ppl` against fake servers with deterministic log-probabilities: the perplexity must equal
//! a direct computation, whatever the number of servers, the concurrency or interruptions.

mod common;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{fake_app, fake_logprob, spawn, Fake};
use exactscore_client::dataset::DatasetSpec;
use exactscore_client::tokenize::TokenizeMode;
use exactscore_client::{
    run_ppl, Method, PplConfig, PplError, Progress, ProgressHook, RetryPolicy,
};

fn text() -> String {
    let words = [
        "the",
        "model",
        "scores",
        "every",
        "token",
        "of",
        "a",
        "long",
        "text",
        "exactly",
        "and",
        "quantized",
        "weights",
        "stay",
        "compressed",
        "on",
        "GPU",
        "perplexity",
        "is",
        "low",
    ];
    let mut s = String::new();
    for i in 0..900usize {
        s.push_str(words[(i * 7 + i / 13) % words.len()]);
        s.push(if i % 17 == 16 { '\n' } else { ' ' });
        if i % 50 == 49 {
            s.push_str(&format!("{i}.\n\n"));
        }
    }
    s
}

fn write_dataset(dir: &Path) -> DatasetSpec {
    let p = dir.join("data.txt");
    std::fs::write(&p, text()).unwrap();
    DatasetSpec::Txt(p)
}

/// Σ NLL and count straight from the definitions of the methods.
fn direct(method: Method, ctx: usize, stride: usize) -> (f64, usize) {
    let tok = common::tokenizer();
    let nll = |id: u32| -(fake_logprob(id) as f64);
    match method {
        Method::Exl3 => {
            let t = tok.encode(text(), true).unwrap().get_ids().to_vec();
            let (mut s, mut c, mut k) = (0.0, 0, 0);
            while k * stride + ctx <= t.len() {
                for p in 1..ctx {
                    s += nll(t[k * stride + p]);
                    c += 1;
                }
                k += 1;
            }
            (s, c)
        }
        Method::Disjoint => {
            let t = tok.encode(text(), true).unwrap().get_ids().to_vec();
            (t[1..].iter().map(|&i| nll(i)).sum(), t.len() - 1)
        }
        Method::Rolling => {
            let t = tok.encode(text(), false).unwrap().get_ids().to_vec();
            (t.iter().map(|&i| nll(i)).sum(), t.len())
        }
    }
}

async fn servers(n: usize) -> (Vec<String>, Vec<Arc<Fake>>) {
    let mut urls = vec![];
    let mut fakes = vec![];
    for _ in 0..n {
        let f = Fake::new(Some("k"));
        urls.push(spawn(fake_app(f.clone())).await);
        fakes.push(f);
    }
    (urls, fakes)
}

fn config(urls: Vec<String>, ds: DatasetSpec, method: Method, concurrency: usize) -> PplConfig {
    let mut c = PplConfig::new(urls, ds);
    c.api_key = Some("k".into());
    c.method = method;
    c.ctx = 64;
    c.stride = 24;
    c.concurrency = concurrency;
    c.timeout = Duration::from_secs(30);
    c
}

fn assert_rel(a: f64, b: f64) {
    assert!(((a - b) / b).abs() <= 1e-6, "{a} vs {b}");
}

async fn check(method: Method, n_servers: usize, concurrency: usize, mode: TokenizeMode) {
    let dir = tempfile::tempdir().unwrap();
    let (urls, fakes) = servers(n_servers).await;
    let mut cfg = config(urls, write_dataset(dir.path()), method, concurrency);
    cfg.tokenize = mode;
    let r = run_ppl(cfg).await.unwrap();
    let (s, c) = direct(method, 64, 24);
    assert_eq!(r.stats.tokens_scored, c, "{method}");
    assert_rel(r.stats.perplexity, (s / c as f64).exp());
    assert_rel(r.stats.total_nll, s);
    assert_eq!(r.per_window.len(), r.stats.windows);
    let calls: Vec<usize> = fakes
        .iter()
        .map(|f| f.score_calls.load(Ordering::SeqCst))
        .collect();
    assert_eq!(calls.iter().sum::<usize>(), r.stats.windows);
    assert!(
        calls.iter().all(|&n| n > 0),
        "every server gets requests: {calls:?}"
    );
    assert_eq!(r.server_info.as_ref().unwrap().bits_per_weight, 4.25);
    assert!(r.bits_per_byte > 0.0 && r.stats.perplexity_stderr.is_some());
}

#[tokio::test]
async fn exl3_one_server_concurrency_1() {
    check(Method::Exl3, 1, 1, TokenizeMode::Local).await;
}

#[tokio::test]
async fn exl3_three_servers_concurrency_8() {
    check(Method::Exl3, 3, 8, TokenizeMode::Local).await;
}

#[tokio::test]
async fn exl3_three_servers_concurrency_1() {
    check(Method::Exl3, 3, 1, TokenizeMode::Server).await;
}

#[tokio::test]
async fn disjoint_one_and_three_servers() {
    check(Method::Disjoint, 1, 1, TokenizeMode::Local).await;
    check(Method::Disjoint, 3, 8, TokenizeMode::Server).await;
}

#[tokio::test]
async fn rolling_one_and_three_servers() {
    check(Method::Rolling, 1, 8, TokenizeMode::Local).await;
    check(Method::Rolling, 3, 8, TokenizeMode::Local).await;
}

#[tokio::test]
async fn rolling_bits_per_byte_is_lm_eval_definition() {
    let dir = tempfile::tempdir().unwrap();
    let (urls, _f) = servers(1).await;
    let r = run_ppl(config(urls, write_dataset(dir.path()), Method::Rolling, 4))
        .await
        .unwrap();
    let (s, _) = direct(Method::Rolling, 64, 24);
    let expected = s / (text().len() as f64 * std::f64::consts::LN_2);
    assert_rel(r.bits_per_byte, expected);
}

#[tokio::test]
async fn interrupted_then_resumed() {
    for (n_servers, conc) in [(1, 1), (3, 8)] {
        let dir = tempfile::tempdir().unwrap();
        let ds = write_dataset(dir.path());
        let partial = dir.path().join("partial.jsonl");
        let (urls, fakes) = servers(n_servers).await;

        let mut cfg = config(urls.clone(), ds.clone(), Method::Exl3, conc);
        cfg.output = Some(partial.clone());
        cfg.stop_after = Some(5);
        let err = run_ppl(cfg).await.unwrap_err();
        let PplError::Interrupted { done, total, .. } = err else {
            panic!("expected Interrupted, got {err}");
        };
        assert!(done >= 5 && done < total, "{done}/{total}");
        let lines = std::fs::read_to_string(&partial).unwrap().lines().count();
        assert_eq!(lines, done + 1, "header + one line per finished window");
        // A torn last line, as if killed mid-write.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&partial)
            .unwrap();
        std::io::Write::write_all(&mut f, b"{\"window\": 99, \"sum_n").unwrap();
        drop(f);

        // Without --resume an existing partial file is refused.
        let mut cfg = config(urls.clone(), ds.clone(), Method::Exl3, conc);
        cfg.output = Some(partial.clone());
        assert!(matches!(run_ppl(cfg).await, Err(PplError::Partial { .. })));
        // A different run is refused.
        let mut cfg = config(urls.clone(), ds.clone(), Method::Exl3, conc);
        cfg.output = Some(partial.clone());
        cfg.resume = true;
        cfg.ctx = 32;
        let e = run_ppl(cfg).await.unwrap_err();
        assert!(e.to_string().contains("different run"), "{e}");

        let before: usize = fakes
            .iter()
            .map(|f| f.score_calls.load(Ordering::SeqCst))
            .sum();
        let mut cfg = config(urls, ds, Method::Exl3, conc);
        cfg.output = Some(partial.clone());
        cfg.resume = true;
        let seen: Arc<Mutex<Vec<Progress>>> = Arc::default();
        let sink = seen.clone();
        cfg.on_progress = Some(ProgressHook(Arc::new(move |p| {
            sink.lock().unwrap().push(p)
        })));
        let r = run_ppl(cfg).await.unwrap();
        // The resumed windows first, then one report per window of this run.
        let seen = seen.lock().unwrap();
        let done_seen: Vec<usize> = seen.iter().map(|p| p.done).collect();
        assert_eq!(done_seen, (done..=total).collect::<Vec<_>>());
        assert!(seen.iter().all(|p| p.total == total));
        assert_rel(seen[total - done].perplexity, r.stats.perplexity);
        let after: usize = fakes
            .iter()
            .map(|f| f.score_calls.load(Ordering::SeqCst))
            .sum();
        assert_eq!(r.resumed_windows, done);
        assert_eq!(
            after - before,
            total - done,
            "finished windows are not redone"
        );
        let (s, c) = direct(Method::Exl3, 64, 24);
        assert_eq!(r.stats.tokens_scored, c);
        assert_rel(r.stats.perplexity, (s / c as f64).exp());
        let lines = std::fs::read_to_string(&partial).unwrap().lines().count();
        assert_eq!(lines, total + 1);
    }
}

#[tokio::test]
async fn max_windows_and_throttling() {
    let dir = tempfile::tempdir().unwrap();
    let f = Fake::throttled(3);
    let url = spawn(fake_app(f.clone())).await;
    let mut cfg = config(vec![url], write_dataset(dir.path()), Method::Exl3, 4);
    cfg.api_key = None;
    cfg.max_windows = Some(7);
    cfg.retry = RetryPolicy {
        max_retries: 5,
        base_delay: Duration::from_millis(1),
        max_delay: Duration::from_millis(5),
        max_retry_after: Duration::from_millis(10),
    };
    let r = run_ppl(cfg).await.unwrap();
    assert_eq!(r.stats.windows, 7);
    assert_eq!(r.stats.tokens_scored, 7 * 63);
    assert!(
        f.score_calls.load(Ordering::SeqCst) > 7,
        "429s were retried"
    );
}

#[tokio::test]
async fn wrong_key_fails_fast() {
    let dir = tempfile::tempdir().unwrap();
    let (urls, _f) = servers(1).await;
    let mut cfg = config(urls, write_dataset(dir.path()), Method::Exl3, 2);
    cfg.api_key = Some("wrong".into());
    // /health/ready and /info are open on the fake; the first authenticated call fails.
    let e = run_ppl(cfg).await.unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("API key"), "{msg}");
    assert!(!msg.contains('\n'));
}

#[tokio::test]
async fn wikitext2_through_the_runner() {
    let (urls, _f) = servers(2).await;
    let mut cfg = config(urls, DatasetSpec::Wikitext2, Method::Exl3, 4);
    cfg.ctx = 2048;
    cfg.stride = 512;
    cfg.max_windows = Some(3);
    let r = run_ppl(cfg).await.unwrap();
    assert_eq!(r.dataset.bytes, 1_293_436);
    assert_eq!(
        r.dataset.sha256,
        exactscore_client::dataset::WIKITEXT2_SHA256
    );
    assert_eq!(
        r.dataset.text_tokens + 1,
        r.dataset.sequence_tokens,
        "BOS added once"
    );
    assert_eq!(r.stats.windows, 3);
    assert_eq!(r.stats.tokens_scored, 3 * 2047);
    let tok = common::tokenizer();
    let wt =
        exactscore_client::dataset::load(&DatasetSpec::Wikitext2, &Default::default()).unwrap();
    let t = tok
        .encode_fast(wt.text.as_str(), true)
        .unwrap()
        .get_ids()
        .to_vec();
    let mut s = 0f64;
    for k in 0..3 {
        for p in 1..2048 {
            s += -(fake_logprob(t[k * 512 + p]) as f64);
        }
    }
    assert_rel(r.stats.perplexity, (s / (3.0 * 2047.0)).exp());
}

/// Issue 37: a partial file records the server's configuration; resuming it against a server
/// that computes other numbers (here: bf16 instead of f32) is refused, naming the field.
#[tokio::test]
async fn resume_refuses_a_server_configured_differently() {
    let dir = tempfile::tempdir().unwrap();
    let ds = write_dataset(dir.path());
    let partial = dir.path().join("partial.jsonl");
    let (urls, fakes) = servers(1).await;
    let mut cfg = config(urls.clone(), ds.clone(), Method::Exl3, 1);
    cfg.output = Some(partial.clone());
    cfg.stop_after = Some(2);
    let Err(PplError::Interrupted { done, .. }) = run_ppl(cfg.clone()).await else {
        panic!("expected an interrupted run");
    };
    fakes[0].info.lock().unwrap().dtype = "bf16".into();
    cfg.stop_after = None;
    cfg.resume = true;
    let e = run_ppl(cfg.clone()).await.unwrap_err().to_string();
    assert!(
        e.contains(r#"server dtype "f32" vs "bf16" (file vs now)"#),
        "{e}"
    );
    // The same server as when the file was written: resumed.
    fakes[0].info.lock().unwrap().dtype = "f32".into();
    let r = run_ppl(cfg).await.unwrap();
    assert_eq!(r.resumed_windows, done);
}

/// Issue 37: the servers of one run must agree on everything that changes the numbers, not only
/// the model name.
#[tokio::test]
async fn servers_of_one_run_must_agree_on_their_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let (urls, fakes) = servers(2).await;
    fakes[1].info.lock().unwrap().activation_quant_mode = "emulate".into();
    let cfg = config(urls.clone(), write_dataset(dir.path()), Method::Exl3, 2);
    let e = run_ppl(cfg).await.unwrap_err().to_string();
    assert!(
        e.contains(r#"activation_quant_mode "off" vs "emulate""#) && e.contains(&urls[1]),
        "{e}"
    );
}

/// Issue 37: `--max-windows 0` and `--timeout 0` are refused before any request, saying why.
#[tokio::test]
async fn zero_windows_and_zero_timeout_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (urls, fakes) = servers(1).await;
    let mut cfg = config(urls.clone(), write_dataset(dir.path()), Method::Exl3, 2);
    cfg.max_windows = Some(0);
    let e = run_ppl(cfg).await.unwrap_err().to_string();
    assert!(e.contains("--max-windows 0 would evaluate nothing"), "{e}");
    let mut cfg = config(urls, write_dataset(dir.path()), Method::Exl3, 2);
    cfg.timeout = Duration::ZERO;
    let e = run_ppl(cfg).await.unwrap_err().to_string();
    assert!(e.contains("--timeout 0"), "{e}");
    assert_eq!(fakes[0].score_calls.load(Ordering::SeqCst), 0);
}
