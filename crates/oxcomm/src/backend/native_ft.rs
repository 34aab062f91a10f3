//! The native backend's fault tolerance: revoking a communicator, the agreement among its
//! survivors, and shrinking it to them on the links it already has.
//!
//! What it builds on, from the links ([`Link`]'s fault-tolerance methods): a *control
//! channel* beside each byte stream, *epoch marks* that let the two ends of a link drop what
//! an abandoned op left in the stream, and the heartbeats peers read. The protocol's messages
//! and the agreement itself are in [`crate::algorithms::agreement`]; this file moves them and
//! runs the failure detector.
//!
//! # Revoking
//!
//! The first error of an op (or [`crate::Communicator::revoke`]) revokes the communicator:
//! this rank marks the end of the current epoch on every link (it will send nothing more of
//! it) and sends every peer a [`Ctrl::Revoke`] naming the rank to blame. A peer's op sees the
//! message whenever it would wait (the doorbell's control count moves) and at its end (an op
//! that completed from bytes its peers wrote before they gave up fails instead: what a frozen
//! rank finds when it resumes), fails naming that rank, and passes the revocation on, so every
//! member learns it even when the revoker dies halfway through telling them. Nothing is
//! closed: [`crate::Communicator::agree`] and [`crate::Communicator::shrink`] use the same
//! links.
//!
//! # Failures
//!
//! A member is *failed* once this rank's detector finds it (its link says it is gone:
//! process exit, closed connection) or suspects it (it showed no sign of life for the
//! heartbeat lapse while this rank waited), or once a peer says so. Failures are passed on
//! ([`Ctrl::Failed`]) and never taken back: a member that was only frozen finds itself left
//! out when it comes back.
//!
//! # Shrinking
//!
//! After the agreement (every survivor holds the same failed set), each survivor's link
//! starts the next epoch in both directions (what is left of the old one in the stream is
//! dropped), and the links to the survivors go, renumbered in the old order, to a new backend
//! with its own sequence numbers; the links to the failed members are closed, telling them
//! they were left out. No store, no new connection. The new backend has no direct
//! shared-memory path (its workspaces assume the whole world): its ops run over the links.

use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use super::native::{NativeBackend, State};
use super::{AnyBackend, OpEnv};
use crate::algorithms::agreement::{AgreeMsg, Agreement, Ctrl, Outcome};
use crate::error::{Error, ErrorKind, Result};
use crate::transport::{cascaded, cause_code, cause_kind, Link};
use crate::wire::Fingerprint;

/// How often the waits of the agreement and of the shrink send heartbeats (as an op's waits
/// do, `engine::PEER_CHECK_INTERVAL`).
const CHECK_EVERY: Duration = Duration::from_millis(50);

/// The longest the agreement sleeps between two looks at its peers' liveness. It runs once
/// per failure, so it polls: a member that waited [`CHECK_EVERY`] to see a death it could
/// see at once made every shrink take two such steps (`Communicator.shrink()` took 100.7 to
/// 101.0 ms for 2 survivors on one host).
const AGREE_POLL: Duration = Duration::from_millis(2);

/// How long a member that has decided keeps trying to hand its last messages to live peers
/// whose control channel is full.
const LINGER: Duration = Duration::from_secs(1);

/// What a shrink hands the communicator: the survivors' backend and who is who.
pub(crate) struct Shrunk {
    /// The backend over the survivors' links.
    pub backend: AnyBackend,
    /// This rank among the survivors.
    pub rank: usize,
    /// The old world ranks of the survivors, in their new order.
    pub survivors: Vec<usize>,
}

/// Why the communicator was revoked, as the members tell each other.
#[derive(Debug, Clone)]
struct Revocation {
    /// The rank that revoked first (a revocation passed on keeps it).
    origin: usize,
    /// The rank to blame (for a fault) or the one that revoked it (for a revoke or an abort),
    /// as `origin` saw it.
    culprit: usize,
    /// `transport::cause_code` of the error kind.
    code: u8,
    /// The op `origin` was running (may be empty).
    op: String,
    /// What happened, in words.
    reason: String,
}

