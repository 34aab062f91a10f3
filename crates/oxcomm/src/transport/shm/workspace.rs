//! The workspace every rank's segment carries for direct shared-memory collectives: counters
//! and buffers that all ranks of the host can read straight from each other's segments, so a
//! collective needs no copy through a ring.
//!
//! This file owns the workspace layout and the raw pointers into it; the protocols that use
//! it (who writes what when) are in `algorithms/shm_direct/`. It knows nothing about ops.
//!
//! # Workspace layout
//!
//! | offset | what |
//! | --- | --- |
//! | 0 | counters, one 128-byte line each: `arrived`, `copied_in` (with `parts_in` in its second 64 bytes), `reduced`, `copied_out` |
//! | [`SINGLE_COPY_OFFSET`] | whether this rank can read every peer's memory (0: not known yet, then the verdict the direct algorithms publish) and the address of its probe word, which peers read to find out (see [`ShmDirect::probe_peer`]) |
//! | [`ANNOUNCE_OFFSET`] | the *announcement*: a tag word (`seq + 1`, 0: none) and [`ANNOUNCE_BYTES`] that a rank publishes when it starts an op that does not use the slots, so peers on the direct path see that it is elsewhere (see [`ShmDirect::announce`]) |
//! | [`SLOTS_OFFSET`] | [`SLOTS`] *slots* (op `k` writes slot `k % SLOTS`), each a line with an 8-byte stamp, an 8-byte check word (a hash of the op's fingerprint) and up to [`INLINE_BYTES`] of payload, then a line with the 56-byte header (fingerprint + length), then up to [`SMALL_BYTES`] of payload when it does not fit inline: a reader of a tiny op whose fingerprint matches reads one line |
//! | [`HISTORY_OFFSET`] | the *fingerprint history*: [`HISTORY`] check words side by side, then as many headers (op `k` writes entry `k % HISTORY` of both), where a rank that checks a loose op late reads them ([`ShmDirect::history_check`], [`ShmDirect::history_header`]) |
//! | [`BIG_OFFSET`] | two *halves* of [`CHUNK_BYTES`] each |
//!
//! Writers publish with `Release` stores to a counter or stamp after writing the bytes it
//! covers; readers load it with `Acquire` before reading those bytes.
//!
//! # What the accessors check, and what they leave to the protocol
//!
//! Every accessor is safe and checks what one process can: the rank indexes a bounds-checked
//! table, a slot index wraps at [`SLOTS`], payload and chunk ranges are checked against their
//! region (without overflow), and every word that two ranks touch at once (counters, stamps,
//! check words, lengths, headers, announcements) is an atomic. This rank's chunk buffer is
//! reachable only through one [`ChunkMut`] at a time, never as a peer's, so two views of this
//! process never alias. The unsafe code and its `SAFETY` lines are all in this file.
//!
//! Not guaranteed by types: that a peer does not rewrite a slot payload or chunk range while
//! this rank holds a slice of it, nor that this rank keeps no slice of its own slot across the
//! [`ShmDirect::write_slot`] that reuses it [`SLOTS`] ops later. Other processes are outside Rust's view; the slot and
//! chunk protocols of `algorithms/shm_direct/` keep them off, and a peer is trusted to follow
//! them, as it is trusted with the rings (see the [transport's docs](super)). Those bytes are
//! plain data, valid for any bits: a peer that breaks the protocol yields wrong numbers, and
//! every length or count read from it is checked before use.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use super::segment::Segment;

/// Default number of times arrival polls the peers' stamps before the doorbell protocol,
/// when every rank has a core of its own.
pub const ARRIVAL_POLLS: usize = 200;

pub use super::layout::{
    ANNOUNCE_BYTES, ANNOUNCE_OFFSET, BIG_OFFSET, CHUNK_BYTES, HISTORY, HISTORY_OFFSET, INLINE_BYTES,
    SINGLE_COPY_OFFSET, SLOTS, SLOTS_OFFSET, SLOT_HEADER, SMALL_BYTES, WORKSPACE_BYTES,
};
use super::layout::{
    HISTORY_ENTRY, HISTORY_HEADERS, LINE, SLOT_BYTES, SLOT_CHECK, SLOT_HEADER_AT, SLOT_INLINE, SLOT_LEN, SLOT_PAYLOAD,
};

