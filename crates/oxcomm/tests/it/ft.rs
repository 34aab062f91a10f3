//! Surviving a rank's death (issue 39): `revoke`, `agree`, `shrink` and the heartbeat
//! suspicion, on thread ranks and on ranks that are processes over shared memory, TCP and
//! shared memory plus TCP (two "hosts" on this machine, told apart by `OXCOMM_HOST_ID`).
//!
//! The process scenarios (`child_entry`, started by `harness::Job`) kill or freeze a rank at
//! each phase: inside an all-reduce loop, inside the agreement, inside the shrink, two at once,
//! a frozen rank that is resumed after the others have gone on, and a revocation racing the
//! loop. Every rank checks every result; the parent checks that the survivors report the same
//! failed set, that the shrunk communicator computes right, and that a frozen rank that comes
//! back completes no op its peers abandoned.

use std::time::{Duration, Instant};

use oxcomm::{threads, CommConfig, Communicator, ErrorKind, ReduceOp};

use crate::harness::{self, Exit, Job};

fn config(timeout_ms: u64, suspect_ms: u64) -> CommConfig {
    CommConfig {
        timeout: Duration::from_millis(timeout_ms),
        suspect_after: Duration::from_millis(suspect_ms),
        ..CommConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Thread ranks
// ---------------------------------------------------------------------------------------------

#[test]
fn issue39_revoke_fails_every_pending_and_future_op_on_every_member() {
    // Ranks 1..3 wait in an all-reduce (and rank 1 has async ops queued behind it) that rank 0
    // never joins; rank 0 revokes. Deadline 60 s: only the revocation can end them.
    let out = threads::run_with(4, config(60_000, 0), |comm| {
        if comm.rank() == 0 {
            std::thread::sleep(Duration::from_millis(300));
            comm.revoke().unwrap();
            comm.revoke().unwrap(); // again: nothing more happens
            assert!(comm.is_revoked());
            return vec![(comm.barrier().unwrap_err(), Duration::ZERO)];
        }
        let t = Instant::now();
        let mut errs = Vec::new();
        if comm.rank() == 1 {
            let a = comm.all_reduce_async(vec![1.0f32; 1000], ReduceOp::Sum);
            let b = comm.barrier_async();
            errs.push((a.wait().unwrap_err(), t.elapsed()));
            errs.push((b.wait().unwrap_err(), t.elapsed()));
        } else {
            errs.push((comm.all_reduce(&mut [1.0f32; 1000], ReduceOp::Sum).unwrap_err(), t.elapsed()));
        }
        // A later op fails at once too.
        let t = Instant::now();
        errs.push((comm.all_gather(&[1u8], &mut [0u8; 4]).unwrap_err(), t.elapsed()));
        errs
    })
    .unwrap();
    for (r, errs) in out.iter().enumerate() {
        for (e, took) in errs {
            assert_eq!(e.kind(), ErrorKind::Revoked, "rank {r}: {e}");
            assert_eq!(e.peer(), Some(0), "rank {r}: {e}");
            assert!(e.to_string().contains("rank 0 revoked the communicator"), "rank {r}: {e}");
            assert!(*took < Duration::from_secs(10), "rank {r} took {took:?}: {e}");
        }
    }
}

#[test]
fn issue39_a_revoke_racing_ops_ends_them_on_every_rank_and_shrink_goes_on() {
    // Rank 0 revokes from another thread at a different moment each round, while every rank
    // runs all-reduces back to back. No rank hangs, none sees a wrong sum, none completes
    // more than one op past another (an op may complete on some ranks and fail on others,
    // never complete on some and hang on others); then all four shrink and go on.
    for round in 0..8u64 {
        let out = threads::run_with(4, config(30_000, 0), |comm| {
            let revoker = (comm.rank() == 0).then(|| {
                let c = comm.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_micros(200 * round));
                    c.revoke().unwrap();
                })
            });
            let mut done = 0u64;
            let err = loop {
                let mut v = [comm.rank() as f64 + 1.0; 4];
                match comm.all_reduce(&mut v, ReduceOp::Sum) {
                    Ok(()) => assert_eq!(v, [10.0; 4]),
                    Err(e) => break e,
                }
                done += 1;
                assert!(done < 10_000_000, "never revoked");
            };
            if let Some(h) = revoker {
                h.join().unwrap();
            }
            assert_eq!((err.kind(), err.peer()), (ErrorKind::Revoked, Some(0)), "{err}");
            let small = comm.shrink().unwrap();
            assert_eq!((small.rank(), small.size()), (comm.rank(), 4));
            let mut v = [1.0f32];
            small.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            assert_eq!(v[0], 4.0);
            let a = small.agree(0b1).unwrap();
            assert_eq!(a, oxcomm::Agreed { flag: 1, failed: vec![] });
            done
        })
        .unwrap();
        let (lo, hi) = (out.iter().min().unwrap(), out.iter().max().unwrap());
        assert!(hi - lo <= 1, "round {round}: ops completed per rank {out:?}");
    }
}

