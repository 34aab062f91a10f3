//! `oxcomm.Work`: the handle of an async op. The op runs on the communicator's async worker,
//! in issue order with every other op of this rank, and writes the caller's buffers in place;
//! the handle holds those buffers' owners until the op is done.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use oxcomm::{Communicator, Element, Error, Work};
use pyo3::prelude::*;

use crate::buffer::Buf;
use crate::errors::to_py;

/// How long one wait slice lasts before Python's signal handlers get a chance (Ctrl-C).
const SLICE: Duration = Duration::from_millis(100);

/// What a handle waits for.
pub trait Pending: Send {
    /// Whether the op has finished.
    fn is_completed(&self) -> bool;
    /// Waits at most `timeout`: `Ok(true)` once done, `Ok(false)` if still running.
    fn wait_timeout(&mut self, timeout: Duration) -> oxcomm::Result<bool>;
    /// For a receive from any source that completed: the sender's group rank.
    fn source(&self) -> Option<usize> {
        None
    }
}

impl<R: Send> Pending for Work<R> {
    fn is_completed(&self) -> bool {
        Work::is_completed(self)
    }

    fn wait_timeout(&mut self, timeout: Duration) -> oxcomm::Result<bool> {
        Work::wait_timeout(self, timeout).map(|r| r.is_some())
    }
}

/// An `irecv` into a caller's buffer: oxcomm's `irecv` fills its own vector, copied into the
/// buffer when the receive completes.
pub struct RecvInto<T: Element> {
    pub work: Work<Vec<T>>,
    pub dst: Buf,
}

impl<T: Element> Pending for RecvInto<T> {
    fn is_completed(&self) -> bool {
        self.work.is_completed()
    }

    fn wait_timeout(&mut self, timeout: Duration) -> oxcomm::Result<bool> {
        match self.work.wait_timeout(timeout)? {
            None => Ok(false),
            Some(v) => {
                // SAFETY: `dst` was checked to hold `v.len()` elements of `T` when the receive was
                // posted; its owner is held by `self`.
                unsafe { self.dst.slice_mut::<T>() }.copy_from_slice(&v);
                Ok(true)
            }
        }
    }
}

/// An `irecv` from any source into a caller's buffer ([`RecvInto`] that also keeps the
/// sender's rank).
pub struct RecvAnyInto<T: Element> {
    pub work: Work<(Vec<T>, usize)>,
    pub dst: Buf,
    pub source: Option<usize>,
}

impl<T: Element> Pending for RecvAnyInto<T> {
    fn is_completed(&self) -> bool {
        self.work.is_completed()
    }

    fn wait_timeout(&mut self, timeout: Duration) -> oxcomm::Result<bool> {
        match self.work.wait_timeout(timeout)? {
            None => Ok(false),
            Some((v, src)) => {
                // SAFETY: as in `RecvInto`: `dst` holds `v.len()` elements of `T`, and its
                // owner is held by `self`.
                unsafe { self.dst.slice_mut::<T>() }.copy_from_slice(&v);
                self.source = Some(src);
                Ok(true)
            }
        }
    }

    fn source(&self) -> Option<usize> {
        self.source
    }
}

enum State {
    Running(Box<dyn Pending>),
    Done(Option<Error>),
}

/// The handle of an async op (`async_op=True`, `isend`, `irecv`).
#[pyclass(module = "oxcomm", name = "Work")]
pub struct PyWork {
    state: Mutex<State>,
    comm: Communicator,
    /// The sender's group rank, once a receive from any source completed.
    source: std::sync::OnceLock<usize>,
}

impl std::fmt::Debug for PyWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PyWork").field("comm", &self.comm).finish_non_exhaustive()
    }
}

impl PyWork {
    /// A handle on `pending`, an op of `comm`.
    pub fn new(pending: Box<dyn Pending>, comm: Communicator) -> PyWork {
        PyWork { state: Mutex::new(State::Running(pending)), comm, source: std::sync::OnceLock::new() }
    }

    /// An op that finished (or failed) when it was issued.
    pub fn done(result: oxcomm::Result<()>, comm: Communicator) -> PyWork {
        PyWork { state: Mutex::new(State::Done(result.err())), comm, source: std::sync::OnceLock::new() }
    }

    /// Marks the op done, keeping what the pending op knows of its sender.
    fn finish(&self, state: &mut State) {
        if let State::Running(p) = state {
            if let Some(src) = p.source() {
                let _ = self.source.set(src);
            }
        }
        *state = State::Done(None);
    }
}

#[pymethods]
impl PyWork {
    /// Whether the op has finished, successfully or not.
    fn is_completed(&self, py: Python<'_>) -> PyResult<bool> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let State::Running(p) = &mut *state {
            if !p.is_completed() {
                return Ok(false);
            }
            let r = py.detach(|| p.wait_timeout(Duration::ZERO));
            match r {
                Ok(false) => return Ok(false),
                Ok(true) => self.finish(&mut state),
                Err(e) => *state = State::Done(Some(e)),
            }
        }
        Ok(true)
    }

    /// Waits for the op (at most `timeout` seconds, if given) and raises its error. Returns
    /// `True` when the op is done, `False` if `timeout` passed first. Ctrl-C while waiting
    /// raises `KeyboardInterrupt` within a tenth of a second and aborts the communicator.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let deadline = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let r = match &mut *state {
                State::Done(None) => return Ok(true),
                State::Done(Some(e)) => return Err(to_py(e.clone())),
                State::Running(p) => {
                    let slice = deadline.map_or(SLICE, |d| d.saturating_duration_since(Instant::now()).min(SLICE));
                    py.detach(|| p.wait_timeout(slice))
                }
            };
            match r {
                Ok(true) => self.finish(&mut state),
                Err(e) => *state = State::Done(Some(e)),
                Ok(false) => {
                    if let Err(interrupt) = py.check_signals() {
                        // Abort on another thread: the op in flight holds this rank's links.
                        let comm = self.comm.clone();
                        std::thread::spawn(move || comm.abort("interrupted while waiting (KeyboardInterrupt)"));
                        return Err(interrupt);
                    }
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Ok(false);
                    }
                }
            }
        }
    }

    /// For an `irecv` from any source (`src=None`) that completed: the sender's rank in the
    /// communicator's group; `None` before it completes, and for every other op.
    fn source_rank(&self) -> Option<usize> {
        self.source.get().copied()
    }

    /// A `concurrent.futures.Future` that completes with `None` (or the op's exception).
    fn get_future(slf: Py<Self>, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(py.import("oxcomm._futures")?.call_method1("future_of", (slf,))?.unbind())
    }

    /// The op's error as an oxcomm exception if it failed, `None` if it succeeded or still runs.
    fn exception(&self) -> Option<PyErr> {
        match &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            State::Done(Some(e)) => Some(to_py(e.clone())),
            _ => None,
        }
    }
}
