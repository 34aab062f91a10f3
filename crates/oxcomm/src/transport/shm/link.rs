//! [`ShmLink`]: the [transport contract](crate::transport) over one peer's pair of rings in
//! shared memory (this rank's ring in the peer's segment, the peer's ring in this one).
//!
//! This file owns the data path once the segments are attached: non-blocking sends and
//! receives through the rings, the doorbell rings that go with them, the close flags and
//! peer-loss detection (close flags, and a pidfd on the peer's process). It knows nothing about
//! how segments are created, named or attached (the [shm module](crate::transport::shm) does
//! that), nor about collectives.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use rustix::event::{poll, PollFd, PollFlags};
use rustix::fd::OwnedFd;
use rustix::io::Errno;
use rustix::process::{pidfd_open, test_kill_process, Pid, PidfdFlags};

use super::ring::{Consumer, Corrupt, Producer};
use super::segment::Segment;
use super::watch::{self, Watched};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::Link;

/// How a link tells whether the peer's process is still alive.
pub(super) enum PeerProcess {
    /// The peer is a thread of this process: only its close flags tell.
    SameProcess,
    /// A pidfd, readable once the process has exited (zombies included), and the process's
    /// death watcher's flag on it (`watch.rs`), where the watcher runs.
    Pidfd(OwnedFd, Option<Watched>),
    /// No pidfd support: `kill(pid, 0)` (a zombie still counts as alive until reaped).
    Pid(Pid),
}

impl PeerProcess {
    /// Opens a handle on process `pid`; `Err` if it does not exist (a stale segment). With a
    /// pidfd, the process is also handed to the death watcher, which rings the bell of `own`
    /// (this rank's segment) when it exits.
    pub(super) fn open(pid: u32, own: &Arc<Segment>) -> std::result::Result<PeerProcess, String> {
        let me = rustix::process::getpid();
        let pid =
            i32::try_from(pid).ok().and_then(Pid::from_raw).ok_or_else(|| format!("owner pid {pid} is invalid"))?;
        if pid == me {
            return Ok(PeerProcess::SameProcess);
        }
        match pidfd_open(pid, PidfdFlags::empty()) {
            Ok(fd) => {
                let watched = watch::watch(&fd, own);
                Ok(PeerProcess::Pidfd(fd, watched))
            }
            Err(Errno::SRCH) => Err(format!("its owner process {} is not running", pid.as_raw_pid())),
            Err(_) => match test_kill_process(pid) {
                Err(Errno::SRCH) => Err(format!("its owner process {} is not running", pid.as_raw_pid())),
                _ => Ok(PeerProcess::Pid(pid)),
            },
        }
    }

    /// `true` once the process is known to have exited. One non-blocking syscall.
    pub(super) fn gone(&self) -> bool {
        match self {
            PeerProcess::SameProcess => false,
            PeerProcess::Pidfd(_, Some(w)) if w.dead() => true,
            PeerProcess::Pidfd(fd, _) => {
                let mut fds = [PollFd::new(fd, PollFlags::IN)];
                let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
                matches!(poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
            }
            PeerProcess::Pid(pid) => matches!(test_kill_process(*pid), Err(Errno::SRCH)),
        }
    }
}

/// This rank's end of a shared-memory link to one peer: writes go into this rank's ring in
/// the peer's segment, reads come from the peer's ring in this rank's segment.
///
/// A send that took bytes always rings the peer's doorbell. A receive that freed space rings
/// it only if the peer found the ring full since (the only case in which it can be waiting
/// for space), so streaming does not wake a busy sender for nothing.
pub struct ShmLink {
    pub(super) rank: usize,
    pub(super) peer: usize,
    /// Into the peer's segment.
    pub(super) tx: Producer,
    /// From this rank's segment.
    pub(super) rx: Consumer,
    /// Control messages into the peer's segment ([`Link::send_ctrl`]).
    pub(super) ctrl_tx: Producer,
    /// Control messages from this rank's segment.
    pub(super) ctrl_rx: Consumer,
    /// Keeps the peer's mapping (and its doorbell) alive.
    pub(super) peer_seg: Arc<Segment>,
    pub(super) process: PeerProcess,
    /// Set once `check_peer` saw the process exit.
    pub(super) process_gone: bool,
}

impl std::fmt::Debug for ShmLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmLink").field("rank", &self.rank).field("peer", &self.peer).finish_non_exhaustive()
    }
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        self.close_flags(1);
    }
}

