//! Issue 38: what the `exactscore` CLI says when something is in the way, each message checked
//! for naming the problem and what to do, on one line, without a panic.

mod common;

use std::process::{Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use common::{error, fake_app, spawn, Fake};

fn run(args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_exactscore"))
        .args(args)
        .env_remove("EXACTSCORE_API_KEY")
        .env_remove("EXACTSCORE_SERVER")
        .output()
        .unwrap()
}

async fn exactscore(args: &[&str]) -> Output {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run(&args)
    })
    .await
    .unwrap()
}

/// The only line on stderr, which must start with `error: `.
fn one_error_line(out: &Output) -> String {
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    let lines: Vec<&str> = stderr.trim_end().lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    lines[0].to_string()
}

fn dead_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://{}", l.local_addr().unwrap())
}

fn dataset(dir: &std::path::Path) -> String {
    let p = dir.join("d.txt");
    std::fs::write(
        &p,
        "a few words of text to score, again and again. ".repeat(60),
    )
    .unwrap();
    p.to_str().unwrap().to_string()
}

#[test]
fn the_default_server_is_the_local_one() {
    for cmd in ["ppl", "kld", "info", "score", "diff"] {
        let out = run(&[cmd, "--help"]);
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(help.contains("http://127.0.0.1:8000"), "{cmd}: {help}");
    }
}

#[test]
fn no_server_fails_within_two_seconds_saying_how_to_start_one() {
    let url = dead_url();
    for args in [
        vec!["info", "--server", &url],
        vec!["ppl", "--server", &url, "--dataset", "wikitext2"],
    ] {
        let t = Instant::now();
        let out = run(&args);
        let secs = t.elapsed().as_secs_f64();
        let line = one_error_line(&out);
        assert!(secs < 2.0, "{secs} s: {line}");
        assert!(line.contains(&url), "{line}");
        assert!(
            line.contains("cargo run --release -p exactscore-server"),
            "{line}"
        );
    }
}

#[tokio::test]
async fn a_failed_run_says_how_to_resume_it() {
    let dir = tempfile::tempdir().unwrap();
    // The third /score and every one after it fail with a 422.
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let app = fake_app(Fake::new(None)).layer(axum::middleware::from_fn(
        move |req: Request, next: Next| {
            let calls = calls.clone();
            async move {
                if req.uri().path() == "/score" && calls.fetch_add(1, Ordering::SeqCst) >= 2 {
                    return error(StatusCode::UNPROCESSABLE_ENTITY, "validation", "scripted");
                }
                next.run(req).await
            }
        },
    ));
    let url = spawn(app).await;
    let data = dataset(dir.path());
    let partial = dir.path().join("run.jsonl");
    let base = [
        "ppl",
        "--server",
        &url,
        "--dataset",
        &data,
        "--ctx",
        "48",
        "--stride",
        "16",
        "--concurrency",
        "1",
        "--no-progress",
    ];
    let line = one_error_line(&exactscore(&base).await);
    assert!(
        line.contains("scripted") && line.contains("--output"),
        "{line}"
    );
    counter.store(0, Ordering::SeqCst);
    let mut with_output = base.to_vec();
    with_output.extend(["--output", partial.to_str().unwrap()]);
    let line = one_error_line(&exactscore(&with_output).await);
    assert!(
        line.contains("; 2/") && line.contains("--resume") && line.contains("run.jsonl"),
        "{line}"
    );
}

