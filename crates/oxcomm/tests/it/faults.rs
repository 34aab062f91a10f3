//! Faults of issue 16 that need real processes or real shared memory: two ranks calling
//! different ops at one sequence number (item 2), a dead peer that left unread bytes in a
//! shared-memory ring (item 3), and (issue 28, item 8) a p2p `recv` that reads what a killed
//! rank left in its link, over shared memory and TCP. The test binary re-runs itself as the ranks
//! (`faults::child_entry`, started by `harness::Job` with the role), each rank printing what it saw;
//! the parent checks the errors, how long they took, and that `/dev/shm` is clean.

use std::time::{Duration, Instant};

use oxcomm::{Algorithm, ErrorKind, OpOptions, ReduceOp};

use crate::harness::{self, Exit, Job};

/// The op deadline the ranks run with: far above every bound checked here, so a fault that
/// is only caught by the deadline fails the test.
const OP_TIMEOUT_S: &str = "30";

/// `n` ranks of [`child_entry`] as `role`, with `env` over the job's environment.
fn spawn(n: usize, role: &str, env: &[(&str, &str)]) -> Job {
    Job::of("faults::child_entry", role, n, OP_TIMEOUT_S).envs(env).spawn()
}

/// Waits for every rank (at most 20 s, well under [`OP_TIMEOUT_S`]).
fn wait_all(job: &mut Job) -> Vec<Exit> {
    job.wait_all(Duration::from_secs(20))
}

/// Exit code of a rank whose op failed as expected (it printed `KIND <kind>` and
/// `MS <elapsed>` and the error).
const FAILED: i32 = 7;

/// Runs `op` and reports its error (exit [`FAILED`]) or success (exit 0).
fn report(op: impl FnOnce() -> oxcomm::Result<()>) -> ! {
    let t = Instant::now();
    let r = op();
    let ms = t.elapsed().as_millis();
    match r {
        Ok(()) => {
            println!("OK MS {ms}");
            std::process::exit(0)
        }
        Err(e) => {
            println!("KIND {:?}\nMS {ms}\nERROR {e}", e.kind());
            std::process::exit(FAILED)
        }
    }
}

