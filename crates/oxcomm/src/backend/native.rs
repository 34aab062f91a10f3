//! The native backend: ops run as oxcomm's algorithms ([`crate::algorithms`]) over this rank's
//! links ([`crate::transport`]).
//!
//! It owns the links, the doorbell they ring, the engine's scratch space and, on one host with
//! the shm transport, the direct shared-memory workspaces. For each op it builds the engine's
//! [`Ctx`] over the op's group, runs the agreement phase when the route asks for it, and calls
//! the algorithm [`crate::algorithms::dispatch`] names. On the shm transport it hands the
//! engine the direct workspaces as the op's peer watch ([`crate::engine::PeerWatch`]), so that
//! the link algorithms meet ranks on the direct path without knowing of it. It knows nothing
//! about turns, sequence numbers, logging or finishing `Avg` (the communicator's).

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::native_ft::FtState;
use super::{concat, split_back, unpack_gathered, Backend, GroupView, NewGroup, OpEnv, P2pMsg, Route, Shrunk};
use crate::algorithms::cost::{Network, Shape};
use crate::algorithms::dispatch::Direct;
use crate::algorithms::{self, dispatch, plan, Algorithm};
use crate::buffers::{ExchangeBuffers, GatherBuffers, ReduceBuffers, ScatterBuffers};
use crate::dtype::Element;
#[cfg(target_os = "linux")]
use crate::engine::PeerWatch;
use crate::engine::{Ctx, Xfer};
use crate::error::{Error, ErrorKind, Result};
use crate::reduce::ReduceOp;
use crate::transport::{Doorbell, Link, Transport};
use crate::wire::{Fingerprint, OpKind, FP_BYTES};

/// An op that took at least this long (coarse clock) looks for a revocation at its end even
/// when the doorbell's control count did not move (see `NativeBackend::run`): a few syscalls
/// per link, nothing for the fast ops.
const SLOW_OP_NS: u64 = 50_000_000;

/// What one op locks while it runs.
pub(super) struct State {
    /// Links indexed by world rank (`None` at this rank, and once closed).
    pub(super) links: Vec<Option<Box<dyn Link>>>,
    scratch: Vec<u64>,
    #[cfg(target_os = "linux")]
    direct_state: crate::algorithms::shm_direct::DirectState,
    /// Revocation, agreement, control messages (`native_ft.rs`).
    pub(super) ft: FtState,
}

/// oxcomm's links and algorithms, as a [`Backend`].
pub(crate) struct NativeBackend {
    /// This rank in the world of the links.
    pub(super) rank: usize,
    pub(super) transport: Transport,
    pub(super) bell: Arc<dyn Doorbell>,
    state: Mutex<State>,
    /// The clock reading ([`OpEnv::now_ns`]) the heartbeat was last stamped at: an op stamps
    /// it only when the coarse clock has moved on since (see [`NativeBackend::beat`]).
    beat_at: AtomicU64,
    /// Every rank's shared-memory workspace, when all ranks share this host.
    #[cfg(target_os = "linux")]
    direct: Option<crate::transport::shm::workspace::ShmDirect>,
    /// The links' parameters the planner prices all-reduces with, on transports that cross
    /// hosts (TCP, shm+TCP): `OXCOMM_NET_*` ([`Network::from_env`]), else measured by
    /// [`NativeBackend::calibrate`], else the model's defaults. Every rank holds the same.
    net: Mutex<Option<Network>>,
}

impl NativeBackend {
    /// A backend of world rank `rank` over ready links (`links[p]`: the link to world rank
    /// `p`, `None` at this rank) that ring `bell`.
    pub(crate) fn new(
        rank: usize,
        links: Vec<Option<Box<dyn Link>>>,
        bell: Arc<dyn Doorbell>,
        transport: Transport,
        #[cfg(target_os = "linux")] direct: Option<crate::transport::shm::workspace::ShmDirect>,
    ) -> NativeBackend {
        bell.heartbeat();
        let net = matches!(transport, Transport::Tcp | Transport::ShmTcp).then(|| {
            // `init` reports a bad value as an error before it builds the backend.
            Network::from_env().ok().flatten().unwrap_or_default()
        });
        let ft = FtState::new(bell.ctrl_count());
        NativeBackend {
            rank,
            net: Mutex::new(net),
            transport,
            bell,
            beat_at: AtomicU64::new(0),
            state: Mutex::new(State {
                links,
                scratch: Vec::new(),
                #[cfg(target_os = "linux")]
                direct_state: Default::default(),
                ft,
            }),
            #[cfg(target_os = "linux")]
            direct,
        }
    }

