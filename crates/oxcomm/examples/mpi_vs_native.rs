//! f32 all-reduce bandwidth of oxcomm's native shared-memory transport against the MPI
//! backend, in one MPI job:
//!
//! ```text
//! cargo build --release -p oxcomm --features mpi --example mpi_vs_native
//! mpirun -n 2 --allow-run-as-root target/release/examples/mpi_vs_native
//! ```
//!
//! Every rank first joins over MPI; rank 0 then picks a free loopback port and a random token
//! for the native rendezvous and broadcasts them with MPI, every rank exports
//! `MASTER_ADDR`/`MASTER_PORT`/`OXCOMM_TOKEN` and calls `oxcomm::init()` (native, shared
//! memory). A second MPI communicator is made with `OXCOMM_MPI_CHECK=0` to show the cost of
//! the fingerprint check. For each size, each communicator runs a few warm-up all-reduces,
//! then [`ROUNDS`] timed loops; the time is the slowest rank's mean per op in the best round
//! (the best round, since a shared machine adds noise only upwards). Bus bandwidth is nccl-tests': algbw ×
//! 2(n−1)/n. Pass sizes in bytes as arguments to override the default 8 B … 64 MiB.

use std::time::Instant;

use oxcomm::{Communicator, ReduceOp, Result};

/// Timed loops per size and communicator; the fastest counts.
const ROUNDS: usize = 3;

fn main() -> Result<()> {
    let mpi = oxcomm::mpi::init()?;
    std::env::set_var(oxcomm::mpi::ENV_MPI_CHECK, "0");
    let mpi_unchecked = oxcomm::mpi::init()?;
    std::env::remove_var(oxcomm::mpi::ENV_MPI_CHECK);
    let native = join_native(&mpi)?;
    let (n, me) = (mpi.size(), mpi.rank());

    let sizes: Vec<usize> = {
        let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
        if args.is_empty() {
            let mut v: Vec<usize> = (0..).map(|k| 8usize << (2 * k)).take_while(|&s| s <= 64 << 20).collect();
            v.push(64 << 20);
            v.dedup();
            v
        } else {
            args
        }
    };
    if me == 0 {
        println!(
            "f32 all_reduce (sum), {n} ranks; time = slowest rank's mean per op, best of {ROUNDS} rounds; \
             busbw = algbw × 2(n−1)/n; mpi-nc = MPI without the fingerprint check"
        );
        println!(
            "{:>10} {:>6} | {:>10} {:>11} | {:>10} {:>11} | {:>10} {:>11}",
            "bytes", "iters", "native µs", "native GB/s", "mpi µs", "mpi GB/s", "mpi-nc µs", "mpi-nc GB/s"
        );
    }
    for bytes in sizes {
        let count = (bytes / 4).max(1);
        let iters = ((128usize << 20) / bytes.max(1)).clamp(4, 1000);
        let mut row = Vec::new();
        for comm in [&native, &mpi, &mpi_unchecked] {
            let secs = time_all_reduce(comm, &mpi, count, iters)?;
            let algbw = (count * 4) as f64 / secs;
            let busbw = algbw * 2.0 * (n - 1) as f64 / n as f64;
            row.push((secs * 1e6, busbw / 1e9));
        }
        if me == 0 {
            println!(
                "{:>10} {:>6} | {:>10.2} {:>11.3} | {:>10.2} {:>11.3} | {:>10.2} {:>11.3}",
                count * 4,
                iters,
                row[0].0,
                row[0].1,
                row[1].0,
                row[1].1,
                row[2].0,
                row[2].1
            );
        }
    }
    drop(native);
    drop(mpi_unchecked);
    drop(mpi);
    Ok(())
}

/// Seconds per all-reduce of `count` f32 on `comm`: the slowest rank's mean over `iters`,
/// in the best of [`ROUNDS`] rounds.
fn time_all_reduce(comm: &Communicator, mpi: &Communicator, count: usize, iters: usize) -> Result<f64> {
    let mut buf = vec![1.0f32; count];
    for _ in 0..3 {
        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
    }
    let mut best = f64::INFINITY;
    for _ in 0..ROUNDS {
        comm.barrier()?;
        let t0 = Instant::now();
        for _ in 0..iters {
            comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        }
        let mut secs = [t0.elapsed().as_secs_f64() / iters as f64];
        mpi.all_reduce(&mut secs, ReduceOp::Max)?;
        best = best.min(secs[0]);
    }
    Ok(best)
}

/// Joins the native shared-memory transport, with the rendezvous settings rank 0 picked and
/// broadcast over MPI.
fn join_native(mpi: &Communicator) -> Result<Communicator> {
    let mut port = [0i32];
    let mut token = [0u8; 32];
    if mpi.rank() == 0 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| oxcomm::Error::io("bind 127.0.0.1:0", e))?;
        port[0] = i32::from(l.local_addr().map_err(|e| oxcomm::Error::io("local_addr", e))?.port());
        getrandom::fill(&mut token).map_err(|e| oxcomm::Error::invalid(format!("random token: {e}")))?;
    }
    mpi.broadcast(&mut port, 0)?;
    mpi.broadcast(&mut token, 0)?;
    let hex: String = token.iter().map(|b| format!("{b:02x}")).collect();
    std::env::set_var("MASTER_ADDR", "127.0.0.1");
    std::env::set_var("MASTER_PORT", port[0].to_string());
    std::env::set_var("OXCOMM_TOKEN", hex);
    std::env::remove_var(oxcomm::init::ENV_BACKEND);
    oxcomm::init()
}