impl Revocation {
    /// The revocation of a [`Ctrl::Revoke`] from peer `from` (its fields).
    fn told(from: usize, origin: u32, culprit: Option<u32>, code: u8, op: String, reason: String) -> Revocation {
        Revocation { origin: origin as usize, culprit: culprit.map_or(from, |c| c as usize), code, op, reason }
    }

    fn from_error(cause: &Error, rank: usize) -> Revocation {
        let blames_peer = matches!(
            cause.kind(),
            ErrorKind::Timeout
                | ErrorKind::PeerGone
                | ErrorKind::Mismatch
                | ErrorKind::Protocol
                | ErrorKind::Revoked
                | ErrorKind::Suspected
        );
        let culprit = if blames_peer { cause.peer().unwrap_or(rank) } else { rank };
        let op = cause.op().unwrap_or_default().to_string();
        Revocation { origin: rank, culprit, code: cause_code(cause.kind()) as u8, op, reason: cause.to_string() }
    }

    /// The error this rank (`me`, running `mine` if it runs an op) gets when peer `from` says
    /// the communicator is revoked.
    fn error(&self, me: usize, from: usize, mine: Option<&Fingerprint>) -> Error {
        let kind = cause_kind(u32::from(self.code));
        let c = self.culprit;
        match kind {
            ErrorKind::Mismatch => self.mismatch(me, from, mine),
            ErrorKind::Revoked => {
                Error::new(ErrorKind::Revoked, format!("rank {c} revoked the communicator ({})", self.reason))
                    .with_peer(c)
            }
            ErrorKind::Timeout | ErrorKind::PeerGone | ErrorKind::Protocol | ErrorKind::Suspected if c != from => {
                cascaded(from, c, kind)
            }
            ErrorKind::Timeout | ErrorKind::PeerGone | ErrorKind::Protocol | ErrorKind::Suspected => {
                Error::new(ErrorKind::PeerGone, format!("rank {from} is gone (it aborted after failing)"))
                    .with_peer(from)
            }
            _ => Error::new(
                ErrorKind::Revoked,
                format!("the communicator was revoked: rank {c} aborted ({})", self.reason),
            )
            .with_peer(c),
        }
    }

    /// [`Revocation::error`] of a mismatch. It reaches the other ranks as a revocation that
    /// overtakes the bytes that would have shown it to them, and `origin` only knows that it
    /// and `culprit` differ: a third rank tells which of the two is the odd one by its own op.
    /// When `origin`'s op differs from this rank's (or `origin` blamed this rank), `origin` is
    /// the one named; otherwise `culprit` is. The revoker's words name both collectives.
    fn mismatch(&self, me: usize, from: usize, mine: Option<&Fingerprint>) -> Error {
        let (o, c) = (self.origin, self.culprit);
        let told = if from == o { String::new() } else { format!(", as rank {from} passed on") };
        let mine = mine.map(Fingerprint::to_string);
        let origin_differs = mine.as_ref().is_some_and(|m| *m != self.op);
        if o != me && !self.op.is_empty() && (c == me || origin_differs) {
            let this = mine.unwrap_or_else(|| "another".to_string());
            return Error::new(
                ErrorKind::Mismatch,
                format!(
                    "ranks called different collectives: rank {o} called {}, this rank called {this} (rank {o}: {}{told})",
                    self.op, self.reason
                ),
            )
            .with_peer(o);
        }
        if c != from && c != me {
            let e = cascaded(from, c, ErrorKind::Mismatch);
            return Error::new(ErrorKind::Mismatch, format!("{} ({})", e.message(), self.reason)).with_peer(c);
        }
        Error::new(
            ErrorKind::Mismatch,
            format!("rank {from} found that ranks called different collectives ({})", self.reason),
        )
        .with_peer(from)
    }
}

