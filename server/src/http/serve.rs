//! The HTTP/1.1 accept loop: what `axum::serve` does, with the connection limits it cannot set.
//! hyper gets a timer, so its header-read timeout applies: a connection must deliver a whole
//! request head within `--header-read-timeout-secs` of being ready for one (accepted, or its
//! previous response written). That bounds half-sent heads and idle keep-alive connections
//! alike: hyper times the wait for a head from the moment it starts waiting, so an idle
//! connection is one whose next head is late. Request bodies are timed where they are read
//! ([`super::json::ApiJson`], `--body-read-timeout-secs`).
//!
//! hyper's own limits on a head (count of headers, bytes buffered) sit above ours
//! ([`super::HeaderLimits`]), so a head too large for us reaches the router and gets a 431 in
//! the JSON error shape; only a head beyond hyper's limits gets hyper's bare 431.
//!
//! HTTP/1.1 only, as `axum::serve` was (axum is built without its `http2` feature).

use std::future::Future;
use std::io;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Headers hyper parses at most (ours: [`super::HeaderLimits`]).
pub const HYPER_MAX_HEADERS: usize = 1000;
/// Bytes hyper buffers at most while reading a head (and a body).
pub const HYPER_MAX_BUF_BYTES: usize = 1 << 20;

/// A server over `listener` (see [`serve`]).
pub struct Serve {
    listener: TcpListener,
    app: Router,
    header_read_timeout: Duration,
}

/// Serves `app` on `listener` until [`Serve::with_graceful_shutdown`]'s signal; the shape of
/// `axum::serve(listener, app).with_graceful_shutdown(signal)`.
pub fn serve(listener: TcpListener, app: Router, header_read_timeout: Duration) -> Serve {
    Serve {
        listener,
        app,
        header_read_timeout,
    }
}

impl Serve {
    /// Accepts connections until `signal` resolves; then closes the listener, lets every
    /// connection finish the request it is serving (idle ones close at once) and returns once
    /// all are closed.
    pub fn with_graceful_shutdown(
        self,
        signal: impl Future<Output = ()> + Send + 'static,
    ) -> impl Future<Output = io::Result<()>> + Send {
        self.run(signal)
    }

    async fn run(self, signal: impl Future<Output = ()> + Send + 'static) -> io::Result<()> {
        let Self {
            listener,
            app,
            header_read_timeout,
        } = self;
        // Dropping `stop_rx` tells the loop and every connection to stop.
        let (stop_tx, stop_rx) = watch::channel(());
        tokio::spawn(async move {
            signal.await;
            drop(stop_rx);
        });
        // Each connection holds a receiver: all are gone once `closed_tx.closed()` resolves.
        let (closed_tx, closed_rx) = watch::channel(());
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(header_read_timeout)
            .max_headers(HYPER_MAX_HEADERS)
            .max_buf_size(HYPER_MAX_BUF_BYTES);
        loop {
            let stream = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        accept_error(e).await;
                        continue;
                    }
                },
                () = stop_tx.closed() => break,
            };
            let service = TowerToHyperService::new(app.clone());
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            let (stop, closed) = (stop_tx.clone(), closed_rx.clone());
            tokio::spawn(async move {
                let mut connection = std::pin::pin!(connection);
                let mut stopping = std::pin::pin!(stop.closed());
                let mut stopped = false;
                loop {
                    tokio::select! {
                        result = connection.as_mut() => {
                            if let Err(e) = result {
                                // A peer that hung up or timed out: not the server's error.
                                tracing::debug!(error = %e, "connection closed");
                            }
                            break;
                        }
                        () = &mut stopping, if !stopped => {
                            stopped = true;
                            connection.as_mut().graceful_shutdown();
                        }
                    }
                }
                drop(closed);
            });
        }
        drop(closed_rx);
        drop(listener);
        closed_tx.closed().await;
        Ok(())
    }
}

/// As hyper 0.14 and axum do: a refused, aborted or reset connection is the peer's business;
/// anything else (out of file descriptors) is logged and accepting pauses for a second.
async fn accept_error(e: io::Error) {
    use io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    ) {
        return;
    }
    tracing::error!(error = %e, "accept error");
    tokio::time::sleep(Duration::from_secs(1)).await;
}
