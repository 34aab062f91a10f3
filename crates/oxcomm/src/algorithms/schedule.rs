//! Pure index math of the algorithms: which chunk a rank sends and receives at each step, who
//! its parent and children are. No I/O here, so every function is unit-tested directly.
//!
//! Vocabulary: the buffer of `count` elements is cut into `size` *chunks* (chunk `i` is
//! [`chunk`]`(count, size, i)`, sizes differ by at most one element); a *step* is one round of
//! concurrent sends and receives; a *segment* is the largest piece one transfer call moves.

use std::ops::Range;

/// Element range of chunk `i` when `count` elements are cut into `parts` near-equal chunks.
pub fn chunk(count: usize, parts: usize, i: usize) -> Range<usize> {
    let base = count / parts;
    let rem = count % parts;
    let start = i * base + i.min(rem);
    let len = base + usize::from(i < rem);
    start..start + len
}

/// `(a - b) mod n` without underflow.
pub fn sub_mod(a: usize, b: usize, n: usize) -> usize {
    (a % n + n - b % n) % n
}

/// Ring reduce-scatter step `step` (0-based, `size - 1` steps) for `rank`:
/// `(chunk to send, chunk to receive and reduce)`. After the last step `rank` holds the fully
/// reduced chunk `rank`.
pub fn ring_reduce_scatter(rank: usize, size: usize, step: usize) -> (usize, usize) {
    (sub_mod(rank, step + 1, size), sub_mod(rank, step + 2, size))
}

/// Ring all-gather step `step` (0-based, `size - 1` steps) for `rank` when each rank starts
/// with chunk `rank`: `(chunk to send, chunk to receive)`.
pub fn ring_all_gather(rank: usize, size: usize, step: usize) -> (usize, usize) {
    (sub_mod(rank, step, size), sub_mod(rank, step + 1, size))
}

/// The binomial tree rooted at `root`: `(parent, children)` of `rank`, with children in the
/// order a reduce receives from them (nearest first) — for a broadcast, send in reverse.
pub fn binomial_tree(rank: usize, size: usize, root: usize) -> (Option<usize>, Vec<usize>) {
    let vr = sub_mod(rank, root, size);
    let mut children = Vec::new();
    let mut mask = 1;
    let mut parent = None;
    while mask < size {
        if vr & mask != 0 {
            parent = Some((vr - mask + root) % size);
            break;
        }
        if vr + mask < size {
            children.push((vr + mask + root) % size);
        }
        mask <<= 1;
    }
    (parent, children)
}

/// Recursive doubling for any `size`: the largest power of two `p <= size` ranks take part in
/// the doubling rounds; each of the first `size - p` *extra* ranks `p + i` first folds its data
/// into rank `i` and gets the result back at the end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Doubling {
    /// Power of two taking part in the rounds.
    pub p: usize,
    /// `Some(partner)` if this rank folds into / receives from a partner outside the rounds.
    /// For an extra rank that is its proxy; for a proxy, its extra rank.
    pub fold: Option<usize>,
    /// Whether this rank takes part in the rounds.
    pub in_rounds: bool,
    /// Partners of the rounds, in order (empty for extra ranks).
    pub partners: Vec<usize>,
}

/// The recursive-doubling plan of `rank` in a group of `size`.
pub fn recursive_doubling(rank: usize, size: usize) -> Doubling {
    let p = if size == 0 { 0 } else { 1 << (usize::BITS - 1 - size.leading_zeros()) };
    let extra = size - p;
    if rank >= p {
        return Doubling { p, fold: Some(rank - p), in_rounds: false, partners: Vec::new() };
    }
    let fold = (rank < extra).then_some(rank + p);
    let mut partners = Vec::new();
    let mut mask = 1;
    while mask < p {
        partners.push(rank ^ mask);
        mask <<= 1;
    }
    Doubling { p, fold, in_rounds: true, partners }
}

/// One step of recursive halving (reduce-scatter) for a rank taking part in the rounds of
/// [`recursive_doubling`]: the partner, the element range this rank keeps (and reduces the
/// partner's half of into) and the one it sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Halving {
    /// Rank exchanged with (`rank ^ mask`).
    pub partner: usize,
    /// The half of the range held before the step that this rank keeps.
    pub keep: Range<usize>,
    /// The other half, which the partner keeps.
    pub send: Range<usize>,
}

/// The recursive-halving steps of `rank` (< `p`, a power of two) over `count` elements, in
/// order: step `k` pairs ranks `p / 2^(k+1)` apart and halves the range each holds, the rank
/// with that bit clear keeping the lower half. After the last step the rank holds its final
/// block (`keep` of the last step); all-gather by recursive doubling runs the steps backwards,
/// sending `keep` and receiving `send`.
pub fn recursive_halving(rank: usize, p: usize, count: usize) -> Vec<Halving> {
    debug_assert!(p.is_power_of_two() && rank < p);
    let mut steps = Vec::new();
    let mut held = 0..count;
    let mut mask = p >> 1;
    while mask > 0 {
        let mid = held.start + (held.end - held.start) / 2;
        let (lower, upper) = (held.start..mid, mid..held.end);
        let (keep, send) = if rank & mask == 0 { (lower, upper) } else { (upper, lower) };
        steps.push(Halving { partner: rank ^ mask, keep: keep.clone(), send });
        held = keep;
        mask >>= 1;
    }
    steps
}

