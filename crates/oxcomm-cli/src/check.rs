//! `oxcomm check`: runs every collective on every transport with exact inputs and prints a
//! pass/fail table (op × transport), then exits 1 if anything failed.
//!
//! This module owns the list of checks ([`checks`]), running them on one rank
//! ([`run_checks`]), starting the ranks (threads in this process; processes over shared memory
//! or TCP through [`crate::launch::launch_self`], as `oxcomm bench` does) and the table. The
//! ops that `oxcomm bench` times are run and verified by the bench's own code
//! ([`crate::bench::cases`]), so the check and the bench agree on what "right" means; the
//! others (all_to_all_v, gather, scatter, barrier, send/recv, reduce_scatter_coalesced) are
//! verified here. It uses only oxcomm's public API.
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

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context};
use oxcomm::compression::coalesced;
use oxcomm::compression::onebit;
use oxcomm::rendezvous::env::{OXCOMM_TIMEOUT, OXCOMM_TRANSPORT};
use oxcomm::{Algorithm, Communicator, DType, Element, OpOptions, ReduceOp, Transport};
use serde::{Deserialize, Serialize};

use crate::bench::cases::{BenchElement, BenchOp, Buffers, Case, Layout, Pattern, SENTINEL};

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
const TRANSPORTS: [Transport; 3] = [Transport::Threads, Transport::Shm, Transport::Tcp];

/// The transports `--transport` names (all of [`TRANSPORTS`] when empty), read with the
/// library's names.
fn transports(typed: &[String]) -> anyhow::Result<Vec<Transport>> {
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
const DEFAULT_TIMEOUT_S: &str = "30";

/// The element counts per rank block: 0, 1, 7, 4097 and 2^18 (1 MiB of f32).
const COUNTS: [usize; 5] = [0, 1, 7, 4097, 1 << 18];

/// Counts up to this also run all_reduce with `max` and `prod`.
const SMALL: usize = 4097;

/// The dtypes every op runs with.
const DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::I32, DType::U8];

/// What the check of one op (over every dtype, count and mode) found on one transport.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Outcome {
    /// The check's name: `op` or `op/algorithm`.
    name: String,
    /// Cases run.
    cases: usize,
    /// Cases that failed.
    failed: usize,
    /// The first failure: the case and what went wrong.
    first: Option<String>,
}

