//! Direct gather, scatter and reduce to or from `root`. S is one rank's block (gather's input,
//! scatter's output, reduce's buffer); chunks, lanes and pieces are as in `all_to_all.rs`.
//!
//! Small rooted ops use loose arrivals (see the module docs): a rank that only publishes (a
//! gather's or reduce's non-root, a scatter's root) leaves once its slot is written, and a
//! scatter's non-root waits for the root alone, so back-to-back small ops overlap by up to
//! `SLOTS - 1` ops.
//!
//! **Gather.** Small (S ≤ [`SMALL_BYTES`]): arrival carries every non-root's block; the root
//! copies each out of its slot (one step; the root reads (n − 1) · S). Large: the exchange with
//! one lane (each non-root sends to the root only): ⌈S / [`CHUNK_BYTES`]⌉ steps, in each a
//! non-root copies its next piece into its half and the root copies every published piece out;
//! per non-root S copied in, at the root (n − 1) · S copied out.
//!
//! **Scatter.** Small (n · S ≤ [`SMALL_BYTES`]): arrival carries the root's whole input, each
//! rank copies its block out of the root's slot. Large: the exchange with n − 1 lanes at the
//! root: ⌈S / lane⌉ steps, in each the root copies the next piece of every block into its half
//! and every rank copies its own out; at the root (n − 1) · S copied in, per rank S copied
//! out. Out of place the root copies its own block last, while the others copy out (the root
//! is the bottleneck: first, it would delay every other rank by S).
//!
//! Single copy (`single_copy.rs`) is not used here: in a loop that rewrites the input and
//! sends it, op after op, as training does, it was slower than these paths at every size it
//! could take, because the root must wait until every reader is done with its buffer where
//! the chunked path lets it go once its pieces are in (docs/benchmarks.md; with a barrier
//! before every op, which hides that, a 2-rank scatter by single copy won from 64 KiB to
//! 1 MiB blocks).
//!
//! **Reduce.** Small: arrival carries every buffer; the root reduces the n payloads in rank
//! order. Large, per chunk: the reduce of the direct all-reduce, with only the root copying
//! out: every rank copies every slice but its own into its half → reduces its 1/n slice in
//! rank order 0..n, 16 KiB at a time (non-roots into their half, where the root reads it; the
//! root straight into its buffer; while the cores look far apart, a non-root reduces each
//! piece in L1 and streams it into its half, as `copy_in.rs` explains) → the root copies the
//! other n − 1 reduced slices into its buffer. Per rank (n − 1)/n · S copied in, S read and
//! S/n written by the reduction; the root also copies (n − 1)/n · S out, so its critical path
//! per chunk is about 3 · C.
//!
//! Why not let the root reduce everyone's published chunk alone (each rank copies its chunk
//! in, the root reads n − 1 chunks and reduces)? That costs the root C + (n − 1) · C per chunk
//! of C bytes, against about 3 · C here where n ranks share the reduction; the two are equal at
//! n = 2 and the shared reduction wins from n = 3. Non-roots keep their buffers unchanged:
//! their share of the result goes into their half, not into their buffer.

use super::all_reduce::{copy_in_at, copy_out_at, reduce_slots, slice, REDUCE_PIECE_BYTES};
use super::all_to_all::{exchange, steps, Blocks, Lanes};
use super::{arrive, arrive_for, is_small, Direct, Wait};
use crate::algorithms::{ExchangeBuffers, GatherBuffers, ReduceBuffers, ScatterBuffers};
use crate::copy::{copy, copy_streaming};
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::engine::Ctx;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};
use crate::transport::shm::workspace::{Counter, CHUNK_BYTES};
use crate::wire::Fingerprint;