#[test]
fn issue39_agree_is_the_and_of_the_survivors_flags_and_names_the_dead() {
    let out = threads::run_with(4, config(30_000, 0), |comm| {
        if comm.rank() == 3 {
            return None; // leaves: its links close when its communicator drops
        }
        Some(comm.agree(!(1u64 << comm.rank())).unwrap())
    })
    .unwrap();
    for a in &out[..3] {
        assert_eq!(a.as_ref().unwrap(), &oxcomm::Agreed { flag: !0b111, failed: vec![3] });
    }
}

/// `n` thread ranks run all-reduces; the ranks in `dying` leave at op 10 (their links close),
/// or at their first failed op if another's departure comes first; the others find out,
/// shrink, and check the shrunk communicator.
fn die_and_shrink(n: usize, dying: &[usize]) {
    let out = threads::run_with(n, config(30_000, 0), |comm| {
        let me = comm.rank();
        let all: f64 = (1..=n).map(|r| r as f64).sum();
        for i in 0.. {
            if dying.contains(&me) && i == 10 {
                break;
            }
            let mut v = [me as f64 + 1.0; 3];
            if comm.all_reduce(&mut v, ReduceOp::Sum).is_err() {
                break;
            }
            assert_eq!(v, [all; 3]);
        }
        if dying.contains(&me) {
            return None;
        }
        let small = comm.shrink().unwrap();
        let failed = comm.failed_ranks();
        assert_eq!(failed, dying);
        assert_eq!(small.size(), n - dying.len());
        assert_eq!(small.rank(), me - dying.iter().filter(|d| **d < me).count(), "renumbered in the old order");
        let mut v = [me as f64 + 1.0; 3];
        small.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        let left: f64 = (0..n).filter(|r| !dying.contains(r)).map(|r| r as f64 + 1.0).sum();
        assert_eq!(v, [left; 3]);
        Some(small.agree(1).unwrap())
    })
    .unwrap();
    for (r, a) in out.iter().enumerate() {
        if !dying.contains(&r) {
            assert_eq!(a.as_ref().unwrap(), &oxcomm::Agreed { flag: 1, failed: vec![] });
        }
    }
}

#[test]
fn issue39_shrink_after_a_death_in_an_op_renumbers_and_goes_on() {
    die_and_shrink(5, &[2]);
}

#[test]
fn issue39_two_ranks_dying_at_once_are_both_left_out() {
    die_and_shrink(6, &[1, 4]);
}