/// One check: an op, and the algorithm forced on it (`None`: auto).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Check {
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
    fn name(&self) -> String {
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
fn checks(transport: Transport) -> Vec<Check> {
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
fn selected(transport: Transport, filter: &[String]) -> Vec<Check> {
    checks(transport)
        .into_iter()
        .filter(|c| filter.is_empty() || filter.iter().any(|f| c.name().starts_with(f.trim())))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Front end
// ---------------------------------------------------------------------------------------------

/// Runs `oxcomm check`: 0 when every check passed, 1 when one failed.
pub fn run(args: CheckArgs) -> anyhow::Result<i32> {
    if std::env::var_os(OXCOMM_TIMEOUT).is_none() {
        std::env::set_var(OXCOMM_TIMEOUT, DEFAULT_TIMEOUT_S);
    }
    if args.worker {
        return run_worker(&args);
    }
    let transports = transports(&args.transport)?;
    if args.world_size.iter().any(|n| !(1..=64).contains(n)) {
        bail!("--world-size must be between 1 and 64");
    }
    if selected(Transport::Shm, &args.op).is_empty() {
        let names: Vec<String> = checks(Transport::Shm).iter().map(Check::name).collect();
        bail!("--op matches no check (the checks: {})", names.join(", "));
    }

    let started = Instant::now();
    println!(
        "# oxcomm check  transports: {}  ranks: {}  dtypes: {}  counts per rank block: {}",
        transports.iter().map(|t| t.as_str()).collect::<Vec<_>>().join(", "),
        args.world_size.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(", "),
        DTYPES.iter().map(|d| d.name()).collect::<Vec<_>>().join(", "),
        COUNTS.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", "),
    );
    let mut columns: Vec<(String, Vec<Outcome>)> = Vec::new();
    for &n in &args.world_size {
        for &t in &transports {
            let t0 = Instant::now();
            let outcomes = match t {
                Transport::Threads => run_threads(&args, n),
                other => run_processes(&args, other, n),
            };
            let outcomes = outcomes.unwrap_or_else(|e| {
                // The job as a whole failed: every check of it fails with that error.
                selected(t, &args.op)
                    .iter()
                    .map(|c| Outcome { name: c.name(), cases: 0, failed: 1, first: Some(format!("{e:#}")) })
                    .collect()
            });
            eprintln!("oxcomm check: {t}, {n} ranks: {:.1}s", t0.elapsed().as_secs_f64());
            columns.push((format!("{t}/{n}"), outcomes));
        }
    }
    let order: Vec<String> = selected(Transport::Shm, &args.op).iter().map(Check::name).collect();
    let (table, failed) = table(&order, &columns);
    print!("{table}");
    println!("# {:.1}s", started.elapsed().as_secs_f64());
    Ok(if failed { 1 } else { 0 })
}

/// The table (rows in the order of `order`, then any others) and whether anything failed.
fn table(order: &[String], columns: &[(String, Vec<Outcome>)]) -> (String, bool) {
    let present = |n: &String| columns.iter().any(|(_, os)| os.iter().any(|o| &o.name == n));
    let mut names: Vec<&str> = order.iter().filter(|n| present(n)).map(String::as_str).collect();
    for (_, outcomes) in columns {
        for o in outcomes {
            if !names.contains(&o.name.as_str()) {
                names.push(&o.name);
            }
        }
    }
    let width = names.iter().map(|n| n.len()).max().unwrap_or(2).max(10);
    let mut t = String::new();
    let _ = write!(t, "{:<width$}", "# op");
    for (label, _) in columns {
        let _ = write!(t, "  {label:>12}");
    }
    t.push('\n');
    let (mut cases, mut failures) = (0, Vec::new());
    for name in &names {
        let _ = write!(t, "{name:<width$}");
        for (label, outcomes) in columns {
            let cell = match outcomes.iter().find(|o| o.name == *name) {
                None => "-".to_string(),
                Some(o) => {
                    cases += o.cases;
                    if o.failed > 0 {
                        failures.push(format!("{label} {name}: {}", o.first.as_deref().unwrap_or("failed")));
                        "FAIL".to_string()
                    } else {
                        "ok".to_string()
                    }
                }
            };
            let _ = write!(t, "  {cell:>12}");
        }
        t.push('\n');
    }
    for f in &failures {
        let _ = writeln!(t, "# FAIL {f}");
    }
    if failures.is_empty() {
        let _ = writeln!(t, "# {cases} cases, all passed: OK");
    } else {
        let _ = writeln!(t, "# {cases} cases, {} checks failed: FAILED", failures.len());
    }
    (t, !failures.is_empty())
}

fn run_threads(args: &CheckArgs, n: usize) -> anyhow::Result<Vec<Outcome>> {
    let checks = selected(Transport::Threads, &args.op);
    let results = oxcomm::threads::run(n, |comm| run_checks(&comm, &checks, args.inject_failure.as_deref()))?;
    results.into_iter().next().ok_or_else(|| anyhow!("no rank 0"))?
}

#[cfg(target_os = "linux")]
fn run_processes(args: &CheckArgs, transport: Transport, n: usize) -> anyhow::Result<Vec<Outcome>> {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let path = std::env::temp_dir().join(format!("oxcomm-check-{}-{nanos:x}.json", std::process::id()));
    let mut argv: Vec<String> = vec![
        "check".into(),
        "--worker".into(),
        "--results".into(),
        path.display().to_string(),
        "--transport".into(),
        transport.as_str().into(),
        "--world-size".into(),
        n.to_string(),
    ];
    if !args.op.is_empty() {
        argv.push("--op".into());
        argv.push(args.op.join(","));
    }
    if let Some(op) = &args.inject_failure {
        argv.push("--inject-failure".into());
        argv.push(op.clone());
    }
    // The workers inherit this and build their links accordingly.
    std::env::set_var(OXCOMM_TRANSPORT, transport.as_str());
    let code = crate::launch::launch_self(n, argv, true);
    let read = read_results(&path);
    let _ = std::fs::remove_file(&path);
    let code = code?;
    match read {
        Ok(outcomes) if code == 0 => Ok(outcomes),
        Ok(_) => bail!("a rank exited with status {code}"),
        Err(e) if code != 0 => Err(e.context(format!("a rank exited with status {code}"))),
        Err(e) => Err(e),
    }
}

#[cfg(not(target_os = "linux"))]
fn run_processes(_args: &CheckArgs, transport: Transport, _n: usize) -> anyhow::Result<Vec<Outcome>> {
    bail!("--transport {transport} needs Linux")
}

fn read_results(path: &Path) -> anyhow::Result<Vec<Outcome>> {
    let text = std::fs::read_to_string(path).context("rank 0 wrote no results")?;
    serde_json::from_str(&text).context("rank 0's results are malformed")
}

#[cfg(target_os = "linux")]
fn run_worker(args: &CheckArgs) -> anyhow::Result<i32> {
    let comm = oxcomm::init().context("cannot join the job")?;
    let transport = match args.transport.first() {
        Some(t) => transports(std::slice::from_ref(t))?[0],
        None => comm.transport(),
    };
    let checks = selected(transport, &args.op);
    let outcomes = run_checks(&comm, &checks, args.inject_failure.as_deref())?;
    if comm.rank() == 0 {
        if let Some(path) = &args.results {
            std::fs::write(path, serde_json::to_vec(&outcomes)?)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
    }
    Ok(0)
}

#[cfg(not(target_os = "linux"))]
fn run_worker(_args: &CheckArgs) -> anyhow::Result<i32> {
    bail!("--worker needs Linux (oxcomm::init)")
}

// ---------------------------------------------------------------------------------------------
// One rank
// ---------------------------------------------------------------------------------------------

/// Longest failure message one rank contributes to the agreement after a case.
const MESSAGE_BYTES: usize = 240;

/// Runs `checks` on this rank; every rank returns rank 0's view of the outcomes.
fn run_checks(comm: &Communicator, checks: &[Check], inject: Option<&str>) -> anyhow::Result<Vec<Outcome>> {
    let mut out = Vec::new();
    for check in checks {
        let name = check.name();
        let corrupt = comm.rank() == 0 && inject.is_some_and(|op| name.starts_with(op));
        let mut outcome = Outcome { name, cases: 0, failed: 0, first: None };
        for dtype in DTYPES {
            for count in COUNTS {
                let cases = match dtype {
                    DType::F32 => typed::<f32>(comm, *check, count, corrupt),
                    DType::BF16 => typed::<half::bf16>(comm, *check, count, corrupt),
                    DType::I32 => typed::<i32>(comm, *check, count, corrupt),
                    DType::U8 => typed::<u8>(comm, *check, count, corrupt),
                    _ => Ok(Vec::new()),
                };
                let cases = match cases {
                    Ok(c) => c,
                    Err(e) => vec![(format!("{dtype} × {count}"), Err(oxcomm::Error::invalid(format!("{e:#}"))))],
                };
                for (what, result) in cases {
                    outcome.cases += 1;
                    if let Some(msg) = agree(comm, &what, result) {
                        outcome.failed += 1;
                        outcome.first.get_or_insert(msg);
                    }
                }
            }
        }
        out.push(outcome);
    }
    Ok(out)
}

/// Every rank's verdict on one case, agreed: `None` when it passed everywhere, else the first
/// failing rank's message (this rank's own when the communicator cannot agree any more).
fn agree(comm: &Communicator, what: &str, result: oxcomm::Result<u64>) -> Option<String> {
    let mine = match &result {
        Ok(0) => String::new(),
        Ok(w) => format!("{what}: {w} wrong elements on rank {}", comm.rank()),
        Err(e) => format!("{what}: {e}"),
    };
    let mut buf = [0u8; MESSAGE_BYTES];
    let bytes = mine.as_bytes();
    let len = bytes.len().min(MESSAGE_BYTES);
    buf[..len].copy_from_slice(&bytes[..len]);
    let mut all = vec![0u8; MESSAGE_BYTES * comm.size()];
    match comm.all_gather(&buf, &mut all) {
        Ok(()) => all.chunks(MESSAGE_BYTES).find(|m| m[0] != 0).map(|m| {
            let end = m.iter().position(|&b| b == 0).unwrap_or(m.len());
            String::from_utf8_lossy(&m[..end]).into_owned()
        }),
        Err(e) if mine.is_empty() => Some(format!("{what}: the ranks cannot agree on the result: {e}")),
        Err(_) => Some(mine),
    }
}

/// The cases of one check at one dtype and count: (what, wrong elements on this rank or the
/// error).
type Cases = Vec<(String, oxcomm::Result<u64>)>;

fn typed<T: BenchElement>(comm: &Communicator, check: Check, count: usize, corrupt: bool) -> anyhow::Result<Cases> {
    let n = comm.size();
    let what = |extra: &str| format!("{} × {count}{extra}", T::DTYPE);
    let timeout = OpOptions::default();
    match check {
        Check::Bench(op, algorithm) => {
            if op == BenchOp::OnebitAllReduce && T::DTYPE != DType::F32
                || op == BenchOp::QuantReduceScatter && !T::DTYPE.is_float()
            {
                return Ok(Vec::new());
            }
            let count = match op {
                BenchOp::OnebitAllReduce => {
                    let grain = onebit::padded_len(1, n)?;
                    count.div_ceil(grain) * grain
                }
                BenchOp::QuantReduceScatter => count.div_ceil(2) * 2,
                _ => count,
            };
            let layout = match op {
                BenchOp::AllReduce | BenchOp::Reduce | BenchOp::Broadcast | BenchOp::OnebitAllReduce => {
                    Layout { input: count, output: count, block: count }
                }
                BenchOp::AllGather | BenchOp::Gather => Layout { input: count, output: count * n, block: count },
                BenchOp::ReduceScatter | BenchOp::QuantReduceScatter | BenchOp::Scatter => {
                    Layout { input: count * n, output: count, block: count }
                }
                BenchOp::AllToAll => Layout { input: count * n, output: count * n, block: count },
            };
            let mut bufs = Buffers::<T>::new(layout.input.max(layout.output))?;
            let opts = OpOptions { algorithm, ..timeout };
            let redops: &[ReduceOp] = match op {
                BenchOp::AllReduce if algorithm.is_none() && count <= SMALL => {
                    &[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Prod]
                }
                _ => &[ReduceOp::Sum],
            };
            let mut out = Vec::new();
            for &redop in redops {
                let pattern = Pattern::new(redop, T::DTYPE, n);
                if op.reduces() && pattern.unsupported().is_some() {
                    continue;
                }
                for in_place in [false, true] {
                    let root = n - 1;
                    let case = Case { comm, op, in_place, layout, redop, root, opts: &opts, groups: None };
                    let mode = if in_place { "in-place" } else { "out-of-place" };
                    let label = if op.reduces() { format!(", {redop}, {mode}") } else { format!(", {mode}") };
                    let spoil = corrupt && layout.full() > 0;
                    out.push((what(&label), case.check_local(&mut bufs, &pattern, spoil)));
                }
            }
            Ok(out)
        }
        Check::Barrier(algorithm) => {
            // One barrier per dtype and count is plenty; the count is not used.
            let opts = OpOptions { algorithm, ..timeout };
            Ok(vec![(what(""), comm.barrier_with(&opts).map(|()| 0))])
        }
        Check::AllToAllV => Ok(vec![(what(""), all_to_all_v::<T>(comm, count, corrupt))]),
        Check::Gather => Ok(vec![(what(""), gather::<T>(comm, count, corrupt))]),
        Check::Scatter => Ok(vec![(what(""), scatter::<T>(comm, count, corrupt))]),
        Check::SendRecv => {
            if n < 2 {
                return Ok(Vec::new());
            }
            Ok(vec![(what(""), send_recv::<T>(comm, count, corrupt))])
        }
        Check::ReduceScatterCoalesced => Ok(vec![(what(""), reduce_scatter_coalesced::<T>(comm, count, corrupt))]),
    }
}

/// The value of element `k` that rank `src` sends to rank `dst`: exact in every dtype.
fn value(src: usize, dst: usize, k: usize) -> f64 {
    let pattern = Pattern::new(ReduceOp::Sum, DType::U8, 1);
    pattern.plain(src, dst * 1_000_003 + k)
}

/// Wrong elements of `got` against `want(k)`, plus one when `corrupt` and `got` is not empty.
fn wrong<T: Element>(got: &[T], want: impl Fn(usize) -> f64, corrupt: bool) -> u64 {
    let bad = got.iter().enumerate().filter(|(k, g)| g.to_f64() != T::from_f64(want(*k)).to_f64()).count() as u64;
    bad + u64::from(corrupt && !got.is_empty())
}

/// all_to_all_v with uneven counts: rank `s` sends `(count + s + 2d) % (count + 3)` elements
/// to rank `d`.
fn all_to_all_v<T: Element>(comm: &Communicator, count: usize, corrupt: bool) -> oxcomm::Result<u64> {
    let (n, me) = (comm.size(), comm.rank());
    let cnt = |s: usize, d: usize| (count + s + 2 * d) % (count + 3);
    let send_counts: Vec<usize> = (0..n).map(|d| cnt(me, d)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|s| cnt(s, me)).collect();
    let send: Vec<T> = (0..n).flat_map(|d| (0..cnt(me, d)).map(move |k| T::from_f64(value(me, d, k)))).collect();
    let mut recv = vec![T::from_f64(SENTINEL); recv_counts.iter().sum()];
    comm.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)?;
    let mut bad = 0;
    let mut at = 0;
    for (s, &c) in recv_counts.iter().enumerate() {
        bad += wrong(&recv[at..at + c], |k| value(s, me, k), false);
        at += c;
    }
    Ok(bad + u64::from(corrupt && !recv.is_empty()))
}

/// gather to the last rank.
fn gather<T: Element>(comm: &Communicator, count: usize, corrupt: bool) -> oxcomm::Result<u64> {
    let (n, me, root) = (comm.size(), comm.rank(), comm.size() - 1);
    let input: Vec<T> = (0..count).map(|k| T::from_f64(value(me, root, k))).collect();
    if me != root {
        comm.gather(&input, None, root)?;
        return Ok(u64::from(corrupt && count > 0));
    }
    let mut output = vec![T::from_f64(SENTINEL); count * n];
    comm.gather(&input, Some(&mut output), root)?;
    Ok(wrong(&output, |i| value(i / count.max(1), root, i % count.max(1)), corrupt))
}

/// scatter from the last rank.
fn scatter<T: Element>(comm: &Communicator, count: usize, corrupt: bool) -> oxcomm::Result<u64> {
    let (n, me, root) = (comm.size(), comm.rank(), comm.size() - 1);
    let mut output = vec![T::from_f64(SENTINEL); count];
    if me == root {
        let input: Vec<T> = (0..n * count).map(|i| T::from_f64(value(root, i / count, i % count))).collect();
        comm.scatter(Some(&input), &mut output, root)?;
    } else {
        comm.scatter(None, &mut output, root)?;
    }
    Ok(wrong(&output, |k| value(root, me, k), corrupt))
}

/// A ring of send/recv: rank 0 sends to 1 and then receives from n − 1; every other rank
/// receives from its left neighbour and then sends to its right one.
fn send_recv<T: Element>(comm: &Communicator, count: usize, corrupt: bool) -> oxcomm::Result<u64> {
    let (n, me) = (comm.size(), comm.rank());
    let (left, right) = ((me + n - 1) % n, (me + 1) % n);
    let tag = 7;
    let send: Vec<T> = (0..count).map(|k| T::from_f64(value(me, right, k))).collect();
    let mut recv = vec![T::from_f64(SENTINEL); count];
    if me == 0 {
        comm.send(&send, right, tag)?;
        comm.recv(&mut recv, left, tag)?;
    } else {
        comm.recv(&mut recv, left, tag)?;
        comm.send(&send, right, tag)?;
    }
    Ok(wrong(&recv, |k| value(left, me, k), corrupt))
}

/// reduce_scatter_coalesced of three tensors of `count`, `count + 1` and `2·count + 3`
/// elements: this rank's ceil partition of each tensor's mean.
fn reduce_scatter_coalesced<T: Element>(comm: &Communicator, count: usize, corrupt: bool) -> oxcomm::Result<u64> {
    let (n, me) = (comm.size(), comm.rank());
    let pattern = Pattern::new(ReduceOp::Avg, T::DTYPE, n);
    if pattern.unsupported().is_some() {
        return Ok(0);
    }
    let lens = [count, count + 1, 2 * count + 3];
    let index = |t: usize, k: usize| t * 10_000_019 + k;
    let tensors: Vec<Vec<T>> = lens
        .iter()
        .enumerate()
        .map(|(t, &l)| (0..l).map(|k| T::from_f64(pattern.input(me, index(t, k)))).collect())
        .collect();
    let views: Vec<&[T]> = tensors.iter().map(Vec::as_slice).collect();
    let out = coalesced::reduce_scatter_coalesced(comm, &views)?;
    // Floats are divided by n before the sum: each term rounds once, and so does each sum.
    let ulp = match T::DTYPE {
        DType::F32 => 2f64.powi(-23),
        DType::BF16 => 2f64.powi(-7),
        DType::F16 => 2f64.powi(-10),
        _ => 0.0,
    };
    let tol = |want: f64| (2.0 * n as f64 + 2.0) * ulp * want.abs();
    let mut bad = 0;
    for (t, (&len, got)) in lens.iter().zip(&out).enumerate() {
        let part = coalesced::partition(len, n, me);
        if got.len() != part.len() {
            bad += part.len().max(1) as u64;
            continue;
        }
        for (k, g) in got.iter().enumerate() {
            let want = pattern.reduced(index(t, part.start + k));
            if (g.to_f64() - want).abs() > tol(want) {
                bad += 1;
            }
        }
    }
    Ok(bad + u64::from(corrupt && out.iter().any(|o| !o.is_empty())))
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

    #[test]
    fn threads_world_3_passes_and_an_injected_failure_is_seen() {
        let only = |f: &str| selected(Transport::Threads, &[f.to_string()]);
        let gather = only("gather");
        let outcomes = oxcomm::threads::run(3, |comm| run_checks(&comm, &gather, Some("gather"))).unwrap();
        // The filter also selects the bench's gather (`gather/auto`, `gather/flat`).
        let o = outcomes[0].as_ref().unwrap().iter().find(|o| o.name == "gather").unwrap();
        assert!(o.failed > 0 && o.first.as_deref().unwrap().contains("wrong"), "{o:?}");
        let rsc = only("reduce_scatter_coalesced");
        let outcomes = oxcomm::threads::run(3, |comm| run_checks(&comm, &rsc, None)).unwrap();
        let o = &outcomes[0].as_ref().unwrap()[0];
        assert_eq!((o.failed, o.cases), (0, 20), "{o:?}");
    }
}