/// Direct gather to group rank `root`; `io` as [`crate::backend::Backend::gather`] takes it
/// (in place at the root: its own block is already in the output, no copy).
pub(crate) fn gather<T: Element>(
    ctx: &mut Ctx<'_>,
    d: &mut Direct<'_>,
    fp: &Fingerprint,
    io: GatherBuffers<'_, T>,
    root: usize,
) -> Result<()> {
    let (n, me) = (ctx.size, ctx.rank);
    let m = io.block_len(n);
    let s = m * std::mem::size_of::<T>();
    let small = is_small(s);
    // Small: a non-root publishes its block and leaves; the root waits for everyone.
    if me != root {
        let input = as_bytes(io.own(me, m, 0..m));
        if small {
            arrive_for(ctx, d, fp, input, Wait::Nobody)?;
            return Ok(());
        }
        arrive(ctx, d, fp, &[])?;
        let send = (0..n).map(|p| if p == root { 0..s } else { 0..0 }).collect();
        let b = Blocks { io: ExchangeBuffers::Apart { send: input, recv: &mut [] }, send, recv: vec![0..0; n] };
        return exchange(ctx, d, b, Lanes::One, steps(s, Lanes::One.bytes(n)));
    }
    let slot = arrive(ctx, d, fp, &[])?;
    let dst = as_bytes_mut(io.into_whole(me));
    let blocks = |r: usize| if r != me { r * s..(r + 1) * s } else { 0..0 };
    if small {
        for r in (0..n).filter(|r| *r != me) {
            // Stamped for this op (arrive waited for it); read before the slot can be
            // reused (only once this rank has arrived at a later op).
            let payload = d.shm.slot_payload(r, slot, s);
            copy(&mut dst[blocks(r)], payload);
        }
        return Ok(());
    }
    let b = Blocks {
        io: ExchangeBuffers::Apart { send: &[], recv: dst },
        send: vec![0..0; n],
        recv: (0..n).map(blocks).collect(),
    };
    exchange(ctx, d, b, Lanes::One, steps(s, Lanes::One.bytes(n)))
}

/// Direct scatter from group rank `root`; `io` as [`crate::backend::Backend::scatter`] takes
/// it (in place at the root: its own block stays in the input, no copy).
pub(crate) fn scatter<T: Element>(
    ctx: &mut Ctx<'_>,
    d: &mut Direct<'_>,
    fp: &Fingerprint,
    mut io: ScatterBuffers<'_, T>,
    root: usize,
) -> Result<()> {
    let (n, me) = (ctx.size, ctx.rank);
    let m = io.block_len(n);
    let s = m * std::mem::size_of::<T>();
    let small = is_small(n * s);
    if me != root {
        // Small: wait for the root alone and copy the block out of its slot.
        let slot = if small { arrive_for(ctx, d, fp, &[], Wait::Root(root))? } else { arrive(ctx, d, fp, &[])? };
        let dst = as_bytes_mut(io.into_result(me, m));
        if small {
            // The root stamped its slot for this op; it is reused only once this rank
            // has arrived at a later op.
            let payload = d.shm.slot_payload(root, slot, n * s);
            copy(dst, &payload[me * s..(me + 1) * s]);
            return Ok(());
        }
        let recv = (0..n).map(|r| if r == root { 0..s } else { 0..0 }).collect();
        let b = Blocks { io: ExchangeBuffers::Apart { send: &[], recv: dst }, send: vec![0..0; n], recv };
        return exchange(ctx, d, b, Lanes::PerPeer, steps(s, Lanes::PerPeer.bytes(n)));
    }
    let src = as_bytes(io.input(0..n * m));
    if small {
        // Small: the root publishes the whole input and leaves.
        arrive_for(ctx, d, fp, src, Wait::Nobody)?;
    } else {
        arrive(ctx, d, fp, &[])?;
        let send = (0..n).map(|p| if p != me { p * s..(p + 1) * s } else { 0..0 }).collect();
        let b = Blocks { io: ExchangeBuffers::Apart { send: src, recv: &mut [] }, send, recv: vec![0..0; n] };
        exchange(ctx, d, b, Lanes::PerPeer, steps(s, Lanes::PerPeer.bytes(n)))?;
    }
    // Apart, the root's own block last: the others copy their last pieces out meanwhile,
    // where copying it first would hold back their first.
    if let (out, Some(own)) = io.result_and_own(me, m, 0..m) {
        out.copy_from_slice(own);
    }
    Ok(())
}

