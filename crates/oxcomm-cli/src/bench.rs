//! `oxcomm bench`: times collectives over a range of message sizes and prints an nccl-tests
//! style table (NVIDIA/nccl-tests, `src/common.cu`), optionally as JSON Lines and CSV too.
//!
//! This module owns the bench: its flags ([`BenchArgs`]), the checked plan built from them,
//! starting the ranks (threads in this process, or processes over shared memory started
//! through [`crate::launch::launch_self`]), the timing loop, the correctness check, and the
//! report (table, progress bar, JSON, CSV). Drawing the plot of `--plot` and reading the files
//! of `--compare` belong to [`crate::plot`]. It uses only oxcomm's public API; it knows nothing
//! about how the transports or algorithms work.
//!
//! # Processes
//!
//! With `--transport shm` (the default) the command re-runs itself as N ranks with the hidden
//! `--worker` flag; each worker builds its communicator with `oxcomm::init()`. Rank 0 sends
//! each finished table line to the parent over a Unix datagram socket (abstract name, passed as
//! the hidden `--report-to`), and the parent prints it, writes the files and moves the progress
//! bar, so the bar and the table share one terminal cleanly. A worker started by hand (e.g.
//! `oxcomm launch -n 4 -- oxcomm bench --worker`) prints the report itself from rank 0.
//! With `--transport threads` the ranks are threads of this process (`oxcomm::threads`).
//!
//! # What is timed
//!
//! For each op, size and mode (out-of-place, in-place): a barrier, `-w` warm-up ops, a
//! barrier, then `-n` ops back to back, timed as a whole with `Instant` (time = total / n) and
//! one by one (for the median). Each rank measures its own mean and median; the table shows
//! the **maximum over ranks** of each (the op is done when the slowest rank is; nccl-tests
//! prints the average over ranks by default). Buffers are allocated and touched once, at the
//! largest size, and reused for every size (first-touch page faults are slow).
//!
//! # Out-of-place and in-place
//!
//! oxcomm's all_reduce has both modes (`all_reduce_into` and `all_reduce`); broadcast and
//! reduce work in place; all_gather, reduce_scatter and all_to_all take separate input and
//! output buffers. The mode the API lacks is emulated with one extra copy, which is *inside*
//! the timed region (it is what a caller of our API pays):
//!
//! | op | out-of-place | in-place |
//! | --- | --- | --- |
//! | all_reduce | `all_reduce_into(input, output)` | `all_reduce(buffer)` |
//! | reduce | copy input → output, then the op on the output | the op on the buffer |
//! | broadcast | root copies input → output, then broadcast of the output | broadcast of the buffer |
//! | all_gather | separate input and output | copy this rank's block of the output to a scratch input, then all_gather |
//! | reduce_scatter | separate input and output | reduce_scatter into a scratch output, then copy it to this rank's block of the input |
//! | all_to_all | separate send and receive buffers | copy the buffer to a scratch send buffer, then all_to_all back into it |
//!
//! | onebit_all_reduce | copy input → output, then the op on the output | the op on the buffer |
//! | quant_reduce_scatter | the op, then copy its result (a new vector) to the output | the op, then copy its result to this rank's block of the input |
//!
//! JSON and CSV rows carry `emulated: true` for the emulated mode.
//!
//! # The compressed ops
//!
//! `onebit_all_reduce` is [`oxcomm::compression::onebit::all_reduce`] (f32 only; DeepSpeed's
//! 1-bit error-compensated all-reduce). One [`OneBitState`] per size is made before the
//! warm-up and kept through both modes, so timed iterations run with the error feedback a
//! training loop would carry. Its count is rounded down to a multiple of DeepSpeed's padding
//! granularity `n · lcm(n, 8)` ([`onebit::padded_len`]`(1, n)`), so no padding is sent.
//! `algbw`/`busbw` are computed from the **uncompressed** f32 bytes with all_reduce's bus
//! factor, so its line compares directly with all_reduce's: a higher busbw means the same
//! gradient was averaged faster.
//!
//! `quant_reduce_scatter` is ZeRO++'s qgZ,
//! [`oxcomm::compression::coalesced::all_to_all_quant_reduce`] (f32, f16, bf16), with one
//! tensor per call. Sizes follow reduce_scatter (size = the full input of `n · P` elements,
//! `P` per rank, rounded down to even so the int4 codes pack); the tensor's shape is
//! `[N / E, E]` with `E` the largest power of two that divides `P`, at most 2048 and at most
//! `√N`, so every line takes the quantized path (one int4 group per row). The host layout comes
//! from `--ranks-per-host K` (hosts are runs of `K` ranks, [`HostGroups::uniform`]); without
//! it, from the job's real hosts ([`HostGroups::from_topology`]: a multi-host launch with
//! several ranks per host), else all ranks form one host (no cross-host phase). Bandwidths use reduce_scatter's factor
//! on the uncompressed bytes.
//!
//! # Bytes on the wire
//!
//! `wire(B)` (JSON/CSV `wire_bytes`) is the number of bytes this rank handed to its links per
//! op during the timed iterations ([`Communicator::stats`]`().bytes_sent` before and after,
//! divided by `-n`), the maximum over ranks; the table shows the larger of the two modes. It
//! counts payload and headers, including each op's agreement messages. The shared-memory
//! direct paths (all_reduce, broadcast and barrier on `--transport shm`, where ranks read each
//! other's memory) send nothing through links, so those ops show little or nothing there.
//!
//! # Sizes, counts, bandwidth
//!
//! `size` is the byte count of the op's full buffer as nccl-tests defines it: the tensor for
//! all_reduce, broadcast and reduce; the gathered output for all_gather; the full input for
//! reduce_scatter; the whole send buffer for all_to_all. It is rounded down to a whole number
//! of elements (per rank where the op splits the buffer by rank), so a line may show fewer bytes
//! than asked for (`size 0` when the buffer cannot hold one element per rank). `count` is
//! `size` / element size. `algbw = size / time` in GB/s (10⁹ bytes), `busbw = algbw ×`
//! [`oxcomm::logging::bus_factor`] (2(n−1)/n all_reduce; (n−1)/n all_gather, reduce_scatter,
//! all_to_all; 1 broadcast, reduce).
//!
//! # Check (`-c 1`, the default)
//!
//! The compressed ops are lossy, so they are checked on inputs they reproduce exactly, with
//! a fresh state: for `onebit_all_reduce` every element of rank `r` is
//! `c_r = [1, −2, 4, −8][r mod 4]` (each rank's scale is then `|c_r|`, every sign is `c_r`'s, the
//! compressed mean is the exact mean, and the result must match it within 8 f32 units in the
//! last place, for the rounding of the f32 norms); for `quant_reduce_scatter` every element
//! of rank `r` is `−2^(r mod 3)` (a power of two at the bottom of the int4 range quantizes
//! exactly; the host sums are requantized with a rounded scale), and the result must match the
//! exact mean within 4 units in the last place of the dtype. Such inputs do not measure the
//! compression error; they check that every rank's contribution arrives, is scaled and is
//! placed right.
//!
//! After timing each mode, every rank fills its inputs with small integers chosen so that the
//! reduced value is exact in every dtype and independent of the reduction order (the idea of
//! nccl-tests' `verifiable`), fills outputs with a sentinel, runs the op once, and counts the
//! elements that differ from the value computed here; `#wrong` is the sum over ranks. Only
//! `avg` on floats is compared with a tolerance (2 units in the last place of the dtype), since
//! the division rounds. For a reduce only the root's output is checked.
//!
//! # Output
//!
//! Lines starting with `#` are headers and notes; every other line is one size. The report
//! ends with `# Out of bounds values : N OK` (or `FAILED`, and exit status 1), and
//! `# Avg bus bandwidth : X`, the mean busbw of all measurements (both modes, all ops), as in
//! nccl-tests.
//!
//! `--json FILE` writes one JSON object per line per (op, size, mode) with the fields `op`,
//! `dtype`, `redop` (`null` for ops that do not reduce), `root` (`null` unless rooted),
//! `world_size`, `transport`, `algorithm` (`auto` unless forced), `size_bytes`, `count`,
//! `in_place`, `emulated`, `iters`, `warmup_iters`, `time_us`, `median_us`, `algbw_gbps`,
//! `busbw_gbps`, `wrong` (`null` when not checked), `wire_bytes`. `--csv FILE` writes the same
//! columns with a header row.
//!
//! `--plot FILE.svg` or `FILE.png` draws busbw and latency against size for every op and mode
//! after the run; `--compare A.json B.json … --plot FILE` draws the rows of earlier `--json`
//! files instead of running anything (see [`crate::plot`]).

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use oxcomm::compression::coalesced::{self, HostGroups, TensorView};
use oxcomm::compression::onebit::{self, OneBitState};
use oxcomm::{Algorithm, CommConfig, Communicator, DType, Element, OpOptions, ReduceOp};
use serde::{Deserialize, Serialize};

// ---------------------------------------------------------------------------------------------
// Flags
// ---------------------------------------------------------------------------------------------

