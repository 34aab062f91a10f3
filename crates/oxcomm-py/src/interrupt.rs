//! Ctrl-C while a sync op waits: the op ends, the communicator is aborted and Python raises
//! `KeyboardInterrupt`, instead of the process hanging until the op's deadline.
//!
//! Sync ops run on the calling thread with the GIL released, so Python's own SIGINT handler
//! only sets a flag that nobody reads until the op returns. This module adds a handler that
//! chains to Python's (signal-hook) and writes to a pipe; a watcher thread blocked on that pipe
//! aborts every communicator with a sync op in flight. The aborted op sees its communicator's
//! abort flag within one peer check (≈50 ms) and returns; the caller then runs Python's signal
//! handlers, which raise `KeyboardInterrupt`. Async waits (`Work.wait`) check signals
//! themselves every 100 ms.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once};

use oxcomm::Communicator;
use pyo3::prelude::*;

use crate::errors::to_py;

/// Communicators with a sync op in flight, by ticket.
static IN_FLIGHT: Mutex<Vec<(u64, Communicator)>> = Mutex::new(Vec::new());
static NEXT: AtomicU64 = AtomicU64::new(0);
static WATCHER: Once = Once::new();

/// Installs the SIGINT pipe and its watcher, once per process. If the OS refuses, Ctrl-C
/// still interrupts async waits and reaches Python after a sync op ends.
fn ensure_watcher() {
    WATCHER.call_once(|| {
        let Ok((mut reader, writer)) = UnixStream::pair() else { return };
        if signal_hook::low_level::pipe::register(signal_hook::consts::SIGINT, writer).is_err() {
            return;
        }
        let _ = std::thread::Builder::new().name("oxcomm-sigint".into()).spawn(move || {
            let mut byte = [0u8; 64];
            while reader.read(&mut byte).is_ok_and(|n| n > 0) {
                let comms: Vec<Communicator> =
                    IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(_, c)| c.clone()).collect();
                for c in comms {
                    c.abort("interrupted (KeyboardInterrupt) while an op waited");
                }
            }
        });
    });
}

/// Removes a communicator from [`IN_FLIGHT`] when its op ends, however it ends.
struct InFlight(u64);

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner()).retain(|(t, _)| *t != self.0);
    }
}

/// Runs the sync op `f` of `comm` with the GIL released, abortable by Ctrl-C (see the module
/// docs). An error raised by Python's signal handlers (`KeyboardInterrupt`) wins over the
/// op's own error.
pub fn run<R: Send>(py: Python<'_>, comm: &Communicator, f: impl FnOnce() -> oxcomm::Result<R> + Send) -> PyResult<R> {
    ensure_watcher();
    let ticket = NEXT.fetch_add(1, Ordering::Relaxed);
    IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner()).push((ticket, comm.clone()));
    let guard = InFlight(ticket);
    let r = py.detach(f);
    drop(guard);
    match r {
        Ok(v) => Ok(v),
        Err(e) => {
            py.check_signals()?;
            Err(to_py(e))
        }
    }
}
