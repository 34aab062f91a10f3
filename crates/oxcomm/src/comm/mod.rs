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

//! The module is split by concern: [`config`] (settings), `core` (turns, abort, the async
//! worker and the op path), `work` ([`Work`] handles), `collectives` and `async_ops` (the op
//! surface), `groups`, `p2p` (point-to-point). Which algorithm runs an op is
//! `algorithms::dispatch`'s business.

mod async_ops;
mod collectives;
pub mod config;
mod core;
mod ft;
mod groups;
mod p2p;
mod work;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use self::core::Core;
use crate::algorithms::hierarchical::HostLayout;
use crate::backend::{AnyBackend, Backend, GroupView};
use crate::dtype::{DType, Element};
use crate::engine::LinkStats;
use crate::error::{Error, ErrorKind, Result};
use crate::logging::CommsLogger;
use crate::transport::Transport;
use crate::wire::{Fingerprint, OpKind};

pub use async_ops::OwnedBuf;
pub use config::{
    CommConfig, OpOptions, DEFAULT_MAX_SEGMENT_BYTES, DEFAULT_SUSPECT_AFTER, DEFAULT_TIMEOUT, ENV_SUSPECT_AFTER,
    ENV_TIMEOUT,
};
pub use ft::Agreed;
pub use work::Work;

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
    /// Deadline of this group's ops in nanoseconds; 0: the communicator's
    /// ([`CommConfig::timeout`]). Set by [`Communicator::set_timeout`].
    timeout_ns: AtomicU64,
}

impl Group {
    fn new(id: u64, members: Vec<usize>, rank: usize, hosts: &[usize]) -> Group {
        let host_of: Vec<usize> = members.iter().map(|w| hosts[*w]).collect();
        let layout = HostLayout::new(&host_of, rank);
        Group { id, members, rank, seq: AtomicU64::new(0), layout, timeout_ns: AtomicU64::new(0) }
    }
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("world_rank", &self.core.world_rank)
            .field("transport", &self.core.backend.transport())
            .finish()
    }
}

impl Communicator {
    /// A world communicator (rank `rank` of `size`) whose ops run on `backend`. Backends are
    /// built where communicators are built (the entry points: `world.rs` for the native one
    /// over links, `mpi.rs`), never here.
    pub(crate) fn from_backend(rank: usize, size: usize, backend: AnyBackend, config: CommConfig) -> Communicator {
        let core = Arc::new(Core::new(rank, size, backend, config));
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

    /// The links' parameters the planner prices all-reduces with on this communicator's
    /// transport (measured when a job across hosts started, or given by `OXCOMM_NET_ALPHA_US`
    /// and `OXCOMM_NET_GBPS`, else the model's defaults); `None` where the planner does not use
    /// the model (shared memory or threads only, MPI).
    pub fn links_model(&self) -> Option<crate::algorithms::cost::Network> {
        match &self.core.backend {
            AnyBackend::Native(native) => native.network(),
            #[allow(unreachable_patterns)] // the MPI backend exists with the `mpi` feature only
            _ => None,
        }
    }

    /// Measures the links of a world communicator whose ranks span hosts, for the planner
    /// (the native backend's `calibrate`); every rank calls it at the same point, before any
    /// op. A no-op on the MPI backend.
    pub(crate) fn calibrate_links(&self) -> Result<()> {
        match &self.core.backend {
            AnyBackend::Native(native) => native.calibrate(self.core.world_rank, self.core.config.timeout).map(|_| ()),
            #[allow(unreachable_patterns)] // the MPI backend exists with the `mpi` feature only
            _ => Ok(()),
        }
    }

    /// The group as a backend sees it.
    pub(super) fn view(&self) -> GroupView<'_> {
        GroupView {
            id: self.group.id,
            rank: self.group.rank,
            members: &self.group.members,
            layout: self.group.layout.as_ref(),
        }
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

    /// How this communicator moves bytes ([`Transport::as_str`] names it: `threads`, `shm`,
    /// `tcp`, `shm+tcp`, `mpi`).
    pub fn transport(&self) -> Transport {
        self.core.backend.transport()
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

    /// Sets the deadline of this group's ops (torch's `new_group(timeout=...)`): every handle
    /// on the group sees it (clones share the group); the world and other groups keep theirs,
    /// and an op's own [`OpOptions::timeout`] still wins. Pending `isend`/`irecv`s from several
    /// groups that start together wait as long as the longest of their groups' timeouts.
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// oxcomm::threads::run(2, |world| {
    ///     let pair = world.new_group(&[0, 1]).unwrap().unwrap();
    ///     pair.set_timeout(Duration::from_secs(5));
    ///     assert_eq!(pair.timeout(), Duration::from_secs(5));
    ///     assert_eq!(world.timeout(), world.config().timeout);
    /// })
    /// .unwrap();
    /// ```
    pub fn set_timeout(&self, timeout: Duration) {
        let ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX).max(1);
        self.group.timeout_ns.store(ns, Ordering::Relaxed);
    }

    /// The deadline this group's ops get (see [`Communicator::set_timeout`]).
    pub fn timeout(&self) -> Duration {
        match self.group.timeout_ns.load(Ordering::Relaxed) {
            0 => self.core.config.timeout,
            ns => Duration::from_nanos(ns),
        }
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

    /// The straggler breakdown (see [`crate::logging::straggler`]).
    fn straggler_table(&self) -> Result<String> {
        let mins = crate::logging::straggler::min_latencies(self, &self.core.logger.straggler_input())?;
        Ok(self.core.logger.straggler_table(&mins))
    }

    /// Keeps `things` alive as long as this communicator (e.g. the rendezvous store).
    pub(crate) fn keep_alive(&self, things: Vec<Box<dyn std::any::Any + Send + Sync>>) {
        self.core.keep.lock().unwrap_or_else(|e| e.into_inner()).extend(things);
    }

    /// How this rank's world was met (see `Core::origin`); `None` when it met without a store.
    pub(crate) fn origin(&self) -> Option<Arc<dyn std::any::Any + Send + Sync>> {
        self.core.origin.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Records how this rank's world was met (the entry points call it on a fresh world).
    pub(crate) fn set_origin(&self, origin: Arc<dyn std::any::Any + Send + Sync>) {
        *self.core.origin.lock().unwrap_or_else(|e| e.into_inner()) = Some(origin);
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
}

impl crate::logging::straggler::GroupOps for Communicator {
    fn size(&self) -> usize {
        Communicator::size(self)
    }

    fn rank(&self) -> usize {
        Communicator::rank(self)
    }

    fn all_reduce_max(&self, buf: &mut [i64]) -> Result<()> {
        self.all_reduce(buf, crate::reduce::ReduceOp::Max)
    }

    fn all_reduce_min(&self, buf: &mut [i64]) -> Result<()> {
        self.all_reduce(buf, crate::reduce::ReduceOp::Min)
    }

    fn all_gather(&self, input: &[i64], output: &mut [i64]) -> Result<()> {
        Communicator::all_gather(self, input, output)
    }
}