    /// Stamps this rank's heartbeat for an op that started at `now` (the op's clock reading),
    /// unless it was stamped at that reading already. The coarse clock moves once per
    /// scheduler tick (a few ms), so back-to-back ops stamp it once per tick instead of
    /// reading the clock again each; a peer names a rank frozen only after 500 ms without a
    /// stamp (`engine::FROZEN_AFTER`), and a wait stamps it as it goes.
    fn beat(&self, now: u64, fp: &Fingerprint) {
        if self.beat_at.load(Ordering::Relaxed) != now {
            self.beat_at.store(now, Ordering::Relaxed);
            self.bell.heartbeat();
            // The op this rank was last seen in, for a peer that suspects it (one store per
            // tick too; a wait stamps its own op as it goes).
            self.bell.set_op(fp.op_word());
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What the planner knows of the links `group`'s all-reduces cross: on TCP every rank
    /// counts as a host of its own; on shm+TCP the group's even spread over hosts (none when
    /// uneven: the size rules apply).
    fn across(&self, group: &GroupView<'_>) -> Option<plan::Across> {
        let net = self.network()?;
        let shape = match self.transport {
            Transport::Tcp => Shape { hosts: group.size(), ranks_per_host: 1 },
            Transport::ShmTcp => {
                let l = group.layout?;
                Shape { hosts: l.num_hosts(), ranks_per_host: l.ranks_per_host() }
            }
            _ => return None,
        };
        Some(plan::Across { net, shape, folds: self.transport == Transport::Tcp })
    }

    /// The links' parameters the planner uses (see the field).
    pub(crate) fn network(&self) -> Option<Network> {
        *self.net.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Measures the links (world group, every rank at once, before any op): alpha from 8-byte
    /// recursive-doubling all-reduces (the median of [`CALIBRATION_SMALL`], per step), beta
    /// from 1 MiB ring all-reduces (the fastest of [`CALIBRATION_LARGE`], less its steps'
    /// alpha), and the median of [`CALIBRATION_MID`] 256 KiB halving-doubling all-reduces
    /// over the median of as many ring ones (whether the planner lets the two compete above
    /// 64 KiB: [`Network::halving_over_ring`]); then the largest of every rank's values, by a
    /// recursive-doubling all-reduce (bitwise equal on every rank), so all ranks plan alike. No agreement phase: every rank
    /// runs it at the same point of setting up. Returns what it set.
    pub(crate) fn calibrate(&self, rank: usize, timeout: Duration) -> Result<Network> {
        let mut state = self.lock();
        let State { links, scratch, .. } = &mut *state;
        let members: Vec<usize> = (0..links.len()).collect();
        let n = members.len();
        let mut stats = crate::engine::LinkStats::default();
        let mut ctx = Ctx::new(rank, &members, links, &*self.bell, timeout, 1 << 20, &mut stats, scratch);
        let started = std::time::Instant::now();
        let mut times = Vec::with_capacity(CALIBRATION_SMALL);
        let mut small = [0f32; 2];
        for _ in 0..CALIBRATION_SMALL {
            let t = std::time::Instant::now();
            algorithms::doubling::all_reduce(&mut ctx, &mut small, ReduceOp::Sum)?;
            times.push(t.elapsed().as_secs_f64());
        }
        let d = algorithms::schedule::recursive_doubling(rank, n);
        let steps = d.p.trailing_zeros() as f64 + if d.p == n { 0.0 } else { 2.0 };
        let alpha = median(times) / steps.max(1.0);
        let mut large = vec![0f32; CALIBRATION_BYTES / 4];
        let mut best = f64::INFINITY;
        for _ in 0..CALIBRATION_LARGE {
            let t = std::time::Instant::now();
            algorithms::ring::all_reduce(&mut ctx, &mut large, ReduceOp::Sum)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        let ring_steps = 2.0 * (n - 1) as f64;
        let bytes = ring_steps / n as f64 * CALIBRATION_BYTES as f64;
        // No faster than 400 Gbit/s links: the ring's time may be mostly alpha on fast ones.
        let beta = ((best - ring_steps * alpha) / bytes).max(8.0 / 400e9);
        // Mid-sized ring and halving-doubling in turn (so that a drift of the machine touches
        // both), after one of each untimed: halving-doubling's links to ranks 2, 4, ... apart
        // have carried only 8-byte messages so far, and a cold TCP window would count against
        // it. Each starts as an op does after its agreement phase: after an 8-byte star
        // all-reduce, not timed (rank 0 hears from every rank, then answers each in turn). The
        // medians are compared.
        let mut mid = vec![0f32; CALIBRATION_MID_BYTES / 4];
        algorithms::ring::all_reduce(&mut ctx, &mut mid, ReduceOp::Sum)?;
        algorithms::halving::all_reduce(&mut ctx, &mut mid, ReduceOp::Sum)?;
        let (mut ring, mut halving) = (Vec::new(), Vec::new());
        for _ in 0..CALIBRATION_MID {
            algorithms::star::all_reduce(&mut ctx, &mut small, ReduceOp::Sum)?;
            let t = std::time::Instant::now();
            algorithms::ring::all_reduce(&mut ctx, &mut mid, ReduceOp::Sum)?;
            ring.push(t.elapsed().as_secs_f64());
            algorithms::star::all_reduce(&mut ctx, &mut small, ReduceOp::Sum)?;
            let t = std::time::Instant::now();
            algorithms::halving::all_reduce(&mut ctx, &mut mid, ReduceOp::Sum)?;
            halving.push(t.elapsed().as_secs_f64());
        }
        let (ring, halving) = (median(ring), median(halving));
        // The largest of every rank's: the rank that found halving-doubling slowest decides.
        let mut agreed = [alpha, beta, halving / ring];
        algorithms::doubling::all_reduce(&mut ctx, &mut agreed, ReduceOp::Max)?;
        let net = Network { alpha: agreed[0], beta: agreed[1], halving_over_ring: agreed[2], ..Network::default() };
        drop(state);
        tracing::info!(target: "oxcomm::plan", rank, alpha_us = net.alpha * 1e6, gbit_per_s = net.gbit_per_s(),
            halving_over_ring = net.halving_over_ring, took_ms = started.elapsed().as_secs_f64() * 1e3,
            "measured the links");
        *self.net.lock().unwrap_or_else(|e| e.into_inner()) = Some(net);
        Ok(net)
    }

    /// Whether ops of `group` can take the direct shared-memory path (world group, shm).
    fn has_direct(&self, group: &GroupView<'_>) -> bool {
        #[cfg(target_os = "linux")]
        return group.id == 0 && self.direct.is_some();
        #[cfg(not(target_os = "linux"))]
        {
            let _ = group;
            false
        }
    }

    /// Runs `f` on the engine's view of this op (the agreement phase first if `route` says so).
    fn run<R>(&self, env: &mut OpEnv<'_>, route: Route, f: impl FnOnce(&mut Ctx<'_>) -> Result<R>) -> Result<R> {
        self.run_direct(env, route, |ctx, _| f(ctx))
    }

    /// [`NativeBackend::run`] for algorithms that may take the direct path: `f` also gets the
    /// direct view (world group on the shm transport), which this backend owns.
    fn run_direct<R>(
        &self,
        env: &mut OpEnv<'_>,
        route: Route,
        f: impl FnOnce(&mut Ctx<'_>, Option<&mut Direct<'_>>) -> Result<R>,
    ) -> Result<R> {
        self.beat(env.now_ns, env.fp);
        let mut state = self.lock();
        #[cfg(target_os = "linux")]
        let State { links, scratch, direct_state, ft } = &mut *state;
        #[cfg(not(target_os = "linux"))]
        let State { links, scratch, ft } = &mut *state;
        if let Some(e) = ft.take_deferred() {
            return Err(e);
        }
        let ctrl_seen = ft.ctrl_seen;
        let (rank, epoch) = (self.rank, ft.epoch);
        let mine = env.fp;
        let cell = RefCell::new(&mut *ft);
        let hook = |links: &mut [Option<Box<dyn Link>>]| cell.borrow_mut().poll(rank, epoch, mine, links);
        let mut ctx = Ctx::new(
            env.group.rank,
            env.group.members,
            links,
            &*self.bell,
            env.timeout,
            env.max_segment_bytes,
            env.stats,
            scratch,
        );
        ctx.cancel = Some(env.cancel);
        ctx.op_word = env.fp.op_word();
        ctx.suspect_after = env.suspect_after;
        ctx.ctrl_seen = ctrl_seen;
        ctx.ft = Some(&hook);
        #[cfg(target_os = "linux")]
        let mut direct =
            self.direct.as_ref().filter(|_| env.group.id == 0).map(|shm| Direct { shm, state: direct_state });
        #[cfg(not(target_os = "linux"))]
        let mut direct: Option<Direct<'_>> = None;
        // Ops that talk over links meet ranks that may run them on the direct path instead
        // (the workspaces are the engine's watch: `Ctx::watched`).
        #[cfg(target_os = "linux")]
        {
            ctx.watch = direct.as_ref().map(|d| d.shm as &dyn PeerWatch);
        }
        let result = match route.agree {
            true => algorithms::star::agree(&mut ctx, env.fp).and_then(|()| f(&mut ctx, direct.as_mut())),
            false => f(&mut ctx, direct.as_mut()),
        };
        let seen = ctx.ctrl_seen;
        ft.ctrl_seen = seen;
        // An op that completed while a control message came (a peer revoked the communicator
        // and gave up on this op, as a rank that was frozen finds when it resumes) fails: it
        // must not complete on this rank when its peers have abandoned it. One load when no
        // message came.
        let count = self.bell.ctrl_count();
        if count != seen && result.is_ok() {
            ft.ctrl_seen = count;
            ft.poll(self.rank, ft.epoch, mine, links)?;
        }
        // A folded all-reduce (no agreement round trip first, `dispatch::folds_agreement`) can
        // complete on a rank that resumes after being frozen from the contributions its peers
        // sent before they gave up on it: look for their revocation behind those bytes too.
        let folded = !route.agree && self.transport == Transport::Tcp;
        env.end_ns = crate::clock::monotonic_ns();
        if result.is_ok() && (folded || env.end_ns.saturating_sub(env.now_ns) >= SLOW_OP_NS) {
            // A slow op may be one of a rank that was frozen and has resumed: on TCP the
            // revocations and the close that left it out sit behind the bytes the op read, and
            // the control count has not moved yet. Look for them before reporting success.
            ft.ctrl_seen = self.bell.ctrl_count();
            ft.poll(self.rank, ft.epoch, mine, links)?;
            if let Some(p) = (0..links.len()).find(|&p| links[p].as_mut().is_some_and(|l| l.left_out_by_peer())) {
                return Err(ft.left_out_by(p));
            }
        }
        if let Err(e) = &result {
            if e.kind() == ErrorKind::PeerGone || e.told_by_close() {
                // A peer that revoked and then left (its thread or process ended) closed its
                // links behind its revocation: the revocation says why.
                ft.poll(self.rank, ft.epoch, mine, links)?;
            }
        }
        result
    }
}

/// The median of `times` (at least one).
fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// How many 8-byte all-reduces [`NativeBackend::calibrate`] times for alpha.
const CALIBRATION_SMALL: usize = 15;
/// How many all-reduces of [`CALIBRATION_BYTES`] it times for beta.
const CALIBRATION_LARGE: usize = 3;
/// Bytes per rank of those: large enough that bytes outweigh steps on 100 Gbit/s links of a
/// few hosts, small enough to take milliseconds on 1 Gbit/s ones.
const CALIBRATION_BYTES: usize = 1 << 20;
/// How many ring and as many halving-doubling all-reduces of [`CALIBRATION_MID_BYTES`] it
/// times (after one of each untimed) to compare the two.
const CALIBRATION_MID: usize = 7;
/// Bytes per rank of those: where halving-doubling's fewer steps show most against the ring's
/// pipelined ones (docs/perf_many_hosts.md, the benchmark's medians: 0.57-0.81 of the ring's
/// time on 8 hosts whose cores set the pace, 0.99-1.15 on tbf-shaped 1 Gbit/s links).
const CALIBRATION_MID_BYTES: usize = 256 << 10;

/// The algorithm of a native route (every native route has one).
fn algo(route: Route) -> Algorithm {
    route.algorithm.unwrap_or(Algorithm::Star)
}

impl Drop for NativeBackend {
    /// A revoked backend that goes away (its process ends after the error) ends each link
    /// with the revocation's culprit (see `FtState::farewell`).
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        state.ft.farewell(&mut state.links);
    }
}

impl Backend for NativeBackend {
    fn transport(&self) -> Transport {
        self.transport
    }

    fn route(
        &self,
        kind: OpKind,
        bytes: usize,
        count: usize,
        group: &GroupView<'_>,
        forced: Option<Algorithm>,
    ) -> Result<Route> {
        // The direct path wins wherever it applies (`plan::choose`'s first rule), whatever the
        // size: taken here before the size rules, as an 8-byte op's whole route.
        let direct = self.has_direct(group);
        if forced.is_none() && direct && plan::candidates(kind).contains(&Algorithm::ShmDirect) {
            let a = Algorithm::ShmDirect;
            return Ok(Route { algorithm: Some(a), name: a.name(), agree: dispatch::agrees(a) });
        }
        let across =
            matches!(kind, OpKind::AllReduce | OpKind::AllReduceCoalesced).then(|| self.across(group)).flatten();
        let a =
            plan::choose(kind, bytes, count, group.size(), forced, direct, group.layout.is_some(), across.as_ref())?;
        let folded = kind == OpKind::AllReduce && dispatch::folds_agreement(a, self.transport, bytes);
        Ok(Route { algorithm: Some(a), name: a.name(), agree: dispatch::agrees(a) && !folded })
    }

    fn revoke(&self, cause: &Error) {
        self.ft_revoke(cause);
    }

    fn agree(&self, env: &mut OpEnv<'_>, flag: u64) -> Result<(u64, Vec<usize>)> {
        self.ft_agree(env, flag)
    }

    fn shrink(&self, env: &mut OpEnv<'_>) -> Result<Shrunk> {
        self.ft_shrink(env)
    }

    fn known_failed(&self) -> Vec<usize> {
        self.lock().ft.failed.iter().copied().collect()
    }

    fn fault_tolerance(&self) -> Result<()> {
        Ok(())
    }

    fn group_needs_op(&self) -> bool {
        false
    }

    fn members_groups(&self) -> Result<()> {
        Ok(())
    }

    fn all_reduce<'b, T: Element>(
        &self,
        env: &mut OpEnv<'_>,
        route: Route,
        io: ReduceBuffers<'b, T>,
        op: ReduceOp,
    ) -> Result<&'b mut [T]> {
        let (layout, fp) = (env.group.layout, env.fp);
        self.run_direct(env, route, |ctx, d| dispatch::all_reduce(ctx, algo(route), route.agree, layout, fp, io, op, d))
    }

