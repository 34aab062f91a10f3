//! Point-to-point ops: `send`/`recv` and their async forms `isend`/`irecv`.
//!
//! A message is a 48-byte header (the fingerprint: dtype, count, tag and the per-pair sequence
//! number) and then the payload; the receiver checks the header before reading any payload.
//! Pending `isend`/`irecv`s start together as one batch (headers both ways, then payloads both
//! ways), so an exchange cannot deadlock; the batch takes one turn like any other op.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::core::Core;
use super::work::{Slot, Work};
use super::Communicator;
use crate::backend::{Backend, GroupView, OpEnv, P2pMsg};
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::error::Result;
use crate::wire::{Fingerprint, OpKind, FP_BYTES};

impl Communicator {
    /// Sends `buf` to group rank `dst` with `tag`. Messages between two ranks are matched in
    /// order; the receiver checks dtype, count and tag and fails on a mismatch.
    pub fn send<T: Element>(&self, buf: &[T], dst: usize, tag: u32) -> Result<()> {
        let fp = self.p2p_fp::<T>(buf.len(), dst, tag)?;
        self.core.check_alive(|| fp.to_string())?;
        let ticket = self.core.draw_ticket();
        let mut job = P2pJob::send(self.group.members[dst], as_bytes(buf).to_vec(), fp, None);
        self.core.run_p2p(ticket, std::slice::from_mut(&mut job.msg))?;
        Ok(())
    }

    /// Receives into `buf` from group rank `src`; the message must carry `tag` and exactly
    /// `buf.len()` elements of `T`, or this fails (naming the sender) without touching `buf`.
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u32) -> Result<()> {
        let fp = self.p2p_fp::<T>(buf.len(), src, tag)?;
        self.core.check_alive(|| fp.to_string())?;
        let ticket = self.core.draw_ticket();
        let mut job = P2pJob::recv(self.group.members[src], vec![0u8; std::mem::size_of_val(buf)], fp, None);
        self.core.run_p2p(ticket, std::slice::from_mut(&mut job.msg))?;
        as_bytes_mut(buf).copy_from_slice(&job.msg.bytes);
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

    pub(super) fn p2p_fp<T: Element>(&self, count: usize, peer: usize, tag: u32) -> Result<Fingerprint> {
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
}

impl Core {
    /// Starts every pending `isend`/`irecv` as one batch on the async worker.
    pub(super) fn flush_p2p(self: &Arc<Self>) {
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
            let (mut msgs, slots): (Vec<P2pMsg>, Vec<_>) = jobs.into_iter().map(|j| (j.msg, j.slot)).unzip();
            let result = core.run_p2p(ticket, &mut msgs);
            for (msg, slot) in msgs.into_iter().zip(slots) {
                if let Some(slot) = slot {
                    slot.complete(match &result {
                        Ok(()) => Ok(msg.bytes),
                        Err(e) => Err(e.clone()),
                    });
                }
            }
        }));
    }

    /// Runs point-to-point messages together under `ticket`, on the backend.
    pub(super) fn run_p2p(&self, ticket: u64, msgs: &mut [P2pMsg]) -> Result<()> {
        let timeout = self.config.timeout;
        let first = msgs.first().map(|m| m.fp.to_string()).unwrap_or_default();
        let _turn = self.await_turn(ticket, timeout, || first.clone())?;
        self.check_alive(|| first.clone())?;
        let mut state = self.lock_state();
        // Stamp per-pair sequence numbers in issue order.
        for msg in msgs.iter_mut() {
            let counter = if msg.is_send { &mut state.p2p_sent[msg.peer] } else { &mut state.p2p_received[msg.peer] };
            msg.fp.seq = *counter;
            *counter += 1;
            msg.header = msg.fp.encode();
        }
        let members: Vec<usize> = (0..self.world_size).collect();
        let flight = msgs.first().map(|m| self.flight.start(&m.fp, "p2p", Some(m.peer)));
        let fp = msgs.first().map_or_else(|| Fingerprint::new(OpKind::P2p, 0, 0), |m| m.fp);
        let mut env = OpEnv {
            fp: &fp,
            group: GroupView { id: 0, rank: self.world_rank, members: &members, layout: None },
            timeout,
            max_segment_bytes: self.config.max_segment_bytes,
            stats: &mut state.stats,
            cancel: &self.aborted,
        };
        let result = crate::unwind::catch(self.world_rank, || self.backend.p2p(&mut env, msgs));
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

/// A pending point-to-point op: its message and the slot of its [`Work`] handle.
pub(super) struct P2pJob {
    msg: P2pMsg,
    slot: Option<Arc<Slot<Vec<u8>>>>,
}

impl P2pJob {
    fn send(peer: usize, bytes: Vec<u8>, fp: Fingerprint, slot: Option<Arc<Slot<Vec<u8>>>>) -> P2pJob {
        P2pJob { msg: P2pMsg { peer, is_send: true, bytes, fp, header: [0; FP_BYTES] }, slot }
    }

    fn recv(peer: usize, bytes: Vec<u8>, fp: Fingerprint, slot: Option<Arc<Slot<Vec<u8>>>>) -> P2pJob {
        P2pJob { msg: P2pMsg { peer, is_send: false, bytes, fp, header: [0; FP_BYTES] }, slot }
    }
}
