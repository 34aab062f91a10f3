//! Choosing an algorithm for one op: by op, message size and group size, and for all-reduces
//! that cross hosts by the [cost model](super::cost).
//!
//! | op | choice |
//! | --- | --- |
//! | all_reduce across hosts ([`Across`]: links over TCP), up to [`SMALL_ALL_REDUCE_BYTES`] | the lowest predicted time of recursive doubling, halving-doubling, ring and (when the group spans hosts evenly) hierarchical, from the links' measured alpha and beta ([`super::cost::best`]); recursive doubling with fewer elements than ranks |
//! | all_reduce across hosts, above | hierarchical when the group spans hosts evenly; else the ring, or up to [`HALVING_COMPETES_MAX_BYTES`] the lower prediction of ring and halving-doubling where halving-doubling measured clearly faster at start-up ([`super::cost::Network::halving_beats_ring`]) |
//! | all_reduce otherwise | recursive doubling below [`SMALL_ALL_REDUCE_BYTES`] (or fewer elements than ranks); above, hierarchical when the group spans hosts evenly, else ring |
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

use super::cost::{self, Network, Shape};
use super::Algorithm;
use crate::error::{Error, Result};
use crate::wire::OpKind;

/// All-reduce messages below this many bytes use recursive doubling.
pub const SMALL_ALL_REDUCE_BYTES: usize = 64 * 1024;

/// Across hosts, the largest all-reduce (bytes per rank) for which halving-doubling competes
/// with the ring, where it measured faster at start-up: above, the ring's pipelined steps are
/// the safe choice (a mistaken halving-doubling cost up to 1.4x there; 1.2x at most up to
/// this size).
pub const HALVING_COMPETES_MAX_BYTES: usize = 1 << 20;

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
        // Run by the backend's fault-tolerance protocol, over control messages.
        OpKind::Agree | OpKind::Shrink => &[],
    }
}

/// What the planner knows of the network a group's ops cross: the links' parameters (measured
/// when the job started, or given), how the group sits on hosts, and whether a small
/// all-reduce folds its agreement into its data (TCP links only: see `doubling.rs`). Every rank
/// of a group must see the same value, or ranks would choose different algorithms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Across {
    /// The links' alpha and beta.
    pub net: Network,
    /// Hosts × ranks per host of the group.
    pub shape: Shape,
    /// Whether recursive doubling of up to 64 KiB skips the agreement phase.
    pub folds: bool,
}

impl Across {
    /// Whether an op of `kind` moving `bytes` per rank with recursive doubling folds its
    /// agreement into its data (no agreement phase): all-reduces of up to 64 KiB over TCP.
    pub fn folds_at(&self, kind: OpKind, bytes: usize) -> bool {
        self.folds && kind == OpKind::AllReduce && bytes <= super::doubling::FOLD_MAX_BYTES
    }
}

