//! The real `exactscore-server` binary on the tiny fixture model, on 127.0.0.1 only:
//!
//! * start-up errors are one line (backtrace only with `RUST_LIB_BACKTRACE=1`);
//! * logs go to stderr without ANSI codes when it is not a terminal, and never hold the key;
//! * a client that hangs up costs no compute (`exactscore_sequences_cancelled_total`);
//! * SIGTERM under load: not ready at once, new scoring requests 503, every admitted request
//!   answered, exit 0 within the drain timeout;
//! * load: 64 concurrent connections of mixed requests; every 200 is bit-identical to the
//!   answer of the same request sent alone, the only other status is 429 (small queue), and
//!   the process's memory does not grow from one round to the next.
//!
//! The HTTP client is a few lines over a TCP socket (one request per connection), so a test
//! can hang up mid-request. Figures are printed (`--nocapture`); docs/reliability.md has them.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_exactscore-server");

fn fixture() -> String {
    format!(
        "{}/../tests/fixtures/llama-w4a16-g128",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn command(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    if !args.contains(&"--model") {
        cmd.args(["--model", &fixture()]);
    }
    cmd.args(["--host", "127.0.0.1", "--port", "0"])
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("RUST_LIB_BACKTRACE")
        .env_remove("EXACTSCORE_API_KEY")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// A running server: its address and everything it wrote to stderr so far.
struct Server {
    child: Child,
    addr: String,
    stderr: Arc<Mutex<String>>,
    stdout: Arc<Mutex<String>>,
}

impl Server {
    fn start(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut cmd = command(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn exactscore-server");
        let stderr = Arc::new(Mutex::new(String::new()));
        let stdout = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let err_pipe = child.stderr.take().unwrap();
        let log = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err_pipe).lines() {
                let Ok(line) = line else { break };
                if let Some(at) = line.find("addr=") {
                    let addr = line[at + 5..].split_whitespace().next().unwrap_or("");
                    let _ = tx.send(addr.to_string());
                }
                let mut log = log.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let out_pipe = child.stdout.take().unwrap();
        let out = stdout.clone();
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut BufReader::new(out_pipe), &mut text);
            out.lock().unwrap().push_str(&text);
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("server not ready: {}", stderr.lock().unwrap()));
        assert!(addr.starts_with("127.0.0.1:"), "{addr}");
        Self {
            child,
            addr,
            stderr,
            stdout,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn sigterm(&self) {
        let ok = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -TERM failed");
    }

    /// Waits for the exit (bounded) and returns its status and how long it took.
    fn wait_exit(&mut self, limit: Duration) -> (std::process::ExitStatus, Duration) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return (status, start.elapsed());
            }
            if start.elapsed() > limit {
                let _ = self.child.kill();
                panic!("server did not exit within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Resident memory of the process in MiB (Linux).
    fn rss_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("VmRSS");
        kib / 1024.0
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug)]
enum Outcome {
    Response {
        status: u16,
        body: Vec<u8>,
    },
    /// No connection: the listener is closed.
    Refused,
    /// Connected, but the connection ended before a whole response.
    Broken(#[allow(dead_code)] String), // shown by Debug
}

/// One request on its own connection (`Connection: close`), on the blocking pool (plain
/// std sockets: the suite needs no extra tokio features).
async fn http(addr: &str, method: &str, path: &str, key: Option<&str>, body: &[u8]) -> Outcome {
    let (addr, method, path) = (addr.to_string(), method.to_string(), path.to_string());
    let (key, body) = (key.map(str::to_string), body.to_vec());
    tokio::task::spawn_blocking(move || http_blocking(&addr, &method, &path, key.as_deref(), &body))
        .await
        .unwrap()
}

fn http_blocking(addr: &str, method: &str, path: &str, key: Option<&str>, body: &[u8]) -> Outcome {
    use std::io::{Read, Write};
    let mut stream = match std::net::TcpStream::connect(addr) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return Outcome::Refused,
        Err(e) => return Outcome::Broken(format!("connect: {e}")),
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(120)));
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{auth}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    if let Err(e) = stream.write_all(&[head.as_bytes(), body].concat()) {
        return Outcome::Broken(format!("write: {e}"));
    }
    let mut buf = Vec::new();
    if let Err(e) = stream.read_to_end(&mut buf) {
        return Outcome::Broken(format!("read: {e}"));
    }
    parse_response(&buf).unwrap_or_else(|| {
        Outcome::Broken(format!(
            "incomplete response: {:?}",
            String::from_utf8_lossy(&buf[..buf.len().min(200)])
        ))
    })
}

fn parse_response(buf: &[u8]) -> Option<Outcome> {
    let split = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&buf[..split]).ok()?;
    let status: u16 = head.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf[split + 4..].to_vec();
    let length = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse::<usize>().ok())?
    });
    match length {
        Some(n) if n == body.len() => Some(Outcome::Response { status, body }),
        Some(_) => None,
        None => Some(Outcome::Response { status, body }),
    }
}