#[test]
fn issue39_a_rank_stuck_outside_the_library_is_suspected_left_out_and_told() {
    // Heartbeat lapse 300 ms, deadline 60 s: rank 1 spends 2.5 s outside the library.
    let out = threads::run_with(4, config(60_000, 300), |comm| {
        for _ in 0..5 {
            comm.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum).unwrap();
        }
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(2500));
            let e = comm.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum).unwrap_err();
            let s = comm.shrink().unwrap_err();
            return Err(Box::new((e, s)));
        }
        let t = Instant::now();
        let e = comm.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum).unwrap_err();
        let took = t.elapsed();
        let small = comm.shrink().unwrap();
        assert_eq!(small.size(), 3);
        small.barrier().unwrap();
        Ok((e, took, comm.failed_ranks()))
    })
    .unwrap();
    let mut suspected = 0;
    for (r, o) in out.into_iter().enumerate() {
        match o {
            Ok((e, took, failed)) => {
                assert_eq!((e.kind(), e.peer()), (ErrorKind::Suspected, Some(1)), "rank {r}: {e}");
                assert!(took < Duration::from_secs(3), "rank {r} waited {took:?}: {e}");
                assert_eq!(failed, vec![1]);
                if e.to_string().contains("rank 1 is suspected") {
                    assert!(e.to_string().contains("last seen in its all_reduce #"), "{e}");
                    suspected += 1;
                }
            }
            Err(b) => {
                let (e, s) = *b;
                assert_eq!(r, 1);
                assert_eq!(e.kind(), ErrorKind::Revoked, "{e}");
                assert_eq!(s.kind(), ErrorKind::Revoked, "{s}");
            }
        }
    }
    assert!(suspected >= 1, "no rank said it suspected rank 1");
}

#[test]
fn issue39_agree_and_shrink_of_a_group_are_unsupported() {
    threads::run(2, |comm| {
        let g = comm.new_group(&[0, 1]).unwrap().unwrap();
        assert_eq!(g.agree(1).unwrap_err().kind(), ErrorKind::Unsupported);
        assert_eq!(g.shrink().unwrap_err().kind(), ErrorKind::Unsupported);
        comm.barrier().unwrap();
    })
    .unwrap();
}

// ---------------------------------------------------------------------------------------------
// Ranks as processes
// ---------------------------------------------------------------------------------------------

/// The op deadline of the process scenarios: far above every bound checked, so a fault
/// caught only by the deadline fails them.
const OP_TIMEOUT_S: &str = "60";
/// How long a scenario may take.
const LIMIT: Duration = Duration::from_secs(60);

/// Ops each rank runs before it says `READY` (the scenarios act after that).
const WARMUP: u64 = 200;

/// How the ranks of a scenario talk.
#[derive(Debug, Clone, Copy)]
enum Net {
    Shm,
    Tcp,
    /// Ranks 0 and 1 on one "host", 2 and 3 on another.
    ShmTcp,
}

fn spawn(net: Net, role: &str, env: &[(&str, &str)]) -> Job {
    let mut spec = Job::of("ft::child_entry", role, 4, OP_TIMEOUT_S).envs(env);
    match net {
        Net::Shm => {}
        Net::Tcp => spec = spec.env("OXCOMM_TRANSPORT", "tcp"),
        Net::ShmTcp => {
            for r in 0..4 {
                spec = spec.rank_env(r, "OXCOMM_HOST_ID", if r < 2 { "host-a" } else { "host-b" });
            }
        }
    }
    spec.spawn()
}

/// The value after `prefix` on the first line of `out` that starts with it.
fn field<'a>(out: &'a str, prefix: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no line starting with {prefix:?} in:\n{out}"))
}

/// Checks the survivors: exit 0, the same failed set `failed` and shrunk size, the same
/// agreement.
fn survivors_agree(exits: &[Exit], survivors: &[usize], failed: &str) {
    let mut agreed = None;
    for &r in survivors {
        let e = &exits[r];
        assert_eq!(e.code, Some(0), "rank {r}:\n{}", e.out);
        let shrunk = field(&e.out, "SHRUNK ");
        assert!(shrunk.contains(&format!("size={} failed={failed}", survivors.len())), "rank {r}: {shrunk}");
        let a = field(&e.out, "AGREED ");
        assert_eq!(*agreed.get_or_insert(a), a, "rank {r}");
    }
}

