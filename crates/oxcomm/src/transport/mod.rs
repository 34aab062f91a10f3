//! Moving bytes between this rank and one peer. Nothing here knows about collectives.
//!
//! # The contract
//!
//! A [`Link`] is a bidirectional, reliable, **ordered byte stream** between this rank and one
//! peer, driven without blocking: [`Link::try_send`] copies as many bytes as the link can take
//! now and [`Link::try_recv`] copies as many as have arrived. Message boundaries are not kept;
//! the layers above frame their own messages. Bytes are delivered exactly once, in order.
//!
//! Links never block and never wait. Waiting is done by the rank's [`Doorbell`]: every link
//! rings the doorbell of the *other* side whenever it makes bytes or space available, so a rank
//! that found no progress on any of its links can sleep on its own doorbell and be woken by
//! whichever peer moves first. A doorbell wait always has a deadline.
//!
//! After a link returns an error it is unusable; the communicator above aborts.
//! [`Link::check_peer`] is how a waiting rank notices that a peer is gone (process died,
//! connection closed) before its deadline.

use std::time::Instant;

use crate::error::{Error, ErrorKind, Result};

pub mod inproc;
#[cfg(target_os = "linux")]
pub mod mixed;
#[cfg(target_os = "linux")]
pub mod shm;
#[cfg(unix)]
pub mod tcp;

/// A bidirectional ordered byte stream to one peer. See the [module docs](self).
pub trait Link: Send {
    /// The peer's rank (in the world this link was built for).
    fn peer(&self) -> usize;

    /// Copies a prefix of `data` into the link; returns how many bytes were taken (0 when the
    /// link is full right now). Rings the peer's doorbell when it took any.
    fn try_send(&mut self, data: &[u8]) -> Result<usize>;

    /// Copies available bytes into a prefix of `buf`; returns how many (0 when none arrived
    /// yet). Rings the peer's doorbell when it freed space.
    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize>;

    /// Offers bytes that have arrived, in place where the transport can, to `consume`, which
    /// must use every byte it is offered (it may be called several times). At most `max` bytes
    /// are offered in all; returns how many. The default copies through a stack buffer;
    /// transports with mapped memory offer it without a copy.
    fn recv_with(&mut self, max: usize, consume: &mut dyn FnMut(&[u8])) -> Result<usize> {
        let mut scratch = [0u8; 4096];
        let want = max.min(scratch.len());
        let got = self.try_recv(&mut scratch[..want])?;
        if got > 0 {
            consume(&scratch[..got]);
        }
        Ok(got)
    }

    /// Copies up to `buf.len()` bytes that have arrived into `buf` **without consuming them**
    /// (the next receive returns them again); returns how many (0 when none). A receive from
    /// any source looks at the head of every candidate's stream this way and takes only the
    /// message meant for it. Like a receive that finds nothing, a short peek makes the next
    /// doorbell wait wake when more bytes arrive.
    fn peek(&mut self, buf: &mut [u8]) -> Result<usize>;

    /// Returns an error of kind [`crate::ErrorKind::PeerGone`] if the peer is known to be
    /// gone. Cheap enough to call every few milliseconds while waiting.
    fn check_peer(&mut self) -> Result<()>;

    /// [`Link::check_peer`] for a rank that is not reading this link: the peer is reported
    /// gone even while bytes it sent are still unread (they will never be read by a wait
    /// that watches shared memory instead, such as the direct shared-memory collectives).
    fn check_alive(&mut self) -> Result<()> {
        self.check_peer()
    }

    /// Closes the link for good after this rank failed, telling the peer (where the transport
    /// can) which rank caused the failure and how (`Timeout`, `PeerGone`, `Mismatch`, ...), so
    /// every rank's error names the original culprit rather than the neighbour that gave up
    /// first. Dropping a link closes it too, without a cause.
    fn close(&mut self, cause: Option<(usize, ErrorKind)>) {
        let _ = cause;
    }

    /// How long ago the peer last showed life inside oxcomm (its doorbell heartbeat), where
    /// the transport can tell; used to name a frozen rank when a wait times out.
    fn peer_idle(&mut self) -> Option<std::time::Duration> {
        None
    }

