//! Ring algorithms: reduce-scatter, all-gather, and all-reduce as the two back to back.
//!
//! Ranks form the ring `r → r+1`. The buffer is cut into `n` *chunks* ([`schedule::chunk`]);
//! each *step* sends one chunk to the successor while receiving (and, for reductions,
//! reducing) another from the predecessor. Transfers move in segments of at most
//! `max_segment_bytes`.
//!
//! | algorithm | steps | bytes sent per rank (S = buffer bytes) |
//! | --- | --- | --- |
//! | reduce-scatter | n − 1 | (n − 1)/n · S (S = full input) |
//! | all-gather | n − 1 | (n − 1)/n · S (S = full output) |
//! | all-reduce | 2(n − 1) | 2(n − 1)/n · S |
//!
//! Bandwidth-optimal for large buffers; latency grows linearly with n.

use super::schedule::{self, chunk};
use crate::dtype::{as_bytes, Element};
use crate::engine::{Ctx, Xfer};
use crate::error::Result;
use crate::reduce::ReduceOp;

/// Borrows two disjoint ranges of `buf`: the first shared, the second mutable.
pub(crate) fn split_pair<T>(buf: &mut [T], a: std::ops::Range<usize>, b: std::ops::Range<usize>) -> (&[T], &mut [T]) {
    if a.is_empty() {
        return (&[], &mut buf[b]);
    }
    if b.is_empty() {
        return (&buf[a], &mut []);
    }
    assert!(a.end <= b.start || b.end <= a.start, "split_pair: ranges overlap");
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

/// In-place ring all-reduce of `buf` with `op` (use the combiner: `Avg` is finished by the
/// caller).
pub(crate) fn all_reduce<T: Element>(ctx: &mut Ctx<'_>, buf: &mut [T], op: ReduceOp) -> Result<()> {
    if ctx.size == 1 {
        return Ok(());
    }
    reduce_scatter_in_place(ctx, buf, op)?;
    all_gather_in_place(ctx, buf)
}

/// Ring reduce-scatter in place: on return chunk `rank` of `buf` ([`chunk`]`(len, n, rank)`)
/// holds the reduction of every rank's chunk `rank`; other chunks hold partial sums.
pub(crate) fn reduce_scatter_in_place<T: Element>(ctx: &mut Ctx<'_>, buf: &mut [T], op: ReduceOp) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let count = buf.len();
    for step in 0..n.saturating_sub(1) {
        let (s, v) = schedule::ring_reduce_scatter(r, n, step);
        let (send, acc) = split_pair(buf, chunk(count, n, s), chunk(count, n, v));
        ctx.run(&mut [Xfer::send(next, as_bytes(send)), Xfer::recv_reduce(prev, acc, op)])?;
    }
    Ok(())
}

/// Ring all-gather in place: on entry chunk `rank` of `buf` is this rank's; on return every
/// chunk is filled.
pub(crate) fn all_gather_in_place<T: Element>(ctx: &mut Ctx<'_>, buf: &mut [T]) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let count = buf.len();
    for step in 0..n - 1 {
        let (s, v) = schedule::ring_all_gather(r, n, step);
        let (send, recv) = split_pair(buf, chunk(count, n, s), chunk(count, n, v));
        ctx.run(&mut [Xfer::send(next, as_bytes(send)), Xfer::recv(prev, bytemuck::cast_slice_mut(recv))])?;
    }
    Ok(())
}

/// Ring all-gather: `output` (n × input.len()) receives every rank's `input` in rank order.
pub(crate) fn all_gather<T: Element>(ctx: &mut Ctx<'_>, input: &[T], output: &mut [T]) -> Result<()> {
    let (n, r, c) = (ctx.size, ctx.rank, input.len());
    output[r * c..(r + 1) * c].copy_from_slice(input);
    if n == 1 {
        return Ok(());
    }
    all_gather_in_place(ctx, output)
}

/// Ring reduce-scatter: `output` receives the reduction of block `rank` of every rank's
/// `input` (n × output.len()).
pub(crate) fn reduce_scatter<T: Element>(ctx: &mut Ctx<'_>, input: &[T], output: &mut [T], op: ReduceOp) -> Result<()> {
    let (n, r, c) = (ctx.size, ctx.rank, output.len());
    let block = |i: usize| i * c..(i + 1) * c;
    if n == 1 {
        output.copy_from_slice(&input[block(r)]);
        return Ok(());
    }
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    // Two chunk-sized accumulators: the one sent this step and the one filled this step.
    let mut sending: Vec<T> = Vec::new();
    let mut filling: Vec<T> = vec![T::default(); if n > 2 { c } else { 0 }];
    for step in 0..n - 1 {
        let (s, v) = schedule::ring_reduce_scatter(r, n, step);
        let send: &[T] = if step == 0 { &input[block(s)] } else { &sending };
        let last = step == n - 2;
        let acc: &mut [T] = if last { &mut *output } else { &mut filling };
        acc.copy_from_slice(&input[block(v)]);
        ctx.run(&mut [Xfer::send(next, as_bytes(send)), Xfer::recv_reduce(prev, acc, op)])?;
        if !last {
            std::mem::swap(&mut sending, &mut filling);
            filling.resize(c, T::default());
        }
    }
    Ok(())
}
