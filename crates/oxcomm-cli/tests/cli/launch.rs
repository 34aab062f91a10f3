//! `oxcomm launch`: environment, output, exit status, signals and the store, driven through the
//! real binary with `sh -c` scripts as ranks. Every launcher run has a deadline and is killed
//! when it overruns.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::harness::{Proc, Run};

const OXCOMM: &str = env!("CARGO_BIN_EXE_oxcomm");

/// Longest any launcher run in these tests may take.
const LIMIT: Duration = Duration::from_secs(30);

fn start_with(args: &[&str], envs: &[(&str, &str)]) -> Proc {
    let mut command = Command::new(OXCOMM);
    command.args(args).envs(envs.iter().copied());
    Proc::spawn(command)
}

fn start(args: &[&str]) -> Proc {
    start_with(args, &[])
}

fn launch(args: &[&str]) -> Run {
    start(args).finish(LIMIT)
}

fn signal(pid: libc::pid_t, signal: libc::c_int) {
    // SAFETY: `kill` has no memory-safety preconditions.
    unsafe { libc::kill(pid, signal) };
}

fn alive(pid: libc::pid_t) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// Waits until every one of `paths` exists; fails the test after [`LIMIT`].
fn wait_for_files(paths: &[&Path]) {
    let deadline = Instant::now() + LIMIT;
    while !paths.iter().all(|p| p.exists()) {
        assert!(Instant::now() < deadline, "timed out waiting for {paths:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_pid(path: &Path) -> libc::pid_t {
    std::fs::read_to_string(path).unwrap().trim().parse().unwrap()
}

fn sorted_lines(text: &str) -> Vec<&str> {
    let mut lines: Vec<&str> = text.lines().collect();
    lines.sort_unstable();
    lines
}

/// A free port on loopback, found by binding port 0 (released again before use).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn every_rank_gets_its_environment() {
    let script = r#"echo "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $OXCOMM_RANK $OXCOMM_WORLD_SIZE $OXCOMM_LOCAL_RANK $OXCOMM_LOCAL_WORLD_SIZE $OXCOMM_TOKEN $OXCOMM_JOB_ID $OXCOMM_STORE $MASTER_ADDR $MASTER_PORT""#;
    // The launcher's own OXCOMM_TOKEN is not passed on: a single-node job gets a fresh one.
    let run = start_with(&["launch", "-n", "3", "--no-prefix", "sh", "-c", script], &[("OXCOMM_TOKEN", "mine")])
        .finish(LIMIT);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let lines = sorted_lines(&run.stdout);
    assert_eq!(lines.len(), 3, "{}", run.stdout);
    let fields: Vec<Vec<&str>> = lines.iter().map(|l| l.split(' ').collect()).collect();
    for (rank, f) in fields.iter().enumerate() {
        let rank = rank.to_string();
        assert_eq!(f.len(), 14, "{f:?}");
        assert_eq!(&f[..9], [&rank, "3", &rank, "3", "0", &rank, "3", &rank, "3"], "{f:?}");
        assert_eq!(f[9].len(), 64, "token {:?}", f[9]);
        assert!(f[9].bytes().all(|b| b.is_ascii_hexdigit()), "token {:?}", f[9]);
        assert!(!f[10].is_empty() && f[10].len() <= 16, "job id {:?}", f[10]);
        assert!(f[10].bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()), "job id {:?}", f[10]);
        assert_eq!(f[11], "launcher");
        assert_eq!(f[12], "127.0.0.1");
        assert_ne!(f[13].parse::<u16>().unwrap(), 0);
        // Token, job id and store address are the same for every rank.
        assert_eq!(&f[9..], &fields[0][9..]);
    }

    let again = launch(&["launch", "-n", "1", "--no-prefix", "sh", "-c", script]);
    let f: Vec<&str> = again.stdout.trim().split(' ').collect();
    assert_ne!(f[9], fields[0][9], "each job gets a fresh token");
    assert_ne!(f[10], fields[0][10], "each job gets a fresh id");
}

#[test]
fn output_lines_are_prefixed_with_the_rank() {
    let run = launch(&["launch", "-n", "2", "sh", "-c", "echo out-$RANK; echo err-$RANK >&2; printf tail-$RANK"]);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(sorted_lines(&run.stdout), ["[0] out-0", "[0] tail-0", "[1] out-1", "[1] tail-1"]);
    assert_eq!(sorted_lines(&run.stderr), ["[0] err-0", "[1] err-1"]);
    assert!(run.stdout.ends_with('\n'), "a partial last line is ended: {:?}", run.stdout);
}

