//! Choosing an algorithm for one op: by op, message size and group size.
//!
//! | op | choice |
//! | --- | --- |
//! | all_reduce | recursive doubling below [`SMALL_ALL_REDUCE_BYTES`] (or fewer elements than ranks), ring above |
//! | all_gather, reduce_scatter | ring |
//! | broadcast, reduce | binomial tree |
//! | all_to_all(_v) | pairwise exchange |
//! | gather, scatter | flat |
//! | barrier | star (the agreement phase, which names missing ranks) |

use super::Algorithm;
use crate::error::{Error, Result};
use crate::wire::OpKind;

/// All-reduce messages below this many bytes use recursive doubling.
pub const SMALL_ALL_REDUCE_BYTES: usize = 64 * 1024;

/// The algorithms that can run `kind`.
pub fn candidates(kind: OpKind) -> &'static [Algorithm] {
    match kind {
        OpKind::AllReduce => &[Algorithm::Ring, Algorithm::RecursiveDoubling, Algorithm::Star, Algorithm::ShmDirect],
        OpKind::AllReduceCoalesced => &[Algorithm::Ring, Algorithm::RecursiveDoubling, Algorithm::Star],
        OpKind::AllGather | OpKind::AllGatherCoalesced | OpKind::ReduceScatter => &[Algorithm::Ring],
        OpKind::Broadcast => &[Algorithm::BinomialTree, Algorithm::ShmDirect],
        OpKind::Reduce => &[Algorithm::BinomialTree],
        OpKind::AllToAll | OpKind::AllToAllV => &[Algorithm::Pairwise],
        OpKind::Gather | OpKind::Scatter => &[Algorithm::Flat],
        OpKind::Barrier => &[Algorithm::Star, Algorithm::Dissemination, Algorithm::ShmDirect],
        OpKind::MonitoredBarrier | OpKind::NewGroup | OpKind::P2p => &[Algorithm::Star],
    }
}

/// Picks the algorithm for `kind` moving `bytes` (one rank's buffer) among `count` elements
/// in a group of `size`, honouring `forced` when it applies. `direct` says whether the
/// shared-memory direct path is available (shm transport, world group); it is preferred
/// wherever it applies.
pub fn choose(
    kind: OpKind,
    bytes: usize,
    count: usize,
    size: usize,
    forced: Option<Algorithm>,
    direct: bool,
) -> Result<Algorithm> {
    let options = candidates(kind);
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
            } else {
                Algorithm::Ring
            }
        }
        _ => options[0],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_by_size() {
        assert_eq!(choose(OpKind::AllReduce, 8, 2, 4, None, false).unwrap(), Algorithm::RecursiveDoubling);
        assert_eq!(choose(OpKind::AllReduce, 1 << 20, 1 << 18, 4, None, false).unwrap(), Algorithm::Ring);
        assert_eq!(choose(OpKind::Broadcast, 8, 2, 4, None, false).unwrap(), Algorithm::BinomialTree);
        assert!(choose(OpKind::Broadcast, 8, 2, 4, Some(Algorithm::Ring), false).is_err());
        assert_eq!(
            choose(OpKind::Barrier, 0, 0, 4, Some(Algorithm::Dissemination), false).unwrap(),
            Algorithm::Dissemination
        );
        assert_eq!(choose(OpKind::AllReduce, 8, 2, 4, None, true).unwrap(), Algorithm::ShmDirect);
        assert!(choose(OpKind::AllReduce, 8, 2, 4, Some(Algorithm::ShmDirect), false).is_err());
    }
}