async fn ok_json(addr: &str, method: &str, path: &str, key: Option<&str>, body: &Value) -> Value {
    let body = if body.is_null() {
        Vec::new()
    } else {
        body.to_string().into_bytes()
    };
    match http(addr, method, path, key, &body).await {
        Outcome::Response { status: 200, body } => serde_json::from_slice(&body).unwrap(),
        other => panic!("{method} {path}: {other:?}"),
    }
}

async fn metrics(addr: &str, key: Option<&str>) -> BTreeMap<String, f64> {
    let Outcome::Response { status: 200, body } = http(addr, "GET", "/metrics", key, b"").await
    else {
        panic!("/metrics failed");
    };
    common::parse_metrics(&String::from_utf8(body).unwrap())
}

fn metric(m: &BTreeMap<String, f64>, name: &str) -> f64 {
    m.get(name).copied().unwrap_or(0.0)
}

// ---- start-up errors and logs ---------------------------------------------------------------

fn run_to_exit(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = command(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A wrong `--model`, a refused flag value and an unparsable flag: one line each, no
/// backtrace even with `RUST_BACKTRACE=1` (as set in many shells); the backtrace comes with
/// `RUST_LIB_BACKTRACE=1`.
#[test]
fn startup_errors_are_one_line() {
    let missing = "/nonexistent/exactscore-model";
    for (args, code, needle) in [
        (&["--model", missing][..], 1, missing),
        (&["--device", "tpu"][..], 1, "--device tpu"),
        (&["--max-batch-tokens", "0"][..], 1, "--max-batch-tokens"),
        (&["--max-queued-requests", "eighty"][..], 2, "eighty"),
        (
            &["--dtype", "f64"][..],
            2,
            "[possible values: f32, bf16, f16]",
        ),
        (&["--no-such-flag"][..], 2, "--no-such-flag"),
    ] {
        let (status, stdout, stderr) = run_to_exit(args, &[("RUST_BACKTRACE", "1")]);
        assert_eq!(status, code, "{args:?}: {stderr}");
        assert!(stdout.is_empty(), "{args:?}: stdout {stdout}");
        let errors: Vec<&str> = stderr.lines().filter(|l| !l.contains(" INFO ")).collect();
        assert_eq!(errors.len(), 1, "{args:?}: {stderr}");
        assert!(
            errors[0].starts_with("exactscore-server: error: ") && errors[0].contains(needle),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains('\x1b'), "{args:?}: ANSI in {stderr:?}");
    }
    let (status, _, stderr) = run_to_exit(&["--model", missing], &[("RUST_LIB_BACKTRACE", "1")]);
    assert_eq!(status, 1);
    let after: Vec<&str> = stderr
        .lines()
        .skip_while(|l| !l.starts_with("exactscore-server: error: "))
        .collect();
    assert!(after.len() > 3, "no backtrace when asked: {stderr}");
}

/// A port in use is refused at once, before the model loads, saying what to do.
#[test]
fn a_port_in_use_is_refused_before_the_model_loads() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out = Command::new(BIN)
        .args([
            "--model",
            &fixture(),
            "--host",
            "127.0.0.1",
            "--port",
            &port,
        ])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("127.0.0.1:{port}"))
            && stderr.contains("in use")
            && stderr.contains("--port"),
        "{stderr}"
    );
    // Nothing was loaded: the "loading" line comes after the bind.
    assert!(!stderr.contains("loading"), "{stderr}");
}

