//! The [`Communicator`]: rank, size, links to peers, op sequence numbers, fingerprint checks,
//! deadlines, sub-groups, async work, and the abort-on-first-error rule.
//!
//! Every op goes through the same path: validate arguments (nothing is sent for a bad
//! argument), wait for this op's turn (ops on one rank run in the order they were issued,
//! sync or async, whichever group they belong to), stamp the next sequence number of the
//! group, run the agreement phase (every rank compares fingerprints before any buffer is
//! touched), run the algorithm [`crate::algorithms::plan`] chose, and log. Any failure while
//! communicating aborts the communicator: its links are closed (so peers notice at once) and
//! every later op fails with the original cause.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::algorithms::hierarchical::HostLayout;
use crate::algorithms::{self, plan, Algorithm, ReduceBuffers};
use crate::dtype::{as_bytes, as_bytes_mut, DType, Element};
use crate::engine::{Ctx, LinkStats, Xfer};
use crate::error::{Error, ErrorKind, Result};
use crate::logging::{CommsLogger, LoggerConfig, OpRecord};
use crate::reduce::{self, ReduceOp};
use crate::transport::{Doorbell, Link};
use crate::wire::{Fingerprint, OpKind, FP_BYTES};

/// Environment variable: default deadline of every blocking op, in seconds.
pub const ENV_TIMEOUT: &str = "OXCOMM_TIMEOUT";
/// Default of [`ENV_TIMEOUT`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Default largest number of bytes one transfer call moves.
pub const DEFAULT_MAX_SEGMENT_BYTES: usize = 1 << 20;

/// Settings of a communicator. `Default` reads [`ENV_TIMEOUT`].
#[derive(Debug, Clone)]
pub struct CommConfig {
    /// Deadline of every blocking op unless [`OpOptions::timeout`] overrides it, counted
    /// from the first time the op has to wait for a peer.
    pub timeout: Duration,
    /// Largest number of bytes one transfer call moves; larger messages go in segments.
    pub max_segment_bytes: usize,
    /// Use this algorithm for every op it applies to (tests and benchmarks); `None` lets
    /// [`plan`] choose.
    pub algorithm: Option<Algorithm>,
    /// The comms logger's settings (default: from `OXCOMM_COMMS_LOGGER*`, off if unset).
    pub logger: LoggerConfig,
}

impl Default for CommConfig {
    fn default() -> Self {
        let timeout = std::env::var(ENV_TIMEOUT)
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .unwrap_or(DEFAULT_TIMEOUT);
        let logger = LoggerConfig::from_env().unwrap_or_else(|e| {
            tracing::warn!(target: "oxcomm::comms", "ignoring the comms logger settings: {e}");
            LoggerConfig::default()
        });
        CommConfig { timeout, max_segment_bytes: DEFAULT_MAX_SEGMENT_BYTES, algorithm: None, logger }
    }
}

/// Per-op knobs; `Default` means "use the communicator's settings".
#[derive(Debug, Clone, Default)]
pub struct OpOptions {
    /// Deadline of this op (counted from its first wait for a peer).
    pub timeout: Option<Duration>,
    /// Force an algorithm; an error if it does not apply to the op.
    pub algorithm: Option<Algorithm>,
    /// Segment size of this op.
    pub max_segment_bytes: Option<usize>,
}

/// What this rank shares with all its communicators (the world and its groups).
pub(crate) struct Core {
    world_rank: usize,
    world_size: usize,
    bell: Arc<dyn Doorbell>,
    state: Mutex<State>,
    /// Ticket of the op whose turn it is; ops run strictly in ticket order.
    turn: AtomicU64,
    /// Threads waiting for their turn sleep here (the fast path never locks).
    turn_lock: Mutex<()>,
    turn_cv: Condvar,
    turn_waiters: AtomicU64,
    /// Whether `pending_p2p` may be non-empty (saves a lock per op).
    p2p_pending: AtomicBool,
    next_ticket: AtomicU64,
    aborted: AtomicBool,
    cause: Mutex<Option<Error>>,
    config: CommConfig,
    transport: &'static str,
    worker: Mutex<Option<mpsc::Sender<Job>>>,
    /// Point-to-point ops issued with `isend`/`irecv` and not yet started.
    pending_p2p: Mutex<Vec<P2pJob>>,
    /// How many groups [`Communicator::members_group`] made for each list of world ranks.
    member_groups: Mutex<std::collections::HashMap<Vec<usize>, u64>>,
    /// Things that must live as long as the communicator (the store, its server).
    keep: Mutex<Vec<Box<dyn std::any::Any + Send + Sync>>>,
    /// The comms logger (records nothing unless enabled).
    logger: CommsLogger,
    /// Set while `log_summary` runs its own collectives, which are not logged.
    logging_paused: AtomicBool,
    /// This rank's last ops, for errors and hung jobs (issue 16).
    flight: crate::logging::flight::FlightRecorder,
    /// Every rank's shared-memory workspace, when all ranks share this host.
    #[cfg(target_os = "linux")]
    direct: Option<crate::transport::shm::direct::ShmDirect>,
    /// The MPI backend: when set, every op runs through it instead of links and algorithms.
    #[cfg(feature = "mpi")]
    mpi: Option<Arc<crate::backend::mpi::MpiBackend>>,
    /// Host index of every world rank (0, 1, … in order of first appearance; all 0 unless
    /// the transport said otherwise).
    hosts: Vec<usize>,
}

struct State {
    links: Vec<Option<Box<dyn Link>>>,
    stats: LinkStats,
    scratch: Vec<u64>,
    /// Messages sent to / received from each world rank (sequence numbers of send/recv).
    p2p_sent: Vec<u64>,
    p2p_received: Vec<u64>,
    #[cfg(target_os = "linux")]
    direct_state: crate::algorithms::shm_direct::DirectState,
}

type Job = Box<dyn FnOnce() + Send>;

/// One rank's handle on a group of ranks. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Communicator {
    core: Arc<Core>,
    group: Arc<Group>,
}

struct Group {
    id: u64,
    /// World rank of each group rank.
    members: Vec<usize>,
    rank: usize,
    seq: AtomicU64,
    /// How the group spans hosts, when hierarchical algorithms apply.
    layout: Option<HostLayout>,
}

impl Group {
    fn new(id: u64, members: Vec<usize>, rank: usize, hosts: &[usize]) -> Group {
        let host_of: Vec<usize> = members.iter().map(|w| hosts[*w]).collect();
        let layout = HostLayout::new(&host_of, rank);
        Group { id, members, rank, seq: AtomicU64::new(0), layout }
    }
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("world_rank", &self.core.world_rank)
            .field("transport", &self.core.transport)
            .finish()
    }
}

/// Advances the turn when an op ends, however it ends (unless the op ran inside a turn that
/// [`Communicator::run_async`] holds, which advances once when its closure returns).
struct TurnGuard<'a> {
    core: &'a Core,
    advance: bool,
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

impl Communicator {
    /// Builds a world communicator over ready links. `links[p]` is the link to world rank `p`
    /// (`None` at `rank`); `bell` is this rank's doorbell that those links ring. Transports
    /// and [`crate::threads::run`] call this; applications normally do not.
    pub fn from_links(
        rank: usize,
        links: Vec<Option<Box<dyn Link>>>,
        bell: Arc<dyn Doorbell>,
        config: CommConfig,
        transport: &'static str,
    ) -> Result<Communicator> {
        Communicator::from_parts(rank, links, bell, config, transport, None)
    }

    /// [`Communicator::from_links`] plus the shared-memory workspaces for direct collectives.
    pub(crate) fn from_parts(
        rank: usize,
        links: Vec<Option<Box<dyn Link>>>,
        bell: Arc<dyn Doorbell>,
        config: CommConfig,
        transport: &'static str,
        #[cfg(target_os = "linux")] direct: Option<crate::transport::shm::direct::ShmDirect>,
        #[cfg(not(target_os = "linux"))] _direct: Option<()>,
    ) -> Result<Communicator> {
        let size = links.len();
        if rank >= size {
            return Err(Error::invalid(format!("rank {rank} out of range for {size} links")));
        }
        for (p, l) in links.iter().enumerate() {
            if l.is_some() == (p == rank) {
                return Err(Error::invalid(format!("link table of rank {rank} is wrong at {p}")));
            }
        }
        Ok(Communicator::build(rank, links, bell, config, transport, direct))
    }