    /// The transport this link belongs to, for logs and plans.
    fn kind(&self) -> Transport;

    // ---------------------------------------------------------------- fault tolerance
    //
    // What revoking, agreeing and shrinking a communicator need of a link (see
    // `backend/native_ft.rs`): a control channel beside the byte stream, epoch marks that let
    // both sides drop what an abandoned op left in the stream and go on with the same link,
    // and, where the peer cannot read this rank's heartbeat in shared memory, heartbeats sent
    // while waiting. The defaults say the transport has none of it (a test's wrapper link).

    /// Sends one control message of at most [`MAX_CTRL_BYTES`], whole or not at all:
    /// `Ok(false)` when the link cannot take it now (try again later). Control messages from
    /// one side arrive in order. Where the transport has room apart from the byte stream
    /// (shared memory, threads) they overtake it; where it has not (TCP) they travel as
    /// control frames between its data frames, so a peer finds them behind what was sent
    /// before. Either way the peer's doorbell is rung and, once the message is where
    /// [`Link::recv_ctrl`] finds it, its [`Doorbell::ctrl_count`] moves.
    fn send_ctrl(&mut self, msg: &[u8]) -> Result<bool> {
        let _ = msg;
        Err(Error::unsupported("this link has no control channel"))
    }

    /// Takes the next control message from the peer into `out` (replacing what it held):
    /// `Ok(false)` when none has arrived. On TCP this reads the control frames at the head
    /// of the stream; data in front of them stops it, unless [`Link::begin_epoch`] asked to
    /// drop that data.
    fn recv_ctrl(&mut self, out: &mut Vec<u8>) -> Result<bool> {
        let _ = out;
        Ok(false)
    }

    /// Ends this side's byte stream of the epochs before `epoch`: everything sent so far
    /// belongs to them, everything sent later to `epoch` (a data frame sent in part is first
    /// completed with padding that the peer drops). `Ok(false)`: not done yet (a full
    /// socket); call again before sending anything else. Idempotent per epoch.
    fn end_epoch(&mut self, epoch: u32) -> Result<bool> {
        let _ = epoch;
        Err(Error::unsupported("this link cannot start a new epoch"))
    }

    /// Starts reading epoch `epoch`: drops every byte the peer sent before its
    /// [`Link::end_epoch`]`(epoch)`, and returns `Ok(true)` once past that point; `Ok(false)`
    /// while the peer's mark has not arrived (bytes before it are dropped as they come; call
    /// again). Control messages are not dropped.
    fn begin_epoch(&mut self, epoch: u32) -> Result<bool> {
        let _ = epoch;
        Err(Error::unsupported("this link cannot start a new epoch"))
    }

    /// Whether the peer has closed the link telling this rank it was left out (the close of
    /// [`Link::close`] with cause `(this rank, Revoked)`, which a shrink sends the members it
    /// leaves out), even while bytes it sent before are unread. Where the transport's control
    /// channel overtakes the byte stream (shared memory, threads) the revocation already says
    /// so: `false`.
    fn left_out_by_peer(&mut self) -> bool {
        false
    }

    /// Shows the peer that this rank is alive inside oxcomm, in the op of op word `op`
    /// (`Fingerprint::op_word`, crate-internal), where the peer cannot read this rank's
    /// doorbell heartbeat (TCP: a heartbeat frame, at most one per [`BEAT_EVERY`], and only
    /// between data frames). Waits call it every few tens of milliseconds; elsewhere it does
    /// nothing.
    fn beat(&mut self, op: u64) {
        let _ = op;
    }

    /// The op word (`Fingerprint::op_word`, crate-internal) of the op the peer last showed
    /// life in, where the transport can tell.
    fn peer_last_op(&mut self) -> Option<u64> {
        None
    }

    /// Renames the two ends after a shrink renumbered the ranks: this rank is now `rank` and
    /// the peer `peer`, in a world of `world` (what errors and close notices name).
    fn renumber(&mut self, rank: usize, peer: usize, world: usize) {
        let _ = (rank, peer, world);
    }
}

