//! A single-producer / single-consumer byte ring over raw memory.
//!
//! This file owns the ring *protocol* only: a control block ([`RingCtrl`]) plus a data area of
//! `cap` bytes (a power of two), reached through raw pointers so the same code runs on a heap
//! buffer in unit tests and on a mapped shared-memory segment in production. It knows nothing
//! about segments, doorbells or peers.
//!
//! # Protocol
//!
//! `tail` and `head` are monotonic byte counters (`u64`, never wrapping in practice: 2^64 bytes)
//! on separate 128-byte lines. Only the producer stores `tail`; only the consumer stores `head`.
//! Byte `i` of the stream lives at `data[i & (cap - 1)]`. The producer may write the
//! `cap - (tail - head)` free bytes after `tail`; the consumer may read the `tail - head` bytes
//! after `head`.
//!
//! Ordering: the producer copies bytes into the data area, then stores `tail` with `Release`;
//! the consumer loads `tail` with `Acquire` before reading them, so it sees the bytes. The
//! consumer finishes reading, then stores `head` with `Release`; the producer loads `head` with
//! `Acquire` before overwriting that space, so its writes cannot overtake the reads. Each side
//! caches the other's counter and reloads it only when the cached value says "no room" or "no
//! bytes", so the other side's line is touched once per batch, not per call.
//!
//! A producer that finds the ring full sets `writer_blocked`, then (after a `SeqCst` fence)
//! reloads `head`; a consumer that advanced `head` fences likewise, then reads and clears the
//! flag. One of the two sees the other, so either the producer finds the freed space itself or
//! the consumer learns that it must ring the producer's doorbell. Space freed while nobody is
//! blocked costs no doorbell ring (and wakes no spinning producer for nothing).
//!
//! Counters come from another process and are not trusted: a `head` or `tail` that breaks
//! `0 <= tail - head <= cap` is reported as [`Corrupt`] instead of being used.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// One 128-byte line (two 64-byte lines: adjacent-line prefetch pairs them on x86).
#[repr(C, align(128))]
#[derive(Default)]
pub(crate) struct Line<T>(pub(crate) T);

/// Close flags of one ring, each set once by its side when that side's link is dropped.
#[repr(C)]
#[derive(Default)]
pub(crate) struct RingFlags {
    /// Set by the producer's side when it goes away.
    pub(crate) writer_closed: AtomicU32,
    /// Set by the consumer's side when it goes away.
    pub(crate) reader_closed: AtomicU32,
    /// Set by the producer's side once it has mapped the ring (so the owner may unlink).
    pub(crate) writer_attached: AtomicU32,
    /// Set by the producer when it found the ring full; cleared by the consumer, which then
    /// owes it a doorbell ring (see [`Consumer::take_writer_blocked`]).
    writer_blocked: AtomicU32,
    /// The producer's last epoch mark ([`Producer::mark`]): bytes before `mark_at` belong to
    /// the epochs before `mark_epoch`. Stored by the producer only: `mark_at` first, then
    /// `mark_epoch` with `Release`.
    mark_epoch: AtomicU32,
    _pad: u32,
    mark_at: AtomicU64,
}

/// The control block of one ring, placed right before its data area. All zero is the valid
/// initial state (fresh shared memory is zero-filled).
#[repr(C)]
#[derive(Default)]
pub(crate) struct RingCtrl {
    /// Bytes ever written (stored by the producer only).
    tail: Line<AtomicU64>,
    /// Bytes ever read (stored by the consumer only).
    head: Line<AtomicU64>,
    /// Close flags.
    pub(crate) flags: Line<RingFlags>,
}

/// Bytes the control block takes before the data area (a multiple of 128).
pub(crate) const CTRL_BYTES: usize = std::mem::size_of::<RingCtrl>();

/// The ring's counters broke the protocol (a peer wrote garbage or the memory is not a ring).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Corrupt {
    /// The counters seen, for the message.
    pub(crate) head: u64,
    /// The counters seen, for the message.
    pub(crate) tail: u64,
}

impl std::fmt::Display for Corrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ring counters are corrupt (head {}, tail {})", self.head, self.tail)
    }
}

/// The memory a ring end points into, and what keeps it alive.
struct Raw {
    /// Keeps the memory mapped (a segment, or a heap buffer in tests).
    _owner: Arc<dyn Any + Send + Sync>,
    ctrl: NonNull<RingCtrl>,
    data: NonNull<u8>,
    cap: u64,
}

