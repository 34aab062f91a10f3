//! The shared-memory layouts that more than one file of this transport reads: the doorbell
//! words in a segment ([`Bell`], whose protocol is `futex.rs`) and the direct collectives'
//! workspace (`workspace.rs`), which `segment.rs` sizes and places. Only sizes, offsets and
//! `#[repr(C)]` structs live here, so that `segment`, `workspace` and `futex` import this file
//! and not each other.
//!
//! # The direct workspace
//!
//! | offset | what |
//! | --- | --- |
//! | 0 | [`COUNTERS`] lines of progress counters, one 128-byte line each |
//! | [`SINGLE_COPY_OFFSET`] | the single-copy line: this rank's verdict on reading every peer's memory (0 not yet known) and the address of its probe word |
//! | [`ANNOUNCE_OFFSET`] | the announcement line (a fingerprint, [`ANNOUNCE_BYTES`]) |
//! | [`SLOTS_OFFSET`] | [`SLOTS`] slots: a line with an 8-byte stamp, an 8-byte check word, the payload's length and up to [`INLINE_BYTES`] of payload; a line with the [`SLOT_HEADER`]-byte header; up to [`SMALL_BYTES`] of payload (when it is not inline) |
//! | [`HISTORY_OFFSET`] | the *fingerprint history* (op `k` writes entry `k % HISTORY`), so that a rank checking a loose op late finds its fingerprint after its slot was reused: [`HISTORY`] check words side by side (a late check of several ops reads one or two lines), then [`HISTORY`] 64-byte entries, each the [`SLOT_HEADER`]-byte header of that op (read only when check words differ) |
//! | [`BIG_OFFSET`] (page-aligned) | two chunk buffers of [`CHUNK_BYTES`] |

use super::sync::AtomicU32;

/// The doorbell words in the owner's segment: the counter and its sleepers on one 128-byte
/// line, the heartbeat on the next, so that the owner stamping its heartbeat every op does not
/// take the line that peers read to decide whether to ring, and the count of control
/// messages on a third, which the owner reads twice per op and peers write only when they
/// send one (a ring, which every send makes, must not take it from the owner's cache).
#[repr(C, align(128))]
#[derive(Default)]
pub(crate) struct Bell {
    /// The counter rung by peers; also the futex word.
    pub(crate) epoch: AtomicU32,
    /// How many threads of the owner are (about to be) inside `FUTEX_WAIT`.
    pub(crate) waiters: AtomicU32,
    /// Padding to the end of the first 128-byte line.
    pub(super) _line: [u64; 15],
    /// When the owner last showed life inside oxcomm (monotonic ns; 0 never).
    pub(crate) heartbeat: std::sync::atomic::AtomicU64,
    /// The op word of the op the owner last ran ([`crate::wire::Fingerprint::op_word`]).
    pub(crate) last_op: std::sync::atomic::AtomicU64,
    /// Padding to the end of the second line.
    pub(super) _line2: [u64; 14],
    /// Control messages peers have put in the owner's control rings so far (wrapping).
    pub(crate) ctrl: std::sync::atomic::AtomicU32,
}

/// Largest payload that travels inline in a slot (small-message path).
pub const SMALL_BYTES: usize = 32 * 1024;
/// Bytes per chunk of the large-message path (per half). Small enough that a chunk stays in
/// the L2 cache between being copied in, reduced and copied out.
pub const CHUNK_BYTES: usize = 512 * 1024;

pub(super) const LINE: usize = 128;
pub(super) const COUNTERS: usize = 4;
/// Offset of the single-copy line (after the counters).
pub const SINGLE_COPY_OFFSET: usize = COUNTERS * LINE;
/// Offset of the announcement line (after the single-copy line).
pub const ANNOUNCE_OFFSET: usize = SINGLE_COPY_OFFSET + LINE;
/// Bytes of an announcement's record (an op fingerprint).
pub const ANNOUNCE_BYTES: usize = 48;
/// Offset of the slots.
pub const SLOTS_OFFSET: usize = ANNOUNCE_OFFSET + LINE;
/// Slots per rank: direct op `k` writes slot `k % SLOTS`, so a rank can run up to
/// `SLOTS - 1` ops ahead of the slowest (`algorithms/shm_direct/mod.rs`). 16 (514 KiB of
/// slots per rank) rather than 8: with 4 ranks sharing 2 cores, small gathers and scatters
/// took 0.86–0.89 µs instead of 1.13–1.32 (docs/benchmarks.md); 2 ranks gain nothing more.
pub const SLOTS: usize = 16;
/// Entries of the fingerprint history: at least twice the ops a rank may run ahead
/// (`SLOTS - 1`), so an entry is rewritten only after every rank has checked it (the proof is
/// in `algorithms/shm_direct/mod.rs`).
pub const HISTORY: usize = 2 * SLOTS;
/// Bytes of a history entry (a header, padded).
pub(super) const HISTORY_ENTRY: usize = 64;
/// Bytes of a slot's header (an op fingerprint and a length), on the slot's second line.
pub const SLOT_HEADER: usize = 56;
/// Offset of the check word in a slot (after the stamp, on the same line).
pub(super) const SLOT_CHECK: usize = 8;
/// Offset of the payload's length in a slot (after the check word, on the same line): where
/// the payload is follows from it, so readers of a prefix find it too.
pub(super) const SLOT_LEN: usize = 16;
/// Offset of the inline payload in a slot (after the length, on the same line).
pub(super) const SLOT_INLINE: usize = 24;
/// Largest payload that travels on the stamp's own line, so a reader of a tiny op (an 8-byte
/// all-reduce) takes one cache line from the writer instead of two.
pub const INLINE_BYTES: usize = 64 - SLOT_INLINE;
/// Offset of the header in a slot (its second 64-byte line).
pub(super) const SLOT_HEADER_AT: usize = 64;
/// Offset of a payload that is not inline.
pub(super) const SLOT_PAYLOAD: usize = 128;
pub(super) const SLOT_BYTES: usize = (SLOT_PAYLOAD + SMALL_BYTES).next_multiple_of(LINE);
/// Offset of the fingerprint history's check words (after the slots).
pub const HISTORY_OFFSET: usize = SLOTS_OFFSET + SLOTS * SLOT_BYTES;
/// Offset of the fingerprint history's headers (after its check words).
pub(super) const HISTORY_HEADERS: usize = (HISTORY_OFFSET + HISTORY * 8).next_multiple_of(LINE);
/// Offset of the chunk buffers (page-aligned).
pub const BIG_OFFSET: usize = (HISTORY_HEADERS + HISTORY * HISTORY_ENTRY).next_multiple_of(4096);
/// Size of the whole workspace.
pub const WORKSPACE_BYTES: usize = BIG_OFFSET + 2 * CHUNK_BYTES;
