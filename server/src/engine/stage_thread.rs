//! One OS thread per pipeline stage. It runs the jobs handed to it one at a time, in the order
//! they were handed over, so the work of one device is never issued from two threads (its
//! cuBLAS handle and stream stay single-threaded) and consecutive micro-batches overlap across
//! stages: stage k computes micro-batch i while stage k + 1 computes micro-batch i − 1.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

/// Work for a stage thread. A job reports its own outcome (through the channels it owns); a
/// panic in it drops those channels, which the jobs waiting on them report as a failure.
pub type Job = Box<dyn FnOnce() + Send>;

/// Called when a stage thread has run every job handed to it.
pub type IdleHook = Arc<dyn Fn() + Send + Sync>;

pub struct StageThread {
    jobs: mpsc::Sender<Job>,
    /// Jobs handed over and not yet finished.
    pending: Arc<AtomicUsize>,
    on_idle: Arc<Mutex<Option<IdleHook>>>,
}

impl StageThread {
    /// Starts the thread; it ends once this handle is dropped and its last job has run.
    pub fn spawn(name: String) -> std::io::Result<Self> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let pending = Arc::new(AtomicUsize::new(0));
        let on_idle: Arc<Mutex<Option<IdleHook>>> = Arc::default();
        let (count, hook) = (pending.clone(), on_idle.clone());
        std::thread::Builder::new().name(name).spawn(move || {
            for job in queue {
                if catch_unwind(AssertUnwindSafe(job)).is_err() {
                    tracing::error!("a pipeline stage job panicked");
                }
                if count.fetch_sub(1, Ordering::SeqCst) == 1 {
                    let hook = hook.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    if let Some(hook) = hook {
                        hook();
                    }
                }
            }
        })?;
        Ok(Self {
            jobs,
            pending,
            on_idle,
        })
    }

    /// Queues `job` behind the jobs handed over before it.
    pub fn submit(&self, job: Job) {
        self.pending.fetch_add(1, Ordering::SeqCst);
        if self.jobs.send(job).is_err() {
            // The thread is gone (it only ends when this handle is dropped): nothing runs.
            self.pending.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Whether every job handed over has finished.
    pub fn is_idle(&self) -> bool {
        self.pending.load(Ordering::SeqCst) == 0
    }

    /// `hook` runs (on the stage thread) whenever the thread finishes its last pending job.
    pub fn set_on_idle(&self, hook: IdleHook) {
        *self.on_idle.lock().unwrap_or_else(|p| p.into_inner()) = Some(hook);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_run_in_order_and_the_idle_hook_fires_when_none_is_left() {
        let stage = StageThread::spawn("test-stage".into()).unwrap();
        let (idle_tx, idle_rx) = mpsc::channel();
        let idle_tx = Mutex::new(idle_tx);
        stage.set_on_idle(Arc::new(move || {
            let _ = idle_tx.lock().unwrap().send(());
        }));
        let (gate_tx, gate_rx) = mpsc::channel::<()>();
        let (out_tx, out_rx) = mpsc::channel();
        let first = out_tx.clone();
        stage.submit(Box::new(move || {
            gate_rx.recv().unwrap();
            first.send(1).unwrap();
        }));
        stage.submit(Box::new(|| panic!("a failing job")));
        stage.submit(Box::new(move || out_tx.send(2).unwrap()));
        assert!(!stage.is_idle());
        gate_tx.send(()).unwrap();
        assert_eq!(out_rx.recv().unwrap(), 1);
        // The panicking job did not stop the thread.
        assert_eq!(out_rx.recv().unwrap(), 2);
        idle_rx.recv().unwrap();
        assert!(stage.is_idle());
    }
}
