//! Binomial-tree broadcast and reduce rooted at any rank.
//!
//! In the tree rooted at `root` ([`schedule::binomial_tree`]) every rank has at most one
//! parent and ⌈log2 n⌉ children.
//!
//! | algorithm | steps | bytes sent per rank |
//! | --- | --- | --- |
//! | broadcast | ⌈log2 n⌉ | S × (number of children) |
//! | reduce | ⌈log2 n⌉ | S (to the parent) |
//!
//! Non-root buffers of a reduce are left unchanged: inner ranks reduce into a copy.

use super::{schedule, ReduceBuffers};
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::engine::{Ctx, Xfer};
use crate::error::Result;
use crate::reduce::ReduceOp;

/// Binomial broadcast of `buf` from `root`.
pub(crate) fn broadcast<T: Element>(ctx: &mut Ctx<'_>, buf: &mut [T], root: usize) -> Result<()> {
    let (parent, children) = schedule::binomial_tree(ctx.rank, ctx.size, root);
    if let Some(p) = parent {
        ctx.recv(p, as_bytes_mut(buf))?;
    }
    // Farthest child first: it has the largest subtree.
    let mut xfers: Vec<Xfer<'_>> = children.iter().rev().map(|c| Xfer::send(*c, as_bytes(buf))).collect();
    ctx.run(&mut xfers)
}

/// Binomial reduce to `root` (`op` is the combiner) of `io` (apart: the root's input is
/// copied into its output first); only the root's result buffer changes, and is returned.
pub(crate) fn reduce<'b, T: Element>(
    ctx: &mut Ctx<'_>,
    io: ReduceBuffers<'b, T>,
    root: usize,
    op: ReduceOp,
) -> Result<&'b mut [T]> {
    let (parent, children) = schedule::binomial_tree(ctx.rank, ctx.size, root);
    let Some(parent) = parent else {
        // The root: its contribution first (apart: copied into the output), then its children's.
        let buf = io.into_in_place();
        for c in children {
            ctx.run(&mut [Xfer::recv_reduce(c, buf, op)])?;
        }
        return Ok(buf);
    };
    let mine = io.input(0..io.len());
    if children.is_empty() {
        ctx.send(parent, as_bytes(mine))?;
    } else {
        let mut acc = mine.to_vec();
        for c in children {
            ctx.run(&mut [Xfer::recv_reduce(c, &mut acc, op)])?;
        }
        ctx.send(parent, as_bytes(&acc))?;
    }
    Ok(io.into_output())
}
