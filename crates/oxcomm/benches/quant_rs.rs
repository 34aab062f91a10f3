//! qgZ quantized reduce-scatter against the exact reduce-scatter, on 4 thread ranks laid out
//! as 2 hosts × 2 ranks.
//!
//! `cargo bench -p oxcomm --bench quant_rs` gives every rank 16 MiB of f32 (a 2048 × 2048
//! tensor: 2048 int4 groups of 2048) and runs, median of 11 timed runs after one warm-up:
//! `all_to_all_quant_reduce` (both phases), the exact `reduce_scatter` (f32 ring, mean) and,
//! for the bandwidth claim, the same in f16. Times are rank 0's, between two barriers. Bytes
//! are one run's `Communicator::stats()` deltas summed over the 4 ranks: everything sent, and
//! what crosses hosts (qgZ: its inter-host phase; ring: the sends of each host's last rank,
//! whose ring successor is on the other host). Thread ranks share memory, so the times show
//! the CPU cost of quantizing, not a network's; the bytes are what a network would carry.
//! Without `--bench` (as under `cargo test --all-targets`) it runs a tiny smoke pass.

use std::hint::black_box;
use std::time::{Duration, Instant};

use half::f16;
use oxcomm::compression::host_groups::HostGroups;
use oxcomm::compression::qgz::{all_to_all_quant_reduce_report, TensorView};
use oxcomm::engine::LinkStats;
use oxcomm::{threads, Communicator, ReduceOp};

const RANKS: usize = 4;
const PER_HOST: usize = 2;

/// One timed run on one rank: its time (rank 0's is reported), bytes sent in total and bytes
/// it sent across hosts.
struct Sample {
    time: Duration,
    sent: u64,
    cross: u64,
}

fn timed(comm: &Communicator, mut f: impl FnMut() -> Option<LinkStats>) -> Sample {
    comm.barrier().unwrap();
    let before = comm.stats();
    let start = Instant::now();
    let inter = f();
    let time = start.elapsed();
    let sent = comm.stats().bytes_sent - before.bytes_sent;
    comm.barrier().unwrap();
    // The ring sends to rank + 1: across hosts only from each host's last rank.
    let cross = match inter {
        Some(s) => s.bytes_sent,
        None if comm.rank() % PER_HOST == PER_HOST - 1 => sent,
        None => 0,
    };
    Sample { time, sent, cross }
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (side, runs) = if full { (2048usize, 11) } else { (64, 1) };
    let n = side * side;
    // Per rank, per op: one Sample per run.
    let results = threads::run(RANKS, |comm| {
        let groups = HostGroups::uniform(&comm, PER_HOST).unwrap();
        let mut x = 0x9E37_79B9u32 ^ (comm.rank() as u32).wrapping_mul(0x85EB_CA6B);
        let src: Vec<f32> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as i32) as f32 / 2_147_483_648.0
            })
            .collect();
        let src16: Vec<f16> = src.iter().map(|&v| f16::from_f32(v)).collect();
        let mut out = vec![0f32; n / RANKS];
        let mut out16 = vec![f16::ZERO; n / RANKS];
        let view = [TensorView::new(&src, &[side, side]).unwrap()];
        let mut rows: Vec<(&str, Vec<Sample>)> = Vec::new();
        let mut bench = |name, f: &mut dyn FnMut() -> Option<LinkStats>| {
            f(); // warm-up
            rows.push((name, (0..runs).map(|_| timed(&comm, &mut *f)).collect()));
        };
        bench("qgZ all_to_all_quant_reduce (int4)", &mut || {
            let (o, rep) = all_to_all_quant_reduce_report(&comm, &view, Some(&groups)).unwrap();
            assert_eq!(rep.quantized, 1);
            black_box(o);
            Some(rep.inter)
        });
        bench("reduce_scatter f32 (exact mean)", &mut || {
            comm.reduce_scatter(black_box(&src), &mut out, ReduceOp::Avg).unwrap();
            None
        });
        bench("reduce_scatter f16 (exact mean)", &mut || {
            comm.reduce_scatter(black_box(&src16), &mut out16, ReduceOp::Avg).unwrap();
            None
        });
        rows
    })
    .unwrap();

    println!(
        "{RANKS} thread ranks as {} hosts x {PER_HOST}, {} MiB f32 per rank ({side} x {side}), median of {runs}",
        RANKS / PER_HOST,
        (n * 4) >> 20
    );
    println!("{:<38} {:>12} {:>16} {:>18}", "op", "median ms", "bytes sent (all)", "bytes across hosts");
    let exact_cross = results[0]
        .iter()
        .position(|(name, _)| name.starts_with("reduce_scatter f32"))
        .map(|i| results.iter().map(|r| r[i].1[0].cross).sum::<u64>());
    for (i, (name, samples)) in results[0].iter().enumerate() {
        let mut t: Vec<Duration> = samples.iter().map(|s| s.time).collect();
        t.sort();
        let median = t[t.len() / 2];
        let sent: u64 = results.iter().map(|r| r[i].1[0].sent).sum();
        let cross: u64 = results.iter().map(|r| r[i].1[0].cross).sum();
        let ratio = exact_cross.map(|c| format!("  ({:.4} of f32's)", cross as f64 / c as f64)).unwrap_or_default();
        println!("{name:<38} {:>12.3} {sent:>16} {cross:>18}{ratio}", median.as_secs_f64() * 1e3);
    }
}