    /// Assembles a communicator (no validation).
    fn build(
        rank: usize,
        links: Vec<Option<Box<dyn Link>>>,
        bell: Arc<dyn Doorbell>,
        config: CommConfig,
        transport: &'static str,
        #[cfg(target_os = "linux")] direct: Option<crate::transport::shm::direct::ShmDirect>,
        #[cfg(not(target_os = "linux"))] _direct: Option<()>,
    ) -> Communicator {
        let size = links.len();
        bell.heartbeat();
        let core = Arc::new(Core {
            world_rank: rank,
            world_size: size,
            bell,
            state: Mutex::new(State {
                links,
                stats: LinkStats::default(),
                scratch: Vec::new(),
                p2p_sent: vec![0; size],
                p2p_received: vec![0; size],
                #[cfg(target_os = "linux")]
                direct_state: Default::default(),
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
            transport,
            worker: Mutex::new(None),
            pending_p2p: Mutex::new(Vec::new()),
            member_groups: Mutex::new(std::collections::HashMap::new()),
            keep: Mutex::new(Vec::new()),
            logger: CommsLogger::new(config.logger.clone()),
            logging_paused: AtomicBool::new(false),
            flight: Default::default(),
            #[cfg(target_os = "linux")]
            direct,
            #[cfg(feature = "mpi")]
            mpi: None,
            hosts: vec![0; size],
        });
        let group = Arc::new(Group::new(0, (0..size).collect(), rank, &core.hosts));
        Communicator { core, group }
    }

    /// Records which host each world rank is on (`host_of[r]`: any label, equal for ranks on
    /// one host), so groups that span hosts evenly use hierarchical algorithms. Only on a
    /// fresh world communicator (transports and [`crate::threads::run_on_hosts`] call it).
    pub(crate) fn with_hosts<L: PartialEq>(mut self, host_of: &[L]) -> Result<Communicator> {
        let size = self.core.world_size;
        if host_of.len() != size {
            return Err(Error::invalid(format!("{} host labels for {size} ranks", host_of.len())));
        }
        // Host j is the j-th distinct label in rank order.
        let mut labels: Vec<&L> = Vec::new();
        let mut hosts = Vec::with_capacity(size);
        for label in host_of {
            let j = labels.iter().position(|l| *l == label).unwrap_or_else(|| {
                labels.push(label);
                labels.len() - 1
            });
            hosts.push(j);
        }
        let core = Arc::get_mut(&mut self.core).ok_or_else(|| Error::invalid("with_hosts on a shared communicator"))?;
        core.hosts = hosts;
        self.group = Arc::new(Group::new(0, (0..size).collect(), core.world_rank, &core.hosts));
        Ok(self)
    }

    /// A world communicator whose ops all run through the MPI backend (no links).
    #[cfg(feature = "mpi")]
    pub(crate) fn from_mpi(
        rank: usize,
        size: usize,
        backend: Arc<crate::backend::mpi::MpiBackend>,
        config: CommConfig,
    ) -> Communicator {
        let links = (0..size).map(|_| None).collect();
        let bell = Arc::new(crate::transport::threads::ThreadDoorbell::default());
        let mut comm = Communicator::build(rank, links, bell, config, "mpi", None);
        Arc::get_mut(&mut comm.core).expect("a fresh communicator is not shared").mpi = Some(backend);
        comm
    }

    /// The MPI backend, when this communicator runs over MPI.
    #[cfg(feature = "mpi")]
    pub(crate) fn mpi(&self) -> Option<&Arc<crate::backend::mpi::MpiBackend>> {
        self.core.mpi.as_ref()
    }

    /// The group's id (0 for the world): the same on every member.
    #[cfg(feature = "mpi")]
    pub(crate) fn group_id(&self) -> u64 {
        self.group.id
    }

    /// Runs one op of a backend: the same turn, sequence number and abort-on-error rule as
    /// [`Communicator::collective`], with `body` doing all the communicating (its own
    /// fingerprint check included) and counting its bytes.
    #[cfg(feature = "mpi")]
    pub(crate) fn run_backend<R>(
        &self,
        mut fp: Fingerprint,
        opts: &OpOptions,
        body: impl FnOnce(&Fingerprint, &mut LinkStats) -> Result<R>,
    ) -> Result<R> {
        self.core.check_alive(|| self.describe(&fp))?;
        let ticket = self.core.draw_ticket();
        let timeout = opts.timeout.unwrap_or(self.core.config.timeout);
        let _turn = self.core.await_turn(ticket, timeout, || self.describe(&fp))?;
        fp.seq = self.group.seq.fetch_add(1, Ordering::SeqCst);
        self.core.check_alive(|| fp.to_string())?;
        let mut state = self.core.lock_state();
        let result = body(&fp, &mut state.stats);
        drop(state);
        result.map_err(|e| {
            let e = e.with_op(fp.to_string()).with_rank(self.core.world_rank);
            self.core.fail(e.clone());
            e
        })
    }

    /// This rank within the communicator's group.
    pub fn rank(&self) -> usize {
        self.group.rank
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.group.members.len()
    }

    /// This rank in the world.
    pub fn world_rank(&self) -> usize {
        self.core.world_rank
    }

    /// Number of ranks in the world.
    pub fn world_size(&self) -> usize {
        self.core.world_size
    }

    /// World ranks of the group's members, in group-rank order.
    pub fn members(&self) -> &[usize] {
        &self.group.members
    }

    /// The transport's name (`threads`, `shm`, `tcp`).
    pub fn transport(&self) -> &'static str {
        self.core.transport
    }

    /// The host of each group rank: hosts are numbered 0, 1, … in order of their first
    /// world rank; ranks that share a host (shared memory between them) share a number. On
    /// thread ranks every rank is on host 0 unless built with [`crate::threads::run_on_hosts`].
    pub fn hosts(&self) -> Vec<usize> {
        self.group.members.iter().map(|w| self.core.hosts[*w]).collect()
    }

    /// How the group spans hosts when it does so evenly (the same number, at least 2, of its
    /// ranks on each of at least 2 hosts); hierarchical algorithms run then.
    pub fn host_layout(&self) -> Option<&HostLayout> {
        self.group.layout.as_ref()
    }

    /// The communicator's settings.
    pub fn config(&self) -> &CommConfig {
        &self.core.config
    }

    /// Bytes this rank has handed to and taken from its links so far (all groups).
    pub fn stats(&self) -> LinkStats {
        self.core.lock_state().stats
    }

    /// The error that aborted this communicator, if any.
    pub fn abort_cause(&self) -> Option<Error> {
        self.core.cause.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// This rank's last ops as JSON Lines, oldest first (the flight recorder: see
    /// [`crate::logging::flight`]); callable while an op hangs on another thread.
    pub fn flight_record(&self) -> String {
        self.core.flight.to_jsonl(self.core.world_rank)
    }

    /// The comms logger: per-op records when enabled by [`CommConfig::logger`] or
    /// `OXCOMM_COMMS_LOGGER=1`.
    pub fn logger(&self) -> &CommsLogger {
        &self.core.logger
    }

    /// Records an op that is built from other collectives (the compressed ones) under its own
    /// name; `start_ns` comes from [`CommsLogger::now_ns`] taken when it began. The ops it ran
    /// inside are recorded too, under their names.
    pub fn log_op(&self, op: &'static str, dtype: Option<DType>, count: usize, bytes: u64, start_ns: u64) {
        if self.core.logging(op) {
            let seq = self.group.seq.load(Ordering::SeqCst);
            self.core.push_record(op, dtype, count, bytes, self.size(), seq, "composite", start_ns, None);
        }
    }

    /// DeepSpeed's `log_summary`: the summary table of this rank's records (and, with
    /// `show_straggler`, the straggler breakdown: latencies minus the element-wise minimum
    /// across the group's ranks, which runs collectives and so must be called by every rank).
    /// The collectives it runs are not logged.
    pub fn log_summary(&self, show_straggler: bool) -> Result<String> {
        let mut out = self.core.logger.summary().table();
        if show_straggler {
            self.core.logging_paused.store(true, Ordering::Relaxed);
            let r = self.straggler_table();
            self.core.logging_paused.store(false, Ordering::Relaxed);
            out.push('\n');
            out.push_str(&r?);
        }
        Ok(out)
    }

    /// The straggler breakdown. Ranks may have logged different (op, size) sets (groups, or
    /// different histories): keys are matched by hash across ranks, and for each key the
    /// element-wise minimum runs over the ranks that logged it, on the shortest common prefix.
    fn straggler_table(&self) -> Result<String> {
        const PAD: i64 = i64::MIN;
        let input = self.core.logger.straggler_input();
        let hash = |name: &str, bytes: u64| {
            let mut h = DefaultHasher::new();
            (name, bytes).hash(&mut h);
            (h.finish() >> 1) as i64
        };
        let mine: Vec<i64> = input.iter().map(|(name, bytes, _)| hash(name, *bytes)).collect();
        let mut most = [mine.len() as i64];
        self.all_reduce(&mut most, ReduceOp::Max)?;
        // Peers' counts are input: at most 2^20 keys and 2^24 samples in all (issue 16).
        let bad = |what: String| Error::protocol(format!("straggler table: a peer sent {what}")).with_rank(self.rank());
        let most =
            usize::try_from(most[0]).ok().filter(|m| *m <= 1 << 20).ok_or_else(|| bad(format!("{} keys", most[0])))?;
        let mut padded = mine.clone();
        padded.resize(most, PAD);
        let mut all = vec![0i64; padded.len() * self.size()];
        self.all_gather(&padded, &mut all)?;
        let mut keys: Vec<i64> = all.into_iter().filter(|k| *k != PAD).collect();
        keys.sort_unstable();
        keys.dedup();
        let position = |k: i64| mine.iter().position(|m| *m == k);
        let mut lengths: Vec<i64> =
            keys.iter().map(|k| position(*k).map_or(i64::MAX, |i| input[i].2.len() as i64)).collect();
        self.all_reduce(&mut lengths, ReduceOp::Min)?;
        let samples = lengths.iter().map(|l| u64::try_from(*l).unwrap_or(u64::MAX)).fold(0, u64::saturating_add);
        if samples > 1 << 24 {
            return Err(bad(format!("{samples} samples")));
        }
        let mut flat = Vec::with_capacity(lengths.iter().map(|l| *l as usize).sum());
        for (k, len) in keys.iter().zip(&lengths) {
            let lat = position(*k).map(|i| &input[i].2);
            for j in 0..*len as usize {
                flat.push(lat.map_or(i64::MAX, |l| l[j] as i64));
            }
        }
        self.all_reduce(&mut flat, ReduceOp::Min)?;
        let mut mins = Vec::new();
        let mut at = 0;
        for (k, len) in keys.iter().zip(&lengths) {
            let len = *len as usize;
            if let Some(i) = position(*k) {
                let (name, bytes, _) = &input[i];
                mins.push((name.clone(), *bytes, flat[at..at + len].iter().map(|v| *v as u64).collect()));
            }
            at += len;
        }
        Ok(self.core.logger.straggler_table(&mins))
    }

    /// Keeps `things` alive as long as this communicator (e.g. the rendezvous store).
    pub(crate) fn keep_alive(&self, things: Vec<Box<dyn std::any::Any + Send + Sync>>) {
        self.core.keep.lock().unwrap_or_else(|e| e.into_inner()).extend(things);
    }

    /// Aborts the communicator now: links close (peers notice) and every later op fails.
    pub fn abort(&self, reason: &str) {
        self.core.fail(
            Error::new(ErrorKind::Aborted, format!("aborted by the application: {reason}"))
                .with_rank(self.core.world_rank),
        );
    }

    // ---------------------------------------------------------------- the op path

    fn fingerprint(&self, kind: OpKind) -> Fingerprint {
        Fingerprint::new(kind, 0, self.group.id)
    }

    fn with_dtype<T: Element>(mut fp: Fingerprint, count: usize) -> Fingerprint {
        fp.dtype = Some(T::DTYPE);
        fp.count = count as u64;
        fp
    }

    fn describe(&self, fp: &Fingerprint) -> String {
        let mut fp = *fp;
        fp.seq = self.group.seq.load(Ordering::SeqCst);
        fp.to_string()
    }

    fn check_root(&self, root: usize, fp: &Fingerprint) -> Result<()> {
        if root >= self.size() {
            return Err(self.arg_error(fp, format!("root {root} out of range for a group of {}", self.size())));
        }
        Ok(())
    }

    /// The root's buffer of a gather or scatter: it must be there with `want` elements on the
    /// root; other ranks' are ignored (`None`).
    fn root_buffer<B>(
        &self,
        fp: &Fingerprint,
        root: usize,
        buf: Option<B>,
        len: impl Fn(&B) -> usize,
        want: usize,
        what: &str,
    ) -> Result<Option<B>> {
        if self.rank() != root {
            return Ok(None);
        }
        match buf {
            Some(b) if len(&b) == want => Ok(Some(b)),
            Some(b) => Err(self.arg_error(fp, format!("{what} has {} elements, expected {want}", len(&b)))),
            None => Err(self.arg_error(fp, format!("the root must pass an {what} buffer"))),
        }
    }

    fn arg_error(&self, fp: &Fingerprint, msg: impl Into<String>) -> Error {
        Error::invalid(msg).with_op(self.describe(fp)).with_rank(self.core.world_rank)
    }

    fn algorithm(&self, fp: &Fingerprint, opts: &OpOptions, bytes: usize, count: usize) -> Result<Algorithm> {
        let forced = match (opts.algorithm, self.core.config.algorithm) {
            (Some(a), _) => Some(a),
            (None, Some(a)) if plan::candidates(fp.kind).contains(&a) => Some(a),
            _ => None,
        };
        plan::choose(fp.kind, bytes, count, self.size(), forced, self.has_direct(), self.group.layout.is_some())
            .map_err(|e| e.with_op(self.describe(fp)).with_rank(self.core.world_rank))
    }

    /// Whether this communicator can use the direct shared-memory path.
    fn has_direct(&self) -> bool {
        #[cfg(target_os = "linux")]
        return self.group.id == 0 && self.core.direct.is_some();
        #[cfg(not(target_os = "linux"))]
        false
    }

    /// Runs one collective: turn, sequence number, agreement (unless `agree` is false), body.
    #[track_caller]
    fn collective<R>(
        &self,
        mut fp: Fingerprint,
        opts: &OpOptions,
        agree: bool,
        algorithm: &'static str,
        body: impl FnOnce(&mut Ctx<'_>, &Fingerprint) -> Result<R>,
    ) -> Result<R> {
        self.core.check_alive(|| self.describe(&fp))?;
        let ticket = self.core.draw_ticket();
        let caller = std::panic::Location::caller();
        self.run_ticket(ticket, &mut fp, opts, agree, (algorithm, caller), body)
    }

    fn run_ticket<R>(
        &self,
        ticket: u64,
        fp: &mut Fingerprint,
        opts: &OpOptions,
        agree: bool,
        (algorithm, caller): (&'static str, &'static std::panic::Location<'static>),
        body: impl FnOnce(&mut Ctx<'_>, &Fingerprint) -> Result<R>,
    ) -> Result<R> {
        let timeout = opts.timeout.unwrap_or(self.core.config.timeout);
        let _turn = self.core.await_turn(ticket, timeout, || self.describe(fp))?;
        fp.seq = self.group.seq.fetch_add(1, Ordering::SeqCst);
        let logged = self.core.logging(fp.kind.name());
        let started = if logged { self.core.logger.now_ns() } else { 0 };
        self.core.check_alive(|| fp.to_string())?;
        let flight = self.core.flight.start(fp, algorithm, None);
        let mut state = self.core.lock_state();
        #[cfg(target_os = "linux")]
        let State { links, stats, scratch, direct_state, .. } = &mut *state;
        #[cfg(not(target_os = "linux"))]
        let State { links, stats, scratch, .. } = &mut *state;
        let mut ctx = Ctx::new(
            self.group.rank,
            &self.group.members,
            links,
            &*self.core.bell,
            timeout,
            opts.max_segment_bytes.unwrap_or(self.core.config.max_segment_bytes),
            stats,
            scratch,
        );
        #[cfg(target_os = "linux")]
        if self.group.id == 0 {
            ctx.direct =
                self.core.direct.as_ref().map(|shm| crate::algorithms::shm_direct::Direct { shm, state: direct_state });
        }
        let result = crate::unwind::catch(self.core.world_rank, || {
            if agree {
                algorithms::star::agree(&mut ctx, fp)?;
            }
            body(&mut ctx, fp)
        });
        drop(state);
        if logged && result.is_ok() {
            self.core.record(fp, self.size(), algorithm, started, caller);
        }
        if result.is_ok() {
            self.core.flight.finish(flight, Ok(()));
        }
        result.map_err(|e| {
            let e = e.with_op(fp.to_string()).with_rank(self.core.world_rank);
            let e = self.core.flight.annotate(flight, e, self.core.world_rank);
            self.core.fail(e.clone());
            e
        })
    }

    // ---------------------------------------------------------------- collectives

    /// Reduces `buf` across the group with `op`; every rank gets the result in `buf`.
    #[track_caller]
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_with(buf, op, &OpOptions::default())
    }

    /// [`Communicator::all_reduce`] with per-op options.
    #[track_caller]
    pub fn all_reduce_with<T: Element>(&self, buf: &mut [T], op: ReduceOp, opts: &OpOptions) -> Result<()> {
        self.all_reduce_buffers(ReduceBuffers::InPlace(buf), op, opts)
    }

    /// Reduces every rank's `input` with `op` into every rank's `output` (NCCL's out-of-place
    /// `ncclAllReduce(sendbuff, recvbuff)`); `input` is only read. Both have the same length.
    ///
    /// The shared-memory direct algorithm reads `input` where it would read the buffer in place,
    /// so this costs no more than [`Communicator::all_reduce`]; the others copy `input` into
    /// `output` and reduce that in place. Ranks may mix this and `all_reduce` in one op. On
    /// error `output` holds garbage. Lengths that differ are [`ErrorKind::InvalidArgument`]
    /// before any communication.
    ///
    /// ```
    /// use oxcomm::ReduceOp;
    /// let out = oxcomm::threads::run(2, |comm| {
    ///     let grads = vec![comm.rank() as f32 + 1.0; 4];
    ///     let mut sum = vec![0.0; 4];
    ///     comm.all_reduce_into(&grads, &mut sum, ReduceOp::Sum)?;
    ///     Ok::<_, oxcomm::Error>((grads, sum))
    /// })
    /// .unwrap();
    /// let (grads, sum) = out[1].as_ref().unwrap();
    /// assert_eq!((grads[0], sum[0]), (2.0, 3.0));
    /// ```
    #[track_caller]
    pub fn all_reduce_into<T: Element>(&self, input: &[T], output: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_into_with(input, output, op, &OpOptions::default())
    }

    /// [`Communicator::all_reduce_into`] with per-op options.
    #[track_caller]
    pub fn all_reduce_into_with<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        self.all_reduce_buffers(ReduceBuffers::Apart { input, output }, op, opts)
    }

    #[track_caller]
    fn all_reduce_buffers<T: Element>(&self, io: ReduceBuffers<'_, T>, op: ReduceOp, opts: &OpOptions) -> Result<()> {
        let count = io.len();
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::AllReduce), count);
        fp.op = Some(op);
        if let ReduceBuffers::Apart { input, output } = &io {
            if input.len() != output.len() {
                let msg = format!("output has {} elements, input {}: they must be equal", output.len(), input.len());
                return Err(self.arg_error(&fp, msg));
            }
        }
        reduce::check(op, T::DTYPE).map_err(|e| e.with_op(self.describe(&fp)).with_rank(self.core.world_rank))?;
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.all_reduce(self, fp, io.into_in_place(), op, opts);
        }
        let algo = self.algorithm(&fp, opts, count * std::mem::size_of::<T>(), count)?;
        let n = self.size();
        let layout = self.group.layout.as_ref();
        self.collective(fp, opts, algo != Algorithm::ShmDirect, algo.name(), |ctx, fp| {
            let buf = match (algo, layout) {
                #[cfg(target_os = "linux")]
                (Algorithm::ShmDirect, _) => {
                    with_direct(ctx, |ctx, d| crate::algorithms::shm_direct::all_reduce(ctx, d, fp, io, op.combiner()))?
                }
                (Algorithm::Hierarchical, Some(l)) => {
                    let buf = io.into_in_place();
                    algorithms::hierarchical::all_reduce(ctx, l, buf, op.combiner())?;
                    buf
                }
                _ => {
                    let buf = io.into_in_place();
                    run_all_reduce(ctx, algo, buf, op.combiner())?;
                    buf
                }
            };
            reduce::finish_avg(buf, op, n);
            Ok(())
        })
    }

