//! Point-to-point ops: `send`/`recv` and their async forms `isend`/`irecv`.
//!
//! A message is a 48-byte header (the fingerprint: dtype, count, tag and the per-pair sequence
//! number) and then the payload; the receiver checks the header before reading any payload.
//! Pending `isend`/`irecv`s start together as one batch (headers both ways, then payloads both
//! ways), so an exchange cannot deadlock; the batch takes one turn like any other op.

use std::sync::atomic::Ordering;

use super::async_ops::OwnedBuf;
use super::core::P2pJob;
use super::work::Work;
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

    /// Starts sending `buf` (any [`OwnedBuf`]: `Vec<T>`, `Box<[T]>`, …) to `dst`; the handle
    /// returns the buffer when the send is done.
    /// Pending `isend`/`irecv`s start together (so an exchange cannot deadlock) when a handle
    /// is waited on or polled, or when any other op is issued.
    pub fn isend<T: Element, B: OwnedBuf<T>>(&self, buf: B, dst: usize, tag: u32) -> Work<B> {
        let fp = match self.p2p_fp::<T>(buf.as_ref().len(), dst, tag) {
            Ok(fp) => fp,
            Err(e) => return Work::done(Err(e), self.core.clone()),
        };
        let (work, slot) = Work::<Vec<u8>>::pending(self.core.clone());
        let job = P2pJob::send(self.group.members[dst], as_bytes(buf.as_ref()).to_vec(), fp, Some(slot));
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
        let (work, slot) = Work::<Vec<u8>>::pending(self.core.clone());
        let job = P2pJob::recv(self.group.members[src], vec![0u8; std::mem::size_of_val(buf.as_ref())], fp, Some(slot));
        self.core.pending_p2p.lock().unwrap_or_else(|e| e.into_inner()).push(job);
        self.core.p2p_pending.store(true, Ordering::SeqCst);
        let mut buf = buf;
        work.map(move |bytes| {
            as_bytes_mut(buf.as_mut()).copy_from_slice(&bytes);
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
