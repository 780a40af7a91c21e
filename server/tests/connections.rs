//! Connections over real sockets (the server's own accept loop and router over the fake
//! engine): nothing a client sends, or does not send, holds a connection open without bound,
//! and the limits on a request's head and body answer in the JSON error shape.
//!
//! * a connection that sends nothing, half a head, or nothing after a response is closed
//!   `--header-read-timeout-secs` after it was ready for a head;
//! * a body short of its `Content-Length` is a 408 after `--body-read-timeout-secs`;
//! * an oversized body announced with `Expect: 100-continue` is a 413 before any upload;
//! * a head with too many headers is a JSON 431.
//!
//! The measured times are printed (`--nocapture`); docs/reliability.md has them.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use exactscore_api::ErrorBody;
use exactscore_server::app::{Server, StateParts};
use exactscore_server::config::HttpConfig;
use exactscore_server::engine::fake::FakeEngine;
use exactscore_server::engine::BatchLimits;
use exactscore_server::tokenizer::TextTokenizer;

mod fake_app;

const HEADER_TIMEOUT: Duration = Duration::from_secs(1);
const BODY_TIMEOUT: Duration = Duration::from_secs(1);
/// Scheduling slack on a busy 2-core machine.
const SLACK: Duration = Duration::from_millis(1500);

/// Serves the fake app on 127.0.0.1 with 1 s header and body timeouts; the address.
async fn serve() -> String {
    let parts = StateParts {
        info: fake_app::info(8),
        tokenizer: Arc::new(TextTokenizer::load(&fake_app::fixture()).unwrap()),
        http: HttpConfig {
            api_key: None,
            metrics_without_auth: false,
            max_body_bytes: 64 * 1024,
            request_timeout: Duration::from_secs(30),
            drain_timeout: Duration::from_secs(5),
            header_read_timeout: HEADER_TIMEOUT,
            body_read_timeout: BODY_TIMEOUT,
        },
        batch: BatchLimits {
            max_batch_tokens: 256,
            max_batch_requests: 4,
        },
    };
    let server = Server::start(Box::new(FakeEngine::default()), parts).unwrap();
    server.warm_up().await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(server.serve(listener, std::future::pending()));
    addr
}

/// Runs `client` on a plain blocking socket to `addr` (off the runtime).
async fn with_socket<R: Send + 'static>(
    addr: &str,
    client: impl FnOnce(TcpStream) -> R + Send + 'static,
) -> R {
    let stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    tokio::task::spawn_blocking(move || client(stream))
        .await
        .unwrap()
}

/// Reads until the server closes the connection: what it sent and when it closed.
fn read_to_close(stream: &mut TcpStream) -> (Vec<u8>, Instant) {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return (out, Instant::now()),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            // A reset is a close too.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return (out, Instant::now())
            }
            Err(e) => panic!("connection still open: {e}"),
        }
    }
}

fn status_and_body(response: &[u8]) -> (u16, Vec<u8>) {
    let text = String::from_utf8_lossy(response);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not a response: {text:?}"));
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head");
    (status, response[split + 4..].to_vec())
}

fn assert_closed_after(label: &str, waited: Duration, limit: Duration) {
    println!(
        "{label}: closed {:.2} s after (limit {limit:?})",
        waited.as_secs_f64()
    );
    assert!(
        waited >= limit - Duration::from_millis(50),
        "{label}: {waited:?}"
    );
    assert!(waited < limit + SLACK, "{label}: {waited:?}");
}

/// Was: open for more than 200 s, with or without an API key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_half_sent_and_idle_connections_are_closed() {
    let addr = serve().await;
    let silent = with_socket(&addr, |mut s| {
        let start = Instant::now();
        let (sent, closed) = read_to_close(&mut s);
        assert!(sent.is_empty(), "{sent:?}");
        closed - start
    });
    let half = with_socket(&addr, |mut s| {
        s.write_all(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-")
            .unwrap();
        let start = Instant::now();
        let (sent, closed) = read_to_close(&mut s);
        assert!(sent.is_empty(), "{sent:?}");
        closed - start
    });
    let kept_alive = with_socket(&addr, |mut s| {
        s.write_all(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut buf = [0u8; 1024];
        let n = s.read(&mut buf).unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        let start = Instant::now();
        let (_, closed) = read_to_close(&mut s);
        closed - start
    });
    let (silent, half, kept_alive) = tokio::join!(silent, half, kept_alive);
    assert_closed_after("a connection that sends nothing", silent, HEADER_TIMEOUT);
    assert_closed_after("half a request head", half, HEADER_TIMEOUT);
    assert_closed_after("idle after a response", kept_alive, HEADER_TIMEOUT);
}

/// Was: the handler waited for the missing bytes forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_short_of_its_length_is_a_408() {
    let addr = serve().await;
    let (status, body, waited) = with_socket(&addr, |mut s| {
        let partial = br#"{"tokens": [1, "#;
        let head = "POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                    Content-Length: 100\r\n\r\n";
        s.write_all(&[head.as_bytes(), partial].concat()).unwrap();
        let start = Instant::now();
        let (response, closed) = read_to_close(&mut s);
        let (status, body) = status_and_body(&response);
        (status, body, closed - start)
    })
    .await;
    assert_eq!(status, 408);
    let e: ErrorBody = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        (e.kind.as_str(), e.field.as_deref()),
        ("body_timeout", Some("body"))
    );
    assert_closed_after("a body 86 bytes short", waited, BODY_TIMEOUT);
}

/// Was: `100 Continue`, then the whole upload, then the 413.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_body_announced_with_expect_is_refused_before_the_upload() {
    let addr = serve().await;
    let (response, waited) = with_socket(&addr, |mut s| {
        let head = "POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                    Content-Length: 1000000000\r\nExpect: 100-continue\r\n\r\n";
        s.write_all(head.as_bytes()).unwrap();
        let start = Instant::now();
        let (response, _) = read_to_close(&mut s);
        (response, start.elapsed())
    })
    .await;
    let (status, body) = status_and_body(&response);
    assert_eq!(status, 413, "{}", String::from_utf8_lossy(&response));
    let e: ErrorBody = serde_json::from_slice(&body).unwrap();
    assert_eq!(e.rule.as_deref(), Some("max_body_bytes"));
    assert!(waited < SLACK, "{waited:?}");
}

/// Was: hyper's 431 with an empty body. Up to hyper's own parse limit (1000 headers) the 431
/// is ours, in the JSON error shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_headers_is_a_json_431() {
    let addr = serve().await;
    let response = with_socket(&addr, |mut s| {
        let mut head = String::from("GET /info HTTP/1.1\r\nHost: x\r\n");
        for i in 0..150 {
            head.push_str(&format!("X-Filler-{i}: {i}\r\n"));
        }
        head.push_str("Connection: close\r\n\r\n");
        s.write_all(head.as_bytes()).unwrap();
        read_to_close(&mut s).0
    })
    .await;
    let (status, body) = status_and_body(&response);
    assert_eq!(status, 431);
    let e: ErrorBody = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        (e.kind.as_str(), e.field.as_deref()),
        ("headers_too_large", Some("headers"))
    );
    assert!(e.error.contains("152 headers"), "{}", e.error);
}
