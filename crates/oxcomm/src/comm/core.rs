//! The core of a rank: what its world communicator and every group made from it share.
//!
//! It owns the order of ops (tickets and turns: ops on one rank run one at a time in the order
//! they were issued, sync or async, whatever group they belong to), the abort-on-first-error
//! rule (the first error closes every link and every later op fails with it), the async
//! worker thread, and the op path every collective takes once validated: turn, sequence
//! number, flight recorder, agreement, body, log record.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::work::{P2pDone, Progress, Slot, Work};
use super::{CommConfig, Communicator, OpOptions};
use crate::backend::{AnyBackend, Backend, GroupView, OpEnv, P2pMsg, Route};
use crate::dtype::DType;
use crate::engine::LinkStats;
use crate::error::{Error, ErrorKind, Result};
use crate::logging::{CommsLogger, OpRecord};
use crate::wire::{Fingerprint, OpKind, FP_BYTES};

/// What this rank shares with all its communicators (the world and its groups).
pub(crate) struct Core {
    pub(super) world_rank: usize,
    pub(super) world_size: usize,
    /// What runs the ops: oxcomm's links and algorithms, or MPI.
    pub(super) backend: AnyBackend,
    pub(super) state: Mutex<State>,
    /// Ticket of the op whose turn it is; ops run strictly in ticket order.
    pub(super) turn: AtomicU64,
    /// Threads waiting for their turn sleep here (the fast path never locks).
    pub(super) turn_lock: Mutex<()>,
    pub(super) turn_cv: Condvar,
    pub(super) turn_waiters: AtomicU64,
    /// Whether `pending_p2p` may be non-empty (saves a lock per op).
    pub(super) p2p_pending: AtomicBool,
    pub(super) next_ticket: AtomicU64,
    pub(super) aborted: AtomicBool,
    pub(super) cause: Mutex<Option<Error>>,
    pub(super) config: CommConfig,
    pub(super) worker: Mutex<Option<mpsc::Sender<Job>>>,
    /// Point-to-point ops issued with `isend`/`irecv` and not yet started.
    pub(super) pending_p2p: Mutex<Vec<P2pJob>>,
    /// How many groups [`Communicator::members_group`] made for each list of world ranks.
    pub(super) member_groups: Mutex<std::collections::HashMap<Vec<usize>, u64>>,
    /// Things that must live as long as the communicator (the store, its server).
    pub(super) keep: Mutex<Vec<Box<dyn std::any::Any + Send + Sync>>>,
    /// The comms logger (records nothing unless enabled).
    pub(super) logger: CommsLogger,
    /// Set while `log_summary` runs its own collectives, which are not logged.
    pub(super) logging_paused: AtomicBool,
    /// This rank's last ops, for errors and hung jobs (issue 16).
    pub(super) flight: crate::logging::flight::FlightRecorder,
    /// Host index of every world rank (0, 1, … in order of first appearance; all 0 unless
    /// the transport said otherwise).
    pub(super) hosts: Vec<usize>,
}

/// The rank's byte totals and point-to-point sequence numbers: a point-to-point batch locks
/// them while it runs, a collective only to add the bytes it moved ([`Core::add_stats`]).
pub(super) struct State {
    pub(super) stats: LinkStats,
    /// Messages sent to / received from each world rank (sequence numbers of send/recv).
    pub(super) p2p_sent: Vec<u64>,
    pub(super) p2p_received: Vec<u64>,
}

pub(super) type Job = Box<dyn FnOnce() + Send>;

/// Advances the turn when an op ends, however it ends (unless the op ran inside a turn that
/// [`Communicator::run_async`] holds, which advances once when its closure returns).
pub(super) struct TurnGuard<'a> {
    pub(super) core: &'a Core,
    pub(super) advance: bool,
}

impl Drop for TurnGuard<'_> {
    fn drop(&mut self) {
        if !self.advance {
            return;
        }
        self.core.turn.fetch_add(1, Ordering::SeqCst);
        if self.core.turn_waiters.load(Ordering::SeqCst) > 0 {
            let _g = self.core.turn_lock.lock().unwrap_or_else(|e| e.into_inner());
            self.core.turn_cv.notify_all();
        }
    }
}