#[test]
fn no_prefix_copies_output_as_is() {
    let run = launch(&["launch", "-n", "2", "--no-prefix", "sh", "-c", "echo out-$RANK; echo err-$RANK >&2"]);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(sorted_lines(&run.stdout), ["out-0", "out-1"]);
    assert_eq!(sorted_lines(&run.stderr), ["err-0", "err-1"]);
}

#[test]
fn lines_of_different_ranks_never_interleave() {
    let pad = "x".repeat(300);
    let script = format!("i=0; while [ $i -lt 400 ]; do echo \"line-$RANK-$i-{pad}\"; i=$((i+1)); done");
    let run = launch(&["launch", "-n", "4", "sh", "-c", &script]);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let mut seen = BTreeSet::new();
    for line in run.stdout.lines() {
        let (prefix, rest) = line.split_once(' ').unwrap_or_else(|| panic!("bad line {line:?}"));
        let rank = prefix.trim_start_matches('[').trim_end_matches(']');
        let mut parts = rest.splitn(4, '-');
        assert_eq!(parts.next(), Some("line"), "{line:?}");
        assert_eq!(parts.next(), Some(rank), "{line:?}");
        let i: u32 = parts.next().unwrap().parse().unwrap();
        assert_eq!(parts.next(), Some(pad.as_str()), "{line:?}");
        assert!(seen.insert((rank.to_owned(), i)), "duplicate {line:?}");
    }
    assert_eq!(seen.len(), 1600);
}

#[test]
fn a_failing_rank_stops_the_others_and_sets_the_exit_status() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    // Ranks 0 and 2 publish their pid and sleep; rank 1 fails once they are up. A long grace
    // period shows that SIGTERM, not SIGKILL after the grace period, ended them.
    let script = format!(
        "if [ $RANK = 1 ]; then while [ ! -f {d}/pid.0 ] || [ ! -f {d}/pid.2 ]; do sleep 0.05; done; exit 3; fi; \
         echo $$ > {d}/tmp.$RANK && mv {d}/tmp.$RANK {d}/pid.$RANK; exec sleep 60"
    );
    let run = launch(&["launch", "-n", "3", "--grace-period", "30", "sh", "-c", &script]);
    assert_eq!(run.code, Some(3), "{}", run.stderr);
    assert!(run.elapsed < Duration::from_secs(15), "took {:?}", run.elapsed);
    assert!(
        run.stderr.contains("oxcomm launch: rank 1 exited with status 3; stopping the other ranks\n"),
        "{}",
        run.stderr
    );
    assert_eq!(run.stderr.matches("exited with status").count(), 1, "{}", run.stderr);
    for rank in [0, 2] {
        let pid = read_pid(&dir.path().join(format!("pid.{rank}")));
        assert!(!alive(pid), "rank {rank} (pid {pid}) is still running");
    }
}

#[test]
fn a_rank_ignoring_sigterm_is_killed_after_the_grace_period() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let script = format!(
        "if [ $RANK = 1 ]; then while [ ! -f {d}/pid.0 ]; do sleep 0.05; done; exit 4; fi; \
         trap '' TERM; echo $$ > {d}/tmp && mv {d}/tmp {d}/pid.0; exec sleep 60"
    );
    let run = launch(&["launch", "-n", "2", "--grace-period", "0.5", "sh", "-c", &script]);
    assert_eq!(run.code, Some(4), "{}", run.stderr);
    assert!(run.elapsed < Duration::from_secs(15), "took {:?}", run.elapsed);
    let pid = read_pid(&dir.path().join("pid.0"));
    assert!(!alive(pid), "rank 0 (pid {pid}) is still running");
}

#[test]
fn a_rank_killed_by_a_signal_gives_128_plus_the_signal() {
    let run = launch(&["launch", "-n", "2", "sh", "-c", "if [ $RANK = 0 ]; then kill -9 $$; fi; exec sleep 60"]);
    assert_eq!(run.code, Some(137), "{}", run.stderr);
    assert!(run.stderr.contains("rank 0 exited with status 137 (killed by SIGKILL)"), "{}", run.stderr);
    assert!(run.elapsed < Duration::from_secs(15), "took {:?}", run.elapsed);
}

