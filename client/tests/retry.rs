//! Retry behaviour of the typed client against scripted local servers.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use common::spawn;
use exactscore_api::ErrorBody;
use exactscore_client::{Client, ClientConfig, ClientError, RetryPolicy};

fn fast() -> RetryPolicy {
    RetryPolicy {
        max_retries: 3,
        base_delay: Duration::from_millis(1),
        max_delay: Duration::from_millis(10),
        max_retry_after: Duration::from_secs(5),
    }
}

fn client(url: &str, key: Option<&str>) -> Client {
    let mut c = ClientConfig::new(url);
    c.api_key = key.map(String::from);
    c.retry = fast();
    c.timeout = Duration::from_secs(20);
    Client::new(c).unwrap()
}

type Script = Vec<(u16, Option<&'static str>)>;
type Scripted = (Arc<AtomicUsize>, Arc<Script>);

/// `/score` answers the scripted statuses in order, then 200 with a valid response.
fn scripted(script: Script) -> (Router, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let script = Arc::new(script);
    let handler = move |State((calls, script)): State<Scripted>| async move {
        let n = calls.fetch_add(1, Ordering::SeqCst);
        if let Some(&(status, retry_after)) = script.get(n) {
            let status = StatusCode::from_u16(status).unwrap();
            let body = Json(ErrorBody {
                error: format!("scripted {}", status.as_u16()),
                kind: match status.as_u16() {
                    429 => "overloaded",
                    503 => "not_ready",
                    401 => "unauthorized",
                    504 => "timeout",
                    _ => "validation",
                }
                .into(),
                field: (status.as_u16() == 422).then(|| "tokens".to_string()),
                rule: (status.as_u16() == 422).then(|| "non-empty".to_string()),
                value: None,
            });
            let mut r: Response = (status, body).into_response();
            if let Some(ra) = retry_after {
                r.headers_mut().insert("retry-after", ra.parse().unwrap());
            }
            return r;
        }
        Json(serde_json::json!({
            "model": "m",
            "sequences": [{"index": 0, "tokens": [1, 2], "token_logprobs": [null, -0.5],
                           "sum_nll": 0.5, "num_scored": 1, "mean_nll": 0.5, "perplexity": 1.6487}],
            "usage": {"input_tokens": 2, "scored_tokens": 1, "queue_ms": 0.0, "compute_ms": 0.0}
        }))
        .into_response()
    };
    let app = Router::new()
        .route("/score", post(handler))
        .route("/info", get(handler))
        .with_state((calls.clone(), script));
    (app, calls)
}

#[tokio::test]
async fn retries_429_honouring_retry_after() {
    let (app, calls) = scripted(vec![(429, Some("1"))]);
    let url = spawn(app).await;
    let t = Instant::now();
    let s = client(&url, None).score_tokens(&[1, 2]).await.unwrap();
    assert_eq!(s.token_logprobs, Some(vec![None, Some(-0.5)]));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert!(t.elapsed() >= Duration::from_secs(1), "waited Retry-After");
}

#[tokio::test]
async fn retries_503_then_succeeds() {
    let (app, calls) = scripted(vec![(503, None), (503, None)]);
    let url = spawn(app).await;
    client(&url, None).score_tokens(&[1, 2]).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn gives_up_after_max_retries() {
    let (app, calls) = scripted(vec![(429, Some("0")); 10]);
    let url = spawn(app).await;
    let e = client(&url, None).score_tokens(&[1, 2]).await.unwrap_err();
    assert!(
        matches!(&e, ClientError::RetriesExhausted { attempts: 4, .. }),
        "{e:?}"
    );
    assert_eq!(e.status(), Some(429));
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn the_servers_own_time_limit_is_not_retried() {
    // A 504 `timeout` from ExactScore: the same request would run as long again.
    let (app, calls) = scripted(vec![(504, None), (504, None)]);
    let url = spawn(app).await;
    let e = client(&url, None).score_tokens(&[1, 2]).await.unwrap_err();
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "no retry on the server's own 504"
    );
    assert_eq!(e.status(), Some(504));
}

#[tokio::test]
async fn a_proxys_504_is_retried() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let app = Router::new().route(
        "/score",
        post(move || {
            let counted = counted.clone();
            async move {
                if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                    return (StatusCode::GATEWAY_TIMEOUT, "upstream timed out").into_response();
                }
                Json(serde_json::json!({
                    "model": "m",
                    "sequences": [{"index": 0, "tokens": [1, 2], "token_logprobs": [null, -0.5],
                                   "sum_nll": 0.5, "num_scored": 1, "mean_nll": 0.5,
                                   "perplexity": 1.6487}],
                    "usage": {"input_tokens": 2, "scored_tokens": 1, "queue_ms": 0.0,
                              "compute_ms": 0.0}
                }))
                .into_response()
            }
        }),
    );
    let url = spawn(app).await;
    client(&url, None).score_tokens(&[1, 2]).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn validation_error_is_not_retried() {
    let (app, calls) = scripted(vec![(422, None), (422, None)]);
    let url = spawn(app).await;
    let e = client(&url, None).score_tokens(&[1, 2]).await.unwrap_err();
    assert_eq!(calls.load(Ordering::SeqCst), 1, "no retry on 422");
    match &e {
        ClientError::Api { status, body, .. } => {
            assert_eq!(*status, 422);
            assert_eq!(body.kind, "validation");
            assert_eq!(body.field.as_deref(), Some("tokens"));
            assert_eq!(body.rule.as_deref(), Some("non-empty"));
        }
        other => panic!("expected Api error, got {other:?}"),
    }
}

#[tokio::test]
async fn wrong_key_is_a_one_line_error() {
    let (app, calls) = scripted(vec![(401, None); 5]);
    let url = spawn(app).await;
    let e = client(&url, Some("nope")).info().await.unwrap_err();
    assert!(
        matches!(e, ClientError::Unauthorized { status: 401, .. }),
        "{e:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1, "no retry on 401");
    let msg = e.to_string();
    assert!(
        msg.contains("rejected the API key") && !msg.contains('\n'),
        "{msg}"
    );
}

#[tokio::test]
async fn cli_wrong_key_prints_one_line_and_fails() {
    let (app, _calls) = scripted(vec![(401, None); 5]);
    let url = spawn(app).await;
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_exactscore"))
            .args(["info", "--server", &url, "--api-key", "nope"])
            .env_remove("EXACTSCORE_API_KEY")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("error: ") && stderr.contains("API key"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked") && !stderr.contains("Backtrace"));
}

/// A server that never answered fails at once: more likely absent than restarting.
#[tokio::test]
async fn connection_refused_by_a_server_never_reached_fails_at_once() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("http://127.0.0.1:{port}");
    let t = std::time::Instant::now();
    let e = client(&url, None).info().await.unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(matches!(e, ClientError::NoServer { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains(&url) && msg.contains("cargo run --release -p exactscore-server"),
        "{msg}"
    );
}

/// A server that answered once and then refuses connections is retried (a restart).
#[tokio::test]
async fn connection_refused_after_an_answer_is_retried_then_reported() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 4096];
        let _ = sock.read(&mut buf).await.unwrap();
        let body = r#"{"status":"ready","replicas_out_of_rotation":[]}"#;
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
             connection: close\r\n\r\n",
            body.len()
        );
        sock.write_all(head.as_bytes()).await.unwrap();
        sock.write_all(body.as_bytes()).await.unwrap();
        // The listener is dropped here: later connections are refused.
    });
    let c = client(&url, None);
    c.ready().await.unwrap();
    server.await.unwrap();
    let e = c.info().await.unwrap_err();
    match &e {
        ClientError::RetriesExhausted { attempts, last } => {
            assert_eq!(*attempts, 4);
            assert!(matches!(**last, ClientError::Connect { .. }), "{last:?}");
        }
        other => panic!("{other:?}"),
    }
}