    /// Reduces `buf` across the group into `root`'s `buf`; other ranks' buffers are unchanged.
    #[track_caller]
    pub fn reduce<T: Element>(&self, buf: &mut [T], root: usize, op: ReduceOp) -> Result<()> {
        self.reduce_with(buf, root, op, &OpOptions::default())
    }

    /// [`Communicator::reduce`] with per-op options.
    #[track_caller]
    pub fn reduce_with<T: Element>(&self, buf: &mut [T], root: usize, op: ReduceOp, opts: &OpOptions) -> Result<()> {
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::Reduce), buf.len());
        fp.op = Some(op);
        fp.root = Some(root as u32);
        self.check_root(root, &fp)?;
        reduce::check(op, T::DTYPE).map_err(|e| e.with_op(self.describe(&fp)).with_rank(self.core.world_rank))?;
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.reduce(self, fp, buf, root, op, opts);
        }
        self.algorithm(&fp, opts, std::mem::size_of_val(buf), buf.len())?;
        let (n, me) = (self.size(), self.rank());
        self.collective(fp, opts, true, "tree", |ctx, _| {
            algorithms::tree::reduce(ctx, buf, root, op.combiner())?;
            if me == root {
                reduce::finish_avg(buf, op, n);
            }
            Ok(())
        })
    }

    /// Copies `root`'s `buf` into every rank's `buf`.
    #[track_caller]
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_with(buf, root, &OpOptions::default())
    }

    /// [`Communicator::broadcast`] with per-op options.
    #[track_caller]
    pub fn broadcast_with<T: Element>(&self, buf: &mut [T], root: usize, opts: &OpOptions) -> Result<()> {
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::Broadcast), buf.len());
        fp.root = Some(root as u32);
        self.check_root(root, &fp)?;
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.broadcast(self, fp, buf, root, opts);
        }
        let algo = self.algorithm(&fp, opts, std::mem::size_of_val(buf), buf.len())?;
        let layout = self.group.layout.as_ref();
        self.collective(fp, opts, algo != Algorithm::ShmDirect, algo.name(), |ctx, fp| match (algo, layout) {
            #[cfg(target_os = "linux")]
            (Algorithm::ShmDirect, _) => {
                with_direct(ctx, |ctx, d| crate::algorithms::shm_direct::broadcast(ctx, d, fp, buf, root))
            }
            (Algorithm::Hierarchical, Some(l)) => algorithms::hierarchical::broadcast(ctx, l, buf, root),
            _ => algorithms::tree::broadcast(ctx, buf, root),
        })
    }

    /// Gathers every rank's `input` into `output` (size × input.len(), rank order).
    #[track_caller]
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.all_gather_with(input, output, &OpOptions::default())
    }

    /// [`Communicator::all_gather`] with per-op options.
    #[track_caller]
    pub fn all_gather_with<T: Element>(&self, input: &[T], output: &mut [T], opts: &OpOptions) -> Result<()> {
        let fp = Self::with_dtype::<T>(self.fingerprint(OpKind::AllGather), input.len());
        if output.len() != input.len() * self.size() {
            return Err(self.arg_error(
                &fp,
                format!(
                    "output has {} elements, expected size × input = {} × {}",
                    output.len(),
                    self.size(),
                    input.len()
                ),
            ));
        }
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.all_gather(self, fp, input, output, opts);
        }
        let algo = self.algorithm(&fp, opts, std::mem::size_of_val(input), input.len())?;
        let layout = self.group.layout.as_ref();
        self.collective(fp, opts, true, algo.name(), |ctx, _| match (algo, layout) {
            (Algorithm::Hierarchical, Some(l)) => algorithms::hierarchical::all_gather(ctx, l, input, output),
            _ => algorithms::ring::all_gather(ctx, input, output),
        })
    }

    /// Reduces `input` (size × output.len()) across the group; rank r gets block r of the
    /// result in `output`.
    #[track_caller]
    pub fn reduce_scatter<T: Element>(&self, input: &[T], output: &mut [T], op: ReduceOp) -> Result<()> {
        self.reduce_scatter_with(input, output, op, &OpOptions::default())
    }

    /// [`Communicator::reduce_scatter`] with per-op options.
    #[track_caller]
    pub fn reduce_scatter_with<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<()> {
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::ReduceScatter), input.len());
        fp.op = Some(op);
        reduce::check(op, T::DTYPE).map_err(|e| e.with_op(self.describe(&fp)).with_rank(self.core.world_rank))?;
        if input.len() != output.len() * self.size() {
            return Err(self.arg_error(
                &fp,
                format!(
                    "input has {} elements, expected size × output = {} × {} (the input length must be a multiple of the group size)",
                    input.len(),
                    self.size(),
                    output.len()
                ),
            ));
        }
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.reduce_scatter(self, fp, input, output, op, opts);
        }
        let algo = self.algorithm(&fp, opts, std::mem::size_of_val(input), input.len())?;
        let n = self.size();
        let layout = self.group.layout.as_ref();
        self.collective(fp, opts, true, algo.name(), |ctx, _| {
            match (algo, layout) {
                (Algorithm::Hierarchical, Some(l)) => {
                    algorithms::hierarchical::reduce_scatter(ctx, l, input, output, op.combiner())?
                }
                _ => algorithms::ring::reduce_scatter(ctx, input, output, op.combiner())?,
            }
            reduce::finish_avg(output, op, n);
            Ok(())
        })
    }

    /// All-to-all with equal blocks: block p of `send` goes to rank p; block p of `recv`
    /// comes from rank p. Both lengths must be equal and a multiple of the group size.
    #[track_caller]
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.all_to_all_with(send, recv, &OpOptions::default())
    }

    /// [`Communicator::all_to_all`] with per-op options.
    #[track_caller]
    pub fn all_to_all_with<T: Element>(&self, send: &[T], recv: &mut [T], opts: &OpOptions) -> Result<()> {
        let fp = Self::with_dtype::<T>(self.fingerprint(OpKind::AllToAll), send.len());
        let n = self.size();
        if send.len() != recv.len() || send.len() % n != 0 {
            return Err(self.arg_error(
                &fp,
                format!(
                    "send ({}) and recv ({}) must have the same length, a multiple of the group size {n}",
                    send.len(),
                    recv.len()
                ),
            ));
        }
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.all_to_all(self, fp, send, recv, opts);
        }
        self.algorithm(&fp, opts, std::mem::size_of_val(send), send.len())?;
        let c = send.len() / n;
        let ranges: Vec<_> = (0..n).map(|p| p * c..(p + 1) * c).collect();
        self.collective(fp, opts, true, "pairwise", |ctx, _| {
            algorithms::pairwise::all_to_all(ctx, send, &ranges, recv, &ranges, false)
        })
    }

    /// All-to-all with per-peer counts: `send_counts[p]` elements of `send` (contiguous, in
    /// rank order) go to rank p; `recv_counts[p]` elements from rank p land in `recv`. A
    /// count that disagrees with the peer's is an error naming the peer; nothing is written
    /// from that peer.
    #[track_caller]
    pub fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let fp = Self::with_dtype::<T>(self.fingerprint(OpKind::AllToAllV), 0);
        let n = self.size();
        for (name, counts, len) in [("send", send_counts, send.len()), ("recv", recv_counts, recv.len())] {
            if counts.len() != n {
                return Err(self.arg_error(&fp, format!("{name}_counts has {} entries, expected {n}", counts.len())));
            }
            let total: usize = counts.iter().sum();
            if total != len {
                return Err(
                    self.arg_error(&fp, format!("{name}_counts add up to {total} but {name} has {len} elements"))
                );
            }
        }
        let ranges = |counts: &[usize]| {
            let mut at = 0;
            counts
                .iter()
                .map(|c| {
                    at += c;
                    at - c..at
                })
                .collect::<Vec<_>>()
        };
        let (sr, rr) = (ranges(send_counts), ranges(recv_counts));
        if sr[self.rank()].len() != rr[self.rank()].len() {
            return Err(self.arg_error(
                &fp,
                format!(
                    "send_counts[{me}] = {} but recv_counts[{me}] = {} (this rank's own block)",
                    sr[self.rank()].len(),
                    rr[self.rank()].len(),
                    me = self.rank()
                ),
            ));
        }
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.all_to_all_v(self, fp, send, send_counts, recv, recv_counts);
        }
        self.collective(fp, &OpOptions::default(), true, "pairwise", |ctx, _| {
            algorithms::pairwise::all_to_all(ctx, send, &sr, recv, &rr, true)
        })
    }

    /// Gathers every rank's `input` into `output` on `root` (size × input.len()); other
    /// ranks pass `None`.
    #[track_caller]
    pub fn gather<T: Element>(&self, input: &[T], output: Option<&mut [T]>, root: usize) -> Result<()> {
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::Gather), input.len());
        fp.root = Some(root as u32);
        self.check_root(root, &fp)?;
        let want = input.len() * self.size();
        let output = self.root_buffer(&fp, root, output, |o| o.len(), want, "output")?;
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.gather(self, fp, input, output, root);
        }
        self.collective(fp, &OpOptions::default(), true, "flat", |ctx, _| {
            algorithms::star::gather(ctx, input, output, root)
        })
    }

    /// Scatters block p of `root`'s `input` (size × output.len()) to rank p's `output`; other
    /// ranks pass `None`.
    #[track_caller]
    pub fn scatter<T: Element>(&self, input: Option<&[T]>, output: &mut [T], root: usize) -> Result<()> {
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::Scatter), output.len());
        fp.root = Some(root as u32);
        self.check_root(root, &fp)?;
        let want = output.len() * self.size();
        let input = self.root_buffer(&fp, root, input, |i| i.len(), want, "input")?;
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.scatter(self, fp, input, output, root);
        }
        self.collective(fp, &OpOptions::default(), true, "flat", |ctx, _| {
            algorithms::star::scatter(ctx, input, output, root)
        })
    }

    /// Blocks until every rank of the group has called `barrier`.
    #[track_caller]
    pub fn barrier(&self) -> Result<()> {
        self.barrier_with(&OpOptions::default())
    }

    /// [`Communicator::barrier`] with per-op options (e.g. the dissemination algorithm).
    #[track_caller]
    pub fn barrier_with(&self, opts: &OpOptions) -> Result<()> {
        let fp = self.fingerprint(OpKind::Barrier);
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.barrier(self, fp, opts);
        }
        let algo = self.algorithm(&fp, opts, 0, 0)?;
        match algo {
            Algorithm::Dissemination => self.collective(fp, opts, false, "dissem", algorithms::barrier::dissemination),
            #[cfg(target_os = "linux")]
            Algorithm::ShmDirect => self.collective(fp, opts, false, "direct", |ctx, fp| {
                with_direct(ctx, |ctx, d| crate::algorithms::shm_direct::barrier(ctx, d, fp))
            }),
            _ => self.collective(fp, opts, true, "star", |_, _| Ok(())),
        }
    }

    /// A barrier that waits at most `timeout` and, on failure, names every rank that did not
    /// arrive (rank 0 collects the arrivals).
    #[track_caller]
    pub fn monitored_barrier(&self, timeout: Duration) -> Result<()> {
        let fp = self.fingerprint(OpKind::MonitoredBarrier);
        let opts = OpOptions { timeout: Some(timeout), ..OpOptions::default() };
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.monitored_barrier(self, fp, timeout);
        }
        self.collective(fp, &opts, true, "star", |_, _| Ok(()))
    }

    /// All-reduces several buffers as one op (one agreement, one algorithm run).
    #[track_caller]
    pub fn all_reduce_coalesced<T: Element>(&self, bufs: &mut [&mut [T]], op: ReduceOp) -> Result<()> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::AllReduceCoalesced), total);
        fp.op = Some(op);
        fp.extra = bufs.len() as u64;
        reduce::check(op, T::DTYPE).map_err(|e| e.with_op(self.describe(&fp)).with_rank(self.core.world_rank))?;
        let opts = OpOptions::default();
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.all_reduce_coalesced(self, fp, bufs, op);
        }
        let algo = self.algorithm(&fp, &opts, total * T::DTYPE.size(), total)?;
        let n = self.size();
        self.collective(fp, &opts, true, algo.name(), |ctx, _| {
            let mut flat: Vec<T> = Vec::with_capacity(total);
            for b in bufs.iter() {
                flat.extend_from_slice(b);
            }
            run_all_reduce(ctx, algo, &mut flat, op.combiner())?;
            reduce::finish_avg(&mut flat, op, n);
            let mut at = 0;
            for b in bufs.iter_mut() {
                b.copy_from_slice(&flat[at..at + b.len()]);
                at += b.len();
            }
            Ok(())
        })
    }

    /// All-gathers several buffers as one op: `outputs[i]` (size × `inputs[i].len()`) receives
    /// every rank's `inputs[i]`.
    #[track_caller]
    pub fn all_gather_coalesced<T: Element>(&self, inputs: &[&[T]], outputs: &mut [&mut [T]]) -> Result<()> {
        let total: usize = inputs.iter().map(|b| b.len()).sum();
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::AllGatherCoalesced), total);
        fp.extra = inputs.len() as u64;
        let n = self.size();
        if inputs.len() != outputs.len() {
            return Err(self.arg_error(&fp, format!("{} inputs but {} outputs", inputs.len(), outputs.len())));
        }
        for (i, (a, b)) in inputs.iter().zip(outputs.iter()).enumerate() {
            if b.len() != a.len() * n {
                return Err(
                    self.arg_error(&fp, format!("outputs[{i}] has {} elements, expected {} × {}", b.len(), n, a.len()))
                );
            }
        }
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.all_gather_coalesced(self, fp, inputs, outputs);
        }
        self.collective(fp, &OpOptions::default(), true, "ring", |ctx, _| {
            let mut flat: Vec<T> = Vec::with_capacity(total);
            for b in inputs {
                flat.extend_from_slice(b);
            }
            let mut all = vec![T::default(); total * n];
            algorithms::ring::all_gather(ctx, &flat, &mut all)?;
            for (p, block) in all.chunks(total.max(1)).enumerate().take(n) {
                let mut at = 0;
                for (i, out) in outputs.iter_mut().enumerate() {
                    let c = inputs[i].len();
                    out[p * c..(p + 1) * c].copy_from_slice(&block[at..at + c]);
                    at += c;
                }
            }
            Ok(())
        })
    }

    // ---------------------------------------------------------------- groups

    /// Creates a sub-group of the listed group ranks. Collective: every rank of this group
    /// must call it with the same list. Returns `None` on ranks outside the new group. Group
    /// ranks follow the order of `ranks`.
    #[track_caller]
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<Communicator>> {
        let mut fp = self.fingerprint(OpKind::NewGroup);
        fp.count = ranks.len() as u64;
        let mut h = DefaultHasher::new();
        ranks.hash(&mut h);
        fp.extra = h.finish();
        let mut seen = vec![false; self.size()];
        for &r in ranks {
            if r >= self.size() {
                return Err(self.arg_error(&fp, format!("rank {r} out of range for a group of {}", self.size())));
            }
            if std::mem::replace(&mut seen[r], true) {
                return Err(self.arg_error(&fp, format!("rank {r} listed twice")));
            }
        }
        if ranks.is_empty() {
            return Err(self.arg_error(&fp, "a group needs at least one rank"));
        }
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.new_group(self, fp, ranks);
        }
        self.collective(fp, &OpOptions::default(), true, "star", |_, _| Ok(()))?;
        Ok(self.subgroup(ranks, fp.extra))
    }

    /// Splits the group by `color` (ranks passing `None` join no group), ordering each new
    /// group by `key` then by current rank, as `MPI_Comm_split`. Collective.
    #[track_caller]
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        #[cfg(feature = "mpi")]
        if let Some(b) = self.mpi() {
            return b.split(self, self.fingerprint(OpKind::NewGroup), color, key);
        }
        let mine = [color.map_or(-1, i64::from), key];
        let mut all = vec![0i64; 2 * self.size()];
        self.all_gather(&mine, &mut all)?;
        let Some(color) = color else { return Ok(None) };
        let mut members: Vec<(i64, usize)> =
            all.chunks(2).enumerate().filter(|(_, ck)| ck[0] == i64::from(color)).map(|(r, ck)| (ck[1], r)).collect();
        members.sort();
        let ranks: Vec<usize> = members.into_iter().map(|(_, r)| r).collect();
        Ok(self.subgroup(&ranks, 0x5eed_0000_0000 ^ u64::from(color)))
    }

    /// A sub-group of the listed group ranks over this communicator's links, made without
    /// any communication: only the members call it (ranks outside the list get `None`, as
    /// from [`Communicator::new_group`]). Every member must pass the same list, and members
    /// must make their groups of one rank list in the same order (as torch requires of
    /// `new_group`), because the group's identity is the list and how many groups of that
    /// list this rank made before. Use it where a framework creates a group on its members
    /// only; [`Communicator::new_group`] checks the list across ranks instead.
    ///
    /// ```
    /// use oxcomm::{threads, ReduceOp};
    ///
    /// let out = threads::run(3, |comm| {
    ///     if comm.rank() == 1 {
    ///         return Ok(0.0); // not a member: takes no part
    ///     }
    ///     let g = comm.members_group(&[0, 2])?.expect("a member");
    ///     let mut v = [comm.rank() as f32];
    ///     g.all_reduce(&mut v, ReduceOp::Sum)?;
    ///     Ok::<_, oxcomm::Error>(v[0])
    /// })?;
    /// assert_eq!(out.into_iter().map(|r| r.unwrap()).collect::<Vec<_>>(), vec![2.0, 0.0, 2.0]);
    /// # Ok::<(), oxcomm::Error>(())
    /// ```
    pub fn members_group(&self, ranks: &[usize]) -> Result<Option<Communicator>> {
        let mut fp = self.fingerprint(OpKind::NewGroup);
        fp.count = ranks.len() as u64;
        let mut seen = vec![false; self.size()];
        for &r in ranks {
            if r >= self.size() {
                return Err(self.arg_error(&fp, format!("rank {r} out of range for a group of {}", self.size())));
            }
            if std::mem::replace(&mut seen[r], true) {
                return Err(self.arg_error(&fp, format!("rank {r} listed twice")));
            }
        }
        if !seen[self.rank()] {
            return Ok(None);
        }
        #[cfg(feature = "mpi")]
        if self.mpi().is_some() {
            return Err(Error::unsupported("members_group on the MPI backend (use new_group or split)")
                .with_rank(self.core.world_rank));
        }
        let world: Vec<usize> = ranks.iter().map(|r| self.group.members[*r]).collect();
        let nth = {
            let mut made = self.core.member_groups.lock().unwrap_or_else(|e| e.into_inner());
            let n = made.entry(world.clone()).or_insert(0);
            *n += 1;
            *n
        };
        let mut h = DefaultHasher::new();
        ("members_group", &world, nth).hash(&mut h);
        let id = h.finish() | 1;
        let me = ranks.iter().position(|r| *r == self.rank()).expect("checked above");
        Ok(Some(Communicator { core: self.core.clone(), group: Arc::new(Group::new(id, world, me, &self.core.hosts)) }))
    }

    pub(crate) fn subgroup(&self, ranks: &[usize], salt: u64) -> Option<Communicator> {
        let me = ranks.iter().position(|r| *r == self.rank())?;
        let mut h = DefaultHasher::new();
        (self.group.id, self.group.seq.load(Ordering::SeqCst), salt, ranks).hash(&mut h);
        let id = h.finish() | 1;
        let members = ranks.iter().map(|r| self.group.members[*r]).collect();
        Some(Communicator { core: self.core.clone(), group: Arc::new(Group::new(id, members, me, &self.core.hosts)) })
    }

    // ---------------------------------------------------------------- point to point

    /// Sends `buf` to group rank `dst` with `tag`. Messages between two ranks are matched in
    /// order; the receiver checks dtype, count and tag and fails on a mismatch.
    pub fn send<T: Element>(&self, buf: &[T], dst: usize, tag: u32) -> Result<()> {
        let fp = self.p2p_fp::<T>(buf.len(), dst, tag)?;
        self.core.check_alive(|| fp.to_string())?;
        let ticket = self.core.draw_ticket();
        let mut job = P2pJob::send(self.group.members[dst], as_bytes(buf).to_vec(), fp, None);
        self.core.run_p2p(ticket, std::slice::from_mut(&mut job))?;
        Ok(())
    }

    /// Receives into `buf` from group rank `src`; the message must carry `tag` and exactly
    /// `buf.len()` elements of `T`, or this fails (naming the sender) without touching `buf`.
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u32) -> Result<()> {
        let fp = self.p2p_fp::<T>(buf.len(), src, tag)?;
        self.core.check_alive(|| fp.to_string())?;
        let ticket = self.core.draw_ticket();
        let mut job = P2pJob::recv(self.group.members[src], vec![0u8; std::mem::size_of_val(buf)], fp, None);
        self.core.run_p2p(ticket, std::slice::from_mut(&mut job))?;
        as_bytes_mut(buf).copy_from_slice(&job.bytes);
        Ok(())
    }

    /// Starts sending `buf` to `dst`; the handle returns the buffer when the send is done.
    /// Pending `isend`/`irecv`s start together (so an exchange cannot deadlock) when a handle
    /// is waited on or polled, or when any other op is issued.
    pub fn isend<T: Element>(&self, buf: Vec<T>, dst: usize, tag: u32) -> Work<Vec<T>> {
        let fp = match self.p2p_fp::<T>(buf.len(), dst, tag) {
            Ok(fp) => fp,
            Err(e) => return Work::done(Err(e), self.core.clone()),
        };
        let (work, slot) = Work::<Vec<u8>>::pending(self.core.clone());
        let job = P2pJob::send(self.group.members[dst], as_bytes(&buf).to_vec(), fp, Some(slot));
        self.core.pending_p2p.lock().unwrap_or_else(|e| e.into_inner()).push(job);
        self.core.p2p_pending.store(true, Ordering::SeqCst);
        work.map(move |_| buf)
    }

    /// Starts receiving into `buf` from `src`; the handle returns the filled buffer. See
    /// [`Communicator::isend`] for when it starts.
    pub fn irecv<T: Element>(&self, buf: Vec<T>, src: usize, tag: u32) -> Work<Vec<T>> {
        let fp = match self.p2p_fp::<T>(buf.len(), src, tag) {
            Ok(fp) => fp,
            Err(e) => return Work::done(Err(e), self.core.clone()),
        };
        let (work, slot) = Work::<Vec<u8>>::pending(self.core.clone());
        let job = P2pJob::recv(self.group.members[src], vec![0u8; std::mem::size_of_val(&buf[..])], fp, Some(slot));
        self.core.pending_p2p.lock().unwrap_or_else(|e| e.into_inner()).push(job);
        self.core.p2p_pending.store(true, Ordering::SeqCst);
        let mut buf = buf;
        work.map(move |bytes| {
            as_bytes_mut(&mut buf).copy_from_slice(&bytes);
            buf
        })
    }

    fn p2p_fp<T: Element>(&self, count: usize, peer: usize, tag: u32) -> Result<Fingerprint> {
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::P2p), count);
        fp.extra = u64::from(tag);
        if peer >= self.size() {
            return Err(self.arg_error(&fp, format!("peer {peer} out of range for a group of {}", self.size())));
        }
        if peer == self.rank() {
            return Err(self.arg_error(&fp, "send/recv to self is not supported"));
        }
        Ok(fp)
    }

    // ---------------------------------------------------------------- async collectives

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

    /// Async [`Communicator::all_reduce`]: takes the buffer and hands it back through the
    /// handle. Async ops on one communicator run and complete in the order they were issued.
    pub fn all_reduce_async<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.run_async(move |c| {
            let mut buf = buf;
            c.all_reduce(&mut buf, op)?;
            Ok(buf)
        })
    }

    /// Async [`Communicator::broadcast`].
    pub fn broadcast_async<T: Element>(&self, buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        self.run_async(move |c| {
            let mut buf = buf;
            c.broadcast(&mut buf, root)?;
            Ok(buf)
        })
    }

    /// Async [`Communicator::reduce`].
    pub fn reduce_async<T: Element>(&self, buf: Vec<T>, root: usize, op: ReduceOp) -> Work<Vec<T>> {
        self.run_async(move |c| {
            let mut buf = buf;
            c.reduce(&mut buf, root, op)?;
            Ok(buf)
        })
    }

    /// Async [`Communicator::all_gather`]: the handle returns the gathered buffer.
    pub fn all_gather_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        self.run_async(move |c| {
            let mut out = vec![T::default(); input.len() * c.size()];
            c.all_gather(&input, &mut out)?;
            Ok(out)
        })
    }

    /// Async [`Communicator::reduce_scatter`]: the handle returns this rank's block.
    pub fn reduce_scatter_async<T: Element>(&self, input: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.run_async(move |c| {
            let mut out = vec![T::default(); input.len() / c.size().max(1)];
            c.reduce_scatter(&input, &mut out, op)?;
            Ok(out)
        })
    }

    /// Async [`Communicator::all_to_all`]: the handle returns the received buffer.
    pub fn all_to_all_async<T: Element>(&self, send: Vec<T>) -> Work<Vec<T>> {
        self.run_async(move |c| {
            let mut out = vec![T::default(); send.len()];
            c.all_to_all(&send, &mut out)?;
            Ok(out)
        })
    }

    /// Async [`Communicator::barrier`].
    pub fn barrier_async(&self) -> Work<()> {
        self.run_async(move |c| c.barrier())
    }
}