/// Logs (at trace level) go to stderr, carry no ANSI codes when stderr is a pipe and never
/// contain the API key, right or wrong; the key in the environment works as the flag does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_are_plain_and_never_hold_the_key() {
    let key = "k-7c1f9e2ab4d8-secret";
    let mut server = Server::start(&[], &[("EXACTSCORE_API_KEY", key), ("RUST_LOG", "trace")]);
    let addr = server.addr.clone();
    let body = json!({"tokens": [1992, 51, 78]});
    ok_json(&addr, "POST", "/score", Some(key), &body).await;
    let wrong = "k-7c1f9e2ab4d8-secreX";
    match http(
        &addr,
        "POST",
        "/score",
        Some(wrong),
        body.to_string().as_bytes(),
    )
    .await
    {
        Outcome::Response { status: 401, .. } => {}
        other => panic!("{other:?}"),
    }
    ok_json(&addr, "GET", "/info", Some(key), &Value::Null).await;
    server.sigterm();
    let (status, _) = server.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status:?}");
    std::thread::sleep(Duration::from_millis(100)); // the reader threads finish
    let log = server.stderr();
    assert!(log.contains("ready"), "{log}");
    assert!(
        log.lines().count() > 10,
        "trace level logs expected:\n{log}"
    );
    assert!(!log.contains('\x1b'), "ANSI escape codes in a piped log");
    assert!(
        !log.contains(key) && !log.contains(wrong),
        "a key was logged"
    );
    assert!(!log.contains("7c1f9e2ab4d8"), "part of a key was logged");
    assert!(
        server.stdout.lock().unwrap().is_empty(),
        "logs went to stdout"
    );
    // The start-up lines read as the flags do: no Rust Debug text, sizes to three decimals.
    let startup: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("loading") || l.contains("placement"))
        .collect();
    assert!(startup.len() >= 2, "{log}");
    for line in startup {
        assert!(
            !line.contains("DeviceSpec") && !line.contains('['),
            "{line}"
        );
        for field in line.split_whitespace().filter(|w| w.contains("_gib=")) {
            let decimals = field.split('.').nth(1).map_or(0, str::len);
            assert!(decimals <= 3, "{line}");
        }
    }
}

// ---- disconnects -----------------------------------------------------------------------