/// The counters of one rank's workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// Number of direct ops this rank has arrived at (written its slot for).
    Arrived = 0,
    /// Number of chunks this rank has copied into its chunk buffer.
    CopiedIn = 1,
    /// Number of chunks this rank has reduced (its slice of its buffer holds the result).
    Reduced = 2,
    /// Number of chunks this rank has finished reading from everyone.
    CopiedOut = 3,
    /// How far this rank has copied into its half, part by part, so that a reader can follow
    /// it inside a chunk (its meaning is the direct algorithms'). It lives in the second half
    /// of the `copied_in` line, which only its writer writes: no line of its own.
    PartsIn = 4,
}

impl Counter {
    /// Byte offset of the counter in a workspace.
    fn offset(self) -> usize {
        match self {
            Counter::PartsIn => Counter::CopiedIn as usize * LINE + LINE / 2,
            c => c as usize * LINE,
        }
    }
}

/// Every local rank's workspace, as mapped in this process. Built by
/// [`super::ShmEndpoint::direct`] when every rank of the world is on this host.
pub struct ShmDirect {
    rank: usize,
    /// How many times arrival polls the peers' stamps before waiting on the doorbell.
    arrival_polls: usize,
    /// Indexed by world rank; keeps the mappings alive.
    segs: Vec<Arc<Segment>>,
    bases: Vec<NonNull<u8>>,
    /// Every rank's process id (its segment's owner).
    pids: Vec<u32>,
    /// The word peers read from this process to find out whether they can (its address is in
    /// this rank's single-copy line; it holds [`probe_value`] of this process).
    probe: Box<u64>,
    /// Whether a [`ChunkMut`] of this rank's chunk buffer is alive.
    own_chunk_out: AtomicBool,
}

/// What a rank's probe word holds: a value peers can predict from its pid alone, and would not
/// read by chance from another process's memory at that address.
fn probe_value(pid: u32) -> u64 {
    0x6F78_636F_6D6D_0000u64 ^ u64::from(pid).rotate_left(17)
}

// SAFETY: the pointers are into mappings owned by `segs`, which are Send + Sync; all shared
// state behind them is accessed through atomics or under the publish/acquire protocol.
unsafe impl Send for ShmDirect {}
// SAFETY: as above.
unsafe impl Sync for ShmDirect {}

impl std::fmt::Debug for ShmDirect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmDirect").field("rank", &self.rank).field("ranks", &self.segs.len()).finish()
    }
}

impl ShmDirect {
    pub(crate) fn new(rank: usize, segs: Vec<Arc<Segment>>, arrival_polls: usize) -> ShmDirect {
        let bases = segs.iter().map(|s| s.workspace()).collect();
        let pids: Vec<u32> = segs.iter().map(|s| s.owner_pid()).collect();
        let probe = Box::new(probe_value(pids[rank]));
        let direct = ShmDirect { rank, arrival_polls, segs, bases, pids, probe, own_chunk_out: AtomicBool::new(false) };
        // Published before this rank's first stamp, which peers acquire before they probe.
        direct.single_copy_words(rank)[1].store(&*direct.probe as *const u64 as u64, Ordering::Release);
        for r in 0..direct.segs.len() {
            direct.map_chunk_buffers(r);
        }
        direct
    }

