//! Direct all-reduce.
//!
//! **Small** (≤ [`SMALL_BYTES`]): after arrival every rank reduces all payloads in
//! rank order (identical results everywhere). One step; each rank writes S and reads n·S.
//!
//! **Large**, per chunk of [`CHUNK_BYTES`] (two halves, so chunk g+1 overlaps
//! with the tail of chunk g): copy every slice but my own into my chunk buffer → reduce my
//! 1/n slice of the user's buffer in place with every other rank's chunk buffer, 16 KiB at a
//! time, copying each reduced piece (still in L1) to my chunk buffer → copy every other rank's
//! reduced slice into the user's buffer. Three steps per chunk; per rank (n−1)/n·S copied in,
//! S read and 2S/n written by the reduction, (n−1)/n·S copied out (writing the user's slice
//! from the reduction instead of copying it out made 2 ranks 20–30% faster at 1–16 MiB). Chunks are
//! small enough to stay in the L2 cache between the steps. Out of place
//! ([`ReduceBuffers::Apart`]) the same steps read the input and write the output, each
//! reduced piece being copied from the input into the output just before it is reduced there.
//!
//! **Where a chunk goes in its half** ([`chunk_place`]): a chunk of at most half a half does
//! not always start at the half's start; consecutive uses of a half take turns over its places
//! (the chunk's size rounded up to a power of two), so a rank rewrites a line of its chunk
//! buffer only after several more ops. The reason is the cost of writing a line that the peer
//! still holds in its cache from reading it: the write must first take the line back from the
//! peer's core. With every chunk at the half's start, a mid-size op (64–256 KiB) rewrote, two
//! ops later, the very lines the peer had just read, all still in its L2, and both writing
//! steps paid that: on the 2-core AMD VM, copying a 32 KiB slice into the chunk buffer took
//! 4.9–5.9 µs (6 GB/s), while copying 32 KiB out of the peer's buffer took 1.1 µs. Taking turns
//! lets the peer's cache drop the lines before they are rewritten; 2 ranks (4 interleaved
//! rounds, both modes) went from 12.3–16.0 to 8.0–8.8 µs at 64 KiB, 23.8–29.3 to 13.2–16.5 µs
//! at 128 KiB, 31.5–47.4 to 20.9–28.6 µs at 256 KiB (docs/perf_mid_allreduce.md). Safety is
//! unchanged: a chunk stays in half `g & 1`, which chunk `g` rewrites only after every rank is
//! done with chunk `g − 2` and every chunk before.
//!
//! **Far cores.** Where the host places the cores far apart, the same writes (copy-in and the
//! reduced slice) pay for every line the peer still holds however long ago it read it; both
//! then go in by non-temporal stores, as the far-cores watch of `copy_in.rs` decides per
//! chunk.

use std::ops::Range;

use super::copy_in::CopyIn;
use super::{arrive, is_small, wait_counter, Direct};
use crate::algorithms::schedule::chunk;
use crate::algorithms::ReduceBuffers;
use crate::copy::copy;
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::engine::Ctx;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};
use crate::transport::shm::workspace::{Counter, ShmDirect, CHUNK_BYTES};
use crate::wire::Fingerprint;

/// Bytes reduced at a time in the reduce step (fits in L1 with its inputs).
pub(super) const REDUCE_PIECE_BYTES: usize = 16 * 1024;

/// The smallest step between the places of a chunk in its half (a page).
const PLACE_STEP_MIN: usize = 4096;

/// Slice `r` of `n` of the chunk of `len` elements at `start`, as a range of the whole buffer.
pub(super) fn slice(start: usize, len: usize, n: usize, r: usize) -> Range<usize> {
    let s = chunk(len, n, r);
    start + s.start..start + s.end
}

/// Where chunk `g`, of `bytes` bytes, starts in its half (module docs): the halves' uses take
/// turns over the places `0, step, 2·step, …` that fit in [`CHUNK_BYTES`], `step` being
/// `bytes` rounded up to a power of two (at least [`PLACE_STEP_MIN`]); a chunk of more than half
/// a half always starts at 0. Every rank computes the same place from the same `g` and size.
pub(super) fn chunk_place(g: u64, bytes: usize) -> usize {
    let step = bytes.max(PLACE_STEP_MIN).next_power_of_two();
    let places = (CHUNK_BYTES / step).max(1) as u64;
    // Chunk g uses half g & 1; g >> 1 counts that half's uses.
    ((g >> 1) % places) as usize * step
}