/// Picks the algorithm for `kind` moving `bytes` (one rank's buffer) among `count` elements
/// in a group of `size`, honouring `forced` when it applies. `direct` says whether the
/// shared-memory direct path is available (shm transport, world group); it is preferred
/// wherever it applies. `hier` says whether the group spans hosts evenly (see the module docs).
/// `across`, for groups whose links cross hosts, lets the cost model choose all-reduces.
#[allow(clippy::too_many_arguments)] // the op, the group and what the backend knows of its links
pub fn choose(
    kind: OpKind,
    bytes: usize,
    count: usize,
    size: usize,
    forced: Option<Algorithm>,
    direct: bool,
    hier: bool,
    across: Option<&Across>,
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
        // Across hosts the model chooses up to `SMALL_ALL_REDUCE_BYTES`.
        OpKind::AllReduce | OpKind::AllReduceCoalesced
            if count >= size && across.is_some() && bytes <= SMALL_ALL_REDUCE_BYTES =>
        {
            let x = across.expect("checked above");
            let folded = x.folds_at(kind, bytes);
            let allowed: Vec<Algorithm> = cost::ALL_REDUCE
                .into_iter()
                .filter(|a| options.contains(a) && (hier || *a != Algorithm::Hierarchical))
                .collect();
            cost::best(x.shape, &x.net, bytes, folded, &allowed).unwrap_or(Algorithm::RecursiveDoubling)
        }
        // Above, hierarchical where the group spans hosts evenly, else the ring, unless
        // halving-doubling measured clearly faster than the ring on these links at start-up:
        // then, up to `HALVING_COMPETES_MAX_BYTES`, the model chooses between the two. The
        // model prices their bytes alike, so it takes halving-doubling's fewer steps; measured
        // (docs/perf_many_hosts.md) that held where the hosts' cores set the pace (256 KiB on 8
        // hosts at 10 Gbit/s: 1.2-1.7x faster than the ring) but not where tbf-shaped 1 Gbit/s
        // links did (the ring up to 1.4x faster from 4 MiB, its pipelined steps keeping the
        // links busy), and the start-up measurement, a few ops, can mistake one for the other.
        OpKind::AllReduce | OpKind::AllReduceCoalesced
            if count >= size
                && !hier
                && bytes <= HALVING_COMPETES_MAX_BYTES
                && across.is_some_and(|x| x.net.halving_beats_ring()) =>
        {
            let x = across.expect("checked above");
            let pair = [Algorithm::HalvingDoubling, Algorithm::Ring];
            cost::best(x.shape, &x.net, bytes, false, &pair).unwrap_or(Algorithm::Ring)
        }
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
        assert_eq!(choose(OpKind::AllReduce, 8, 2, 4, None, false, false, None).unwrap(), Algorithm::RecursiveDoubling);
        assert_eq!(choose(OpKind::AllReduce, 1 << 20, 1 << 18, 4, None, false, false, None).unwrap(), Algorithm::Ring);
        assert_eq!(choose(OpKind::Broadcast, 8, 2, 4, None, false, false, None).unwrap(), Algorithm::BinomialTree);
        assert!(choose(OpKind::Broadcast, 8, 2, 4, Some(Algorithm::Ring), false, false, None).is_err());
        assert_eq!(
            choose(OpKind::Barrier, 0, 0, 4, Some(Algorithm::Dissemination), false, false, None).unwrap(),
            Algorithm::Dissemination
        );
        assert_eq!(choose(OpKind::AllReduce, 8, 2, 4, None, true, false, None).unwrap(), Algorithm::ShmDirect);
        assert!(choose(OpKind::AllReduce, 8, 2, 4, Some(Algorithm::ShmDirect), false, false, None).is_err());
        for kind in [OpKind::Reduce, OpKind::AllToAll, OpKind::AllToAllV, OpKind::Gather, OpKind::Scatter] {
            assert_eq!(choose(kind, 1 << 20, 1 << 18, 4, None, true, false, None).unwrap(), Algorithm::ShmDirect);
            assert_eq!(choose(kind, 1 << 20, 1 << 18, 4, None, false, false, None).unwrap(), candidates(kind)[0]);
        }
        // Across hosts: hierarchical for large all-reduces and every all-gather/reduce-scatter.
        assert_eq!(choose(OpKind::AllReduce, 8, 2, 4, None, false, true, None).unwrap(), Algorithm::RecursiveDoubling);
        assert_eq!(
            choose(OpKind::AllReduce, 1 << 20, 1 << 18, 4, None, false, true, None).unwrap(),
            Algorithm::Hierarchical
        );
        assert_eq!(choose(OpKind::AllGather, 8, 2, 4, None, false, true, None).unwrap(), Algorithm::Hierarchical);
        assert_eq!(choose(OpKind::Reduce, 8, 2, 4, None, false, true, None).unwrap(), Algorithm::BinomialTree);
        assert!(choose(OpKind::AllGather, 8, 2, 4, Some(Algorithm::Hierarchical), false, false, None).is_err());
        assert_eq!(
            choose(OpKind::AllGather, 8, 2, 4, Some(Algorithm::Ring), false, true, None).unwrap(),
            Algorithm::Ring
        );
        // One host on shm: the direct path for all-gather and reduce-scatter of any size.
        for kind in [OpKind::AllGather, OpKind::ReduceScatter] {
            assert_eq!(choose(kind, 8, 2, 4, None, true, false, None).unwrap(), Algorithm::ShmDirect);
            assert_eq!(choose(kind, 1 << 24, 1 << 22, 4, None, true, false, None).unwrap(), Algorithm::ShmDirect);
            assert_eq!(choose(kind, 8, 2, 4, Some(Algorithm::Ring), true, false, None).unwrap(), Algorithm::Ring);
            assert!(choose(kind, 8, 2, 4, Some(Algorithm::ShmDirect), false, false, None).is_err());
        }
    }

    /// Issue 40: across hosts the cost model picks the all-reduce, from the links' alpha and
    /// beta, not from a fixed size: at 4 hosts the switch from recursive doubling moves with
    /// the links' speed, and with 16 hosts mid sizes go to halving-doubling.
    #[test]
    fn across_hosts_the_model_picks_the_all_reduce() {
        let across = |hosts: usize, alpha_us: f64, gbit: f64| Across {
            net: Network::new(alpha_us, gbit),
            shape: Shape { hosts, ranks_per_host: 1 },
            folds: true,
        };
        let pick = |x: &Across, bytes: usize| {
            choose(OpKind::AllReduce, bytes, bytes / 4, x.shape.hosts, None, false, false, Some(x)).unwrap()
        };
        let (slow, fast) = (across(4, 20.0, 1.0), across(4, 20.0, 10.0));
        assert_eq!(pick(&slow, 8), Algorithm::RecursiveDoubling);
        // Above 64 KiB: the ring, as measured best at 1 Gbit/s on 4 and 8 hosts.
        assert_eq!(pick(&slow, 64 << 20), Algorithm::Ring);
        assert_eq!(pick(&across(8, 20.0, 1.0), 256 << 10), Algorithm::Ring);
        // 64 KiB at 10 Gbit/s: the ring's 6 steps cost more than doubling's extra bytes.
        assert_eq!(pick(&fast, 64 << 10), Algorithm::RecursiveDoubling);
        assert_ne!(pick(&slow, 1 << 20), Algorithm::RecursiveDoubling);
        assert_eq!(pick(&across(16, 20.0, 1.0), 64 << 10), Algorithm::HalvingDoubling);
        // The same inputs give the same choice (every rank computes it alone).
        assert_eq!(pick(&slow, 100_000), pick(&slow, 100_000));
        // Forcing still wins; fewer elements than ranks stay on recursive doubling.
        let forced = choose(OpKind::AllReduce, 8, 2, 4, Some(Algorithm::Ring), false, false, Some(&slow)).unwrap();
        assert_eq!(forced, Algorithm::Ring);
        assert_eq!(
            choose(OpKind::AllReduce, 12, 3, 4, None, false, false, Some(&slow)).unwrap(),
            Algorithm::RecursiveDoubling
        );
        // Above 64 KiB halving-doubling competes only where it measured clearly faster than
        // the ring at start-up; then the model takes its fewer steps.
        let measured = |x: Across, halving_over_ring: f64| Across { net: Network { halving_over_ring, ..x.net }, ..x };
        for bytes in [(64 << 10) + 4, 256 << 10, 1 << 20] {
            assert_eq!(pick(&measured(fast, 0.75), bytes), Algorithm::HalvingDoubling, "{bytes}");
            assert_eq!(pick(&measured(fast, 0.95), bytes), Algorithm::Ring, "{bytes}");
            assert_eq!(pick(&measured(across(8, 130.0, 1.0), 1.1), bytes), Algorithm::Ring, "{bytes}");
        }
        // Above 1 MiB the ring, whatever was measured.
        assert_eq!(pick(&measured(fast, 0.5), (1 << 20) + 4), Algorithm::Ring);
        // Five hosts: halving-doubling's extra rank costs two full-size steps, more than the
        // ring's extra steps save.
        assert_eq!(pick(&measured(across(5, 20.0, 1.0), 0.75), 1 << 20), Algorithm::Ring);
        // Several ranks per host spread evenly: hierarchical for large buffers.
        let hier = Across { shape: Shape { hosts: 4, ranks_per_host: 4 }, ..slow };
        assert_eq!(
            choose(OpKind::AllReduce, 64 << 20, 16 << 20, 16, None, false, true, Some(&hier)).unwrap(),
            Algorithm::Hierarchical
        );
        let hier = measured(hier, 0.75);
        assert_eq!(
            choose(OpKind::AllReduce, 64 << 20, 16 << 20, 16, None, false, true, Some(&hier)).unwrap(),
            Algorithm::Hierarchical
        );
    }
}
