//! Choosing an algorithm for one op: by op, message size and group size.
//!
//! | op | choice |
//! | --- | --- |
//! | all_reduce | recursive doubling below [`SMALL_ALL_REDUCE_BYTES`] (or fewer elements than ranks); above, hierarchical when the group spans hosts evenly, else ring |
//! | all_gather, reduce_scatter | shm direct on one host (shm transport), else hierarchical when the group spans hosts evenly, else ring |
//! | broadcast | hierarchical when the group spans hosts evenly, else binomial tree |
//! | reduce | binomial tree; direct on one host (shm) |
//! | all_to_all(_v) | pairwise exchange; direct on one host (shm) |
//! | gather, scatter | flat; direct on one host (shm) |
//! | barrier | star (the agreement phase, which names missing ranks) |
//!
//! The shared-memory direct path wins wherever it applies (one host, shm transport). "Spans
//! hosts evenly" is [`super::hierarchical::HostLayout`]: ≥ 2 hosts with the same number (≥ 2)
//! of the group's ranks each; the hierarchical algorithms then move fewer bytes across hosts.

use super::Algorithm;
use crate::error::{Error, Result};
use crate::wire::OpKind;

/// All-reduce messages below this many bytes use recursive doubling.
pub const SMALL_ALL_REDUCE_BYTES: usize = 64 * 1024;

/// The algorithms that can run `kind`.
pub fn candidates(kind: OpKind) -> &'static [Algorithm] {
    match kind {
        OpKind::AllReduce => &[
            Algorithm::Ring,
            Algorithm::RecursiveDoubling,
            Algorithm::HalvingDoubling,
            Algorithm::Star,
            Algorithm::ShmDirect,
            Algorithm::Hierarchical,
        ],
        OpKind::AllReduceCoalesced => {
            &[Algorithm::Ring, Algorithm::RecursiveDoubling, Algorithm::HalvingDoubling, Algorithm::Star]
        }
        OpKind::AllGather | OpKind::ReduceScatter => &[Algorithm::Ring, Algorithm::ShmDirect, Algorithm::Hierarchical],
        OpKind::AllGatherCoalesced => &[Algorithm::Ring],
        OpKind::Broadcast => &[Algorithm::BinomialTree, Algorithm::ShmDirect, Algorithm::Hierarchical],
        OpKind::Reduce => &[Algorithm::BinomialTree, Algorithm::ShmDirect],
        OpKind::AllToAll | OpKind::AllToAllV => &[Algorithm::Pairwise, Algorithm::ShmDirect],
        OpKind::Gather | OpKind::Scatter => &[Algorithm::Flat, Algorithm::ShmDirect],
        OpKind::Barrier => &[Algorithm::Star, Algorithm::Dissemination, Algorithm::ShmDirect],
        OpKind::MonitoredBarrier | OpKind::NewGroup | OpKind::P2p => &[Algorithm::Star],
    }
}