thread_local! {
    /// The core whose turn this thread holds inside [`Communicator::run_async`] (its address),
    /// or 0: ops of that core issued on this thread run inside the held turn.
    static HELD_TURN: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Ticket value meaning "this thread already holds the turn".
const HELD: u64 = u64::MAX;

impl Communicator {
    /// Whether the calling thread runs inside this communicator's [`Communicator::run_async`],
    /// where waiting on a [`Work`] of this communicator would wait for the turn it holds (a
    /// composite op then uses its blocking form).
    pub(crate) fn in_held_turn(&self) -> bool {
        self.core.holds_turn()
    }

    /// Runs one op on the backend: turn, sequence number, flight recorder, `body` (which
    /// hands the op to the backend), log record, and the abort-on-first-error rule.
    #[track_caller]
    pub(super) fn run_op<R>(
        &self,
        mut fp: Fingerprint,
        opts: &OpOptions,
        route: Route,
        body: impl FnOnce(&AnyBackend, &mut OpEnv<'_>) -> Result<R>,
    ) -> Result<R> {
        self.core.check_alive(|| self.describe(&fp))?;
        let ticket = self.core.draw_ticket();
        let caller = std::panic::Location::caller();
        let fp = &mut fp;
        let core = &*self.core;
        let timeout = opts.timeout.unwrap_or_else(|| self.timeout());
        let _turn = core.await_turn(ticket, timeout, false, || self.describe(fp))?;
        // Only the turn's holder moves a group's sequence number (every op of the group takes
        // this core's turn), so a load and a store do, without a read-modify-write.
        fp.seq = self.group.seq.load(Ordering::Relaxed);
        self.group.seq.store(fp.seq + 1, Ordering::Release);
        let logged = core.logging(fp.kind.name());
        let started = if logged { core.logger.now_ns() } else { 0 };
        core.check_alive(|| fp.to_string())?;
        // One clock reading per op: the flight record's start, and the heartbeat the backend
        // stamps from it (`OpEnv::now_ns`).
        let now_ns = crate::clock::monotonic_ns();
        let flight = core.flight.start_at(fp, route.name, None, now_ns);
        // The op counts its bytes here and they join the rank's totals once it ends, under
        // the state's lock only if it moved any: the turn already runs ops one at a time, so
        // the direct path (which moves none through links) takes no lock of this core. A
        // reader of `stats` sees the totals between ops, as it did when this lock was held
        // for the whole op.
        let mut stats = LinkStats::default();
        let mut env = OpEnv {
            fp,
            group: self.view(),
            timeout,
            max_segment_bytes: opts.max_segment_bytes.unwrap_or(core.config.max_segment_bytes),
            stats: &mut stats,
            cancel: &core.aborted,
            suspect_after: core.config.suspect_after,
            now_ns,
        };
        let result = crate::unwind::catch(core.world_rank, || body(&core.backend, &mut env));
        core.add_stats(&stats);
        if logged && result.is_ok() {
            core.record(fp, self.size(), route.name, started, caller);
        }
        if result.is_ok() {
            core.flight.finish(flight, Ok(()));
        }
        result.map_err(|e| {
            // An op that gave up because another thread revoked or aborted the communicator
            // reports why it was.
            if e.kind() == ErrorKind::Aborted && core.aborted.load(Ordering::SeqCst) {
                if let Some(cause) = core.cause.lock().unwrap_or_else(|e| e.into_inner()).clone() {
                    let e = cause.aborted(fp.to_string()).with_rank(core.world_rank);
                    core.flight.finish(flight, Err(&e));
                    return e;
                }
            }
            let e = e.with_op(fp.to_string()).with_rank(core.world_rank);
            let e = core.flight.annotate(flight, e, core.world_rank);
            core.fail(e.clone());
            e
        })
    }

    /// Runs `f` on this rank's async worker as one op in issue order: it starts after every op
    /// issued before `run_async` returned and before any op issued after it, and every op `f`
    /// issues on this communicator (or its groups) runs inside that one turn, so a composite
    /// op (several collectives, e.g. the 1-bit all-reduce) keeps its place on every rank. The
    /// handle returns what `f` returns.
    ///
    /// `f` must not wait on [`Work`] handles of this communicator (they would wait for the
    /// turn `f` holds); it may call any sync op. An error from `f` completes the handle; an
    /// error inside an op also aborts the communicator, as for sync ops.
    ///
    /// ```
    /// use oxcomm::{threads, ReduceOp};
    ///
    /// let out = threads::run(2, |comm| {
    ///     let work = comm.run_async(|c| {
    ///         let mut v = vec![c.rank() as f32; 4];
    ///         c.all_reduce(&mut v, ReduceOp::Sum)?;
    ///         c.all_reduce(&mut v, ReduceOp::Sum)?;
    ///         Ok(v)
    ///     });
    ///     work.wait()
    /// })?;
    /// assert_eq!(out[0].as_ref().unwrap(), &vec![2.0; 4]);
    /// # Ok::<(), oxcomm::Error>(())
    /// ```
    pub fn run_async<R: Send + 'static>(&self, f: impl FnOnce(&Communicator) -> Result<R> + Send + 'static) -> Work<R> {
        if self.core.holds_turn() {
            // Issued from inside a held turn (on the worker): it runs there and then.
            return Work::done(f(self), self.core.clone());
        }
        let ticket = self.core.draw_ticket();
        let (work, slot) = Work::pending(self.core.clone());
        let me = self.clone();
        self.core.submit(Box::new(move || {
            // A panic outside the op's own guard (in the closure's own code) still completes
            // the handle and aborts the communicator, so later ops do not wait their turn.
            let r =
                crate::unwind::guard(me.core.world_rank, || me.core.hold_turn(ticket, || f(&me))).unwrap_or_else(|e| {
                    me.core.fail(e.clone());
                    Err(e)
                });
            slot.complete(r);
        }));
        work
    }
}

impl Core {
    /// A rank's core running its ops on `backend` (world rank `rank` of `size`).
    pub(super) fn new(rank: usize, size: usize, backend: AnyBackend, config: CommConfig) -> Core {
        Core {
            world_rank: rank,
            world_size: size,
            backend,
            state: Mutex::new(State {
                stats: LinkStats::default(),
                p2p_sent: vec![0; size],
                p2p_received: vec![0; size],
            }),
            turn: AtomicU64::new(0),
            turn_lock: Mutex::new(()),
            turn_cv: Condvar::new(),
            turn_waiters: AtomicU64::new(0),
            p2p_pending: AtomicBool::new(false),
            next_ticket: AtomicU64::new(0),
            aborted: AtomicBool::new(false),
            cause: Mutex::new(None),
            config: config.clone(),
            worker: Mutex::new(None),
            pending_p2p: Mutex::new(Vec::new()),
            member_groups: Mutex::new(std::collections::HashMap::new()),
            keep: Mutex::new(Vec::new()),
            logger: CommsLogger::new(config.logger.clone()),
            logging_paused: AtomicBool::new(false),
            flight: crate::logging::flight::FlightRecorder::with_names(crate::backend::route_names()),
            hosts: vec![0; size],
        }
    }

    /// Whether an op named `op` is recorded now.
    pub(super) fn logging(&self, op: &str) -> bool {
        self.logger.should_record(op) && !self.logging_paused.load(Ordering::Relaxed)
    }

    /// Records a finished op (message size by DeepSpeed's convention: see `logging`).
    pub(super) fn record(
        &self,
        fp: &Fingerprint,
        group_size: usize,
        algorithm: &'static str,
        start_ns: u64,
        caller: &'static std::panic::Location<'static>,
    ) {
        let elem = fp.dtype.map_or(0, |d| d.size()) as u64;
        // Fingerprint counts already follow DeepSpeed's message-size convention: the whole
        // tensor (all_reduce, broadcast, reduce), one rank's input (all_gather, gather), the
        // full input (reduce_scatter, all_to_all), the output buffer (scatter).
        let (op, count, bytes) = (fp.kind.name(), fp.count as usize, fp.count * elem);
        let caller = self.logger.config().debug.then_some(caller);
        self.push_record(op, fp.dtype, count, bytes, group_size, fp.seq, algorithm, start_ns, caller);
    }

    /// Appends one record that ends now.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push_record(
        &self,
        op: &'static str,
        dtype: Option<DType>,
        count: usize,
        bytes: u64,
        group_size: usize,
        seq: u64,
        algorithm: &'static str,
        start_ns: u64,
        caller: Option<&'static std::panic::Location<'static>>,
    ) {
        let end = self.logger.now_ns();
        self.logger.record(OpRecord {
            op,
            dtype,
            count,
            bytes,
            group_size,
            seq,
            algorithm,
            transport: self.backend.transport().as_str(),
            start_ns,
            latency_ns: end.saturating_sub(start_ns),
            caller,
        });
    }

    /// Adds one op's byte counts to the rank's totals (no lock when the op moved none).
    pub(super) fn add_stats(&self, op: &LinkStats) {
        if *op == LinkStats::default() {
            return;
        }
        let mut state = self.lock_state();
        state.stats.bytes_sent += op.bytes_sent;
        state.stats.bytes_received += op.bytes_received;
        state.stats.bytes_read_directly += op.bytes_read_directly;
    }

    pub(super) fn lock_state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn check_alive(&self, op: impl FnOnce() -> String) -> Result<()> {
        if self.aborted.load(Ordering::SeqCst) {
            let cause = self.cause.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let cause = cause.unwrap_or_else(|| Error::new(ErrorKind::Aborted, "aborted"));
            return Err(cause.aborted(op()).with_rank(self.world_rank));
        }
        Ok(())
    }

    /// Records the first error and revokes the communicator: every peer is told (its ops
    /// fail), this rank's waiting ops end, and every later op fails with the first error.
    pub(super) fn fail(&self, err: Error) {
        {
            let mut cause = self.cause.lock().unwrap_or_else(|e| e.into_inner());
            if cause.is_none() {
                *cause = Some(err);
            }
        }
        self.aborted.store(true, Ordering::SeqCst);
        {
            // Ops waiting their turn fail now instead of at their deadline.
            let _g = self.turn_lock.lock().unwrap_or_else(|e| e.into_inner());
            self.turn_cv.notify_all();
        }
        let cause = self.cause.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(cause) = cause {
            self.backend.revoke(&cause);
        }
    }

    /// Waits for `ticket`'s turn (at most `timeout`); fails at once if the communicator is
    /// aborted, unless `even_if_aborted` (the fault-tolerance ops, which run on a revoked
    /// communicator).
    pub(super) fn await_turn(
        &self,
        ticket: u64,
        timeout: Duration,
        even_if_aborted: bool,
        op: impl FnOnce() -> String,
    ) -> Result<TurnGuard<'_>> {
        if ticket == HELD {
            return Ok(TurnGuard { core: self, advance: false });
        }
        if self.turn.load(Ordering::SeqCst) == ticket {
            return Ok(TurnGuard { core: self, advance: true });
        }
        let deadline = Instant::now() + timeout;
        let mut op_name = Some(op);
        let mut g = self.turn_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.turn_waiters.fetch_add(1, Ordering::SeqCst);
        let result = loop {
            if self.turn.load(Ordering::SeqCst) == ticket {
                break Ok(TurnGuard { core: self, advance: true });
            }
            if !even_if_aborted {
                if let Err(e) = self.check_alive(|| op_name.take().map_or_else(String::new, |f| f())) {
                    break Err(e);
                }
            }
            let now = Instant::now();
            if now >= deadline {
                break Err(Error::new(
                    ErrorKind::Timeout,
                    format!("timed out after {timeout:?} waiting for this rank's earlier async ops to finish"),
                )
                .with_op(op_name.take().map_or_else(String::new, |f| f()))
                .with_rank(self.world_rank));
            }
            g = self.turn_cv.wait_timeout(g, deadline - now).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
        };
        self.turn_waiters.fetch_sub(1, Ordering::SeqCst);
        result
    }

    /// The ticket of the op about to run: [`HELD`] inside a turn this thread holds (see
    /// [`Communicator::run_async`]), or a fresh one after starting pending `isend`/`irecv`s.
    pub(super) fn draw_ticket(self: &Arc<Self>) -> u64 {
        if self.holds_turn() {
            return HELD;
        }
        self.flush_p2p();
        self.next_ticket.fetch_add(1, Ordering::SeqCst)
    }

    /// Whether this thread holds this core's turn (inside [`Communicator::run_async`]).
    pub(super) fn holds_turn(&self) -> bool {
        HELD_TURN.with(|h| h.get()) == self as *const Core as usize
    }

    /// Waits for `ticket`'s turn, then runs `f` holding it: every op `f` issues on this core
    /// runs inside the turn, which advances once when `f` returns (or unwinds).
    pub(super) fn hold_turn<R>(&self, ticket: u64, f: impl FnOnce() -> Result<R>) -> Result<R> {
        /// Restores the previous holder when `f` ends, however it ends.
        struct Restore(usize);
        impl Drop for Restore {
            fn drop(&mut self) {
                HELD_TURN.with(|h| h.set(self.0));
            }
        }
        let _turn = self.await_turn(ticket, self.config.timeout, false, || "an async op".to_string())?;
        let _restore = Restore(HELD_TURN.with(|h| h.replace(self as *const Core as usize)));
        f()
    }

    pub(super) fn submit(&self, job: Job) {
        let mut w = self.worker.lock().unwrap_or_else(|e| e.into_inner());
        if w.is_none() {
            let (tx, rx) = mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name(format!("oxcomm-async-{}", self.world_rank))
                .spawn(move || {
                    for job in rx {
                        // Jobs catch their panics (`spawn`); this keeps the worker alive for
                        // the jobs queued behind one that did not.
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                    }
                })
                .expect("spawn the async worker thread");
            *w = Some(tx);
        }
        let _ = w.as_ref().expect("worker started").send(job);
    }
}

