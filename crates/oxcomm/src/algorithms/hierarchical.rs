//! Hierarchical collectives for groups that span several hosts: inside each host first, then
//! across hosts, then back, so the slow links between hosts carry as few bytes as possible.
//!
//! This file owns the group's host layout ([`HostLayout`], from the host of every group rank)
//! and the four hierarchical algorithms. Each phase is an ordinary algorithm (ring, recursive
//! doubling, binomial tree) run on a sub-view of the op's context (`Ctx::sub`): the ranks
//! of one host (*intra*), or the ranks with the same local index on every host (*inter*).
//! It applies when every host holds the same number `k ≥ 2` of the group's ranks and there are
//! `h ≥ 2` hosts; group ranks need not be contiguous per host.
//!
//! With `S` the buffer bytes (the full input of reduce-scatter, the full output of
//! all-gather), `n = h·k`:
//!
//! | op | phases | bytes each rank sends across hosts | flat ring's |
//! | --- | --- | --- | --- |
//! | all_reduce | intra ring reduce-scatter; inter all-reduce of the own chunk (ring, or doubling when small); intra ring all-gather | 2(h−1)/h · S/k | 2(n−1)/n · S on the ring's host-crossing links |
//! | reduce_scatter | intra ring reduce-scatter of the blocks bound for each local index; inter ring reduce-scatter | (h−1)/h · S/k | (n−1)/n · S |
//! | all_gather | inter ring all-gather; intra ring all-gather | (h−1)/h · S/k | (n−1)/n · S |
//! | broadcast | inter binomial tree among the root's local index; intra binomial tree | S per child host | S per crossing edge |
//!
//! Reduce-scatter and all-gather permute blocks through one scratch copy of the buffer (host
//! order ↔ group-rank order; kept per thread between ops up to 64 MiB); all-reduce and
//! broadcast work in place.

use std::cell::RefCell;

use super::schedule::chunk;
use super::{doubling, ring, tree};
use crate::dtype::Element;
use crate::engine::Ctx;
use crate::error::Result;
use crate::reduce::ReduceOp;

/// Below this many bytes per inter-host chunk, the inter phase of all-reduce uses recursive
/// doubling (fewer rounds) instead of a ring.
const INTER_DOUBLING_BYTES: usize = 64 * 1024;

/// Where a group's ranks live: `hosts[j][l]` is the group rank with local index `l` on host
/// `j` (hosts in order of their first group rank, ranks in group order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostLayout {
    hosts: Vec<Vec<usize>>,
    /// This rank's host index and local index.
    host: usize,
    local: usize,
}

impl HostLayout {
    /// The layout of a group whose rank `r` is on host `host_of[r]` (any labels), seen from
    /// group rank `me`; `None` unless there are at least 2 hosts with the same number (≥ 2) of
    /// ranks each, where a hierarchical algorithm helps.
    pub fn new(host_of: &[usize], me: usize) -> Option<HostLayout> {
        let mut labels: Vec<usize> = Vec::new();
        let mut hosts: Vec<Vec<usize>> = Vec::new();
        for (r, h) in host_of.iter().enumerate() {
            match labels.iter().position(|l| l == h) {
                Some(j) => hosts[j].push(r),
                None => {
                    labels.push(*h);
                    hosts.push(vec![r]);
                }
            }
        }
        let k = hosts.first()?.len();
        if hosts.len() < 2 || k < 2 || hosts.iter().any(|h| h.len() != k) {
            return None;
        }
        let mine = *host_of.get(me)?;
        let host = labels.iter().position(|l| *l == mine)?;
        let local = hosts[host].iter().position(|r| *r == me)?;
        Some(HostLayout { hosts, host, local })
    }

    /// Number of hosts.
    pub fn num_hosts(&self) -> usize {
        self.hosts.len()
    }

    /// Ranks per host.
    pub fn ranks_per_host(&self) -> usize {
        self.hosts[0].len()
    }

    /// The group rank with local index `local` on host `host`.
    fn at(&self, host: usize, local: usize) -> usize {
        self.hosts[host][local]
    }

    /// World ranks of this rank's host (for a sub-view), in local order.
    fn intra(&self, ctx: &Ctx<'_>) -> Vec<usize> {
        self.hosts[self.host].iter().map(|r| ctx.world(*r)).collect()
    }

    /// World ranks with this rank's local index, in host order.
    fn inter(&self, ctx: &Ctx<'_>) -> Vec<usize> {
        self.hosts.iter().map(|h| ctx.world(h[self.local])).collect()
    }
}

/// All-reduce of `buf` in place (`op` is the combiner): intra reduce-scatter, inter
/// all-reduce of this rank's chunk, intra all-gather.
pub(crate) fn all_reduce<T: Element>(
    ctx: &mut Ctx<'_>,
    layout: &HostLayout,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (intra, inter) = (layout.intra(ctx), layout.inter(ctx));
    ring::reduce_scatter_in_place(&mut ctx.sub(&intra, layout.local), buf, op)?;
    let mine = chunk(buf.len(), layout.ranks_per_host(), layout.local);
    let part = &mut buf[mine];
    let mut across = ctx.sub(&inter, layout.host);
    if std::mem::size_of_val(part) < INTER_DOUBLING_BYTES || part.len() < layout.num_hosts() {
        doubling::all_reduce(&mut across, part, op)?;
    } else {
        ring::all_reduce(&mut across, part, op)?;
    }
    ring::all_gather_in_place(&mut ctx.sub(&intra, layout.local), buf)
}