/// Entry point of the child ranks. It does nothing in a normal test run (no role set).
#[test]
fn child_entry() {
    let Some(role) = harness::role() else { return };
    let comm = oxcomm::init().unwrap_or_else(|e| {
        eprintln!("init failed: {e}");
        std::process::exit(3)
    });
    let me = comm.rank();
    let ring = OpOptions { algorithm: Some(Algorithm::Ring), ..OpOptions::default() };
    // Warm up: both ranks are set up and past one op before the fault.
    comm.barrier().unwrap();
    match role.as_str() {
        "barrier_vs_all_gather" => report(|| {
            // The all_gather over the links (ring), the barrier on the direct path.
            if me == 1 {
                let mut out = vec![0f32; 4 * comm.size()];
                comm.all_gather_with(&[1.0f32; 4], &mut out, &ring)
            } else {
                comm.barrier()
            }
        }),
        "root_agrees" => report(|| {
            // Rank 0, the agreement's root, over the links; the others on the direct path.
            if me == 0 {
                let mut out = vec![0f32; 4 * comm.size()];
                comm.all_gather_with(&[1.0f32; 4], &mut out, &ring)
            } else {
                comm.barrier()
            }
        }),
        "all_gather_vs_reduce_scatter" => report(|| {
            // Both on the direct path; large enough for its chunked steps.
            let n = comm.size();
            if me == 1 {
                let mut out = vec![0f32; 1 << 18];
                comm.reduce_scatter(&vec![1.0f32; n << 18], &mut out, ReduceOp::Sum)
            } else {
                let mut out = vec![0f32; n << 18];
                comm.all_gather(&vec![1.0f32; 1 << 18], &mut out)
            }
        }),
        "all_gather_direct_vs_ring" => report(|| {
            // The same op, but rank 1 forces the ring: the paths must still meet.
            let mut buf = vec![1.0f32; 256 * comm.size()];
            let algorithm = (me == 1).then_some(Algorithm::Ring);
            comm.all_gather_in_place_with(&mut buf, &OpOptions { algorithm, ..OpOptions::default() })
        }),
        "all_reduce_vs_reduce" => report(|| {
            let mut buf = vec![1.0f32; 256];
            if me == 1 {
                // A small reduce's non-root publishes and leaves (a loose arrival on the
                // direct path): it learns of the mismatch at its next op.
                comm.reduce(&mut buf, 0, ReduceOp::Sum)?;
                comm.barrier()
            } else {
                comm.all_reduce(&mut buf, ReduceOp::Sum)
            }
        }),
        "broadcast_roots_differ" => report(|| {
            // Each rank roots its own small broadcast: on the direct path a root does not wait
            // for the others, so the mismatch must surface at the next op, on both ranks.
            let mut buf = vec![me as f32; 4];
            comm.broadcast(&mut buf, me)?;
            comm.barrier()
        }),
        "loose_ops_only" => report(|| {
            // Rank 0 roots small broadcasts, rank 1 is a non-root of small reduces: neither
            // arrival waits for the other, so the mismatch surfaces when a rank would run more
            // than EAGER (SLOTS - 1) direct ops ahead of the other.
            let mut buf = vec![1.0f32; 4];
            for _ in 0..64 {
                if me == 0 {
                    comm.broadcast(&mut buf, 0)?;
                } else {
                    comm.reduce(&mut buf, 0, ReduceOp::Sum)?;
                }
            }
            Ok(())
        }),
        "broadcast_vs_all_reduce" => report(|| {
            let mut buf = vec![1.0f32; 4];
            if me == 0 {
                comm.broadcast(&mut buf, 0)?;
                comm.barrier()
            } else {
                comm.all_reduce(&mut buf, ReduceOp::Sum)
            }
        }),
        "direct_vs_ring" => report(|| {
            // The same op, but rank 1 forces the ring: the paths must still meet.
            let mut buf = vec![1.0f32; 256];
            let algorithm = (me == 1).then_some(Algorithm::Ring);
            comm.all_reduce_with(&mut buf, ReduceOp::Sum, &OpOptions { algorithm, ..OpOptions::default() })
        }),
        "all_to_all_vs_gather" => report(|| {
            let n = comm.size();
            if me == 1 {
                comm.all_to_all(&vec![1.0f32; 4 * n], &mut vec![0.0f32; 4 * n])
            } else {
                let mut out = vec![0f32; 4 * n];
                comm.gather(&[1.0f32; 4], (me == 0).then_some(&mut out[..]), 0)
            }
        }),
        "reduce_vs_scatter" => report(|| {
            // Large buffers: the ranks meet at arrival, before any chunk step.
            let mut buf = vec![1.0f32; 1 << 20];
            if me == 2 {
                let all = vec![1.0f32; 3 << 20];
                comm.scatter((me == 0).then_some(&all[..]), &mut buf, 0)
            } else {
                comm.reduce(&mut buf, 0, ReduceOp::Sum)
            }
        }),
        "all_to_all_v_counts" | "all_to_all_v_counts_large" => report(|| {
            // Every rank sends k elements to every rank, but rank 1 expects k + 1 from rank 0.
            let (n, k) = (comm.size(), if role == "all_to_all_v_counts" { 3 } else { 300_001 });
            let send_counts = vec![k; n];
            let recv_counts: Vec<usize> = (0..n).map(|p| k + usize::from(me == 1 && p == 0)).collect();
            let send = vec![me as i32; k * n];
            let mut recv = vec![-1i32; recv_counts.iter().sum()];
            let r = comm.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts);
            if recv.iter().any(|x| *x != -1) {
                println!("WRITTEN");
            }
            r
        }),
        "leftover_bytes" | "leftover_bytes_no_drop" | "leftover_bytes_then_all_gather" => {
            if me == 1 {
                // 64 bytes rank 0 never receives, then go away.
                comm.send(&[7u8; 64], 0, 5).unwrap();
                if role != "leftover_bytes" {
                    // As if killed: no link is closed.
                    std::mem::forget(comm);
                } else {
                    drop(comm);
                }
                std::process::exit(0);
            }
            // Let rank 1 be gone before the barrier (it may also die during it).
            std::thread::sleep(Duration::from_millis(300));
            if role == "leftover_bytes_then_all_gather" {
                // An op that reads the link: the bytes are not rank 1's fingerprint.
                let mut out = vec![0f32; 4 * comm.size()];
                report(|| comm.all_gather(&[1.0f32; 4], &mut out))
            }
            report(|| comm.barrier())
        }
        "p2p_leftover" | "p2p_dies_mid_message" => {
            // Rank 1 leaves a p2p message (whole, or cut off mid-payload) in rank 0's link and
            // is killed; rank 0 then receives with another tag (the leftover header does not
            // match) or the same one (the payload never ends).
            let whole = role == "p2p_leftover";
            let len = if whole { 64 } else { 64 << 20 };
            if me == 1 {
                if !whole {
                    // Killed while the send waits for room: the header and part of the
                    // payload are in the link.
                    std::thread::spawn(|| {
                        std::thread::sleep(Duration::from_millis(300));
                        die();
                    });
                }
                let _ = comm.send(&vec![7u8; len], 0, 5);
                die();
            }
            std::thread::sleep(Duration::from_millis(600));
            let mut buf = vec![0u8; len];
            report(|| comm.recv(&mut buf, 1, if whole { 6 } else { 5 }))
        }
        "flight" => {
            // One more op together, then one rank 1 never joins (it sleeps past the
            // deadline, alive): rank 0 times out naming it and writes its flight record.
            comm.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum).unwrap();
            if me == 1 {
                std::thread::sleep(Duration::from_secs(3));
                std::process::exit(0);
            }
            report(|| {
                let mut out = vec![0u8; 4 * comm.size()];
                comm.all_gather(&[1u8; 4], &mut out)
            })
        }
        other => panic!("unknown role {other}"),
    }
}

