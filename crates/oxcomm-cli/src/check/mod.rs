//! `oxcomm check`: runs every collective on every transport with exact inputs and prints a
//! pass/fail table (op × transport), then exits 1 if anything failed.
//!
//! This folder owns the list of checks ([`checks`], in this file, with the flags), the front
//! end (`front.rs`: starting the ranks — threads in this process, or processes over shared
//! memory or TCP through [`crate::launch::launch_self`], as `oxcomm bench` does — and the
//! table), running the checks on one rank (`rank.rs`) and the ops verified here
//! (`verify.rs`). The ops that `oxcomm bench` times are run and verified by the bench's own
//! code ([`crate::bench::cases`]), so the check and the bench agree on what "right" means; the
//! others (all_to_all_v, gather, scatter, barrier, send/recv, reduce_scatter_coalesced) are
//! verified in `verify.rs`. It uses only oxcomm's public API.
//!
//! # What runs
//!
//! For each transport and world size: every op with every algorithm that applies to it
//! (`auto` too; `direct` only on shm, `hier` only across hosts), for the dtypes f32, bf16, i32
//! and u8 (the compressed ops only for the dtypes they take), at counts of 0, 1, 7, 4097 and 2^18 elements per rank
//! block (2^18 is 1 MiB of f32), both in place and out of place where the bench has both
//! modes. Reducing ops use `sum`; all_reduce (auto) also `max` and `prod` up to 4097 elements. Inputs are small integers
//! whose reductions are exact in every dtype (see `crate::bench::cases`), so results are compared
//! exactly (within a few units in the last place only where the op divides: the compressed
//! ops and reduce_scatter_coalesced on floats). onebit_all_reduce's counts are rounded up to
//! its padding granularity and quant_reduce_scatter's up to even (their exact-input checks
//! need unpadded buffers; see `crate::bench::cases`).
//!
//! Every op has a deadline of `OXCOMM_TIMEOUT` seconds (30 here unless set), so a hang
//! becomes a failure. A failure names the case (dtype, count, mode) and what went wrong: the
//! number of wrong elements over all ranks, or the error. After a communication error the
//! communicator is aborted, so the later checks of that transport fail with the same cause.
//!
//! # Processes
//!
//! For shm and tcp the command re-runs itself as N ranks with the hidden `--worker` flag (and
//! `OXCOMM_TRANSPORT` set to the transport); rank 0 writes the results as JSON to the file
//! named by the hidden `--results`, which the front end reads.
//!
//! # Test only
//!
//! The hidden `--inject-failure OP` makes rank 0 corrupt (or, for ops verified here, count as
//! wrong) the first element of its result in every non-empty check whose name starts with
//! OP, so the tests can see a failing table and exit status. It exists for the tests only.

use std::path::PathBuf;

use anyhow::anyhow;
use oxcomm::{Algorithm, DType, Transport};
use serde::{Deserialize, Serialize};

use crate::bench::cases::BenchOp;

mod front;
mod rank;
mod verify;

pub use front::run;

/// Flags of `oxcomm check`.
#[derive(Debug, Clone, clap::Args)]
pub struct CheckArgs {
    /// Transports to check, comma-separated: threads, shm, tcp (default: all three).
    #[arg(long = "transport", value_name = "NAMES", value_delimiter = ',')]
    pub transport: Vec<String>,

    /// Ranks per job, comma-separated for several (e.g. 2,3,4).
    #[arg(
        long = "world-size",
        visible_alias = "world_size",
        value_name = "N",
        value_delimiter = ',',
        default_value = "3"
    )]
    pub world_size: Vec<usize>,

    /// Only the checks whose name starts with one of these, comma-separated (e.g.
    /// all_reduce,gather).
    #[arg(long = "op", value_name = "OPS", value_delimiter = ',')]
    pub op: Vec<String>,

    /// Test only: rank 0 spoils its result in every non-empty check whose name starts with OP.
    #[arg(long = "inject-failure", hide = true, value_name = "OP")]
    pub inject_failure: Option<String>,

    /// Run as one rank of a job started by the front end.
    #[arg(long = "worker", hide = true)]
    pub worker: bool,

    /// Worker rank 0 writes its results (JSON) to this file.
    #[arg(long = "results", hide = true, value_name = "FILE", requires = "worker")]
    pub results: Option<PathBuf>,
}

/// The transports `--transport` takes, and the default list, in column order.
pub(super) const TRANSPORTS: [Transport; 3] = [Transport::Threads, Transport::Shm, Transport::Tcp];

/// The transports `--transport` names (all of [`TRANSPORTS`] when empty), read with the
/// library's names.
pub(super) fn transports(typed: &[String]) -> anyhow::Result<Vec<Transport>> {
    if typed.is_empty() {
        return Ok(TRANSPORTS.to_vec());
    }
    typed
        .iter()
        .map(|t| {
            Transport::parse(t.trim()).filter(|t| TRANSPORTS.contains(t)).ok_or_else(|| {
                let names: Vec<&str> = TRANSPORTS.iter().map(|t| t.as_str()).collect();
                anyhow!(
                    "--transport: unknown transport {:?} (one of: {})",
                    t.trim().to_ascii_lowercase(),
                    names.join(", ")
                )
            })
        })
        .collect()
}

