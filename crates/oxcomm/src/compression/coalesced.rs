//! DeepSpeed's `reduce_scatter_coalesced` (spec §3.1): several tensors reduce-scattered in one
//! collective, each rank getting its partition of every tensor's mean. Built on
//! [`Communicator::reduce_scatter`]; it owns the flat buffer's layout (ceil partitions
//! interleaved by destination) and moves no bytes itself.
//!
//! # Vocabulary
//!
//! * `W`: ranks of the communicator. **partition**: the part of a tensor one rank gets back;
//!   ceil partitions of `c = ⌈L / W⌉` elements (shorter or empty at the end).
//!
//! # Cost (per rank)
//!
//! One ring reduce-scatter of `W · Σ c_t` elements: `W − 1` steps, `(W − 1) · Σ c_t` elements
//! sent.
//!
//! The ZeRO++ qgZ quantized reduce-scatter, which falls back to this, is [`super::qgz`] (its
//! host groups: [`super::host_groups`]).

use std::ops::Range;

use super::arg_error;
use crate::comm::Communicator;
use crate::dtype::Element;
use crate::error::Result;
use crate::reduce::{self, ReduceOp};

/// Reduce-scatters several tensors in one collective and returns this rank's partition of
/// each tensor's **mean** over the group (spec §3.1).
///
/// Tensor `t` of length `L_t` is cut into `n = comm.size()` ceil partitions of
/// `c_t = ⌈L_t / n⌉` elements; partition `k` is `[k·c_t, min((k+1)·c_t, L_t))`, shorter than
/// `c_t` or empty at the end. The flat buffer is ordered by destination rank, then by tensor,
/// each partition padded to `c_t`: `F = ‖_k ‖_t [p_{t,k}, pad]`, `|F| = n · Σ_t c_t`. One
/// [`Communicator::reduce_scatter`] of `F` gives rank `r` the block `r`, and output `t` is that
/// block's `[Σ_{u<t} c_u, Σ_{u<t} c_u + len(p_{t,r}))`, possibly empty.
///
/// Floats are divided by `n` before the sum, as DeepSpeed does (it keeps f16 sums from
/// overflowing, and is exact for power-of-two `n`); integers are summed and then divided
/// (truncating) once, as [`ReduceOp::Avg`].
///
/// Collective over `comm`; every rank must pass the same lengths in the same order. Inputs are
/// not modified. Errors are those of [`Communicator::reduce_scatter`], plus
/// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) if the flat buffer's
/// length overflows.
pub fn reduce_scatter_coalesced<T: Element>(comm: &Communicator, tensors: &[&[T]]) -> Result<Vec<Vec<T>>> {
    let start = comm.logger().now_ns();
    let out = reduce_scatter_coalesced_inner(comm, tensors)?;
    let count: usize = tensors.iter().map(|t| t.len()).sum();
    let bytes = (count * std::mem::size_of::<T>()) as u64;
    comm.log_op("reduce_scatter_coalesced", Some(T::DTYPE), count, bytes, start);
    Ok(out)
}

fn reduce_scatter_coalesced_inner<T: Element>(comm: &Communicator, tensors: &[&[T]]) -> Result<Vec<Vec<T>>> {
    let n = comm.size();
    let layout = CoalescedLayout::new(tensors.iter().map(|t| t.len()), n);
    let total = layout.row.checked_mul(n).ok_or_else(|| {
        arg_error(comm, "reduce_scatter_coalesced", format!("{n} × {} elements overflow", layout.row))
    })?;
    let mut flat = vec![T::default(); total];
    for (k, row) in flat.chunks_exact_mut(layout.row.max(1)).enumerate().take(n) {
        for (t, x) in tensors.iter().enumerate() {
            let part = partition(x.len(), n, k);
            let at = layout.offsets[t];
            row[at..at + part.len()].copy_from_slice(&x[part]);
        }
    }
    let mut mine = vec![T::default(); layout.row];
    if T::DTYPE.is_float() {
        reduce::finish_avg(&mut flat, ReduceOp::Avg, n);
        comm.reduce_scatter(&flat, &mut mine, ReduceOp::Sum)?;
    } else {
        comm.reduce_scatter(&flat, &mut mine, ReduceOp::Avg)?;
    }
    let r = comm.rank();
    Ok(tensors
        .iter()
        .enumerate()
        .map(|(t, x)| {
            let at = layout.offsets[t];
            mine[at..at + partition(x.len(), n, r).len()].to_vec()
        })
        .collect())
}

/// Ceil partition `k` of `len` elements over `n` ranks: `[k·c, min((k+1)·c, len))` with
/// `c = ⌈len / n⌉`, empty when `k·c ≥ len` (spec §3.1). `n` must be positive.
pub fn partition(len: usize, n: usize, k: usize) -> Range<usize> {
    let c = len.div_ceil(n);
    let start = (k * c).min(len);
    start..((k + 1) * c).min(len)
}

/// Where each tensor sits in one destination's row of the flat buffer.
struct CoalescedLayout {
    /// `Σ_{u<t} c_u`.
    offsets: Vec<usize>,
    /// `Σ_t c_t`: the row (and output block) length.
    row: usize,
}

impl CoalescedLayout {
    fn new(lens: impl Iterator<Item = usize>, n: usize) -> CoalescedLayout {
        let mut offsets = Vec::new();
        let mut row = 0usize;
        for len in lens {
            offsets.push(row);
            row = row.saturating_add(len.div_ceil(n));
        }
        CoalescedLayout { offsets, row }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceil_partitions() {
        assert_eq!(partition(6, 2, 0), 0..3);
        assert_eq!(partition(6, 2, 1), 3..6);
        assert_eq!(partition(3, 2, 0), 0..2);
        assert_eq!(partition(3, 2, 1), 2..3);
        assert_eq!(partition(1, 2, 1), 1..1);
        assert_eq!(partition(0, 4, 3), 0..0);
        // 49 over 2: 25 and 24 (the spec's (7, 7) fallback).
        assert_eq!(partition(49, 2, 0).len(), 25);
        assert_eq!(partition(49, 2, 1).len(), 24);
        // 5 over 4: c = 2, partitions 2, 2, 1, 0.
        let lens: Vec<usize> = (0..4).map(|k| partition(5, 4, k).len()).collect();
        assert_eq!(lens, [2, 2, 1, 0]);
    }

    #[test]
    fn coalesced_offsets() {
        let l = CoalescedLayout::new([6usize, 3, 0, 1].into_iter(), 2);
        assert_eq!(l.offsets, [0, 3, 5, 5]);
        assert_eq!(l.row, 6);
    }
}
