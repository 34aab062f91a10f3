//! The workspace every rank's segment carries for direct shared-memory collectives: counters
//! and buffers that all ranks of the host can read straight from each other's segments, so a
//! collective needs no copy through a ring.
//!
//! This file owns the workspace layout and the raw pointers into it; the protocols that use
//! it (who writes what when) are in `algorithms/shm_direct.rs`. It knows nothing about ops.
//!
//! # Workspace layout
//!
//! | offset | what |
//! | --- | --- |
//! | 0 | counters, one 128-byte line each: `arrived`, `copied_in`, `reduced`, `copied_out` |
//! | [`SLOTS_OFFSET`] | two *slots* (by op parity), each an 8-byte stamp, a 56-byte header (fingerprint + length) and [`SMALL_BYTES`] of payload, so a small op's stamp, header and first 64 payload bytes share two adjacent cache lines |
//! | [`BIG_OFFSET`] | two *halves* of [`CHUNK_BYTES`] each |
//!
//! Writers publish with `Release` stores to a counter or stamp after writing the bytes it
//! covers; readers load it with `Acquire` before reading those bytes.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::segment::Segment;

/// Default number of times arrival polls the peers' stamps before the doorbell protocol,
/// when every rank has a core of its own.
pub const ARRIVAL_POLLS: usize = 200;

/// Largest payload that travels inline in a slot (small-message path).
pub const SMALL_BYTES: usize = 32 * 1024;
/// Bytes per chunk of the large-message path (per half). Small enough that a chunk stays in
/// the L2 cache between being copied in, reduced and copied out.
pub const CHUNK_BYTES: usize = 512 * 1024;

const LINE: usize = 128;
const COUNTERS: usize = 4;
/// Offset of the two slots.
pub const SLOTS_OFFSET: usize = COUNTERS * LINE;
/// Bytes of the header that follows the 8-byte stamp.
pub const SLOT_HEADER: usize = 56;
const SLOT_PAYLOAD: usize = 8 + SLOT_HEADER;
const SLOT_BYTES: usize = (SLOT_PAYLOAD + SMALL_BYTES).next_multiple_of(LINE);
/// Offset of the chunk buffers (page-aligned).
pub const BIG_OFFSET: usize = (SLOTS_OFFSET + 2 * SLOT_BYTES).next_multiple_of(4096);
/// Size of the whole workspace.
pub const WORKSPACE_BYTES: usize = BIG_OFFSET + 2 * CHUNK_BYTES;

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
        ShmDirect { rank, arrival_polls, segs, bases }
    }

    /// How many times arrival should poll the peers' stamps before waiting on the doorbell
    /// (0 when ranks share cores).
    pub fn arrival_polls(&self) -> usize {
        self.arrival_polls
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
        // 128-aligned (the workspace is page-aligned); `AtomicU64` is valid for any bits.
        unsafe { self.bases[rank].add(c as usize * LINE).cast::<AtomicU64>().as_ref() }
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

    fn slot_base(&self, rank: usize, parity: usize) -> NonNull<u8> {
        // SAFETY: slot `parity & 1` lies inside the workspace by the layout constants.
        unsafe { self.bases[rank].add(SLOTS_OFFSET + (parity & 1) * SLOT_BYTES) }
    }

    fn stamp(&self, rank: usize, parity: usize) -> &AtomicU64 {
        // SAFETY: the stamp is the first word of the slot, which is 128-aligned.
        unsafe { self.slot_base(rank, parity).cast::<AtomicU64>().as_ref() }
    }

    /// Writes this rank's slot `parity`: `header` (≤ [`SLOT_HEADER`] bytes) and `payload` (≤ [`SMALL_BYTES`]),
    /// then stamps it `stamp` and wakes every other rank.
    ///
    /// # Safety
    /// No other rank may be reading this slot: the caller follows the parity protocol (a slot
    /// is rewritten two ops later, after every rank has arrived at the op in between).
    pub unsafe fn write_slot(&self, parity: usize, stamp: u64, header: &[u8], payload: &[u8]) {
        assert!(header.len() <= SLOT_HEADER && payload.len() <= SMALL_BYTES);
        let base = self.slot_base(self.rank, parity);
        // SAFETY: both ranges lie inside the slot (asserted sizes); by the caller's contract
        // nobody reads them now; the source slices are ordinary memory, not in this slot.
        unsafe {
            std::ptr::copy_nonoverlapping(header.as_ptr(), base.as_ptr().add(8), header.len());
            crate::copy::copy_raw(base.as_ptr().add(SLOT_PAYLOAD), payload.as_ptr(), payload.len());
        }
        self.stamp(self.rank, parity).store(stamp, Ordering::Release);
        self.wake_sleepers();
    }

    /// The stamp of `rank`'s slot `parity` (`Acquire`).
    pub fn slot_stamp(&self, rank: usize, parity: usize) -> u64 {
        self.stamp(rank, parity).load(Ordering::Acquire)
    }

    /// `rank`'s slot `parity`: its header ([`SLOT_HEADER`] bytes) and `len` bytes of payload.
    ///
    /// # Safety
    /// The caller has seen the slot's stamp for the current op (so the writer is done) and
    /// does not keep the slices past the point where the writer may reuse the slot.
    pub unsafe fn slot(&self, rank: usize, parity: usize, len: usize) -> (&[u8], &[u8]) {
        assert!(len <= SMALL_BYTES);
        let base = self.slot_base(rank, parity);
        // SAFETY: inside the slot; not written concurrently by the caller's contract.
        unsafe {
            (
                std::slice::from_raw_parts(base.as_ptr().add(8), SLOT_HEADER),
                std::slice::from_raw_parts(base.as_ptr().add(SLOT_PAYLOAD), len),
            )
        }
    }

    fn region(&self, rank: usize, half: usize) -> *mut u8 {
        let off = BIG_OFFSET + (half & 1) * CHUNK_BYTES;
        // SAFETY: inside the workspace by the layout constants.
        unsafe { self.bases[rank].as_ptr().add(off) }
    }

    /// `rank`'s chunk buffer of half `half`, `len` bytes from `offset`.
    ///
    /// # Safety
    /// The caller follows the chunk protocol: it reads only what the owner has published
    /// (counters) and is not overwriting, and writes only its own buffer where no one reads.
    pub unsafe fn chunk(&self, rank: usize, half: usize, offset: usize, len: usize) -> &[u8] {
        assert!(offset + len <= CHUNK_BYTES);
        // SAFETY: inside the region (asserted); exclusivity per the caller's contract.
        unsafe { std::slice::from_raw_parts(self.region(rank, half).add(offset), len) }
    }

    /// This rank's chunk buffer of half `half`, mutable.
    ///
    /// # Safety
    /// As [`ShmDirect::chunk`]: nobody else reads these bytes while the slice lives.
    #[allow(clippy::mut_from_ref)] // the memory is shared with other processes, not owned by `self`
    pub unsafe fn chunk_mut(&self, half: usize, offset: usize, len: usize) -> &mut [u8] {
        assert!(offset + len <= CHUNK_BYTES);
        // SAFETY: inside this rank's region; exclusivity per the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.region(self.rank, half).add(offset), len) }
    }
}