/// What the native backend keeps for fault tolerance (in its state, locked per op).
pub(crate) struct FtState {
    /// The epoch of the links: 0 for a world built from new links, one more per shrink.
    pub(super) epoch: u32,
    /// The doorbell's control count when the control channels were last read.
    pub(super) ctrl_seen: u32,
    /// Members (world ranks) known to have failed.
    pub(super) failed: BTreeSet<usize>,
    /// Why the communicator was revoked, once it is.
    revoked: Option<Revocation>,
    /// The error of this rank once a peer declared it failed (it is left out for good).
    left_out: Option<Error>,
    /// Whether this rank has told its peers (and marked its links' epochs).
    told: bool,
    /// The peer this rank's own error named when it revoked (see [`FtState::close_cause`]).
    blamed: Option<usize>,
    /// A revocation that came from a peer already past the op this rank was running (it
    /// completed that op, and sent its part before revoking): the op goes on, and the next
    /// one fails with this error at its start (see [`FtState::take_deferred`]).
    deferred: Option<Error>,
    /// Agreements this rank has started in this epoch.
    instance: u32,
    /// Messages of agreements this rank has not started yet: (sender, instance, message).
    early: Vec<(usize, u32, AgreeMsg)>,
    /// Messages of later epochs (peers already on the shrunk communicator), for it, encoded
    /// (their ranks are the shrunk communicator's).
    later: Vec<(usize, Vec<u8>)>,
    /// Messages this backend was handed for its epoch before it existed (see `later`).
    stash: Vec<(usize, Vec<u8>)>,
    /// Per world rank: control messages its link has not taken yet, in order.
    outbox: Vec<VecDeque<Vec<u8>>>,
    /// Per world rank: an epoch whose mark its link has not taken yet (it goes first).
    ending: Vec<Option<u32>>,
    buf: Vec<u8>,
}

impl FtState {
    /// Nothing failed or revoked, epoch 0; `ctrl_seen` is the doorbell's count now.
    pub(super) fn new(ctrl_seen: u32) -> FtState {
        FtState {
            epoch: 0,
            ctrl_seen,
            failed: BTreeSet::new(),
            revoked: None,
            left_out: None,
            told: false,
            blamed: None,
            deferred: None,
            instance: 0,
            early: Vec::new(),
            later: Vec::new(),
            stash: Vec::new(),
            outbox: Vec::new(),
            ending: Vec::new(),
            buf: Vec::new(),
        }
    }

    fn size_for(&mut self, n: usize) {
        if self.outbox.len() < n {
            self.outbox.resize_with(n, VecDeque::new);
            self.ending.resize(n, None);
        }
    }

    /// Queues `msg` for world rank `to`.
    fn queue(&mut self, to: usize, msg: &Ctrl) -> Result<()> {
        let bytes = msg.encode()?;
        self.outbox[to].push_back(bytes);
        Ok(())
    }

    /// Hands the links what they will take: each link's epoch mark first, then its control
    /// messages in order. A link that fails drops its queue (its peer is gone; the detector
    /// tells). A link without a control channel (one an application wrote) is closed instead,
    /// naming the rank to blame, as every link was before revocation existed: its peer
    /// notices that.
    fn flush(&mut self, links: &mut [Option<Box<dyn Link>>]) {
        self.size_for(links.len());
        for (p, slot) in links.iter_mut().enumerate() {
            let Some(link) = slot.as_mut() else {
                self.outbox[p].clear();
                continue;
            };
            let mut failed = None;
            if let Some(e) = self.ending[p] {
                match link.end_epoch(e) {
                    Ok(true) => self.ending[p] = None,
                    Ok(false) => continue,
                    Err(err) => failed = Some(err),
                }
            }
            while failed.is_none() {
                let Some(msg) = self.outbox[p].front() else { break };
                match link.send_ctrl(msg) {
                    Ok(true) => {
                        self.outbox[p].pop_front();
                    }
                    Ok(false) => break,
                    Err(err) => failed = Some(err),
                }
            }
            if let Some(err) = failed {
                self.ending[p] = None;
                self.outbox[p].clear();
                if err.kind() == ErrorKind::Unsupported {
                    if let Some(mut link) = slot.take() {
                        link.close(self.close_cause());
                    }
                }
            }
        }
    }

