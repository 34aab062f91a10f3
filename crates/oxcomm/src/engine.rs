//! The progress engine: drives a set of sends and receives over [`Link`]s to completion, with a
//! deadline, and names the peer when it fails.
//!
//! Algorithms describe one *step* as a list of `Xfer`s (send these bytes to that peer, receive
//! into this buffer from that peer, receive and reduce into this buffer) and hand them to
//! `Ctx::run`, which makes progress on all of them at once, so a rank always sends and
//! receives concurrently and ring steps never deadlock on bounded links. When no transfer can
//! move, the rank sleeps on its doorbell until a peer rings it, the deadline passes, or it is
//! time to check whether a stalled peer is still alive.
//!
//! The engine knows nothing about which collective it serves; `Ctx` carries the op's
//! description only to put it in errors.

use std::time::{Duration, Instant};

use crate::dtype::Element;
use crate::error::{Error, ErrorKind, Result};
use crate::reduce::{self, ReduceOp};
use crate::transport::{Doorbell, Link};
use crate::wire::Fingerprint;

/// How often a waiting rank asks its stalled links whether their peer is still alive (and
/// stamps its heartbeat, polls control channels, looks for a lapsed member). A death the
/// transport announces ([`Doorbell::deaths`]: shared memory's death watcher) is checked for at
/// once, whatever this is; TCP learns of one from the socket. Env `OXCOMM_PEER_CHECK_MS`
/// ([`peer_check_interval`]); default 50 ms.
const PEER_CHECK_INTERVAL: Duration = Duration::from_millis(50);

/// [`PEER_CHECK_INTERVAL`], or `OXCOMM_PEER_CHECK_MS` where set to a whole number of
/// milliseconds from 1 (read once per process; another value is ignored with a warning).
/// Tests set it very long to show that a death is found without it.
fn peer_check_interval() -> Duration {
    static INTERVAL: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *INTERVAL.get_or_init(|| match std::env::var("OXCOMM_PEER_CHECK_MS") {
        Err(_) => PEER_CHECK_INTERVAL,
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(ms) if ms > 0 => Duration::from_millis(ms),
            _ => {
                tracing::warn!(target: "oxcomm::engine", value = %v,
                    "OXCOMM_PEER_CHECK_MS is not a whole number of milliseconds from 1; using 50");
                PEER_CHECK_INTERVAL
            }
        },
    })
}

/// A peer whose heartbeat is older than this (and than a quarter of the op's timeout) when a
/// wait times out is named as the likely frozen rank.
const FROZEN_AFTER: Duration = Duration::from_millis(500);

/// Size in u64 words of the aligned scratch a receive-and-reduce reads into, then reduces
/// from: 128 KiB, so a large reduce over TCP makes half the `recv` calls it made with 64 KiB,
/// while the scratch and the piece of the accumulator it meets stay in a core's L2.
const REDUCE_SCRATCH_WORDS: usize = 16 * 1024;

/// A function that reduces `src` bytes into `dst` bytes of one element type.
pub(crate) type ReduceBytes = fn(&mut [u8], &[u8], ReduceOp);

/// Returns the [`ReduceBytes`] function for `T`.
pub(crate) fn reducer<T: Element>() -> ReduceBytes {
    fn f<T: Element>(dst: &mut [u8], src: &[u8], op: ReduceOp) {
        let dst: &mut [T] = bytemuck::cast_slice_mut(dst);
        let src: &[T] = bytemuck::cast_slice(src);
        reduce::reduce_into(dst, src, op);
    }
    f::<T>
}