/// Flags of `oxcomm bench`. The short flags and defaults follow nccl-tests where it has the
/// flag (except `-w`, 5 here, and `-b`/`-e`, 8 B to 64 MiB here).
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Smallest message size in bytes; suffixes K, M, G, T are powers of 1024 (8, 1K, 64M).
    #[arg(short = 'b', long = "minbytes", value_name = "BYTES", default_value = "8", value_parser = parse_size)]
    pub minbytes: u64,

    /// Largest message size in bytes (same suffixes as --minbytes).
    #[arg(short = 'e', long = "maxbytes", value_name = "BYTES", default_value = "64M", value_parser = parse_size)]
    pub maxbytes: u64,

    /// Multiply the size by this factor from one line to the next (at least 2).
    #[arg(short = 'f', long = "stepfactor", value_name = "F", default_value_t = 2)]
    pub stepfactor: u64,

    /// Timed iterations per size and mode (at least 1).
    #[arg(short = 'n', long = "iters", value_name = "N", default_value_t = 20)]
    pub iters: usize,

    /// Untimed warm-up iterations before the timed ones, per size and mode.
    #[arg(short = 'w', long = "warmup_iters", visible_alias = "warmup-iters", value_name = "N", default_value_t = 5)]
    pub warmup_iters: usize,

    /// 1: check every op's result with exact values and count wrong elements; 0: do not.
    #[arg(short = 'c', long = "check", value_name = "0|1", default_value = "1", value_parser = parse_bool01, action = clap::ArgAction::Set)]
    pub check: bool,

    /// Ops to time, comma-separated: all_reduce, all_gather, reduce_scatter, broadcast,
    /// reduce, all_to_all, onebit_all_reduce (f32 only), quant_reduce_scatter (f32, f16,
    /// bf16), or `all` (every op that takes the dtype).
    #[arg(long = "op", value_name = "OPS", default_value = "all_reduce")]
    pub op: String,

    /// Element type: f32, f64, f16, bf16, i8, u8, i32, i64 (also float, half, ...).
    #[arg(short = 'd', long = "dtype", value_name = "TYPE", default_value = "f32", value_parser = parse_dtype)]
    pub dtype: DType,

    /// Reduction operator of the reducing ops: sum, avg, prod, min, max, band, bor, bxor.
    #[arg(short = 'o', long = "redop", value_name = "OP", default_value = "sum", value_parser = parse_redop)]
    pub redop: ReduceOp,

    /// Root rank of broadcast and reduce.
    #[arg(short = 'r', long = "root", value_name = "RANK", default_value_t = 0)]
    pub root: usize,

    /// Number of ranks (default: the number of cores, at least 2).
    #[arg(long = "world-size", visible_alias = "world_size", value_name = "N")]
    pub world_size: Option<usize>,

    /// How ranks talk: shm (processes on this host over shared memory), threads (ranks are
    /// threads of this process) or tcp (processes joined by TCP links on loopback).
    #[arg(long = "transport", value_name = "NAME", default_value = "shm", value_parser = parse_transport)]
    pub transport: Transport,

    /// Force an algorithm where it applies: ring, rd, star, tree, pairwise (default: chosen by
    /// size). With --op all, ops it does not apply to keep their default; naming such an op
    /// explicitly is an error.
    #[arg(long = "algorithm", value_name = "NAME", value_parser = parse_algorithm)]
    pub algorithm: Option<Algorithm>,

    /// Also write one JSON object per (op, size, mode) to FILE (JSON Lines).
    #[arg(long = "json", value_name = "FILE")]
    pub json: Option<PathBuf>,

    /// Also write the rows as CSV (with a header) to FILE.
    #[arg(long = "csv", value_name = "FILE")]
    pub csv: Option<PathBuf>,

    /// Draw busbw and latency against size for every op and mode to FILE (.svg or .png).
    #[arg(long = "plot", value_name = "FILE")]
    pub plot: Option<PathBuf>,

    /// Run nothing: draw the rows of these --json files (one line per file, op and mode) to
    /// the --plot file.
    #[arg(long = "compare", value_name = "JSON", num_args = 1.., requires = "plot")]
    pub compare: Vec<PathBuf>,

    /// quant_reduce_scatter: ranks per host (hosts are runs of K ranks; K must divide the
    /// world size). Default: the job's hosts when it spans several with several ranks each,
    /// else every rank on one host.
    #[arg(long = "ranks-per-host", value_name = "K")]
    pub ranks_per_host: Option<usize>,

    /// No progress bar (it is also hidden when stderr is not a terminal).
    #[arg(short = 'q', long = "quiet")]
    pub quiet: bool,

    /// Run as one rank of a job started by a launcher (oxcomm::init() from the environment).
    #[arg(long = "worker", hide = true)]
    pub worker: bool,

    /// Worker rank 0 sends its lines to this abstract Unix socket instead of printing them.
    #[arg(long = "report-to", hide = true, value_name = "NAME", requires = "worker")]
    pub report_to: Option<String>,
}

/// Parses a byte count: digits, then an optional K, M, G or T (powers of 1024), optionally
/// followed by `B` or `iB`, any case (`8`, `1K`, `64M`, `2GiB`).
pub fn parse_size(raw: &str) -> Result<u64, String> {
    let s = raw.trim();
    let bad = || format!("{raw:?} is not a size (examples: 8, 1K, 64M, 1G)");
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    if digits == 0 {
        return Err(bad());
    }
    let value: u64 = s[..digits].parse().map_err(|_| bad())?;
    let shift = match s[digits..].to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(bad()),
    };
    value.checked_mul(1u64 << shift).ok_or_else(|| format!("{raw:?} is too large"))
}

fn parse_bool01(raw: &str) -> Result<bool, String> {
    match raw.trim() {
        "0" => Ok(false),
        "1" => Ok(true),
        _ => Err(format!("{raw:?} is not 0 or 1")),
    }
}

fn parse_dtype(raw: &str) -> Result<DType, String> {
    DType::parse(raw.trim()).ok_or_else(|| {
        let names: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
        format!("unknown dtype {raw:?} (one of: {})", names.join(", "))
    })
}

fn parse_redop(raw: &str) -> Result<ReduceOp, String> {
    ReduceOp::parse(raw.trim()).ok_or_else(|| {
        let names: Vec<&str> = ReduceOp::ALL.iter().map(|o| o.name()).collect();
        format!("unknown reduce op {raw:?} (one of: {})", names.join(", "))
    })
}

fn parse_algorithm(raw: &str) -> Result<Algorithm, String> {
    Algorithm::parse(raw.trim()).ok_or_else(|| {
        let names: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
        format!("unknown algorithm {raw:?} (one of: {})", names.join(", "))
    })
}

fn parse_transport(raw: &str) -> Result<Transport, String> {
    match raw.trim().to_ascii_lowercase().as_str() {
        "shm" => Ok(Transport::Shm),
        "threads" => Ok(Transport::Threads),
        "tcp" => Ok(Transport::Tcp),
        _ => Err(format!("unknown transport {raw:?} (one of: shm, threads, tcp)")),
    }
}

/// How the bench's ranks talk to each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Processes on this host over shared memory.
    Shm,
    /// Threads of this process.
    Threads,
    /// Processes over TCP links (on loopback).
    Tcp,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Shm => "shm",
            Transport::Threads => "threads",
            Transport::Tcp => "tcp",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The ops
// ---------------------------------------------------------------------------------------------

/// A collective the bench can time: a name, a buffer [`Layout`], how to run each mode, and
/// how to check it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BenchOp {
    /// `all_reduce` (in place).
    AllReduce,
    /// `all_gather` (separate input and output).
    AllGather,
    /// `reduce_scatter` (separate input and output).
    ReduceScatter,
    /// `broadcast` from the root (in place).
    Broadcast,
    /// `reduce` to the root (in place).
    Reduce,
    /// `all_to_all` with equal blocks (separate send and receive buffers).
    AllToAll,
    /// `onebit::all_reduce`, the 1-bit compressed mean (in place, f32 only).
    OnebitAllReduce,
    /// `all_to_all_quant_reduce`, the int4 quantized reduce-scatter of the mean (returns a
    /// new vector).
    QuantReduceScatter,
}

impl BenchOp {
    /// Every op, in the order `--op all` runs them.
    pub const ALL: [BenchOp; 8] = [
        BenchOp::AllReduce,
        BenchOp::AllGather,
        BenchOp::ReduceScatter,
        BenchOp::Broadcast,
        BenchOp::Reduce,
        BenchOp::AllToAll,
        BenchOp::OnebitAllReduce,
        BenchOp::QuantReduceScatter,
    ];

    /// The op's name (also its name for [`oxcomm::logging::bus_factor`]).
    pub fn name(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "all_reduce",
            BenchOp::AllGather => "all_gather",
            BenchOp::ReduceScatter => "reduce_scatter",
            BenchOp::Broadcast => "broadcast",
            BenchOp::Reduce => "reduce",
            BenchOp::AllToAll => "all_to_all",
            BenchOp::OnebitAllReduce => "onebit_all_reduce",
            BenchOp::QuantReduceScatter => "quant_reduce_scatter",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<BenchOp> {
        let s = s.trim().to_ascii_lowercase().replace('-', "_");
        BenchOp::ALL.into_iter().find(|o| o.name() == s || o.name().replace('_', "") == s)
    }

    /// Whether the op applies the `--redop` reduction operator.
    pub(crate) fn reduces(self) -> bool {
        matches!(self, BenchOp::AllReduce | BenchOp::ReduceScatter | BenchOp::Reduce)
    }

    /// Whether the op computes the mean whatever `--redop` says (the compressed ops).
    pub(crate) fn averages(self) -> bool {
        matches!(self, BenchOp::OnebitAllReduce | BenchOp::QuantReduceScatter)
    }

    /// The reduction the op applies, for the table and the files: `--redop`, `avg` for the
    /// compressed ops, `None` for ops that only move data.
    fn redop_name(self, redop: ReduceOp) -> Option<&'static str> {
        if self.reduces() {
            Some(redop.name())
        } else if self.averages() {
            Some(ReduceOp::Avg.name())
        } else {
            None
        }
    }

    /// Whether the op has a root.
    fn rooted(self) -> bool {
        matches!(self, BenchOp::Broadcast | BenchOp::Reduce)
    }

    /// Whether the API lacks the mode (`in_place` or not), which is then emulated with a copy.
    fn emulated(self, in_place: bool) -> bool {
        match self {
            BenchOp::AllReduce => false,
            BenchOp::Broadcast | BenchOp::Reduce | BenchOp::OnebitAllReduce => !in_place,
            _ => in_place,
        }
    }

