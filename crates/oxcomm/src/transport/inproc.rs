//! In-process transport: ranks are threads, links are bounded byte queues in memory.
//!
//! Used by [`crate::threads::run`], tests and examples. Each direction of a link is a
//! `Mutex<VecDeque<u8>>` bounded at [`QUEUE_BYTES`] so flow control is exercised as on real
//! transports. A link notices that its peer is gone when the peer's end is dropped (its thread
//! returned or panicked).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use super::{Doorbell, Link};
use crate::error::{Error, ErrorKind, Result};

/// Capacity of one direction of a thread link.
pub const QUEUE_BYTES: usize = 1 << 20;

/// A doorbell for ranks in one process: an atomic counter plus a condition variable for
/// sleepers. Spins briefly (yielding) before sleeping.
#[derive(Default)]
pub struct ThreadDoorbell {
    epoch: AtomicU32,
    heartbeat: std::sync::atomic::AtomicU64,
    /// The op word of the op this rank last ran ([`Doorbell::set_op`]).
    last_op: std::sync::atomic::AtomicU64,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    cond: Condvar,
    /// Control messages sent to this rank so far (peers add one per message), on a line of
    /// its own: the owner reads it twice per op, peers write it only with a message.
    ctrl: Padded<AtomicU32>,
}

/// A value on a 128-byte line of its own.
#[repr(align(128))]
#[derive(Default)]
struct Padded<T>(T);

impl std::fmt::Debug for ThreadDoorbell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadDoorbell").field("epoch", &self.epoch).finish_non_exhaustive()
    }
}

impl ThreadDoorbell {
    /// Increments the counter and wakes sleepers.
    pub fn ring(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.cond.notify_all();
        }
    }
}

impl Doorbell for ThreadDoorbell {
    fn epoch(&self) -> u32 {
        self.epoch.load(Ordering::SeqCst)
    }

    fn wait(&self, epoch: u32, until: Instant) {
        for i in 0..64 {
            if self.epoch.load(Ordering::SeqCst) != epoch {
                return;
            }
            if i < 16 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        while self.epoch.load(Ordering::SeqCst) == epoch {
            let now = Instant::now();
            if now >= until {
                break;
            }
            guard = match self.cond.wait_timeout(guard, until - now) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    fn heartbeat(&self) {
        self.heartbeat.store(super::monotonic_ns(), Ordering::Relaxed);
    }

    fn set_op(&self, op: u64) {
        self.last_op.store(op, Ordering::Relaxed);
    }

    fn ctrl_count(&self) -> u32 {
        self.ctrl.0.load(Ordering::Acquire)
    }

    fn wake(&self) {
        self.ring();
    }
}

/// Most control messages one direction of a thread link holds unread.
const MAX_CTRL_QUEUED: usize = 1024;

/// One direction of a link.
struct Queue {
    bytes: Mutex<Stream>,
    /// Control messages, apart from the bytes ([`Link::send_ctrl`]).
    ctrl: Mutex<VecDeque<Vec<u8>>>,
    /// Set when the sending end is dropped.
    writer_gone: AtomicBool,
    /// Set when the receiving end is dropped.
    reader_gone: AtomicBool,
    /// The rank whose failure made the writing end close (`usize::MAX`: none given).
    culprit: AtomicUsize,
    /// [`super::cause_code`] of that failure.
    cause: AtomicU32,
}

/// The bytes of one direction, with the writer's epoch marks.
struct Stream {
    bytes: VecDeque<u8>,
    /// Bytes ever written.
    written: u64,
    /// The writer's last mark: bytes before `mark_at` (of all ever written) belong to the
    /// epochs before `mark_epoch` ([`Link::end_epoch`]).
    mark_epoch: u32,
    mark_at: u64,
}

impl std::ops::Deref for Stream {
    type Target = VecDeque<u8>;
    fn deref(&self) -> &VecDeque<u8> {
        &self.bytes
    }
}

impl std::ops::DerefMut for Stream {
    fn deref_mut(&mut self) -> &mut VecDeque<u8> {
        &mut self.bytes
    }
}

impl Queue {
    fn new() -> Arc<Queue> {
        Arc::new(Queue {
            bytes: Mutex::new(Stream {
                bytes: VecDeque::with_capacity(QUEUE_BYTES),
                written: 0,
                mark_epoch: 0,
                mark_at: 0,
            }),
            ctrl: Mutex::new(VecDeque::new()),
            writer_gone: AtomicBool::new(false),
            reader_gone: AtomicBool::new(false),
            culprit: AtomicUsize::new(usize::MAX),
            cause: AtomicU32::new(0),
        })
    }
}

/// This rank's end of an in-process link.
pub struct ThreadLink {
    /// This rank (what a close notice naming it is compared with).
    rank: usize,
    peer: usize,
    out: Arc<Queue>,
    inbox: Arc<Queue>,
    peer_bell: Arc<ThreadDoorbell>,
}

impl std::fmt::Debug for ThreadLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadLink").field("peer", &self.peer).finish_non_exhaustive()
    }
}

impl Drop for ThreadLink {
    fn drop(&mut self) {
        self.out.writer_gone.store(true, Ordering::SeqCst);
        self.inbox.reader_gone.store(true, Ordering::SeqCst);
        self.peer_bell.ring();
    }
}

impl ThreadLink {
    fn gone(&self) -> Error {
        for q in [&self.inbox, &self.out] {
            let c = q.culprit.load(Ordering::SeqCst);
            if c == self.peer {
                return Error::new(ErrorKind::PeerGone, format!("rank {c} is gone (it aborted after failing)"))
                    .with_peer(c);
            }
            if c != usize::MAX {
                return super::cascaded_to(self.rank, self.peer, c, super::cause_kind(q.cause.load(Ordering::SeqCst)));
            }
        }
        Error::new(ErrorKind::PeerGone, format!("rank {} is gone (its thread dropped its communicator)", self.peer))
            .with_peer(self.peer)
    }
}

impl Link for ThreadLink {
    fn peer(&self) -> usize {
        self.peer
    }

    fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        if self.out.reader_gone.load(Ordering::SeqCst) {
            return Err(self.gone());
        }
        let n = {
            let mut q = self.out.bytes.lock().unwrap_or_else(|e| e.into_inner());
            let n = (QUEUE_BYTES - q.len()).min(data.len());
            q.extend(&data[..n]);
            q.written += n as u64;
            n
        };
        if n > 0 {
            self.peer_bell.ring();
        }
        Ok(n)
    }

    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        let n = {
            let mut q = self.inbox.bytes.lock().unwrap_or_else(|e| e.into_inner());
            let n = q.len().min(buf.len());
            let (a, b) = q.as_slices();
            let na = a.len().min(n);
            crate::copy::copy(&mut buf[..na], &a[..na]);
            crate::copy::copy(&mut buf[na..n], &b[..n - na]);
            q.drain(..n);
            n
        };
        if n > 0 {
            self.peer_bell.ring();
        } else if self.inbox.writer_gone.load(Ordering::SeqCst) && !buf.is_empty() {
            return Err(self.gone());
        }
        Ok(n)
    }

    fn peek(&mut self, buf: &mut [u8]) -> Result<usize> {
        let q = self.inbox.bytes.lock().unwrap_or_else(|e| e.into_inner());
        let n = q.len().min(buf.len());
        for (dst, src) in buf[..n].iter_mut().zip(q.iter()) {
            *dst = *src;
        }
        Ok(n)
    }

    fn check_peer(&mut self) -> Result<()> {
        if self.inbox.writer_gone.load(Ordering::SeqCst) {
            // Bytes already queued may still be read; try_recv reports the loss once drained.
            let empty = self.inbox.bytes.lock().map(|q| q.is_empty()).unwrap_or(true);
            if empty {
                return Err(self.gone());
            }
        }
        Ok(())
    }

    fn close(&mut self, cause: Option<(usize, ErrorKind)>) {
        if let Some((c, kind)) = cause {
            for q in [&self.out, &self.inbox] {
                q.cause.store(super::cause_code(kind), Ordering::SeqCst);
                q.culprit.store(c, Ordering::SeqCst);
            }
        }
    }

    fn peer_idle(&mut self) -> Option<std::time::Duration> {
        super::idle_since(self.peer_bell.heartbeat.load(Ordering::Relaxed))
    }

    fn send_ctrl(&mut self, msg: &[u8]) -> Result<bool> {
        if msg.len() > super::MAX_CTRL_BYTES {
            return Err(Error::invalid(format!("a control message of {} bytes", msg.len())));
        }
        if self.out.reader_gone.load(Ordering::SeqCst) {
            return Err(self.gone());
        }
        {
            let mut q = self.out.ctrl.lock().unwrap_or_else(|e| e.into_inner());
            if q.len() >= MAX_CTRL_QUEUED {
                return Ok(false);
            }
            q.push_back(msg.to_vec());
        }
        self.peer_bell.ctrl.0.fetch_add(1, Ordering::AcqRel);
        self.peer_bell.ring();
        Ok(true)
    }

    fn recv_ctrl(&mut self, out: &mut Vec<u8>) -> Result<bool> {
        let msg = self.inbox.ctrl.lock().unwrap_or_else(|e| e.into_inner()).pop_front();
        match msg {
            Some(m) => {
                *out = m;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn end_epoch(&mut self, epoch: u32) -> Result<bool> {
        let mut q = self.out.bytes.lock().unwrap_or_else(|e| e.into_inner());
        if q.mark_epoch < epoch {
            q.mark_epoch = epoch;
            q.mark_at = q.written;
        }
        drop(q);
        self.peer_bell.ring();
        Ok(true)
    }

    fn begin_epoch(&mut self, epoch: u32) -> Result<bool> {
        let mut q = self.inbox.bytes.lock().unwrap_or_else(|e| e.into_inner());
        if q.mark_epoch < epoch {
            // Not marked yet: what arrived so far is the old epoch's, and goes.
            q.bytes.clear();
            return Ok(false);
        }
        // Bytes written after the mark stay; those before it (still queued) go.
        let after = (q.written - q.mark_at) as usize;
        let before = q.bytes.len().saturating_sub(after);
        q.bytes.drain(..before);
        Ok(true)
    }

    fn peer_last_op(&mut self) -> Option<u64> {
        Some(self.peer_bell.last_op.load(Ordering::Relaxed))
    }

    fn renumber(&mut self, rank: usize, peer: usize, _world: usize) {
        self.rank = rank;
        self.peer = peer;
    }

    fn kind(&self) -> crate::transport::Transport {
        crate::transport::Transport::Threads
    }
}

/// The links and doorbell of one thread rank, as built by [`mesh`].
pub struct ThreadEndpoint {
    /// This rank.
    pub rank: usize,
    /// `links[p]` is the link to rank `p`; `None` at `p == rank`.
    pub links: Vec<Option<ThreadLink>>,
    /// This rank's doorbell.
    pub doorbell: Arc<ThreadDoorbell>,
}

impl std::fmt::Debug for ThreadEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadEndpoint")
            .field("rank", &self.rank)
            .field("peers", &self.links.len())
            .finish_non_exhaustive()
    }
}

/// Builds a full mesh of in-process links among `n` ranks.
pub fn mesh(n: usize) -> Vec<ThreadEndpoint> {
    let bells: Vec<Arc<ThreadDoorbell>> = (0..n).map(|_| Arc::new(ThreadDoorbell::default())).collect();
    // queues[a][b]: bytes from a to b.
    let queues: Vec<Vec<Arc<Queue>>> = (0..n).map(|_| (0..n).map(|_| Queue::new()).collect()).collect();
    (0..n)
        .map(|r| ThreadEndpoint {
            rank: r,
            links: (0..n)
                .map(|p| {
                    (p != r).then(|| ThreadLink {
                        rank: r,
                        peer: p,
                        out: queues[r][p].clone(),
                        inbox: queues[p][r].clone(),
                        peer_bell: bells[p].clone(),
                    })
                })
                .collect(),
            doorbell: bells[r].clone(),
        })
        .collect()
}