// SAFETY: `Raw` only points into memory kept alive by `_owner` (which is Send + Sync); the
// control block is accessed through atomics and the data area only under the SPSC protocol
// above, with exactly one producer and one consumer end per ring.
unsafe impl Send for Raw {}

impl Raw {
    /// # Safety
    /// `ctrl` must point to a `RingCtrl` and `data` to `cap` bytes, both valid for reads and
    /// writes while `owner` lives; `cap` must be a power of two; only atomic accesses may touch
    /// the control block from anywhere else.
    unsafe fn new(owner: Arc<dyn Any + Send + Sync>, ctrl: NonNull<RingCtrl>, data: NonNull<u8>, cap: usize) -> Raw {
        debug_assert!(cap.is_power_of_two());
        Raw { _owner: owner, ctrl, data, cap: cap as u64 }
    }

    fn ctrl(&self) -> &RingCtrl {
        // SAFETY: `ctrl` is valid while `_owner` lives (constructor contract), and `RingCtrl`
        // holds only atomics, so a shared reference is sound even with another process writing.
        unsafe { self.ctrl.as_ref() }
    }

    /// Checks `0 <= tail - head <= cap`.
    fn check(&self, head: u64, tail: u64) -> Result<u64, Corrupt> {
        match tail.checked_sub(head) {
            Some(used) if used <= self.cap => Ok(used),
            _ => Err(Corrupt { head, tail }),
        }
    }
}

/// The writing end of a ring. Exactly one may exist per ring.
pub(crate) struct Producer {
    raw: Raw,
    /// Our own `tail` (the shared copy is only stored, never re-read).
    tail: u64,
    /// Last `head` loaded from the consumer.
    head_cache: u64,
}

/// The reading end of a ring. Exactly one may exist per ring.
pub(crate) struct Consumer {
    raw: Raw,
    /// Our own `head`.
    head: u64,
    /// Last `tail` loaded from the producer.
    tail_cache: u64,
}

impl Producer {
    /// # Safety
    /// As for the memory: `ctrl` points to a `RingCtrl` (all-zero or left by an earlier
    /// producer/consumer of this same ring) and `data` to `cap` bytes, both valid while `owner`
    /// lives; `cap` is a power of two; no other `Producer` exists for this ring.
    pub(crate) unsafe fn new(
        owner: Arc<dyn Any + Send + Sync>,
        ctrl: NonNull<RingCtrl>,
        data: NonNull<u8>,
        cap: usize,
    ) -> Producer {
        // SAFETY: forwarded from this function's contract.
        let raw = unsafe { Raw::new(owner, ctrl, data, cap) };
        let tail = raw.ctrl().tail.0.load(Ordering::Acquire);
        let head_cache = raw.ctrl().head.0.load(Ordering::Acquire);
        Producer { raw, tail, head_cache }
    }

    /// The ring's control block (for its close flags).
    pub(crate) fn ctrl(&self) -> &RingCtrl {
        self.raw.ctrl()
    }