/// A 503 `out_of_memory` is sent for a sequence that failed even in a batch of its own: the
/// same request would fail again, so it is not retried.
#[tokio::test]
async fn out_of_memory_for_a_sequence_alone_is_not_retried() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let app = Router::new().route(
        "/score",
        post(move || {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
                common::error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "out_of_memory",
                    "the device ran out of memory for this sequence even in a batch of its own",
                )
            }
        }),
    );
    let url = spawn(app).await;
    let e = client(&url, None).score_tokens(&[1, 2]).await.unwrap_err();
    assert_eq!(calls.load(Ordering::SeqCst), 1, "{e}");
    assert_eq!(e.status(), Some(503));
    assert!(e.to_string().contains("out_of_memory"), "{e}");
}

/// A key with a trailing newline (read from a file) is refused before any request, naming the
/// problem, instead of being retried as a transport error.
#[tokio::test]
async fn a_key_with_white_space_is_refused_when_the_client_is_made() {
    for key in ["secret\n", " secret", ""] {
        let mut c = ClientConfig::new("http://127.0.0.1:1");
        c.api_key = Some(key.into());
        let e = Client::new(c).unwrap_err();
        assert!(matches!(e, ClientError::BadKey(_)), "{e:?}");
        assert!(e.to_string().contains("white space"), "{e}");
    }
}
