//! One rank dies inside an all-reduce loop; the others shrink and go on. The program of
//! `bench/ft_shrink.sh` (it starts the ranks, each with `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT` and `OXCOMM_TOKEN`, and reads what they print).
//!
//! The last rank runs `FT_OPS` (2000) all-reduces, prints `KILL_NS <t>` (CLOCK_MONOTONIC, the
//! same clock in every process of the host) and SIGKILLs itself. The others run all-reduces
//! until one fails, shrink, run one all-reduce on the shrunk communicator, check it, and print
//! `DONE_NS <t> rank=<r> failed=<failed ranks>`: `DONE_NS - KILL_NS` is the time from the death
//! to the survivors' first completed op on the shrunk communicator.

use oxcomm::{ErrorKind, ReduceOp};

fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn main() -> Result<(), oxcomm::Error> {
    let comm = oxcomm::init()?;
    let (me, n) = (comm.rank(), comm.size());
    let ops: u64 = std::env::var("FT_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
    let victim = n - 1;
    let all = (n * (n + 1) / 2) as f32;
    let mut done = 0u64;
    let err = loop {
        if me == victim && done == ops {
            println!("KILL_NS {}", now_ns());
            // SAFETY: kill(2) on this process; it does not return.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        let mut v = [me as f32 + 1.0; 2];
        match comm.all_reduce(&mut v, ReduceOp::Sum) {
            Ok(()) => assert_eq!(v, [all; 2], "rank {me}: wrong sum at op {done}"),
            Err(e) => break e,
        }
        done += 1;
    };
    assert!(matches!(err.kind(), ErrorKind::PeerGone | ErrorKind::Revoked), "rank {me}: {err}");
    let small = comm.shrink()?;
    let failed = comm.failed_ranks();
    let mut v = [me as f32 + 1.0; 2];
    small.all_reduce(&mut v, ReduceOp::Sum)?;
    let t = now_ns();
    let want: f32 = (0..n).filter(|r| !failed.contains(r)).map(|r| r as f32 + 1.0).sum();
    assert_eq!(v, [want; 2], "rank {me}: wrong sum on the shrunk communicator");
    println!("DONE_NS {t} rank={me} failed={failed:?} after_ops={done}");
    small.barrier()?;
    Ok(())
}
