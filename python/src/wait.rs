//! Running the client's futures for Python: on one shared tokio runtime, the GIL released while
//! waiting, waking every [`TICK`] to draw progress and to let Python see Ctrl-C (a signal reaches
//! Python code only when the main thread checks for it).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::exceptions::{PyKeyboardInterrupt, PyRuntimeError};
use pyo3::prelude::*;
use tokio::runtime::Runtime;

const TICK: Duration = Duration::from_millis(100);

static RUNTIME: OnceLock<Runtime> = OnceLock::new();

fn runtime() -> PyResult<&'static Runtime> {
    if let Some(rt) = RUNTIME.get() {
        return Ok(rt);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("exactscore")
        .build()
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start the tokio runtime: {e}")))?;
    Ok(RUNTIME.get_or_init(|| rt))
}

/// What Ctrl-C does to the call being waited on.
pub enum OnInterrupt<'a> {
    /// Drop it at once (one request: nothing to keep).
    Abort,
    /// The first Ctrl-C sets the flag and waits for the call to wind down (a run finishing the
    /// requests in flight and writing them to its partial file); a second one drops it.
    Cancel(&'a AtomicBool),
}

/// A finished call, and the KeyboardInterrupt that asked it to wind down, if one did.
pub struct Finished<T> {
    pub value: T,
    pub interrupt: Option<PyErr>,
}

/// Runs `fut` to completion, calling `tick` (with the GIL) between waits.
pub fn wait<T: Send + 'static>(
    py: Python<'_>,
    fut: impl Future<Output = T> + Send + 'static,
    on_interrupt: OnInterrupt<'_>,
    mut tick: impl FnMut(Python<'_>) -> PyResult<()>,
) -> PyResult<Finished<T>> {
    let rt = runtime()?;
    let mut handle = rt.spawn(fut);
    let mut interrupt: Option<PyErr> = None;
    loop {
        let joined =
            py.detach(|| rt.block_on(async { tokio::time::timeout(TICK, &mut handle).await.ok() }));
        if let Some(joined) = joined {
            let value = joined
                .map_err(|e| PyRuntimeError::new_err(format!("the client task failed: {e}")))?;
            return Ok(Finished { value, interrupt });
        }
        // A signal handler may also raise inside `tick`'s Python code.
        let Err(e) = tick(py).and_then(|()| py.check_signals()) else {
            continue;
        };
        match on_interrupt {
            OnInterrupt::Cancel(flag)
                if interrupt.is_none() && e.is_instance_of::<PyKeyboardInterrupt>(py) =>
            {
                flag.store(true, Ordering::SeqCst);
                let note =
                    "\nstopping: finishing the requests in flight (Ctrl-C again to quit now)\n";
                // Where stderr cannot be written to, the note is lost, not the interrupt.
                let _ = py
                    .import("sys")
                    .and_then(|sys| sys.getattr("stderr"))
                    .and_then(|err| err.call_method1("write", (note,)));
                interrupt = Some(e);
            }
            _ => {
                handle.abort();
                return Err(e);
            }
        }
    }
}