#[tokio::test]
async fn off_a_terminal_progress_is_plain_lines_with_the_running_statistic() {
    let dir = tempfile::tempdir().unwrap();
    let url = spawn(fake_app(Fake::new(None))).await;
    let data = dataset(dir.path());
    let out = exactscore(&[
        "ppl",
        "--server",
        &url,
        "--dataset",
        &data,
        "--ctx",
        "48",
        "--concurrency",
        "1",
        "--progress-every",
        "0",
    ])
    .await;
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("progress: "))
        .collect();
    assert!(lines.len() >= 2, "{stderr}");
    let last = lines[lines.len() - 1];
    for part in ["windows", "tok/s", "ETA", "ppl "] {
        assert!(last.contains(part), "{last}");
    }
    assert!(
        !stderr.contains('\r') && !stderr.contains('\u{1b}'),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_closed_stdout_ends_quietly() {
    let url = spawn(fake_app(Fake::new(None))).await;
    let out = tokio::task::spawn_blocking(move || {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_exactscore"))
            .args(["info", "--server", &url])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // `exactscore info | head -0`: the reader is gone before anything is written.
        drop(child.stdout.take());
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
}

#[test]
fn compare_names_what_it_was_given_instead_of_a_report() {
    let dir = tempfile::tempdir().unwrap();
    let partial = dir.path().join("p.jsonl");
    std::fs::write(
        &partial,
        "{\"exactscore_partial\":1,\"method\":\"exl3\"}\n{\"window\":0}\n",
    )
    .unwrap();
    let line = one_error_line(&run(&["compare", partial.to_str().unwrap()]));
    assert!(
        line.contains("partial file") && line.contains("--resume"),
        "{line}"
    );
    let diff = dir.path().join("d.json");
    std::fs::write(&diff, r#"{"server":"x","layers":[],"kld":{}}"#).unwrap();
    let line = one_error_line(&run(&["compare", diff.to_str().unwrap()]));
    assert!(line.contains("exactscore diff --from"), "{line}");
    let other = dir.path().join("o.json");
    std::fs::write(&other, r#"{"a":1}"#).unwrap();
    let line = one_error_line(&run(&["compare", other.to_str().unwrap()]));
    assert!(line.contains("not an `exactscore ppl` or `kld`"), "{line}");
}

#[tokio::test]
async fn an_os_error_is_shown_once_and_a_directory_is_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let url = spawn(fake_app(Fake::new(None))).await;
    let missing = dir.path().join("missing.txt");
    let line = one_error_line(
        &exactscore(&[
            "ppl",
            "--server",
            &url,
            "--dataset",
            missing.to_str().unwrap(),
        ])
        .await,
    );
    assert_eq!(line.matches("os error 2").count(), 1, "{line}");
    let folder = dir.path().join("texts.txt");
    std::fs::create_dir(&folder).unwrap();
    let line = one_error_line(
        &exactscore(&[
            "ppl",
            "--server",
            &url,
            "--dataset",
            folder.to_str().unwrap(),
        ])
        .await,
    );
    assert_eq!(line.matches("a directory").count(), 1, "{line}");
}

#[tokio::test]
async fn zero_timeouts_are_refused_by_every_command() {
    for args in [
        vec!["info", "--timeout", "0"],
        vec!["ppl", "--dataset", "wikitext2", "--timeout", "0"],
        vec!["diff", "--timeout", "0"],
    ] {
        let out = exactscore(&args).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            stderr.contains("0 would fail every request at once"),
            "{stderr}"
        );
    }
}

#[tokio::test]
async fn a_key_with_a_trailing_newline_is_refused_before_any_request() {
    let fake = Fake::new(Some("k"));
    let url = spawn(fake_app(fake.clone())).await;
    let t = Instant::now();
    let line = one_error_line(&exactscore(&["info", "--server", &url, "--api-key", "k\n"]).await);
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(
        line.contains("API key") && line.contains("white space"),
        "{line}"
    );
}

#[test]
fn an_unsupported_plot_format_lists_the_supported_ones() {
    let dir = tempfile::tempdir().unwrap();
    let pdf = dir.path().join("out.pdf");
    let out = run(&[
        "diff",
        "--from",
        "nothing.json",
        "--plot",
        pdf.to_str().unwrap(),
    ]);
    let line = one_error_line(&out);
    assert!(
        line.contains(".pdf") && line.contains(".png") && line.contains(".svg"),
        "{line}"
    );
}