    /// Maps `rank`'s two chunk buffers into this process's page tables now (the kernel does it:
    /// `MADV_POPULATE_READ` reads no byte here), so that the first ops reaching a new place of
    /// a half (the direct all-reduce takes turns over them) do not pay a page fault per page
    /// and process: a 4-rank 64 KiB all-reduce took 112–151 µs instead of 55–65 over its first
    /// 25 ops (docs/perf_mid_allreduce.md). Best effort: a kernel before 5.14 refuses the
    /// advice, and the pages then fault in on first use.
    fn map_chunk_buffers(&self, rank: usize) {
        // SAFETY: sysconf only reads a system setting.
        let page = (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as usize;
        let start = self.region(rank, 0, 0, 0) as usize;
        let aligned = start & !(page - 1);
        let len = start - aligned + 2 * CHUNK_BYTES;
        // SAFETY: `aligned..aligned + len` lies inside `rank`'s mapped segment (the chunk
        // buffers end the workspace, the segment is mapped from a page boundary); this advice
        // only fills page tables and changes no byte.
        let _ = unsafe {
            rustix::mm::madvise(aligned as *mut std::ffi::c_void, len, rustix::mm::Advice::LinuxPopulateRead)
        };
    }

    /// `rank`'s process id.
    pub fn pid(&self, rank: usize) -> u32 {
        self.pids[rank]
    }

    /// The words of `rank`'s single-copy line: its verdict, then its probe word's address.
    fn single_copy_words(&self, rank: usize) -> &[AtomicU64; 2] {
        // SAFETY: the single-copy line lies inside the workspace (layout constants), is
        // 128-aligned, and `AtomicU64` is valid for any bits.
        unsafe { self.bases[rank].add(SINGLE_COPY_OFFSET).cast::<[AtomicU64; 2]>().as_ref() }
    }

    /// Whether this process can read `rank`'s memory: reads its probe word by single copy and
    /// compares it with the value that process put there. Call once `rank` has stamped a slot
    /// (its probe address is published before).
    pub fn probe_peer(&self, rank: usize) -> bool {
        let addr = self.single_copy_words(rank)[1].load(Ordering::Acquire);
        let mut word = [0u8; 8];
        addr != 0
            && super::single_copy::read(self.pids[rank], addr, &mut word).is_ok()
            && u64::from_ne_bytes(word) == probe_value(self.pids[rank])
    }

    /// `rank`'s single-copy verdict: 0 not known yet, then what it published.
    pub fn single_copy_verdict(&self, rank: usize) -> u64 {
        self.single_copy_words(rank)[0].load(Ordering::Acquire)
    }

    /// Publishes this rank's single-copy verdict (nonzero) and wakes the ranks that sleep.
    pub fn publish_single_copy_verdict(&self, verdict: u64) {
        self.single_copy_words(self.rank)[0].store(verdict, Ordering::Release);
        self.wake_sleepers();
    }

    /// How many times arrival should poll the peers' stamps before waiting on the doorbell
    /// (0 when ranks share cores).
    pub fn arrival_polls(&self) -> usize {
        self.arrival_polls
    }

    /// Whether every local rank has a core of its own (the transport's waits spin; see
    /// `ShmConfig::for_local_ranks`), as counted before the ranks were pinned: a pinned rank
    /// sees one core.
    pub fn each_rank_has_a_core(&self) -> bool {
        self.arrival_polls > 0
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks (all of the world).
    pub fn size(&self) -> usize {
        self.segs.len()
    }

    fn counter_ref(&self, rank: usize, c: Counter) -> &AtomicU64 {
        // SAFETY: the counter lines are at the start of the workspace, inside the mapping,
        // 64-aligned (the workspace is page-aligned; `Counter::offset` is a multiple of 64
        // below `COUNTERS * LINE`); `AtomicU64` is valid for any bits.
        unsafe { self.bases[rank].add(c.offset()).cast::<AtomicU64>().as_ref() }
    }

    /// Reads `rank`'s counter `c` (`Acquire`: what it covers is visible afterwards).
    pub fn counter(&self, rank: usize, c: Counter) -> u64 {
        self.counter_ref(rank, c).load(Ordering::Acquire)
    }

    /// Publishes this rank's counter `c` (`Release`) and wakes the other ranks that sleep.
    pub fn publish(&self, c: Counter, value: u64) {
        self.counter_ref(self.rank, c).store(value, Ordering::Release);
        self.wake_sleepers();
    }

    /// Publishes this rank's counter `c` = `value` without ringing anyone: for progress inside
    /// a step whose end the caller publishes with [`ShmDirect::publish`] right after, whose
    /// ring wakes the sleepers then. Spinning readers see the value at once.
    pub fn publish_quiet(&self, c: Counter, value: u64) {
        self.counter_ref(self.rank, c).store(value, Ordering::Release);
    }

    /// Rings the doorbell of every other rank that is (about to be) asleep. Ranks that are
    /// not see stamps and counters themselves: every wait on them goes through
    /// [`crate::transport::Doorbell::wait_checked`], which checks them again after
    /// registering as a sleeper. Skipping the ring saves a write to a line the peer is
    /// spinning on, which on 2 ranks is a good part of an 8-byte all-reduce.
    pub fn wake_sleepers(&self) {
        for (r, s) in self.segs.iter().enumerate() {
            if r != self.rank {
                s.bell().ring_if_sleeping();
            }
        }
    }

    fn slot_base(&self, rank: usize, slot: usize) -> NonNull<u8> {
        // SAFETY: slot `slot % SLOTS` lies inside the workspace by the layout constants.
        unsafe { self.bases[rank].add(SLOTS_OFFSET + (slot % SLOTS) * SLOT_BYTES) }
    }

    /// The words of `rank`'s slot `slot`: stamp, check word, payload length and header.
    fn slot_words(&self, rank: usize, slot: usize) -> SlotWords<'_> {
        const _: () = assert!(SLOT_CHECK == 8 && SLOT_LEN == 16 && SLOT_HEADER_AT % 8 == 0);
        const _: () = assert!(SLOT_HEADER_AT + SLOT_HEADER <= SLOT_PAYLOAD && SLOT_LEN + 8 <= SLOT_INLINE);
        let base = self.slot_base(rank, slot).as_ptr();
        // SAFETY: the stamp, check and length words open the slot (128-aligned), the header
        // is 8-aligned on its second line (asserted above), all inside the mapping; the inline
        // payload is not among them (it starts at `SLOT_INLINE`); `AtomicU64` is valid for any
        // bits, and every access to these words is atomic.
        unsafe {
            SlotWords {
                stamp: &*base.cast::<AtomicU64>(),
                check: &*base.add(SLOT_CHECK).cast::<AtomicU64>(),
                len: &*base.add(SLOT_LEN).cast::<AtomicU64>(),
                header: &*base.add(SLOT_HEADER_AT).cast::<[AtomicU64; SLOT_HEADER / 8]>(),
            }
        }
    }

    fn stamp(&self, rank: usize, slot: usize) -> &AtomicU64 {
        self.slot_words(rank, slot).stamp
    }

    /// `rank`'s history check word of op `op`.
    fn history_check_word(&self, rank: usize, op: u64) -> &AtomicU64 {
        const _: () = assert!(HISTORY_OFFSET % 8 == 0 && HISTORY_OFFSET + HISTORY * 8 <= HISTORY_HEADERS);
        let at = HISTORY_OFFSET + (op % HISTORY as u64) as usize * 8;
        // SAFETY: word `op % HISTORY` of the check words lies inside the workspace (layout
        // constants, asserted above), is 8-aligned, and `AtomicU64` is valid for any bits;
        // every access to it is atomic.
        unsafe { self.bases[rank].add(at).cast::<AtomicU64>().as_ref() }
    }

    /// The words of `rank`'s history header of op `op`.
    fn history_header_words(&self, rank: usize, op: u64) -> &[AtomicU64; SLOT_HEADER / 8] {
        const _: () = assert!(SLOT_HEADER <= HISTORY_ENTRY && HISTORY_HEADERS % LINE == 0);
        let at = HISTORY_HEADERS + (op % HISTORY as u64) as usize * HISTORY_ENTRY;
        // SAFETY: entry `op % HISTORY` lies inside the workspace (layout constants), is
        // 64-aligned (the headers start on a line), and `AtomicU64` is valid for any bits;
        // every access to these words is atomic.
        unsafe { self.bases[rank].add(at).cast::<[AtomicU64; SLOT_HEADER / 8]>().as_ref() }
    }

    /// The check word `rank` wrote in its history for op `op`; meaningful once the caller has
    /// seen `rank`'s stamp of op `op` or a later one, and until `rank` writes op
    /// `op + HISTORY` (which the slot protocol holds back until this rank has checked `op`).
    pub fn history_check(&self, rank: usize, op: u64) -> u64 {
        self.history_check_word(rank, op).load(Ordering::Relaxed)
    }

    /// The header `rank` wrote in its history for op `op` (as [`ShmDirect::history_check`]).
    pub fn history_header(&self, rank: usize, op: u64) -> [u8; SLOT_HEADER] {
        let mut h = [0u8; SLOT_HEADER];
        for (word, bytes) in self.history_header_words(rank, op).iter().zip(h.chunks_exact_mut(8)) {
            bytes.copy_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
        }
        h
    }

    /// Writes this rank's slot and history entry of direct op `op` (slot `op % SLOTS`, entry
    /// `op % HISTORY`): `header` (the [`SLOT_HEADER`] bytes as little-endian words), its
    /// `check` word and `payload` (≤ [`SMALL_BYTES`]; inline when ≤ [`INLINE_BYTES`]), then
    /// stamps the slot `op + 1` and wakes every other rank. `copy(dst, payload)` puts the
    /// payload in (the caller's choice of stores and of timing them; it must copy every byte,
    /// and a copy by non-temporal stores must end with a store fence, as
    /// `copy::copy_streaming` does, so the bytes are ordered before the stamp).
    ///
    /// The slot protocol of `algorithms/shm_direct/mod.rs` makes sure that no rank still reads
    /// the slot or the entry (a slot is rewritten [`SLOTS`] ops later, once every rank has read
    /// it; an entry [`HISTORY`] ops later, once every rank has checked it); the module docs
    /// say what that leaves to the protocol.
    ///
    /// # Panics
    /// If `payload` is longer than [`SMALL_BYTES`].
    pub fn write_slot(
        &self,
        op: u64,
        check: u64,
        header: &[u64; SLOT_HEADER / 8],
        payload: &[u8],
        copy: impl FnOnce(&mut [u8], &[u8]),
    ) {
        assert!(payload.len() <= SMALL_BYTES, "slot payload of {} bytes over {SMALL_BYTES}", payload.len());
        let slot = (op % SLOTS as u64) as usize;
        let words = self.slot_words(self.rank, slot);
        self.history_check_word(self.rank, op).store(check, Ordering::Relaxed);
        for ((word, entry), w) in words.header.iter().zip(self.history_header_words(self.rank, op)).zip(header) {
            word.store(w.to_le(), Ordering::Relaxed);
            entry.store(w.to_le(), Ordering::Relaxed);
        }
        words.check.store(check, Ordering::Relaxed);
        words.len.store(payload.len() as u64, Ordering::Relaxed);
        let at = if payload.len() <= INLINE_BYTES { SLOT_INLINE } else { SLOT_PAYLOAD };
        // SAFETY: `at + payload.len()` lies inside this rank's slot (asserted length, layout
        // constants: the inline room is `INLINE_BYTES` from `SLOT_INLINE`, the other
        // `SMALL_BYTES` from `SLOT_PAYLOAD`), past the words written above; the payload is
        // ordinary memory, not in the workspace; only this rank writes its slots, and no
        // reader holds this slot's bytes (slot protocol, see the module docs), so the slice is
        // this call's alone until the stamp below.
        let dst =
            unsafe { std::slice::from_raw_parts_mut(self.slot_base(self.rank, slot).as_ptr().add(at), payload.len()) };
        copy(dst, payload);
        words.stamp.store(op + 1, Ordering::Release);
        self.wake_sleepers();
    }

    /// The check word of `rank`'s slot `slot`; meaningful once the caller has seen the slot's
    /// stamp for the current op.
    pub fn slot_check(&self, rank: usize, slot: usize) -> u64 {
        self.slot_words(rank, slot).check.load(Ordering::Relaxed)
    }

    /// The words of the announcement line: the tag, then the record.
    fn announce_words(&self, rank: usize) -> &[AtomicU64; 1 + ANNOUNCE_BYTES / 8] {
        // SAFETY: the announcement line lies inside the workspace (layout constants), is
        // 128-aligned, and `AtomicU64` is valid for any bits.
        unsafe { self.bases[rank].add(ANNOUNCE_OFFSET).cast::<[AtomicU64; 1 + ANNOUNCE_BYTES / 8]>().as_ref() }
    }

    /// Publishes this rank's announcement: `record` under `tag` (nonzero), replacing the
    /// previous one, and wakes the ranks that sleep. A seqlock: the tag is cleared while the
    /// record is rewritten, so [`ShmDirect::announced`] never returns a torn record.
    pub fn announce(&self, tag: u64, record: &[u8; ANNOUNCE_BYTES]) {
        let w = self.announce_words(self.rank);
        w[0].store(0, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        for (word, bytes) in w[1..].iter().zip(record.chunks_exact(8)) {
            word.store(u64::from_le_bytes(bytes.try_into().expect("8 bytes")), Ordering::Relaxed);
        }
        w[0].store(tag, Ordering::Release);
        self.wake_sleepers();
    }

    /// `rank`'s announced record if its tag is `tag` now (and was not being rewritten).
    pub fn announced(&self, rank: usize, tag: u64) -> Option<[u8; ANNOUNCE_BYTES]> {
        let w = self.announce_words(rank);
        if tag == 0 || w[0].load(Ordering::Acquire) != tag {
            return None;
        }
        let mut record = [0u8; ANNOUNCE_BYTES];
        for (word, bytes) in w[1..].iter().zip(record.chunks_exact_mut(8)) {
            bytes.copy_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
        }
        std::sync::atomic::fence(Ordering::Acquire);
        (w[0].load(Ordering::Relaxed) == tag).then_some(record)
    }

    /// A snapshot of the header of `rank`'s slot `slot` whatever its state, read word by
    /// word: it may be torn while the owner rewrites the slot, so callers that have not seen
    /// the slot's stamp for their op use it only as a hint that they confirm (a fingerprint
    /// with the op's sequence number). Once the stamp is seen, it is the op's header.
    pub fn slot_header_snapshot(&self, rank: usize, slot: usize) -> [u8; SLOT_HEADER] {
        let mut h = [0u8; SLOT_HEADER];
        for (word, bytes) in self.slot_words(rank, slot).header.iter().zip(h.chunks_exact_mut(8)) {
            bytes.copy_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
        }
        h
    }

    /// The stamp of `rank`'s slot `slot` (`Acquire`).
    pub fn slot_stamp(&self, rank: usize, slot: usize) -> u64 {
        self.stamp(rank, slot).load(Ordering::Acquire)
    }

    /// The first `len` bytes of the payload of `rank`'s slot `slot` (inline or not, as the
    /// writer's payload length says). Meaningful once the caller has seen the slot's stamp for
    /// the current op; the caller drops the slice before the slot protocol lets the writer
    /// reuse the slot (module docs).
    ///
    /// # Panics
    /// If `len` is over [`SMALL_BYTES`] or `rank` is not below [`ShmDirect::size`].
    pub fn slot_payload(&self, rank: usize, slot: usize, len: usize) -> &[u8] {
        assert!(len <= SMALL_BYTES, "slot payload of {len} bytes over {SMALL_BYTES}");
        let written = self.slot_words(rank, slot).len.load(Ordering::Relaxed);
        // A prefix longer than the inline room (a peer's bad length) reads the other region:
        // wrong bytes, which the caller's checks catch, never past the slot.
        let inline = written <= INLINE_BYTES as u64 && len <= INLINE_BYTES;
        let at = if inline { SLOT_INLINE } else { SLOT_PAYLOAD };
        // SAFETY: `at + len` lies inside the slot (asserted `len`; inline only when
        // `len ≤ INLINE_BYTES`); bytes are valid for any bits; this process writes slots only
        // through `write_slot`, and the slot protocol keeps every writer off a slot while it
        // is read (module docs).
        unsafe { std::slice::from_raw_parts(self.slot_base(rank, slot).as_ptr().add(at), len) }
    }

    /// Start of `rank`'s chunk buffer of half `half`, with `offset..offset + len` checked to
    /// lie inside it (without overflow).
    fn region(&self, rank: usize, half: usize, offset: usize, len: usize) -> *mut u8 {
        assert!(
            len <= CHUNK_BYTES && offset <= CHUNK_BYTES - len,
            "chunk range {offset}+{len} outside the {CHUNK_BYTES}-byte buffer"
        );
        let off = BIG_OFFSET + (half & 1) * CHUNK_BYTES + offset;
        // SAFETY: inside the workspace by the layout constants and the check above.
        unsafe { self.bases[rank].as_ptr().add(off) }
    }

    /// Peer `rank`'s chunk buffer of half `half`, `len` bytes from `offset`. The caller
    /// reads only what the owner has published (its counters) and not yet released for
    /// rewriting (chunk protocol, `algorithms/shm_direct/`). This rank's own buffer is only
    /// reachable through [`ShmDirect::chunk_mut`].
    ///
    /// # Panics
    /// If `rank` is this rank or not below [`ShmDirect::size`], or the range is outside the
    /// buffer.
    pub fn chunk(&self, rank: usize, half: usize, offset: usize, len: usize) -> &[u8] {
        assert!(rank != self.rank, "rank {rank} read its own chunk buffer as a peer's");
        // SAFETY: inside the peer's buffer (checked by `region`); bytes are valid for any
        // bits; this process never writes a peer's buffer, and the peer rewrites it only
        // after this rank has released it (chunk protocol, module docs).
        unsafe { std::slice::from_raw_parts(self.region(rank, half, offset, len), len) }
    }

    /// This rank's chunk buffer of half `half`, `len` bytes from `offset`, writable: the caller
    /// writes only where no peer reads (chunk protocol, `algorithms/shm_direct/`).
    ///
    /// # Panics
    /// If the range is outside the buffer, or another [`ChunkMut`] of this rank is alive (one
    /// at a time, so two writable views never alias).
    pub fn chunk_mut(&self, half: usize, offset: usize, len: usize) -> ChunkMut<'_> {
        let at = self.region(self.rank, half, offset, len);
        assert!(!self.own_chunk_out.swap(true, Ordering::Acquire), "two writable views of this rank's chunk buffer");
        // SAFETY: inside this rank's buffer (checked by `region`); no other view of it exists
        // in this process (the flag above; `chunk` refuses this rank); peers only read it,
        // where and when the chunk protocol lets them.
        let bytes = unsafe { std::slice::from_raw_parts_mut(at, len) };
        ChunkMut { bytes, out: &self.own_chunk_out }
    }
}

/// The atomic words of one slot ([`ShmDirect::slot_words`]).
struct SlotWords<'a> {
    stamp: &'a AtomicU64,
    check: &'a AtomicU64,
    len: &'a AtomicU64,
    header: &'a [AtomicU64; SLOT_HEADER / 8],
}

/// A writable view of this rank's chunk buffer ([`ShmDirect::chunk_mut`]); one at a time.
#[derive(Debug)]
pub struct ChunkMut<'a> {
    bytes: &'a mut [u8],
    out: &'a AtomicBool,
}

impl std::ops::Deref for ChunkMut<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl std::ops::DerefMut for ChunkMut<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
}

impl Drop for ChunkMut<'_> {
    fn drop(&mut self) {
        self.out.store(false, Ordering::Release);
    }
}
