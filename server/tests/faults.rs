//! Device faults through the real router, queue, batcher and workers, over fake engines: a
//! batch that runs out of memory is retried in halves until it fits; a replica that keeps
//! failing answers 503 until it leaves the rotation while the other replica keeps answering
//! 200; a sticky device error turns the server not-ready, and `serve` ends on its own within
//! the drain timeout, reporting the lost device (the binary then exits 1: `process.rs`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::Router;
use exactscore_api::{ErrorBody, Health, ScoreResponse};
use exactscore_server::app::{Server, Shutdown, StateParts};
use exactscore_server::config::HttpConfig;
use exactscore_server::engine::fake::{FakeEngine, FakeFault};
use exactscore_server::engine::{BatchLimits, Engine, EngineError};
use exactscore_server::http::router;
use exactscore_server::tokenizer::TextTokenizer;
use serde_json::json;
use tower::ServiceExt;

mod fake_app;

use fake_app::{fixture, info};

const DRAIN: Duration = Duration::from_secs(2);

fn parts() -> StateParts {
    StateParts {
        info: info(64),
        tokenizer: Arc::new(TextTokenizer::load(&fixture()).unwrap()),
        http: HttpConfig {
            api_key: None,
            metrics_without_auth: false,
            max_body_bytes: 64 * 1024,
            request_timeout: Duration::from_secs(30),
            drain_timeout: DRAIN,
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(30),
        },
        batch: BatchLimits {
            max_batch_tokens: 256,
            max_batch_requests: 8,
        },
    }
}

async fn started(engines: Vec<Arc<dyn Engine>>) -> Server {
    let server = Server::start_replicas(engines, parts()).unwrap();
    server.warm_up().await.unwrap();
    server
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, Vec<u8>) {
    let res = app.clone().oneshot(req).await.unwrap();
    let status = res.status();
    let body = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, body.to_vec())
}

fn score(tokens: serde_json::Value) -> Request<Body> {
    Request::post("/score")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(json!({ "tokens": tokens }).to_string()))
        .unwrap()
}

fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

/// The engine runs out of memory above 10 tokens: a request of 6 sequences of 5 tokens, sent
/// while the engine computes another batch so that all 6 wait for one batch of 30 tokens, is
/// answered in full from the halves (15 tokens, still too many; then 10 and 5). A sequence of
/// 12 tokens does not fit even alone: 503 naming out-of-memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_memory_is_retried_in_halves_until_the_batch_fits() {
    let (engine, gate) = FakeEngine::gated();
    let engine = engine.with_fault(FakeFault::OutOfMemoryAbove(10));
    let server = Server::start_replicas(vec![Arc::new(engine)], parts()).unwrap();
    let state = server.state.clone();
    let app = router(state.clone());
    // Warm-up, then a batch that holds the engine while the big request queues.
    let warm = tokio::spawn(async move {
        server.warm_up().await.unwrap();
        server
    });
    let gate = tokio::task::spawn_blocking(move || {
        gate.wait_started();
        gate.release();
        gate
    })
    .await
    .unwrap();
    let _server = warm.await.unwrap();
    let blocker = tokio::spawn({
        let app = app.clone();
        async move { send(&app, score(json!([1, 2]))).await }
    });
    let gate = tokio::task::spawn_blocking(move || {
        gate.wait_started();
        gate
    })
    .await
    .unwrap();
    let retries_before = counter(&app, "exactscore_oom_retries_total").await;
    let sequences: Vec<Vec<u32>> = (0..6)
        .map(|s| (0..5).map(|i| s * 100 + i).collect())
        .collect();
    let big = tokio::spawn({
        let app = app.clone();
        let sequences = sequences.clone();
        async move { send(&app, score(json!(sequences))).await }
    });
    // Let the six sequences queue behind the held batch, then let every batch through.
    while state.scheduler.queue_depth() < 6 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let releaser = std::thread::spawn(move || {
        for _ in 0..20 {
            gate.release();
        }
        gate
    });
    assert_eq!(blocker.await.unwrap().0, StatusCode::OK);
    let (status, body) = big.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let response: ScoreResponse = serde_json::from_slice(&body).unwrap();
    for (seq, tokens) in response.sequences.iter().zip(&sequences) {
        let logprobs = seq.token_logprobs.as_ref().unwrap();
        for (i, lp) in logprobs.iter().enumerate().skip(1) {
            assert_eq!(*lp, Some(FakeEngine::logprob(tokens[i])));
        }
    }
    // 30 tokens → 15 + 15, each 15 → 5 + 10: three halvings.
    let retries = counter(&app, "exactscore_oom_retries_total").await - retries_before;
    assert_eq!(retries, 3.0);
    let gate = releaser.join().unwrap();
    // Alone and still too large: the client learns why.
    let too_long: Vec<u32> = (0..12).collect();
    let app2 = app.clone();
    let alone = tokio::spawn(async move { send(&app2, score(json!(too_long))).await });
    std::thread::spawn(move || {
        for _ in 0..4 {
            gate.release();
        }
    });
    let (status, body) = alone.await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let e: ErrorBody = serde_json::from_slice(&body).unwrap();
    assert_eq!(e.kind, "out_of_memory", "{e:?}");
    assert!(e.error.contains("out of memory"), "{e:?}");
}