/// Reduce-scatter: `input` holds one block of `output.len()` elements per group rank;
/// `output` receives the reduction of block `rank` (`op` is the combiner).
pub(crate) fn reduce_scatter<T: Element>(
    ctx: &mut Ctx<'_>,
    layout: &HostLayout,
    input: &[T],
    output: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (h, k, c) = (layout.num_hosts(), layout.ranks_per_host(), output.len());
    let (intra, inter) = (layout.intra(ctx), layout.inter(ctx));
    with_scratch(input.len(), |by_local: &mut [T]| {
        // Blocks in [local][host] order: the h blocks bound for local index l are chunk l.
        for l in 0..k {
            for j in 0..h {
                let g = layout.at(j, l);
                by_local[(l * h + j) * c..][..c].copy_from_slice(&input[g * c..][..c]);
            }
        }
        // Local index l ends up with the host's sum of its chunk ...
        ring::reduce_scatter_in_place(&mut ctx.sub(&intra, layout.local), by_local, op)?;
        // ... and across hosts, host j's rank keeps block j (the one bound for itself).
        let mine = &by_local[layout.local * h * c..][..h * c];
        ring::reduce_scatter(&mut ctx.sub(&inter, layout.host), mine, output, op)
    })
}

/// All-gather: `output` (one block of `input.len()` elements per group rank, in group-rank
/// order) receives every rank's `input`.
pub(crate) fn all_gather<T: Element>(
    ctx: &mut Ctx<'_>,
    layout: &HostLayout,
    input: &[T],
    output: &mut [T],
) -> Result<()> {
    let (h, k, c) = (layout.num_hosts(), layout.ranks_per_host(), input.len());
    let (intra, inter) = (layout.intra(ctx), layout.inter(ctx));
    with_scratch(output.len(), |by_local: &mut [T]| {
        // Across hosts first: the h blocks of this local index, in host order, as chunk
        // `local` of the [local][host] buffer; then the other chunks inside the host.
        let mine = &mut by_local[layout.local * h * c..][..h * c];
        ring::all_gather(&mut ctx.sub(&inter, layout.host), input, mine)?;
        ring::all_gather_in_place(&mut ctx.sub(&intra, layout.local), by_local)?;
        for l in 0..k {
            for j in 0..h {
                let g = layout.at(j, l);
                output[g * c..][..c].copy_from_slice(&by_local[(l * h + j) * c..][..c]);
            }
        }
        Ok(())
    })
}

/// Largest permutation buffer a thread keeps between ops.
const KEEP_SCRATCH_BYTES: usize = 64 << 20;

thread_local! {
    /// The block-permutation buffer of reduce-scatter and all-gather, kept between ops (up
    /// to [`KEEP_SCRATCH_BYTES`]) so that large ops do not fault in fresh pages every time.
    static SCRATCH: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on a scratch slice of `len` elements (contents unspecified).
fn with_scratch<T: Element, R>(len: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
    let mut words = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    let need = (len * std::mem::size_of::<T>()).div_ceil(8);
    if words.len() < need {
        words.resize(need, 0);
    }
    // Element sizes divide 8, so `need` words hold at least `len` whole elements.
    let r = f(&mut bytemuck::cast_slice_mut::<u64, T>(&mut words[..need])[..len]);
    if words.len() * 8 <= KEEP_SCRATCH_BYTES {
        SCRATCH.with(|s| *s.borrow_mut() = words);
    }
    r
}

/// Broadcast of `buf` from group rank `root`: a tree across hosts among the ranks with the
/// root's local index, then a tree inside every host from that rank.
pub(crate) fn broadcast<T: Element>(ctx: &mut Ctx<'_>, layout: &HostLayout, buf: &mut [T], root: usize) -> Result<()> {
    let (root_host, root_local) = layout
        .hosts
        .iter()
        .enumerate()
        .find_map(|(j, h)| h.iter().position(|r| *r == root).map(|l| (j, l)))
        .expect("the root is a group rank");
    if layout.local == root_local {
        let inter = layout.inter(ctx);
        tree::broadcast(&mut ctx.sub(&inter, layout.host), buf, root_host)?;
    }
    let intra = layout.intra(ctx);
    tree::broadcast(&mut ctx.sub(&intra, layout.local), buf, root_local)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts() {
        let l = HostLayout::new(&[7, 7, 9, 9], 2).unwrap();
        assert_eq!((l.num_hosts(), l.ranks_per_host(), l.host, l.local), (2, 2, 1, 0));
        // Interleaved placement.
        let l = HostLayout::new(&[0, 1, 0, 1, 0, 1], 3).unwrap();
        assert_eq!(l.hosts, vec![vec![0, 2, 4], vec![1, 3, 5]]);
        assert_eq!((l.host, l.local), (1, 1));
        // Uneven hosts, one host, one rank per host: no hierarchy.
        assert!(HostLayout::new(&[0, 0, 1], 0).is_none());
        assert!(HostLayout::new(&[0, 0, 0, 0], 0).is_none());
        assert!(HostLayout::new(&[0, 1, 2], 0).is_none());
    }
}