/// Largest control message a link carries ([`Link::send_ctrl`]).
pub const MAX_CTRL_BYTES: usize = 4096;

/// Shortest time between two heartbeat frames on one link ([`Link::beat`]).
pub const BEAT_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// How a communicator moves bytes: which transport its links use, or MPI.
///
/// [`Transport::as_str`] is the name in logs, the comms log's JSON and the CLI's tables
/// (`threads`, `shm`, `tcp`, `shm+tcp`, `mpi`), and [`Transport::parse`] is the one place those
/// names are read back (the CLI, the Python package). Compare values, not names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Transport {
    /// Threads of one process ([`inproc`]).
    Threads,
    /// Shared memory between processes on one host ([`shm`]).
    Shm,
    /// TCP between every pair of ranks ([`tcp`]).
    Tcp,
    /// Shared memory inside each host, TCP between hosts ([`mixed`]).
    ShmTcp,
    /// MPI (the `mpi` backend): MPI's own transports.
    Mpi,
}

impl Transport {
    /// Every transport, in the order the CLI lists them.
    pub const ALL: [Transport; 5] =
        [Transport::Threads, Transport::Shm, Transport::Tcp, Transport::ShmTcp, Transport::Mpi];

    /// The transport named `s` (any case): one of the names [`Transport::as_str`] gives.
    ///
    /// ```
    /// use oxcomm::Transport;
    ///
    /// for t in Transport::ALL {
    ///     assert_eq!(Transport::parse(t.as_str()), Some(t));
    /// }
    /// assert_eq!(Transport::parse("SHM+TCP"), Some(Transport::ShmTcp));
    /// assert_eq!(Transport::parse("gloo"), None);
    /// ```
    pub fn parse(s: &str) -> Option<Transport> {
        Transport::ALL.into_iter().find(|t| t.as_str().eq_ignore_ascii_case(s))
    }

