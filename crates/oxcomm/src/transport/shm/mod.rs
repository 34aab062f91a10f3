//! Shared-memory transport for ranks (processes, or threads in tests) on one host.
//!
//! This file owns the endpoint: the setup of per-rank POSIX shared-memory segments, the
//! transport's settings and the hand-out of the [`ShmLink`]s (in `link.rs`) and the
//! [`ShmDoorbell`] (in `futex.rs`) that implement the [transport contract](crate::transport)
//! over them. The ring lives in `ring.rs`, the segment and its header in `segment.rs` and
//! `layout.rs`, the direct collectives' view in `workspace.rs`. It knows nothing about
//! collectives, and nothing about how ranks find each other: the caller coordinates the two
//! setup phases (for example through a key-value store).
//!
//! # Design
//!
//! Each rank creates ONE segment, `/dev/shm/oxcomm-{job}-{rank}`, holding a versioned header,
//! its doorbell (a process-shared futex word) and one inbound single-producer/single-consumer
//! byte ring per local peer: peer `p` writes into ring `p` of my segment and only I read it.
//! So a message is copied once into the receiver's segment and once out of it (or consumed in
//! place with [`Link::recv_with`]). Ring counters sit on separate 128-byte lines; a sender
//! rings the receiver's doorbell after writing, a receiver rings the sender's after freeing
//! space; a waiter spins a few µs, yields, then sleeps on the futex (ranks often outnumber
//! cores).
//!
//! # Setup
//!
//! 1. Every rank calls [`ShmEndpoint::create`] (creation must precede attaching).
//! 2. Every rank calls [`ShmEndpoint::attach`] with its local peers (retries until their
//!    segments appear, up to a deadline, and validates their headers).
//! 3. Once *every* rank has attached (the caller knows through its store, or by
//!    [`ShmEndpoint::wait_attached`]), each calls [`ShmEndpoint::unlink_own`]; mappings stay
//!    valid, and nothing is left in `/dev/shm` even if a process is killed later.
//! 4. [`ShmEndpoint::into_parts`] hands out the links and the doorbell.
//!
//! A segment's name is also unlinked when its owner drops it, so a failed setup leaves no file
//! behind (unless the process is killed between steps 1 and 3).
//!
//! # Peer failure
//!
//! A link notices a peer that dropped its link (a flag in the ring), and a peer *process* that
//! died (a `pidfd` polled by [`Link::check_peer`], falling back to `kill(pid, 0)`), and reports
//! [`ErrorKind::PeerGone`] naming the peer once the bytes it sent are drained, or at once
//! to a wait that does not read the link ([`Link::check_alive`]: bytes a dead peer left
//! unread in a ring do not hide its death from the direct collectives). A death is known at
//! once, not at a waiter's next periodic check: a per-process watcher thread (`watch.rs`)
//! sleeps in `poll` on every peer's pidfd and, when one exits, marks it gone and rings the
//! doorbell of the rank that talks to it ([`Doorbell::deaths`] counts these rings, so the
//! woken wait checks its peers then). Pids are
//! compared within one pid namespace: ranks sharing `/dev/shm` across pid namespaces are not
//! supported.
//!
//! # Not guaranteed
//!
//! A peer process is trusted not to write into the data of rings it does not own; a corrupt
//! ring *counter* is detected and reported as [`ErrorKind::Protocol`], corrupt bytes are not.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Doorbell, Link};
use crate::error::{Error, ErrorKind, Result};

mod futex;
mod layout;
mod link;
mod ring;
mod segment;
pub(crate) mod single_copy;
mod sync;
mod watch;
pub mod workspace;

pub use futex::ShmDoorbell;
pub use link::ShmLink;

use link::PeerProcess;
use segment::{Layout, Segment, MAX_RING_BYTES, MIN_RING_BYTES};

/// Longest accepted job name.
pub const MAX_JOB_LEN: usize = 64;

