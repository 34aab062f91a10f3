//! The straggler breakdown's cross-rank step: the element-wise minimum of every rank's
//! latencies for each (op, size) key, from which [`super::CommsLogger::straggler_table`]
//! subtracts (see [`super::summary`] for the formulas).
//!
//! Ranks may have logged different (op, size) sets (groups, or different histories): keys are
//! matched by hash across ranks, and for each key the minimum runs over the ranks that logged
//! it, on the shortest common prefix. The collectives it needs are passed in ([`GroupOps`]),
//! so this module stays below the communicator. Peers' counts are input from a stranger:
//! at most 2^20 keys and 2^24 samples in all are accepted.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use super::summary::StragglerEntry;
use crate::error::{Error, Result};

/// The three collectives the straggler step runs, over the group whose records are compared.
pub trait GroupOps {
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// This rank in the group.
    fn rank(&self) -> usize;
    /// All-reduce MAX of `buf` across the group.
    fn all_reduce_max(&self, buf: &mut [i64]) -> Result<()>;
    /// All-reduce MIN of `buf` across the group.
    fn all_reduce_min(&self, buf: &mut [i64]) -> Result<()>;
    /// All-gather of `input` into `output` (size × input, rank order).
    fn all_gather(&self, input: &[i64], output: &mut [i64]) -> Result<()>;
}

/// Most keys a peer may announce.
const MAX_KEYS: usize = 1 << 20;
/// Most latency samples, over all keys, a round may carry.
const MAX_SAMPLES: u64 = 1 << 24;

/// For each of this rank's entries in `input`, the element-wise minimum of its latencies
/// across the ranks of `group` that logged the same key (collective: every rank calls it).
pub fn min_latencies(group: &impl GroupOps, input: &[StragglerEntry]) -> Result<Vec<StragglerEntry>> {
    const PAD: i64 = i64::MIN;
    let hash = |name: &str, bytes: u64| {
        let mut h = DefaultHasher::new();
        (name, bytes).hash(&mut h);
        (h.finish() >> 1) as i64
    };
    let mine: Vec<i64> = input.iter().map(|(name, bytes, _)| hash(name, *bytes)).collect();
    let mut most = [mine.len() as i64];
    group.all_reduce_max(&mut most)?;
    let bad = |what: String| Error::protocol(format!("straggler table: a peer sent {what}")).with_rank(group.rank());
    let most =
        usize::try_from(most[0]).ok().filter(|m| *m <= MAX_KEYS).ok_or_else(|| bad(format!("{} keys", most[0])))?;
    let mut padded = mine.clone();
    padded.resize(most, PAD);
    let mut all = vec![0i64; padded.len() * group.size()];
    group.all_gather(&padded, &mut all)?;
    let mut keys: Vec<i64> = all.into_iter().filter(|k| *k != PAD).collect();
    keys.sort_unstable();
    keys.dedup();
    let position = |k: i64| mine.iter().position(|m| *m == k);
    let mut lengths: Vec<i64> =
        keys.iter().map(|k| position(*k).map_or(i64::MAX, |i| input[i].2.len() as i64)).collect();
    group.all_reduce_min(&mut lengths)?;
    let samples = lengths.iter().map(|l| u64::try_from(*l).unwrap_or(u64::MAX)).fold(0, u64::saturating_add);
    if samples > MAX_SAMPLES {
        return Err(bad(format!("{samples} samples")));
    }
    let mut flat = Vec::with_capacity(lengths.iter().map(|l| *l as usize).sum());
    for (k, len) in keys.iter().zip(&lengths) {
        let lat = position(*k).map(|i| &input[i].2);
        for j in 0..*len as usize {
            flat.push(lat.map_or(i64::MAX, |l| l[j] as i64));
        }
    }
    group.all_reduce_min(&mut flat)?;
    let mut mins = Vec::new();
    let mut at = 0;
    for (k, len) in keys.iter().zip(&lengths) {
        let len = *len as usize;
        if let Some(i) = position(*k) {
            let (name, bytes, _) = &input[i];
            mins.push((name.clone(), *bytes, flat[at..at + len].iter().map(|v| *v as u64).collect()));
        }
        at += len;
    }
    Ok(mins)
}
