//! One logged op ([`OpRecord`]) and the bandwidth model that turns its size and latency into
//! nccl-tests' algbw and busbw ([`OpKind`], [`bus_factor`]).
//!
//! This file owns the formulas; it knows nothing about how an op was timed or which transport
//! ran it (those arrive as plain fields).
//!
//! # The formulas (nccl-tests, `doc/PERFORMANCE.md` and `src/*.cu: *GetBw`)
//!
//! With `S` = [`OpRecord::bytes`] (DeepSpeed's message-size convention, see below), `n` =
//! [`OpRecord::group_size`] and `t` = the latency in seconds:
//!
//! * `algbw = S · size_scale(op, n) / t / 1e9` in GB/s (1 GB = 10⁹ bytes);
//! * `busbw = algbw · bus_factor(op, n)`.
//!
//! `size_scale` converts DeepSpeed's `S` into the byte count nccl-tests divides by (the *total*
//! array): it is `n` where DeepSpeed records one rank's share of that array (all_gather's input,
//! gather's input, scatter's receive buffer) and `1` everywhere else.
//!
//! | [`OpKind`] | op names (see [`OpKind::of`]) | `S` recorded | size_scale | bus_factor |
//! | --- | --- | --- | --- | --- |
//! | `AllReduce` | `all_reduce`, `all_reduce_coalesced`, `inference_all_reduce`, `onebit_all_reduce`, … | the tensor (sum for coalesced) | 1 | 2(n−1)/n |
//! | `ReduceScatter` | `reduce_scatter`, `reduce_scatter_tensor`, `reduce_scatter_coalesced`, `quant_reduce_scatter`, `all_to_all_quant_reduce` | the **full input** (n × output) | 1 | (n−1)/n |
//! | `AllGather` | `all_gather`, `all_gather_into_tensor`, `all_gather_coalesced` | one rank's input | n | (n−1)/n |
//! | `AllToAll` | `all_to_all`, `all_to_all_single`, `all_to_all_v` | the whole send buffer | 1 | (n−1)/n |
//! | `Gather` | `gather` | one rank's input | n | (n−1)/n |
//! | `Scatter` | `scatter` | the receive buffer | n | (n−1)/n |
//! | `Rooted` | `broadcast`, `reduce` | the tensor | 1 | 1 |
//! | `PointToPoint` | `send`, `recv`, `isend`, `irecv` | the tensor | 1 | 1 |
//! | `Barrier` | `barrier`, `monitored_barrier`, `*_barrier` | 0 | 1 | 0 |
//! | `Other` | anything else | as the caller says | 1 | 1 |
//!
//! With `n = 1` the `(n−1)/n` and `2(n−1)/n` factors are 0 (nothing crosses a link); the factor-1
//! kinds stay 1. `n = 0` (a malformed record) gives factor 0 and scale 1. A latency of 0 gives
//! 0 GB/s rather than infinity.
//!
//! Compressed collectives log the **uncompressed** byte count under their own names
//! (`onebit_all_reduce`, `quant_reduce_scatter`, …) and are measured with the factor of the
//! collective they replace, so their busbw is comparable with the uncompressed op's.
//!
//! # How this differs from DeepSpeed's `calc_bw_log` (spec §4.4)
//!
//! DeepSpeed prints `tput`/`busbw` in **Gbit/s** (× 8 / 10⁶ with t in ms); ours are GB/s
//! (multiply by 8 to compare). Beyond the unit:
//!
//! * all_reduce: DeepSpeed's `tput` is `2·S/t`, twice nccl-tests' algbw; our algbw is `S/t`.
//!   busbw agrees.
//! * reduce_scatter: DeepSpeed multiplies the already-full input by n again, so both of its
//!   numbers are n× too high; ours are `S/t` and `S/t·(n−1)/n`.
//! * gather/scatter: DeepSpeed uses `S/t` and factor 1; we follow nccl-tests (`S·n/t`,
//!   `(n−1)/n`).
//! * DeepSpeed always uses the WORLD size for `n`; we use the size of the group the op ran on.
//! * DeepSpeed ends the process (`exit(0)`) on an op name it has no formula for; we use
//!   factor 1 ([`OpKind::Other`]).

use std::panic::Location;

use crate::dtype::DType;

