//! `exactscore-server`: parse flags into a Config, set up logging, load the model, warm it up
//! and serve until SIGTERM or ctrl-c, then drain and exit 0.

use anyhow::Context;
use clap::Parser;
use exactscore_server::app::Server;
use exactscore_server::config::{Args, Config, LogFormat};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.print_openapi {
        let doc = exactscore_server::http::openapi();
        println!("{}", doc.to_pretty_json().context("serializing OpenAPI")?);
        return Ok(());
    }
    let config = Config::from_args(args)?;
    init_logging(config.log_format);
    tracing::info!(model = %config.model_dir.display(), device = ?config.device, "loading");

    let server = Server::load(&config).await.context("starting the engine")?;
    let listener = tokio::net::TcpListener::bind((config.host.as_str(), config.port))
        .await
        .with_context(|| format!("binding {}:{}", config.host, config.port))?;
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
    server.serve(listener, shutdown_signal()).await?;
    tracing::info!("bye");
    Ok(())
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
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