/// Ends this process as SIGKILL would (no destructor, no link closed).
fn die() -> ! {
    // SAFETY: kill(2) on this process; it does not return.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    unreachable!("SIGKILL returned")
}

/// The `(kind, ms, output)` a failed rank printed.
fn failure(r: usize, code: Option<i32>, out: &str) -> (String, u128) {
    assert_eq!(code, Some(FAILED), "rank {r} did not fail as expected:\n{out}");
    let field = |k: &str| out.lines().find_map(|l| l.strip_prefix(k)).map(str::to_string);
    let kind = field("KIND ").unwrap_or_else(|| panic!("rank {r} printed no kind:\n{out}"));
    let ms = field("MS ").and_then(|v| v.trim().parse().ok()).unwrap_or_else(|| panic!("rank {r}: no time:\n{out}"));
    (kind, ms)
}

/// Issue 16, item 9: a rank that times out on a hung peer writes its last ops to the file
/// `OXCOMM_FLIGHT_RECORDER` names (`<prefix><rank>`), and its error shows them.
#[test]
fn issue16_flight_record_file_shows_where_a_rank_stopped() {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "oxcomm-flight-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = format!("{}/trace_rank_", dir.display());
    let mut job = spawn(2, "flight", &[("OXCOMM_FLIGHT_RECORDER", &prefix), ("OXCOMM_TIMEOUT", "1")]);
    let results = wait_all(&mut job);
    let file = std::fs::read_to_string(format!("{prefix}0"));
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(results[1].code, Some(0), "rank 1:\n{}", results[1].out);
    let out = &results[0].out;
    let (kind, _) = failure(0, results[0].code, out);
    assert_eq!(kind, format!("{:?}", ErrorKind::Timeout), "rank 0:\n{out}");
    let error = out.lines().find(|l| l.starts_with("ERROR ")).unwrap();
    // `init`'s barrier, the warm-up barrier, the all_reduce, the all_gather that hung.
    let want = "last ops on rank 0: barrier #0 done, barrier #1 done, all_reduce #2 (f32 × 4, sum) done, \
                all_gather #3 (u8 × 4) timed out (rank 1)";
    assert!(error.contains(want), "{error}");
    assert!(error.contains(&format!("{prefix}0")), "the error does not name the file: {error}");
    let file = file.expect("rank 0 wrote no flight record");
    let lines: Vec<&str> = file.lines().collect();
    assert_eq!(lines.len(), 4, "{file}");
    assert!(lines[0].contains("\"seq\":0,\"op\":\"barrier\"") && lines[0].contains("\"state\":\"done\""), "{file}");
    assert!(lines[3].contains("\"seq\":3,\"op\":\"all_gather\"") && lines[3].contains("\"dtype\":\"u8\""), "{file}");
    assert!(lines[3].contains("\"state\":\"failed\",\"error\":\"timed out\",\"peer\":1"), "{file}");
    job.assert_clean();
}

/// Issue 16, item 9, on threads: the error of an op that times out lists the rank's last
/// ops, and `flight_record` has them all.
#[test]
fn issue16_timeout_error_lists_the_last_ops() {
    let config = oxcomm::CommConfig { timeout: Duration::from_millis(500), ..oxcomm::CommConfig::default() };
    let out = oxcomm::threads::run_with(2, config, |comm| {
        comm.all_reduce(&mut [1i32; 3], ReduceOp::Max).unwrap();
        comm.barrier().unwrap();
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            return None;
        }
        let e = comm.broadcast(&mut [0i64; 2], 1).unwrap_err();
        Some((e, comm.flight_record()))
    })
    .unwrap();
    let (e, record) = out[0].clone().unwrap();
    assert_eq!((e.kind(), e.peer()), (ErrorKind::Timeout, Some(1)), "{e}");
    let want = "last ops on rank 0: all_reduce #0 (i32 × 3, max) done, barrier #1 done, broadcast #2 (i64 × 2, root 1) timed out (rank 1)";
    assert!(e.message().contains(want), "{e}");
    assert_eq!(record.lines().count(), 3, "{record}");
}