/// The value of a counter (without labels) in `/metrics`, 0 when absent.
async fn counter(app: &Router, name: &str) -> f64 {
    let (_, body) = send(app, get("/metrics")).await;
    let text = String::from_utf8(body).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Replica 1 fails every batch after its warm-up. Requests sent one after the other go to
/// whichever replica waits: replica 1's are answered 503 until it has failed
/// `FAILURES_OUT_OF_ROTATION` batches in a row and leaves the rotation; every other request,
/// and every request after that, is answered 200 by replica 0. Readiness stays 200 and names
/// the replica that left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_replica_leaves_the_rotation_while_the_other_serves() {
    let failing = FakeEngine::faulty(FakeFault::FailAfter {
        after: 1,
        error: EngineError::Compute("fake: the device returned garbage".into()),
    });
    let server = started(vec![Arc::new(FakeEngine::default()), Arc::new(failing)]).await;
    let app = router(server.state.clone());
    let failures = exactscore_server::engine::worker::FAILURES_OUT_OF_ROTATION;
    let mut statuses = Vec::new();
    // Until replica 1 has failed its last batch (which replica an arrival goes to depends on
    // which one waits at that instant), then ten more.
    let mut after_out = 0;
    for i in 0..200u32 {
        let (status, body) = send(&app, score(json!([1, 2, i]))).await;
        if status == StatusCode::SERVICE_UNAVAILABLE {
            let e: ErrorBody = serde_json::from_slice(&body).unwrap();
            assert_eq!(e.kind, "compute_failed", "{e:?}");
        } else {
            assert_eq!(status, StatusCode::OK);
            let r: ScoreResponse = serde_json::from_slice(&body).unwrap();
            let lp = r.sequences[0].token_logprobs.as_ref().unwrap()[2];
            assert_eq!(lp, Some(FakeEngine::logprob(i)));
        }
        statuses.push(status.as_u16());
        if statuses.iter().filter(|&&s| s == 503).count() == failures {
            after_out += 1;
            if after_out > 10 {
                break;
            }
        }
    }
    assert_eq!(
        statuses.iter().filter(|&&s| s == 503).count(),
        failures,
        "{statuses:?}"
    );
    // Out of rotation after its third failure: every later request is served.
    assert!(statuses.ends_with(&[200; 10]), "{statuses:?}");
    let (status, body) = send(&app, get("/health/ready")).await;
    assert_eq!(status, StatusCode::OK);
    let health: Health = serde_json::from_slice(&body).unwrap();
    assert_eq!(health.replicas_out_of_rotation.len(), 1);
    assert_eq!(health.replicas_out_of_rotation[0].replica, 1);
    assert!(
        health.replicas_out_of_rotation[0]
            .reason
            .contains("3 consecutive batches failed"),
        "{health:?}"
    );
}

/// A sticky device error: the request that hit it is answered 503 `device_lost`, readiness
/// turns 503 `device_lost` at once, and `serve` ends by itself within the drain timeout,
/// reporting the lost device (no signal is sent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_device_makes_the_server_not_ready_and_stop() {
    let lost = FakeEngine::faulty(FakeFault::FailAfter {
        after: 1,
        error: EngineError::DeviceLost("fake: CUDA_ERROR_ILLEGAL_ADDRESS".into()),
    });
    let server = started(vec![Arc::new(lost)]).await;
    let app = router(server.state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let started = Instant::now();
    let serving = tokio::spawn(server.serve(listener, std::future::pending()));
    let (status, body) = send(&app, score(json!([1, 2, 3]))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let e: ErrorBody = serde_json::from_slice(&body).unwrap();
    assert_eq!(e.kind, "device_lost", "{e:?}");
    let mut ready = None;
    for _ in 0..100 {
        let (status, body) = send(&app, get("/health/ready")).await;
        if status == StatusCode::SERVICE_UNAVAILABLE {
            ready = Some(serde_json::from_slice::<Health>(&body).unwrap());
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(ready.expect("still ready").status, "device_lost");
    let outcome = tokio::time::timeout(DRAIN + Duration::from_secs(3), serving)
        .await
        .expect("serve did not end after the device was lost")
        .unwrap()
        .unwrap();
    assert!(matches!(outcome, Shutdown::DeviceLost(ref m) if m.contains("ILLEGAL_ADDRESS")));
    assert!(started.elapsed() < DRAIN + Duration::from_secs(2));
}