    fn reduce<'b, T: Element>(
        &self,
        env: &mut OpEnv<'_>,
        route: Route,
        io: ReduceBuffers<'b, T>,
        root: usize,
        op: ReduceOp,
    ) -> Result<&'b mut [T]> {
        let fp = env.fp;
        self.run_direct(env, route, |ctx, d| dispatch::reduce(ctx, algo(route), fp, io, root, op, d))
    }

    fn broadcast<T: Element>(&self, env: &mut OpEnv<'_>, route: Route, buf: &mut [T], root: usize) -> Result<()> {
        let (layout, fp) = (env.group.layout, env.fp);
        self.run_direct(env, route, |ctx, d| dispatch::broadcast(ctx, algo(route), layout, fp, buf, root, d))
    }

    fn all_gather<T: Element>(&self, env: &mut OpEnv<'_>, route: Route, io: GatherBuffers<'_, T>) -> Result<()> {
        let (layout, fp) = (env.group.layout, env.fp);
        self.run_direct(env, route, |ctx, d| dispatch::all_gather(ctx, algo(route), layout, fp, io, d))
    }

    fn reduce_scatter<'b, T: Element>(
        &self,
        env: &mut OpEnv<'_>,
        route: Route,
        io: ScatterBuffers<'b, T>,
        op: ReduceOp,
    ) -> Result<&'b mut [T]> {
        let (layout, fp) = (env.group.layout, env.fp);
        self.run_direct(env, route, |ctx, d| dispatch::reduce_scatter(ctx, algo(route), layout, fp, io, op, d))
    }

    fn all_to_all<T: Element>(&self, env: &mut OpEnv<'_>, route: Route, io: ExchangeBuffers<'_, T>) -> Result<()> {
        let (n, fp) = (env.group.size(), env.fp);
        let c = io.send_len() / n;
        let ranges: Vec<_> = (0..n).map(|p| p * c..(p + 1) * c).collect();
        self.run_direct(env, route, |ctx, d| dispatch::all_to_all(ctx, algo(route), fp, io, &ranges, &ranges, false, d))
    }

    fn all_to_all_v<T: Element>(
        &self,
        env: &mut OpEnv<'_>,
        route: Route,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let (sr, rr) = (algorithms::schedule::ranges(send_counts), algorithms::schedule::ranges(recv_counts));
        let fp = env.fp;
        let io = ExchangeBuffers::Apart { send, recv };
        self.run_direct(env, route, |ctx, d| dispatch::all_to_all(ctx, algo(route), fp, io, &sr, &rr, true, d))
    }

    fn gather<T: Element>(
        &self,
        env: &mut OpEnv<'_>,
        route: Route,
        io: GatherBuffers<'_, T>,
        root: usize,
    ) -> Result<()> {
        let fp = env.fp;
        self.run_direct(env, route, |ctx, d| dispatch::gather(ctx, algo(route), fp, io, root, d))
    }

    fn scatter<T: Element>(
        &self,
        env: &mut OpEnv<'_>,
        route: Route,
        io: ScatterBuffers<'_, T>,
        root: usize,
    ) -> Result<()> {
        let fp = env.fp;
        self.run_direct(env, route, |ctx, d| dispatch::scatter(ctx, algo(route), fp, io, root, d))
    }

    fn barrier(&self, env: &mut OpEnv<'_>, route: Route) -> Result<()> {
        let fp = env.fp;
        self.run_direct(env, route, |ctx, d| dispatch::barrier(ctx, algo(route), fp, d))
    }

    fn monitored_barrier(&self, env: &mut OpEnv<'_>, route: Route, _timeout: Duration) -> Result<()> {
        // The agreement phase is the barrier; it names the ranks that did not arrive, within
        // the op's timeout (`env.timeout`, which the communicator set to `timeout`).
        self.run(env, route, |_| Ok(()))
    }

    fn all_reduce_coalesced<T: Element>(
        &self,
        env: &mut OpEnv<'_>,
        route: Route,
        bufs: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        self.run(env, route, |ctx| {
            let mut flat = concat(bufs.iter().map(|b| &**b));
            dispatch::all_reduce_in_place(ctx, algo(route), &mut flat, op)?;
            split_back(&flat, bufs);
            Ok(())
        })
    }

    fn all_gather_coalesced<T: Element>(
        &self,
        env: &mut OpEnv<'_>,
        route: Route,
        inputs: &[&[T]],
        outputs: &mut [&mut [T]],
    ) -> Result<()> {
        let n = env.group.size();
        self.run(env, route, |ctx| {
            let flat = concat(inputs.iter().copied());
            let mut all = vec![T::default(); flat.len() * n];
            algorithms::ring::all_gather(ctx, &flat, &mut all)?;
            unpack_gathered(&all, inputs, outputs, n);
            Ok(())
        })
    }

    fn new_group(&self, env: &mut OpEnv<'_>, route: Route, _new: NewGroup) -> Result<()> {
        // Agreeing on the list (its hash is in the fingerprint) is all a native group needs.
        self.run(env, route, |_| Ok(()))
    }

    fn p2p(&self, env: &mut OpEnv<'_>, msgs: &mut [P2pMsg]) -> Result<()> {
        let route = Route { algorithm: None, name: "p2p", agree: false };
        if let [msg] = msgs {
            if msg.is_any_source() {
                return self.run(env, route, |ctx| recv_any(ctx, msg));
            }
        }
        debug_assert!(!msgs.iter().any(P2pMsg::is_any_source), "a receive from any source runs alone");
        self.run(env, route, |ctx| {
            // Each message is its header, then its payload, in the stream to its peer, so a
            // stream reads the same however the two sides grouped their messages into batches.
            // Every transfer of the batch moves at once (the engine keeps each peer's stream in
            // order), so payloads flow both ways and an exchange cannot deadlock; a receive
            // checks the header before it reads any payload.
            let expect: Vec<(usize, Fingerprint)> = msgs.iter().map(|m| (m.peer, m.fp)).collect();
            let checks: Vec<_> =
                expect.iter().map(|(peer, fp)| move |got: &[u8]| P2pMsg::check_header_of(fp, *peer, got)).collect();
            let mut heads = vec![[0u8; FP_BYTES]; msgs.len()];
            let mut xfers: Vec<Xfer<'_>> = Vec::with_capacity(2 * msgs.len());
            for ((msg, head), check) in msgs.iter_mut().zip(heads.iter_mut()).zip(&checks) {
                if msg.is_send {
                    xfers.push(Xfer::send(msg.peer, &msg.header));
                    xfers.push(Xfer::send(msg.peer, &msg.bytes));
                } else {
                    xfers.push(Xfer::recv_checked(msg.peer, head, check, &mut msg.bytes));
                }
            }
            // A header that does not match may be a dead rank's leftover (a message nobody
            // received): then its death is the error, not a mismatch.
            ctx.run(&mut xfers).map_err(|e| ctx.blame_the_dead(e))
        })
    }
}