    /// Copies a prefix of `data` into the ring; returns how many bytes (0 when full).
    pub(crate) fn try_write(&mut self, data: &[u8]) -> Result<usize, Corrupt> {
        let cap = self.raw.cap;
        let mut free = cap - self.raw.check(self.head_cache, self.tail)?;
        if free < data.len() as u64 {
            // Acquire: the consumer's reads of the space it freed happen before our writes.
            self.head_cache = self.raw.ctrl().head.0.load(Ordering::Acquire);
            free = cap - self.raw.check(self.head_cache, self.tail)?;
        }
        if free == 0 && !data.is_empty() {
            // Full: ask for a ring when space is freed, then look once more (see module docs).
            let flags = &self.raw.ctrl().flags.0;
            flags.writer_blocked.store(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            self.head_cache = self.raw.ctrl().head.0.load(Ordering::Acquire);
            free = cap - self.raw.check(self.head_cache, self.tail)?;
        }
        let n = free.min(data.len() as u64) as usize;
        if n == 0 {
            return Ok(0);
        }
        let pos = (self.tail & (cap - 1)) as usize;
        let first = n.min(cap as usize - pos);
        // SAFETY: `pos + first <= cap` and `n - first <= pos`, so both copies stay inside the
        // data area; the `n` bytes after `tail` are free (not readable by the consumer until we
        // publish `tail` below), so nobody else touches them; `data` is a separate allocation
        // (a caller's slice cannot alias the ring, which only this end and the consumer reach).
        unsafe {
            let base = self.raw.data.as_ptr();
            crate::copy::copy_raw(base.add(pos), data.as_ptr(), first);
            crate::copy::copy_raw(base, data.as_ptr().add(first), n - first);
        }
        self.tail += n as u64;
        // Release: publishes the bytes copied above.
        self.raw.ctrl().tail.0.store(self.tail, Ordering::Release);
        Ok(n)
    }

    /// Writes all of `parts`, one after the other, or nothing: `Ok(false)` when the ring has
    /// not room for them all now (a control message goes whole or not at all). The consumer
    /// sees them together, with one `tail` store.
    pub(crate) fn try_write_all(&mut self, parts: &[&[u8]]) -> Result<bool, Corrupt> {
        let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
        let cap = self.raw.cap;
        if total > cap {
            return Ok(false);
        }
        // Acquire: the consumer's reads of the space it freed happen before our writes.
        self.head_cache = self.raw.ctrl().head.0.load(Ordering::Acquire);
        let free = cap - self.raw.check(self.head_cache, self.tail)?;
        if free < total {
            return Ok(false);
        }
        let mut at = self.tail;
        for part in parts {
            let pos = (at & (cap - 1)) as usize;
            let first = part.len().min(cap as usize - pos);
            // SAFETY: as in `try_write`: `pos + first <= cap` and the wrapped rest starts at
            // the data area's beginning; the `total` bytes after `tail` are free (checked
            // above) and not readable by the consumer until `tail` is published below.
            unsafe {
                let base = self.raw.data.as_ptr();
                crate::copy::copy_raw(base.add(pos), part.as_ptr(), first);
                crate::copy::copy_raw(base, part.as_ptr().add(first), part.len() - first);
            }
            at += part.len() as u64;
        }
        self.tail = at;
        // Release: publishes the bytes copied above.
        self.raw.ctrl().tail.0.store(self.tail, Ordering::Release);
        Ok(true)
    }

    /// Marks the end of the epochs before `epoch`: every byte written so far belongs to them,
    /// every later one to `epoch` ([`Consumer::skip_to_mark`]). Only the producer stores the
    /// mark; a mark for an epoch not above the last one is ignored.
    pub(crate) fn mark(&mut self, epoch: u32) {
        let flags = &self.raw.ctrl().flags.0;
        if flags.mark_epoch.load(Ordering::Relaxed) >= epoch {
            return;
        }
        flags.mark_at.store(self.tail, Ordering::Relaxed);
        // Release: a consumer that sees the epoch sees `mark_at` (and the bytes before it).
        flags.mark_epoch.store(epoch, Ordering::Release);
    }
}

impl Consumer {
    /// # Safety
    /// As for [`Producer::new`], with "no other `Consumer`".
    pub(crate) unsafe fn new(
        owner: Arc<dyn Any + Send + Sync>,
        ctrl: NonNull<RingCtrl>,
        data: NonNull<u8>,
        cap: usize,
    ) -> Consumer {
        // SAFETY: forwarded from this function's contract.
        let raw = unsafe { Raw::new(owner, ctrl, data, cap) };
        let head = raw.ctrl().head.0.load(Ordering::Acquire);
        let tail_cache = raw.ctrl().tail.0.load(Ordering::Acquire);
        Consumer { raw, head, tail_cache }
    }

    /// The ring's control block (for its close flags).
    pub(crate) fn ctrl(&self) -> &RingCtrl {
        self.raw.ctrl()
    }

    /// Bytes readable now (reloads the producer's counter).
    pub(crate) fn available(&mut self) -> Result<u64, Corrupt> {
        self.tail_cache = self.raw.ctrl().tail.0.load(Ordering::Acquire);
        self.raw.check(self.head, self.tail_cache)
    }

    /// Offers up to `max` readable bytes in place to `f` (at most two calls, split at the wrap
    /// point), then frees them; returns how many. `f` must take every byte it is offered.
    pub(crate) fn read_with(&mut self, max: usize, f: &mut dyn FnMut(&[u8])) -> Result<usize, Corrupt> {
        let n = self.offer(max, f)?;
        if n > 0 {
            self.head += n as u64;
            // Release: our reads in `offer` happen before the producer may reuse this space.
            self.raw.ctrl().head.0.store(self.head, Ordering::Release);
        }
        Ok(n)
    }

