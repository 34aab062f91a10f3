//! Collective algorithms, written against the engine's `Ctx` (which moves bytes over
//! per-peer links), never against a particular transport.
//!
//! Each file states its steps and bytes sent per rank. [`schedule`] holds the pure index
//! math; [`plan`] picks an algorithm from the op, the buffer size and the group size, unless
//! the caller forces one through [`crate::OpOptions`].

pub(crate) mod agreement;
pub(crate) mod barrier;
pub mod cost;
pub(crate) mod dispatch;
pub(crate) mod doubling;
pub(crate) mod halving;
pub mod hierarchical;
pub(crate) mod pairwise;
pub mod plan;
pub(crate) mod ring;
pub mod schedule;
#[cfg(target_os = "linux")]
pub(crate) mod shm_direct;
pub(crate) mod star;
pub(crate) mod tree;

use std::fmt;

// The op buffers live at the values level (`crate::buffers`: the communicator, both backends
// and these algorithms share them); the algorithm files name them through here.
pub(crate) use crate::buffers::{ExchangeBuffers, GatherBuffers, ReduceBuffers, ScatterBuffers};

/// An algorithm a collective can run with. Not every algorithm applies to every op; forcing
/// one that does not is an [`crate::ErrorKind::InvalidArgument`] error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Ring reduce-scatter + all-gather (all_reduce), ring all-gather, ring reduce-scatter.
    Ring,
    /// Recursive doubling (all_reduce), any group size.
    RecursiveDoubling,
    /// Recursive halving reduce-scatter + recursive doubling all-gather (all_reduce), any
    /// group size: the ring's bytes in 2 · log2 n steps.
    HalvingDoubling,
    /// Rank 0 reduces everything and sends the result back (all_reduce); the agreement
    /// phase as barrier.
    Star,
    /// Binomial tree (broadcast, reduce).
    BinomialTree,
    /// Pairwise exchange (all_to_all, all_to_all_v).
    Pairwise,
    /// Dissemination (barrier).
    Dissemination,
    /// Root talks to every rank directly (gather, scatter).
    Flat,
    /// Ranks on one host read each other's shared memory directly (all_reduce, broadcast,
    /// all_gather, reduce_scatter, barrier); only on the shm transport, for the world group.
    ShmDirect,
    /// Inside each host, then across hosts, then back (all_reduce, reduce_scatter, all_gather,
    /// broadcast); for groups with the same number (≥ 2) of ranks on each of ≥ 2 hosts.
    Hierarchical,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 10] = [
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::HalvingDoubling,
        Algorithm::Star,
        Algorithm::BinomialTree,
        Algorithm::Pairwise,
        Algorithm::Dissemination,
        Algorithm::Flat,
        Algorithm::ShmDirect,
        Algorithm::Hierarchical,
    ];

    /// Short name for logs and the CLI (`ring`, `rd`, `rhd`, `star`, `tree`, `pairwise`, `dissem`, `flat`, `direct`, `hier`).
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::RecursiveDoubling => "rd",
            Algorithm::HalvingDoubling => "rhd",
            Algorithm::Star => "star",
            Algorithm::BinomialTree => "tree",
            Algorithm::Pairwise => "pairwise",
            Algorithm::Dissemination => "dissem",
            Algorithm::Flat => "flat",
            Algorithm::ShmDirect => "direct",
            Algorithm::Hierarchical => "hier",
        }
    }

    /// Parses [`Algorithm::name`] (also `recursive_doubling`, `halving_doubling`,
    /// `rabenseifner`, `binomial`, `dissemination`, `hierarchical`), in any case, as [`crate::ReduceOp::parse`] and the dtypes' names are.
    pub fn parse(s: &str) -> Option<Algorithm> {
        Some(match s.to_ascii_lowercase().as_str() {
            "ring" => Algorithm::Ring,
            "rd" | "recursive_doubling" | "doubling" => Algorithm::RecursiveDoubling,
            "rhd" | "halving_doubling" | "rabenseifner" => Algorithm::HalvingDoubling,
            "star" => Algorithm::Star,
            "tree" | "binomial" => Algorithm::BinomialTree,
            "pairwise" => Algorithm::Pairwise,
            "dissem" | "dissemination" => Algorithm::Dissemination,
            "flat" => Algorithm::Flat,
            "direct" | "shm_direct" => Algorithm::ShmDirect,
            "hier" | "hierarchical" => Algorithm::Hierarchical,
            _ => return None,
        })
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::Algorithm;

    #[test]
    fn every_name_parses_back_in_any_case() {
        for a in Algorithm::ALL {
            assert_eq!(Algorithm::parse(a.name()), Some(a));
            assert_eq!(Algorithm::parse(&a.name().to_ascii_uppercase()), Some(a));
        }
        assert_eq!(Algorithm::parse("Hierarchical"), Some(Algorithm::Hierarchical));
        assert_eq!(Algorithm::parse("rings"), None);
    }
}