    /// Why the op cannot run on `dtype`, if it cannot.
    fn rejects(self, dtype: DType) -> Option<&'static str> {
        match self {
            BenchOp::OnebitAllReduce if dtype != DType::F32 => Some("onebit_all_reduce takes f32 only"),
            BenchOp::QuantReduceScatter if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) => {
                Some("quant_reduce_scatter takes f32, f16 and bf16 only")
            }
            _ => None,
        }
    }

    /// The algorithms `--algorithm` may force on the op (none for the compressed ops, which
    /// are built from several collectives).
    pub(crate) fn algorithms(self) -> &'static [Algorithm] {
        use oxcomm::wire::OpKind;
        let kind = match self {
            BenchOp::AllReduce => OpKind::AllReduce,
            BenchOp::AllGather => OpKind::AllGather,
            BenchOp::ReduceScatter => OpKind::ReduceScatter,
            BenchOp::Broadcast => OpKind::Broadcast,
            BenchOp::Reduce => OpKind::Reduce,
            BenchOp::AllToAll => OpKind::AllToAll,
            BenchOp::OnebitAllReduce | BenchOp::QuantReduceScatter => return &[],
        };
        oxcomm::algorithms::plan::candidates(kind)
    }

    /// How the emulated mode works, for the block header.
    fn emulation_note(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "out-of-place = all_reduce_into(input, output), in-place = all_reduce(buffer)",
            BenchOp::Reduce => {
                "out-of-place = copy input to output, then the in-place op on the output (the API is in-place)"
            }
            BenchOp::Broadcast => {
                "out-of-place = root copies input to output, then broadcast of the output (the API is in-place)"
            }
            BenchOp::AllGather => {
                "in-place = copy this rank's block of the output to a scratch input, then all_gather (the API takes two buffers)"
            }
            BenchOp::ReduceScatter => {
                "in-place = reduce_scatter to a scratch output, then copy it to this rank's block of the input (the API takes two buffers)"
            }
            BenchOp::AllToAll => {
                "in-place = copy the buffer to a scratch send buffer, then all_to_all back into it (the API takes two buffers)"
            }
            BenchOp::OnebitAllReduce => {
                "f32 mean, 1-bit compressed, state kept across iterations; out-of-place = copy input to output, then the op; bandwidth on the uncompressed bytes"
            }
            BenchOp::QuantReduceScatter => {
                "mean, int4 quantized (qgZ); the result is a new vector, copied to the output (out-of-place) or to this rank's block of the input (in-place); bandwidth on the uncompressed bytes"
            }
        }
    }

    /// The buffers of one line for a requested `size` in bytes, `n` ranks and `elem` bytes
    /// per element (nccl-tests' conventions; see the module docs).
    pub(crate) fn layout(self, size: u64, n: usize, elem: usize) -> Layout {
        let total = (size / elem as u64) as usize;
        let n = n.max(1);
        match self {
            BenchOp::AllReduce | BenchOp::Broadcast | BenchOp::Reduce => {
                Layout { input: total, output: total, block: total }
            }
            BenchOp::AllGather => {
                let block = total / n;
                Layout { input: block, output: block * n, block }
            }
            BenchOp::ReduceScatter => {
                let block = total / n;
                Layout { input: block * n, output: block, block }
            }
            BenchOp::AllToAll => {
                let block = total / n;
                Layout { input: block * n, output: block * n, block }
            }
            BenchOp::OnebitAllReduce => {
                let grain = onebit::padded_len(1, n).unwrap_or(8 * n).max(1);
                let len = total / grain * grain;
                Layout { input: len, output: len, block: len }
            }
            BenchOp::QuantReduceScatter => {
                let block = match qgz_group(total / n / 2 * 2, n) {
                    Some(_) => total / n / 2 * 2,
                    None => 0,
                };
                Layout { input: block * n, output: block, block }
            }
        }
    }
}

/// Largest int4 group (elements per scale) the quant_reduce_scatter bench uses.
const QGZ_MAX_GROUP: usize = 2048;

/// The group size `E` of a quant_reduce_scatter tensor of `p` elements per rank on `n` ranks
/// (shape `[n·p / E, E]`): the largest power of two dividing `p`, at most [`QGZ_MAX_GROUP`]
/// and with `E² ≤ n·p`; `None` when no even `E` fits (the line is then empty).
fn qgz_group(p: usize, n: usize) -> Option<usize> {
    if p == 0 || p % 2 != 0 {
        return None;
    }
    let total = p.checked_mul(n)?;
    let mut e = (1usize << p.trailing_zeros()).min(QGZ_MAX_GROUP);
    while e >= 2 && e.saturating_mul(e) > total {
        e /= 2;
    }
    (e >= 2).then_some(e)
}

/// Element counts of one line's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Elements of this rank's input (send) buffer.
    pub(crate) input: usize,
    /// Elements of this rank's output (receive) buffer.
    pub(crate) output: usize,
    /// Elements per rank where the op splits its buffer by rank; else the whole buffer.
    pub(crate) block: usize,
}

impl Layout {
    /// Elements of the op's full buffer as nccl-tests counts it (the table's `count`).
    pub(crate) fn full(&self) -> usize {
        self.input.max(self.output)
    }
}

// ---------------------------------------------------------------------------------------------
// Plan: what the flags mean
// ---------------------------------------------------------------------------------------------

/// Largest world size the bench accepts.
const MAX_WORLD: usize = 1024;

/// Everything the bench needs, checked.
#[derive(Debug, Clone)]
struct Plan {
    ops: Vec<BenchOp>,
    /// `--op all` was given (a forced algorithm then applies only where it fits).
    all_ops: bool,
    /// Ops `--op all` left out because they do not take the dtype, and why.
    skipped: Vec<(BenchOp, &'static str)>,
    /// quant_reduce_scatter's `--ranks-per-host` (`None`: one host).
    ranks_per_host: Option<usize>,
    /// `--plot`.
    plot: Option<PathBuf>,
    dtype: DType,
    redop: ReduceOp,
    root: usize,
    sizes: Vec<u64>,
    min_bytes: u64,
    max_bytes: u64,
    step: u64,
    iters: usize,
    warmup: usize,
    check: bool,
    /// `None` only for a worker started without --world-size (the job decides).
    world: Option<usize>,
    transport: Transport,
    algorithm: Option<Algorithm>,
    json: Option<PathBuf>,
    csv: Option<PathBuf>,
    quiet: bool,
    worker: bool,
    report_to: Option<String>,
}

impl Plan {
    fn new(args: &BenchArgs) -> anyhow::Result<Plan> {
        let (mut ops, all_ops) = parse_ops(&args.op)?;
        let mut skipped = Vec::new();
        if all_ops {
            ops.retain(|o| match o.rejects(args.dtype) {
                Some(why) => {
                    skipped.push((*o, why));
                    false
                }
                None => true,
            });
        } else if let Some(why) = ops.iter().find_map(|o| o.rejects(args.dtype)) {
            bail!("--dtype {}: {why}", args.dtype);
        }
        if let Some(p) = &args.plot {
            crate::plot::Format::of(p)?;
        }
        if args.minbytes == 0 {
            bail!("-b/--minbytes must be at least 1");
        }
        if args.minbytes > args.maxbytes {
            bail!("-b/--minbytes {} is larger than -e/--maxbytes {}", args.minbytes, args.maxbytes);
        }
        if args.stepfactor < 2 {
            bail!("-f/--stepfactor must be at least 2");
        }
        if args.iters == 0 {
            bail!("-n/--iters must be at least 1");
        }
        let elem = args.dtype.size() as u64;
        if args.maxbytes < elem {
            bail!("-e/--maxbytes {} is smaller than one {} element ({elem} bytes)", args.maxbytes, args.dtype);
        }
        if args.maxbytes > isize::MAX as u64 / 4 {
            bail!("-e/--maxbytes {} is too large", args.maxbytes);
        }
        let mut sizes = Vec::new();
        let mut size = args.minbytes;
        while size <= args.maxbytes {
            sizes.push(size);
            match size.checked_mul(args.stepfactor) {
                Some(s) => size = s,
                None => break,
            }
        }
        if ops.iter().any(|o| o.reduces()) && !args.redop.fits(args.dtype) {
            bail!("--redop {} does not apply to --dtype {} (bitwise ops need an integer type)", args.redop, args.dtype);
        }
        if let Some(a) = args.algorithm {
            let fits = |o: &BenchOp| o.algorithms().contains(&a);
            if all_ops {
                if !ops.iter().any(fits) {
                    bail!("--algorithm {a} applies to none of the ops");
                }
            } else if let Some(o) = ops.iter().find(|o| !fits(o)) {
                let names: Vec<&str> = o.algorithms().iter().map(|a| a.name()).collect();
                if names.is_empty() {
                    bail!("--algorithm {a} does not apply to {} (it is built from several collectives)", o.name());
                }
                bail!("--algorithm {a} does not apply to {} (it runs with: {})", o.name(), names.join(", "));
            }
        }
        let world = match (args.world_size, args.worker) {
            (Some(0), _) => bail!("--world-size must be at least 1"),
            (Some(n), _) if n > MAX_WORLD => bail!("--world-size {n} is more than {MAX_WORLD}"),
            (Some(n), _) => Some(n),
            (None, true) => None,
            (None, false) => Some(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).max(2)),
        };
        if let Some(n) = world {
            if ops.iter().any(|o| o.rooted()) && args.root >= n {
                bail!("-r/--root {} is not below the world size {n}", args.root);
            }
        }
        if let Some(k) = args.ranks_per_host {
            check_ranks_per_host(k, world)?;
        }
        Ok(Plan {
            ops,
            all_ops,
            skipped,
            ranks_per_host: args.ranks_per_host,
            plot: args.plot.clone(),
            dtype: args.dtype,
            redop: args.redop,
            root: args.root,
            sizes,
            min_bytes: args.minbytes,
            max_bytes: args.maxbytes,
            step: args.stepfactor,
            iters: args.iters,
            warmup: args.warmup_iters,
            check: args.check,
            world,
            transport: args.transport,
            algorithm: args.algorithm,
            json: args.json.clone(),
            csv: args.csv.clone(),
            quiet: args.quiet,
            worker: args.worker,
            report_to: args.report_to.clone(),
        })
    }

    /// The algorithm forced on `op`, if any.
    fn algorithm_for(&self, op: BenchOp) -> Option<Algorithm> {
        self.algorithm.filter(|a| op.algorithms().contains(a))
    }

    /// The flags a worker gets to rebuild this plan (everything that changes what is run).
    fn worker_args(&self, world: usize, report_to: &str) -> Vec<String> {
        let ops = if self.all_ops {
            "all".to_string()
        } else {
            self.ops.iter().map(|o| o.name()).collect::<Vec<_>>().join(",")
        };
        let mut a: Vec<String> = vec![
            "bench".into(),
            "--worker".into(),
            "--report-to".into(),
            report_to.into(),
            "--world-size".into(),
            world.to_string(),
            "--transport".into(),
            "shm".into(),
            "--op".into(),
            ops,
            "--dtype".into(),
            self.dtype.name().into(),
            "--redop".into(),
            self.redop.name().into(),
            "--root".into(),
            self.root.to_string(),
            "-b".into(),
            self.min_bytes.to_string(),
            "-e".into(),
            self.max_bytes.to_string(),
            "-f".into(),
            self.step.to_string(),
            "-n".into(),
            self.iters.to_string(),
            "-w".into(),
            self.warmup.to_string(),
            "-c".into(),
            if self.check { "1" } else { "0" }.into(),
            "--quiet".into(),
        ];
        if let Some(alg) = self.algorithm {
            a.push("--algorithm".into());
            a.push(alg.name().into());
        }
        if let Some(k) = self.ranks_per_host {
            a.push("--ranks-per-host".into());
            a.push(k.to_string());
        }
        a
    }