#[test]
fn signals_to_the_launcher_are_forwarded_to_every_rank() {
    for (signal_no, name) in [(libc::SIGTERM, "TERM"), (libc::SIGINT, "INT")] {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        // `sleep & wait` so the shell runs its trap as soon as the signal arrives.
        let script = format!(
            "trap 'echo got > {d}/got.$RANK; exit 0' {name}; touch {d}/ready.$RANK; sleep 60 & wait; \
             echo missed > {d}/got.$RANK"
        );
        let launcher = start(&["launch", "-n", "2", "sh", "-c", &script]);
        wait_for_files(&[&dir.path().join("ready.0"), &dir.path().join("ready.1")]);
        launcher.signal(signal_no);
        let run = launcher.finish(LIMIT);
        assert_eq!(run.code, Some(128 + signal_no), "SIG{name}: {}", run.stderr);
        assert!(run.elapsed < Duration::from_secs(15), "took {:?}", run.elapsed);
        for rank in 0..2 {
            let got = std::fs::read_to_string(dir.path().join(format!("got.{rank}"))).unwrap_or_default();
            assert_eq!(got.trim(), "got", "rank {rank} did not see SIG{name}");
        }
    }
}

#[test]
fn an_unknown_program_is_a_one_line_error() {
    let run = launch(&["launch", "-n", "2", "/nonexistent/oxcomm-test-program"]);
    assert_eq!(run.code, Some(1));
    assert_eq!(run.stderr.lines().count(), 1, "{}", run.stderr);
    assert!(run.stderr.contains("not found") && run.stderr.contains("oxcomm-test-program"), "{}", run.stderr);
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
}

#[test]
fn zero_ranks_is_an_error() {
    let run = launch(&["launch", "-n", "0", "true"]);
    assert_eq!(run.code, Some(1));
    assert!(run.stderr.contains("at least 1"), "{}", run.stderr);
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
}

#[test]
fn nproc_per_node_is_an_alias_of_n() {
    for flag in ["--nproc-per-node=2", "--nproc_per_node=2"] {
        let run = launch(&["launch", flag, "--no-prefix", "sh", "-c", "echo $RANK/$WORLD_SIZE"]);
        assert_eq!(run.code, Some(0), "{flag}: {}", run.stderr);
        assert_eq!(sorted_lines(&run.stdout), ["0/2", "1/2"], "{flag}");
    }
}

#[test]
fn ranks_reach_the_launchers_store() {
    let run = launch(&["launch", "-n", "3", "--no-prefix", OXCOMM, "store-ping"]);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let lines = sorted_lines(&run.stdout);
    assert_eq!(lines.len(), 3, "{}", run.stdout);
    for (rank, line) in lines.iter().enumerate() {
        assert!(line.starts_with(&format!("store-ping: rank {rank} of 3 ok, job ")), "{line}");
    }
}

#[test]
fn two_nodes_on_one_host_share_one_store_and_job_id() {
    let port = free_port().to_string();
    let token = [("OXCOMM_TOKEN", "shared-secret-of-the-test")];
    let node = |rank: &str| {
        let args =
            ["launch", "-n", "2", "--nnodes", "2", "--node-rank", rank, "--master-addr", "127.0.0.1", "--master-port"];
        let mut args = args.to_vec();
        args.extend([port.as_str(), "--no-prefix", OXCOMM, "store-ping"]);
        start_with(&args, &token)
    };
    // Node 1 first: its ranks retry until node 0's store is up.
    let node1 = node("1");
    let node0 = node("0");
    let (run0, run1) = (node0.finish(LIMIT), node1.finish(LIMIT));
    assert_eq!(run0.code, Some(0), "node 0: {}", run0.stderr);
    assert_eq!(run1.code, Some(0), "node 1: {}", run1.stderr);
    let lines0 = sorted_lines(&run0.stdout);
    let lines1 = sorted_lines(&run1.stdout);
    let job = lines0[0].rsplit(' ').next().unwrap();
    assert_eq!(
        [lines0, lines1].concat(),
        (0..4).map(|r| format!("store-ping: rank {r} of 4 ok, job {job}")).collect::<Vec<_>>()
    );
}

#[test]
fn multi_node_needs_a_shared_token() {
    let port = free_port().to_string();
    let run = start_with(
        &["launch", "-n", "1", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", &port, "true"],
        &[("OXCOMM_TOKEN", "")],
    )
    .finish(LIMIT);
    assert_eq!(run.code, Some(1));
    assert!(run.stderr.contains("OXCOMM_TOKEN") && run.stderr.contains("every node"), "{}", run.stderr);
    assert_eq!(run.stderr.lines().count(), 1, "{}", run.stderr);
}

#[test]
fn a_child_holding_the_output_open_does_not_hang_the_launcher() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("pid");
    // The rank exits at once; its background child keeps the rank's stdout open for 20 s.
    let script = format!("sleep 20 & echo $! > {}; echo started", pid_file.display());
    let run = launch(&["launch", "-n", "1", "sh", "-c", &script]);
    signal(read_pid(&pid_file), libc::SIGKILL);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(run.stdout, "[0] started\n");
    assert!(run.elapsed < Duration::from_secs(10), "took {:?}", run.elapsed);
}

