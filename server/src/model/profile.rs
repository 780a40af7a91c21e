//! The stages of the model's device work, and their opt-in wall time (`exactscore-bench speed --profile`). Each
//! stage synchronizes its device before and after, so asynchronous GPU work is charged to the
//! stage that queued it. Off by default: then a stage costs one relaxed atomic load.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::{Device, Result};

static ENABLED: AtomicBool = AtomicBool::new(false);
/// (stage, total time, calls), in the order stages first ran.
static TOTALS: Mutex<Vec<(&'static str, Duration, u64)>> = Mutex::new(Vec::new());
/// (stage, the most bytes live tensors held during one of its calls), where the device says.
static PEAKS: Mutex<Vec<(&'static str, u64)>> = Mutex::new(Vec::new());

pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether stages are being timed (`exactscore-bench speed --profile`).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The totals since the last call, and a fresh start.
pub fn take() -> Vec<(&'static str, Duration, u64)> {
    std::mem::take(&mut *TOTALS.lock().unwrap_or_else(|e| e.into_inner()))
}

/// Each stage's memory peak since the last call (empty on the CPU), and a fresh start.
pub fn take_peaks() -> Vec<(&'static str, u64)> {
    std::mem::take(&mut *PEAKS.lock().unwrap_or_else(|e| e.into_inner()))
}

/// Runs `f` as the stage `name` on `device`. Every piece of the model's device work runs in a
/// stage, so this is where a thread is bound to the device it works on (cuBLAS and candle's
/// per-thread stream resolve against the thread's current context, which work on another
/// device may have left behind). Stages must not nest (their times would be counted twice).
pub fn stage<R>(name: &'static str, device: &Device, f: impl FnOnce() -> Result<R>) -> Result<R> {
    crate::device::bind(device)?;
    if !ENABLED.load(Ordering::Relaxed) {
        return f();
    }
    device.synchronize()?;
    crate::device::peak_since_last(device)?;
    let start = Instant::now();
    let out = f()?;
    device.synchronize()?;
    let elapsed = start.elapsed();
    if let Some(peak) = crate::device::peak_since_last(device)? {
        let mut peaks = PEAKS.lock().unwrap_or_else(|e| e.into_inner());
        match peaks.iter_mut().find(|(n, _)| *n == name) {
            Some((_, most)) => *most = (*most).max(peak),
            None => peaks.push((name, peak)),
        }
    }
    let mut totals = TOTALS.lock().unwrap_or_else(|e| e.into_inner());
    match totals.iter_mut().find(|(n, _, _)| *n == name) {
        Some((_, total, calls)) => {
            *total += elapsed;
            *calls += 1;
        }
        None => totals.push((name, elapsed, 1)),
    }
    Ok(out)
}

/// Tokens per expert summed over the MoE layers since the last [`take_expert_load`]
/// (recorded only while profiling): how evenly a batch spreads over the experts.
static EXPERT_LOAD: Mutex<Vec<u64>> = Mutex::new(Vec::new());

/// (sparse layer calls, experts with tokens summed over them) since the last take.
static ACTIVE_EXPERTS: Mutex<(u64, u64)> = Mutex::new((0, 0));

pub fn record_expert_load(tokens_per_expert: impl Iterator<Item = usize>) {
    if !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    let mut load = EXPERT_LOAD.lock().unwrap_or_else(|e| e.into_inner());
    let mut active = 0;
    for (e, n) in tokens_per_expert.enumerate() {
        if load.len() <= e {
            load.resize(e + 1, 0);
        }
        load[e] += n as u64;
        active += u64::from(n > 0);
    }
    let mut calls = ACTIVE_EXPERTS.lock().unwrap_or_else(|e| e.into_inner());
    *calls = (calls.0 + 1, calls.1 + active);
}

/// Tokens routed to each expert since the last call (empty for dense models), and the mean
/// number of experts a sparse layer ran (that had tokens) per call; a fresh start.
pub fn take_expert_load() -> (Vec<u64>, f64) {
    let load = std::mem::take(&mut *EXPERT_LOAD.lock().unwrap_or_else(|e| e.into_inner()));
    let (calls, active) =
        std::mem::take(&mut *ACTIVE_EXPERTS.lock().unwrap_or_else(|e| e.into_inner()));
    (load, active as f64 / calls.max(1) as f64)
}