/// One completed op, as the communicator hands it to [`CommsLogger::record`](super::CommsLogger::record).
///
/// Plain `Copy` data (no heap), so recording it never allocates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OpRecord {
    /// The op name, e.g. `all_reduce`, `reduce_scatter`, `onebit_all_reduce`. It is the grouping
    /// key of the summary and selects the bandwidth formula ([`OpKind::of`]).
    pub op: &'static str,
    /// The element type, if the op has one (`None` for barrier).
    pub dtype: Option<DType>,
    /// Elements in the buffer that [`bytes`](Self::bytes) measures.
    pub count: usize,
    /// The message size in bytes, by DeepSpeed's convention (spec §4.3): all_reduce, broadcast,
    /// reduce, send, recv: the tensor; all_gather and gather: **one rank's input**;
    /// reduce_scatter: the **full input** (n × output); all_to_all: the whole send buffer;
    /// scatter: the receive buffer; coalesced/list forms: the sum; barrier: 0. Compressed
    /// collectives: the uncompressed size. See the [formula table](self).
    pub bytes: u64,
    /// The number of ranks in the group the op ran on (`n` of the formulas).
    pub group_size: usize,
    /// The communicator's sequence number of the op.
    pub seq: u64,
    /// The algorithm that ran (`ring`, `direct`, `tree`, …).
    pub algorithm: &'static str,
    /// The transport that carried it (`threads`, `shm`, `tcp`, …).
    pub transport: &'static str,
    /// When the op started, in ns since the logger was created ([`CommsLogger::now_ns`](super::CommsLogger::now_ns)).
    pub start_ns: u64,
    /// How long the op took on this rank, in ns.
    pub latency_ns: u64,
    /// Where the op was called from (via `#[track_caller]`), when the communicator captured it.
    pub caller: Option<&'static Location<'static>>,
}

impl OpRecord {
    /// The kind of op, which selects the formula.
    pub fn kind(&self) -> OpKind {
        OpKind::of(self.op)
    }

    /// Algorithm bandwidth in GB/s (10⁹ bytes/s): `bytes · size_scale / latency`. 0 when the
    /// latency is 0. See the [module docs](self).
    pub fn algbw_gbps(&self) -> f64 {
        algbw_gbps(self.op, self.bytes, self.group_size, self.latency_ns)
    }

    /// Bus bandwidth in GB/s: `algbw · bus_factor(op, group_size)`.
    pub fn busbw_gbps(&self) -> f64 {
        self.algbw_gbps() * bus_factor(self.op, self.group_size)
    }

    /// The latency in milliseconds.
    pub fn latency_ms(&self) -> f64 {
        self.latency_ns as f64 / 1e6
    }
}

/// The family of an op name, which decides its bandwidth formula (table in the
/// [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// all_reduce and its compressed/coalesced variants: factor 2(n−1)/n.
    AllReduce,
    /// reduce_scatter (bytes = full input): factor (n−1)/n.
    ReduceScatter,
    /// all_gather (bytes = one rank's input, scaled by n): factor (n−1)/n.
    AllGather,
    /// all_to_all (bytes = whole send buffer): factor (n−1)/n.
    AllToAll,
    /// gather (bytes = one rank's input, scaled by n): factor (n−1)/n.
    Gather,
    /// scatter (bytes = the receive buffer, scaled by n): factor (n−1)/n.
    Scatter,
    /// broadcast and reduce: factor 1.
    Rooted,
    /// send and recv: factor 1.
    PointToPoint,
    /// barriers: factor 0 (they move no payload).
    Barrier,
    /// An unrecognised name: factor 1, so busbw = algbw.
    Other,
}

/// Prefixes that name a variant of a base collective with the same bandwidth model.
const VARIANT_PREFIXES: [&str; 4] = ["onebit_", "quant_", "compressed_", "inference_"];
/// Suffixes that name a variant (API shape) of a base collective.
const VARIANT_SUFFIXES: [&str; 4] = ["_coalesced", "_into_tensor", "_tensor", "_single"];

impl OpKind {
    /// Classifies an op name. The name is matched exactly after removing at most one variant
    /// prefix (`onebit_`, `quant_`, `compressed_`, `inference_`) and at most one suffix
    /// (`_coalesced`, `_into_tensor`, `_tensor`, `_single`); `allreduce` is accepted for
    /// `all_reduce`, `all_to_all_quant_reduce` (qgZ) is a reduce-scatter, and any name ending in
    /// `barrier` is a barrier.
    pub fn of(op: &str) -> OpKind {
        if op == "all_to_all_quant_reduce" || op == "all_to_all_loco_quant_reduce" {
            return OpKind::ReduceScatter;
        }
        if op.ends_with("barrier") {
            return OpKind::Barrier;
        }
        let mut base = op;
        if let Some(p) = VARIANT_PREFIXES.iter().find(|p| base.starts_with(*p)) {
            base = &base[p.len()..];
        }
        if let Some(s) = VARIANT_SUFFIXES.iter().find(|s| base.ends_with(*s)) {
            base = &base[..base.len() - s.len()];
        }
        match base {
            "all_reduce" | "allreduce" => OpKind::AllReduce,
            "reduce_scatter" => OpKind::ReduceScatter,
            "all_gather" => OpKind::AllGather,
            "all_to_all" | "all_to_all_v" => OpKind::AllToAll,
            "gather" => OpKind::Gather,
            "scatter" => OpKind::Scatter,
            "broadcast" | "reduce" => OpKind::Rooted,
            "send" | "recv" | "isend" | "irecv" => OpKind::PointToPoint,
            _ => OpKind::Other,
        }
    }