    /// Bytes of buffers one rank allocates: three buffers of the largest size.
    fn bytes_per_rank(&self) -> u64 {
        3 * self.max_bytes
    }
}

/// `--ranks-per-host K` must be positive and divide the world size (when it is known).
fn check_ranks_per_host(k: usize, world: Option<usize>) -> anyhow::Result<()> {
    if k == 0 {
        bail!("--ranks-per-host must be at least 1");
    }
    if let Some(n) = world {
        if n % k != 0 {
            bail!("--ranks-per-host {k} does not divide the world size {n}");
        }
    }
    Ok(())
}

/// `--op` as a list of ops; `all` means every op.
fn parse_ops(raw: &str) -> anyhow::Result<(Vec<BenchOp>, bool)> {
    if raw.trim().eq_ignore_ascii_case("all") {
        return Ok((BenchOp::ALL.to_vec(), true));
    }
    let mut ops = Vec::new();
    for part in raw.split(',') {
        let op = BenchOp::parse(part).ok_or_else(|| {
            let names: Vec<&str> = BenchOp::ALL.iter().map(|o| o.name()).collect();
            anyhow!("--op: unknown op {:?} (one of: {}, or all)", part.trim(), names.join(", "))
        })?;
        if !ops.contains(&op) {
            ops.push(op);
        }
    }
    Ok((ops, false))
}

// ---------------------------------------------------------------------------------------------
// Entry point
// ---------------------------------------------------------------------------------------------

/// Runs `oxcomm bench`: returns the exit status (0, or the launcher's status when a rank
/// failed); an error when the flags are wrong, a rank fails in-process, or a value was wrong.
pub fn run(args: BenchArgs) -> anyhow::Result<i32> {
    if !args.compare.is_empty() {
        let out = args.plot.as_ref().ok_or_else(|| anyhow!("--compare needs --plot FILE"))?;
        crate::plot::compare(&args.compare, out)?;
        return Ok(0);
    }
    let plan = Plan::new(&args)?;
    if plan.worker {
        return run_worker(&plan);
    }
    let world = plan.world.expect("the front end always knows the world size");
    check_memory(&plan, world)?;
    match plan.transport {
        Transport::Threads => run_threads(&plan, world),
        Transport::Shm => run_shm(&plan, world),
        Transport::Tcp => {
            // The worker ranks inherit this and build TCP links on loopback.
            std::env::set_var("OXCOMM_TRANSPORT", "tcp");
            run_shm(&plan, world)
        }
    }
}

/// Refuses a run whose buffers cannot fit in this host's available memory (instead of being
/// killed by the OOM killer half-way).
fn check_memory(plan: &Plan, world: usize) -> anyhow::Result<()> {
    let need = plan.bytes_per_rank().saturating_mul(world as u64);
    if let Some(avail) = mem_available() {
        if need > avail {
            bail!(
                "the buffers need {} (3 × {} per rank × {world} ranks) but only {} of memory is available; lower -e/--maxbytes or --world-size",
                human(need),
                human(plan.max_bytes),
                human(avail)
            );
        }
    }
    Ok(())
}

/// `MemAvailable` from /proc/meminfo, in bytes.
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// What rank 0 does with each finished line.
type Sink<'a> = &'a (dyn Fn(&Line) -> anyhow::Result<()> + Sync);

fn run_threads(plan: &Plan, world: usize) -> anyhow::Result<i32> {
    let report = Mutex::new(Report::create(plan, world, plan.transport.name(), true)?);
    let sink = |line: &Line| report.lock().unwrap_or_else(|e| e.into_inner()).line(line);
    let results = oxcomm::threads::run_with(world, CommConfig::default(), |comm| {
        rank_main(&comm, plan, if comm.rank() == 0 { Some(&sink) } else { None })
    })?;
    let report = report.into_inner().unwrap_or_else(|e| e.into_inner());
    if let Some(err) = results.into_iter().find_map(|r| r.err()) {
        report.abandon();
        return Err(err);
    }
    report.finish()
}

#[cfg(target_os = "linux")]
fn run_shm(plan: &Plan, world: usize) -> anyhow::Result<i32> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    let report = Report::create(plan, world, plan.transport.name(), true)?;
    let (socket, name) = channel::bind()?;
    let stop = Arc::new(AtomicBool::new(false));
    let receiver = {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("oxcomm-bench-report".into())
            .spawn(move || channel::receive(socket, report, &stop))
            .context("cannot start the report thread")?
    };
    let launched = crate::launch::launch_self(world, plan.worker_args(world, &name), false);
    stop.store(true, Ordering::SeqCst);
    let received = receiver.join().map_err(|_| anyhow!("the report thread panicked"))?;
    let code = launched?;
    let report = received?;
    if code != 0 {
        report.abandon();
        return Ok(code);
    }
    report.finish()
}

#[cfg(not(target_os = "linux"))]
fn run_shm(_plan: &Plan, _world: usize) -> anyhow::Result<i32> {
    bail!("--transport shm needs Linux; use --transport threads")
}

