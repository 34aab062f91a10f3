//! Direct all-gather: every rank's *block* (its contribution, B bytes) lands at its place in
//! every rank's output of n blocks.
//!
//! **Small** (B ≤ [`SMALL_BYTES`](crate::transport::shm::workspace::SMALL_BYTES)): arrival
//! carries the block; every rank then copies every other rank's slot to its place in the
//! output. One step (data and agreement together); each rank writes B and reads (n−1)·B.
//!
//! **Large**, per chunk of up to [`CHUNK_BYTES`] of each rank's block (two halves, so chunk
//! g+1's copy-in overlaps with the tail of chunk g): *copy in* — my piece of my block into my
//! chunk buffer, part by part, publishing each part ("Parts" in the module docs of
//! `shm_direct`); *copy out* — every other rank's piece, each part as soon as that rank
//! published it, to its place in my output (starting with the next rank, so the n readers of one buffer are
//! spread over time). Two steps per chunk; per rank B copied in and (n−1)·B copied out. There
//! is nothing to reduce: `Reduced` is published with `CopiedIn` so every counter moves in
//! lockstep with the other direct ops.
//!
//! **Blocks from 512 KiB to 16 MiB** with `OXCOMM_SHM_SINGLE_COPY=1` (off by default) where
//! every rank can read its peers: each rank exposes its block and reads every other rank's
//! straight into its output (`single_copy.rs`): per rank (n−1)·B copied once.
//!
//! This rank's own block is copied from the input to the output once (out of place) or not
//! at all (in place, [`GatherBuffers::InPlace`]).

use super::single_copy;
use super::{
    arrive, copy_in_for, copy_out_for, follows_parts, is_small, parts, publish_part, wait_counter, wait_part, Direct,
};
use crate::algorithms::GatherBuffers;
use crate::copy::copy;
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::engine::Ctx;
use crate::error::Result;
use crate::transport::shm::workspace::{Counter, CHUNK_BYTES};
use crate::wire::Fingerprint;

/// Direct all-gather of `io` (the block length is the same on every rank: the fingerprints
/// agree on it).
pub(crate) fn all_gather<T: Element>(
    ctx: &mut Ctx<'_>,
    d: &mut Direct<'_>,
    fp: &Fingerprint,
    io: GatherBuffers<'_, T>,
) -> Result<()> {
    let (n, me, size) = (ctx.size, ctx.rank, std::mem::size_of::<T>());
    let m = io.block_len(n);
    let bytes = m * size;
    // The other ranks, starting after this one.
    let others = move || (1..n).map(move |k| (me + k) % n);
    if single_copy::planned(d, bytes) {
        let slot = arrive(ctx, d, fp, &single_copy::expose(io.own(me, m, 0..m).as_ptr().cast(), 0))?;
        let out = as_bytes_mut(io.into_whole(me));
        for r in others() {
            let (addr, _) = single_copy::exposed(d, slot, r)?;
            single_copy::read(ctx, d, r, addr, 0..bytes, &mut out[r * bytes..(r + 1) * bytes])?;
        }
        return single_copy::finish(ctx, d);
    }
    if is_small(bytes) {
        let slot = arrive(ctx, d, fp, as_bytes(io.own(me, m, 0..m)))?;
        let out = io.into_whole(me);
        for r in others() {
            // Stamped for this op (arrive waited for it); read before the slot can be
            // reused (only once this rank has arrived at a later op).
            let payload = d.shm.slot_payload(r, slot, bytes);
            copy(as_bytes_mut(&mut out[r * m..(r + 1) * m]), payload);
        }
        return Ok(());
    }
    arrive(ctx, d, fp, &[])?;
    single_copy::learn(ctx, d, bytes)?;
    let copy_out = copy_out_for(m * n * size);
    let follow = follows_parts(d.shm.each_rank_has_a_core(), m * n * size);
    let mut io = GatherBuffers::InPlace(io.into_whole_with(me, copy_out));
    let per_chunk = CHUNK_BYTES / size;
    for start in (0..m).step_by(per_chunk) {
        let piece = start..(start + per_chunk).min(m);
        let len = piece.len() * size;
        let g = d.state.chunks;
        let half = (g & 1) as usize;
        let shm = d.shm;
        // Copy in. Half `half` was last used by chunk g-2: everyone must be done reading it.
        wait_counter(ctx, shm, Counter::CopiedOut, g.saturating_sub(1))?;
        // Copy in, part by part. Others read a part of my half for chunk g only after I
        // publish it, and they finished with chunk g-2 (waited above).
        let mut copy_in = copy_in_for(n * len, shm.each_rank_has_a_core());
        let elems = |at: &std::ops::Range<usize>| piece.start + at.start / size..piece.start + at.end / size;
        for (j, at) in parts(len).enumerate() {
            copy_in.copy(&mut shm.chunk_mut(half, at.start, at.len()), as_bytes(io.own(me, m, elems(&at))));
            publish_part(shm, g, j);
        }
        copy_in.done();
        shm.publish(Counter::CopiedIn, g + 1);
        shm.publish(Counter::Reduced, g + 1);
        // Copy out, part by part, each as soon as its owner has it in.
        for r in others() {
            for (j, at) in parts(len).enumerate() {
                wait_part(ctx, shm, r, g, j, follow)?;
                // Rank r published part j of chunk g and rewrites this half only after
                // everyone (me included) published CopiedOut = g+1.
                let src = shm.chunk(r, half, at.start, at.len());
                copy_out(as_bytes_mut(io.block_mut(m, r, elems(&at))), src);
            }
        }
        shm.publish(Counter::CopiedOut, g + 1);
        d.state.chunks += 1;
    }
    Ok(())
}