impl Core {
    /// Starts every pending `isend`/`irecv` as one batch on the async worker.
    pub(super) fn flush_p2p(self: &Arc<Self>) {
        // A plain load first: the swap (a read-modify-write) only when something is pending.
        if !self.p2p_pending.load(Ordering::SeqCst) || !self.p2p_pending.swap(false, Ordering::SeqCst) {
            return;
        }
        let jobs: Vec<P2pJob> = std::mem::take(&mut *self.pending_p2p.lock().unwrap_or_else(|e| e.into_inner()));
        if jobs.is_empty() {
            return;
        }
        let ticket = self.next_ticket.fetch_add(1, Ordering::SeqCst);
        // Each job carries its group's timeout; the batch waits as long as the most patient.
        let timeout = jobs.iter().map(|j| j.timeout).max().filter(|t| !t.is_zero()).unwrap_or(self.config.timeout);
        let core = self.clone();
        self.submit(Box::new(move || {
            let (mut msgs, slots): (Vec<P2pMsg>, Vec<_>) = jobs.into_iter().map(|j| (j.msg, j.slot)).unzip();
            let result = core.run_p2p(ticket, &mut msgs, timeout);
            for (msg, slot) in msgs.into_iter().zip(slots) {
                if let Some(slot) = slot {
                    slot.complete(match &result {
                        Ok(()) => Ok((msg.bytes, msg.peer)),
                        Err(e) => Err(e.clone()),
                    });
                }
            }
        }));
    }