/// While a long request computes (one sequence per batch), 24 clients send a request each and
/// hang up 300 ms later. None of their sequences is computed: the cancelled counter rises by 24 and the
/// processed-token counter by exactly the long request's tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnected_clients_cost_no_compute() {
    let server = Server::start(
        &[
            "--max-batch-requests",
            "1",
            "--max-batch-tokens",
            "4096",
            "--max-input-tokens",
            "4096",
        ],
        &[],
    );
    let addr = server.addr.clone();
    let before = metrics(&addr, None).await;
    // Three long sequences, computed one batch each: the queue is busy for a while.
    let long: Vec<Vec<u32>> = (0..3)
        .map(|s| (0..1500).map(|i| (i * 7 + s * 13) % 2000).collect())
        .collect();
    let long_tokens = (long.len() * long[0].len()) as f64;
    let long_body = json!({ "tokens": long }).to_string();
    let started = Instant::now();
    let long_req = tokio::spawn({
        let addr = addr.clone();
        async move { http(&addr, "POST", "/score", None, long_body.as_bytes()).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    const GONE: usize = 24;
    let mut hangups = Vec::new();
    for i in 0..GONE {
        let addr = addr.clone();
        hangups.push(tokio::task::spawn_blocking(move || {
            use std::io::Write;
            let mut s = std::net::TcpStream::connect(&addr).unwrap();
            let body = json!({"tokens": [1992, 10 + i, 20 + i, 30 + i]}).to_string();
            let req = format!(
                "POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\n\r\n{body}",
                body.len()
            );
            s.write_all(req.as_bytes()).unwrap();
            // Long enough for the server to read the request and queue it, far shorter than
            // the long request's computation.
            std::thread::sleep(Duration::from_millis(300));
            drop(s); // hang up before the answer
        }));
    }
    for h in hangups {
        h.await.unwrap();
    }
    let hung_up_at = started.elapsed();
    match long_req.await.unwrap() {
        Outcome::Response { status: 200, .. } => {}
        other => panic!("long request: {other:?}"),
    }
    let long_secs = started.elapsed().as_secs_f64();
    assert!(
        hung_up_at.as_secs_f64() < long_secs,
        "the long request ended before the hang-ups ({hung_up_at:?})"
    );
    // The batcher drops cancelled entries when it forms the next batch.
    let after = metrics(&addr, None).await;
    let cancelled = metric(&after, "exactscore_sequences_cancelled_total")
        - metric(&before, "exactscore_sequences_cancelled_total");
    let processed = metric(&after, "exactscore_tokens_processed_total")
        - metric(&before, "exactscore_tokens_processed_total");
    println!(
        "disconnects: {GONE} clients hung up during a {long_secs:.2} s request; \
         cancelled {cancelled}, tokens processed {processed} (long request {long_tokens})"
    );
    assert_eq!(cancelled, GONE as f64);
    assert_eq!(processed, long_tokens, "a hung-up sequence was computed");
    // Still serving.
    ok_json(&addr, "POST", "/score", None, &json!({"tokens": [1992, 5]})).await;
}

// ---- SIGTERM under load ------------------------------------------------------------------

#[derive(Default, Debug)]
struct Tally {
    before_ok: usize,
    after_ok: usize,
    after_503: usize,
    refused: usize,
    reset_after_close: usize,
    wrong: Vec<String>,
}

/// 64 clients keep sending; SIGTERM arrives mid-load. Readiness is 503 at once, requests
/// sent before the signal are all answered 200 (and correctly), later ones get 200 (admitted
/// before the flag flipped), 503, or a refused connection once the listener is closed; the
/// process exits 0 within the drain timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_drains_and_exits_0() {
    let drain = 20;
    let mut server = Server::start(
        &[
            "--max-queued-requests",
            "512",
            "--drain-timeout-secs",
            &drain.to_string(),
        ],
        &[],
    );
    let addr = server.addr.clone();
    let bodies: Vec<String> = (0..16)
        .map(|i| {
            json!({"tokens": [[1992, 100 + i, 200 + i, 300 + i, 400 + i, 500 + i]]}).to_string()
        })
        .collect();
    let mut expected = Vec::new();
    for b in &bodies {
        let v = ok_json(
            &addr,
            "POST",
            "/score",
            None,
            &serde_json::from_str(b).unwrap(),
        )
        .await;
        expected.push(v["sequences"].clone());
    }
    let expected = Arc::new(expected);
    let bodies = Arc::new(bodies);
    let signal: Arc<Mutex<Option<Instant>>> = Arc::default();
    let tally: Arc<Mutex<Tally>> = Arc::default();
    let mut clients = Vec::new();
    for c in 0..64 {
        let (addr, bodies, expected, signal, tally) = (
            addr.clone(),
            bodies.clone(),
            expected.clone(),
            signal.clone(),
            tally.clone(),
        );
        clients.push(tokio::spawn(async move {
            for n in 0..200usize {
                let i = (c + n) % bodies.len();
                let sent = Instant::now();
                let outcome = http(&addr, "POST", "/score", None, bodies[i].as_bytes()).await;
                let signalled = *signal.lock().unwrap();
                // Sent before the signal (with 20 ms of slack for the kill to be delivered).
                let before = signalled.is_none_or(|t| sent + Duration::from_millis(20) < t);
                let mut t = tally.lock().unwrap();
                match outcome {
                    Outcome::Response { status: 200, body } => {
                        let v: Value = serde_json::from_slice(&body).unwrap();
                        if v["sequences"] != expected[i] {
                            t.wrong.push(format!("wrong answer for body {i}"));
                        }
                        if before {
                            t.before_ok += 1;
                        } else {
                            t.after_ok += 1;
                        }
                    }
                    Outcome::Response { status: 503, .. } if !before => t.after_503 += 1,
                    Outcome::Refused if !before => {
                        t.refused += 1;
                        return;
                    }
                    // Accepted by the kernel after the last admitted answer, then closed with
                    // the listener: never reached the server.
                    Outcome::Broken(_) if !before => {
                        t.reset_after_close += 1;
                        return;
                    }
                    other => t.wrong.push(format!("before={before}: {other:?}")),
                }
            }
        }));
    }
    // Let the load build up, then signal.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let in_flight_ok = tally.lock().unwrap().before_ok;
    *signal.lock().unwrap() = Some(Instant::now());
    let t_signal = Instant::now();
    server.sigterm();
    // Readiness turns false at once (polled on new connections while the drain runs).
    let mut not_ready_after = None;
    for _ in 0..200 {
        if let Outcome::Response { status: 503, body } =
            http(&addr, "GET", "/health/ready", None, b"").await
        {
            assert!(String::from_utf8_lossy(&body).contains("draining"));
            not_ready_after = Some(t_signal.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let not_ready_after = not_ready_after.expect("readiness never turned 503");
    for c in clients {
        c.await.unwrap();
    }
    let (status, _) = server.wait_exit(Duration::from_secs(drain + 10));
    let exit_after = t_signal.elapsed();
    let t = tally.lock().unwrap();
    println!(
        "SIGTERM under load: {in_flight_ok} answered before the signal; after it: readiness 503 \
         in {:.1} ms; {} sent before it answered 200, {} more admitted 200, {} refused 503, \
         {} connections refused, {} reset after close; exit {:?} {:.2} s after the signal \
         (drain timeout {drain} s)",
        not_ready_after.as_secs_f64() * 1e3,
        t.before_ok,
        t.after_ok,
        t.after_503,
        t.refused,
        t.reset_after_close,
        status.code(),
        exit_after.as_secs_f64(),
    );
    assert!(t.wrong.is_empty(), "{:?}", &t.wrong[..t.wrong.len().min(5)]);
    assert!(status.success(), "exit {status:?}: {}", server.stderr());
    assert!(exit_after < Duration::from_secs(drain));
    assert!(not_ready_after < Duration::from_millis(500));
    assert!(t.before_ok > 64, "{t:?}");
    assert!(
        t.after_503 > 0,
        "no request was refused while draining: {t:?}"
    );
    let log = server.stderr();
    assert!(log.contains("drained"), "{log}");
}

// ---- load ----------------------------------------------------------------------------------

/// A mix of requests over every scoring and tokenizer route, each with its answer when sent
/// alone (timings and ids removed).
fn mix() -> Vec<(&'static str, Value)> {
    let mut out = Vec::new();
    for i in 0..8u32 {
        let len = 4 + (i * 5) % 28;
        let ids: Vec<u32> = (0..len).map(|j| (j * 31 + i * 17 + 1) % 2000).collect();
        out.push(("/score", json!({ "tokens": ids, "top_k": i % 3 })));
        out.push((
            "/score",
            json!({"tokens": [ids.clone(), ids[..2].to_vec(), [1992, i]], "return": {"greedy": true}}),
        ));
        out.push((
            "/v1/score",
            json!({"text": format!("Sample {i}: to be, or not to be"), "top_k": 3}),
        ));
        out.push((
            "/v1/completions",
            json!({"prompt": format!("The number {i} is"), "echo": true, "logprobs": 2,
                   "max_tokens": 1, "temperature": 0}),
        ));
        out.push(("/tokenize", json!({ "prompt": format!("token {i}") })));
    }
    out
}

fn normalize(mut v: Value) -> Value {
    if let Some(o) = v.as_object_mut() {
        o.remove("id"); // cmpl-N
        if o.contains_key("sequences") {
            o.remove("usage"); // queue and compute times
        }
    }
    v
}

struct LoadResult {
    ok: usize,
    status: BTreeMap<u16, usize>,
    latencies: Vec<Duration>,
    wrong: Vec<String>,
}

async fn load(addr: &str, total: usize, expected: Arc<Vec<Value>>) -> LoadResult {
    let requests = Arc::new(mix());
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let result = Arc::new(Mutex::new(LoadResult {
        ok: 0,
        status: BTreeMap::new(),
        latencies: Vec::new(),
        wrong: Vec::new(),
    }));
    let mut clients = Vec::new();
    for _ in 0..64 {
        let (addr, requests, expected, next, result) = (
            addr.to_string(),
            requests.clone(),
            expected.clone(),
            next.clone(),
            result.clone(),
        );
        clients.push(tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if n >= total {
                    break;
                }
                let i = (n * 7) % requests.len();
                let (path, body) = &requests[i];
                let start = Instant::now();
                let outcome = http(&addr, "POST", path, None, body.to_string().as_bytes()).await;
                let took = start.elapsed();
                let mut r = result.lock().unwrap();
                match outcome {
                    Outcome::Response { status, body } => {
                        *r.status.entry(status).or_default() += 1;
                        if status == 200 {
                            r.ok += 1;
                            r.latencies.push(took);
                            let v = normalize(serde_json::from_slice(&body).unwrap());
                            if v != expected[i] {
                                r.wrong.push(format!("{path} {body:?} differs"));
                            }
                        }
                    }
                    other => r.wrong.push(format!("{path}: {other:?}")),
                }
            }
        }));
    }
    for c in clients {
        c.await.unwrap();
    }
    Arc::try_unwrap(result)
        .ok()
        .expect("clients done")
        .into_inner()
        .unwrap()
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

async fn expected_answers(addr: &str) -> Arc<Vec<Value>> {
    let mut out = Vec::new();
    for (path, body) in mix() {
        out.push(normalize(ok_json(addr, "POST", path, None, &body).await));
    }
    Arc::new(out)
}

/// `EXACTSCORE_LOAD_REQUESTS` (default 2000) requests from 64 connections, in two rounds;
/// then 400 against a server whose queue holds 4 requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_64_connections_bitwise_answers_bounded_memory() {
    let total: usize = std::env::var("EXACTSCORE_LOAD_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let server = Server::start(&[], &[]);
    let addr = server.addr.clone();
    let expected = expected_answers(&addr).await;
    let rss_idle = server.rss_mib();
    let start = Instant::now();
    let first = load(&addr, total / 2, expected.clone()).await;
    let rss_first = server.rss_mib();
    let second = load(&addr, total - total / 2, expected.clone()).await;
    let rss_second = server.rss_mib();
    let secs = start.elapsed().as_secs_f64();
    let mut latencies: Vec<Duration> = first
        .latencies
        .iter()
        .chain(&second.latencies)
        .copied()
        .collect();
    latencies.sort();
    println!(
        "load: {total} requests, 64 connections, {secs:.1} s ({:.0} req/s): {} + {} OK; \
         p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; RSS idle {rss_idle:.1} MiB, after round 1 \
         {rss_first:.1} MiB, after round 2 {rss_second:.1} MiB",
        total as f64 / secs,
        first.ok,
        second.ok,
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        percentile(&latencies, 1.0),
    );
    for r in [&first, &second] {
        assert!(r.wrong.is_empty(), "{:?}", &r.wrong[..r.wrong.len().min(5)]);
        assert_eq!(
            r.status.keys().copied().collect::<Vec<_>>(),
            vec![200],
            "{:?}",
            r.status
        );
    }
    assert_eq!(first.ok + second.ok, total);
    // No growth from one round to the next (allocator noise allowed).
    assert!(
        rss_second <= rss_first * 1.10 + 8.0,
        "RSS grew: {rss_first:.1} -> {rss_second:.1} MiB"
    );
    drop(server);

    // A queue of 4 requests under 64 connections: 429s, and only 429s, besides exact 200s.
    let small = Server::start(&["--max-queued-requests", "4"], &[]);
    let expected = expected_answers(&small.addr).await;
    let r = load(&small.addr, 400, expected).await;
    println!("load, queue of 4: 400 requests: {:?}", r.status);
    assert!(r.wrong.is_empty(), "{:?}", &r.wrong[..r.wrong.len().min(5)]);
    let statuses: Vec<u16> = r.status.keys().copied().collect();
    assert!(
        statuses.iter().all(|s| [200, 429].contains(s)),
        "{statuses:?}"
    );
    assert!(
        r.status.get(&429).copied().unwrap_or(0) > 0,
        "no 429 with a queue of 4"
    );
    assert!(r.ok > 0);
}

// ---- bounded shutdown ----------------------------------------------------------------------

/// `--drain-timeout-secs` bounds the shutdown even when the admitted work would take much
/// longer: 12 requests of 4096 tokens (several seconds of compute each on the CPU) are in
/// flight at SIGTERM; once the timeout passes, every one not yet answered gets a 503
/// `shutting_down` JSON error, compute stops at the next batch boundary, and the process exits
/// 0 shortly after the timeout instead of after the work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_timeout_bounds_the_shutdown() {
    let drain = 1;
    let mut server = Server::start(
        &[
            "--drain-timeout-secs",
            &drain.to_string(),
            "--max-input-tokens",
            "4096",
        ],
        &[],
    );
    let addr = server.addr.clone();
    let requests: Vec<_> = (0..12u32)
        .map(|r| {
            let ids: Vec<u32> = (0..4096).map(|i| (i * 7 + r * 131) % 2000).collect();
            let addr = addr.clone();
            tokio::spawn(async move {
                let body = json!({ "tokens": ids }).to_string();
                http(&addr, "POST", "/score", None, body.as_bytes()).await
            })
        })
        .collect();
    // Admitted and computing.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let signalled = Instant::now();
    server.sigterm();
    let (status, _) = server.wait_exit(Duration::from_secs(30));
    let exited_after = signalled.elapsed();
    let (mut answered, mut abandoned) = (0, 0);
    for request in requests {
        match request.await.unwrap() {
            Outcome::Response { status: 200, .. } => answered += 1,
            Outcome::Response { status: 503, body } => {
                let e: Value = serde_json::from_slice(&body).unwrap();
                assert_eq!(e["kind"], "shutting_down", "{e}");
                abandoned += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    println!(
        "drain timeout {drain} s with 12 × 4096-token requests in flight: exit {:?} {:.2} s after \
         SIGTERM; {answered} answered 200 before the timeout, {abandoned} answered 503 \
         shutting_down",
        status.code(),
        exited_after.as_secs_f64()
    );
    assert!(status.success(), "exit {status:?}: {}", server.stderr());
    assert!(
        abandoned > 0,
        "all 12 finished within {drain} s: make them longer"
    );
    assert_eq!(answered + abandoned, 12);
    assert!(
        exited_after < Duration::from_secs(drain + 2),
        "exited {exited_after:?} after the signal: {}",
        server.stderr()
    );
    // Work the drain abandons is what a drain does, not an error of the server.
    let log = server.stderr();
    let errors: Vec<&str> = log.lines().filter(|l| l.contains(" ERROR ")).collect();
    assert!(errors.is_empty(), "{errors:#?}");
}

/// A sticky device error (injected: the real binary, the real model, the engine told to fail
/// every batch after the warm-up with CUDA_ERROR_LAUNCH_FAILED): the request is answered 503
/// `device_lost`, readiness is 503 `device_lost` at once, and the process exits 1 on its own
/// within the drain timeout, for its orchestrator to restart it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_device_exits_1_within_the_drain_timeout() {
    let drain = 2;
    let mut server = Server::start(
        &[
            "--drain-timeout-secs",
            &drain.to_string(),
            "--inject-fault",
            "device-lost-after:1",
        ],
        &[],
    );
    let addr = server.addr.clone();
    let failed = Instant::now();
    match http(
        &addr,
        "POST",
        "/score",
        None,
        br#"{"tokens": [1992, 51, 78]}"#,
    )
    .await
    {
        Outcome::Response { status: 503, body } => {
            let e: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(e["kind"], "device_lost", "{e}");
        }
        other => panic!("{other:?}"),
    }
    match http(&addr, "GET", "/health/ready", None, b"").await {
        Outcome::Response { status: 503, body } => {
            let health: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(health["status"], "device_lost", "{health}");
        }
        // Already gone: the listener closed once nothing was left to drain.
        Outcome::Refused | Outcome::Broken(_) => {}
        other => panic!("{other:?}"),
    }
    let (status, _) = server.wait_exit(Duration::from_secs(drain + 10));
    let exited_after = failed.elapsed();
    println!(
        "device lost: exit {:?} {:.2} s after the failing request (drain timeout {drain} s)",
        status.code(),
        exited_after.as_secs_f64()
    );
    assert_eq!(status.code(), Some(1), "{}", server.stderr());
    assert!(exited_after < Duration::from_secs(drain + 1));
    let log = server.stderr();
    assert!(
        log.contains("exactscore-server: error: a device failed"),
        "{log}"
    );
}

/// A sticky device error in one of two pipelined replicas (two stages each; injected into
/// replica 0 after its warm-up and two batches): the other replica keeps answering, every 200
/// is bitwise equal to the first, and the process exits 1 within the drain timeout of the first
/// `device_lost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_device_in_one_pipelined_replica_stops_the_server_the_other_stays_exact() {
    let drain = 2;
    let mut server = Server::start(
        &[
            "--device",
            "cpu,cpu,cpu,cpu",
            "--replicas",
            "2",
            "--drain-timeout-secs",
            &drain.to_string(),
            "--inject-fault",
            "device-lost-after:3@0",
        ],
        &[],
    );
    let addr = server.addr.clone();
    let body = br#"{"tokens": [1992, 51, 78, 1474, 618]}"#;
    let (mut answers, mut lost_at) = (Vec::new(), None);
    for _ in 0..40 {
        match http(&addr, "POST", "/score", None, body).await {
            Outcome::Response { status: 200, body } => {
                let v: Value = serde_json::from_slice(&body).unwrap();
                answers.push(normalize(v));
            }
            Outcome::Response { status: 503, body } => {
                let e: Value = serde_json::from_slice(&body).unwrap();
                lost_at.get_or_insert_with(Instant::now);
                assert!(
                    ["device_lost", "draining", "not_ready"]
                        .contains(&e["kind"].as_str().unwrap_or("")),
                    "{e}"
                );
            }
            Outcome::Refused | Outcome::Broken(_) => break,
            other => panic!("{other:?}"),
        }
    }
    let lost_at = lost_at.expect("replica 0 never reported its lost device");
    println!("{} answers bitwise checked before the stop", answers.len());
    assert!(
        answers.len() >= 3,
        "{} answers before the stop",
        answers.len()
    );
    assert!(answers.iter().all(|a| *a == answers[0]), "{answers:#?}");
    let (status, _) = server.wait_exit(Duration::from_secs(drain + 10));
    assert_eq!(status.code(), Some(1), "{}", server.stderr());
    assert!(lost_at.elapsed() < Duration::from_secs(drain + 1));
}

// ---- batch invariance under load (issue 27) -------------------------------------------------

/// 1000 requests from 32 connections, most of them one to three tokens long (alone, such a
/// request is a batch of one to three tokens in total; under load it shares a batch with
/// others), each answer bitwise equal to the same request's answer alone. Before the CPU GEMM
/// was padded to its general kernel, a request of two tokens differed from its answer alone
/// whenever it shared a batch (-13.269264 vs -13.269267 for `[1474, 618]`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_requests_under_load_are_bitwise_equal_to_alone() {
    let server = Server::start(&[], &[]);
    let addr = server.addr.clone();
    let mut requests = vec![json!({"tokens": [1474, 618]}), json!({"tokens": [1992]})];
    for i in 0..30u32 {
        let id = |j: u32| (i * 131 + j * 17 + 3) % 2000;
        let len = 1 + i % 3;
        let ids: Vec<u32> = (0..len).map(id).collect();
        requests.push(match i % 5 {
            0 => json!({"tokens": [ids, [id(7), id(8)]], "top_k": 2}),
            1 => json!({"tokens": (0..20).map(id).collect::<Vec<_>>(), "top_k": 1}),
            _ => json!({ "tokens": ids, "top_k": i % 4 }),
        });
    }
    let mut expected = Vec::new();
    for body in &requests {
        expected.push(normalize(
            ok_json(&addr, "POST", "/score", None, body).await,
        ));
    }
    let (requests, expected) = (Arc::new(requests), Arc::new(expected));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let wrong = Arc::new(Mutex::new(Vec::new()));
    const TOTAL: usize = 1000;
    let start = Instant::now();
    let mut clients = Vec::new();
    for _ in 0..32 {
        let (addr, requests, expected, next, wrong) = (
            addr.clone(),
            requests.clone(),
            expected.clone(),
            next.clone(),
            wrong.clone(),
        );
        clients.push(tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if n >= TOTAL {
                    break;
                }
                let i = (n * 7) % requests.len();
                let got = normalize(ok_json(&addr, "POST", "/score", None, &requests[i]).await);
                if got != expected[i] {
                    wrong.lock().unwrap().push(requests[i].to_string());
                }
            }
        }));
    }
    for c in clients {
        c.await.unwrap();
    }
    let batches = metrics(&addr, None).await;
    let wrong = wrong.lock().unwrap();
    println!(
        "batch invariance under load: {TOTAL} requests ({} distinct, 1-3 tokens in {} of them) \
         from 32 connections in {:.1} s, {} batches: {} differ from their answer alone",
        requests.len(),
        requests.len() - 6,
        start.elapsed().as_secs_f64(),
        metric(&batches, "exactscore_batch_tokens_count"),
        wrong.len()
    );
    assert!(wrong.is_empty(), "{:?}", &wrong[..wrong.len().min(5)]);
}