// ---------------------------------------------------------------------------------------------
// --on-failure continue | restart, with the library's `ft_grow` example as the ranks
// ---------------------------------------------------------------------------------------------

/// The library's example, compiled into this test binary: [`ft_grow_rank`] runs it as a rank.
#[path = "../../../oxcomm/examples/ft_grow.rs"]
mod ft_grow;

/// A rank of the `ft_grow` example under the launcher; does nothing in a normal test run.
#[test]
fn ft_grow_rank() {
    if std::env::var("OXCOMM_TEST_FT_GROW").is_err() {
        return;
    }
    let code = match ft_grow::main() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("ft_grow failed: {e}");
            1
        }
    };
    std::process::exit(code)
}

/// Four ranks of `ft_grow` under `--on-failure <on_failure>`; rank 2 exits with status 17 at
/// step 50 of 200.
fn ft_grow_job(on_failure: &str) -> Run {
    let exe = std::env::current_exe().unwrap();
    let exe = exe.to_str().unwrap();
    let args = ["launch", "-n", "4", "--on-failure", on_failure, "--", exe];
    let test = ["--exact", "launch::ft_grow_rank", "--nocapture", "--test-threads=1", "-q"];
    let env = [("OXCOMM_TEST_FT_GROW", "1"), ("FT_DIE_RANK", "2"), ("OXCOMM_TIMEOUT", "20")];
    start_with(&[&args[..], &test[..]].concat(), &env).finish(Duration::from_secs(60))
}

/// The `DONE` lines of the ranks, sorted.
fn done_lines(out: &str) -> Vec<String> {
    let mut done: Vec<String> =
        out.lines().filter_map(|l| l.split_once("DONE ").map(|(_, rest)| rest.to_owned())).collect();
    done.sort();
    done
}

#[test]
fn issue39_on_failure_continue_lets_the_survivors_finish() {
    let run = ft_grow_job("continue");
    assert_eq!(run.code, Some(0), "stdout:\n{}\nstderr:\n{}", run.stdout, run.stderr);
    assert!(run.stderr.contains("rank 2 exited with status 17; the others go on"), "{}", run.stderr);
    let want: Vec<String> = (0..3).map(|r| format!("rank={r} size=3 steps=200")).collect();
    assert_eq!(done_lines(&run.stdout), want, "stderr:\n{}", run.stderr);
}

#[test]
fn issue39_on_failure_restart_grows_the_job_back_to_full_size() {
    let run = ft_grow_job("restart");
    assert_eq!(run.code, Some(0), "stdout:\n{}\nstderr:\n{}", run.stdout, run.stderr);
    assert!(
        run.stderr
            .contains("rank 2 exited with status 17; starting a replacement that joins the others (restart 1 of 3)"),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("joined as rank 3 of 4 at step"), "{}", run.stderr);
    let want: Vec<String> = (0..4).map(|r| format!("rank={r} size=4 steps=200")).collect();
    assert_eq!(done_lines(&run.stdout), want, "stderr:\n{}", run.stderr);
}

#[test]
fn issue39_on_failure_restart_beyond_max_restarts_goes_on_without_the_rank() {
    let exe = std::env::current_exe().unwrap();
    let args = ["launch", "-n", "4", "--on-failure", "restart", "--max-restarts", "0", "--", exe.to_str().unwrap()];
    let test = ["--exact", "launch::ft_grow_rank", "--nocapture", "--test-threads=1", "-q"];
    // Without a replacement the survivors' grow times out (3 s) naming rank 3: the job fails.
    let env = [("OXCOMM_TEST_FT_GROW", "1"), ("FT_DIE_RANK", "2"), ("OXCOMM_TIMEOUT", "3")];
    let run = start_with(&[&args[..], &test[..]].concat(), &env).finish(Duration::from_secs(60));
    assert!(run.stderr.contains("no restarts left (--max-restarts 0): the others go on"), "{}", run.stderr);
    assert!(run.stderr.contains("waiting for newcomer rank 3"), "{}", run.stderr);
    assert_ne!(run.code, Some(0), "{}", run.stderr);
}