#[cfg(target_os = "linux")]
fn run_worker(plan: &Plan) -> anyhow::Result<i32> {
    let comm = oxcomm::init().context("cannot join the job")?;
    if let Some(n) = plan.world {
        if n != comm.size() {
            bail!("--world-size {n} but the job has {} ranks", comm.size());
        }
    }
    if plan.ops.iter().any(|o| o.rooted()) && plan.root >= comm.size() {
        bail!("-r/--root {} is not below the world size {}", plan.root, comm.size());
    }
    if let Some(k) = plan.ranks_per_host {
        check_ranks_per_host(k, Some(comm.size()))?;
    }
    if comm.rank() != 0 {
        rank_main(&comm, plan, None)?;
        return Ok(0);
    }
    match &plan.report_to {
        Some(name) => {
            let tx = channel::Sender::connect(name)?;
            rank_main(&comm, plan, Some(&|line: &Line| tx.send(line)))?;
            Ok(0)
        }
        None => {
            let report = Mutex::new(Report::create(plan, comm.size(), comm.transport(), !plan.quiet)?);
            let sink = |line: &Line| report.lock().unwrap_or_else(|e| e.into_inner()).line(line);
            let result = rank_main(&comm, plan, Some(&sink));
            let report = report.into_inner().unwrap_or_else(|e| e.into_inner());
            match result {
                Ok(()) => report.finish(),
                Err(e) => {
                    report.abandon();
                    Err(e)
                }
            }
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn run_worker(_plan: &Plan) -> anyhow::Result<i32> {
    bail!("--worker needs Linux (oxcomm::init)")
}

// ---------------------------------------------------------------------------------------------
// Rank 0 → front end: one datagram per line
// ---------------------------------------------------------------------------------------------

/// The channel from worker rank 0 to the front end: a Unix datagram socket with an abstract
/// name (nothing on the file system to clean up), one JSON-encoded [`Line`] per datagram.
#[cfg(target_os = "linux")]
mod channel {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use anyhow::Context;

    use super::{Line, Report};

    /// How often the receiver looks at the stop flag when nothing arrives.
    const POLL: Duration = Duration::from_millis(100);
    /// Largest datagram accepted (a line is a few hundred bytes).
    const MAX_DATAGRAM: usize = 64 << 10;

    /// Binds a fresh abstract socket; returns it and its name.
    pub(super) fn bind() -> anyhow::Result<(UnixDatagram, String)> {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        let name = format!("oxcomm-bench-{}-{nanos:x}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).context("abstract socket name")?;
        let socket = UnixDatagram::bind_addr(&addr).context("cannot bind the report socket")?;
        socket.set_read_timeout(Some(POLL)).context("report socket timeout")?;
        Ok((socket, name))
    }

    /// Feeds every line that arrives to `report` until `stop` is set and nothing is left.
    pub(super) fn receive(socket: UnixDatagram, mut report: Report, stop: &AtomicBool) -> anyhow::Result<Report> {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        loop {
            match socket.recv(&mut buf) {
                Ok(n) => {
                    let line: Line = serde_json::from_slice(&buf[..n]).context("a malformed line from rank 0")?;
                    report.line(&line)?;
                }
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    // The flag is set after every rank exited, so every datagram they sent is
                    // already queued: an empty queue then means done.
                    if stop.load(Ordering::SeqCst) {
                        return Ok(report);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e).context("reading the report socket"),
            }
        }
    }

    /// Rank 0's end.
    pub(super) struct Sender {
        socket: UnixDatagram,
    }

    impl Sender {
        pub(super) fn connect(name: &str) -> anyhow::Result<Sender> {
            let addr = SocketAddr::from_abstract_name(name.as_bytes()).context("abstract socket name")?;
            let socket = UnixDatagram::unbound().context("report socket")?;
            socket.connect_addr(&addr).with_context(|| format!("cannot reach the bench front end at @{name}"))?;
            Ok(Sender { socket })
        }

        pub(super) fn send(&self, line: &Line) -> anyhow::Result<()> {
            let bytes = serde_json::to_vec(line)?;
            self.socket.send(&bytes).context("sending a line to the bench front end")?;
            Ok(())
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The report: table, progress bar, JSON, CSV
// ---------------------------------------------------------------------------------------------

/// One table line: one op and size, both modes. What rank 0 sends to the front end.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Line {
    op: BenchOp,
    size_bytes: u64,
    count: u64,
    out_of_place: Measured,
    in_place: Measured,
}

/// One mode of one line.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Measured {
    /// Mean time per op (max over ranks), µs.
    time_us: f64,
    /// Median time per op (max over ranks), µs.
    median_us: f64,
    /// Wrong elements summed over ranks; `None` when not checked.
    wrong: Option<u64>,
    /// Bytes one rank handed to its links per op (timed iterations), max over ranks.
    wire_bytes: u64,
}

/// One row of the JSON and CSV outputs.
#[derive(Debug, Serialize)]
struct Row<'a> {
    op: &'a str,
    dtype: &'a str,
    redop: Option<&'a str>,
    root: Option<usize>,
    world_size: usize,
    transport: &'a str,
    algorithm: &'a str,
    size_bytes: u64,
    count: u64,
    in_place: bool,
    emulated: bool,
    iters: usize,
    warmup_iters: usize,
    time_us: f64,
    median_us: f64,
    algbw_gbps: f64,
    busbw_gbps: f64,
    wrong: Option<u64>,
    wire_bytes: u64,
}

const CSV_HEADER: &str = "op,dtype,redop,root,world_size,transport,algorithm,size_bytes,count,in_place,emulated,\
                          iters,warmup_iters,time_us,median_us,algbw_gbps,busbw_gbps,wrong,wire_bytes";

impl Row<'_> {
    fn csv(&self) -> String {
        let opt = |v: Option<String>| v.unwrap_or_default();
        format!(
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{:.3},{:.3},{:.6},{:.6},{},{}",
            self.op,
            self.dtype,
            opt(self.redop.map(str::to_string)),
            opt(self.root.map(|r| r.to_string())),
            self.world_size,
            self.transport,
            self.algorithm,
            self.size_bytes,
            self.count,
            self.in_place,
            self.emulated,
            self.iters,
            self.warmup_iters,
            self.time_us,
            self.median_us,
            self.algbw_gbps,
            self.busbw_gbps,
            opt(self.wrong.map(|w| w.to_string())),
            self.wire_bytes,
        )
    }
}

/// Prints the table and writes the files as lines arrive.
struct Report {
    plan: Plan,
    world: usize,
    transport: String,
    bar: ProgressBar,
    json: Option<BufWriter<File>>,
    csv: Option<BufWriter<File>>,
    current_op: Option<BenchOp>,
    busbw_sum: f64,
    busbw_count: usize,
    wrong: u64,
    unchecked: bool,
    /// Table lines printed so far.
    lines_done: usize,
    /// What `--plot` draws, one point per row.
    points: Vec<crate::plot::Point>,
}

impl Report {
    /// Opens the output files and prints the header. `progress`: whether a bar may be drawn
    /// (still hidden with --quiet or when stderr is not a terminal).
    fn create(plan: &Plan, world: usize, transport: &str, progress: bool) -> anyhow::Result<Report> {
        let open = |p: &PathBuf| -> anyhow::Result<BufWriter<File>> {
            Ok(BufWriter::new(File::create(p).with_context(|| format!("cannot create {}", p.display()))?))
        };
        let json = plan.json.as_ref().map(open).transpose()?;
        let mut csv = plan.csv.as_ref().map(open).transpose()?;
        if let Some(f) = csv.as_mut() {
            writeln!(f, "{CSV_HEADER}")?;
        }
        let total = (plan.ops.len() * plan.sizes.len()) as u64;
        let bar = if progress && !plan.quiet && std::io::stderr().is_terminal() {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed}]") {
                bar.set_style(style);
            }
            bar
        } else {
            ProgressBar::hidden()
        };
        let report = Report {
            plan: plan.clone(),
            world,
            transport: transport.to_string(),
            bar,
            json,
            csv,
            current_op: None,
            busbw_sum: 0.0,
            busbw_count: 0,
            wrong: 0,
            unchecked: !plan.check,
            lines_done: 0,
            points: Vec::new(),
        };
        report.print(&report.header())?;
        report.bar.set_message(report.next_label());
        Ok(report)
    }

    fn header(&self) -> String {
        let p = &self.plan;
        let mut h = String::new();
        let _ = writeln!(
            h,
            "# oxcomm bench  ranks: {}  transport: {}  dtype: {}  minBytes: {}  maxBytes: {}  step: {}(factor)  warmup iters: {}  iters: {}  validation: {}",
            self.world,
            self.transport,
            p.dtype,
            p.min_bytes,
            p.max_bytes,
            p.step,
            p.warmup,
            p.iters,
            u8::from(p.check)
        );
        let _ = writeln!(
            h,
            "# time: mean of {} back-to-back ops, max over ranks; p50: median of the per-op times, max over ranks",
            p.iters
        );
        if let Some(a) = p.algorithm {
            let skipped: Vec<&str> =
                p.ops.iter().filter(|o| p.algorithm_for(**o).is_none()).map(|o| o.name()).collect();
            if skipped.is_empty() {
                let _ = writeln!(h, "# algorithm: {a}");
            } else {
                let _ =
                    writeln!(h, "# algorithm: {a} (not applicable to {}: they use their default)", skipped.join(", "));
            }
        }
        for (op, why) in &p.skipped {
            let _ = writeln!(h, "# {} not run: {why} (--dtype {})", op.name(), p.dtype);
        }
        if let Some(k) = p.ranks_per_host.filter(|_| p.ops.contains(&BenchOp::QuantReduceScatter)) {
            let _ = writeln!(h, "# quant_reduce_scatter: {k} ranks per host, {} hosts", self.world / k.max(1));
        }
        if p.check && p.ops.iter().any(|o| o.reduces()) {
            if let Some(why) = Pattern::new(p.redop, p.dtype, self.world).unsupported() {
                let _ = writeln!(h, "# check: {why}; reducing ops are not checked");
            }
        }
        h
    }

    fn block_header(&self, op: BenchOp) -> String {
        let mut h = String::new();
        let _ = writeln!(h, "#");
        let _ = writeln!(h, "# Collective: {}  ({})", op.name(), op.emulation_note());
        let _ = writeln!(h, "#{:51}{:^35}{:^35}{:^20}", "", "out-of-place", "in-place", "median");
        let cols = |a: &str, b: &str, c: &str, d: &str, e: &str| format!("#{a:>11}  {b:>12}  {c:>8}  {d:>6}  {e:>6}");
        let block = |t: &str, a: &str, b: &str, w: &str| format!("  {t:>9}  {a:>6}  {b:>6}  {w:>6}");
        let _ = writeln!(
            h,
            "{}{}{}  {:>9} {:>9}  {:>11}",
            cols("size", "count", "type", "redop", "root"),
            block("time", "algbw", "busbw", "#wrong"),
            block("time", "algbw", "busbw", "#wrong"),
            "oop_p50",
            "ip_p50",
            "wire"
        );
        let _ = writeln!(
            h,
            "{}{}{}  {:>9} {:>9}  {:>11}",
            cols("(B)", "(elements)", "", "", ""),
            block("(us)", "(GB/s)", "(GB/s)", ""),
            block("(us)", "(GB/s)", "(GB/s)", ""),
            "(us)",
            "(us)",
            "(B)"
        );
        h
    }

    fn print(&self, text: &str) -> anyhow::Result<()> {
        let mut result = Ok(());
        self.bar.suspend(|| {
            let mut out = std::io::stdout().lock();
            result = out.write_all(text.as_bytes()).and_then(|_| out.flush());
        });
        result.context("writing to stdout")
    }

    fn line(&mut self, line: &Line) -> anyhow::Result<()> {
        if self.current_op != Some(line.op) {
            self.current_op = Some(line.op);
            self.print(&self.block_header(line.op))?;
        }
        let p = &self.plan;
        let n = self.world;
        let factor = oxcomm::logging::bus_factor(line.op.name(), n);
        let bw = |m: &Measured| {
            let algbw = if m.time_us > 0.0 { line.size_bytes as f64 / m.time_us / 1e3 } else { 0.0 };
            (algbw, algbw * factor)
        };
        let redop = line.op.redop_name(p.redop).unwrap_or("none");
        let root = if line.op.rooted() { p.root as i64 } else { -1 };
        let mut text =
            format!("{:>12}  {:>12}  {:>8}  {:>6}  {:>6}", line.size_bytes, line.count, p.dtype.name(), redop, root);
        let algorithm = p.algorithm_for(line.op).map(|a| a.name()).unwrap_or("auto");
        for (m, in_place) in [(&line.out_of_place, false), (&line.in_place, true)] {
            let (algbw, busbw) = bw(m);
            let wrong = m.wrong.map(|w| w.to_string()).unwrap_or_else(|| "N/A".into());
            let _ = write!(text, "  {:>9}  {:6.2}  {:6.2}  {:>6}", fmt_us(m.time_us), algbw, busbw, wrong);
            self.busbw_sum += busbw;
            self.busbw_count += 1;
            match m.wrong {
                Some(w) => self.wrong += w,
                None => self.unchecked = true,
            }
            let row = Row {
                op: line.op.name(),
                dtype: p.dtype.name(),
                redop: line.op.redop_name(p.redop),
                root: line.op.rooted().then_some(p.root),
                world_size: n,
                transport: &self.transport,
                algorithm,
                size_bytes: line.size_bytes,
                count: line.count,
                in_place,
                emulated: line.op.emulated(in_place),
                iters: p.iters,
                warmup_iters: p.warmup,
                time_us: m.time_us,
                median_us: m.median_us,
                algbw_gbps: algbw,
                busbw_gbps: busbw,
                wrong: m.wrong,
                wire_bytes: m.wire_bytes,
            };
            self.points.push(crate::plot::Point {
                op: line.op.name().to_string(),
                in_place,
                size_bytes: line.size_bytes,
                time_us: m.time_us,
                busbw_gbps: busbw,
                transport: self.transport.clone(),
                world_size: n,
                dtype: p.dtype.name().to_string(),
            });
            if let Some(f) = self.json.as_mut() {
                serde_json::to_writer(&mut *f, &row)?;
                writeln!(f)?;
            }
            if let Some(f) = self.csv.as_mut() {
                writeln!(f, "{}", row.csv())?;
            }
        }
        let wire = line.out_of_place.wire_bytes.max(line.in_place.wire_bytes);
        let _ = writeln!(
            text,
            "  {:>9} {:>9}  {:>11}",
            fmt_us(line.out_of_place.median_us),
            fmt_us(line.in_place.median_us),
            wire
        );
        self.print(&text)?;
        self.lines_done += 1;
        self.bar.set_message(self.next_label());
        self.bar.inc(1);
        Ok(())
    }

    /// What runs next, for the progress bar: the op and the requested size.
    fn next_label(&self) -> String {
        let sizes = &self.plan.sizes;
        let op = self.plan.ops.get(self.lines_done / sizes.len().max(1));
        match (op, sizes.get(self.lines_done % sizes.len().max(1))) {
            (Some(op), Some(size)) => format!("{} {}", op.name(), human(*size)),
            _ => String::new(),
        }
    }

    /// Prints the footer and flushes the files: exit status 0, or an error when values were
    /// wrong.
    fn finish(mut self) -> anyhow::Result<i32> {
        self.bar.finish_and_clear();
        self.flush_files()?;
        let avg = if self.busbw_count > 0 { self.busbw_sum / self.busbw_count as f64 } else { 0.0 };
        let verdict = if self.wrong > 0 {
            format!("{} FAILED", self.wrong)
        } else if !self.plan.check {
            "N/A (not checked: -c 0)".to_string()
        } else if self.unchecked {
            "0 OK (some ops not checked)".to_string()
        } else {
            "0 OK".to_string()
        };
        self.print(&format!("# Out of bounds values : {verdict}\n# Avg bus bandwidth : {avg:.6}\n#\n"))?;
        if let Some(path) = &self.plan.plot {
            let title = crate::plot::title_of(&self.points);
            crate::plot::draw(&crate::plot::series(&self.points, None), &title, path)?;
            self.print(&format!("# plot: {}\n", path.display()))?;
        }
        if self.wrong > 0 {
            bail!("{} wrong values (see the #wrong columns)", self.wrong);
        }
        Ok(0)
    }

    /// Ends a failed run: clears the bar and keeps what the files already hold.
    fn abandon(mut self) {
        self.bar.finish_and_clear();
        let _ = self.flush_files();
    }

    fn flush_files(&mut self) -> anyhow::Result<()> {
        for f in [self.json.as_mut(), self.csv.as_mut()].into_iter().flatten() {
            f.flush().context("writing the output file")?;
        }
        Ok(())
    }
}

