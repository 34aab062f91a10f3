//! The flags of `oxcomm bench` as typed: [`BenchArgs`] (clap) and the parsers of their values
//! (sizes with suffixes, dtypes, reduce ops, algorithms, transports), and the backend the
//! environment asks for ([`Backend::from_env`]). This is the first of the two parsing stages:
//! each value here is well-formed on its own; whether they make sense together is
//! [`super::plan`]'s question.

use std::path::PathBuf;

use anyhow::bail;
pub use oxcomm::init::ENV_BACKEND;
use oxcomm::{Algorithm, DType, ReduceOp, Transport};

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
    /// reduce, all_to_all, gather, scatter, onebit_all_reduce (f32 only), quant_reduce_scatter (f32, f16,
    /// bf16), or `all` (every op that takes the dtype).
    #[arg(long = "op", value_name = "OPS", default_value = "all_reduce")]
    pub op: String,

    /// Element type: f32, f64, f16, bf16, i8, u8, i32, i64 (also float, half, ...).
    #[arg(short = 'd', long = "dtype", value_name = "TYPE", default_value = "f32", value_parser = parse_dtype)]
    pub dtype: DType,

    /// Reduction operator of the reducing ops: sum, avg, prod, min, max, band, bor, bxor.
    #[arg(short = 'o', long = "redop", value_name = "OP", default_value = "sum", value_parser = parse_redop)]
    pub redop: ReduceOp,

    /// Root rank of broadcast, reduce, gather and scatter.
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

    /// Rewrite this rank's input before every op, as the step that produced it would have
    /// (untimed; every timed op then starts after a barrier, and the time is the mean of the
    /// ops alone). Without it, ops resend unchanged buffers (nccl-tests' way), which a
    /// transport reading peers' memory in place may find in cache.
    #[arg(long = "fresh-inputs")]
    pub fresh_inputs: bool,

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

/// The transports `--transport` takes, in the order its error lists them.
pub const TRANSPORTS: [Transport; 3] = [Transport::Shm, Transport::Threads, Transport::Tcp];

fn parse_transport(raw: &str) -> Result<Transport, String> {
    Transport::parse(raw.trim()).filter(|t| TRANSPORTS.contains(t)).ok_or_else(|| {
        let names: Vec<&str> = TRANSPORTS.iter().map(|t| t.as_str()).collect();
        format!("unknown transport {raw:?} (one of: {})", names.join(", "))
    })
}

/// Where a rank's communicator comes from: oxcomm's own transports, or the MPI backend
/// (`OXCOMM_BACKEND=mpi`, read by `oxcomm::init()` too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// oxcomm's transports (`OXCOMM_BACKEND` unset, empty or `native`).
    Native,
    /// The MPI backend: the process is one rank of a job an MPI launcher started.
    Mpi,
}

impl Backend {
    /// The backend `OXCOMM_BACKEND` names (values as `oxcomm::init()` takes them); an error for
    /// an unknown value, or for `mpi` when this build lacks the `mpi` cargo feature.
    pub fn from_env() -> anyhow::Result<Backend> {
        Backend::parse(&std::env::var(ENV_BACKEND).unwrap_or_default())
    }

    /// [`Backend::from_env`] of a given value.
    pub fn parse(raw: &str) -> anyhow::Result<Backend> {
        match raw.trim().to_ascii_lowercase().as_str() {
            "" | "native" => Ok(Backend::Native),
            "mpi" if cfg!(feature = "mpi") => Ok(Backend::Mpi),
            "mpi" => bail!(
                "{ENV_BACKEND}=mpi but this oxcomm was built without the `mpi` feature (build it with `cargo build --release -p oxcomm-cli --features mpi`)"
            ),
            other => bail!("{ENV_BACKEND}={other}: expected `native` or `mpi`"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn backends_parse_like_oxcomm_init() {
        assert_eq!(Backend::parse("").unwrap(), Backend::Native);
        assert_eq!(Backend::parse(" Native ").unwrap(), Backend::Native);
        assert!(Backend::parse("gloo").unwrap_err().to_string().contains("expected `native` or `mpi`"));
        let mpi = Backend::parse("MPI");
        if cfg!(feature = "mpi") {
            assert_eq!(mpi.unwrap(), Backend::Mpi);
        } else {
            assert!(mpi.unwrap_err().to_string().contains("without the `mpi` feature"));
        }
    }
}