    /// Copies up to `buf.len()` readable bytes into `buf` without freeing them (the next read
    /// returns them again); returns how many.
    pub(crate) fn peek(&mut self, buf: &mut [u8]) -> Result<usize, Corrupt> {
        let mut at = 0;
        self.offer(buf.len(), &mut |chunk| {
            crate::copy::copy(&mut buf[at..at + chunk.len()], chunk);
            at += chunk.len();
        })
    }

    /// Offers up to `max` readable bytes in place to `f` (at most two calls, split at the wrap
    /// point) without freeing them; returns how many.
    fn offer(&mut self, max: usize, f: &mut dyn FnMut(&[u8])) -> Result<usize, Corrupt> {
        let cap = self.raw.cap;
        let mut avail = self.raw.check(self.head, self.tail_cache)?;
        if avail < max as u64 {
            // Acquire: makes the producer's bytes up to `tail` visible.
            self.tail_cache = self.raw.ctrl().tail.0.load(Ordering::Acquire);
            avail = self.raw.check(self.head, self.tail_cache)?;
        }
        let n = avail.min(max as u64) as usize;
        if n == 0 {
            return Ok(0);
        }
        let pos = (self.head & (cap - 1)) as usize;
        let first = n.min(cap as usize - pos);
        let base = self.raw.data.as_ptr();
        // SAFETY: `pos + first <= cap`: inside the data area. These bytes lie in
        // `[head, tail)`, published by the producer (Acquire above) and not writable by it
        // until `head` moves past them (only `read_with` moves it, after `f` returned), so
        // nobody writes them while the slice lives.
        f(unsafe { std::slice::from_raw_parts(base.add(pos), first) });
        if n > first {
            // SAFETY: `n - first <= pos <= cap` bytes from the start of the data area, the
            // wrapped rest of the same readable range.
            f(unsafe { std::slice::from_raw_parts(base, n - first) });
        }
        Ok(n)
    }

    /// After freeing space: `true` if the producer found the ring full since the last call,
    /// so it may be waiting for a doorbell ring. Clears the request.
    pub(crate) fn take_writer_blocked(&self) -> bool {
        // Orders our `head` store before the flag load (pairs with the producer's fence).
        fence(Ordering::SeqCst);
        let flag = &self.raw.ctrl().flags.0.writer_blocked;
        flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::Relaxed) != 0
    }

    /// Drops every byte the producer wrote before its mark for `epoch` ([`Producer::mark`]):
    /// `Ok(true)` once the mark is there and passed, `Ok(false)` while the producer has not
    /// marked that epoch (then every readable byte is dropped: all of it is older). Bytes after
    /// the mark stay.
    pub(crate) fn skip_to_mark(&mut self, epoch: u32) -> Result<bool, Corrupt> {
        let flags = &self.raw.ctrl().flags.0;
        // Acquire: pairs with the producer's Release store of the epoch (after `mark_at`).
        let marked = flags.mark_epoch.load(Ordering::Acquire) >= epoch;
        let to = if marked {
            flags.mark_at.load(Ordering::Relaxed)
        } else {
            self.tail_cache = self.raw.ctrl().tail.0.load(Ordering::Acquire);
            self.tail_cache
        };
        if to > self.head {
            // The mark lies within what the producer has published (it stores `tail` before
            // marking), unless the counters are corrupt.
            self.tail_cache = self.raw.ctrl().tail.0.load(Ordering::Acquire);
            self.raw.check(self.head, self.tail_cache)?;
            if to > self.tail_cache {
                return Err(Corrupt { head: to, tail: self.tail_cache });
            }
            self.head = to;
            // Release: nothing was read, but the producer may reuse the space.
            self.raw.ctrl().head.0.store(self.head, Ordering::Release);
        }
        Ok(marked)
    }

    /// Copies readable bytes into a prefix of `buf`; returns how many (0 when none).
    pub(crate) fn try_read(&mut self, buf: &mut [u8]) -> Result<usize, Corrupt> {
        let mut at = 0;
        self.read_with(buf.len(), &mut |chunk| {
            crate::copy::copy(&mut buf[at..at + chunk.len()], chunk);
            at += chunk.len();
        })
    }
}