    /// Reads every control message that has arrived and hands those of this epoch to `take`
    /// (sender's world rank, message); keeps those of later epochs for the shrunk
    /// communicator and drops older ones. A message that does not decode fails, naming its
    /// sender.
    fn receive(
        &mut self,
        links: &mut [Option<Box<dyn Link>>],
        mut take: impl FnMut(&mut FtState, usize, Ctrl) -> Result<()>,
    ) -> Result<()> {
        let n = links.len();
        let bad = |p: usize, e: Error| {
            Error::protocol(format!("rank {p} sent a bad control message: {}", e.message())).with_peer(p)
        };
        for (from, bytes) in std::mem::take(&mut self.stash) {
            let msg = Ctrl::decode(&bytes, n).map_err(|e| bad(from, e))?;
            take(self, from, msg)?;
        }
        let mut buf = std::mem::take(&mut self.buf);
        for (p, link) in links.iter_mut().enumerate() {
            let Some(link) = link.as_mut() else { continue };
            while let Ok(true) = link.recv_ctrl(&mut buf) {
                match Ctrl::epoch_of(&buf).map_err(|e| bad(p, e))?.cmp(&self.epoch) {
                    std::cmp::Ordering::Less => {}
                    std::cmp::Ordering::Greater => self.later.push((p, buf.clone())),
                    std::cmp::Ordering::Equal => {
                        let msg = Ctrl::decode(&buf, n).map_err(|e| bad(p, e))?;
                        take(self, p, msg)?;
                    }
                }
            }
        }
        self.buf = buf;
        Ok(())
    }

    /// Takes a revocation told by `from` to this rank (`rank`); the error of this rank's ops.
    /// A revocation that blames this rank for a death or a silence means the others gave up on
    /// it: it is left out.
    fn revoked_by(&mut self, rank: usize, from: usize, rev: Revocation, mine: Option<&Fingerprint>) -> Error {
        let kind = cause_kind(u32::from(rev.code));
        let err =
            if matches!(kind, ErrorKind::PeerGone | ErrorKind::Timeout | ErrorKind::Suspected) && rev.culprit == rank {
                self.declared_failed(from, Some(&rev.reason))
            } else {
                if matches!(kind, ErrorKind::PeerGone | ErrorKind::Timeout | ErrorKind::Suspected) {
                    self.failed.insert(rev.culprit);
                }
                rev.error(rank, from, mine)
            };
        self.revoked.get_or_insert(rev);
        err
    }

    /// Peer `by` closed its link telling this rank it was left out (found at the end of a
    /// slow op); the error of its ops from now on.
    pub(super) fn left_out_by(&mut self, by: usize) -> Error {
        self.declared_failed(by, None)
    }

    /// Peer `by` declared this rank failed: it is left out for good; the error of its ops.
    fn declared_failed(&mut self, by: usize, why: Option<&str>) -> Error {
        self.left_out.get_or_insert_with(|| left_out(by, why)).clone()
    }

    /// The fault-tolerance hook of an op ([`crate::engine::FtHook`]): hands out what waits
    /// to go, reads the control channels, and fails when the communicator is revoked or this
    /// rank was declared failed. Agreement messages are kept for the agreement.
    ///
    /// `mine`: the op this rank runs. A revocation from a peer that failed in a later world
    /// op does not fail a world op (that peer completed it, and its part of it is in the
    /// stream ahead of the revocation); the next op fails instead ([`FtState::take_deferred`]).
    pub(super) fn poll(
        &mut self,
        rank: usize,
        epoch: u32,
        mine: &Fingerprint,
        links: &mut [Option<Box<dyn Link>>],
    ) -> Result<()> {
        debug_assert_eq!(epoch, self.epoch);
        let seq = (mine.group == 0).then_some(mine.seq);
        self.flush(links);
        let mut found: Option<Error> = None;
        self.receive(links, |ft, from, msg| {
            match msg {
                Ctrl::Revoke { origin, culprit, code, op, reason, .. } => {
                    let later = seq.is_some_and(|seq| world_seq(&op).is_some_and(|theirs| theirs > seq));
                    let rev = Revocation::told(from, origin, culprit, code, op, reason);
                    let e = ft.revoked_by(rank, from, rev, Some(mine));
                    if later && ft.left_out.is_none() {
                        ft.deferred.get_or_insert(e);
                    } else {
                        found.get_or_insert(e);
                    }
                }
                Ctrl::Failed { rank: r, .. } if r as usize == rank => {
                    // Being left out says more than whatever came before it.
                    found = Some(ft.declared_failed(from, None));
                }
                Ctrl::Failed { rank: r, .. } => {
                    ft.failed.insert(r as usize);
                }
                Ctrl::Agree { instance, msg, .. } => ft.early.push((from, instance, msg)),
            }
            Ok(())
        })?;
        match (found, &self.left_out) {
            (_, Some(e)) => Err(e.clone()),
            (Some(e), None) => Err(e),
            (None, None) => Ok(()),
        }
    }