/// The copy-in step of chunk `g` (the `len` elements of `input` at `start`, placed `at` bytes
/// into its half): waits until its half is free (every rank published `CopiedOut` = g − 1),
/// copies every other rank's slice into it, publishes `CopiedIn` = g + 1 and waits for every
/// rank's.
///
/// Plain stores, timed by the far-cores watch (`copy_in.rs`), or non-temporal ones while the
/// cores look far apart. Returns which: the caller's later writes into its half this chunk
/// (the reduced slice) follow the same choice, since the peers read those lines last too.
pub(super) fn copy_in_at<T: Element>(
    ctx: &mut Ctx<'_>,
    shm: &ShmDirect,
    g: u64,
    at: usize,
    start: usize,
    len: usize,
    input: &[T],
) -> Result<bool> {
    let (n, me, size) = (ctx.size, ctx.rank, std::mem::size_of::<T>());
    // Half `g & 1` was last used by chunk g-2: everyone must be done reading it.
    wait_counter(ctx, shm, Counter::CopiedOut, g.saturating_sub(1))?;
    let mut copy_in = CopyIn::new(false, shm.each_rank_has_a_core());
    for r in (0..n).filter(|r| *r != me) {
        let s = slice(start, len, n, r);
        let off = at + (s.start - start) * size;
        // Others read slice r of my buffer only after I publish CopiedIn = g+1, and
        // they finished with chunk g-2 (waited above).
        copy_in.copy(&mut shm.chunk_mut((g & 1) as usize, off, s.len() * size), as_bytes(&input[s]));
    }
    let streamed = copy_in.streams();
    copy_in.done();
    shm.publish(Counter::CopiedIn, g + 1);
    wait_counter(ctx, shm, Counter::CopiedIn, g + 1)?;
    Ok(streamed)
}

/// The copy-out step of chunk `g` (the `len` elements of `output` at `start`, placed `at` bytes
/// into its half): waits for every rank's `Reduced` = g + 1 and copies every other rank's
/// reduced slice into `output`.
pub(super) fn copy_out_at<T: Element>(
    ctx: &mut Ctx<'_>,
    shm: &ShmDirect,
    g: u64,
    at: usize,
    start: usize,
    len: usize,
    output: &mut [T],
) -> Result<()> {
    let (n, me, size) = (ctx.size, ctx.rank, std::mem::size_of::<T>());
    wait_counter(ctx, shm, Counter::Reduced, g + 1)?;
    for r in (0..n).filter(|r| *r != me) {
        let s = slice(start, len, n, r);
        if s.is_empty() {
            continue;
        }
        let off = at + (s.start - start) * size;
        // Rank r published its reduced slice for chunk g and rewrites it only after
        // everyone (me included) published CopiedOut = g+1.
        let src = shm.chunk(r, (g & 1) as usize, off, s.len() * size);
        copy(as_bytes_mut(&mut output[s]), src);
    }
    Ok(())
}

/// `out` = the `n` ranks' payloads in this op's `slot` (each `out`'s size), reduced in rank
/// order.
pub(super) fn reduce_slots<T: Element>(d: &Direct<'_>, slot: usize, n: usize, out: &mut [T], op: ReduceOp) {
    let bytes = std::mem::size_of_val(out);
    for r in 0..n {
        // Stamped for this op (arrive waited for it); read before the slot can be
        // reused (only once this rank has arrived at a later op).
        let payload = d.shm.slot_payload(r, slot, bytes);
        if r == 0 {
            copy(as_bytes_mut(out), payload);
        } else {
            reduce::reduce_into(out, bytemuck::cast_slice(payload), op);
        }
    }
}

