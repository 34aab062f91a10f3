//! Micro-benchmark of `CommsLogger::record`: the per-op cost the communicator pays when the
//! logger is on. Prints ns per call and how many heap allocations the timed loop made. Also
//! the flight recorder's start + finish, which every op pays (it is always on).
//!
//! Run: `cargo bench -p oxcomm --bench logger` (add `-- N` to change the call count, default
//! 1e6).

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use oxcomm::logging::flight::FlightRecorder;
use oxcomm::logging::{CommsLogger, LoggerConfig, OpRecord};
use oxcomm::wire::{Fingerprint, OpKind};
use oxcomm::DType;

/// Counts allocations so the benchmark can show the hot path makes none.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call unchanged to the system allocator; the counter has no effect on
// the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn rec(i: u64, start_ns: u64) -> OpRecord {
    OpRecord {
        op: "all_reduce",
        dtype: Some(DType::F32),
        count: 1 << 18,
        bytes: 1 << 20,
        group_size: 4,
        seq: i,
        algorithm: "ring",
        transport: "shm",
        start_ns,
        latency_ns: 1000 + (i & 1023),
        caller: None,
    }
}

/// Times `n` records on `log`; returns (ns per record, allocations during the loop).
fn run(log: &CommsLogger, n: u64) -> (f64, u64) {
    let a0 = ALLOCS.load(Ordering::Relaxed);
    let t0 = Instant::now();
    for i in 0..n {
        let op = black_box("all_reduce");
        if log.should_record(op) {
            log.record(black_box(rec(i, i)));
        }
    }
    let ns = t0.elapsed().as_nanos() as f64 / n as f64;
    (ns, ALLOCS.load(Ordering::Relaxed) - a0)
}

fn main() {
    let n: u64 = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(1_000_000);
    let config = LoggerConfig { enabled: true, ..LoggerConfig::default() };

    // Growing: storage chunks are allocated as records arrive (one per 1024 records).
    let log = CommsLogger::new(config.clone());
    let (ns, allocs) = run(&log, n);
    println!("record (growing storage):      {ns:6.1} ns/record, {allocs} allocations over {n} records");

    // Warm: after reset the chunks are reused, so the loop allocates nothing.
    log.reset();
    let (ns, allocs) = run(&log, n);
    println!("record (warm, after reset):    {ns:6.1} ns/record, {allocs} allocations over {n} records");

    // Reserved up front.
    let log = CommsLogger::new(config.clone());
    log.reserve(n as usize);
    let (ns, allocs) = run(&log, n);
    println!("record (reserved):             {ns:6.1} ns/record, {allocs} allocations over {n} records");

    // Contended: 2 threads on one logger (a communicator is normally driven by one thread).
    let log = CommsLogger::new(config.clone());
    log.reserve(n as usize);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..2 {
            let log = &log;
            s.spawn(move || run(log, n / 2));
        }
    });
    let ns = t0.elapsed().as_nanos() as f64 / n as f64;
    println!("record (2 threads, contended): {ns:6.1} ns/record (wall / total records)");

    // Disabled logger: the gate alone.
    let log = CommsLogger::new(LoggerConfig::default());
    let (ns, _) = run(&log, n);
    println!("should_record (disabled):      {ns:6.1} ns/call");
    assert_eq!(log.op_count(), 0);

    flight_recorder(n);
    overhead_on_an_8_byte_all_reduce();
}

/// The flight recorder's per-op cost: one start and one finish (two uncontended lock/unlock
/// pairs and two coarse clock reads), and the allocations it makes (none).
fn flight_recorder(n: u64) {
    let fr = FlightRecorder::default();
    let mut fp = Fingerprint::new(OpKind::AllReduce, 0, 0);
    fp.dtype = Some(DType::F32);
    fp.count = 2;
    let a0 = ALLOCS.load(Ordering::Relaxed);
    let t0 = Instant::now();
    for i in 0..n {
        fp.seq = i;
        let id = fr.start(black_box(&fp), "direct", None);
        fr.finish(black_box(id), Ok(()));
    }
    let ns = t0.elapsed().as_nanos() as f64 / n as f64;
    let allocs = ALLOCS.load(Ordering::Relaxed) - a0;
    println!("flight recorder start+finish:  {ns:6.1} ns/op, {allocs} allocations over {n} ops");
    assert_eq!(allocs, 0, "the flight recorder allocates per op");
}

/// The end-to-end cost: 8-byte all_reduce on 2 thread ranks with the logger off, on and warm
/// (its storage already grown once and reused after `reset`, as in a loop that logs a summary
/// and resets every N steps), and on while its storage grows (a fresh chunk and fresh pages
/// every 1024 records), in the same run, alternating rounds so machine noise hits all alike.
/// Prints the medians of the per-round mean latency and the overheads.
fn overhead_on_an_8_byte_all_reduce() {
    const ROUNDS: usize = 15;
    const OPS: usize = 20_000;
    #[derive(Clone, Copy, PartialEq)]
    enum Mode {
        Off,
        Warm,
        Growing,
    }
    let time = |mode: Mode| -> f64 {
        let config = oxcomm::CommConfig {
            logger: LoggerConfig { enabled: mode != Mode::Off, ..LoggerConfig::default() },
            ..oxcomm::CommConfig::default()
        };
        let per_rank = oxcomm::threads::run_with(2, config, |comm| {
            let mut v = [1.0f32, 2.0];
            let warm_ops = if mode == Mode::Warm { OPS } else { 1000 };
            for _ in 0..warm_ops {
                comm.all_reduce(&mut v, oxcomm::ReduceOp::Sum).expect("warm-up");
            }
            if mode == Mode::Warm {
                comm.logger().reset();
            }
            comm.barrier().expect("barrier");
            let t0 = Instant::now();
            for _ in 0..OPS {
                comm.all_reduce(black_box(&mut v), oxcomm::ReduceOp::Sum).expect("all_reduce");
            }
            t0.elapsed().as_nanos() as f64 / OPS as f64
        })
        .expect("thread ranks");
        per_rank.into_iter().fold(0.0, f64::max)
    };
    let (mut off, mut warm, mut growing) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        off.push(time(Mode::Off));
        warm.push(time(Mode::Warm));
        growing.push(time(Mode::Growing));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let (off, warm, growing) = (median(&mut off), median(&mut warm), median(&mut growing));
    println!(
        "8-byte all_reduce, 2 thread ranks (median of {ROUNDS} rounds × {OPS} ops): logger off {off:.0} ns/op; \
         on, warm {warm:.0} ns/op ({:+.1}%); on, storage growing {growing:.0} ns/op ({:+.1}%)",
        (warm / off - 1.0) * 100.0,
        (growing / off - 1.0) * 100.0
    );
}
