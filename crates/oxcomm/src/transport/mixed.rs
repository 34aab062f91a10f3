//! Jobs that span hosts with several ranks per host: shared-memory links to the peers on this
//! host and TCP links to the others, behind one [`MixedDoorbell`].
//!
//! This file owns only the joining: [`combine`] merges the two transports' links into one
//! table indexed by world rank and builds the doorbell. Setting up each transport is theirs
//! (`shm`, `tcp`); choosing who is local is `init`'s.
//!
//! # Waiting on two kinds of event
//!
//! Shared-memory peers ring a futex word in this rank's segment; TCP peers make a socket
//! readable or writable. No single system call sleeps on both, so the doorbell waits on the
//! one that matters: every link records *interest* when a call could not move all its bytes
//! ([`Watched`]: one flag for the shared-memory links, one for the TCP links), and each wait
//! clears both, so only the transfers pending right now count. (The TCP links' own per-socket
//! interest is what `poll(2)` then watches; it may outlive a transfer, so it cannot tell
//! whether TCP is waited on.)
//!
//! - interest on shared-memory links only: sleep on the futex ([`ShmDoorbell`]);
//! - on TCP links only: sleep in `poll(2)` ([`TcpDoorbell`]);
//! - on both (a flat ring whose neighbours are on different transports, say): sleep in
//!   `poll(2)` for a slice that starts at 20 µs and doubles up to [`MAX_SLICE`], checking the
//!   futex word between slices. A shared-memory peer then waits at most one slice longer to
//!   be noticed; the hierarchical algorithms, which the planner picks for such jobs, wait on
//!   one transport at a time.
//!
//! The epoch is the (wrapping) sum of the two counters; both only grow, so it changes
//! whenever either does.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::shm::{ShmDoorbell, ShmLink};
use super::tcp::{TcpDoorbell, TcpLink};
use super::{Doorbell, Link};
use crate::error::{Error, ErrorKind, Result};

/// Longest sleep in `poll(2)` before looking at the shared-memory doorbell again, while
/// links of both kinds are waited on.
pub const MAX_SLICE: Duration = Duration::from_micros(200);

/// First slice of such a wait.
const FIRST_SLICE: Duration = Duration::from_micros(20);

/// A link that raises a shared flag whenever a call could not move all the bytes asked for
/// (so the caller may wait on this link next).
pub struct Watched<L> {
    inner: L,
    interest: Arc<AtomicBool>,
}

impl<L> std::fmt::Debug for Watched<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watched").field("interest", &self.interest).finish_non_exhaustive()
    }
}

impl<L: Link> Link for Watched<L> {
    fn peer(&self) -> usize {
        self.inner.peer()
    }

    fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        let n = self.inner.try_send(data)?;
        if n < data.len() {
            self.interest.store(true, Ordering::SeqCst);
        }
        Ok(n)
    }

    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        let n = self.inner.try_recv(buf)?;
        if n < buf.len() {
            self.interest.store(true, Ordering::SeqCst);
        }
        Ok(n)
    }

    fn recv_with(&mut self, max: usize, consume: &mut dyn FnMut(&[u8])) -> Result<usize> {
        let n = self.inner.recv_with(max, consume)?;
        if n < max {
            self.interest.store(true, Ordering::SeqCst);
        }
        Ok(n)
    }

    fn peek(&mut self, buf: &mut [u8]) -> Result<usize> {
        let n = self.inner.peek(buf)?;
        if n < buf.len() {
            self.interest.store(true, Ordering::SeqCst);
        }
        Ok(n)
    }

    fn check_peer(&mut self) -> Result<()> {
        self.inner.check_peer()
    }

    fn check_alive(&mut self) -> Result<()> {
        self.inner.check_alive()
    }

    fn close(&mut self, cause: Option<(usize, ErrorKind)>) {
        self.inner.close(cause);
    }

    fn peer_idle(&mut self) -> Option<Duration> {
        self.inner.peer_idle()
    }

    fn kind(&self) -> super::Transport {
        self.inner.kind()
    }

    fn send_ctrl(&mut self, msg: &[u8]) -> Result<bool> {
        self.inner.send_ctrl(msg)
    }

    fn recv_ctrl(&mut self, out: &mut Vec<u8>) -> Result<bool> {
        let got = self.inner.recv_ctrl(out)?;
        if !got {
            self.interest.store(true, Ordering::SeqCst);
        }
        Ok(got)
    }

    fn end_epoch(&mut self, epoch: u32) -> Result<bool> {
        let done = self.inner.end_epoch(epoch)?;
        if !done {
            self.interest.store(true, Ordering::SeqCst);
        }
        Ok(done)
    }

    fn begin_epoch(&mut self, epoch: u32) -> Result<bool> {
        let done = self.inner.begin_epoch(epoch)?;
        if !done {
            self.interest.store(true, Ordering::SeqCst);
        }
        Ok(done)
    }

    fn left_out_by_peer(&mut self) -> bool {
        self.inner.left_out_by_peer()
    }

    fn beat(&mut self, op: u64) {
        self.inner.beat(op);
    }

    fn peer_last_op(&mut self) -> Option<u64> {
        self.inner.peer_last_op()
    }

    fn renumber(&mut self, rank: usize, peer: usize, world: usize) {
        self.inner.renumber(rank, peer, world);
    }
}

