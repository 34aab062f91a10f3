//! One rank dies (or freezes) inside an all-reduce loop; the others shrink and go on. The
//! program of `bench/ft_shrink.sh` (it starts the ranks, each with `RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT` and `OXCOMM_TOKEN`, and reads what they print).
//!
//! The last rank runs `FT_OPS` (2000) all-reduces, prints `KILL_NS <t>` (CLOCK_MONOTONIC, the
//! same clock in every process of the host, and in every network namespace of it) and
//! SIGKILLs itself; with `FT_MODE=freeze` it SIGSTOPs itself instead, and once resumed (the
//! script sends SIGCONT after the survivors are done) runs one more all-reduce, which must
//! fail: it prints `LEFT_OUT <error kind>` (or `COMPLETED`, a defect). The others run
//! all-reduces until one fails (printing `ERROR_NS <t>`: `ERROR_NS - KILL_NS` is the time from
//! the death to this survivor's error), shrink, run one all-reduce on the shrunk communicator,
//! check it, and print `DONE_NS <t> rank=<r> failed=<failed ranks>`: `DONE_NS - KILL_NS` is the
//! time from the death to the survivors' first completed op on the shrunk communicator. Then they
//! stay `FT_LINGER_MS` (0) with their links open, so that a frozen rank resumed meanwhile
//! meets survivors that have left it out, not closed connections.

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
    let freeze = std::env::var("FT_MODE").is_ok_and(|m| m == "freeze");
    let linger: u64 = std::env::var("FT_LINGER_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let victim = n - 1;
    if me == victim {
        println!("PID {}", std::process::id());
    }
    let all = (n * (n + 1) / 2) as f32;
    let mut done = 0u64;
    let err = loop {
        if me == victim && done == ops {
            println!("KILL_NS {}", now_ns());
            if !freeze {
                // SAFETY: kill(2) on this process; it does not return.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
            use std::io::Write as _;
            std::io::stdout().flush().map_err(|e| oxcomm::Error::new(ErrorKind::Io, e.to_string()))?;
            // SAFETY: kill(2) on this process; it returns once the script sends SIGCONT.
            unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
            let mut v = [me as f32 + 1.0; 2];
            match comm.all_reduce(&mut v, ReduceOp::Sum) {
                Ok(()) => println!("COMPLETED {v:?}"),
                Err(e) => println!("LEFT_OUT {:?}: {e}", e.kind()),
            }
            return Ok(());
        }
        let mut v = [me as f32 + 1.0; 2];
        match comm.all_reduce(&mut v, ReduceOp::Sum) {
            Ok(()) => assert_eq!(v, [all; 2], "rank {me}: wrong sum at op {done}"),
            Err(e) => {
                println!("ERROR_NS {}", now_ns());
                break e;
            }
        }
        done += 1;
    };
    assert!(matches!(err.kind(), ErrorKind::PeerGone | ErrorKind::Revoked | ErrorKind::Suspected), "rank {me}: {err}");
    let small = comm.shrink()?;
    let failed = comm.failed_ranks();
    let mut v = [me as f32 + 1.0; 2];
    small.all_reduce(&mut v, ReduceOp::Sum)?;
    let t = now_ns();
    let want: f32 = (0..n).filter(|r| !failed.contains(r)).map(|r| r as f32 + 1.0).sum();
    assert_eq!(v, [want; 2], "rank {me}: wrong sum on the shrunk communicator");
    println!("DONE_NS {t} rank={me} failed={failed:?} after_ops={done}");
    small.barrier()?;
    std::thread::sleep(std::time::Duration::from_millis(linger));
    small.barrier()?;
    Ok(())
}