/// A time in µs as nccl-tests prints it: 2 decimals below 100, 1 below 10000, else none.
fn fmt_us(us: f64) -> String {
    if us >= 10000.0 {
        format!("{us:.0}")
    } else if us >= 100.0 {
        format!("{us:.1}")
    } else {
        format!("{us:.2}")
    }
}

// ---------------------------------------------------------------------------------------------
// One rank
// ---------------------------------------------------------------------------------------------

/// Runs every line on this rank; rank 0 hands each finished line to `sink`.
fn rank_main(comm: &Communicator, plan: &Plan, sink: Option<Sink<'_>>) -> anyhow::Result<()> {
    match plan.dtype {
        DType::F32 => rank_typed::<f32>(comm, plan, sink),
        DType::F64 => rank_typed::<f64>(comm, plan, sink),
        DType::F16 => rank_typed::<half::f16>(comm, plan, sink),
        DType::BF16 => rank_typed::<half::bf16>(comm, plan, sink),
        DType::I8 => rank_typed::<i8>(comm, plan, sink),
        DType::U8 => rank_typed::<u8>(comm, plan, sink),
        DType::I32 => rank_typed::<i32>(comm, plan, sink),
        DType::I64 => rank_typed::<i64>(comm, plan, sink),
    }
}

/// An element type of the bench: every [`Element`], with the compressed ops where the type
/// has them.
pub(crate) trait BenchElement: Element {
    /// `all_to_all_quant_reduce` of one tensor, or `None` when the type is not quantizable.
    fn quant_reduce(
        comm: &Communicator,
        data: &[Self],
        shape: &[usize],
        groups: Option<&HostGroups>,
    ) -> Option<oxcomm::Result<Vec<Self>>>;
}

macro_rules! bench_element {
    (quant: $($q:ty),*; plain: $($p:ty),*) => {
        $(impl BenchElement for $q {
            fn quant_reduce(
                comm: &Communicator,
                data: &[Self],
                shape: &[usize],
                groups: Option<&HostGroups>,
            ) -> Option<oxcomm::Result<Vec<Self>>> {
                let run = || {
                    let view = TensorView::new(data, shape)?;
                    let mut out = coalesced::all_to_all_quant_reduce(comm, &[view], groups)?;
                    Ok(out.pop().unwrap_or_default())
                };
                Some(run())
            }
        })*
        $(impl BenchElement for $p {
            fn quant_reduce(
                _: &Communicator,
                _: &[Self],
                _: &[usize],
                _: Option<&HostGroups>,
            ) -> Option<oxcomm::Result<Vec<Self>>> {
                None
            }
        })*
    };
}

bench_element!(quant: f32, half::f16, half::bf16; plain: f64, i8, u8, i32, i64);

/// `buf` as f32, when `T` is f32.
fn as_f32<T: Element>(buf: &mut [T]) -> Option<&mut [f32]> {
    (T::DTYPE == DType::F32).then(|| bytemuck::cast_slice_mut(buf))
}

/// This rank's buffers, allocated once at the largest size, and the 1-bit state of the
/// current size.
pub(crate) struct Buffers<T> {
    pub(crate) a: Vec<T>,
    pub(crate) b: Vec<T>,
    pub(crate) scratch: Vec<T>,
    pub(crate) onebit: Option<OneBitState>,
}

impl<T: Element> Buffers<T> {
    /// Three buffers of `len` elements, every page touched.
    pub(crate) fn new(len: usize) -> anyhow::Result<Buffers<T>> {
        Ok(Buffers { a: allocate(len)?, b: allocate(len)?, scratch: allocate(len)?, onebit: None })
    }
}

fn allocate<T: Element>(len: usize) -> anyhow::Result<Vec<T>> {
    let mut v: Vec<T> = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| anyhow!("cannot allocate {} for a buffer", human((len * std::mem::size_of::<T>()) as u64)))?;
    // Touch every page now, outside any timed region.
    v.resize(len, T::from_f64(1.0));
    Ok(v)
}

fn rank_typed<T: BenchElement>(comm: &Communicator, plan: &Plan, sink: Option<Sink<'_>>) -> anyhow::Result<()> {
    let n = comm.size();
    let elem = std::mem::size_of::<T>();
    let max_elems = (plan.max_bytes / elem as u64) as usize;
    let mut bufs = Buffers::<T>::new(max_elems)?;
    let pattern = Pattern::new(plan.redop, plan.dtype, n);
    let groups = match plan.ranks_per_host {
        Some(k) if plan.ops.contains(&BenchOp::QuantReduceScatter) => {
            Some(HostGroups::uniform(comm, k).context("building the host groups of --ranks-per-host")?)
        }
        None if plan.ops.contains(&BenchOp::QuantReduceScatter) => {
            HostGroups::from_topology(comm).context("building the host groups of the job's hosts")?
        }
        _ => None,
    };
    for &op in &plan.ops {
        let opts = OpOptions { algorithm: plan.algorithm_for(op), ..OpOptions::default() };
        for &size in &plan.sizes {
            let layout = op.layout(size, n, elem);
            bufs.onebit = match op {
                BenchOp::OnebitAllReduce => Some(OneBitState::new(layout.input, n)?),
                _ => None,
            };
            let mut measure = |in_place: bool| -> anyhow::Result<Measured> {
                let case = Case {
                    comm,
                    op,
                    in_place,
                    layout,
                    redop: plan.redop,
                    root: plan.root,
                    opts: &opts,
                    groups: groups.as_ref(),
                };
                let what =
                    || format!("{} of {} B ({})", op.name(), size, if in_place { "in-place" } else { "out-of-place" });
                let timed = case.time(&mut bufs, plan.warmup, plan.iters).with_context(what)?;
                let wrong = if plan.check && (!op.reduces() || pattern.unsupported().is_none()) {
                    Some(case.check(&mut bufs, &pattern).with_context(what)?)
                } else {
                    None
                };
                Ok(Measured { time_us: timed.mean_us, median_us: timed.median_us, wrong, wire_bytes: timed.wire_bytes })
            };
            let out_of_place = measure(false)?;
            let in_place = measure(true)?;
            if let Some(sink) = sink {
                let full = layout.full() as u64;
                sink(&Line { op, size_bytes: full * elem as u64, count: full, out_of_place, in_place })?;
            }
        }
    }
    comm.barrier().context("final barrier")?;
    Ok(())
}

/// What [`Case::time`] measured, each the maximum over ranks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timed {
    /// Mean time per op, µs.
    pub(crate) mean_us: f64,
    /// Median of the per-op times, µs.
    pub(crate) median_us: f64,
    /// Bytes handed to links per op.
    pub(crate) wire_bytes: u64,
}

/// One op in one mode at one size on this rank.
pub(crate) struct Case<'a> {
    pub(crate) comm: &'a Communicator,
    pub(crate) op: BenchOp,
    pub(crate) in_place: bool,
    pub(crate) layout: Layout,
    pub(crate) redop: ReduceOp,
    pub(crate) root: usize,
    pub(crate) opts: &'a OpOptions,
    /// quant_reduce_scatter's host layout (`None`: one host).
    pub(crate) groups: Option<&'a HostGroups>,
}