/// Picks the algorithm for `kind` moving `bytes` (one rank's buffer) among `count` elements
/// in a group of `size`, honouring `forced` when it applies. `direct` says whether the
/// shared-memory direct path is available (shm transport, world group); it is preferred
/// wherever it applies. `hier` says whether the group spans hosts evenly (see the module docs).
pub fn choose(
    kind: OpKind,
    bytes: usize,
    count: usize,
    size: usize,
    forced: Option<Algorithm>,
    direct: bool,
    hier: bool,
) -> Result<Algorithm> {
    let options = candidates(kind);
    if forced == Some(Algorithm::Hierarchical) && !hier {
        return Err(Error::invalid(format!(
            "algorithm hier needs a group with the same number (at least 2) of ranks on each of at least 2 hosts for {}",
            kind.name()
        )));
    }
    if forced == Some(Algorithm::ShmDirect) && !direct {
        return Err(Error::invalid(format!(
            "algorithm direct needs the shm transport and the world group (all ranks on one host) for {}",
            kind.name()
        )));
    }
    if forced.is_none() && direct && options.contains(&Algorithm::ShmDirect) {
        return Ok(Algorithm::ShmDirect);
    }
    if let Some(f) = forced {
        return if options.contains(&f) {
            Ok(f)
        } else {
            Err(Error::invalid(format!(
                "algorithm {f} does not apply to {} (choose one of: {})",
                kind.name(),
                options.iter().map(|a| a.name()).collect::<Vec<_>>().join(", ")
            )))
        };
    }
    Ok(match kind {
        OpKind::AllReduce | OpKind::AllReduceCoalesced => {
            if bytes < SMALL_ALL_REDUCE_BYTES || count < size {
                Algorithm::RecursiveDoubling
            } else if hier && options.contains(&Algorithm::Hierarchical) {
                Algorithm::Hierarchical
            } else {
                Algorithm::Ring
            }
        }
        _ if hier && options.contains(&Algorithm::Hierarchical) => Algorithm::Hierarchical,
        _ => options[0],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_by_size() {
        assert_eq!(choose(OpKind::AllReduce, 8, 2, 4, None, false, false).unwrap(), Algorithm::RecursiveDoubling);
        assert_eq!(choose(OpKind::AllReduce, 1 << 20, 1 << 18, 4, None, false, false).unwrap(), Algorithm::Ring);
        assert_eq!(choose(OpKind::Broadcast, 8, 2, 4, None, false, false).unwrap(), Algorithm::BinomialTree);
        assert!(choose(OpKind::Broadcast, 8, 2, 4, Some(Algorithm::Ring), false, false).is_err());
        assert_eq!(
            choose(OpKind::Barrier, 0, 0, 4, Some(Algorithm::Dissemination), false, false).unwrap(),
            Algorithm::Dissemination
        );
        assert_eq!(choose(OpKind::AllReduce, 8, 2, 4, None, true, false).unwrap(), Algorithm::ShmDirect);
        assert!(choose(OpKind::AllReduce, 8, 2, 4, Some(Algorithm::ShmDirect), false, false).is_err());
        for kind in [OpKind::Reduce, OpKind::AllToAll, OpKind::AllToAllV, OpKind::Gather, OpKind::Scatter] {
            assert_eq!(choose(kind, 1 << 20, 1 << 18, 4, None, true, false).unwrap(), Algorithm::ShmDirect);
            assert_eq!(choose(kind, 1 << 20, 1 << 18, 4, None, false, false).unwrap(), candidates(kind)[0]);
        }
        // Across hosts: hierarchical for large all-reduces and every all-gather/reduce-scatter.
        assert_eq!(choose(OpKind::AllReduce, 8, 2, 4, None, false, true).unwrap(), Algorithm::RecursiveDoubling);
        assert_eq!(choose(OpKind::AllReduce, 1 << 20, 1 << 18, 4, None, false, true).unwrap(), Algorithm::Hierarchical);
        assert_eq!(choose(OpKind::AllGather, 8, 2, 4, None, false, true).unwrap(), Algorithm::Hierarchical);
        assert_eq!(choose(OpKind::Reduce, 8, 2, 4, None, false, true).unwrap(), Algorithm::BinomialTree);
        assert!(choose(OpKind::AllGather, 8, 2, 4, Some(Algorithm::Hierarchical), false, false).is_err());
        assert_eq!(choose(OpKind::AllGather, 8, 2, 4, Some(Algorithm::Ring), false, true).unwrap(), Algorithm::Ring);
        // One host on shm: the direct path for all-gather and reduce-scatter of any size.
        for kind in [OpKind::AllGather, OpKind::ReduceScatter] {
            assert_eq!(choose(kind, 8, 2, 4, None, true, false).unwrap(), Algorithm::ShmDirect);
            assert_eq!(choose(kind, 1 << 24, 1 << 22, 4, None, true, false).unwrap(), Algorithm::ShmDirect);
            assert_eq!(choose(kind, 8, 2, 4, Some(Algorithm::Ring), true, false).unwrap(), Algorithm::Ring);
            assert!(choose(kind, 8, 2, 4, Some(Algorithm::ShmDirect), false, false).is_err());
        }
    }
}