    /// The revocation a peer past this rank's last op sent while it ran (see
    /// [`FtState::poll`]): the error of the next op, at its start.
    pub(super) fn take_deferred(&mut self) -> Option<Error> {
        self.deferred.take()
    }

    /// Revokes: records why (unless a peer's revocation came first, which is passed on as it
    /// came), marks the end of this epoch on every link and tells every peer. Once.
    fn revoke(&mut self, rank: usize, links: &mut [Option<Box<dyn Link>>], cause: &Error) {
        self.size_for(links.len());
        if matches!(cause.kind(), ErrorKind::PeerGone | ErrorKind::Timeout | ErrorKind::Suspected) {
            if let Some(p) = cause.peer().filter(|p| *p != rank && *p < links.len()) {
                self.failed.insert(p);
            }
        }
        if self.told {
            return;
        }
        self.told = true;
        self.blamed = cause.peer();
        let rev = self.revoked.get_or_insert_with(|| Revocation::from_error(cause, rank)).clone();
        let msg = Ctrl::Revoke {
            epoch: self.epoch,
            origin: rev.origin as u32,
            culprit: Some(rev.culprit as u32),
            code: rev.code,
            op: rev.op,
            reason: rev.reason,
        };
        for p in (0..links.len()).filter(|&p| p != rank) {
            self.ending[p] = Some(self.epoch + 1);
            // A message that cannot be encoded is a bug; the mark still tells the peer.
            let _ = self.queue(p, &msg);
        }
        self.flush(links);
    }

    /// When a revoked backend goes away (its process ends after the error): hands the links
    /// what still waits to go, then closes each naming the rank to blame. On TCP that is an
    /// abort frame at the end of the stream: a peer that finds the connection closed before
    /// it has read the revocation (queued behind data it has not taken) learns from it who
    /// failed, as from an abort before revocation existed, instead of blaming this rank.
    /// Best effort: a link whose socket stays full closes without it.
    pub(super) fn farewell(&mut self, links: &mut [Option<Box<dyn Link>>]) {
        let culprit = self.close_cause();
        if culprit.is_none() {
            return;
        }
        self.flush(links);
        for mut link in links.iter_mut().filter_map(Option::take) {
            link.close(culprit);
        }
    }

    /// What this rank's links say when it closes them once revoked: the rank to blame and
    /// why. After a mismatch, the rank this rank's own error named (a revocation heard from a
    /// peer names the peer's culprit, who may be the one rank whose op was right).
    fn close_cause(&self) -> Option<(usize, ErrorKind)> {
        let rev = self.revoked.as_ref()?;
        let kind = cause_kind(u32::from(rev.code));
        let culprit = match (kind, self.blamed) {
            (ErrorKind::Mismatch, Some(b)) => b,
            _ => rev.culprit,
        };
        Some((culprit, kind))
    }
}

