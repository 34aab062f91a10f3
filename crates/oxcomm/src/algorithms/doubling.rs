//! Recursive doubling all-reduce, for small buffers, correct for any group size.
//!
//! With `p` the largest power of two ≤ n, the `n − p` *extra* ranks first fold their buffer
//! into a proxy rank, the `p` ranks then exchange whole buffers with partner `rank ^ 2^k` for
//! `log2 p` steps, reducing each time, and proxies hand the result back.
//!
//! Steps: log2 p (+2 when n is not a power of two). Bytes sent per rank: S · log2 p (+S for
//! proxies and extras). Latency-optimal, bandwidth-wasteful: used below `plan`'s threshold.
//! Every rank computes `a ⊕ b` as its partner computes `b ⊕ a`, so results are bitwise equal
//! on all ranks.

use super::schedule;
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::engine::{Ctx, Xfer};
use crate::error::Result;
use crate::reduce::ReduceOp;

/// In-place recursive-doubling all-reduce (`op` is the combiner).
pub(crate) fn all_reduce<T: Element>(ctx: &mut Ctx<'_>, buf: &mut [T], op: ReduceOp) -> Result<()> {
    let d = schedule::recursive_doubling(ctx.rank, ctx.size);
    if !d.in_rounds {
        let proxy = d.fold.expect("extra ranks have a proxy");
        ctx.send(proxy, as_bytes(buf))?;
        return ctx.recv(proxy, as_bytes_mut(buf));
    }
    if let Some(extra) = d.fold {
        ctx.run(&mut [Xfer::recv_reduce(extra, buf, op)])?;
    }
    let mut mine = buf.to_vec();
    for partner in d.partners {
        mine.copy_from_slice(buf);
        ctx.run(&mut [Xfer::send(partner, as_bytes(&mine)), Xfer::recv_reduce(partner, buf, op)])?;
    }
    if let Some(extra) = d.fold {
        ctx.send(extra, as_bytes(buf))?;
    }
    Ok(())
}