/// The doorbell of a rank with links of both kinds; see the [module docs](self).
pub struct MixedDoorbell {
    shm: Arc<ShmDoorbell>,
    tcp: Arc<TcpDoorbell>,
    shm_interest: Arc<AtomicBool>,
    tcp_interest: Arc<AtomicBool>,
}

impl std::fmt::Debug for MixedDoorbell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MixedDoorbell").field("tcp", &self.tcp).finish_non_exhaustive()
    }
}

impl MixedDoorbell {
    /// Sleeps in `poll(2)` slice by slice, looking at the futex word in between.
    fn wait_both(&self, shm_seen: u32, tcp_seen: u32, until: Instant) {
        let mut slice = FIRST_SLICE;
        loop {
            if self.shm.epoch() != shm_seen || self.tcp.epoch() != tcp_seen {
                return;
            }
            let now = Instant::now();
            if now >= until {
                return;
            }
            self.tcp.wait(tcp_seen, until.min(now + slice));
            slice = (slice * 2).min(MAX_SLICE);
        }
    }
}

impl Doorbell for MixedDoorbell {
    fn epoch(&self) -> u32 {
        self.shm.epoch().wrapping_add(self.tcp.epoch())
    }

    fn wait(&self, epoch: u32, until: Instant) {
        let (shm_seen, tcp_seen) = (self.shm.epoch(), self.tcp.epoch());
        if shm_seen.wrapping_add(tcp_seen) != epoch {
            return;
        }
        let want_shm = self.shm_interest.swap(false, Ordering::SeqCst);
        let want_tcp = self.tcp_interest.swap(false, Ordering::SeqCst);
        match (want_shm, want_tcp) {
            (true, false) => self.shm.wait(shm_seen, until),
            (false, true) => self.tcp.wait(tcp_seen, until),
            // Both, or neither (a caller polling something else): wake for either.
            _ => self.wait_both(shm_seen, tcp_seen, until),
        }
    }

    fn heartbeat(&self) {
        self.shm.heartbeat();
        self.tcp.heartbeat();
    }

    fn set_op(&self, op: u64) {
        self.shm.set_op(op);
    }

    fn ctrl_count(&self) -> u32 {
        self.shm.ctrl_count().wrapping_add(self.tcp.ctrl_count())
    }

    fn wake(&self) {
        self.shm.wake();
        self.tcp.wake();
    }

    fn deaths(&self) -> u32 {
        self.shm.deaths()
    }
}

/// Merges shared-memory links (to this host's peers) and TCP links (to the other hosts'),
/// both indexed by world rank, into one table, with a doorbell over both. Fails if a rank has
/// links of both kinds, or if a peer has neither (except `rank` itself).
#[allow(clippy::type_complexity)] // the shape every transport hands to the communicator
pub fn combine(
    rank: usize,
    shm_links: Vec<Option<ShmLink>>,
    shm_bell: Arc<ShmDoorbell>,
    tcp_links: Vec<Option<TcpLink>>,
    tcp_bell: Arc<TcpDoorbell>,
) -> Result<(Vec<Option<Box<dyn Link>>>, Arc<dyn Doorbell>)> {
    let world = shm_links.len().max(tcp_links.len());
    let (shm_interest, tcp_interest) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let mut shm_links = shm_links.into_iter();
    let mut tcp_links = tcp_links.into_iter();
    let mut links: Vec<Option<Box<dyn Link>>> = Vec::with_capacity(world);
    for p in 0..world {
        let link: Option<Box<dyn Link>> = match (shm_links.next().flatten(), tcp_links.next().flatten()) {
            (Some(s), None) => Some(Box::new(Watched { inner: s, interest: shm_interest.clone() })),
            (None, Some(t)) => Some(Box::new(Watched { inner: t, interest: tcp_interest.clone() })),
            (None, None) if p == rank => None,
            (None, None) => {
                return Err(Error::invalid(format!("rank {rank} has no link to rank {p}")).with_rank(rank).with_peer(p))
            }
            (Some(_), Some(_)) => {
                return Err(Error::invalid(format!("rank {rank} has both a shared-memory and a TCP link to rank {p}"))
                    .with_rank(rank)
                    .with_peer(p))
            }
        };
        links.push(link);
    }
    Ok((links, Arc::new(MixedDoorbell { shm: shm_bell, tcp: tcp_bell, shm_interest, tcp_interest })))
}
