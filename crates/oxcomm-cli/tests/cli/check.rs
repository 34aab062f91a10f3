//! `oxcomm check`: the whole table on threads passes; a failure (injected with the test-only
//! `--inject-failure`) makes the table say FAIL and the exit status 1; the process transports
//! run through the same path.

use std::time::Duration;

use crate::bench::oxcomm_within;

/// A debug build checks every op on three threads in about 30 s alone; tests run side by side
/// on two cores.
const LIMIT: Duration = Duration::from_secs(240);

#[test]
fn every_check_passes_on_threads_and_prints_the_table() {
    let run = oxcomm_within(&["check", "--transport", "threads"], LIMIT);
    assert_eq!(run.code, Some(0), "stdout: {}\nstderr: {}", run.stdout, run.stderr);
    let out = &run.stdout;
    assert!(out.contains("threads/3"), "{out}");
    for op in [
        "all_reduce/ring",
        "all_reduce/rd",
        "all_reduce/star",
        "reduce/tree",
        "broadcast/tree",
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
        let line = out.lines().find(|l| l.split_whitespace().next() == Some(op));
        let line = line.unwrap_or_else(|| panic!("no row for {op}: {out}"));
        assert_eq!(line.split_whitespace().nth(1), Some("ok"), "{line}");
    }
    assert!(!out.contains("direct"), "direct needs shm: {out}");
    assert!(out.contains("all passed: OK"), "{out}");
}

#[test]
fn an_injected_failure_fails_the_table_and_the_exit_status() {
    let run = oxcomm_within(
        &["check", "--transport", "threads", "--op", "gather,scatter", "--inject-failure", "gather"],
        LIMIT,
    );
    assert_eq!(run.code, Some(1), "stdout: {}\nstderr: {}", run.stdout, run.stderr);
    let row = |op: &str| run.stdout.lines().find(|l| l.split_whitespace().next() == Some(op)).unwrap_or_default();
    assert!(row("gather").ends_with("FAIL"), "{}", run.stdout);
    assert!(row("scatter").ends_with("ok"), "{}", run.stdout);
    assert!(run.stdout.contains("# FAIL threads/3 gather: "), "{}", run.stdout);
    assert!(run.stdout.contains("wrong elements on rank 0"), "{}", run.stdout);
    assert!(run.stdout.contains("FAILED"), "{}", run.stdout);
}

#[test]
fn processes_over_shm_and_tcp_pass() {
    let run = oxcomm_within(
        &["check", "--transport", "shm,tcp", "--world-size", "2", "--op", "all_reduce,barrier,send_recv,gather"],
        LIMIT,
    );
    assert_eq!(run.code, Some(0), "stdout: {}\nstderr: {}", run.stdout, run.stderr);
    let direct = run.stdout.lines().find(|l| l.starts_with("all_reduce/direct")).unwrap_or_default();
    assert_eq!(direct.split_whitespace().collect::<Vec<_>>(), ["all_reduce/direct", "ok", "-"], "{}", run.stdout);
    assert!(run.stdout.contains("all passed: OK"), "{}", run.stdout);
}

#[test]
fn bad_flags_are_one_line_errors() {
    for args in
        [&["check", "--transport", "pigeon"][..], &["check", "--world-size", "0"], &["check", "--op", "frobnicate"]]
    {
        let run = oxcomm_within(args, LIMIT);
        assert_eq!(run.code, Some(1), "{args:?}: {}", run.stderr);
        assert_eq!(run.stderr.lines().count(), 1, "{args:?}: {}", run.stderr);
        assert!(run.stderr.starts_with("oxcomm: error: "), "{}", run.stderr);
    }
}
