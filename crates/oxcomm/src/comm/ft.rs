//! Surviving a rank's death: [`Communicator::revoke`], [`Communicator::agree`],
//! [`Communicator::shrink`], and what a communicator knows of failed members.
//!
//! The three calls are ULFM's (`MPIX_Comm_revoke`, `MPIX_Comm_agree`, `MPIX_Comm_shrink`),
//! on oxcomm's own links: the protocol is the native backend's (`backend/native_ft.rs`), the
//! agreement's proof in [`crate::algorithms::agreement`]. The MPI backend calls ULFM where
//! the MPI library has a working one (`backend/mpi/ulfm.rs`) and answers
//! [`ErrorKind::Unsupported`] elsewhere.
//!
//! A revocation covers everything that shares the communicator's links: the world it was
//! made from and every group made from that world. Agreeing and shrinking are calls of that
//! world: a group is made again from the shrunk world.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::core::Core;
use super::{Communicator, Group, OpOptions};
use crate::backend::{Backend, GroupView, OpEnv};
use crate::engine::LinkStats;
use crate::error::{Error, ErrorKind, Result};
use crate::wire::{Fingerprint, OpKind};

/// What [`Communicator::agree`] returns, the same on every member that returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Agreed {
    /// The bitwise AND of the `flag`s of every member outside `failed`.
    pub flag: u64,
    /// The members (group ranks, ascending) that failed before or during the agreement and
    /// took no part: those every survivor leaves out when it shrinks.
    pub failed: Vec<usize>,
}

impl Communicator {
    /// Revokes the communicator on every member: every op of it that is pending or issued
    /// later fails at once, here and on every peer (however far each has got), with an
    /// [`ErrorKind::Revoked`] error naming this rank. No op of a revoked communicator
    /// completes on one rank and hangs on another. The links stay open for
    /// [`Communicator::agree`] and [`Communicator::shrink`].
    ///
    /// A failure inside an op (a dead or suspected peer, a timeout, a mismatch) revokes the
    /// communicator the same way, naming the rank to blame. Revoking covers the world this
    /// communicator shares its links with and every group made from it. Calling it again
    /// does nothing.
    ///
    /// ```
    /// use oxcomm::{threads, ErrorKind, ReduceOp};
    ///
    /// let out = threads::run(3, |comm| {
    ///     if comm.rank() == 0 {
    ///         comm.revoke()?;
    ///     }
    ///     // Every rank's next op fails, naming rank 0.
    ///     let err = comm.all_reduce(&mut [1.0f32], ReduceOp::Sum).unwrap_err();
    ///     assert_eq!((err.kind(), err.peer()), (ErrorKind::Revoked, Some(0)));
    ///     Ok::<_, oxcomm::Error>(())
    /// })?;
    /// assert!(out.iter().all(|r| r.is_ok()));
    /// # Ok::<(), oxcomm::Error>(())
    /// ```
    pub fn revoke(&self) -> Result<()> {
        let me = self.core.world_rank;
        self.core.backend.fault_tolerance().map_err(|e| e.with_rank(me))?;
        self.core.fail(
            Error::new(ErrorKind::Revoked, format!("rank {me} revoked the communicator (it called revoke)"))
                .with_peer(me)
                .with_rank(me),
        );
        Ok(())
    }

    /// Whether the communicator is revoked (by this rank, a peer, or a failure).
    pub fn is_revoked(&self) -> bool {
        self.core.aborted.load(Ordering::SeqCst)
    }

    /// The members (group ranks, ascending) this rank knows have failed: found dead,
    /// suspected after the heartbeat lapse ([`crate::CommConfig::suspect_after`]), named by a
    /// peer, or left out by an agreement. Local knowledge, as ULFM's
    /// `MPIX_Comm_get_failed`: [`Communicator::agree`] makes it the same everywhere.
    pub fn failed_ranks(&self) -> Vec<usize> {
        let failed = self.core.backend.known_failed();
        (0..self.size()).filter(|r| failed.contains(&self.group.members[*r])).collect()
    }

    /// Fault-tolerant agreement (ULFM's `MPIX_Comm_agree`): every member that returns gets
    /// the same [`Agreed`]: the bitwise AND of the `flag`s of the members that took part, and
    /// the members that did not (they failed before or during it). Members may fail while it
    /// runs, the coordinator included; a member that the others declared failed (one that was
    /// frozen and came back) gets an [`ErrorKind::Revoked`] error instead of a value. Works
    /// on a revoked communicator, and on a healthy one (then it is an all-reduce of `flag`
    /// with AND that survives failures). Collective over the world of the links: call it on
    /// the world communicator (a group's call is [`ErrorKind::Unsupported`]).
    ///
    /// ```
    /// use oxcomm::threads;
    ///
    /// let out = threads::run(3, |comm| comm.agree(if comm.rank() == 1 { 0b01 } else { 0b11 }))?;
    /// for a in out {
    ///     assert_eq!(a?, oxcomm::Agreed { flag: 0b01, failed: vec![] });
    /// }
    /// # Ok::<(), oxcomm::Error>(())
    /// ```
    pub fn agree(&self, flag: u64) -> Result<Agreed> {
        self.check_world("agree")?;
        let fp = self.fingerprint(OpKind::Agree);
        let (flag, failed) = self.run_ft(fp, |b, env| b.agree(env, flag))?;
        let failed = failed.iter().filter_map(|w| self.group.members.iter().position(|m| m == w)).collect();
        Ok(Agreed { flag, failed })
    }

