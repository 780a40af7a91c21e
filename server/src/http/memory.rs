//! Memory given back after large answers. An answer of tens of MB is built from millions of
//! small allocations (token strings, top-k entries) that glibc's malloc keeps in its arenas
//! once freed: without a trim the process stayed near its peak (160 MiB after a 32 MB answer
//! on the tiny model, from 25 MiB idle). After an answer of at least [`TRIM_ABOVE_BYTES`] the
//! middleware asks malloc to return free memory to the system, off the async workers, at most
//! one trim at a time.

use std::sync::atomic::{AtomicBool, Ordering};

use axum::body::HttpBody as _;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;

/// Answers at least this large are followed by a trim.
pub const TRIM_ABOVE_BYTES: u64 = 1 << 20;

static TRIMMING: AtomicBool = AtomicBool::new(false);

/// Middleware: a trim after a large answer was built (its structures are freed by then; the
/// serialized body is one large allocation, which malloc maps and unmaps by itself).
pub async fn trim_after_large_answers(req: Request, next: Next) -> Response {
    let response = next.run(req).await;
    let size = response.body().size_hint().exact().unwrap_or(0);
    if size >= TRIM_ABOVE_BYTES && !TRIMMING.swap(true, Ordering::SeqCst) {
        tokio::task::spawn_blocking(|| {
            trim();
            TRIMMING.store(false, Ordering::SeqCst);
        });
    }
    response
}

/// Returns free heap memory to the system (glibc); nothing elsewhere.
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[allow(unsafe_code)]
    // SAFETY: malloc_trim only walks malloc's own arenas; it takes no pointers from us.
    unsafe {
        libc::malloc_trim(0);
    }
}