/// The sequence number of the world op an error's op text names (`Fingerprint`'s display:
/// `"<kind> #<seq> (...)"`, with `group <id>` for a group's op); `None` for a group's op or
/// no op.
fn world_seq(op: &str) -> Option<u64> {
    if op.contains("group ") {
        return None;
    }
    let rest = op.split_once(" #")?.1;
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

/// The error of a rank that peer `by` declared failed (`why`: the peer's own error, if it
/// said).
fn left_out(by: usize, why: Option<&str>) -> Error {
    let why = why.map(|w| format!(" ({w})")).unwrap_or_default();
    Error::new(
        ErrorKind::Revoked,
        format!(
            "rank {by} declared this rank failed{why}: the others go on without it (it was dead to them: \
             frozen, or stuck outside oxcomm, for longer than they waited), and its ops of this communicator fail"
        ),
    )
    .with_peer(by)
}

impl NativeBackend {
    /// [`super::Backend::revoke`].
    pub(super) fn ft_revoke(&self, cause: &Error) {
        // An op of this rank that waits (on another thread) gives up at once: the
        // communicator's abort flag is set already, and this wakes it.
        self.bell.wake();
        let mut state = self.lock();
        let State { links, ft, .. } = &mut *state;
        ft.revoke(self.rank, links, cause);
    }

    /// [`super::Backend::agree`]; see [`crate::algorithms::agreement`].
    pub(super) fn ft_agree(&self, env: &mut OpEnv<'_>, flag: u64) -> Result<(u64, Vec<usize>)> {
        let mut state = self.lock();
        let State { links, ft, .. } = &mut *state;
        let (me, n) = (self.rank, links.len());
        ft.size_for(n);
        let instance = ft.instance;
        ft.instance += 1;
        if let Some(e) = &ft.left_out {
            return Err(e.clone());
        }
        let known: Vec<usize> = ft.failed.iter().copied().collect();
        let mut agreement = Agreement::new(me, n, flag, &known);
        for (from, _, msg) in extract(&mut ft.early, |(_, i, _)| *i == instance) {
            agreement.message(from, msg);
        }
        let start = Instant::now();
        let deadline = start + env.timeout;
        let op = env.fp.op_word();
        let mut checked = start;
        loop {
            let bell_epoch = self.bell.epoch();
            for f in agreement.take_failures() {
                ft.failed.insert(f as usize);
                for p in (0..n).filter(|&p| p != me) {
                    ft.queue(p, &Ctrl::Failed { epoch: ft.epoch, rank: f })?;
                }
            }
            for (to, msg) in agreement.take_out() {
                ft.queue(to, &Ctrl::Agree { epoch: ft.epoch, instance, msg })?;
            }
            ft.flush(links);
            if ft.told || ft.revoked.is_some() {
                // The streams hold what the abandoned ops left: drop it, so that the control
                // frames behind it (TCP) come through.
                let next = ft.epoch + 1;
                let live: Vec<usize> = (0..n).filter(|&p| p != me && !agreement.is_failed(p)).collect();
                for p in live {
                    if let Some(link) = links[p].as_mut() {
                        if let Err(e) = link.begin_epoch(next) {
                            if e.kind() == ErrorKind::Revoked {
                                // Its link was closed telling this rank it is left out.
                                return Err(ft.declared_failed(p, None));
                            }
                            agreement.failed(p, None);
                        }
                    }
                }
            }
            ft.receive(links, |ft, from, msg| {
                match msg {
                    Ctrl::Agree { instance: i, msg, .. } if i == instance => agreement.message(from, msg),
                    Ctrl::Agree { instance: i, msg, .. } => {
                        if i > instance {
                            ft.early.push((from, i, msg));
                        }
                    }
                    Ctrl::Failed { rank, .. } => {
                        if rank as usize != me {
                            ft.failed.insert(rank as usize);
                        }
                        agreement.failed(rank as usize, Some(from));
                    }
                    Ctrl::Revoke { origin, culprit, code, op, reason, .. } => {
                        ft.revoked_by(me, from, Revocation::told(from, origin, culprit, code, op, reason), None);
                    }
                }
                Ok(())
            })?;
            if let Some(e) = &ft.left_out {
                return Err(e.clone());
            }
            match agreement.outcome() {
                Outcome::Running => {}
                Outcome::Decided(value) => {
                    let value = value.clone();
                    for &f in &value.failed {
                        ft.failed.insert(f as usize);
                    }
                    // Hand over the decision (and anything else queued) before leaving: a peer
                    // may still wait for it.
                    for (to, msg) in agreement.take_out() {
                        ft.queue(to, &Ctrl::Agree { epoch: ft.epoch, instance, msg })?;
                    }
                    self.linger(ft, links, |p| !agreement.is_failed(p));
                    return Ok((value.flag, value.failed.iter().map(|&f| f as usize).collect()));
                }
                Outcome::LeftOut { by } => return Err(ft.declared_failed(*by as usize, None)),
            }
            let now = Instant::now();
            if now >= deadline {
                let c = agreement.coordinator();
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "timed out after {:?} in the agreement (its coordinator is rank {c}; ranks known to have failed: {:?})",
                        env.timeout, ft.failed
                    ),
                )
                .with_peer(c));
            }
            // Liveness at every wake (a death decides who is in the agreement); heartbeats
            // every CHECK_EVERY.
            let beat = now.duration_since(checked) >= CHECK_EVERY;
            if beat {
                checked = now;
                self.bell.heartbeat();
                self.bell.set_op(op);
            }
            {
                let live: Vec<usize> = (0..n).filter(|&p| p != me && !agreement.is_failed(p)).collect();
                for p in live {
                    let Some(link) = links[p].as_mut() else {
                        agreement.failed(p, None);
                        continue;
                    };
                    if beat {
                        link.beat(op);
                    }
                    if let Err(e) = link.check_alive() {
                        if e.kind() == ErrorKind::Revoked {
                            // Its link was closed telling this rank it is left out.
                            return Err(ft.declared_failed(p, None));
                        }
                        agreement.failed(p, None);
                        continue;
                    }
                    let lapse = env.suspect_after;
                    if !lapse.is_zero()
                        && now.duration_since(start) >= lapse
                        && link.peer_idle().is_some_and(|idle| idle >= lapse)
                    {
                        agreement.failed(p, None);
                    }
                }
            }
            self.bell.wait(bell_epoch, deadline.min(now + AGREE_POLL));
        }
    }

    /// After deciding: keeps handing the queued messages to the links of the members `live`
    /// says are alive, for at most [`LINGER`] (a control channel is full only while its peer
    /// does not read; every member reads until it decides).
    fn linger(&self, ft: &mut FtState, links: &mut [Option<Box<dyn Link>>], live: impl Fn(usize) -> bool) {
        let until = Instant::now() + LINGER;
        loop {
            let bell_epoch = self.bell.epoch();
            ft.flush(links);
            let waiting = (0..links.len()).any(|p| live(p) && links[p].is_some() && !ft.outbox[p].is_empty());
            let now = Instant::now();
            if !waiting || now >= until {
                return;
            }
            self.bell.wait(bell_epoch, until.min(now + Duration::from_millis(5)));
        }
    }

    /// [`super::Backend::shrink`]: agrees on the failed members, starts the next epoch on
    /// every survivor's link and hands those links to a new backend; see the module docs.
    pub(super) fn ft_shrink(&self, env: &mut OpEnv<'_>) -> Result<Shrunk> {
        let (_, failed) = self.ft_agree(env, u64::MAX)?;
        let mut state = self.lock();
        let State { links, ft, .. } = &mut *state;
        let n = links.len();
        let survivors: Vec<usize> = (0..n).filter(|r| !failed.contains(r)).collect();
        let rank = survivors.iter().position(|&r| r == self.rank).ok_or_else(|| left_out(self.rank, None))?;
        let next = ft.epoch + 1;
        let deadline = Instant::now() + env.timeout;
        // Both directions of every survivor's link move to the next epoch: this rank marked
        // its side when it revoked; the peer's mark arrives behind whatever it had sent.
        let mut pending: Vec<usize> = survivors.iter().copied().filter(|&p| p != self.rank).collect();
        let mut checked = Instant::now();
        loop {
            let bell_epoch = self.bell.epoch();
            ft.flush(links);
            pending.retain(|&p| {
                let Some(link) = links[p].as_mut() else { return false };
                let ended = ft.ending[p].is_none();
                // A survivor that dies now: its link goes to the new communicator all the
                // same, whose first op finds it gone.
                match link.begin_epoch(next) {
                    Ok(begun) => !(begun && ended),
                    Err(_) => false,
                }
            });
            if pending.is_empty() {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("timed out after {:?} waiting for ranks {pending:?} to end their old epoch", env.timeout),
                )
                .with_peer(pending[0]));
            }
            if now.duration_since(checked) >= CHECK_EVERY {
                checked = now;
                self.bell.heartbeat();
                pending.retain(|&p| links[p].as_mut().is_some_and(|l| l.check_alive().is_ok()));
            }
            self.bell.wait(bell_epoch, deadline.min(now + Duration::from_millis(5)));
        }
        let size = survivors.len();
        let mut kept: Vec<Option<Box<dyn Link>>> = Vec::with_capacity(size);
        for (i, &p) in survivors.iter().enumerate() {
            if p == self.rank {
                kept.push(None);
                continue;
            }
            let mut link = links[p].take().ok_or_else(|| {
                Error::new(ErrorKind::PeerGone, format!("no link to rank {p}, a survivor")).with_peer(p)
            })?;
            link.renumber(rank, i, size);
            kept.push(Some(link));
        }
        for &f in &failed {
            if let Some(mut link) = links[f].take() {
                // Tells the member it was left out (a frozen one reads it when it resumes).
                link.close(Some((f, ErrorKind::Revoked)));
            }
        }
        let new_rank_of = |old: usize| survivors.iter().position(|&s| s == old);
        let later: Vec<(usize, Vec<u8>)> = std::mem::take(&mut ft.later)
            .into_iter()
            .filter(|(_, m)| Ctrl::epoch_of(m).is_ok_and(|e| e == next))
            .filter_map(|(from, m)| new_rank_of(from).map(|r| (r, m)))
            .collect();
        let backend = NativeBackend::new(
            rank,
            kept,
            self.bell.clone(),
            self.transport,
            #[cfg(target_os = "linux")]
            None,
        );
        {
            let mut st = backend.lock();
            st.ft.epoch = next;
            if !later.is_empty() {
                // Read them at the first op's end, as if they had just arrived.
                st.ft.ctrl_seen = st.ft.ctrl_seen.wrapping_sub(1);
                st.ft.stash = later;
            }
        }
        Ok(Shrunk { backend: AnyBackend::Native(backend), rank, survivors })
    }
}

