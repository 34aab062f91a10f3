//! Point-to-point ops: `send`/`recv` and their async forms `isend`/`irecv`.
//!
//! A message is a 48-byte header (the fingerprint: dtype, count, tag and the per-pair sequence
//! number) and then the payload; the receiver checks the header before reading any payload.
//! Pending `isend`/`irecv`s start together as one batch (every message's transfers move at
//! once), so an exchange cannot deadlock; the batch takes one turn like any other op. Each
//! message is whole in the stream (header, then payload), so how each side grouped its
//! messages into batches does not matter to the other.
//!
//! A receive from any source (`recv_any`, `irecv_any`) takes the first message with its tag
//! to reach this rank from any group member, as MPI's `MPI_ANY_SOURCE`: it looks at the head
//! of every member's stream and leaves the others' messages unread (each sender's messages
//! are still received in the order sent). It runs alone in its batch, after the sends and
//! receives issued before it.

use std::sync::atomic::Ordering;

use super::async_ops::OwnedBuf;
use super::core::P2pJob;
use super::work::{P2pDone, Work};
use super::Communicator;
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::error::Result;
use crate::wire::{Fingerprint, OpKind};

impl Communicator {
    /// Sends `buf` to group rank `dst` with `tag`. Messages between two ranks are matched in
    /// order; the receiver checks dtype, count and tag and fails on a mismatch.
    pub fn send<T: Element>(&self, buf: &[T], dst: usize, tag: u32) -> Result<()> {
        let fp = self.p2p_fp::<T>(buf.len(), dst, tag)?;
        self.core.check_alive(|| fp.to_string())?;
        let ticket = self.core.draw_ticket();
        let mut job = P2pJob::send(self.group.members[dst], as_bytes(buf).to_vec(), fp, None);
        self.core.run_p2p(ticket, std::slice::from_mut(&mut job.msg), self.timeout())?;
        Ok(())
    }