/// Direct all-reduce (`op` is the combiner; `Avg` is finished by the caller).
pub(crate) fn all_reduce<'b, T: Element>(
    ctx: &mut Ctx<'_>,
    d: &mut Direct<'_>,
    fp: &Fingerprint,
    mut io: ReduceBuffers<'b, T>,
    op: ReduceOp,
) -> Result<&'b mut [T]> {
    let total = io.len();
    let bytes = total * std::mem::size_of::<T>();
    if is_small(bytes) {
        let slot = arrive(ctx, d, fp, as_bytes(io.input(0..total)))?;
        let out = io.into_output();
        reduce_slots(d, slot, ctx.size, out, op);
        return Ok(out);
    }
    arrive(ctx, d, fp, &[])?;
    let (n, me, size) = (ctx.size, ctx.rank, std::mem::size_of::<T>());
    let per_chunk = CHUNK_BYTES / size;
    for start in (0..total).step_by(per_chunk) {
        let part_len = (start + per_chunk).min(total) - start;
        let g = d.state.chunks;
        let half = (g & 1) as usize;
        let at = chunk_place(g, part_len * size);
        let shm = d.shm;
        let slice = |r: usize| slice(start, part_len, n, r);
        let far = copy_in_at(ctx, shm, g, at, start, part_len, io.input(0..total))?;
        let to_half = if far { crate::copy::copy_streaming } else { copy };
        let mine = slice(me);
        if !mine.is_empty() {
            let (off, len) = (at + (mine.start - start) * size, mine.len() * size);
            // Slice `me` of my buffer is read by others only after I publish
            // Reduced = g+1; the other ranks' slices `me` were published for chunk g and are
            // not rewritten before everyone published CopiedOut = g+1.
            let mut own = shm.chunk_mut(half, off, len);
            let dst: &mut [T] = bytemuck::cast_slice_mut(&mut own);
            // As above, for the other ranks' published slices.
            let theirs = |r: usize| -> &[T] { bytemuck::cast_slice(shm.chunk(r, half, off, len)) };
            // In L1-sized pieces: reduce into the result's buffer (apart: after copying the
            // input's piece there), then copy the piece (still in L1) to my chunk buffer for
            // the others; so my own slice needs no copy-out.
            let piece = (REDUCE_PIECE_BYTES / size).max(1);
            for lo in (0..mine.len()).step_by(piece) {
                let hi = (lo + piece).min(mine.len());
                let user = io.loaded(mine.start + lo..mine.start + hi);
                for r in (0..n).filter(|r| *r != me) {
                    reduce::reduce_into(user, &theirs(r)[lo..hi], op);
                }
                to_half(as_bytes_mut(&mut dst[lo..hi]), as_bytes(user));
            }
        }
        shm.publish(Counter::Reduced, g + 1);
        copy_out_at(ctx, shm, g, at, start, part_len, io.output(0..total))?;
        shm.publish(Counter::CopiedOut, g + 1);
        d.state.chunks += 1;
    }
    Ok(io.into_output())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_stays_inside_its_half() {
        for bytes in [1, 4, 4096, 4097, 65536, 96 * 1024 + 4, 256 * 1024, 256 * 1024 + 4, CHUNK_BYTES - 4, CHUNK_BYTES]
        {
            for g in 0..64 {
                let at = chunk_place(g, bytes);
                assert!(at + bytes <= CHUNK_BYTES, "chunk {g} of {bytes} B at {at}");
                assert_eq!(at % PLACE_STEP_MIN, 0, "chunk {g} of {bytes} B at {at}: not page-aligned");
            }
        }
    }

    #[test]
    fn places_take_turns_per_half_and_large_chunks_start_at_zero() {
        // 64 KiB: 8 places a half; chunks g and g + 1 share the place index but not the half.
        let places: Vec<usize> = (0..20).map(|g| chunk_place(g, 64 * 1024)).collect();
        assert_eq!(places[..4], [0, 0, 65536, 65536]);
        assert_eq!(places[14..18], [7 * 65536, 7 * 65536, 0, 0]);
        // A half's consecutive uses (g, g + 2) never share a place while there are two or more.
        for bytes in [4096, 100_000, 256 * 1024] {
            for g in 0..32 {
                assert_ne!(chunk_place(g, bytes), chunk_place(g + 2, bytes), "{bytes} B, chunk {g}");
            }
        }
        for g in 0..8 {
            assert_eq!(chunk_place(g, 256 * 1024 + 4), 0);
            assert_eq!(chunk_place(g, CHUNK_BYTES), 0);
        }
    }
}