impl Case<'_> {
    /// Runs the op once (with the emulation copy where the mode needs one). Inputs are in
    /// `a`; outputs in `b` (out-of-place) or `a` (in-place).
    pub(crate) fn run_once<T: BenchElement>(&self, bufs: &mut Buffers<T>) -> oxcomm::Result<()> {
        let Layout { input, output, block } = self.layout;
        let (c, me) = (self.comm, self.comm.rank());
        let Buffers { a, b, scratch, onebit } = bufs;
        let o = self.opts;
        match (self.op, self.in_place) {
            (BenchOp::AllReduce, true) => c.all_reduce_with(&mut a[..input], self.redop, o),
            (BenchOp::AllReduce, false) => c.all_reduce_into_with(&a[..input], &mut b[..input], self.redop, o),
            (BenchOp::Reduce, true) => c.reduce_with(&mut a[..input], self.root, self.redop, o),
            (BenchOp::Reduce, false) => {
                b[..input].copy_from_slice(&a[..input]);
                c.reduce_with(&mut b[..input], self.root, self.redop, o)
            }
            (BenchOp::Broadcast, true) => c.broadcast_with(&mut a[..input], self.root, o),
            (BenchOp::Broadcast, false) => {
                if me == self.root {
                    b[..input].copy_from_slice(&a[..input]);
                }
                c.broadcast_with(&mut b[..input], self.root, o)
            }
            (BenchOp::AllGather, false) => c.all_gather_with(&a[..input], &mut b[..output], o),
            (BenchOp::AllGather, true) => {
                let mine = me * block..(me + 1) * block;
                scratch[..block].copy_from_slice(&a[mine]);
                c.all_gather_with(&scratch[..block], &mut a[..output], o)
            }
            (BenchOp::ReduceScatter, false) => c.reduce_scatter_with(&a[..input], &mut b[..output], self.redop, o),
            (BenchOp::ReduceScatter, true) => {
                c.reduce_scatter_with(&a[..input], &mut scratch[..output], self.redop, o)?;
                a[me * block..(me + 1) * block].copy_from_slice(&scratch[..output]);
                Ok(())
            }
            (BenchOp::AllToAll, false) => c.all_to_all_with(&a[..input], &mut b[..output], o),
            (BenchOp::AllToAll, true) => {
                scratch[..input].copy_from_slice(&a[..input]);
                c.all_to_all_with(&scratch[..input], &mut a[..output], o)
            }
            (BenchOp::OnebitAllReduce, in_place) => {
                let state = onebit.as_mut().ok_or_else(|| oxcomm::Error::invalid("no 1-bit state for this size"))?;
                let buf = if in_place {
                    &mut a[..input]
                } else {
                    b[..input].copy_from_slice(&a[..input]);
                    &mut b[..input]
                };
                let buf = as_f32(buf).ok_or_else(|| oxcomm::Error::invalid("onebit_all_reduce takes f32 only"))?;
                onebit::all_reduce(c, buf, state)
            }
            (BenchOp::QuantReduceScatter, in_place) => {
                let shape = match qgz_group(block, c.size()) {
                    Some(e) => vec![input / e, e],
                    None => vec![input],
                };
                let out = T::quant_reduce(c, &a[..input], &shape, self.groups)
                    .ok_or_else(|| oxcomm::Error::invalid("quant_reduce_scatter takes f32, f16 and bf16 only"))??;
                let dst = if in_place { &mut a[me * block..(me + 1) * block] } else { &mut b[..output] };
                if out.len() != dst.len() {
                    return Err(oxcomm::Error::invalid(format!(
                        "quant_reduce_scatter returned {} elements, expected {}",
                        out.len(),
                        dst.len()
                    )));
                }
                dst.copy_from_slice(&out);
                Ok(())
            }
        }
    }

    /// Warm-up, then `iters` timed ops back to back: mean and median in µs and the bytes sent
    /// per op, each the maximum over ranks.
    pub(crate) fn time<T: BenchElement>(
        &self,
        bufs: &mut Buffers<T>,
        warmup: usize,
        iters: usize,
    ) -> oxcomm::Result<Timed> {
        self.comm.barrier()?;
        for _ in 0..warmup {
            self.run_once(bufs)?;
        }
        self.comm.barrier()?;
        let mut each: Vec<Duration> = Vec::with_capacity(iters);
        let sent = self.comm.stats().bytes_sent;
        let start = Instant::now();
        for _ in 0..iters {
            let t = Instant::now();
            self.run_once(bufs)?;
            each.push(t.elapsed());
        }
        let total = start.elapsed();
        let wire = (self.comm.stats().bytes_sent - sent) as f64 / iters.max(1) as f64;
        let mut stats =
            [total.as_secs_f64() * 1e6 / iters.max(1) as f64, median(&mut each).as_secs_f64() * 1e6, wire.round()];
        self.comm.all_reduce(&mut stats, ReduceOp::Max)?;
        Ok(Timed { mean_us: stats[0], median_us: stats[1], wire_bytes: stats[2] as u64 })
    }

    /// Fills the inputs with the check pattern and the outputs with a sentinel, runs the op
    /// once and returns the wrong elements summed over ranks.
    pub(crate) fn check<T: BenchElement>(&self, bufs: &mut Buffers<T>, pattern: &Pattern) -> oxcomm::Result<u64> {
        let wrong = self.check_local(bufs, pattern, false)?;
        let mut total = [wrong as i64];
        self.comm.all_reduce(&mut total, ReduceOp::Sum)?;
        Ok(total[0].max(0) as u64)
    }

    /// [`Case::check`] on this rank only: the wrong elements of this rank's output. With
    /// `corrupt` (`oxcomm check --inject-failure`), the first output element is overwritten
    /// after the op, before it is compared.
    pub(crate) fn check_local<T: BenchElement>(
        &self,
        bufs: &mut Buffers<T>,
        pattern: &Pattern,
        corrupt: bool,
    ) -> oxcomm::Result<u64> {
        let Layout { input, output, block } = self.layout;
        let me = self.comm.rank();
        let sentinel = T::from_f64(SENTINEL);
        // Inputs: a[j] = value of (this rank, global index j).
        let fill = |buf: &mut [T], rank: usize, offset: usize, f: &dyn Fn(usize, usize) -> f64| {
            for (j, x) in buf.iter_mut().enumerate() {
                *x = T::from_f64(f(rank, offset + j));
            }
        };
        let plain = |r: usize, i: usize| pattern.plain(r, i);
        let input_of = |r: usize, i: usize| pattern.input(r, i);
        match self.op {
            BenchOp::AllReduce | BenchOp::Reduce => fill(&mut bufs.a[..input], me, 0, &input_of),
            BenchOp::ReduceScatter => fill(&mut bufs.a[..input], me, 0, &input_of),
            BenchOp::Broadcast => {
                if me == self.root || !self.in_place {
                    fill(&mut bufs.a[..input], self.root, 0, &plain);
                }
                if me != self.root && self.in_place {
                    bufs.a[..input].fill(sentinel);
                }
            }
            BenchOp::AllGather => {
                if self.in_place {
                    bufs.a[..output].fill(sentinel);
                    fill(&mut bufs.a[me * block..(me + 1) * block], me, me * block, &plain);
                } else {
                    fill(&mut bufs.a[..input], me, me * block, &plain);
                }
            }
            BenchOp::AllToAll => fill(&mut bufs.a[..input], me, 0, &plain),
            BenchOp::OnebitAllReduce => {
                bufs.a[..input].fill(T::from_f64(onebit_input(me)));
                bufs.onebit = Some(OneBitState::new(input, self.comm.size())?);
            }
            BenchOp::QuantReduceScatter => bufs.a[..input].fill(T::from_f64(qgz_input(me))),
        }
        if !self.in_place {
            bufs.b[..output].fill(sentinel);
        }
        self.run_once(bufs)?;
        if corrupt {
            let target = match (self.op, self.in_place) {
                (BenchOp::ReduceScatter | BenchOp::QuantReduceScatter, true) => {
                    &mut bufs.a[me * block..(me + 1) * block]
                }
                (_, true) => &mut bufs.a[..output],
                (_, false) => &mut bufs.b[..output],
            };
            if let Some(x) = target.first_mut() {
                *x = sentinel;
            }
        }

        let out: &[T] = if self.in_place { &bufs.a } else { &bufs.b };
        let exact = |got: T, want: f64| got.to_f64() == T::from_f64(want).to_f64();
        let n = self.comm.size();
        let wrong = match self.op {
            BenchOp::AllReduce => count_wrong(&out[..output], |i, g| pattern.matches(g.to_f64(), pattern.reduced(i))),
            BenchOp::Reduce if me == self.root => {
                count_wrong(&out[..output], |i, g| pattern.matches(g.to_f64(), pattern.reduced(i)))
            }
            BenchOp::Reduce => 0,
            BenchOp::Broadcast => count_wrong(&out[..output], |i, g| exact(g, pattern.plain(self.root, i))),
            BenchOp::AllGather => count_wrong(&out[..output], |i, g| exact(g, pattern.plain(i / block.max(1), i))),
            BenchOp::ReduceScatter => {
                let got = if self.in_place { &bufs.a[me * block..(me + 1) * block] } else { &bufs.b[..output] };
                count_wrong(got, |i, g| pattern.matches(g.to_f64(), pattern.reduced(me * block + i)))
            }
            BenchOp::AllToAll => {
                // Block p of the output came from rank p's block `me`.
                count_wrong(&out[..output], |i, g| {
                    let (p, k) = (i / block.max(1), i % block.max(1));
                    exact(g, pattern.plain(p, me * block + k))
                })
            }
            BenchOp::OnebitAllReduce => {
                let want = (0..n).map(onebit_input).sum::<f64>() / n as f64;
                let tol = 8.0 * f64::from(f32::EPSILON) * 8.0;
                count_wrong(&out[..output], |_, g| (g.to_f64() - want).abs() <= tol)
            }
            BenchOp::QuantReduceScatter => {
                let want = (0..n).map(qgz_input).sum::<f64>() / n as f64;
                let tol = 4.0 * ulp_of(T::DTYPE) * want.abs();
                let got = if self.in_place { &bufs.a[me * block..(me + 1) * block] } else { &bufs.b[..output] };
                count_wrong(got, |_, g| (g.to_f64() - want).abs() <= tol)
            }
        };
        Ok(wrong)
    }
}

/// Every element of rank `r`'s onebit_all_reduce check input (see the module docs).
fn onebit_input(r: usize) -> f64 {
    [1.0, -2.0, 4.0, -8.0][r % 4]
}

/// Every element of rank `r`'s quant_reduce_scatter check input (see the module docs).
fn qgz_input(r: usize) -> f64 {
    -f64::from(1u32 << (r % 3))
}

/// One unit in the last place at 1.0 for a float dtype (the machine epsilon).
fn ulp_of(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 2f64.powi(-10),
        DType::BF16 => 2f64.powi(-7),
        DType::F32 => 2f64.powi(-23),
        _ => 2f64.powi(-52),
    }
}

fn count_wrong<T: Element>(got: &[T], ok: impl Fn(usize, T) -> bool) -> u64 {
    got.iter().enumerate().filter(|(i, g)| !ok(*i, **g)).count() as u64
}

fn median(v: &mut [Duration]) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort_unstable();
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2
    }
}

// ---------------------------------------------------------------------------------------------
// Check values
// ---------------------------------------------------------------------------------------------

/// What an output element holds before the op writes it: outside every pattern's range and
/// exact in every dtype.
pub(crate) const SENTINEL: f64 = 113.0;

/// Inputs whose reduction is exact in the dtype and independent of the order of operations:
/// small non-negative integers (sums stay below the dtype's exact-integer limit, products are
/// powers of two within its range).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pattern {
    redop: ReduceOp,
    dtype: DType,
    n: usize,
    /// Largest input of a sum/avg: `min(3, limit / n)`.
    sum_max: u64,
    /// How many ranks may contribute a 2 to a product.
    prod_twos: usize,
}

