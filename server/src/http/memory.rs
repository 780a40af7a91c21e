//! Memory given back after large answers. An answer of tens of MB is built from millions of
//! small allocations (token strings, top-k entries) that glibc's malloc keeps in its arenas
//! once freed: without a trim the process stayed near its peak (160 MiB after a 32 MB answer
//! on the tiny model, from 25 MiB idle). After an answer of at least [`TRIM_ABOVE_BYTES`] the
//! middleware asks malloc to return free memory to the system, off the async workers, at most
//! one trim at a time.
//!
//! `malloc_trim` alone is not enough: it never shrinks the top of a thread's arena. A request
//! whose tensors landed in a second arena kept 36 MiB resident after a 4 MB answer, in about
//! one run in three with other processes busy. [`configure_malloc`] therefore keeps one arena.

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

/// Blocks of at least this size are mapped on their own and unmapped when freed: glibc's
/// largest dynamic value, from the start.
const MMAP_THRESHOLD_BYTES: i32 = 32 << 20;
/// A free top of the arena above this size is given back as blocks are freed. Lower values
/// cost the CPU forward pass time: it frees and re-faults its scratch (2 × 4096 tokens on the
/// tiny model: 4.2 s at 1 MiB, 2.4 s at 64 MiB).
const TRIM_THRESHOLD_BYTES: i32 = 64 << 20;

/// One malloc arena for every thread, so that [`trim`] reaches all free memory, and fixed
/// mmap and trim thresholds (glibc's dynamic maxima). Measured on the CPU test of the expected
/// peak (2 × 4096 tokens): 3.5 s and 137 MB with glibc's defaults, 2.4 s and 119 MB with these;
/// the compute allocates a tensor an op, so threads rarely contend for the one arena. Call
/// first thing in `main`, before other threads start; nothing outside glibc.
pub fn configure_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[allow(unsafe_code)]
    // SAFETY: mallopt only sets malloc's own parameters; it takes no pointers.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES);
    }
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