/// A receive from any source: waits until one candidate's stream starts with this receive's
/// header (the others' messages stay unread: another tag's, another group's, or an op they
/// started already), then reads that header and the payload from it.
fn recv_any(ctx: &mut Ctx<'_>, msg: &mut P2pMsg) -> Result<()> {
    // The ranks in `any_of` are world ranks, and so are this op's group ranks (the world).
    let peers: Vec<usize> = msg.any_of.iter().map(|&(peer, _)| peer).collect();
    let seen: RefCell<Vec<Option<Fingerprint>>> = RefCell::new(vec![None; peers.len()]);
    let describe = || {
        let mut text = format!("a message with tag {} from any of ranks {peers:?}", msg.fp.extra);
        for (p, fp) in peers.iter().zip(seen.borrow().iter()) {
            if let Some(fp) = fp {
                text.push_str(&format!("; rank {p}'s next message is {fp}"));
            }
        }
        text
    };
    let mut head = [0u8; FP_BYTES];
    let src = ctx.wait_for_head(&peers, &mut head, &describe, |p, got| {
        let i = peers.iter().position(|&q| q == p).expect("a candidate");
        seen.borrow_mut()[i] = Fingerprint::decode(got).ok();
        msg.fits_any(i, got)
    })?;
    let i = peers.iter().position(|&q| q == src).expect("a candidate");
    msg.take_sender(i);
    let mut got = [0u8; FP_BYTES];
    ctx.run(&mut [Xfer::recv(src, &mut got), Xfer::recv(src, &mut msg.bytes)])
}