    /// Runs point-to-point messages together under `ticket`, on the backend.
    ///
    /// A receive from any source runs alone, after every send and every receive issued
    /// before it (sends may start early: that changes no match, and a peer that waits for one
    /// of them before it sends what this rank waits for cannot deadlock the batch); the
    /// receives issued after it run after it, since it may take the message they would.
    pub(super) fn run_p2p(&self, ticket: u64, msgs: &mut [P2pMsg], timeout: Duration) -> Result<()> {
        let first = msgs.first().map(|m| m.fp.to_string()).unwrap_or_default();
        let _turn = self.await_turn(ticket, timeout, false, || first.clone())?;
        self.check_alive(|| first.clone())?;
        if !msgs.iter().any(P2pMsg::is_any_source) {
            return self.run_p2p_batch(msgs, &first, timeout);
        }
        // Order: sends and the receives before the first any-source receive, that receive,
        // the receives before the next one, and so on.
        let mut any_before = 0u64;
        let keys: Vec<u64> = msgs
            .iter()
            .map(|m| match (m.is_send, m.is_any_source()) {
                (true, _) => 0,
                (false, false) => 2 * any_before,
                (false, true) => {
                    any_before += 1;
                    2 * any_before - 1
                }
            })
            .collect();
        let mut order: Vec<usize> = (0..msgs.len()).collect();
        order.sort_by_key(|&i| keys[i]);
        permute(msgs, &order);
        let mut result = Ok(());
        let mut at = 0;
        while at < msgs.len() && result.is_ok() {
            let key = keys[order[at]];
            let len = order[at..].iter().take_while(|&&i| keys[i] == key).count();
            result = self.run_p2p_batch(&mut msgs[at..at + len], &first, timeout);
            at += len;
        }
        let mut back = vec![0; msgs.len()];
        for (pos, &i) in order.iter().enumerate() {
            back[i] = pos;
        }
        // `msgs[pos]` holds message `order[pos]`: move each back to its index.
        permute(msgs, &back);
        result
    }