    /// The transport's name: `threads`, `shm`, `tcp`, `shm+tcp` or `mpi`.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Threads => "threads",
            Transport::Shm => "shm",
            Transport::Tcp => "tcp",
            Transport::ShmTcp => "shm+tcp",
            Transport::Mpi => "mpi",
        }
    }

    /// Whether some of the bytes cross TCP connections (where CPU time spent overlapping
    /// computation with communication pays off, e.g. the 1-bit all-reduce's pipeline).
    pub fn uses_tcp(self) -> bool {
        matches!(self, Transport::Tcp | Transport::ShmTcp)
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Small codes for the error kinds a close can carry (for transports that store a word).
pub fn cause_code(kind: ErrorKind) -> u32 {
    match kind {
        ErrorKind::Timeout => 1,
        ErrorKind::PeerGone => 2,
        ErrorKind::Mismatch => 3,
        ErrorKind::Protocol => 4,
        ErrorKind::Revoked => 5,
        ErrorKind::Suspected => 6,
        _ => 0,
    }
}

/// The largest [`cause_code`].
pub const MAX_CAUSE_CODE: u32 = 6;

/// The error kind of a [`cause_code`].
pub fn cause_kind(code: u32) -> ErrorKind {
    match code {
        1 => ErrorKind::Timeout,
        2 => ErrorKind::PeerGone,
        3 => ErrorKind::Mismatch,
        4 => ErrorKind::Protocol,
        5 => ErrorKind::Revoked,
        6 => ErrorKind::Suspected,
        _ => ErrorKind::Aborted,
    }
}

/// The error a rank reports when `peer` closed its link because `culprit` failed with `kind`.
/// A close of kind [`ErrorKind::Revoked`] names the rank a shrink left out: this rank when
/// `culprit` is `me`.
pub fn cascaded_to(me: usize, peer: usize, culprit: usize, kind: ErrorKind) -> Error {
    if kind == ErrorKind::Revoked && culprit == me {
        return Error::new(
            ErrorKind::Revoked,
            format!(
                "rank {peer} left this rank out of the communicator it shrank to (this rank was failed or suspected)"
            ),
        )
        .with_peer(peer);
    }
    cascaded(peer, culprit, kind).told_by_a_close()
}

/// The error a rank reports when `peer` closed its link because `culprit` failed with `kind`.
pub fn cascaded(peer: usize, culprit: usize, kind: ErrorKind) -> Error {
    if kind == ErrorKind::Revoked {
        return Error::new(
            ErrorKind::Revoked,
            format!("rank {peer} left rank {culprit} out of the communicator it shrank to"),
        )
        .with_peer(culprit);
    }
    let how = match kind {
        ErrorKind::Timeout => format!("timed out waiting for rank {culprit}"),
        ErrorKind::PeerGone => format!("lost rank {culprit}"),
        ErrorKind::Mismatch => format!("found that rank {culprit} called a different collective"),
        ErrorKind::Suspected => {
            format!("suspected rank {culprit} (no sign of life inside oxcomm for the heartbeat lapse)")
        }
        _ => format!("failed because of rank {culprit}"),
    };
    let kind = if matches!(kind, ErrorKind::Timeout | ErrorKind::PeerGone | ErrorKind::Mismatch | ErrorKind::Suspected)
    {
        kind
    } else {
        ErrorKind::PeerGone
    };
    Error::new(kind, format!("rank {peer} aborted: it {how} (see rank {culprit}'s error)")).with_peer(culprit)
}

/// How one rank sleeps until any peer makes progress for it.
///
/// The doorbell is a counter that peers increment (ring) after making bytes or space available
/// to this rank. A waiter reads [`Doorbell::epoch`], re-checks its links, and only then calls
/// [`Doorbell::wait`] with the epoch it read, so a ring in between is never lost.
pub trait Doorbell: Send + Sync {
    /// The current count.
    fn epoch(&self) -> u32;
    /// Sleeps until the count differs from `epoch` or `until` has passed (spurious early
    /// returns are allowed). Implementations spin briefly before sleeping.
    fn wait(&self, epoch: u32, until: Instant);

    /// [`Doorbell::wait`] that also returns once `ready()` holds. Transports whose peers
    /// may publish such events without ringing unless this rank sleeps (the shared-memory
    /// direct collectives) check `ready` while spinning and again after registering as a
    /// sleeper; the default checks it once and waits.
    fn wait_checked(&self, epoch: u32, until: Instant, ready: &mut dyn FnMut() -> bool) {
        if !ready() {
            self.wait(epoch, until);
        }
    }

    /// Records that this rank is alive and inside oxcomm now (peers read it through
    /// [`Link::peer_idle`]). Called at the start of every op and every few milliseconds
    /// while waiting.
    fn heartbeat(&self) {}

    /// Records the op word (`Fingerprint::op_word`, crate-internal) of the op this rank runs,
    /// beside its heartbeat, where peers read it ([`Link::peer_last_op`]).
    fn set_op(&self, op: u64) {
        let _ = op;
    }

    /// How many control messages have arrived for this rank's links so far (wrapping), where
    /// the transport counts them: when it moved since a caller last looked, some link's
    /// [`Link::recv_ctrl`] has one. A plain load of memory only this rank reads unless a
    /// message arrives (the op path reads it twice per op). 0 where nothing counts.
    fn ctrl_count(&self) -> u32 {
        0
    }

    /// Wakes this rank's waits at once (another thread of this rank revoked the
    /// communicator): a wait returns as if a peer had rung.
    fn wake(&self) {}

    /// How many peer processes the transport has seen exit and rung this doorbell for
    /// (wrapping), where it learns of deaths as they happen (shared memory's death watcher):
    /// when it moved since a wait last looked, the wait checks its peers ([`Link::check_peer`])
    /// at once rather than at its next periodic check. A load of process-local memory, read
    /// only when a wait would sleep. 0 where nothing counts.
    fn deaths(&self) -> u32 {
        0
    }
}

// The clock lives at the values level (`crate::clock`); transports stamp heartbeats with it.
pub use crate::clock::{idle_since, monotonic_ns};
