//! Direct reduce-scatter: every rank's input is n *blocks* of B bytes (S = n·B); rank r gets
//! the reduction of every rank's block r.
//!
//! **Small** (S ≤ [`SMALL_BYTES`](crate::transport::shm::workspace::SMALL_BYTES)): arrival
//! carries the whole input; every rank then reduces its block from every slot. One step (data
//! and agreement together); each rank writes S and reads n·B = S.
//!
//! **Large**, per chunk (a *piece* of each block, as long as n−1 pieces fit in
//! [`CHUNK_BYTES`]; two halves, so chunk g+1's copy-in overlaps with the tail of chunk g):
//! *copy in* — my pieces of the blocks bound for the other ranks into my chunk buffer (the
//! piece for rank r at [`piece_index`]`(r, me)`); *reduce* — my piece of my own block and
//! every other rank's piece for me, into my output, 16 KiB at a time so the inputs stay in L1.
//! Two steps per chunk; per rank (n−1)·B copied in, n·B read and B written by the reduction.
//! Nothing is copied out: `CopiedOut` (and `Reduced`) are published after the reduction so
//! every counter moves in lockstep with the other direct ops.
//!
//! Every element is reduced in rank order (0, 1, …, n−1) on both paths, as the small all-reduce
//! does, so the result does not depend on the path or on whether the op runs in place. In
//! place ([`ScatterBuffers::InPlace`]) my block of the buffer is both my input and my output:
//! each piece of it is saved (in L1) before source 0 overwrites it, unless I am rank 0.

use super::all_reduce::REDUCE_PIECE_BYTES;
use super::copy_in::CopyIn;
use super::{arrive, is_small, wait_counter, Direct};
use crate::algorithms::ScatterBuffers;
use crate::copy::copy;
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::engine::Ctx;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};
use crate::transport::shm::workspace::{Counter, CHUNK_BYTES};
use crate::wire::Fingerprint;

/// Where, among the n−1 pieces in rank `owner`'s chunk buffer, the piece bound for rank
/// `dest` (≠ `owner`) is: the other ranks in rank order.
pub(crate) fn piece_index(dest: usize, owner: usize) -> usize {
    debug_assert_ne!(dest, owner);
    dest - usize::from(dest > owner)
}

/// Direct reduce-scatter of `io` with `op` (the combiner; `Avg` is finished by the caller on
/// the returned block, which holds the result).
pub(crate) fn reduce_scatter<'b, T: Element>(
    ctx: &mut Ctx<'_>,
    d: &mut Direct<'_>,
    fp: &Fingerprint,
    mut io: ScatterBuffers<'b, T>,
    op: ReduceOp,
) -> Result<&'b mut [T]> {
    let (n, me, size) = (ctx.size, ctx.rank, std::mem::size_of::<T>());
    let m = io.block_len(n);
    let mut saved = Vec::new();
    if is_small(n * m * size) {
        let slot = arrive(ctx, d, fp, as_bytes(io.input(0..n * m)))?;
        let shm = d.shm;
        let theirs = |r: usize| -> &[T] {
            // Stamped for this op (arrive waited for it); read before the slot can be
            // reused (only once this rank has arrived at a later op).
            let payload = shm.slot_payload(r, slot, n * m * size);
            bytemuck::cast_slice(&payload[me * m * size..(me + 1) * m * size])
        };
        let out = io.into_result(me, m);
        reduce_in_rank_order(out, Some(theirs(me)), me, n, theirs, &mut saved, op);
        return Ok(out);
    }
    arrive(ctx, d, fp, &[])?;
    let per_chunk = CHUNK_BYTES / ((n - 1).max(1) * size);
    for start in (0..m).step_by(per_chunk) {
        let k = (start + per_chunk).min(m) - start;
        let g = d.state.chunks;
        let half = (g & 1) as usize;
        let shm = d.shm;
        // Copy in. Half `half` was last used by chunk g-2: everyone must be done reading it.
        wait_counter(ctx, shm, Counter::CopiedOut, g.saturating_sub(1))?;
        // Plain stores, or non-temporal ones while the cores look far apart (`copy_in.rs`).
        let mut copy_in = CopyIn::new(false, shm.each_rank_has_a_core());
        for r in (0..n).filter(|r| *r != me) {
            let at = r * m + start;
            // Others read my buffer for chunk g only after I publish CopiedIn = g+1,
            // and they finished with chunk g-2 (waited above).
            let mut dst = shm.chunk_mut(half, piece_index(r, me) * k * size, k * size);
            copy_in.copy(&mut dst, as_bytes(io.input(at..at + k)));
        }
        copy_in.done();
        shm.publish(Counter::CopiedIn, g + 1);
        wait_counter(ctx, shm, Counter::CopiedIn, g + 1)?;
        // Reduce, in L1-sized pieces.
        let step = (REDUCE_PIECE_BYTES / size).max(1);
        for lo in (0..k).step_by(step) {
            let hi = (lo + step).min(k);
            let theirs = |r: usize| -> &[T] {
                let off = (piece_index(me, r) * k + lo) * size;
                // Every rank published its pieces for chunk g and rewrites this half
                // only after everyone (me included) published CopiedOut = g+1.
                bytemuck::cast_slice(shm.chunk(r, half, off, (hi - lo) * size))
            };
            let (out, own) = io.result_and_own(me, m, start + lo..start + hi);
            reduce_in_rank_order(out, own, me, n, theirs, &mut saved, op);
        }
        shm.publish(Counter::Reduced, g + 1);
        shm.publish(Counter::CopiedOut, g + 1);
        d.state.chunks += 1;
    }
    Ok(io.into_result(me, m))
}

/// Reduces the n ranks' contributions to `out` in rank order with `op`: `theirs(r)` for the
/// other ranks, `own` for this one (`me`; `None`: `out` holds it on entry, and it is saved
/// into `saved` before being overwritten, unless this rank comes first).
fn reduce_in_rank_order<'s, T: Element>(
    out: &mut [T],
    own: Option<&[T]>,
    me: usize,
    n: usize,
    theirs: impl Fn(usize) -> &'s [T],
    saved: &mut Vec<T>,
    op: ReduceOp,
) {
    let own = match own {
        Some(own) => own,
        None if me == 0 => {
            for r in 1..n {
                reduce::reduce_into(out, theirs(r), op);
            }
            return;
        }
        None => {
            saved.clear();
            saved.extend_from_slice(out);
            &saved[..]
        }
    };
    for r in 0..n {
        let src = if r == me { own } else { theirs(r) };
        if r == 0 {
            copy(as_bytes_mut(out), as_bytes(src));
        } else {
            reduce::reduce_into(out, src, op);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::piece_index;

    #[test]
    fn pieces_of_the_other_ranks_in_rank_order() {
        for n in 2..9 {
            for owner in 0..n {
                let idx: Vec<usize> = (0..n).filter(|d| *d != owner).map(|d| piece_index(d, owner)).collect();
                assert_eq!(idx, (0..n - 1).collect::<Vec<_>>(), "n={n} owner={owner}");
            }
        }
    }
}