    /// Receives into `buf` from group rank `src`; the message must carry `tag` and exactly
    /// `buf.len()` elements of `T`, or this fails (naming the sender) without touching `buf`.
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u32) -> Result<()> {
        let fp = self.p2p_fp::<T>(buf.len(), src, tag)?;
        self.core.check_alive(|| fp.to_string())?;
        let ticket = self.core.draw_ticket();
        let mut job = P2pJob::recv(self.group.members[src], vec![0u8; std::mem::size_of_val(buf)], fp, None);
        self.core.run_p2p(ticket, std::slice::from_mut(&mut job.msg), self.timeout())?;
        as_bytes_mut(buf).copy_from_slice(&job.msg.bytes);
        Ok(())
    }

    /// Starts sending `buf` (any [`OwnedBuf`]: `Vec<T>`, `Box<[T]>`, …) to `dst`; the handle
    /// returns the buffer when the send is done.
    /// Pending `isend`/`irecv`s start together (so an exchange cannot deadlock) when a handle
    /// is waited on or polled, or when any other op is issued.
    pub fn isend<T: Element, B: OwnedBuf<T>>(&self, buf: B, dst: usize, tag: u32) -> Work<B> {
        let fp = match self.p2p_fp::<T>(buf.as_ref().len(), dst, tag) {
            Ok(fp) => fp,
            Err(e) => return Work::done(Err(e), self.core.clone()),
        };
        let (work, slot) = Work::<P2pDone>::pending(self.core.clone());
        let job = P2pJob::send(self.group.members[dst], as_bytes(buf.as_ref()).to_vec(), fp, Some(slot))
            .within(self.timeout());
        self.core.pending_p2p.lock().unwrap_or_else(|e| e.into_inner()).push(job);
        self.core.p2p_pending.store(true, Ordering::SeqCst);
        work.map(move |_| buf)
    }

    /// Starts receiving into `buf` from `src`; the handle returns the filled buffer. See
    /// [`Communicator::isend`] for when it starts.
    pub fn irecv<T: Element, B: OwnedBuf<T>>(&self, buf: B, src: usize, tag: u32) -> Work<B> {
        let fp = match self.p2p_fp::<T>(buf.as_ref().len(), src, tag) {
            Ok(fp) => fp,
            Err(e) => return Work::done(Err(e), self.core.clone()),
        };
        let (work, slot) = Work::<P2pDone>::pending(self.core.clone());
        let job = P2pJob::recv(self.group.members[src], vec![0u8; std::mem::size_of_val(buf.as_ref())], fp, Some(slot))
            .within(self.timeout());
        self.core.pending_p2p.lock().unwrap_or_else(|e| e.into_inner()).push(job);
        self.core.p2p_pending.store(true, Ordering::SeqCst);
        let mut buf = buf;
        work.map(move |(bytes, _)| {
            as_bytes_mut(buf.as_mut()).copy_from_slice(&bytes);
            buf
        })
    }

    /// Receives into `buf` the first message with `tag` that reaches this rank from any other
    /// group member, and returns its sender's group rank (torch's `recv` without `src`, MPI's
    /// `MPI_ANY_SOURCE`). Messages with another tag (or from another group) stay for the
    /// receives they are meant for; each sender's messages are taken in the order it sent
    /// them. A message with this tag but another dtype or count fails (naming the sender)
    /// without touching `buf`. On timeout the error names the tag and what each member's next
    /// message is; a member that dies while this waits is named ([`crate::ErrorKind::PeerGone`]).
    ///
    /// ```
    /// use oxcomm::threads;
    ///
    /// let got = threads::run(3, |comm| -> oxcomm::Result<Vec<usize>> {
    ///     if comm.rank() == 0 {
    ///         let mut senders = Vec::new();
    ///         for _ in 0..2 {
    ///             let mut buf = [0i32; 2];
    ///             let src = comm.recv_any(&mut buf, 7)?;
    ///             assert_eq!(buf, [src as i32; 2]);
    ///             senders.push(src);
    ///         }
    ///         senders.sort();
    ///         Ok(senders)
    ///     } else {
    ///         comm.send(&[comm.rank() as i32; 2], 0, 7)?;
    ///         Ok(vec![])
    ///     }
    /// })
    /// .unwrap();
    /// assert_eq!(got[0].as_ref().unwrap(), &vec![1, 2]);
    /// ```
    pub fn recv_any<T: Element>(&self, buf: &mut [T], tag: u32) -> Result<usize> {
        let (fp, peers) = self.any_source_fp::<T>(buf.len(), tag)?;
        self.core.check_alive(|| fp.to_string())?;
        let ticket = self.core.draw_ticket();
        let mut job = P2pJob::recv_any(peers, vec![0u8; std::mem::size_of_val(buf)], fp, None);
        self.core.run_p2p(ticket, std::slice::from_mut(&mut job.msg), self.timeout())?;
        as_bytes_mut(buf).copy_from_slice(&job.msg.bytes);
        Ok(self.group_rank_of(job.msg.peer))
    }

    /// [`Communicator::recv_any`] started like [`Communicator::irecv`]: the handle returns
    /// the filled buffer and the sender's group rank.
    pub fn irecv_any<T: Element, B: OwnedBuf<T>>(&self, buf: B, tag: u32) -> Work<(B, usize)> {
        let (fp, peers) = match self.any_source_fp::<T>(buf.as_ref().len(), tag) {
            Ok(x) => x,
            Err(e) => return Work::done(Err(e), self.core.clone()),
        };
        let (work, slot) = Work::<P2pDone>::pending(self.core.clone());
        let job = P2pJob::recv_any(peers, vec![0u8; std::mem::size_of_val(buf.as_ref())], fp, Some(slot))
            .within(self.timeout());
        self.core.pending_p2p.lock().unwrap_or_else(|e| e.into_inner()).push(job);
        self.core.p2p_pending.store(true, Ordering::SeqCst);
        let mut buf = buf;
        let members = self.group.members.clone();
        work.map(move |(bytes, world)| {
            as_bytes_mut(buf.as_mut()).copy_from_slice(&bytes);
            let src = members.iter().position(|&m| m == world).expect("the sender is a group member");
            (buf, src)
        })
    }

    /// The fingerprint of a receive from any source and the world ranks it may come from.
    fn any_source_fp<T: Element>(&self, count: usize, tag: u32) -> Result<(Fingerprint, Vec<usize>)> {
        let mut fp = Self::with_dtype::<T>(self.fingerprint(OpKind::P2p), count);
        fp.extra = u64::from(tag);
        if self.size() < 2 {
            return Err(self.arg_error(&fp, "a receive from any source needs another rank in the group"));
        }
        let me = self.group.members[self.rank()];
        Ok((fp, self.group.members.iter().copied().filter(|&m| m != me).collect()))
    }

    fn group_rank_of(&self, world: usize) -> usize {
        self.group.members.iter().position(|&m| m == world).expect("the sender is a group member")
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
