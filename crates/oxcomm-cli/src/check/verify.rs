//! The ops `oxcomm check` verifies itself (the bench does not time them): all_to_all_v with
//! uneven counts, gather, scatter, a send/recv ring and reduce_scatter_coalesced. Each returns
//! the number of wrong elements on this rank (plus one when asked to spoil its result), from
//! inputs that are exact in every dtype.

use oxcomm::compression::coalesced;
use oxcomm::{Communicator, DType, Element, ReduceOp};

use crate::bench::cases::{Pattern, SENTINEL};

/// The value of element `k` that rank `src` sends to rank `dst`: exact in every dtype.
fn value(src: usize, dst: usize, k: usize) -> f64 {
    let pattern = Pattern::new(ReduceOp::Sum, DType::U8, 1);
    pattern.plain(src, dst * 1_000_003 + k)
}

/// Wrong elements of `got` against `want(k)`, plus one when `corrupt` and `got` is not empty.
fn wrong<T: Element>(got: &[T], want: impl Fn(usize) -> f64, corrupt: bool) -> u64 {
    let bad = got.iter().enumerate().filter(|(k, g)| g.to_f64() != T::from_f64(want(*k)).to_f64()).count() as u64;
    bad + u64::from(corrupt && !got.is_empty())
}

/// all_to_all_v with uneven counts: rank `s` sends `(count + s + 2d) % (count + 3)` elements
/// to rank `d`.
pub(super) fn all_to_all_v<T: Element>(comm: &Communicator, count: usize, corrupt: bool) -> oxcomm::Result<u64> {
    let (n, me) = (comm.size(), comm.rank());
    let cnt = |s: usize, d: usize| (count + s + 2 * d) % (count + 3);
    let send_counts: Vec<usize> = (0..n).map(|d| cnt(me, d)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|s| cnt(s, me)).collect();
    let send: Vec<T> = (0..n).flat_map(|d| (0..cnt(me, d)).map(move |k| T::from_f64(value(me, d, k)))).collect();
    let mut recv = vec![T::from_f64(SENTINEL); recv_counts.iter().sum()];
    comm.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)?;
    let mut bad = 0;
    let mut at = 0;
    for (s, &c) in recv_counts.iter().enumerate() {
        bad += wrong(&recv[at..at + c], |k| value(s, me, k), false);
        at += c;
    }
    Ok(bad + u64::from(corrupt && !recv.is_empty()))
}

/// gather to the last rank.
pub(super) fn gather<T: Element>(comm: &Communicator, count: usize, corrupt: bool) -> oxcomm::Result<u64> {
    let (n, me, root) = (comm.size(), comm.rank(), comm.size() - 1);
    let input: Vec<T> = (0..count).map(|k| T::from_f64(value(me, root, k))).collect();
    if me != root {
        comm.gather(&input, None, root)?;
        return Ok(u64::from(corrupt && count > 0));
    }
    let mut output = vec![T::from_f64(SENTINEL); count * n];
    comm.gather(&input, Some(&mut output), root)?;
    Ok(wrong(&output, |i| value(i / count.max(1), root, i % count.max(1)), corrupt))
}

/// scatter from the last rank.
pub(super) fn scatter<T: Element>(comm: &Communicator, count: usize, corrupt: bool) -> oxcomm::Result<u64> {
    let (n, me, root) = (comm.size(), comm.rank(), comm.size() - 1);
    let mut output = vec![T::from_f64(SENTINEL); count];
    if me == root {
        let input: Vec<T> = (0..n * count).map(|i| T::from_f64(value(root, i / count, i % count))).collect();
        comm.scatter(Some(&input), &mut output, root)?;
    } else {
        comm.scatter(None, &mut output, root)?;
    }
    Ok(wrong(&output, |k| value(root, me, k), corrupt))
}

/// A ring of send/recv: rank 0 sends to 1 and then receives from n − 1; every other rank
/// receives from its left neighbour and then sends to its right one.
pub(super) fn send_recv<T: Element>(comm: &Communicator, count: usize, corrupt: bool) -> oxcomm::Result<u64> {
    let (n, me) = (comm.size(), comm.rank());
    let (left, right) = ((me + n - 1) % n, (me + 1) % n);
    let tag = 7;
    let send: Vec<T> = (0..count).map(|k| T::from_f64(value(me, right, k))).collect();
    let mut recv = vec![T::from_f64(SENTINEL); count];
    if me == 0 {
        comm.send(&send, right, tag)?;
        comm.recv(&mut recv, left, tag)?;
    } else {
        comm.recv(&mut recv, left, tag)?;
        comm.send(&send, right, tag)?;
    }
    Ok(wrong(&recv, |k| value(left, me, k), corrupt))
}

/// reduce_scatter_coalesced of three tensors of `count`, `count + 1` and `2·count + 3`
/// elements: this rank's ceil partition of each tensor's mean.
pub(super) fn reduce_scatter_coalesced<T: Element>(
    comm: &Communicator,
    count: usize,
    corrupt: bool,
) -> oxcomm::Result<u64> {
    let (n, me) = (comm.size(), comm.rank());
    let pattern = Pattern::new(ReduceOp::Avg, T::DTYPE, n);
    if pattern.unsupported().is_some() {
        return Ok(0);
    }
    let lens = [count, count + 1, 2 * count + 3];
    let index = |t: usize, k: usize| t * 10_000_019 + k;
    let tensors: Vec<Vec<T>> = lens
        .iter()
        .enumerate()
        .map(|(t, &l)| (0..l).map(|k| T::from_f64(pattern.input(me, index(t, k)))).collect())
        .collect();
    let views: Vec<&[T]> = tensors.iter().map(Vec::as_slice).collect();
    let out = coalesced::reduce_scatter_coalesced(comm, &views)?;
    // Floats are divided by n before the sum: each term rounds once, and so does each sum.
    let ulp = match T::DTYPE {
        DType::F32 => 2f64.powi(-23),
        DType::BF16 => 2f64.powi(-7),
        DType::F16 => 2f64.powi(-10),
        _ => 0.0,
    };
    let tol = |want: f64| (2.0 * n as f64 + 2.0) * ulp * want.abs();
    let mut bad = 0;
    for (t, (&len, got)) in lens.iter().zip(&out).enumerate() {
        let part = coalesced::partition(len, n, me);
        if got.len() != part.len() {
            bad += part.len().max(1) as u64;
            continue;
        }
        for (k, g) in got.iter().enumerate() {
            let want = pattern.reduced(index(t, part.start + k));
            if (g.to_f64() - want).abs() > tol(want) {
                bad += 1;
            }
        }
    }
    Ok(bad + u64::from(corrupt && out.iter().any(|o| !o.is_empty())))
}