    /// A new communicator of the survivors (ULFM's `MPIX_Comm_shrink`): revokes this one if
    /// it is not yet, agrees with the others on the failed members ([`Communicator::agree`])
    /// and returns a communicator of the rest, ranks renumbered in the old order, with its own
    /// sequence numbers. It runs on the links the job already has (no store, no new
    /// connection): each survivor's link drops what the abandoned ops left in it. The shrunk
    /// communicator has no direct shared-memory path (its ops run over the links), and takes
    /// this one's settings, timeouts included.
    ///
    /// Collective over the survivors of the world communicator. A member the others left out
    /// (a frozen one that came back) gets [`ErrorKind::Revoked`], as do all its later ops
    /// here. A member that fails while it runs is left out, or, if it fails after the
    /// agreement, found by the shrunk communicator's first op: shrink again then.
    ///
    /// ```
    /// use oxcomm::{threads, ReduceOp};
    ///
    /// let out = threads::run(3, |comm| {
    ///     if comm.rank() == 2 {
    ///         return Ok(None); // rank 2 leaves: its links close when `comm` drops
    ///     }
    ///     // Rank 2's departure fails this op (or the next); then the others go on without it.
    ///     let _ = comm.barrier();
    ///     let _ = comm.barrier();
    ///     let small = comm.shrink()?;
    ///     let mut v = [1.0f32];
    ///     small.all_reduce(&mut v, ReduceOp::Sum)?;
    ///     Ok::<_, oxcomm::Error>(Some((small.rank(), small.size(), v[0])))
    /// })?;
    /// assert_eq!(out[0].as_ref().unwrap(), &Some((0, 2, 2.0)));
    /// assert_eq!(out[1].as_ref().unwrap(), &Some((1, 2, 2.0)));
    /// # Ok::<(), oxcomm::Error>(())
    /// ```
    pub fn shrink(&self) -> Result<Communicator> {
        self.check_world("shrink")?;
        let me = self.core.world_rank;
        if !self.is_revoked() {
            self.core.fail(
                Error::new(ErrorKind::Revoked, format!("rank {me} revoked the communicator to shrink it"))
                    .with_peer(me)
                    .with_rank(me),
            );
        }
        let fp = self.fingerprint(OpKind::Shrink);
        let shrunk = self.run_ft(fp, |b, env| b.shrink(env))?;
        let size = shrunk.survivors.len();
        let hosts: Vec<usize> = shrunk.survivors.iter().map(|&w| self.core.hosts[w]).collect();
        let mut core = Core::new(shrunk.rank, size, shrunk.backend, self.core.config.clone());
        core.hosts = hosts;
        // The survivors can grow back through the store the world met at.
        *core.origin.get_mut().unwrap_or_else(|e| e.into_inner()) = self.origin();
        let core = Arc::new(core);
        // The old core keeps what must outlive every communicator of the job (the store).
        core.keep.lock().unwrap_or_else(|e| e.into_inner()).push(Box::new(self.core.clone()));
        let epoch_id = 2 * (self.group.id / 2 + 1);
        let group = Group::new(epoch_id, (0..size).collect(), shrunk.rank, &core.hosts);
        group.timeout_ns.store(self.group.timeout_ns.load(Ordering::Relaxed), Ordering::Relaxed);
        Ok(Communicator { core, group: Arc::new(group) })
    }

    /// Fails unless this is the world communicator of its links (the one made by
    /// [`crate::init`], [`crate::threads::run`] or [`Communicator::shrink`]) and its backend
    /// does fault tolerance.
    pub(crate) fn check_world(&self, what: &str) -> Result<()> {
        let me = self.core.world_rank;
        self.core.backend.fault_tolerance().map_err(|e| e.with_rank(me))?;
        if self.group.id % 2 == 1 || self.size() != self.core.world_size {
            return Err(Error::unsupported(format!(
                "{what} on a group: call it on the world communicator it was made from, then make the group again"
            ))
            .with_rank(me));
        }
        Ok(())
    }

    /// Runs a fault-tolerance op: its turn (even on a revoked communicator), a sequence
    /// number, the flight recorder; an error does not revoke (the caller decides).
    fn run_ft<R>(
        &self,
        mut fp: Fingerprint,
        body: impl FnOnce(&crate::backend::AnyBackend, &mut OpEnv<'_>) -> Result<R>,
    ) -> Result<R> {
        let ticket = self.core.draw_ticket();
        let core = &*self.core;
        let timeout = OpOptions::default().timeout.unwrap_or_else(|| self.timeout());
        let _turn = core.await_turn(ticket, timeout, true, || self.describe(&fp))?;
        fp.seq = self.group.seq.load(Ordering::Relaxed);
        self.group.seq.store(fp.seq + 1, Ordering::Release);
        let now_ns = crate::clock::monotonic_ns();
        let flight = core.flight.start_at(&fp, "ft", None, now_ns);
        let mut stats = LinkStats::default();
        let mut env = OpEnv {
            fp: &fp,
            group: GroupView {
                id: self.group.id,
                rank: self.group.rank,
                members: &self.group.members,
                layout: self.group.layout.as_ref(),
            },
            timeout,
            max_segment_bytes: core.config.max_segment_bytes,
            stats: &mut stats,
            cancel: &core.aborted,
            suspect_after: core.config.suspect_after,
            now_ns,
            end_ns: 0,
        };
        let result = crate::unwind::catch(core.world_rank, || body(&core.backend, &mut env));
        match &result {
            Ok(_) => core.flight.finish(flight, Ok(())),
            Err(e) => core.flight.finish(flight, Err(e)),
        }
        result.map_err(|e| e.with_op(fp.to_string()).with_rank(core.world_rank))
    }
}
