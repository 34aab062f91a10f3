//! `oxcomm bench`: times collectives over a range of message sizes and prints an nccl-tests
//! style table (NVIDIA/nccl-tests, `src/common.cu`), optionally as JSON Lines and CSV too.
//!
//! This module owns the bench, one concern per submodule, in the order a run goes through
//! them:
//!
//! | module | owns |
//! | --- | --- |
//! | [`args`] | the flags as typed ([`BenchArgs`]) and the parsers of their values; the backend `OXCOMM_BACKEND` asks for |
//! | [`plan`] | what the flags mean together, checked: ops, sizes, dtype, world, algorithm per op; a worker's flags |
//! | [`workers`] | where the ranks come from (threads, spawned processes, a launcher's or MPI's job) and the channel from worker rank 0 to the front end |
//! | [`sweep`] | one rank's run of the plan: every op × size × mode, timed and checked, lines handed to rank 0's sink |
//! | [`cases`] | one op in one mode at one size: how it runs, is timed and is verified; shared with `oxcomm check` |
//! | [`report`] | the table, progress bar, JSON Lines, CSV and the `--plot` hook |
//!
//! Drawing the plot of `--plot` and reading the files of `--compare` belong to
//! [`crate::plot`]. The bench uses only oxcomm's public API; it knows nothing about how the
//! transports or algorithms work.
//!
//! # Where the ranks come from
//!
//! * `--transport shm` (the default) or `tcp`: this process is the front end; it spawns the
//!   ranks as worker processes of itself and prints what their rank 0 sends back
//!   ([`workers`]).
//! * `--transport threads`: the ranks are threads of this process.
//! * `--worker` (hidden; `oxcomm launch -n 4 -- oxcomm bench --worker`): this process is one
//!   rank of a job a launcher started; it joins with `oxcomm::init()` and rank 0 prints.
//! * `OXCOMM_BACKEND=mpi` (built with the `mpi` feature): this process is one rank of an MPI
//!   job, as with nccl-tests under mpirun: `OXCOMM_BACKEND=mpi mpirun -n 4 oxcomm bench -b 8
//!   -e 64M`. It joins with `oxcomm::init()` (the MPI backend), the job decides the world
//!   size, and rank 0 prints the same table (`transport: mpi`). `--transport threads|tcp` and
//!   `--algorithm` are errors there (MPI picks its own algorithms). Without the feature,
//!   `OXCOMM_BACKEND=mpi` is a one-line error.

mod args;
pub(crate) mod cases;
mod plan;
mod report;
mod sweep;
mod workers;

use anyhow::{anyhow, bail};

use args::Backend;
pub use args::{parse_size, BenchArgs};
use cases::human;
use oxcomm::rendezvous::env::OXCOMM_TRANSPORT;
use oxcomm::Transport;
use plan::BenchPlan;

/// Runs `oxcomm bench`: returns the exit status (0, or the launcher's status when a rank
/// failed); an error when the flags are wrong, a rank fails in-process, or a value was wrong.
pub fn run(args: BenchArgs) -> anyhow::Result<i32> {
    if !args.compare.is_empty() {
        let out = args.plot.as_ref().ok_or_else(|| anyhow!("--compare needs --plot FILE"))?;
        crate::plot::compare(&args.compare, out)?;
        return Ok(0);
    }
    let plan = BenchPlan::new(&args, Backend::from_env()?)?;
    if plan.in_job() {
        return workers::run_in_job(&plan);
    }
    let world = plan.world.expect("the front end always knows the world size");
    check_memory(&plan, world)?;
    match plan.transport {
        Transport::Threads => workers::run_threads(&plan, world),
        Transport::Shm => workers::run_shm(&plan, world),
        Transport::Tcp => {
            // The worker ranks inherit this and build TCP links on loopback.
            std::env::set_var(OXCOMM_TRANSPORT, Transport::Tcp.as_str());
            workers::run_shm(&plan, world)
        }
        other => bail!("--transport {other} does not apply to oxcomm bench"),
    }
}

/// Refuses a run whose buffers cannot fit in this host's available memory (instead of being
/// killed by the OOM killer half-way).
fn check_memory(plan: &BenchPlan, world: usize) -> anyhow::Result<()> {
    let need = plan.bytes_per_rank().saturating_mul(world as u64);
    if let Some(avail) = mem_available() {
        if need > avail {
            bail!(
                "the buffers need {} (3 × {} per rank × {world} ranks) but only {} of memory is available; lower -e/--maxbytes or --world-size",
                human(need),
                human(plan.max_bytes),
                human(avail)
            );
        }
    }
    Ok(())
}

/// `MemAvailable` from /proc/meminfo, in bytes.
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