/// Settings of the shared-memory transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmConfig {
    /// Bytes of each inbound ring (one per local peer), a power of two from 4 KiB to 1 GiB.
    /// Env `OXCOMM_SHM_RING_BYTES`; default 1 MiB.
    pub ring_bytes: usize,
    /// How long a doorbell wait spins before yielding and sleeping on the futex.
    /// Env `OXCOMM_SHM_SPIN_US` (µs); default 5 µs (see [`ShmConfig::for_local_ranks`]).
    pub spin: Duration,
    /// How long a wait then keeps yielding the core (so an oversubscribed peer can run) before
    /// it sleeps on the futex. Env `OXCOMM_SHM_YIELD_US` (µs); default 100 µs.
    pub yield_for: Duration,
}

impl Default for ShmConfig {
    fn default() -> ShmConfig {
        ShmConfig { ring_bytes: 1 << 20, spin: Duration::from_micros(5), yield_for: Duration::from_micros(100) }
    }
}

impl ShmConfig {
    /// The defaults for `local_ranks` ranks on this host: with a core per rank, waits spin
    /// for 50 µs (waking a sleeping process costs ~30 µs); oversubscribed, they do not spin
    /// but yield at once, so the rank being waited for gets the core (measured with 4 ranks on
    /// 2 cores: 12 µs per 8-byte all-reduce, against 23 µs with a 2 µs spin).
    pub fn for_local_ranks(local_ranks: usize) -> ShmConfig {
        ShmConfig::for_local_ranks_on(local_ranks, std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// [`ShmConfig::for_local_ranks`] on a host where the ranks share `cores` cores (counted
    /// before any rank was pinned to one of them: a pinned rank sees a single core).
    pub fn for_local_ranks_on(local_ranks: usize, cores: usize) -> ShmConfig {
        let spin = if local_ranks <= cores { Duration::from_micros(50) } else { Duration::ZERO };
        ShmConfig { spin, ..ShmConfig::default() }
    }

    /// The defaults, overridden by `OXCOMM_SHM_RING_BYTES` and `OXCOMM_SHM_SPIN_US` where set.
    pub fn from_env() -> Result<ShmConfig> {
        ShmConfig::default().with_env()
    }

    /// `self`, overridden by `OXCOMM_SHM_RING_BYTES`, `OXCOMM_SHM_SPIN_US` and
    /// `OXCOMM_SHM_YIELD_US` where set.
    pub fn with_env(self) -> Result<ShmConfig> {
        let mut c = self;
        let parse = |var: &str| -> Result<Option<u64>> {
            match std::env::var(var) {
                Ok(v) => v
                    .trim()
                    .parse::<u64>()
                    .map(Some)
                    .map_err(|_| Error::invalid(format!("{var}={v:?} is not a non-negative integer"))),
                Err(_) => Ok(None),
            }
        };
        if let Some(b) = parse("OXCOMM_SHM_RING_BYTES")? {
            c.ring_bytes = usize::try_from(b).unwrap_or(usize::MAX);
        }
        if let Some(us) = parse("OXCOMM_SHM_SPIN_US")? {
            c.spin = Duration::from_micros(us);
        }
        if let Some(us) = parse("OXCOMM_SHM_YIELD_US")? {
            c.yield_for = Duration::from_micros(us);
        }
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<()> {
        if !self.ring_bytes.is_power_of_two() || !(MIN_RING_BYTES..=MAX_RING_BYTES).contains(&self.ring_bytes) {
            return Err(Error::invalid(format!(
                "shm ring size {} must be a power of two from {MIN_RING_BYTES} to {MAX_RING_BYTES}",
                self.ring_bytes
            )));
        }
        Ok(())
    }
}

/// Checks that `job` is 1..=64 characters of `[A-Za-z0-9_-]`.
pub fn validate_job(job: &str) -> Result<()> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if job.is_empty() || job.len() > MAX_JOB_LEN || !job.chars().all(ok_char) {
        return Err(Error::invalid(format!("job name {job:?} must be 1 to {MAX_JOB_LEN} characters of [A-Za-z0-9_-]")));
    }
    Ok(())
}

/// The POSIX shared-memory name of rank `rank`'s segment in `job` (`/oxcomm-{job}-{rank}`,
/// i.e. the file `/dev/shm/oxcomm-{job}-{rank}`).
pub fn segment_name(job: &str, rank: usize) -> String {
    format!("/oxcomm-{job}-{rank}")
}

/// One rank's shared-memory transport during setup: its own segment, and the links to the
/// peers attached so far. See the [module docs](self) for the setup sequence.
pub struct ShmEndpoint {
    job: String,
    rank: usize,
    world: usize,
    config: ShmConfig,
    own: Arc<Segment>,
    links: Vec<Option<ShmLink>>,
}

impl std::fmt::Debug for ShmEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmEndpoint")
            .field("segment", &self.own.name())
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

impl ShmEndpoint {
    /// Creates this rank's segment with one inbound ring per rank in `local_peers` (ranks of
    /// other hosts are simply left out). Fails if a segment of that name exists already (a
    /// stale one from an earlier run with the same job name: remove it or pick another name).
    pub fn create(
        job: &str,
        rank: usize,
        world: usize,
        local_peers: &[usize],
        config: &ShmConfig,
    ) -> Result<ShmEndpoint> {
        validate_job(job)?;
        config.validate()?;
        if rank >= world {
            return Err(Error::invalid(format!("rank {rank} is not below world size {world}")));
        }
        let mut ring_of = vec![None; world];
        for (slot, &p) in local_peers.iter().enumerate() {
            if p >= world || p == rank {
                return Err(Error::invalid(format!(
                    "local peer {p} of rank {rank} must be another rank below {world}"
                ))
                .with_rank(rank));
            }
            if ring_of[p].replace(slot).is_some() {
                return Err(Error::invalid(format!("local peer {p} listed twice")).with_rank(rank));
            }
        }
        let layout = Layout::new(world, local_peers.len(), config.ring_bytes).ok_or_else(|| {
            Error::invalid(format!(
                "shm segment for world {world} with {} rings of {} bytes is too large",
                local_peers.len(),
                config.ring_bytes
            ))
        })?;
        let name = segment_name(job, rank);
        let own = Segment::create(&name, rank, layout, &ring_of).map_err(|e| e.with_rank(rank))?;
        tracing::debug!(target: "oxcomm::shm", rank, world, segment = %name,
            bytes = layout.total_bytes, "created segment");
        Ok(ShmEndpoint {
            job: job.to_string(),
            rank,
            world,
            config: config.clone(),
            own: Arc::new(own),
            links: (0..world).map(|_| None).collect(),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The world size.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Opens and maps every listed peer's segment, waiting for it to be created until
    /// `deadline` ([`ErrorKind::Timeout`] then), validates its header (magic, version, world,
    /// owner rank, layout; [`ErrorKind::Protocol`] if stale or foreign) and builds the link.
    /// Each peer must have been listed in `local_peers` at [`ShmEndpoint::create`], and must
    /// list this rank likewise. May be called more than once, with different peers.
    pub fn attach(&mut self, peers: &[usize], deadline: Instant) -> Result<()> {
        self.attach_watching(peers, deadline, &|| Ok(()))
    }

    /// [`ShmEndpoint::attach`] for a caller that can tell whether the job has failed meanwhile
    /// (through its store: [`crate::rendezvous::Store::check_job`]): `watch` runs while a
    /// peer's segment is not there yet (every [`ShmEndpoint::SETUP_WATCH_INTERVAL`]), and its
    /// error ends the attach. A segment that was published and is not there has been unlinked
    /// by its owner, which failed, or by a rank that found its owner dead; either publishes
    /// why, and without the watch this rank would wait for the segment until `deadline`.
    pub fn attach_watching(
        &mut self,
        peers: &[usize],
        deadline: Instant,
        watch: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        for &p in peers {
            self.attach_one(p, deadline, watch).map_err(|e| e.with_peer(p).with_rank(self.rank))?;
        }
        Ok(())
    }

    fn attach_one(&mut self, p: usize, deadline: Instant, watch: &dyn Fn() -> Result<()>) -> Result<()> {
        let my_slot = self.own.slot_of(p).ok_or_else(|| {
            Error::invalid(format!("rank {p} was not among the local peers given when creating the segment"))
        })?;
        if self.links[p].is_some() {
            return Err(Error::invalid(format!("rank {p} is already attached")));
        }
        let seg =
            Segment::attach(&segment_name(&self.job, p), p, self.world, deadline, watch, Self::SETUP_WATCH_INTERVAL)?;
        let their_slot = seg.slot_of(self.rank).ok_or_else(|| {
            Error::protocol(format!(
                "rank {p}'s segment has no ring for rank {}: it was created without this \
                 rank among its local peers",
                self.rank
            ))
        })?;
        let process = PeerProcess::open(seg.owner_pid(), &self.own).map_err(|why| {
            Error::protocol(format!("rank {p}'s shared-memory segment /dev/shm{} is stale: {why}", seg.name()))
        })?;
        let seg = Arc::new(seg);
        let tx = seg.producer(their_slot);
        // Tell the owner we have mapped its segment (see `wait_attached`).
        tx.ctrl().flags.0.writer_attached.store(1, Ordering::Release);
        seg.bell().ring();
        let link = ShmLink {
            rank: self.rank,
            peer: p,
            tx,
            rx: self.own.consumer(my_slot),
            ctrl_tx: seg.ctrl_producer(their_slot),
            ctrl_rx: self.own.ctrl_consumer(my_slot),
            peer_seg: seg,
            process,
            process_gone: false,
        };
        tracing::debug!(target: "oxcomm::shm", rank = self.rank, peer = p, "attached");
        self.links[p] = Some(link);
        Ok(())
    }

    /// How often the set-up waits ([`ShmEndpoint::attach_watching`],
    /// [`ShmEndpoint::wait_attached_watching`]) look whether the peers they wait for are alive
    /// and run the caller's watch (one store round trip in `init`).
    pub const SETUP_WATCH_INTERVAL: Duration = Duration::from_millis(50);

    /// Waits until each of `peers` has attached to this rank's segment (each attach sets a
    /// flag in its ring here and rings this rank's doorbell), so that [`unlink_own`] is safe
    /// without another round through the caller's store. [`ErrorKind::Timeout`] naming the
    /// first missing peer at `deadline`; [`ErrorKind::PeerGone`] naming a missing peer as soon
    /// as this rank attached to its segment and its process has exited since (every missing
    /// peer is looked at, not only the first).
    ///
    /// [`unlink_own`]: ShmEndpoint::unlink_own
    pub fn wait_attached(&self, peers: &[usize], deadline: Instant) -> Result<()> {
        self.wait_attached_watching(peers, deadline, &|| Ok(()))
    }

    /// [`ShmEndpoint::wait_attached`] for a caller that can tell whether the job has failed
    /// meanwhile (see [`ShmEndpoint::attach_watching`]): `watch` runs every
    /// [`ShmEndpoint::SETUP_WATCH_INTERVAL`], and its error ends the wait. A live peer that
    /// failed to attach to a third rank's segment never attaches here either; only its
    /// published failure tells. The watch also runs before a dead peer is reported, so a
    /// peer that exited after publishing why it failed (an error whose peer is that rank) is
    /// reported with its reason.
    pub fn wait_attached_watching(
        &self,
        peers: &[usize],
        deadline: Instant,
        watch: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let bell = self.own.bell();
        let mut watched = Instant::now();
        loop {
            let epoch = bell.epoch.load(Ordering::SeqCst);
            let mut missing = Vec::new();
            for &p in peers {
                let slot = self.own.slot_of(p).ok_or_else(|| {
                    Error::invalid(format!("rank {p} is not a local peer of this segment")).with_rank(self.rank)
                })?;
                let flags = &self.own.ring_ctrl(slot).flags.0;
                if flags.writer_attached.load(Ordering::Acquire) == 0 {
                    missing.push(p);
                }
            }
            let Some(&first) = missing.first() else { return Ok(()) };
            // A peer that died after publishing its segment never attaches: name it now (with
            // the failure it published before it exited, if the watch has one from it), and
            // take its name out of /dev/shm (nobody else will).
            if let Some(p) = missing.iter().copied().find(|&p| self.links[p].as_ref().is_some_and(|l| l.process.gone()))
            {
                if let Err(e) = watch() {
                    if e.peer() == Some(p) {
                        let _ = rustix::shm::unlink(segment_name(&self.job, p).as_str());
                        return Err(e.with_rank(self.rank));
                    }
                }
                let _ = rustix::shm::unlink(segment_name(&self.job, p).as_str());
                return Err(Error::new(
                    ErrorKind::PeerGone,
                    format!("rank {p} is gone (its process exited before it attached to this rank's segment)"),
                )
                .with_peer(p)
                .with_rank(self.rank));
            }
            let now = Instant::now();
            if now >= watched + Self::SETUP_WATCH_INTERVAL {
                watched = now;
                watch().map_err(|e| e.with_rank(self.rank))?;
            }
            if now >= deadline {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("timed out waiting for rank(s) {missing:?} to attach to this rank's segment"),
                )
                .with_peer(first)
                .with_rank(self.rank));
            }
            bell.wait(epoch, deadline.min(now + Self::SETUP_WATCH_INTERVAL), self.config.spin, self.config.yield_for);
        }
    }

    /// Removes this rank's segment name from `/dev/shm`. Call once every peer has attached
    /// (later attaches would fail); the mappings stay valid. Idempotent.
    pub fn unlink_own(&self) -> Result<()> {
        self.own.unlink().map_err(|e| e.with_rank(self.rank))
    }

    /// The direct-collectives view of every rank's workspace, when every rank of the world
    /// is attached (all on this host); `None` otherwise.
    pub fn direct(&self) -> Option<workspace::ShmDirect> {
        let mut segs = Vec::with_capacity(self.world);
        for r in 0..self.world {
            if r == self.rank {
                segs.push(self.own.clone());
            } else {
                segs.push(self.links[r].as_ref()?.peer_seg.clone());
            }
        }
        // Polling peers before the doorbell only pays when each rank has its own core.
        let polls = if self.config.spin.is_zero() { 0 } else { workspace::ARRIVAL_POLLS };
        Some(workspace::ShmDirect::new(self.rank, segs, polls))
    }

    /// The links indexed by world rank (`None` for this rank and unattached ranks), and this
    /// rank's doorbell.
    #[allow(clippy::type_complexity)] // the shape every transport hands to the communicator
    pub fn into_parts(mut self) -> (Vec<Option<Box<dyn Link>>>, Arc<dyn Doorbell>) {
        let (links, bell) = self.take_parts();
        let links = links.into_iter().map(|l| l.map(|l| Box::new(l) as Box<dyn Link>)).collect();
        (links, bell)
    }

    /// As [`ShmEndpoint::into_parts`], with the concrete types.
    pub fn into_shm_parts(mut self) -> (Vec<Option<ShmLink>>, Arc<ShmDoorbell>) {
        self.take_parts()
    }

    fn take_parts(&mut self) -> (Vec<Option<ShmLink>>, Arc<ShmDoorbell>) {
        let links = std::mem::take(&mut self.links);
        let bell = Arc::new(ShmDoorbell::new(self.own.clone(), self.config.spin, self.config.yield_for));
        (links, bell)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_names() {
        assert!(validate_job("job_1-a").is_ok());
        assert!(validate_job("").is_err());
        assert!(validate_job("a/b").is_err());
        assert!(validate_job("a.b").is_err());
        assert!(validate_job(&"x".repeat(65)).is_err());
        assert!(validate_job(&"x".repeat(64)).is_ok());
    }

    #[test]
    fn config_checks_ring_size() {
        let bad = ShmConfig { ring_bytes: 5000, ..ShmConfig::default() };
        assert_eq!(ShmEndpoint::create("cfgcheck", 0, 2, &[1], &bad).unwrap_err().kind(), ErrorKind::InvalidArgument);
    }
}