thread_local! {
    /// The core whose turn this thread holds inside [`Communicator::run_async`] (its address),
    /// or 0: ops of that core issued on this thread run inside the held turn.
    static HELD_TURN: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Ticket value meaning "this thread already holds the turn".
const HELD: u64 = u64::MAX;

/// Runs `f` with the direct shared-memory view taken out of `ctx` (and puts it back).
#[cfg(target_os = "linux")]
fn with_direct<'c, R>(
    ctx: &mut Ctx<'c>,
    f: impl FnOnce(&mut Ctx<'c>, &mut crate::algorithms::shm_direct::Direct<'c>) -> Result<R>,
) -> Result<R> {
    let mut d = ctx.direct.take().ok_or_else(|| Error::invalid("the direct shared-memory path is not available"))?;
    let r = f(ctx, &mut d);
    ctx.direct = Some(d);
    r
}

fn run_all_reduce<T: Element>(ctx: &mut Ctx<'_>, algo: Algorithm, buf: &mut [T], op: ReduceOp) -> Result<()> {
    match algo {
        Algorithm::Ring => algorithms::ring::all_reduce(ctx, buf, op),
        Algorithm::Star => algorithms::star::all_reduce(ctx, buf, op),
        _ => algorithms::doubling::all_reduce(ctx, buf, op),
    }
}