/// Runs a 2- or 3-rank job where ranks call different ops; every rank must fail with
/// `Mismatch` naming another rank and showing both ops, in under a second.
fn mismatch_is_named_fast(n: usize, role: &str, env: &[(&str, &str)], ops: [&str; 2]) {
    let mut job = spawn(n, role, env);
    let results = wait_all(&mut job);
    for (r, Exit { code, out, .. }) in results.iter().enumerate() {
        let (kind, ms) = failure(r, *code, out);
        assert_eq!(kind, format!("{:?}", ErrorKind::Mismatch), "rank {r}:\n{out}");
        let error = out.lines().find(|l| l.starts_with("ERROR ")).unwrap();
        for op in ops {
            assert!(error.contains(op), "rank {r} does not show {op}:\n{out}");
        }
        let other = (0..n).filter(|p| *p != r).any(|p| error.contains(&format!("rank {p} called")));
        assert!(other, "rank {r} does not name another rank as the one that called the other op:\n{out}");
        assert!(ms < 1000, "rank {r} took {ms} ms:\n{out}");
    }
    job.assert_clean();
}

#[test]
fn shm_broadcasts_from_different_roots_are_a_mismatch_by_the_next_op() {
    mismatch_is_named_fast(2, "broadcast_roots_differ", &[], ["broadcast", "root"]);
}

#[test]
fn shm_loose_ops_that_differ_are_a_mismatch_without_a_full_op() {
    mismatch_is_named_fast(2, "loose_ops_only", &[], ["broadcast", "reduce"]);
}

#[test]
fn shm_broadcast_against_all_reduce_is_a_mismatch_on_both_ranks() {
    mismatch_is_named_fast(2, "broadcast_vs_all_reduce", &[], ["broadcast", "all_reduce"]);
}

#[test]
fn issue16_shm_barrier_against_all_gather_is_a_mismatch_at_once() {
    mismatch_is_named_fast(2, "barrier_vs_all_gather", &[], ["barrier", "all_gather"]);
}

#[test]
fn issue16_shm_three_ranks_direct_and_agreed_ops_meet() {
    // Ranks 0 and 2 on the direct path, rank 1 over the links.
    mismatch_is_named_fast(3, "barrier_vs_all_gather", &[], ["barrier", "all_gather"]);
}

#[test]
fn issue16_shm_agreement_root_meets_ranks_on_the_direct_path() {
    mismatch_is_named_fast(3, "root_agrees", &[], ["barrier", "all_gather"]);
}

#[test]
fn issue16_shm_all_reduce_against_reduce_is_a_mismatch_at_once() {
    mismatch_is_named_fast(2, "all_reduce_vs_reduce", &[], ["all_reduce", "reduce"]);
}

#[test]
fn issue16_shm_same_op_on_direct_and_ring_paths_is_a_mismatch_at_once() {
    mismatch_is_named_fast(2, "direct_vs_ring", &[], ["all_reduce", "different algorithms"]);
}

#[test]
fn shm_direct_all_gather_against_reduce_scatter_is_a_mismatch_at_once() {
    mismatch_is_named_fast(3, "all_gather_vs_reduce_scatter", &[], ["all_gather", "reduce_scatter"]);
}

#[test]
fn shm_same_all_gather_on_direct_and_ring_paths_is_a_mismatch_at_once() {
    mismatch_is_named_fast(2, "all_gather_direct_vs_ring", &[], ["all_gather", "different algorithms"]);
}

#[test]
fn issue16_tcp_barrier_against_all_gather_is_a_mismatch_at_once() {
    mismatch_is_named_fast(2, "barrier_vs_all_gather", &[("OXCOMM_TRANSPORT", "tcp")], ["barrier", "all_gather"]);
}

#[test]
fn shm_direct_all_to_all_against_gather_is_a_mismatch_at_once() {
    mismatch_is_named_fast(2, "all_to_all_vs_gather", &[], ["all_to_all", "gather"]);
}

#[test]
fn shm_direct_reduce_against_scatter_is_a_mismatch_at_once() {
    mismatch_is_named_fast(3, "reduce_vs_scatter", &[], ["reduce", "scatter"]);
}

