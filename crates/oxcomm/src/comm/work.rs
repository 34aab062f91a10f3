//! [`Work`]: the handle of an async op, and the slot its result lands in.
//!
//! A handle waits on its slot; polling or waiting also starts pending `isend`/`irecv`s
//! (see `p2p`), so that an exchange made only of those cannot wait for ever.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result};

/// What a handle needs from the rank whose op it waits for (the communicator's core).
pub(super) trait Progress: Send + Sync {
    /// Starts the pending `isend`/`irecv`s, so that waiting on one of them cannot wait for ever.
    fn start_pending(self: Arc<Self>);
    /// The ops' default deadline (the wait's outer bound is derived from it).
    fn op_timeout(&self) -> Duration;
    /// This rank in the world, for errors.
    fn world_rank(&self) -> usize;
}

pub(super) struct Slot<R> {
    pub(super) result: Mutex<Option<Result<R>>>,
    pub(super) cv: Condvar,
    pub(super) done: AtomicBool,
}

impl<R> Slot<R> {
    pub(super) fn complete(&self, r: Result<R>) {
        let mut g = self.result.lock().unwrap_or_else(|e| e.into_inner());
        *g = Some(r);
        self.done.store(true, Ordering::SeqCst);
        self.cv.notify_all();
    }
}

/// What a point-to-point op's slot gets: the payload (what was received, or what was sent)
/// and the peer's world rank (the sender, for a receive from any source).
pub(super) type P2pDone = (Vec<u8>, usize);

pub(super) type Mapper<R> = Box<dyn FnOnce(P2pDone) -> R + Send>;

/// The handle of an async op. Dropping it does not cancel the op.
pub struct Work<R> {
    inner: WorkInner<R>,
    core: Arc<dyn Progress>,
    taken: bool,
}

impl<R> std::fmt::Debug for Work<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work").field("rank", &self.core.world_rank()).field("taken", &self.taken).finish()
    }
}

pub(super) enum WorkInner<R> {
    Direct(Arc<Slot<R>>),
    Mapped(Arc<Slot<P2pDone>>, Option<Mapper<R>>),
}

impl<R: Send + 'static> Work<R> {
    pub(super) fn pending(core: Arc<dyn Progress>) -> (Work<R>, Arc<Slot<R>>) {
        let slot = Arc::new(Slot { result: Mutex::new(None), cv: Condvar::new(), done: AtomicBool::new(false) });
        (Work { inner: WorkInner::Direct(slot.clone()), core, taken: false }, slot)
    }

    pub(super) fn done(r: Result<R>, core: Arc<dyn Progress>) -> Work<R> {
        let (w, slot) = Work::pending(core);
        slot.complete(r);
        w
    }
}

impl Work<P2pDone> {
    pub(super) fn map<S>(self, f: impl FnOnce(P2pDone) -> S + Send + 'static) -> Work<S> {
        let WorkInner::Direct(slot) = self.inner else { unreachable!("map is applied once, to a fresh handle") };
        Work { inner: WorkInner::Mapped(slot, Some(Box::new(f))), core: self.core, taken: false }
    }
}

impl<R> Work<R> {
    /// Whether the op has finished (successfully or not). Polling also starts pending
    /// `isend`/`irecv`s.
    pub fn is_completed(&self) -> bool {
        self.core.clone().start_pending();
        match &self.inner {
            WorkInner::Direct(s) => s.done.load(Ordering::SeqCst),
            WorkInner::Mapped(s, _) => s.done.load(Ordering::SeqCst),
        }
    }

    /// Waits for the op and returns its result. The op's own deadline bounds the wait.
    pub fn wait(mut self) -> Result<R> {
        // The op fails by its own deadline; this outer bound only guards against a bug.
        let bound = self.core.op_timeout() * 2 + Duration::from_secs(5);
        match self.wait_timeout(bound)? {
            Some(r) => Ok(r),
            None => Err(Error::new(ErrorKind::Timeout, format!("async op did not finish within {bound:?}"))
                .with_rank(self.core.world_rank())),
        }
    }

    /// Waits at most `timeout`: `Ok(Some(result))` once the op is done, `Ok(None)` if it is
    /// still running, `Err` if it failed. The result can be taken once.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<R>> {
        if self.taken {
            return Err(Error::invalid("the result of this work handle was already taken"));
        }
        self.core.clone().start_pending();
        let deadline = Instant::now() + timeout;
        let out = match &mut self.inner {
            WorkInner::Direct(s) => take(s, deadline),
            WorkInner::Mapped(s, f) => take(s, deadline).map(|r| r.map(|b| (f.take().expect("mapper used once"))(b))),
        };
        if !matches!(out, Ok(None)) {
            self.taken = true;
        }
        out
    }
}

fn take<R>(slot: &Slot<R>, deadline: Instant) -> Result<Option<R>> {
    let mut g = slot.result.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if let Some(r) = g.take() {
            return r.map(Some);
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(None);
        }
        g = slot.cv.wait_timeout(g, deadline - now).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
    }
}
