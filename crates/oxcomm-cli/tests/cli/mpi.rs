//! `oxcomm bench` on the MPI backend (`OXCOMM_BACKEND=mpi`): without the `mpi` feature a
//! one-line error; with it (`cargo test -p oxcomm-cli --features mpi --test cli mpi`, run by
//! `.ci/mpi.sh`), a 2-rank job under `mpirun` whose rank 0 prints one full table. Every run has
//! a deadline and is killed when it overruns.

use std::process::Command;
use std::time::Duration;

use crate::harness::{Proc, Run};

const OXCOMM: &str = env!("CARGO_BIN_EXE_oxcomm");

/// Longest any run in these tests may take (an MPI job on a loaded 2-core machine included).
const LIMIT: Duration = Duration::from_secs(120);

/// Runs `command`; kills it (and the ranks below it) and fails the test after [`LIMIT`].
fn run(command: Command) -> Run {
    Proc::spawn(command).finish(LIMIT)
}

fn bench_with_backend(backend: &str, args: &[&str]) -> Run {
    let mut c = Command::new(OXCOMM);
    c.arg("bench").args(args).env("OXCOMM_BACKEND", backend);
    run(c)
}

/// A value `oxcomm::init()` would reject is rejected up front, before any rank is started.
#[test]
fn an_unknown_backend_is_a_one_line_error() {
    let r = bench_with_backend("gloo", &["-b", "8", "-e", "64"]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert_eq!(r.stderr, "oxcomm: error: OXCOMM_BACKEND=gloo: expected `native` or `mpi`\n");
    assert!(r.stdout.is_empty(), "{}", r.stdout);
}

#[cfg(not(feature = "mpi"))]
#[test]
fn mpi_without_the_feature_is_a_one_line_error() {
    let r = bench_with_backend("mpi", &["-b", "8", "-e", "64"]);
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    assert!(
        r.stderr.starts_with("oxcomm: error: OXCOMM_BACKEND=mpi but this oxcomm was built without the `mpi` feature"),
        "{}",
        r.stderr
    );
    assert!(r.stdout.is_empty(), "{}", r.stdout);
}

/// `OXCOMM_BACKEND=mpi mpirun -n 2 oxcomm bench --op all`: each process is one rank of the
/// MPI job; rank 0 alone prints the header, one block per op with every size, and the footer.
#[cfg(feature = "mpi")]
#[test]
fn mpirun_n2_prints_one_full_table_from_rank_0() {
    const OPS: [&str; 10] = [
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "reduce",
        "all_to_all",
        "gather",
        "scatter",
        "onebit_all_reduce",
        "quant_reduce_scatter",
    ];
    let mut c = Command::new("mpirun");
    c.args(["-n", "2", "--oversubscribe", "--allow-run-as-root"])
        .args(["--mca", "btl_vader_single_copy_mechanism", "none"])
        .args(["-x", "OXCOMM_BACKEND=mpi"])
        .arg(OXCOMM)
        .args(["bench", "-b", "8", "-e", "64K", "--op", "all", "-n", "3", "-w", "1"])
        .env("OXCOMM_BACKEND", "mpi");
    let r = run(c);
    assert_eq!(r.code, Some(0), "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    let out = &r.stdout;
    assert_eq!(out.matches("# oxcomm bench  ranks: 2  transport: mpi  dtype: f32").count(), 1, "{out}");
    for op in OPS {
        assert_eq!(out.matches(&format!("# Collective: {op}  (")).count(), 1, "{op}:\n{out}");
    }
    // 8 B .. 64 KiB by 2: 14 sizes per op; every row checked and right in both modes.
    let rows: Vec<Vec<&str>> =
        out.lines().filter(|l| !l.starts_with('#')).map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(rows.len(), OPS.len() * 14, "{out}");
    for row in &rows {
        assert_eq!(row.len(), 16, "{row:?}");
        assert_eq!((row[8], row[12]), ("0", "0"), "#wrong in {row:?}");
    }
    assert_eq!(out.matches("\n# Out of bounds values : 0 OK\n").count(), 1, "{out}");
}
