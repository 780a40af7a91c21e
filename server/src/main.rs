//! `exactscore-server`: parse flags into a Config, set up logging, load the model, warm it up
//! and serve until SIGTERM or ctrl-c, then drain and exit 0 (or, after a sticky device error,
//! drain and exit 1 so that the orchestrator restarts it).
//!
//! Logs go to stderr, with ANSI colours only when stderr is a terminal. A start-up failure is
//! one line on stderr (`exactscore-server: error: ...: cause`) and exit status 1; a backtrace
//! follows only when asked with `RUST_LIB_BACKTRACE=1` (`RUST_BACKTRACE` alone governs panics:
//! a wrong `--model` path is not a bug, and many shells export `RUST_BACKTRACE=1`).

use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use exactscore_server::app::{Server, Shutdown};
use exactscore_server::config::{Args, Config, LogFormat};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    exactscore_server::http::memory::configure_malloc();
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) if !e.use_stderr() => {
            // --help and --version: clap's own output, exit 0.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // clap's message without its usage block, on one line, with the values a flag
            // takes where it lists them.
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or("invalid arguments");
            let first = first.strip_prefix("error: ").unwrap_or(first);
            let values = text
                .lines()
                .map(str::trim)
                .find(|l| l.starts_with("[possible values:"))
                .map_or(String::new(), |l| format!(" {l}"));
            eprintln!("exactscore-server: error: {first}{values} (see --help)");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => return fail(&anyhow::Error::new(e).context("starting the async runtime")),
    };
    let outcome = runtime.block_on(run(args));
    // A worker left in the middle of a batch (an abandoned drain, a lost device) is not waited
    // for.
    runtime.shutdown_timeout(std::time::Duration::from_millis(500));
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

/// One line: the context chain joined by `: `. The backtrace anyhow captured only on request.
fn fail(err: &anyhow::Error) -> ExitCode {
    // The context chain, skipping a cause whose text its parent already quotes (thiserror
    // variants such as `loading the model: {0}` are both the message and the source).
    let mut line = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if !line.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
    }
    let line = line.replace(['\n', '\r'], " ");
    eprintln!("exactscore-server: error: {line}");
    if backtrace_asked() {
        eprintln!("{}", err.backtrace());
    }
    ExitCode::FAILURE
}

fn backtrace_asked() -> bool {
    std::env::var("RUST_LIB_BACKTRACE").is_ok_and(|v| v != "0")
}

async fn run(args: Args) -> anyhow::Result<()> {
    if args.print_openapi {
        let doc = exactscore_server::http::openapi();
        println!("{}", doc.to_pretty_json().context("serializing OpenAPI")?);
        return Ok(());
    }
    if args.healthcheck {
        return healthcheck(&args.host, args.port);
    }
    let config = Config::from_args(args).context("invalid configuration")?;
    init_logging(config.log_format);
    // The port first: a port in use is found in a moment, not after the model has loaded.
    let listener = bind(&config.host, config.port).await?;
    tracing::info!(model = %config.model_dir.display(), device = %config.device, "loading");

    let server = Server::load(&config).await.context("starting the engine")?;
    let addr = listener.local_addr()?;
    server.warm_up().await.context("warm-up")?;
    tracing::info!(%addr, model = %server.state.info.model, "ready");

    // Upkeep bounds the memory of histograms between scrapes.
    if let Some(handle) = server.state.metrics.clone() {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
            loop {
                tick.tick().await;
                handle.run_upkeep();
            }
        });
    }
    match server.serve(listener, shutdown_signal()).await? {
        Shutdown::Drained => {
            tracing::info!("bye");
            Ok(())
        }
        Shutdown::DeviceLost(message) => {
            anyhow::bail!("a device failed for good ({message}); exiting for a restart")
        }
    }
}

/// The listening socket, with what to do when the address is taken.
async fn bind(host: &str, port: u16) -> anyhow::Result<tokio::net::TcpListener> {
    match tokio::net::TcpListener::bind((host, port)).await {
        Ok(listener) => Ok(listener),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => anyhow::bail!(
            "cannot listen on {host}:{port}: the address is in use (another exactscore-server?): \
             pass --port N, or stop what listens there"
        ),
        Err(e) => Err(anyhow::Error::new(e).context(format!("binding {host}:{port}"))),
    }
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// `--healthcheck`: one HTTP/1.0 `GET /health/ready` to this host and port, 3 s at most.
fn healthcheck(host: &str, port: u16) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    use std::net::{TcpStream, ToSocketAddrs};
    let timeout = std::time::Duration::from_secs(3);
    // A server listening on every address answers on loopback.
    let host = match host.trim_matches(['[', ']']) {
        "0.0.0.0" => "127.0.0.1",
        "::" => "::1",
        h => h,
    };
    let addr = (host, port)
        .to_socket_addrs()
        .with_context(|| format!("resolving {host}"))?
        .next()
        .with_context(|| format!("{host} has no address"))?;
    let mut stream = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let request = format!("GET /health/ready HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    stream.write_all(request.as_bytes())?;
    let mut head = Vec::new();
    stream.take(4096).read_to_end(&mut head)?;
    let head = String::from_utf8_lossy(&head);
    let status = head.lines().next().unwrap_or_default();
    anyhow::ensure!(
        status.split_whitespace().nth(1) == Some("200"),
        "{addr}/health/ready: {}",
        if status.is_empty() {
            "no answer"
        } else {
            status
        }
    );
    println!("{status}");
    Ok(())
}