/// all_to_all_v where rank 1 expects one element more from rank 0 than rank 0 sends: every
/// rank fails with `Mismatch` at once and writes nothing; ranks 0 and 1 name each other.
fn all_to_all_v_counts_disagree(role: &str, env: &[(&str, &str)]) {
    let mut job = spawn(3, role, env);
    let results = wait_all(&mut job);
    for (r, Exit { code, out, .. }) in results.iter().enumerate() {
        let (kind, ms) = failure(r, *code, out);
        assert_eq!(kind, format!("{:?}", ErrorKind::Mismatch), "rank {r}:\n{out}");
        assert!(!out.contains("WRITTEN"), "rank {r} wrote into recv:\n{out}");
        let named = match r {
            0 => "rank 1 expects",
            1 => "rank 0 sends",
            _ => "rank 0 sends",
        };
        assert!(out.contains(named), "rank {r} does not say {named:?}:\n{out}");
        assert!(ms < 1000, "rank {r} took {ms} ms:\n{out}");
    }
    job.assert_clean();
}

#[test]
fn shm_direct_all_to_all_v_counts_that_disagree_fail_on_every_rank() {
    all_to_all_v_counts_disagree("all_to_all_v_counts", &[]);
}

#[test]
fn shm_direct_all_to_all_v_counts_that_disagree_fail_on_every_rank_large() {
    all_to_all_v_counts_disagree("all_to_all_v_counts_large", &[]);
}

/// Rank 1 leaves 64 unread bytes in rank 0's ring and exits; rank 0's barrier must report it
/// gone (not wait out the deadline).
fn dead_peer_with_unread_bytes(role: &str) {
    rank_1_is_gone(role, &[], Some(0));
}

/// Rank 1 leaves bytes in rank 0's link and exits with `rank_1_exit` (`None`: killed); rank 0
/// must fail naming it gone, promptly.
fn rank_1_is_gone(role: &str, env: &[(&str, &str)], rank_1_exit: Option<i32>) {
    let mut job = spawn(2, role, env);
    let results = wait_all(&mut job);
    assert_eq!(results[1].code, rank_1_exit, "rank 1:\n{}", results[1].out);
    let (kind, ms) = failure(0, results[0].code, &results[0].out);
    assert_eq!(kind, format!("{:?}", ErrorKind::PeerGone), "rank 0:\n{}", results[0].out);
    assert!(results[0].out.contains("rank 1"), "rank 0 does not name rank 1:\n{}", results[0].out);
    // The check runs every 50 ms; allow for a loaded machine.
    assert!(ms < 1000, "rank 0 took {ms} ms:\n{}", results[0].out);
    job.assert_clean();
}

#[test]
fn issue16_shm_dead_peer_that_closed_with_unread_bytes_is_gone() {
    dead_peer_with_unread_bytes("leftover_bytes");
}

#[test]
fn issue16_shm_dead_peer_that_vanished_with_unread_bytes_is_gone() {
    dead_peer_with_unread_bytes("leftover_bytes_no_drop");
}

#[test]
fn issue16_shm_dead_peer_with_unread_bytes_is_gone_to_an_op_reading_its_link() {
    dead_peer_with_unread_bytes("leftover_bytes_then_all_gather");
}

/// Issue 28, item 8: rank 1 leaves a p2p message in rank 0's link and is killed; rank 0's
/// `recv` reads what it left and must report rank 1 gone (not a mismatch, not at the deadline).
fn p2p_from_a_dead_rank_is_gone(role: &str, env: &[(&str, &str)]) {
    rank_1_is_gone(role, env, None);
}

#[test]
fn issue28_shm_recv_of_a_dead_ranks_leftover_header_is_gone() {
    p2p_from_a_dead_rank_is_gone("p2p_leftover", &[]);
}

#[test]
fn issue28_tcp_recv_of_a_dead_ranks_leftover_header_is_gone() {
    p2p_from_a_dead_rank_is_gone("p2p_leftover", &[("OXCOMM_TRANSPORT", "tcp")]);
}

#[test]
fn issue28_shm_recv_of_a_dead_ranks_cut_off_message_is_gone() {
    p2p_from_a_dead_rank_is_gone("p2p_dies_mid_message", &[]);
}

#[test]
fn issue28_tcp_recv_of_a_dead_ranks_cut_off_message_is_gone() {
    p2p_from_a_dead_rank_is_gone("p2p_dies_mid_message", &[("OXCOMM_TRANSPORT", "tcp")]);
}