/// Entry point of the child ranks. It does nothing in a normal test run (no role set).
#[test]
fn child_entry() {
    let Some(role) = harness::role() else { return };
    let comm = harness::init_child();
    let code = match role.as_str() {
        "loop" => loop_then_shrink(&comm),
        "agree" => die_in_agree(&comm),
        "shrink" => die_in_shrink(&comm),
        other => {
            eprintln!("unknown role {other}");
            2
        }
    };
    std::process::exit(code)
}

/// Ranks named in `OXCOMM_TEST_VICTIMS` (a comma list).
fn victims() -> Vec<usize> {
    std::env::var("OXCOMM_TEST_VICTIMS").unwrap_or_default().split(',').filter_map(|s| s.parse().ok()).collect()
}

/// The all-reduce every scenario runs: `[rank + 1; 2]` summed, checked against `want`.
fn step(comm: &Communicator, want: f64) -> oxcomm::Result<bool> {
    let mut v = [comm.rank() as f64 + 1.0; 2];
    comm.all_reduce(&mut v, ReduceOp::Sum)?;
    Ok(v == [want; 2])
}

/// After a failure: shrink, check the shrunk communicator, agree, report.
fn shrink_and_go_on(comm: &Communicator, since: Instant) -> i32 {
    let small = match comm.shrink() {
        Ok(s) => s,
        Err(e) => {
            println!("SHRINK FAILED {e}");
            return 6;
        }
    };
    let failed = comm.failed_ranks();
    println!("SHRUNK rank={} size={} failed={failed:?} ms={}", small.rank(), small.size(), since.elapsed().as_millis());
    let want: f64 = (0..comm.size()).filter(|r| !failed.contains(r)).map(|r| r as f64 + 1.0).sum();
    for _ in 0..20 {
        let mut v = [comm.rank() as f64 + 1.0; 2];
        if let Err(e) = small.all_reduce(&mut v, ReduceOp::Sum) {
            println!("SHRUNK OP FAILED {e}");
            return 6;
        }
        if v != [want; 2] {
            println!("WRONG on the shrunk communicator: {v:?}, expected {want}");
            return 9;
        }
    }
    match small.agree(0b11 & !(comm.rank() as u64 % 2)) {
        Ok(a) => println!("AGREED {a:?}"),
        Err(e) => {
            println!("AGREE FAILED {e}");
            return 6;
        }
    }
    match small.barrier() {
        Ok(()) => 0,
        Err(e) => {
            println!("BARRIER FAILED {e}");
            6
        }
    }
}

/// Runs all-reduces until one fails (a victim killed or frozen by the parent, or rank 0
/// revoking after `OXCOMM_TEST_REVOKE_US` µs), then shrinks and goes on. A rank named in
/// `OXCOMM_TEST_VICTIMS` that gets here was frozen and resumed: it reports how many ops it
/// completed and must be refused by shrink.
fn loop_then_shrink(comm: &Communicator) -> i32 {
    let me = comm.rank();
    let n = comm.size();
    let want = (n * (n + 1) / 2) as f64;
    let revoke_after =
        std::env::var("OXCOMM_TEST_REVOKE_US").ok().and_then(|v| v.parse().ok()).map(Duration::from_micros);
    let start = Instant::now();
    let mut revoker = None;
    let mut done = 0u64;
    let (at, err) = loop {
        if done == WARMUP {
            println!("READY");
            if let (0, Some(after)) = (me, revoke_after) {
                let c = comm.clone();
                revoker = Some(std::thread::spawn(move || {
                    std::thread::sleep(after);
                    c.revoke().unwrap();
                }));
            }
        }
        match step(comm, want) {
            Ok(true) => done += 1,
            Ok(false) => {
                println!("WRONG at op {done}");
                return 9;
            }
            Err(e) => break (done, e),
        }
        if start.elapsed() > LIMIT {
            println!("NO FAILURE");
            return 8;
        }
    };
    let since = Instant::now();
    if let Some(h) = revoker {
        h.join().unwrap();
    }
    println!("FAILED_AT {at} {:?} peer={:?}: {err}", err.kind(), err.peer());
    if victims().contains(&me) {
        println!("LAST {done}");
        return match comm.shrink() {
            Err(e) if e.kind() == ErrorKind::Revoked => 0,
            Err(e) => {
                println!("SHRINK FAILED OTHERWISE {e}");
                5
            }
            Ok(s) => {
                println!("SHRINK LET A LEFT-OUT RANK IN: size {}", s.size());
                5
            }
        };
    }
    shrink_and_go_on(comm, since)
}