/// Direct reduce to group rank `root` of `io` (`op` is the combiner; `Avg` is finished by the
/// caller on the returned buffer, the root's result; empty or unchanged elsewhere). Other
/// ranks' buffers are left as they are; apart, the root reads its input and writes its
/// output, with no copy of one into the other.
pub(crate) fn reduce<'b, T: Element>(
    ctx: &mut Ctx<'_>,
    d: &mut Direct<'_>,
    fp: &Fingerprint,
    mut io: ReduceBuffers<'b, T>,
    root: usize,
    op: ReduceOp,
) -> Result<&'b mut [T]> {
    let (n, me, size) = (ctx.size, ctx.rank, std::mem::size_of::<T>());
    let total = io.len();
    let bytes = total * size;
    if is_small(bytes) {
        // A non-root publishes its buffer and leaves; the root waits for everyone.
        let wait = if me == root { Wait::Everyone } else { Wait::Nobody };
        let slot = arrive_for(ctx, d, fp, as_bytes(io.input(0..total)), wait)?;
        let out = io.into_output();
        if me == root {
            reduce_slots(d, slot, n, out, op);
        }
        return Ok(out);
    }
    arrive(ctx, d, fp, &[])?;
    let per_chunk = CHUNK_BYTES / size;
    let piece = (REDUCE_PIECE_BYTES / size).max(1);
    // In place, the root's own piece is saved before the result overwrites it in its buffer.
    let in_place = matches!(io, ReduceBuffers::InPlace(_));
    let mut own: Vec<T> = if me == root && in_place { vec![T::default(); piece] } else { Vec::new() };
    // A non-root's reduced piece, while the cores look far apart.
    let mut staged: Vec<T> = Vec::new();
    for start in (0..total).step_by(per_chunk) {
        let part_len = (start + per_chunk).min(total) - start;
        let g = d.state.chunks;
        let half = (g & 1) as usize;
        let shm = d.shm;
        let slice = |r: usize| slice(start, part_len, n, r);
        let far = copy_in_at(ctx, shm, g, 0, start, part_len, io.input(0..total))?;
        if far && me != root && staged.is_empty() {
            staged = vec![T::default(); piece];
        }
        let mine = slice(me);
        let (off, len) = ((mine.start - start) * size, mine.len() * size);
        // The other ranks' slices `me` were published for chunk g and are not
        // rewritten before everyone published CopiedOut = g+1.
        let theirs = |r: usize| -> &[T] { bytemuck::cast_slice(shm.chunk(r, half, off, len)) };
        for lo in (0..mine.len()).step_by(piece) {
            let hi = (lo + piece).min(mine.len());
            let at = mine.start + lo..mine.start + hi;
            if me == root {
                let out = match &mut io {
                    ReduceBuffers::InPlace(buf) => {
                        own[..hi - lo].copy_from_slice(&buf[at.clone()]);
                        &mut buf[at]
                    }
                    ReduceBuffers::Apart { input, output } => {
                        let out = &mut output[at.clone()];
                        reduce_in_rank_order(
                            out,
                            n,
                            |r| if r == me { &input[at.clone()] } else { &theirs(r)[lo..hi] },
                            op,
                        );
                        continue;
                    }
                };
                let own = &own[..hi - lo];
                reduce_in_rank_order(out, n, |r| if r == me { own } else { &theirs(r)[lo..hi] }, op);
            } else {
                // Slice `me` of my half is read by the root only after I publish
                // Reduced = g+1, and by no one else.
                let mut own = shm.chunk_mut(half, off, len);
                let dst: &mut [T] = bytemuck::cast_slice_mut(&mut own);
                let mine_now = io.input(at);
                let src = |r: usize| if r == me { mine_now } else { &theirs(r)[lo..hi] };
                if far {
                    // Far apart, reduced in L1 and streamed into the half (`copy_in.rs`).
                    let piece = &mut staged[..hi - lo];
                    reduce_in_rank_order(piece, n, src, op);
                    copy_streaming(as_bytes_mut(&mut dst[lo..hi]), as_bytes(piece));
                } else {
                    reduce_in_rank_order(&mut dst[lo..hi], n, src, op);
                }
            }
        }
        shm.publish(Counter::Reduced, g + 1);
        if me == root {
            copy_out_at(ctx, shm, g, 0, start, part_len, io.output(0..total))?;
        }
        shm.publish(Counter::CopiedOut, g + 1);
        d.state.chunks += 1;
    }
    Ok(io.into_output())
}

/// `out` = `src(0)` op `src(1)` op … op `src(n − 1)`, left to right (the reference order).
fn reduce_in_rank_order<'a, T: Element>(out: &mut [T], n: usize, src: impl Fn(usize) -> &'a [T], op: ReduceOp) {
    copy(as_bytes_mut(out), as_bytes(src(0)));
    for r in 1..n {
        reduce::reduce_into(out, src(r), op);
    }
}