/// Removes the items `pick` chooses from `items`, in order, and returns them.
fn extract<T>(items: &mut Vec<T>, pick: impl Fn(&T) -> bool) -> Vec<T> {
    let (taken, kept) = std::mem::take(items).into_iter().partition(|t| pick(t));
    *items = kept;
    taken
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::reduce::ReduceOp;
    use crate::wire::OpKind;

    fn all_reduce(count: u64) -> Fingerprint {
        Fingerprint {
            dtype: Some(DType::F32),
            op: Some(ReduceOp::Sum),
            count,
            ..Fingerprint::new(OpKind::AllReduce, 1, 0)
        }
    }

    /// Rank 2 ran 999 elements where ranks 0, 1 and 3 ran 1000; rank 0 told rank 2 first, so
    /// rank 2 revoked blaming rank 0 (the one rank whose op it saw).
    fn odd_one_revoked() -> Revocation {
        let (odd, right) = (all_reduce(999), all_reduce(1000));
        let cause = Error::new(
            ErrorKind::Mismatch,
            format!("ranks called different collectives: rank 0 called {right}, this rank called {odd}"),
        )
        .with_peer(0)
        .with_op(odd.to_string());
        Revocation::from_error(&cause, 2)
    }

    #[test]
    fn a_third_rank_names_the_odd_one_whoever_tells_it() {
        let rev = odd_one_revoked();
        assert_eq!((rev.origin, rev.culprit), (2, 0));
        let mine = all_reduce(1000);
        // Heard from the odd one, passed on by rank 1 or by rank 0 (the one it blamed).
        for (me, from) in [(1, 2), (3, 2), (3, 1), (0, 2), (0, 1)] {
            let e = rev.error(me, from, Some(&mine));
            assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
            assert_eq!(e.peer(), Some(2), "rank {me} told by {from}: {e}");
            assert!(e.message().contains("999") && e.message().contains("1000"), "{e}");
        }
    }

    #[test]
    fn a_third_rank_running_the_odd_ones_op_names_the_other() {
        // Rank 2 and this rank ran the same op: the rank rank 2 blamed is the odd one here.
        let rev = odd_one_revoked();
        let e = rev.error(1, 2, Some(&all_reduce(999)));
        assert_eq!(e.peer(), Some(0), "{e}");
        // Without its own op (an agreement of a revoked communicator), as the revoker said.
        assert_eq!(rev.error(1, 2, None).peer(), Some(0));
    }

    #[test]
    fn links_close_naming_whom_this_rank_blamed() {
        let mut ft = FtState::new(0);
        ft.revoked = Some(odd_one_revoked());
        let mine = Error::new(ErrorKind::Mismatch, "rank 2 called all_reduce #1 (f32 × 999)").with_peer(2);
        ft.revoke(1, &mut [None, None, None, None], &mine);
        assert_eq!(ft.close_cause(), Some((2, ErrorKind::Mismatch)));
    }
}