impl Pattern {
    pub(crate) fn new(redop: ReduceOp, dtype: DType, n: usize) -> Pattern {
        // Largest integer up to which every integer is exact, and the largest power-of-two
        // exponent, per dtype.
        let (limit, max_exp): (u64, usize) = match dtype {
            DType::F16 => (2048, 15),
            DType::BF16 => (256, 127),
            DType::F32 => (1 << 24, 127),
            DType::F64 => (1 << 53, 1023),
            DType::I8 => (127, 6),
            DType::U8 => (255, 7),
            DType::I32 => (i32::MAX as u64, 30),
            DType::I64 => (1 << 53, 52),
        };
        let n = n.max(1);
        Pattern { redop, dtype, n, sum_max: (limit / n as u64).min(3), prod_twos: max_exp.min(n) }
    }

    /// Why reduced values cannot be checked exactly here, if they cannot.
    pub(crate) fn unsupported(&self) -> Option<String> {
        matches!(self.redop, ReduceOp::Sum | ReduceOp::Avg)
            .then_some(())
            .filter(|_| self.sum_max == 0)
            .map(|_| format!("{} ranks can overflow a {} sum of ones", self.n, self.dtype))
    }

    fn mix(r: usize, i: usize) -> u64 {
        let mut x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (r as u64 + 1).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        x ^= x >> 31;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^ (x >> 29)
    }

    /// A value for ops that only move data: 0..=99.
    pub(crate) fn plain(&self, r: usize, i: usize) -> f64 {
        (Self::mix(r, i) % 100) as f64
    }

    /// Rank `r`'s input at global index `i` for the reducing ops.
    pub(crate) fn input(&self, r: usize, i: usize) -> f64 {
        let m = Self::mix(r, i);
        match self.redop {
            ReduceOp::Sum | ReduceOp::Avg => (m % (self.sum_max + 1)) as f64,
            ReduceOp::Prod => {
                if r < self.prod_twos && m % 4 == 0 {
                    2.0
                } else {
                    1.0
                }
            }
            ReduceOp::Min | ReduceOp::Max => (m % 8) as f64,
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => (m % 64) as f64,
        }
    }

    /// The reduced value at global index `i`, over all ranks.
    pub(crate) fn reduced(&self, i: usize) -> f64 {
        let vals = (0..self.n).map(|r| self.input(r, i));
        match self.redop {
            ReduceOp::Sum => vals.sum(),
            ReduceOp::Avg => {
                let s: f64 = vals.sum();
                if self.dtype.is_float() {
                    s / self.n as f64
                } else {
                    (s / self.n as f64).trunc()
                }
            }
            ReduceOp::Prod => vals.product(),
            ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
            ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
            ReduceOp::BAnd => vals.map(|v| v as i64).fold(-1, |a, b| a & b) as f64,
            ReduceOp::BOr => vals.map(|v| v as i64).fold(0, |a, b| a | b) as f64,
            ReduceOp::BXor => vals.map(|v| v as i64).fold(0, |a, b| a ^ b) as f64,
        }
    }

    /// Whether `got` is the reduced value `want`: exact, except avg on floats (2 ulp).
    pub(crate) fn matches(&self, got: f64, want: f64) -> bool {
        if self.redop == ReduceOp::Avg && self.dtype.is_float() {
            let ulp = match self.dtype {
                DType::F16 => 2f64.powi(-10),
                DType::BF16 => 2f64.powi(-7),
                DType::F32 => 2f64.powi(-23),
                _ => 2f64.powi(-52),
            };
            (got - want).abs() <= 2.0 * ulp * want.abs().max(f64::MIN_POSITIVE)
        } else {
            got == want
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn plan(argv: &[&str]) -> anyhow::Result<Plan> {
        let cli = Cli::try_parse_from(std::iter::once("bench").chain(argv.iter().copied()))?;
        Plan::new(&cli.args)
    }

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("1K"), Ok(1024));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("3kb"), Ok(3072));
        assert!(parse_size("").is_err());
        assert!(parse_size("K").is_err());
        assert!(parse_size("1X").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn defaults_sweep_8_bytes_to_64_mib() {
        let p = plan(&[]).unwrap();
        assert_eq!(p.sizes.first(), Some(&8));
        assert_eq!(p.sizes.last(), Some(&(64 << 20)));
        assert_eq!(p.sizes.len(), 24);
        assert_eq!(p.ops, vec![BenchOp::AllReduce]);
        assert!(p.world.unwrap() >= 2);
        assert_eq!((p.iters, p.warmup, p.check), (20, 5, true));
    }

    #[test]
    fn bad_plans_are_errors() {
        for argv in [
            &["-b", "0"][..],
            &["-b", "1M", "-e", "1K"],
            &["-f", "1"],
            &["-n", "0"],
            &["--op", "all_reduce,nope"],
            &["--dtype", "f32", "--redop", "band"],
            &["--op", "broadcast", "--algorithm", "ring"],
            &["--world-size", "0"],
            &["--world-size", "2", "--op", "reduce", "--root", "2"],
            &["-e", "2", "--dtype", "f64"],
        ] {
            assert!(plan(argv).is_err(), "{argv:?} should be rejected");
        }
        // --op all with an algorithm applies it where it fits.
        let p = plan(&["--op", "all", "--algorithm", "ring"]).unwrap();
        assert_eq!(p.algorithm_for(BenchOp::AllReduce), Some(Algorithm::Ring));
        assert_eq!(p.algorithm_for(BenchOp::Broadcast), None);
    }

    #[test]
    fn worker_args_rebuild_the_plan() {
        let p = plan(&["--op", "all_gather,reduce", "-b", "1K", "-e", "4K", "-f", "4", "--dtype", "bf16", "-c", "0"])
            .unwrap();
        let argv = p.worker_args(3, "sock");
        let q = plan(&argv[1..].iter().map(|s| s.as_str()).collect::<Vec<_>>()).unwrap();
        assert_eq!(q.ops, p.ops);
        assert_eq!(q.sizes, p.sizes);
        assert_eq!((q.dtype, q.check, q.world, q.worker), (p.dtype, false, Some(3), true));
        assert_eq!(q.report_to.as_deref(), Some("sock"));
    }

    #[test]
    fn layouts_follow_nccl_tests() {
        // 1 KiB of f32 on 4 ranks.
        assert_eq!(BenchOp::AllReduce.layout(1024, 4, 4), Layout { input: 256, output: 256, block: 256 });
        assert_eq!(BenchOp::AllGather.layout(1024, 4, 4), Layout { input: 64, output: 256, block: 64 });
        assert_eq!(BenchOp::ReduceScatter.layout(1024, 4, 4), Layout { input: 256, output: 64, block: 64 });
        assert_eq!(BenchOp::AllToAll.layout(1024, 4, 4), Layout { input: 256, output: 256, block: 64 });
        // Rounded down to whole elements per rank.
        assert_eq!(BenchOp::AllGather.layout(8, 3, 4).full(), 0);
        assert_eq!(BenchOp::ReduceScatter.layout(40, 3, 4).full(), 9);
    }

    #[test]
    fn patterns_are_exact_in_their_dtype() {
        for dtype in DType::ALL {
            for redop in ReduceOp::ALL.into_iter().filter(|o| o.fits(dtype)) {
                for n in [1, 2, 3, 8, 64] {
                    let p = Pattern::new(redop, dtype, n);
                    if p.unsupported().is_some() {
                        continue;
                    }
                    for i in 0..200 {
                        let want = p.reduced(i);
                        if !(redop == ReduceOp::Avg && dtype.is_float()) {
                            let round = match dtype {
                                DType::F16 => half::f16::from_f64(want).to_f64(),
                                DType::BF16 => half::bf16::from_f64(want).to_f64(),
                                DType::F32 => want as f32 as f64,
                                DType::I8 => want as i8 as f64,
                                DType::U8 => want as u8 as f64,
                                DType::I32 => want as i32 as f64,
                                _ => want,
                            };
                            assert_eq!(round, want, "{dtype} {redop} n={n} i={i}");
                        }
                        assert!(p.input(0, i) != SENTINEL && p.plain(0, i) != SENTINEL);
                    }
                }
            }
        }
    }

    /// `#wrong` comes from comparing real outputs: right data gives 0; an all_reduce max
    /// checked against the expected sums gives wrong elements.
    #[test]
    fn check_counts_real_mismatches() {
        let opts = OpOptions::default();
        let counts = oxcomm::threads::run(3, |comm| {
            let layout = BenchOp::AllReduce.layout(4096, 3, 4);
            let mut bufs = Buffers::<f32>::new(1024).unwrap();
            let case = |op, redop, root| Case {
                comm: &comm,
                op,
                in_place: true,
                layout,
                redop,
                root,
                opts: &opts,
                groups: None,
            };
            let sums = Pattern::new(ReduceOp::Sum, DType::F32, 3);
            let right = case(BenchOp::AllReduce, ReduceOp::Sum, 0).check(&mut bufs, &sums).unwrap();
            let max_as_sum = case(BenchOp::AllReduce, ReduceOp::Max, 0).check(&mut bufs, &sums).unwrap();
            let bcast = case(BenchOp::Broadcast, ReduceOp::Sum, 0).check(&mut bufs, &sums).unwrap();
            (right, max_as_sum, bcast)
        })
        .unwrap();
        for (right, max_as_sum, bcast) in counts {
            assert_eq!((right, bcast), (0, 0));
            assert!(max_as_sum > 1000, "only {max_as_sum} of 3 × 1024 elements differ");
        }
    }

    #[test]
    fn times_print_like_nccl_tests() {
        assert_eq!(fmt_us(12.345), "12.35");
        assert_eq!(fmt_us(123.45), "123.5");
        assert_eq!(fmt_us(12345.6), "12346");
    }

    #[test]
    fn median_of_even_and_odd() {
        let ms = |v: &[u64]| v.iter().map(|m| Duration::from_millis(*m)).collect::<Vec<_>>();
        assert_eq!(median(&mut ms(&[3, 1, 2])), Duration::from_millis(2));
        assert_eq!(median(&mut ms(&[4, 1, 2, 3])), Duration::from_micros(2500));
        assert_eq!(median(&mut []), Duration::ZERO);
    }
}
