//! The 1-bit compressed all-reduce against the exact f32 all-reduce, on thread ranks.
//!
//! `cargo bench -p oxcomm --bench onebit` runs 1 Mi f32 (4 MiB) on 2 and 4 thread ranks:
//! one warm-up call of each, then 15 timed calls; each call starts after a barrier and its time
//! is the slowest rank's, and the line shows the median. It also prints the bytes rank 0 sent
//! per call (`Communicator::stats`). Without `--bench` (as under `cargo test --all-targets`)
//! it runs a tiny smoke pass instead.
//!
//! Thread ranks share the memory bus and the cores: on a machine with fewer cores than ranks
//! the times include scheduling, and the exact all-reduce moves memory at memcpy speed, so
//! compression mostly trades bandwidth for compute here; the byte counts show what a slower
//! link would carry.

use std::time::{Duration, Instant};

use oxcomm::compression::onebit::{self, OneBitState};
use oxcomm::{threads, Communicator, ReduceOp};

/// Times `runs` calls of `op` after one warm-up; returns (median of the slowest rank per call,
/// bytes rank 0 sent per call).
fn bench(
    ranks: usize,
    len: usize,
    runs: usize,
    op: fn(&Communicator, &mut [f32], &mut OneBitState),
) -> (Duration, u64) {
    let per_rank = threads::run(ranks, |comm| {
        let mut buf: Vec<f32> = (0..len).map(|k| ((k * 7 + comm.rank() * 13) % 101) as f32 / 50.0 - 1.0).collect();
        let mut state = OneBitState::new(len, ranks).expect("state");
        op(&comm, &mut buf, &mut state);
        let mut times = Vec::with_capacity(runs);
        let mut bytes = 0;
        for _ in 0..runs {
            comm.barrier().expect("barrier");
            let before = comm.stats().bytes_sent;
            let start = Instant::now();
            op(&comm, &mut buf, &mut state);
            times.push(start.elapsed());
            bytes = comm.stats().bytes_sent - before;
        }
        (times, bytes)
    })
    .expect("ranks");
    let mut slowest: Vec<Duration> =
        (0..runs).map(|i| per_rank.iter().map(|(t, _)| t[i]).max().expect("ranks")).collect();
    slowest.sort();
    (slowest[runs / 2], per_rank[0].1)
}

fn exact(comm: &Communicator, buf: &mut [f32], _: &mut OneBitState) {
    comm.all_reduce(buf, ReduceOp::Avg).expect("all_reduce");
}

fn compressed(comm: &Communicator, buf: &mut [f32], state: &mut OneBitState) {
    onebit::all_reduce(comm, buf, state).expect("onebit::all_reduce");
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (len, runs) = if full { (1 << 20, 15) } else { (4096, 3) };
    println!("{len} f32 ({} KiB), median of {runs} calls (slowest rank each)", len * 4 / 1024);
    println!(
        "{:>5}  {:>14}  {:>14}  {:>8}  {:>12}  {:>12}",
        "ranks", "exact", "1-bit", "speedup", "exact B/call", "1-bit B/call"
    );
    for ranks in [2, 4] {
        let (t_exact, b_exact) = bench(ranks, len, runs, exact);
        let (t_onebit, b_onebit) = bench(ranks, len, runs, compressed);
        println!(
            "{ranks:>5}  {:>11.3} ms  {:>11.3} ms  {:>7.2}×  {b_exact:>12}  {b_onebit:>12}",
            t_exact.as_secs_f64() * 1e3,
            t_onebit.as_secs_f64() * 1e3,
            t_exact.as_secs_f64() / t_onebit.as_secs_f64(),
        );
    }
}