/// Ten all-reduces before the agreement or shrink of a scenario; `Some(exit code)` on a
/// wrong sum. The last may fail with a revocation or a death (the rank that goes on first can
/// complete it and revoke, by shrinking, or die while a slower one still finishes it: an op
/// completes on some ranks and fails on others, as in ULFM); the scenario goes on then.
fn warm_up(comm: &Communicator) -> Option<i32> {
    for i in 0..10 {
        match step(comm, 10.0) {
            Ok(true) => {}
            Ok(false) => return Some(9),
            Err(e) if i == 9 && matches!(e.kind(), ErrorKind::Revoked | ErrorKind::PeerGone) => return None,
            Err(e) => {
                println!("WARMUP FAILED at op {i}: {e}");
                return Some(9);
            }
        }
    }
    None
}

/// Rank 0 enters an agreement and is killed there (the parent kills it when it says
/// `AGREEING`); the others join a second later and must agree without it.
fn die_in_agree(comm: &Communicator) -> i32 {
    if let Some(code) = warm_up(comm) {
        return code;
    }
    if comm.rank() == 0 {
        println!("AGREEING");
        let r = comm.agree(1);
        println!("RANK 0 WAS NOT KILLED: {r:?}");
        return 4;
    }
    std::thread::sleep(Duration::from_secs(1));
    match comm.agree(1) {
        Ok(a) if a.failed == [0] && a.flag == 1 => {}
        other => {
            println!("AGREE WITHOUT RANK 0 GAVE {other:?}");
            return 6;
        }
    }
    shrink_and_go_on(comm, Instant::now())
}

/// Rank 1 enters a shrink and is killed there (when it says `SHRINKING`); the others join a
/// second later and must shrink without it.
fn die_in_shrink(comm: &Communicator) -> i32 {
    if let Some(code) = warm_up(comm) {
        return code;
    }
    if comm.rank() == 1 {
        println!("SHRINKING");
        let r = comm.shrink().map(|s| s.size());
        println!("RANK 1 WAS NOT KILLED: {r:?}");
        return 4;
    }
    std::thread::sleep(Duration::from_secs(1));
    shrink_and_go_on(comm, Instant::now())
}

fn kill_in_op(net: Net) {
    let mut job = spawn(net, "loop", &[]);
    job.wait_line(2, LIMIT, |l| l == "READY");
    job.signal(2, libc::SIGKILL);
    let exits = job.wait_all(LIMIT);
    survivors_agree(&exits, &[0, 1, 3], "[2]");
    job.assert_clean();
}

fn two_kills(net: Net) {
    let mut job = spawn(net, "loop", &[]);
    job.wait_line(1, LIMIT, |l| l == "READY");
    job.wait_line(3, LIMIT, |l| l == "READY");
    job.signal(1, libc::SIGKILL);
    job.signal(3, libc::SIGKILL);
    let exits = job.wait_all(LIMIT);
    survivors_agree(&exits, &[0, 2], "[1, 3]");
    job.assert_clean();
}