/// Close-flag values: 0 open, 1 closed, `2 + (r << 3 | code)` closed because rank `r` failed
/// with the error kind of [`crate::transport::cause_code`] `code`.
const CLOSED: u32 = 1;

fn closed_flag(cause: Option<(usize, ErrorKind)>) -> u32 {
    cause.map_or(CLOSED, |(r, kind)| 2 + ((r as u32) << 3 | crate::transport::cause_code(kind)))
}

/// Why a link of rank `me` with close flag `flag` is gone: a plain reason, or the error naming
/// the culprit.
fn closed_reason(flag: u32, me: usize, peer: usize) -> Option<std::result::Result<String, Error>> {
    match flag {
        0 => None,
        CLOSED => Some(Ok("it closed its shared-memory link".to_string())),
        v => {
            let (culprit, code) = (((v - 2) >> 3) as usize, (v - 2) & 7);
            if culprit == peer {
                Some(Ok("it closed its shared-memory link after failing".to_string()))
            } else {
                Some(Err(crate::transport::cascaded_to(me, peer, culprit, crate::transport::cause_kind(code))))
            }
        }
    }
}

impl ShmLink {
    /// Sets both close flags (first value wins) and wakes the peer.
    fn close_flags(&self, value: u32) {
        let flags = &self.tx.ctrl().flags.0;
        let _ = flags.writer_closed.compare_exchange(0, value, Ordering::AcqRel, Ordering::Acquire);
        let flags = &self.rx.ctrl().flags.0;
        let _ = flags.reader_closed.compare_exchange(0, value, Ordering::AcqRel, Ordering::Acquire);
        self.peer_seg.bell().ring();
    }

    fn gone(&self, why: std::result::Result<String, Error>) -> Error {
        match why {
            Ok(why) => Error::new(ErrorKind::PeerGone, format!("rank {} is gone ({why})", self.peer))
                .with_peer(self.peer)
                .with_rank(self.rank),
            Err(e) => e.with_rank(self.rank),
        }
    }

    fn corrupt(&self, c: Corrupt, dir: &str) -> Error {
        Error::protocol(format!("shm ring {dir} rank {}: {c}", self.peer)).with_peer(self.peer).with_rank(self.rank)
    }

    /// Why the peer can no longer read, if it cannot, and the rank to blame.
    fn reader_gone(&self) -> Option<std::result::Result<String, Error>> {
        closed_reason(self.tx.ctrl().flags.0.reader_closed.load(Ordering::Acquire), self.rank, self.peer)
            .or_else(|| self.process_gone.then(|| Ok("its process exited".to_string())))
    }

    /// Why the peer will send no more, if it will not, and the rank to blame.
    fn writer_gone(&self) -> Option<std::result::Result<String, Error>> {
        closed_reason(self.rx.ctrl().flags.0.writer_closed.load(Ordering::Acquire), self.rank, self.peer)
            .or_else(|| self.process_gone.then(|| Ok("its process exited".to_string())))
    }
}

impl Link for ShmLink {
    fn peer(&self) -> usize {
        self.peer
    }

    fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        if let Some(why) = self.reader_gone() {
            return Err(self.gone(why));
        }
        let n = self.tx.try_write(data).map_err(|c| self.corrupt(c, "to"))?;
        if n > 0 {
            self.peer_seg.bell().ring();
        }
        Ok(n)
    }

    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        let n = self.rx.try_read(buf).map_err(|c| self.corrupt(c, "from"))?;
        self.after_recv(n, buf.is_empty())
    }

    fn recv_with(&mut self, max: usize, consume: &mut dyn FnMut(&[u8])) -> Result<usize> {
        let n = self.rx.read_with(max, consume).map_err(|c| self.corrupt(c, "from"))?;
        self.after_recv(n, max == 0)
    }

    fn peek(&mut self, buf: &mut [u8]) -> Result<usize> {
        self.rx.peek(buf).map_err(|c| self.corrupt(c, "from"))
    }

    fn check_peer(&mut self) -> Result<()> {
        if !self.process_gone && self.process.gone() {
            self.process_gone = true;
        }
        if let Some(why) = self.writer_gone() {
            // Bytes already in the ring may still be read; report once drained.
            let left = self.rx.available().map_err(|c| self.corrupt(c, "from"))?;
            if left == 0 {
                return Err(self.gone(why));
            }
        }
        Ok(())
    }

    fn check_alive(&mut self) -> Result<()> {
        if !self.process_gone && self.process.gone() {
            self.process_gone = true;
        }
        match self.writer_gone() {
            Some(why) => Err(self.gone(why)),
            None => Ok(()),
        }
    }

    fn close(&mut self, cause: Option<(usize, ErrorKind)>) {
        self.close_flags(closed_flag(cause));
    }

    fn peer_idle(&mut self) -> Option<std::time::Duration> {
        crate::transport::idle_since(self.peer_seg.bell().heartbeat.load(Ordering::Relaxed))
    }

    fn send_ctrl(&mut self, msg: &[u8]) -> Result<bool> {
        if msg.len() > crate::transport::MAX_CTRL_BYTES {
            return Err(Error::invalid(format!("a control message of {} bytes", msg.len())));
        }
        if let Some(why) = self.reader_gone() {
            return Err(self.gone(why));
        }
        let len = (msg.len() as u32).to_le_bytes();
        if !self.ctrl_tx.try_write_all(&[&len, msg]).map_err(|c| self.corrupt(c, "to"))? {
            return Ok(false);
        }
        // Release: the peer that sees the count sees the message (published before it).
        self.peer_seg.bell().ctrl.fetch_add(1, Ordering::AcqRel);
        self.peer_seg.bell().ring();
        Ok(true)
    }

    fn recv_ctrl(&mut self, out: &mut Vec<u8>) -> Result<bool> {
        let mut len = [0u8; 4];
        if self.ctrl_rx.peek(&mut len).map_err(|c| self.corrupt(c, "from"))? < len.len() {
            return Ok(false);
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > crate::transport::MAX_CTRL_BYTES {
            return Err(Error::protocol(format!(
                "rank {} sent a control message of {len} bytes (at most {})",
                self.peer,
                crate::transport::MAX_CTRL_BYTES
            ))
            .with_peer(self.peer)
            .with_rank(self.rank));
        }
        if (self.ctrl_rx.available().map_err(|c| self.corrupt(c, "from"))? as usize) < 4 + len {
            return Ok(false); // written whole: not possible, but never read a part
        }
        self.ctrl_rx.try_read(&mut [0u8; 4]).map_err(|c| self.corrupt(c, "from"))?;
        out.resize(len, 0);
        let got = self.ctrl_rx.try_read(out).map_err(|c| self.corrupt(c, "from"))?;
        debug_assert_eq!(got, len);
        Ok(true)
    }

    fn end_epoch(&mut self, epoch: u32) -> Result<bool> {
        self.tx.mark(epoch);
        self.peer_seg.bell().ring();
        Ok(true)
    }

    fn begin_epoch(&mut self, epoch: u32) -> Result<bool> {
        let passed = self.rx.skip_to_mark(epoch).map_err(|c| self.corrupt(c, "from"))?;
        // Dropped bytes are freed space: a writer blocked on a full ring waits for it.
        if self.rx.take_writer_blocked() {
            self.peer_seg.bell().ring();
        }
        Ok(passed)
    }

    fn peer_last_op(&mut self) -> Option<u64> {
        Some(self.peer_seg.bell().last_op.load(Ordering::Relaxed))
    }

    fn renumber(&mut self, rank: usize, peer: usize, _world: usize) {
        self.rank = rank;
        self.peer = peer;
    }

    fn kind(&self) -> crate::transport::Transport {
        crate::transport::Transport::Shm
    }
}

impl ShmLink {
    fn after_recv(&mut self, n: usize, asked_none: bool) -> Result<usize> {
        if n > 0 {
            // Ring only if the peer found its ring full and may wait for this space.
            if self.rx.take_writer_blocked() {
                self.peer_seg.bell().ring();
            }
        } else if !asked_none {
            if let Some(why) = self.writer_gone() {
                // Re-check: bytes may have landed between the read and the flag.
                if self.rx.available().map_err(|c| self.corrupt(c, "from"))? == 0 {
                    return Err(self.gone(why));
                }
            }
        }
        Ok(n)
    }
}
