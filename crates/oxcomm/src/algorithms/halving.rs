//! Recursive halving-doubling all-reduce (Rabenseifner's): a reduce-scatter by recursive
//! halving, then an all-gather by recursive doubling, for any group size.
//!
//! With `p` the largest power of two ≤ n, the `n − p` *extra* ranks first fold their buffer
//! into a proxy rank and get the result back at the end, as in [`super::doubling`]. Among the
//! `p` ranks, each *halving step* ([`schedule::recursive_halving`]) pairs ranks `p / 2^(k+1)`
//! apart: each sends the half of its range its partner keeps and reduces the partner's copy of
//! the half it keeps, so after `log2 p` steps every rank holds one fully reduced *block*
//! (about S/p). The *doubling steps* run the same pairs backwards, each rank sending what it
//! holds and receiving its partner's, until every rank holds the whole result. Each element is
//! reduced on one rank and copied to the others, so results are bitwise equal everywhere.
//!
//! Steps: 2 · log2 p (+2 when n is not a power of two). Bytes sent per rank:
//! 2 (p − 1)/p · S (+S for proxies and extras). As few bytes as the ring with log2 p instead of
//! n − 1 steps each way: the choice between the two for mid-sized buffers on many ranks.

use super::ring::split_pair;
use super::{doubling, schedule};
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::engine::{Ctx, Xfer};
use crate::error::Result;
use crate::reduce::ReduceOp;

/// In-place recursive halving-doubling all-reduce (`op` is the combiner).
pub(crate) fn all_reduce<T: Element>(ctx: &mut Ctx<'_>, buf: &mut [T], op: ReduceOp) -> Result<()> {
    if ctx.size == 1 {
        return Ok(());
    }
    let d = schedule::recursive_doubling(ctx.rank, ctx.size);
    if !doubling::fold_extra(ctx, &d, buf, op)? {
        return Ok(());
    }
    let steps = schedule::recursive_halving(ctx.rank, d.p, buf.len());
    // Halving: send the half the partner keeps, reduce its copy of the half this rank keeps.
    for s in &steps {
        let (send, keep) = split_pair(buf, s.send.clone(), s.keep.clone());
        ctx.run(&mut [Xfer::send(s.partner, as_bytes(send)), Xfer::recv_reduce(s.partner, keep, op)])?;
    }
    // Doubling: the same pairs backwards, each side sending the reduced range it holds.
    for s in steps.iter().rev() {
        let (held, missing) = split_pair(buf, s.keep.clone(), s.send.clone());
        ctx.run(&mut [Xfer::send(s.partner, as_bytes(held)), Xfer::recv(s.partner, as_bytes_mut(missing))])?;
    }
    doubling::return_to_extra(ctx, &d, buf)
}