/// Pairwise exchange step `step` in `1..size`: `(peer to send to, peer to receive from)`.
pub fn pairwise(rank: usize, size: usize, step: usize) -> (usize, usize) {
    ((rank + step) % size, sub_mod(rank, step, size))
}

/// Dissemination barrier round `k`: `(peer to signal, peer to wait for)`; `ceil(log2 size)`
/// rounds.
pub fn dissemination(rank: usize, size: usize, round: u32) -> (usize, usize) {
    let d = 1usize << round;
    ((rank + d) % size, sub_mod(rank, d, size))
}

/// Number of dissemination rounds for `size` ranks.
pub fn dissemination_rounds(size: usize) -> u32 {
    if size <= 1 {
        0
    } else {
        usize::BITS - (size - 1).leading_zeros()
    }
}

/// The consecutive ranges of a buffer cut into blocks of `counts[p]` elements, in order (the
/// blocks of an all-to-all-v).
pub(crate) fn ranges(counts: &[usize]) -> Vec<Range<usize>> {
    let mut at = 0;
    counts
        .iter()
        .map(|c| {
            at += c;
            at - c..at
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recursive_halving_splits_and_pairs_up() {
        for p in [1usize, 2, 4, 8, 16] {
            for count in [0usize, 1, 5, 16, 1001] {
                let all: Vec<Vec<Halving>> = (0..p).map(|r| recursive_halving(r, p, count)).collect();
                let mut finals = Vec::new();
                for (r, steps) in all.iter().enumerate() {
                    assert_eq!(steps.len(), p.trailing_zeros() as usize);
                    let mut held = 0..count;
                    for (k, s) in steps.iter().enumerate() {
                        // The two halves split what was held, and the partner mirrors them.
                        assert_eq!(s.keep.len() + s.send.len(), held.len());
                        assert!(s.keep.start == held.start || s.send.start == held.start);
                        let theirs = &all[s.partner][k];
                        assert_eq!(theirs.partner, r);
                        assert_eq!((theirs.keep.clone(), theirs.send.clone()), (s.send.clone(), s.keep.clone()));
                        held = s.keep.clone();
                    }
                    finals.push(held);
                }
                // The final blocks tile the buffer.
                finals.sort_by_key(|r| (r.start, r.end));
                let mut next = 0;
                for f in finals {
                    assert_eq!(f.start, next);
                    next = f.end;
                }
                assert_eq!(next, count);
            }
        }
    }

    #[test]
    fn chunks_cover_exactly() {
        for count in [0, 1, 7, 10, 65537] {
            for parts in 1..=8 {
                let mut next = 0;
                for i in 0..parts {
                    let r = chunk(count, parts, i);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, count);
            }
        }
    }

    #[test]
    fn ring_reduce_scatter_ends_with_own_chunk() {
        for size in 1..=8 {
            for rank in 0..size {
                // The chunk received in the last step is the rank's own.
                if size > 1 {
                    assert_eq!(ring_reduce_scatter(rank, size, size - 2).1, rank);
                }
                for step in 0..size.saturating_sub(1) {
                    // What I send now is what my successor receives now.
                    let (send, _) = ring_reduce_scatter(rank, size, step);
                    let (_, recv_next) = ring_reduce_scatter((rank + 1) % size, size, step);
                    assert_eq!(send, recv_next);
                    // What I send at step s+1 is what I received at step s.
                    if step + 1 < size - 1 {
                        assert_eq!(
                            ring_reduce_scatter(rank, size, step + 1).0,
                            ring_reduce_scatter(rank, size, step).1
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn ring_all_gather_collects_everything() {
        for size in 1..=8 {
            for rank in 0..size {
                let mut have = vec![false; size];
                have[rank] = true;
                for step in 0..size - 1 {
                    let (send, recv) = ring_all_gather(rank, size, step);
                    assert!(have[send]);
                    assert_eq!(ring_all_gather((rank + 1) % size, size, step).1, send);
                    have[recv] = true;
                }
                assert!(have.iter().all(|h| *h));
            }
        }
    }

    #[test]
    fn binomial_tree_is_a_tree() {
        for size in 1..=9 {
            for root in 0..size {
                let mut seen = vec![0; size];
                for r in 0..size {
                    let (parent, children) = binomial_tree(r, size, root);
                    assert_eq!(parent.is_none(), r == root);
                    for c in children {
                        assert_eq!(binomial_tree(c, size, root).0, Some(r));
                        seen[c] += 1;
                    }
                }
                for (r, n) in seen.iter().enumerate() {
                    assert_eq!(*n, usize::from(r != root));
                }
            }
        }
    }

    #[test]
    fn recursive_doubling_pairs_up() {
        for size in 1..=9 {
            for rank in 0..size {
                let d = recursive_doubling(rank, size);
                assert!(d.p.is_power_of_two() && d.p <= size && 2 * d.p > size);
                if let Some(f) = d.fold {
                    assert_eq!(recursive_doubling(f, size).fold, Some(rank));
                }
                for (k, partner) in d.partners.iter().enumerate() {
                    assert_eq!(recursive_doubling(*partner, size).partners[k], rank);
                }
            }
        }
    }

    #[test]
    fn dissemination_rounds_cover() {
        assert_eq!(dissemination_rounds(1), 0);
        assert_eq!(dissemination_rounds(2), 1);
        assert_eq!(dissemination_rounds(5), 3);
        assert_eq!(dissemination_rounds(8), 3);
        assert_eq!(dissemination(0, 5, 2), (4, 1));
        assert_eq!(pairwise(1, 4, 3), (0, 2));
    }
}