    /// The busbw factor for a group of `n` ranks (table in the [module docs](self)).
    pub fn bus_factor(self, n: usize) -> f64 {
        if n == 0 {
            return 0.0;
        }
        let nf = n as f64;
        match self {
            OpKind::AllReduce => 2.0 * (nf - 1.0) / nf,
            OpKind::ReduceScatter | OpKind::AllGather | OpKind::AllToAll | OpKind::Gather | OpKind::Scatter => {
                (nf - 1.0) / nf
            }
            OpKind::Rooted | OpKind::PointToPoint | OpKind::Other => 1.0,
            OpKind::Barrier => 0.0,
        }
    }

    /// The factor from the recorded `bytes` to the byte count algbw divides by: `n` for
    /// all_gather, gather and scatter (DeepSpeed records one rank's share), else 1.
    pub fn size_scale(self, n: usize) -> f64 {
        match self {
            OpKind::AllGather | OpKind::Gather | OpKind::Scatter => n.max(1) as f64,
            _ => 1.0,
        }
    }

    /// Whether the op is collective over its whole group (everything but send/recv), and so
    /// takes part in the straggler analysis.
    pub fn is_collective(self) -> bool {
        self != OpKind::PointToPoint
    }
}

/// The busbw factor of op name `op` on `n` ranks: `OpKind::of(op).bus_factor(n)`.
///
/// | op | factor | n = 1 | n = 2 | n = 4 | n = 8 |
/// | --- | --- | --- | --- | --- | --- |
/// | all_reduce (+ onebit_/compressed_/inference_ variants) | 2(n−1)/n | 0 | 1 | 1.5 | 1.75 |
/// | reduce_scatter, all_gather, all_to_all(_v), gather, scatter (+ quant_ variants) | (n−1)/n | 0 | 0.5 | 0.75 | 0.875 |
/// | broadcast, reduce, send, recv, unknown names | 1 | 1 | 1 | 1 | 1 |
/// | barrier | 0 | 0 | 0 | 0 | 0 |
///
/// See the [module docs](self) for the full name list and how this differs from DeepSpeed.
pub fn bus_factor(op: &str, n: usize) -> f64 {
    OpKind::of(op).bus_factor(n)
}

/// Algorithm bandwidth in GB/s of op `op` moving `bytes` (DeepSpeed's convention) on `n` ranks
/// in `latency_ns`: `bytes · size_scale / latency_ns` (bytes per ns = GB/s). 0 when the latency
/// is 0.
pub fn algbw_gbps(op: &str, bytes: u64, n: usize, latency_ns: u64) -> f64 {
    if latency_ns == 0 {
        return 0.0;
    }
    bytes as f64 * OpKind::of(op).size_scale(n) / latency_ns as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_classify() {
        assert_eq!(OpKind::of("all_reduce"), OpKind::AllReduce);
        assert_eq!(OpKind::of("onebit_all_reduce"), OpKind::AllReduce);
        assert_eq!(OpKind::of("compressed_allreduce"), OpKind::AllReduce);
        assert_eq!(OpKind::of("all_reduce_coalesced"), OpKind::AllReduce);
        assert_eq!(OpKind::of("quant_reduce_scatter"), OpKind::ReduceScatter);
        assert_eq!(OpKind::of("reduce_scatter_tensor"), OpKind::ReduceScatter);
        assert_eq!(OpKind::of("all_gather_into_tensor"), OpKind::AllGather);
        assert_eq!(OpKind::of("all_to_all_single"), OpKind::AllToAll);
        assert_eq!(OpKind::of("log_summary_barrier"), OpKind::Barrier);
        assert_eq!(OpKind::of("reduce"), OpKind::Rooted);
        assert_eq!(OpKind::of("irecv"), OpKind::PointToPoint);
        assert_eq!(OpKind::of("frobnicate"), OpKind::Other);
        assert_eq!(OpKind::of(""), OpKind::Other);
    }
}