/// A ring on the heap, for tests: returns both ends.
#[cfg(test)]
pub(crate) fn heap_pair(cap: usize) -> (Producer, Consumer) {
    use std::alloc::{alloc_zeroed, dealloc, Layout};

    struct Heap {
        ptr: NonNull<u8>,
        layout: Layout,
    }
    // SAFETY: the buffer is plain memory only reached through the ring ends.
    unsafe impl Send for Heap {}
    // SAFETY: as above; shared access goes through atomics and the SPSC protocol.
    unsafe impl Sync for Heap {}
    impl Drop for Heap {
        fn drop(&mut self) {
            // SAFETY: allocated in `heap_pair` with this layout.
            unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
        }
    }

    assert!(cap.is_power_of_two());
    let layout = Layout::from_size_align(CTRL_BYTES + cap, 128).expect("layout");
    // SAFETY: the layout has a non-zero size.
    let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).expect("allocation failed");
    let heap: Arc<dyn Any + Send + Sync> = Arc::new(Heap { ptr, layout });
    let ctrl = ptr.cast::<RingCtrl>();
    // SAFETY: `CTRL_BYTES < CTRL_BYTES + cap`, inside the allocation.
    let data = unsafe { NonNull::new_unchecked(ptr.as_ptr().add(CTRL_BYTES)) };
    // SAFETY: zeroed memory is a valid `RingCtrl`; both areas live as long as `heap`; one
    // producer and one consumer are made.
    unsafe { (Producer::new(heap.clone(), ctrl, data, cap), Consumer::new(heap, ctrl, data, cap)) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn layout_is_three_lines() {
        assert_eq!(CTRL_BYTES, 384);
        assert_eq!(std::mem::align_of::<RingCtrl>(), 128);
    }

    #[test]
    fn a_peek_leaves_the_bytes_for_the_next_read() {
        let (mut tx, mut rx) = heap_pair(16);
        assert_eq!(tx.try_write(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]).unwrap(), 12);
        let mut buf = [0u8; 12];
        assert_eq!(rx.try_read(&mut buf[..8]).unwrap(), 8);
        assert_eq!(tx.try_write(&[13, 14, 15, 16, 17, 18]).unwrap(), 6); // wraps
        let mut head = [0u8; 8];
        assert_eq!(rx.peek(&mut head).unwrap(), 8);
        assert_eq!(head, [9, 10, 11, 12, 13, 14, 15, 16]);
        let mut all = [0u8; 10];
        assert_eq!(rx.try_read(&mut all).unwrap(), 10);
        assert_eq!(all, [9, 10, 11, 12, 13, 14, 15, 16, 17, 18]);
        assert_eq!(rx.peek(&mut head).unwrap(), 0);
    }

    #[test]
    fn a_mark_splits_the_stream_between_epochs() {
        let (mut tx, mut rx) = heap_pair(64);
        tx.try_write(&[1, 2, 3]).unwrap();
        rx.try_read(&mut [0u8; 1]).unwrap();
        // Not marked yet: what is there is the old epoch's.
        assert!(!rx.skip_to_mark(1).unwrap());
        assert_eq!(rx.peek(&mut [0u8; 4]).unwrap(), 0);
        tx.try_write(&[4, 5]).unwrap();
        tx.mark(1);
        tx.mark(1); // idempotent
        tx.try_write(&[6, 7]).unwrap();
        assert!(rx.skip_to_mark(1).unwrap());
        let mut buf = [0u8; 4];
        assert_eq!(rx.try_read(&mut buf).unwrap(), 2);
        assert_eq!(&buf[..2], &[6, 7]);
        assert!(rx.skip_to_mark(1).unwrap(), "passing a mark twice drops nothing");
        // Whole writes: all or nothing.
        assert!(tx.try_write_all(&[&[8u8; 30], &[9u8; 30]]).unwrap());
        assert!(!tx.try_write_all(&[&[1u8; 5]]).unwrap(), "4 bytes free");
        assert_eq!(rx.try_read(&mut [0u8; 64]).unwrap(), 60);
        assert!(tx.try_write_all(&[&[1u8; 40], &[2u8; 24]]).unwrap(), "wraps");
        let mut all = [0u8; 64];
        assert_eq!(rx.try_read(&mut all).unwrap(), 64);
        assert_eq!((&all[..40], &all[40..]), (&[1u8; 40][..], &[2u8; 24][..]));
    }

    #[test]
    fn fills_then_drains() {
        let (mut tx, mut rx) = heap_pair(4096);
        let data: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        assert_eq!(tx.try_write(&data).unwrap(), 4096);
        assert_eq!(tx.try_write(&data[4096..]).unwrap(), 0);
        let mut out = vec![0u8; 5000];
        assert_eq!(rx.try_read(&mut out[..100]).unwrap(), 100);
        assert_eq!(tx.try_write(&data[4096..]).unwrap(), 100);
        assert_eq!(rx.try_read(&mut out[100..]).unwrap(), 4096);
        assert_eq!(&out[..4196], &data[..4196]);
        assert_eq!(rx.try_read(&mut out).unwrap(), 0);
    }

    #[test]
    fn read_with_splits_at_the_wrap_point_only() {
        let (mut tx, mut rx) = heap_pair(4096);
        tx.try_write(&[1u8; 4000]).unwrap();
        rx.try_read(&mut [0u8; 4000]).unwrap();
        tx.try_write(&[2u8; 200]).unwrap();
        let mut calls = Vec::new();
        let n = rx.read_with(1000, &mut |c| calls.push(c.len())).unwrap();
        assert_eq!(n, 200);
        assert_eq!(calls, vec![96, 104]);
    }

    #[test]
    fn a_full_ring_asks_for_a_ring_once() {
        let (mut tx, mut rx) = heap_pair(4096);
        assert_eq!(tx.try_write(&[7u8; 4096]).unwrap(), 4096);
        rx.try_read(&mut [0u8; 10]).unwrap();
        assert!(!rx.take_writer_blocked(), "nobody was blocked");
        assert_eq!(tx.try_write(&[7u8; 100]).unwrap(), 10);
        assert_eq!(tx.try_write(&[7u8; 100]).unwrap(), 0);
        rx.try_read(&mut [0u8; 10]).unwrap();
        assert!(rx.take_writer_blocked());
        assert!(!rx.take_writer_blocked());
    }

    #[test]
    fn corrupt_counters_are_reported_not_used() {
        let (mut tx, mut rx) = heap_pair(4096);
        rx.ctrl().tail.0.store(5000, Ordering::Release);
        assert!(rx.available().is_err());
        assert!(rx.try_read(&mut [0u8; 8]).is_err());
        tx.ctrl().head.0.store(7, Ordering::Release);
        assert!(tx.try_write(&[0u8; 8192]).is_err());
    }

    #[test]
    fn two_threads_stream_in_order() {
        let (mut tx, mut rx) = heap_pair(4096);
        // Under Miri (every access checked) a few wraps of the ring are enough.
        const TOTAL: usize = if cfg!(miri) { 20 << 10 } else { 4 << 20 };
        let writer = std::thread::spawn(move || {
            let mut sent = 0usize;
            let chunk: Vec<u8> = (0..3001u32).map(|i| i as u8).collect();
            while sent < TOTAL {
                let off = sent % 3001;
                let end = (off + 1000).min(3001).min(off + TOTAL - sent);
                sent += tx.try_write(&chunk[off..end]).unwrap();
                std::thread::yield_now();
            }
        });
        let mut got = 0usize;
        let mut buf = vec![0u8; 777];
        while got < TOTAL {
            let n = rx.try_read(&mut buf).unwrap();
            for (i, b) in buf[..n].iter().enumerate() {
                assert_eq!(*b, ((got + i) % 3001) as u8);
            }
            got += n;
            if n == 0 {
                std::thread::yield_now();
            }
        }
        writer.join().unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        #[cfg_attr(miri, ignore = "proptest's case store needs the file system; fills_then_drains and the two-thread test cover the wrap under Miri")]
        fn wraps_with_random_chunks(
            ops in proptest::collection::vec((1usize..700, 1usize..700), 1..200)
        ) {
            let (mut tx, mut rx) = heap_pair(4096);
            let mut next_w = 0u64;
            let mut next_r = 0u64;
            for (w, r) in ops {
                let data: Vec<u8> = (0..w as u64).map(|i| ((next_w + i) * 7 % 251) as u8).collect();
                next_w += tx.try_write(&data).unwrap() as u64;
                let mut buf = vec![0u8; r];
                let n = rx.try_read(&mut buf).unwrap();
                for (i, b) in buf[..n].iter().enumerate() {
                    prop_assert_eq!(*b, ((next_r + i as u64) * 7 % 251) as u8);
                }
                next_r += n as u64;
                prop_assert!(next_w - next_r <= 4096);
            }
        }
    }
}