    /// Runs one batch of point-to-point messages on the backend (inside the caller's turn):
    /// stamps the per-pair sequence numbers in issue order, and counts the message a receive
    /// from any source took.
    fn run_p2p_batch(&self, msgs: &mut [P2pMsg], first: &str, timeout: Duration) -> Result<()> {
        let mut state = self.lock_state();
        for msg in msgs.iter_mut() {
            if msg.is_any_source() {
                for (peer, seq) in msg.any_of.iter_mut() {
                    *seq = state.p2p_received[*peer];
                }
                continue;
            }
            let counter = if msg.is_send { &mut state.p2p_sent[msg.peer] } else { &mut state.p2p_received[msg.peer] };
            msg.fp.seq = *counter;
            *counter += 1;
            msg.header = msg.fp.encode();
        }
        let members: Vec<usize> = (0..self.world_size).collect();
        let now_ns = crate::clock::monotonic_ns();
        let flight = msgs.first().map(|m| {
            let peer = (!m.is_any_source()).then_some(m.peer);
            self.flight.start_at(&m.fp, "p2p", peer, now_ns)
        });
        let fp = msgs.first().map_or_else(|| Fingerprint::new(OpKind::P2p, 0, 0), |m| m.fp);
        let mut env = OpEnv {
            fp: &fp,
            group: GroupView { id: 0, rank: self.world_rank, members: &members, layout: None },
            timeout,
            max_segment_bytes: self.config.max_segment_bytes,
            stats: &mut state.stats,
            cancel: &self.aborted,
            suspect_after: self.config.suspect_after,
            now_ns,
        };
        let result = crate::unwind::catch(self.world_rank, || self.backend.p2p(&mut env, msgs));
        if result.is_ok() {
            for msg in msgs.iter().filter(|m| m.is_any_source()) {
                state.p2p_received[msg.peer] += 1;
            }
        }
        drop(state);
        if let (Some(id), Ok(())) = (flight, &result) {
            self.flight.finish(id, Ok(()));
        }
        result.map_err(|e| {
            let e = e.with_op(first.to_string()).with_rank(self.world_rank);
            let e = match flight {
                Some(id) => self.flight.annotate(id, e, self.world_rank),
                None => e,
            };
            self.fail(e.clone());
            e
        })
    }
}