/// Deadline of every op of a check, unless `OXCOMM_TIMEOUT` is set.
pub(super) const DEFAULT_TIMEOUT_S: &str = "30";

/// The element counts per rank block: 0, 1, 7, 4097 and 2^18 (1 MiB of f32).
pub(super) const COUNTS: [usize; 5] = [0, 1, 7, 4097, 1 << 18];

/// Counts up to this also run all_reduce with `max` and `prod`.
pub(super) const SMALL: usize = 4097;

/// The dtypes every op runs with.
pub(super) const DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::I32, DType::U8];

/// What the check of one op (over every dtype, count and mode) found on one transport.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Outcome {
    /// The check's name: `op` or `op/algorithm`.
    pub(super) name: String,
    /// Cases run.
    pub(super) cases: usize,
    /// Cases that failed.
    pub(super) failed: usize,
    /// The first failure: the case and what went wrong.
    pub(super) first: Option<String>,
}

/// One check: an op, and the algorithm forced on it (`None`: auto).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Check {
    /// An op the bench also times, run and verified by [`Case`].
    Bench(BenchOp, Option<Algorithm>),
    AllToAllV,
    Gather,
    Scatter,
    Barrier(Option<Algorithm>),
    SendRecv,
    ReduceScatterCoalesced,
}

impl Check {
    pub(super) fn name(&self) -> String {
        let with = |op: &str, a: &Option<Algorithm>| match a {
            Some(a) => format!("{op}/{}", a.name()),
            None => format!("{op}/auto"),
        };
        match self {
            Check::Bench(op, _) if op.averages() => op.name().to_string(),
            Check::Bench(op, a) => with(op.name(), a),
            Check::AllToAllV => "all_to_all_v".into(),
            Check::Gather => "gather".into(),
            Check::Scatter => "scatter".into(),
            Check::Barrier(a) => with("barrier", a),
            Check::SendRecv => "send_recv".into(),
            Check::ReduceScatterCoalesced => "reduce_scatter_coalesced".into(),
        }
    }
}

/// Every check for `transport` (`direct` algorithms only on shm, hierarchical ones only on
/// jobs that mix shm and TCP, i.e. span hosts), in table order.
pub(super) fn checks(transport: Transport) -> Vec<Check> {
    let applies = |a: &Algorithm| match a {
        Algorithm::ShmDirect => transport == Transport::Shm,
        Algorithm::Hierarchical => transport == Transport::ShmTcp,
        _ => true,
    };
    let mut out = Vec::new();
    for op in BenchOp::ALL {
        if op.averages() {
            continue;
        }
        out.push(Check::Bench(op, None));
        out.extend(op.algorithms().iter().filter(|a| applies(a)).map(|a| Check::Bench(op, Some(*a))));
    }
    out.extend([Check::AllToAllV, Check::Gather, Check::Scatter, Check::Barrier(None)]);
    out.extend(
        oxcomm::algorithms::plan::candidates(oxcomm::wire::OpKind::Barrier)
            .iter()
            .filter(|a| applies(a))
            .map(|a| Check::Barrier(Some(*a))),
    );
    out.extend([
        Check::SendRecv,
        Check::Bench(BenchOp::OnebitAllReduce, None),
        Check::Bench(BenchOp::QuantReduceScatter, None),
        Check::ReduceScatterCoalesced,
    ]);
    out
}

/// The checks selected by `--op` (all when empty).
pub(super) fn selected(transport: Transport, filter: &[String]) -> Vec<Check> {
    checks(transport)
        .into_iter()
        .filter(|c| filter.is_empty() || filter.iter().any(|f| c.name().starts_with(f.trim())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_op_of_the_brief_is_checked() {
        let names: Vec<String> = checks(Transport::Shm).iter().map(Check::name).collect();
        for want in [
            "all_reduce/auto",
            "all_reduce/ring",
            "all_reduce/rd",
            "all_reduce/star",
            "all_reduce/direct",
            "reduce/auto",
            "broadcast/direct",
            "all_gather/ring",
            "reduce_scatter/ring",
            "all_to_all/pairwise",
            "all_to_all_v",
            "gather",
            "scatter",
            "barrier/dissem",
            "send_recv",
            "onebit_all_reduce",
            "quant_reduce_scatter",
            "reduce_scatter_coalesced",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} missing from {names:?}");
        }
        assert!(!checks(Transport::Threads).iter().any(|c| c.name().ends_with("/direct")));
        assert!(!checks(Transport::Shm).iter().any(|c| c.name().ends_with("/hier")));
        assert!(checks(Transport::ShmTcp).iter().any(|c| c.name() == "all_reduce/hier"));
    }
}