impl Core {
    /// Whether an op named `op` is recorded now.
    fn logging(&self, op: &str) -> bool {
        self.logger.should_record(op) && !self.logging_paused.load(Ordering::Relaxed)
    }

    /// Records a finished op (message size by DeepSpeed's convention: see `logging`).
    fn record(
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
    fn push_record(
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
            transport: self.transport,
            start_ns,
            latency_ns: end.saturating_sub(start_ns),
            caller,
        });
    }

    fn lock_state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_alive(&self, op: impl FnOnce() -> String) -> Result<()> {
        if self.aborted.load(Ordering::SeqCst) {
            let cause = self.cause.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let cause = cause.unwrap_or_else(|| Error::new(ErrorKind::Aborted, "aborted"));
            return Err(cause.aborted(op()).with_rank(self.world_rank));
        }
        Ok(())
    }

    /// Records the first error and closes every link so peers notice.
    fn fail(&self, err: Error) {
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
        let culprit =
            self.cause.lock().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(|e| e.peer().map(|p| (p, e.kind())));
        let mut state = self.lock_state();
        for l in state.links.iter_mut() {
            if let Some(mut link) = l.take() {
                link.close(culprit);
            }
        }
    }

    fn await_turn(&self, ticket: u64, timeout: Duration, op: impl FnOnce() -> String) -> Result<TurnGuard<'_>> {
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
            if let Err(e) = self.check_alive(|| op_name.take().map_or_else(String::new, |f| f())) {
                break Err(e);
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
    fn draw_ticket(self: &Arc<Self>) -> u64 {
        if self.holds_turn() {
            return HELD;
        }
        self.flush_p2p();
        self.next_ticket.fetch_add(1, Ordering::SeqCst)
    }

    /// Whether this thread holds this core's turn (inside [`Communicator::run_async`]).
    fn holds_turn(&self) -> bool {
        HELD_TURN.with(|h| h.get()) == self as *const Core as usize
    }

    /// Waits for `ticket`'s turn, then runs `f` holding it: every op `f` issues on this core
    /// runs inside the turn, which advances once when `f` returns (or unwinds).
    fn hold_turn<R>(&self, ticket: u64, f: impl FnOnce() -> Result<R>) -> Result<R> {
        /// Restores the previous holder when `f` ends, however it ends.
        struct Restore(usize);
        impl Drop for Restore {
            fn drop(&mut self) {
                HELD_TURN.with(|h| h.set(self.0));
            }
        }
        let _turn = self.await_turn(ticket, self.config.timeout, || "an async op".to_string())?;
        let _restore = Restore(HELD_TURN.with(|h| h.replace(self as *const Core as usize)));
        f()
    }

    fn submit(&self, job: Job) {
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

    /// Starts every pending `isend`/`irecv` as one batch on the async worker.
    fn flush_p2p(self: &Arc<Self>) {
        if !self.p2p_pending.swap(false, Ordering::SeqCst) {
            return;
        }
        let jobs: Vec<P2pJob> = std::mem::take(&mut *self.pending_p2p.lock().unwrap_or_else(|e| e.into_inner()));
        if jobs.is_empty() {
            return;
        }
        let ticket = self.next_ticket.fetch_add(1, Ordering::SeqCst);
        let core = self.clone();
        self.submit(Box::new(move || {
            let mut jobs = jobs;
            let result = core.run_p2p(ticket, &mut jobs);
            for job in jobs {
                if let Some(slot) = job.slot {
                    slot.complete(match &result {
                        Ok(()) => Ok(job.bytes),
                        Err(e) => Err(e.clone()),
                    });
                }
            }
        }));
    }

    /// Runs point-to-point jobs together under `ticket`.
    fn run_p2p(&self, ticket: u64, jobs: &mut [P2pJob]) -> Result<()> {
        let timeout = self.config.timeout;
        let first = jobs.first().map(|j| j.fp.to_string()).unwrap_or_default();
        let _turn = self.await_turn(ticket, timeout, || first.clone())?;
        self.check_alive(|| first.clone())?;
        let mut state = self.lock_state();
        // Stamp per-pair sequence numbers in issue order.
        for job in jobs.iter_mut() {
            let counter = if job.is_send { &mut state.p2p_sent[job.peer] } else { &mut state.p2p_received[job.peer] };
            job.fp.seq = *counter;
            *counter += 1;
            job.header = job.fp.encode();
        }
        #[cfg(feature = "mpi")]
        if let Some(b) = &self.mpi {
            let result = b.p2p(jobs, &mut state.stats);
            drop(state);
            return result.map_err(|e| {
                let e = e.with_op(first.clone()).with_rank(self.world_rank);
                self.fail(e.clone());
                e
            });
        }
        let members: Vec<usize> = (0..self.world_size).collect();
        let flight = jobs.first().map(|j| self.flight.start(&j.fp, "p2p", Some(j.peer)));
        let State { links, stats, scratch, .. } = &mut *state;
        let mut ctx = Ctx::new(
            self.world_rank,
            &members,
            links,
            &*self.bell,
            timeout,
            self.config.max_segment_bytes,
            stats,
            scratch,
        );
        let result = crate::unwind::catch(self.world_rank, || {
            // Phase 1: headers out, headers in.
            let mut got = vec![[0u8; FP_BYTES]; jobs.len()];
            {
                let mut xfers: Vec<Xfer<'_>> = Vec::new();
                for (job, g) in jobs.iter().zip(got.iter_mut()) {
                    if job.is_send {
                        xfers.push(Xfer::send(job.peer, &job.header));
                    } else {
                        xfers.push(Xfer::recv(job.peer, g));
                    }
                }
                ctx.run(&mut xfers)?;
            }
            // Check what arrived before reading any payload.
            for (job, g) in jobs.iter().zip(got.iter()) {
                if !job.is_send {
                    job.check_header(g)?;
                }
            }
            // Phase 2: payloads both ways at once (headers are small enough to never block,
            // payloads are not, so they must flow concurrently).
            let mut xfers: Vec<Xfer<'_>> = jobs
                .iter_mut()
                .map(|j| if j.is_send { Xfer::send(j.peer, &j.bytes) } else { Xfer::recv(j.peer, &mut j.bytes) })
                .collect();
            ctx.run(&mut xfers)
        });
        drop(state);
        if let (Some(id), Ok(())) = (flight, &result) {
            self.flight.finish(id, Ok(()));
        }
        result.map_err(|e| {
            let e = e.with_op(first.clone()).with_rank(self.world_rank);
            let e = match flight {
                Some(id) => self.flight.annotate(id, e, self.world_rank),
                None => e,
            };
            self.fail(e.clone());
            e
        })
    }
}

/// A pending point-to-point op.
pub(crate) struct P2pJob {
    /// World rank of the peer.
    pub(crate) peer: usize,
    pub(crate) is_send: bool,
    pub(crate) bytes: Vec<u8>,
    pub(crate) fp: Fingerprint,
    pub(crate) header: [u8; FP_BYTES],
    slot: Option<Arc<Slot<Vec<u8>>>>,
}

impl P2pJob {
    /// Checks the header that arrived for this receive against what it expects (dtype,
    /// count, tag, per-pair sequence number), before any payload is read.
    pub(crate) fn check_header(&self, got: &[u8]) -> Result<()> {
        let theirs = Fingerprint::decode_from(got, self.peer)?;
        if theirs != self.fp {
            return Err(Error::new(
                ErrorKind::Mismatch,
                format!("rank {} sent {theirs}, this rank expected {}", self.peer, self.fp),
            )
            .with_op(self.fp.to_string())
            .with_peer(self.peer));
        }
        Ok(())
    }

    fn send(peer: usize, bytes: Vec<u8>, fp: Fingerprint, slot: Option<Arc<Slot<Vec<u8>>>>) -> P2pJob {
        P2pJob { peer, is_send: true, bytes, fp, header: [0; FP_BYTES], slot }
    }

    fn recv(peer: usize, bytes: Vec<u8>, fp: Fingerprint, slot: Option<Arc<Slot<Vec<u8>>>>) -> P2pJob {
        P2pJob { peer, is_send: false, bytes, fp, header: [0; FP_BYTES], slot }
    }
}

// -------------------------------------------------------------------- work handles

struct Slot<R> {
    result: Mutex<Option<Result<R>>>,
    cv: Condvar,
    done: AtomicBool,
}

impl<R> Slot<R> {
    fn complete(&self, r: Result<R>) {
        let mut g = self.result.lock().unwrap_or_else(|e| e.into_inner());
        *g = Some(r);
        self.done.store(true, Ordering::SeqCst);
        self.cv.notify_all();
    }
}

type Mapper<R> = Box<dyn FnOnce(Vec<u8>) -> R + Send>;

/// The handle of an async op. Dropping it does not cancel the op.
pub struct Work<R> {
    inner: WorkInner<R>,
    core: Arc<Core>,
    taken: bool,
}

enum WorkInner<R> {
    Direct(Arc<Slot<R>>),
    Mapped(Arc<Slot<Vec<u8>>>, Option<Mapper<R>>),
}

impl<R: Send + 'static> Work<R> {
    fn pending(core: Arc<Core>) -> (Work<R>, Arc<Slot<R>>) {
        let slot = Arc::new(Slot { result: Mutex::new(None), cv: Condvar::new(), done: AtomicBool::new(false) });
        (Work { inner: WorkInner::Direct(slot.clone()), core, taken: false }, slot)
    }

    fn done(r: Result<R>, core: Arc<Core>) -> Work<R> {
        let (w, slot) = Work::pending(core);
        slot.complete(r);
        w
    }
}