/// Reorders `items` so that position `k` holds what was at `order[k]` (`order` is a
/// permutation), by following its cycles.
fn permute<T>(items: &mut [T], order: &[usize]) {
    let mut done = vec![false; items.len()];
    for start in 0..items.len() {
        if done[start] {
            continue;
        }
        // Walk the cycle: position `k` takes the item at `order[k]`.
        let mut k = start;
        loop {
            done[k] = true;
            let from = order[k];
            if from == start {
                break;
            }
            items.swap(k, from);
            k = from;
        }
    }
}

/// A pending point-to-point op: its message, the slot of its [`Work`] handle (which gets
/// the payload and the sender's world rank) and its group's timeout.
pub(super) struct P2pJob {
    pub(super) msg: P2pMsg,
    slot: Option<Arc<Slot<P2pDone>>>,
    timeout: Duration,
}

impl P2pJob {
    pub(super) fn send(peer: usize, bytes: Vec<u8>, fp: Fingerprint, slot: Option<Arc<Slot<P2pDone>>>) -> P2pJob {
        let msg = P2pMsg { peer, is_send: true, bytes, fp, header: [0; FP_BYTES], any_of: Vec::new() };
        P2pJob { msg, slot, timeout: Duration::ZERO }
    }

    pub(super) fn recv(peer: usize, bytes: Vec<u8>, fp: Fingerprint, slot: Option<Arc<Slot<P2pDone>>>) -> P2pJob {
        let msg = P2pMsg { peer, is_send: false, bytes, fp, header: [0; FP_BYTES], any_of: Vec::new() };
        P2pJob { msg, slot, timeout: Duration::ZERO }
    }

    /// A receive from whichever of `peers` (world ranks) sends first a message `fp` describes.
    pub(super) fn recv_any(
        peers: Vec<usize>,
        bytes: Vec<u8>,
        fp: Fingerprint,
        slot: Option<Arc<Slot<P2pDone>>>,
    ) -> P2pJob {
        let any_of = peers.into_iter().map(|p| (p, 0)).collect();
        let msg = P2pMsg { peer: usize::MAX, is_send: false, bytes, fp, header: [0; FP_BYTES], any_of };
        P2pJob { msg, slot, timeout: Duration::ZERO }
    }

    /// This job, waited for in its batch up to `timeout` (its group's; see [`Core::flush_p2p`]).
    pub(super) fn within(mut self, timeout: Duration) -> P2pJob {
        self.timeout = timeout;
        self
    }
}

impl Progress for Core {
    fn start_pending(self: Arc<Self>) {
        self.flush_p2p();
    }

    fn op_timeout(&self) -> Duration {
        self.config.timeout
    }

    fn world_rank(&self) -> usize {
        self.world_rank
    }
}
