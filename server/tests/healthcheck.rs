//! `exactscore-server --healthcheck` (the container HEALTHCHECK) against the real binary: it
//! fails while nothing listens, passes once the server is ready, fails on a 503, and maps a
//! wildcard `--host` to loopback.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_exactscore-server");

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn healthcheck(host: &str, port: u16) -> Output {
    Command::new(BIN)
        .args(["--healthcheck", "--host", host, "--port", &port.to_string()])
        .env_remove("EXACTSCORE_HOST")
        .env_remove("EXACTSCORE_PORT")
        .output()
        .unwrap()
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn healthcheck_follows_readiness_of_the_real_server() {
    let port = free_port();
    let before = healthcheck("127.0.0.1", port);
    assert_eq!(before.status.code(), Some(1), "nothing listens yet");
    let stderr = String::from_utf8_lossy(&before.stderr);
    assert!(stderr.contains("connecting to 127.0.0.1"), "{stderr}");

    let server = Killed(
        Command::new(BIN)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let start = Instant::now();
    let ready = loop {
        let out = healthcheck("0.0.0.0", port);
        if out.status.success() {
            break out;
        }
        assert!(
            start.elapsed() < Duration::from_secs(180),
            "not ready after 180 s: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let stdout = String::from_utf8_lossy(&ready.stdout);
    assert!(stdout.starts_with("HTTP/1.0 200"), "{stdout}");
    drop(server);
    assert_eq!(healthcheck("127.0.0.1", port).status.code(), Some(1));
}

#[test]
fn healthcheck_fails_on_a_503() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let answer = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut request = Vec::new();
        let mut buf = [0u8; 1024];
        while !request.ends_with(b"\r\n\r\n") {
            let n = conn.read(&mut buf).unwrap();
            assert!(n > 0, "request ended early: {request:?}");
            request.extend_from_slice(&buf[..n]);
        }
        let request = String::from_utf8(request).unwrap();
        conn.write_all(
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 21\r\n\r\n{\"status\":\"draining\"}",
        )
        .unwrap();
        request
    });
    let out = healthcheck("127.0.0.1", port);
    let request = answer.join().unwrap();
    assert!(
        request.starts_with("GET /health/ready HTTP/1.0\r\n"),
        "{request}"
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("503 Service Unavailable"), "{stderr}");
}