impl Work<Vec<u8>> {
    fn map<S>(self, f: impl FnOnce(Vec<u8>) -> S + Send + 'static) -> Work<S> {
        let WorkInner::Direct(slot) = self.inner else { unreachable!("map is applied once, to a fresh handle") };
        Work { inner: WorkInner::Mapped(slot, Some(Box::new(f))), core: self.core, taken: false }
    }
}

impl<R> Work<R> {
    /// Whether the op has finished (successfully or not). Polling also starts pending
    /// `isend`/`irecv`s.
    pub fn is_completed(&self) -> bool {
        self.core.flush_p2p();
        match &self.inner {
            WorkInner::Direct(s) => s.done.load(Ordering::SeqCst),
            WorkInner::Mapped(s, _) => s.done.load(Ordering::SeqCst),
        }
    }

    /// Waits for the op and returns its result. The op's own deadline bounds the wait.
    pub fn wait(mut self) -> Result<R> {
        // The op fails by its own deadline; this outer bound only guards against a bug.
        let bound = self.core.config.timeout * 2 + Duration::from_secs(5);
        match self.wait_timeout(bound)? {
            Some(r) => Ok(r),
            None => Err(Error::new(ErrorKind::Timeout, format!("async op did not finish within {bound:?}"))
                .with_rank(self.core.world_rank)),
        }
    }

    /// Waits at most `timeout`: `Ok(Some(result))` once the op is done, `Ok(None)` if it is
    /// still running, `Err` if it failed. The result can be taken once.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<R>> {
        if self.taken {
            return Err(Error::invalid("the result of this work handle was already taken"));
        }
        self.core.flush_p2p();
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