/// Rank `victim` of role `role` says `line` on entering the phase and is killed there; the
/// others must go on without it.
fn kill_in_phase(net: Net, role: &str, victim: usize, line: &str) {
    let mut job = spawn(net, role, &[]);
    job.wait_line(victim, LIMIT, |l| l == line);
    std::thread::sleep(Duration::from_millis(100));
    job.signal(victim, libc::SIGKILL);
    let exits = job.wait_all(LIMIT);
    let survivors: Vec<usize> = (0..4).filter(|&r| r != victim).collect();
    survivors_agree(&exits, &survivors, &format!("[{victim}]"));
    job.assert_clean();
}

fn kill_in_agree(net: Net) {
    kill_in_phase(net, "agree", 0, "AGREEING");
}

fn kill_in_shrink(net: Net) {
    kill_in_phase(net, "shrink", 1, "SHRINKING");
}

/// Rank 1 is frozen (SIGSTOP) in the all-reduce loop; the others suspect it after the
/// heartbeat lapse (400 ms), shrink and go on; then it is resumed. It must complete no op that
/// a survivor failed (the defect of issue 39: it completed its in-flight all-reduce from the
/// contributions the others had written before they gave up), and be refused by shrink.
fn frozen_comes_back(net: Net) {
    let mut job = spawn(net, "loop", &[("OXCOMM_SUSPECT_AFTER_MS", "400"), ("OXCOMM_TEST_VICTIMS", "1")]);
    job.wait_line(1, LIMIT, |l| l == "READY");
    let frozen = Instant::now();
    job.signal(1, libc::SIGSTOP);
    for r in [0, 2, 3] {
        job.wait_line(r, LIMIT, |l| l.starts_with("SHRUNK "));
    }
    let moved_on = frozen.elapsed();
    job.signal(1, libc::SIGCONT);
    let exits = job.wait_all(LIMIT);
    survivors_agree(&exits, &[0, 2, 3], "[1]");
    assert!(moved_on < Duration::from_secs(10), "the survivors took {moved_on:?} to move on");
    let victim = &exits[1];
    assert_eq!(victim.code, Some(0), "rank 1:\n{}", victim.out);
    let last: u64 = field(&victim.out, "LAST ").parse().unwrap();
    let abandoned = [0, 2, 3]
        .iter()
        .map(|&r| field(&exits[r].out, "FAILED_AT ").split(' ').next().unwrap().parse::<u64>().unwrap())
        .min()
        .unwrap();
    assert!(
        last <= abandoned,
        "the resumed rank completed {last} ops, but op {abandoned} was abandoned by a survivor:\n{}",
        victim.out
    );
    assert!(field(&victim.out, "FAILED_AT ").contains("Revoked"), "{}", victim.out);
    job.assert_clean();
}

/// Rank 0 revokes from another thread while every rank runs all-reduces; all shrink (nobody
/// failed) and go on.
fn revoke_racing(net: Net) {
    let mut job = spawn(net, "loop", &[("OXCOMM_TEST_REVOKE_US", "300")]);
    let exits = job.wait_all(LIMIT);
    survivors_agree(&exits, &[0, 1, 2, 3], "[]");
    for e in &exits {
        assert!(field(&e.out, "FAILED_AT ").contains("Revoked peer=Some(0)"), "{}", e.out);
    }
    job.assert_clean();
}

macro_rules! on_every_net {
    ($($name:ident => $scenario:ident),* $(,)?) => {
        $(
            mod $name {
                use super::*;
                #[test]
                fn shm() {
                    $scenario(Net::Shm)
                }
                #[test]
                fn tcp() {
                    $scenario(Net::Tcp)
                }
                #[test]
                fn shm_tcp() {
                    $scenario(Net::ShmTcp)
                }
            }
        )*
    };
}

on_every_net! {
    issue39_kill_in_an_op => kill_in_op,
    issue39_two_kills_at_once => two_kills,
    issue39_kill_in_agree => kill_in_agree,
    issue39_kill_in_shrink => kill_in_shrink,
    issue39_frozen_rank_comes_back => frozen_comes_back,
    issue39_revoke_racing_ops => revoke_racing,
}