/// One transfer of a step.
pub(crate) enum Xfer<'a> {
    /// Send all of `data` to `peer` (a group rank).
    Send { peer: usize, data: &'a [u8], done: usize },
    /// Receive exactly `buf.len()` bytes from `peer` into `buf`.
    Recv { peer: usize, buf: &'a mut [u8], done: usize },
    /// Receive `acc.len()` bytes from `peer` and reduce them into `acc` element by element.
    RecvReduce { peer: usize, acc: &'a mut [u8], done: usize, elem: usize, op: ReduceOp, reduce: ReduceBytes },
    /// Receive a header of `head.len()` bytes from `peer`, hand it to `check` once complete
    /// (its error fails the run before any byte of the body is read), then `body.len()` bytes
    /// into `body`: a framed message, checked before its payload.
    RecvChecked {
        peer: usize,
        head: &'a mut [u8],
        head_done: usize,
        check: &'a dyn Fn(&[u8]) -> Result<()>,
        checked: bool,
        body: &'a mut [u8],
        done: usize,
    },
}

impl<'a> Xfer<'a> {
    /// A send of `data` to group rank `peer`.
    pub(crate) fn send(peer: usize, data: &'a [u8]) -> Xfer<'a> {
        Xfer::Send { peer, data, done: 0 }
    }

    /// A receive into `buf` from group rank `peer`.
    pub(crate) fn recv(peer: usize, buf: &'a mut [u8]) -> Xfer<'a> {
        Xfer::Recv { peer, buf, done: 0 }
    }

    /// A receive of a header into `head`, checked by `check`, then of a body into `body`, from
    /// group rank `peer` (see [`Xfer::RecvChecked`]).
    pub(crate) fn recv_checked(
        peer: usize,
        head: &'a mut [u8],
        check: &'a dyn Fn(&[u8]) -> Result<()>,
        body: &'a mut [u8],
    ) -> Xfer<'a> {
        Xfer::RecvChecked { peer, head, head_done: 0, check, checked: false, body, done: 0 }
    }

    /// A receive from `peer` reduced into `acc` with `op`.
    pub(crate) fn recv_reduce<T: Element>(peer: usize, acc: &'a mut [T], op: ReduceOp) -> Xfer<'a> {
        Xfer::RecvReduce {
            peer,
            acc: bytemuck::cast_slice_mut(acc),
            done: 0,
            elem: std::mem::size_of::<T>(),
            op,
            reduce: reducer::<T>(),
        }
    }

    fn peer(&self) -> usize {
        match self {
            Xfer::Send { peer, .. }
            | Xfer::Recv { peer, .. }
            | Xfer::RecvReduce { peer, .. }
            | Xfer::RecvChecked { peer, .. } => *peer,
        }
    }

    pub(crate) fn finished(&self) -> bool {
        match self {
            Xfer::Send { data, done, .. } => *done == data.len(),
            Xfer::Recv { buf, done, .. } => *done == buf.len(),
            Xfer::RecvReduce { acc, done, .. } => *done == acc.len(),
            Xfer::RecvChecked { checked, body, done, .. } => *checked && *done == body.len(),
        }
    }

    fn is_send(&self) -> bool {
        matches!(self, Xfer::Send { .. })
    }
}

/// Byte counters of one rank, read by [`crate::Communicator::stats`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LinkStats {
    /// Bytes handed to links (payload and headers).
    pub bytes_sent: u64,
    /// Bytes taken from links.
    pub bytes_received: u64,
    /// Bytes copied straight out of peers' buffers by single copy (shared memory on Linux;
    /// not through any link).
    pub bytes_read_directly: u64,
}

/// How an op that talks over links meets ranks that may run the same op another way (the
/// direct shared-memory path, where ranks never touch the links): the backend that owns that
/// other path hands one to [`Ctx`] ([`Ctx::watch`]), and [`Ctx::watched`] uses it. The engine
/// knows only this trait, not what is behind it.
pub(crate) trait PeerWatch {
    /// Tells the peers that this rank runs `fp` over the links.
    fn announce(&self, fp: &Fingerprint);
    /// `Err` (naming the peer) if a peer runs `fp`'s sequence number another way, which this
    /// rank will never meet. Called only when the op would sleep, so it may read shared memory.
    fn check(&self, rank: usize, fp: &Fingerprint) -> Result<()>;
}

/// The fault-tolerance hook a backend hands an op ([`Ctx::ft`]): it polls the control
/// channels of the links it is given and fails (a revocation naming who revoked) when the
/// communicator has been revoked. A shared reference (the state it updates is the
/// backend's, behind a cell), so that sub-views of the op share it.
pub(crate) type FtHook<'c> = &'c dyn Fn(&mut [Option<Box<dyn Link>>]) -> Result<()>;

/// What an algorithm sees of the communicator while it runs one op.
pub(crate) struct Ctx<'c> {
    /// This rank within the group.
    pub rank: usize,
    /// The group size.
    pub size: usize,
    /// World rank of each group rank.
    members: &'c [usize],
    /// Links indexed by world rank.
    links: &'c mut [Option<Box<dyn Link>>],
    bell: &'c dyn Doorbell,
    /// When the op must be over: `timeout` after the first time it had to wait (set then, so
    /// that an op whose peers are already there never reads the clock; what runs before the
    /// first wait is this rank's own work). See [`Ctx::deadline`].
    deadline: std::cell::Cell<Option<Instant>>,
    timeout: Duration,
    /// Largest number of bytes moved per transfer; larger transfers are split.
    pub max_segment: usize,
    stats: &'c mut LinkStats,
    scratch: &'c mut Vec<u64>,
    /// How to meet ranks that may run this op another way, when they may (set by the backend
    /// that owns the other path; `None` in sub-views). Only [`Ctx::watched`] uses it.
    pub watch: Option<&'c dyn PeerWatch>,
    /// The op [`Ctx::watched`] runs now: while set, whenever the rank would sleep it asks
    /// [`Ctx::watch`] whether a peer runs this op's sequence number another way.
    watching: Option<Fingerprint>,
    /// The communicator's abort flag: a wait that sees it set (checked with the peers, every
    /// [`PEER_CHECK_INTERVAL`]) gives up, so `abort()` from another thread (or Ctrl-C in the
    /// Python binding) ends an op that waits for a peer.
    pub cancel: Option<&'c std::sync::atomic::AtomicBool>,
    /// The op word of this op ([`Fingerprint::op_word`]): what this rank's heartbeats say it
    /// runs.
    pub op_word: u64,
    /// How long a member may show no sign of life, while this op has waited as long, before
    /// the op gives up on it (the heartbeat lapse; zero: never, only the deadline).
    pub suspect_after: Duration,
    /// Polls the communicator's control messages (see [`FtHook`]): whenever the doorbell's
    /// control count moves while this op waits, and every [`PEER_CHECK_INTERVAL`].
    pub ft: Option<FtHook<'c>>,
    /// The doorbell's control count when the hook last ran (or the op started).
    pub ctrl_seen: u32,
}

/// `cell`'s deadline, set to `now + timeout` if it is not yet (see [`Ctx::deadline`]).
fn fix_deadline(cell: &std::cell::Cell<Option<Instant>>, timeout: Duration, now: Instant) -> Instant {
    match cell.get() {
        Some(d) => d,
        None => {
            let d = now + timeout;
            cell.set(Some(d));
            d
        }
    }
}

impl<'c> Ctx<'c> {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        rank: usize,
        members: &'c [usize],
        links: &'c mut [Option<Box<dyn Link>>],
        bell: &'c dyn Doorbell,
        timeout: Duration,
        max_segment: usize,
        stats: &'c mut LinkStats,
        scratch: &'c mut Vec<u64>,
    ) -> Ctx<'c> {
        // The heartbeat of an op that does not wait is the caller's (stamped from the op's one
        // clock reading: `NativeBackend::run_direct`); a wait stamps it again as it goes.
        Ctx {
            rank,
            size: members.len(),
            members,
            links,
            bell,
            deadline: std::cell::Cell::new(None),
            timeout,
            max_segment: max_segment.max(64),
            stats,
            scratch,
            watch: None,
            watching: None,
            cancel: None,
            op_word: 0,
            suspect_after: Duration::ZERO,
            ft: None,
            ctrl_seen: 0,
        }
    }

    /// A view of this op over a subset of the group: `members` are the world ranks of the
    /// subset (this rank among them at index `rank`). Same links, doorbell, deadline and
    /// counters; no direct shared-memory path. Hierarchical algorithms run their phases on it.
    pub fn sub<'s>(&'s mut self, members: &'s [usize], rank: usize) -> Ctx<'s> {
        debug_assert_eq!(members[rank], self.members[self.rank], "a sub-view must contain this rank");
        // The phases share one deadline: fix it now, or each sub-view would start its own.
        self.deadline();
        Ctx {
            rank,
            size: members.len(),
            members,
            links: &mut *self.links,
            bell: self.bell,
            deadline: self.deadline.clone(),
            timeout: self.timeout,
            max_segment: self.max_segment,
            stats: &mut *self.stats,
            scratch: &mut *self.scratch,
            watch: None,
            watching: None,
            cancel: self.cancel,
            op_word: self.op_word,
            suspect_after: self.suspect_after,
            ft: self.ft,
            ctrl_seen: self.ctrl_seen,
        }
    }

    /// The world rank of group rank `r`.
    pub fn world(&self, r: usize) -> usize {
        self.members[r]
    }

    /// The op's timeout (the span from its start to its deadline).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// When the op must be over (fixed by the first call, or the first wait).
    pub fn deadline(&self) -> Instant {
        self.deadline.get().unwrap_or_else(|| self.deadline_at(Instant::now()))
    }

    /// The deadline, fixed at `now + timeout` if it is not yet (`now` is the caller's reading
    /// of the clock, so the slow paths read it once).
    fn deadline_at(&self, now: Instant) -> Instant {
        fix_deadline(&self.deadline, self.timeout, now)
    }

    /// Moves the deadline to `deadline` (used by monitored barrier and the agreement phase).
    pub fn set_deadline(&mut self, deadline: Instant) {
        self.deadline.set(Some(deadline));
    }

    /// Sends `data` to `peer`, receives into `buf` from `peer2`, concurrently.
    pub fn sendrecv(&mut self, to: usize, data: &[u8], from: usize, buf: &mut [u8]) -> Result<()> {
        self.run(&mut [Xfer::send(to, data), Xfer::recv(from, buf)])
    }

    /// Sends `data` to `peer`.
    pub fn send(&mut self, to: usize, data: &[u8]) -> Result<()> {
        self.run(&mut [Xfer::send(to, data)])
    }

    /// Receives `buf.len()` bytes from `peer`.
    pub fn recv(&mut self, from: usize, buf: &mut [u8]) -> Result<()> {
        self.run(&mut [Xfer::recv(from, buf)])
    }

    /// Drives every transfer to completion, or fails with an error naming the peer.
    pub fn run(&mut self, xfers: &mut [Xfer<'_>]) -> Result<()> {
        let mut last_check = None;
        // Deaths announced before this wait count too: its peer may be one of them.
        let mut deaths_seen = 0;
        let interval = peer_check_interval();
        loop {
            let epoch = self.bell.epoch();
            let mut progressed = false;
            let mut pending = false;
            for i in 0..xfers.len() {
                if xfers[i].finished() {
                    continue;
                }
                // Bytes to (or from) one peer are one stream: a transfer waits until every
                // earlier transfer in the same direction with the same peer is complete.
                let (peer, send) = (xfers[i].peer(), xfers[i].is_send());
                let blocked = xfers[..i].iter().any(|y| !y.finished() && y.peer() == peer && y.is_send() == send);
                if !blocked {
                    progressed |= self.step(&mut xfers[i])?;
                }
                pending |= !xfers[i].finished();
            }
            if !pending {
                return Ok(());
            }
            if progressed {
                continue;
            }
            self.check_paths()?;
            self.check_ft()?;
            let now = Instant::now();
            let deadline = self.deadline_at(now);
            if now >= deadline {
                return Err(self.timeout_error(xfers));
            }
            if self.bell.deaths() != deaths_seen {
                deaths_seen = self.bell.deaths();
                self.check_stalled(xfers)?;
            }
            if now.duration_since(*last_check.get_or_insert(now)) >= interval {
                last_check = Some(now);
                self.bell.heartbeat();
                self.check_cancel()?;
                self.check_stalled(xfers)?;
                self.periodic_ft(now)?;
            }
            let wake = deadline.min(now + interval);
            self.bell.wait(epoch, wake);
        }
    }

    /// Fails, naming the peer, if the peer of an unfinished transfer is gone.
    fn check_stalled(&mut self, xfers: &[Xfer<'_>]) -> Result<()> {
        for x in xfers.iter().filter(|x| !x.finished()) {
            let world = self.members[x.peer()];
            self.link(world)?.check_peer().map_err(|e| e.with_peer(world))?;
        }
        Ok(())
    }

    /// Waits until the stream from one of `peers` (group ranks) starts with `head.len()`
    /// bytes that `pick` takes, and returns that peer; the bytes stay unread, for the caller
    /// to receive next. `pick` sees a peer and the first bytes of its stream: `Ok(true)` takes
    /// it, `Ok(false)` leaves them for another receive, `Err` fails the wait. Peers are looked
    /// at in the order given (the first wins a tie). Fails on the deadline (the error says it
    /// waited for `what`), on abort, and when a peer whose stream was not taken is gone, since
    /// it may have been the one to send.
    ///
    /// Cost: one peek of `head.len()` bytes per peer each time any peer rings this rank.
    pub fn wait_for_head(
        &mut self,
        peers: &[usize],
        head: &mut [u8],
        what: &dyn Fn() -> String,
        mut pick: impl FnMut(usize, &[u8]) -> Result<bool>,
    ) -> Result<usize> {
        let mut last_check = None;
        let mut deaths_seen = 0;
        let interval = peer_check_interval();
        loop {
            let epoch = self.bell.epoch();
            for &p in peers {
                let world = self.members[p];
                let n = self.link(world)?.peek(head).map_err(|e| e.with_peer(world))?;
                if n == head.len() && pick(p, head)? {
                    return Ok(p);
                }
            }
            self.check_ft()?;
            let now = Instant::now();
            let deadline = self.deadline_at(now);
            if now >= deadline {
                let msg = format!("timed out after {:?} waiting for {}", self.timeout, what());
                return Err(Error::new(ErrorKind::Timeout, msg));
            }
            let died = self.bell.deaths() != deaths_seen;
            let due = now.duration_since(*last_check.get_or_insert(now)) >= interval;
            if due {
                last_check = Some(now);
                self.bell.heartbeat();
                self.check_cancel()?;
                self.periodic_ft(now)?;
            }
            if died || due {
                deaths_seen = self.bell.deaths();
                for &p in peers {
                    let world = self.members[p];
                    if let Err(e) = self.link(world)?.check_alive() {
                        // It may have sent what this wait takes, then exited, since the peek.
                        let n = self.link(world)?.peek(head).map_err(|e| e.with_peer(world))?;
                        if n == head.len() && pick(p, head)? {
                            return Ok(p);
                        }
                        return Err(e.with_peer(world));
                    }
                }
            }
            self.bell.wait(epoch, deadline.min(now + interval));
        }
    }

    /// Waits until `lagging` returns `None`; it returns the group rank still being waited for
    /// (checked for liveness, and named on timeout). Peers ring this rank's doorbell when they
    /// publish progress.
    pub fn wait_until(&mut self, mut lagging: impl FnMut() -> Option<usize>) -> Result<()> {
        let mut last_check = None;
        let mut deaths_seen = 0;
        let interval = peer_check_interval();
        loop {
            let epoch = self.bell.epoch();
            let Some(lag) = lagging() else { return Ok(()) };
            self.check_ft()?;
            let now = Instant::now();
            let world = self.members[lag];
            let deadline = self.deadline_at(now);
            if now >= deadline {
                return Err(self.timeout_for(world, false));
            }
            let died = self.bell.deaths() != deaths_seen;
            let due = now.duration_since(*last_check.get_or_insert(now)) >= interval;
            if due {
                last_check = Some(now);
                self.bell.heartbeat();
                self.check_cancel()?;
                self.periodic_ft(now)?;
            }
            if died || due {
                deaths_seen = self.bell.deaths();
                if world != self.members[self.rank] {
                    // This wait reads shared memory, not the link: bytes the peer left unread
                    // in it must not make a dead peer look alive.
                    if let Err(e) = self.link(world)?.check_alive() {
                        // It may have published, then exited, since `lagging` was read.
                        if lagging() == Some(lag) {
                            return Err(e.with_peer(world));
                        }
                        continue;
                    }
                }
            }
            // Peers publish what `lagging` reads without ringing unless this rank sleeps.
            self.bell.wait_checked(epoch, deadline.min(now + interval), &mut || lagging().is_none());
        }
    }

    /// Why group rank `peer` no longer takes part, if its link says so: it exited, or it
    /// aborted and named the rank to blame (whose error this then is, as a wait on it would
    /// return). `None` while it looks alive.
    pub fn peer_failure(&mut self, peer: usize) -> Option<Error> {
        let world = self.members[peer];
        match self.link(world) {
            Ok(link) => link.check_alive().err().map(|e| e.with_peer(world)),
            Err(e) => Some(e),
        }
    }

    /// Counts `bytes` copied straight out of a peer's buffer (see [`LinkStats`]).
    pub fn count_read_directly(&mut self, bytes: usize) {
        self.stats.bytes_read_directly += bytes as u64;
    }

    /// Between two waits of this op: fails at once if the communicator was aborted (by
    /// another thread of this rank) or if a control message came and the hook finds the
    /// communicator revoked. Two loads when nothing happened.
    fn check_ft(&mut self) -> Result<()> {
        self.check_cancel()?;
        let count = self.bell.ctrl_count();
        if count != self.ctrl_seen {
            self.ctrl_seen = count;
            if let Some(hook) = self.ft {
                hook(self.links)?;
            }
        }
        Ok(())
    }

    /// Every [`PEER_CHECK_INTERVAL`] of waiting: tells the peers this rank is alive in this op
    /// (its op word beside the doorbell heartbeat, heartbeat frames where the links need
    /// them), polls the control channels (TCP's arrive only when read), and gives up on a
    /// member that has shown no sign of life for the heartbeat lapse.
    fn periodic_ft(&mut self, now: Instant) -> Result<()> {
        self.bell.set_op(self.op_word);
        for link in self.links.iter_mut().flatten() {
            link.beat(self.op_word);
        }
        if let Some(hook) = self.ft {
            self.ctrl_seen = self.bell.ctrl_count();
            hook(self.links)?;
        }
        self.check_suspects(now)
    }

    /// Fails naming the member idle longest, if this op has waited for the heartbeat lapse
    /// ([`Ctx::suspect_after`]) and that member has shown no sign of life for as long.
    fn check_suspects(&mut self, now: Instant) -> Result<()> {
        let lapse = self.suspect_after;
        let Some(deadline) = self.deadline.get() else { return Ok(()) };
        let first_wait = deadline.checked_sub(self.timeout).unwrap_or(now);
        if lapse.is_zero() || now.saturating_duration_since(first_wait) < lapse {
            return Ok(());
        }
        let mut worst: Option<(usize, Duration)> = None;
        for m in (0..self.size).filter(|&m| m != self.rank) {
            let world = self.members[m];
            let Some(link) = self.links.get_mut(world).and_then(|l| l.as_mut()) else { continue };
            if let Some(idle) = link.peer_idle() {
                if idle >= lapse && worst.is_none_or(|(_, w)| idle > w) {
                    worst = Some((world, idle));
                }
            }
        }
        let Some((world, idle)) = worst else { return Ok(()) };
        let link = self.link(world)?;
        let last = link.peer_last_op().and_then(crate::wire::describe_op_word);
        let last = last.map(|op| format!(", last seen in its {op}")).unwrap_or_default();
        Err(Error::new(
            ErrorKind::Suspected,
            format!(
                "rank {world} is suspected: no sign of life inside oxcomm for {idle:.1?}{last} \
                 (more than the heartbeat lapse of {lapse:?}, OXCOMM_SUSPECT_AFTER_MS): stopped, or \
                 busy outside oxcomm"
            ),
        )
        .with_peer(world))
    }

    /// Fails if the communicator was aborted while this op waited (see [`Ctx::cancel`]).
    fn check_cancel(&self) -> Result<()> {
        match self.cancel {
            Some(flag) if flag.load(std::sync::atomic::Ordering::SeqCst) => Err(Error::new(
                ErrorKind::Aborted,
                "the communicator was aborted (by another thread, or an interrupt) while this op waited",
            )),
            _ => Ok(()),
        }
    }

    /// `e`, unless it blames the bytes a peer sent (a mismatch or a protocol error naming it)
    /// and that peer is gone: then the peer's death, since what a dead rank left unread in
    /// a link is a leftover (a message nobody received), not its part in this op.
    pub fn blame_the_dead(&mut self, e: Error) -> Error {
        if !matches!(e.kind(), ErrorKind::Mismatch | ErrorKind::Protocol) {
            return e;
        }
        let Some(world) = e.peer() else { return e };
        match self.links.get_mut(world).and_then(|l| l.as_mut()).map(|l| l.check_alive()) {
            Some(Err(gone)) if gone.kind() == ErrorKind::PeerGone => gone.with_peer(world),
            _ => e,
        }
    }

    /// Runs `f`, an op `fp` of this rank that talks over links (agreement first), beside ranks
    /// that may run it another way ([`Ctx::watch`]): announces `fp` to them and, whenever `f`
    /// would sleep, checks that no peer runs `fp`'s sequence number that other way, so both
    /// sides fail at once with a mismatch instead of waiting for each other until the
    /// deadline. Without a watch (no other path, sub-views) it is just `f`.
    pub fn watched<R>(&mut self, fp: &Fingerprint, f: impl FnOnce(&mut Ctx<'_>) -> Result<R>) -> Result<R> {
        let Some(watch) = self.watch else { return f(self) };
        watch.announce(fp);
        let before = self.watching.replace(*fp);
        let r = f(self);
        self.watching = before;
        // A peer that saw the mismatch first may have closed its links: name the op it runs
        // rather than report its close.
        r.map_err(|e| watch.check(self.rank, fp).err().unwrap_or(e))
    }

    /// Fails (a mismatch naming the peer) if [`Ctx::watched`] runs an op and a peer runs its
    /// sequence number another way (it would never send what this rank waits for).
    fn check_paths(&self) -> Result<()> {
        if let (Some(w), Some(fp)) = (self.watch, &self.watching) {
            return w.check(self.rank, fp);
        }
        Ok(())
    }

    fn link(&mut self, world: usize) -> Result<&mut Box<dyn Link>> {
        self.links
            .get_mut(world)
            .and_then(|l| l.as_mut())
            .ok_or_else(|| Error::new(ErrorKind::PeerGone, format!("no link to rank {world}")).with_peer(world))
    }

    fn timeout_error(&mut self, xfers: &[Xfer<'_>]) -> Error {
        let stalled =
            xfers.iter().find(|x| !x.finished() && !x.is_send()).or_else(|| xfers.iter().find(|x| !x.finished()));
        let peer = stalled.map(|x| self.members[x.peer()]).unwrap_or(0);
        self.timeout_for(peer, stalled.is_some_and(|x| x.is_send()))
    }

    /// The timeout error of a wait on world rank `peer` (to send to it, or to hear from it).
    fn timeout_for(&mut self, peer: usize, sending: bool) -> Error {
        let what = if sending { " to accept data from us" } else { "" };
        let mut msg = format!("timed out after {:?} waiting for rank {peer}{what}", self.timeout);
        // The rank we waited for may itself be waiting: blame the one that shows no life.
        let mut blamed = peer;
        if let Some((frozen, idle)) = self.most_idle_peer() {
            if frozen != peer {
                msg.push_str(&format!(
                    "; rank {frozen} has shown no sign of life for {idle:.1?} (stopped, or busy outside oxcomm)"
                ));
                blamed = frozen;
            }
        }
        Error::new(ErrorKind::Timeout, msg).with_peer(blamed)
    }

    /// The group member idle longest, if idle long enough to look frozen.
    fn most_idle_peer(&mut self) -> Option<(usize, Duration)> {
        let threshold = (self.timeout / 4).max(FROZEN_AFTER);
        let mut worst: Option<(usize, Duration)> = None;
        for m in 0..self.size {
            let world = self.members[m];
            if m == self.rank {
                continue;
            }
            let Some(link) = self.links.get_mut(world).and_then(|l| l.as_mut()) else { continue };
            if let Some(idle) = link.peer_idle() {
                if idle >= threshold && worst.is_none_or(|(_, w)| idle > w) {
                    worst = Some((world, idle));
                }
            }
        }
        worst
    }

    /// Makes what progress one transfer can make now; returns whether any byte moved.
    fn step(&mut self, x: &mut Xfer<'_>) -> Result<bool> {
        let world = self.members[x.peer()];
        let max_segment = self.max_segment;
        match x {
            Xfer::Send { data, done, .. } => {
                let end = (*done + max_segment).min(data.len());
                let n = self.link(world)?.try_send(&data[*done..end]).map_err(|e| e.with_peer(world))?;
                *done += n;
                self.stats.bytes_sent += n as u64;
                Ok(n > 0)
            }
            Xfer::Recv { buf, done, .. } => {
                let end = (*done + max_segment).min(buf.len());
                let n = self.link(world)?.try_recv(&mut buf[*done..end]).map_err(|e| e.with_peer(world))?;
                *done += n;
                self.stats.bytes_received += n as u64;
                Ok(n > 0)
            }
            Xfer::RecvChecked { head, head_done, check, checked, body, done, .. } => {
                let link = self.link(world)?;
                let mut moved = 0;
                if *head_done < head.len() {
                    let n = link.try_recv(&mut head[*head_done..]).map_err(|e| e.with_peer(world))?;
                    *head_done += n;
                    moved += n;
                    if *head_done < head.len() {
                        self.stats.bytes_received += moved as u64;
                        return Ok(moved > 0);
                    }
                }
                if !*checked {
                    check(head)?;
                    *checked = true;
                }
                let end = (*done + max_segment).min(body.len());
                let link = self.link(world)?;
                let n = link.try_recv(&mut body[*done..end]).map_err(|e| e.with_peer(world))?;
                *done += n;
                moved += n;
                self.stats.bytes_received += moved as u64;
                // A checked empty body is progress too: the transfer just finished.
                Ok(moved > 0 || (*checked && body.is_empty()))
            }
            Xfer::RecvReduce { acc, done, elem, op, reduce, .. } => {
                let (elem, op, reduce) = (*elem, *op, *reduce);
                let want = (acc.len() - *done).min(max_segment).min(REDUCE_SCRATCH_WORDS * 8);
                if self.scratch.len() < REDUCE_SCRATCH_WORDS {
                    self.scratch.resize(REDUCE_SCRATCH_WORDS, 0);
                }
                let scratch: &mut [u8] = bytemuck::cast_slice_mut(&mut self.scratch[..]);
                // Receive into aligned scratch, then reduce whole elements. `done` is always a
                // multiple of `elem`: a partial element is completed before returning.
                let base = *done;
                let link = self.links.get_mut(world).and_then(|l| l.as_mut()).ok_or_else(|| {
                    Error::new(ErrorKind::PeerGone, format!("no link to rank {world}")).with_peer(world)
                })?;
                // Only ask for whole elements so nothing is left over.
                let want = want - want % elem;
                let n = link.try_recv(&mut scratch[..want]).map_err(|e| e.with_peer(world))?;
                if n == 0 {
                    return Ok(false);
                }
                let whole = n - n % elem;
                if whole < n {
                    // Read the rest of the element; it is on its way (the sender writes whole
                    // segments), so wait for it within the deadline.
                    let mut got = n;
                    let stop = whole + elem;
                    while got < stop {
                        let m = link.try_recv(&mut scratch[got..stop]).map_err(|e| e.with_peer(world))?;
                        got += m;
                        if m == 0 {
                            let now = Instant::now();
                            if now >= fix_deadline(&self.deadline, self.timeout, now) {
                                return Err(Error::new(
                                    ErrorKind::Timeout,
                                    format!("timed out after {:?} waiting for rank {world}", self.timeout),
                                )
                                .with_peer(world));
                            }
                            link.check_peer().map_err(|e| e.with_peer(world))?;
                            std::thread::yield_now();
                        }
                    }
                    reduce(&mut acc[base..base + stop], &scratch[..stop], op);
                    *done = base + stop;
                    self.stats.bytes_received += stop as u64;
                } else {
                    reduce(&mut acc[base..base + n], &scratch[..n], op);
                    *done = base + n;
                    self.stats.bytes_received += n as u64;
                }
                Ok(true)
            }
        }
    }
}
