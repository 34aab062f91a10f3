//! Where the ranks of `oxcomm bench` come from and how their lines reach the table: thread
//! ranks in this process ([`run_threads`]), worker processes this front end spawns over shared
//! memory or TCP ([`run_shm`], through [`crate::launch::launch_self`]) with the channel that
//! carries rank 0's lines back ([`channel`]), and a rank of a job someone else started
//! ([`run_in_job`]: `--worker` under `oxcomm launch`, or a rank of an MPI job with
//! `OXCOMM_BACKEND=mpi`), whose rank 0 prints the table itself. What a rank runs is
//! [`super::sweep`]'s; what the table looks like is [`super::report`]'s.
//!
//! # Processes
//!
//! With `--transport shm` (the default) the command re-runs itself as N ranks with the hidden
//! `--worker` flag; each worker builds its communicator with `oxcomm::init()`. Rank 0 sends
//! each finished table line to the parent over a Unix datagram socket (abstract name, passed as
//! the hidden `--report-to`), and the parent prints it, writes the files and moves the progress
//! bar, so the bar and the table share one terminal cleanly. `--transport tcp` does the same
//! with `OXCOMM_TRANSPORT=tcp` in the workers' environment. A worker started by hand (e.g.
//! `oxcomm launch -n 4 -- oxcomm bench --worker`) or by an MPI launcher
//! (`OXCOMM_BACKEND=mpi mpirun -n 4 oxcomm bench`) prints the report itself from rank 0.
//! With `--transport threads` the ranks are threads of this process (`oxcomm::threads`).

use std::sync::Mutex;

use anyhow::bail;
#[cfg(target_os = "linux")]
use anyhow::{anyhow, Context};
use oxcomm::CommConfig;

#[cfg(target_os = "linux")]
use super::plan::check_ranks_per_host;
use super::plan::BenchPlan;
use super::report::{Line, Report};
use super::sweep::rank_main;

/// Runs the plan on `world` thread ranks of this process; prints the table here.
pub(super) fn run_threads(plan: &BenchPlan, world: usize) -> anyhow::Result<i32> {
    let report = Mutex::new(Report::create(plan, world, plan.transport, None, true)?);
    let sink = |line: &Line| report.lock().unwrap_or_else(|e| e.into_inner()).line(line);
    let results = oxcomm::threads::run_with(world, CommConfig::default(), |comm| {
        rank_main(&comm, plan, if comm.rank() == 0 { Some(&sink) } else { None })
    })?;
    let report = report.into_inner().unwrap_or_else(|e| e.into_inner());
    if let Some(err) = results.into_iter().find_map(|r| r.err()) {
        report.abandon();
        return Err(err);
    }
    report.finish()
}

/// Spawns `world` worker processes of this binary (`--worker`, over shared memory or, with
/// `OXCOMM_TRANSPORT=tcp` inherited, TCP) and prints the lines their rank 0 sends back.
#[cfg(target_os = "linux")]
pub(super) fn run_shm(plan: &BenchPlan, world: usize) -> anyhow::Result<i32> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    let report = Report::create(plan, world, plan.transport, None, true)?;
    let (socket, name) = channel::bind()?;
    let stop = Arc::new(AtomicBool::new(false));
    let receiver = {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("oxcomm-bench-report".into())
            .spawn(move || channel::receive(socket, report, &stop))
            .context("cannot start the report thread")?
    };
    let launched = crate::launch::launch_self(world, plan.worker_args(world, &name), false);
    stop.store(true, Ordering::SeqCst);
    let received = receiver.join().map_err(|_| anyhow!("the report thread panicked"))?;
    let code = launched?;
    let report = received?;
    if code != 0 {
        report.abandon();
        return Ok(code);
    }
    report.finish()
}

#[cfg(not(target_os = "linux"))]
pub(super) fn run_shm(_plan: &BenchPlan, _world: usize) -> anyhow::Result<i32> {
    bail!("--transport shm needs Linux; use --transport threads")
}

/// Runs the plan as one rank of a job someone else started (`oxcomm::init()`: oxcomm's
/// transports, or MPI with `OXCOMM_BACKEND=mpi`). Rank 0 sends its lines to the front end of
/// `--report-to`, or else prints the table itself.
#[cfg(target_os = "linux")]
pub(super) fn run_in_job(plan: &BenchPlan) -> anyhow::Result<i32> {
    let comm = oxcomm::init().context("cannot join the job")?;
    if let Some(n) = plan.world {
        if n != comm.size() {
            bail!("--world-size {n} but the job has {} ranks", comm.size());
        }
    }
    if plan.ops.iter().any(|o| o.rooted()) && plan.root >= comm.size() {
        bail!("-r/--root {} is not below the world size {}", plan.root, comm.size());
    }
    if let Some(k) = plan.ranks_per_host {
        check_ranks_per_host(k, Some(comm.size()))?;
    }
    if comm.rank() != 0 {
        rank_main(&comm, plan, None)?;
        return Ok(0);
    }
    match &plan.report_to {
        Some(name) => {
            let tx = channel::Sender::connect(name)?;
            rank_main(&comm, plan, Some(&|line: &Line| tx.send(line)))?;
            Ok(0)
        }
        None => {
            let report =
                Mutex::new(Report::create(plan, comm.size(), comm.transport(), comm.links_model(), !plan.quiet)?);
            let sink = |line: &Line| report.lock().unwrap_or_else(|e| e.into_inner()).line(line);
            let result = rank_main(&comm, plan, Some(&sink));
            let report = report.into_inner().unwrap_or_else(|e| e.into_inner());
            match result {
                Ok(()) => report.finish(),
                Err(e) => {
                    report.abandon();
                    Err(e)
                }
            }
        }
    }
}

#[cfg(not(target_os = "linux"))]
pub(super) fn run_in_job(_plan: &BenchPlan) -> anyhow::Result<i32> {
    bail!("--worker needs Linux (oxcomm::init)")
}

/// The channel from worker rank 0 to the front end: a Unix datagram socket with an abstract
/// name (nothing on the file system to clean up), one JSON-encoded [`Line`] per datagram.
#[cfg(target_os = "linux")]
mod channel {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use anyhow::Context;

    use crate::bench::report::{Line, Report};

    /// How often the receiver looks at the stop flag when nothing arrives.
    const POLL: Duration = Duration::from_millis(100);
    /// Largest datagram accepted (a line is a few hundred bytes).
    const MAX_DATAGRAM: usize = 64 << 10;

    /// Binds a fresh abstract socket; returns it and its name.
    pub(super) fn bind() -> anyhow::Result<(UnixDatagram, String)> {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        let name = format!("oxcomm-bench-{}-{nanos:x}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).context("abstract socket name")?;
        let socket = UnixDatagram::bind_addr(&addr).context("cannot bind the report socket")?;
        socket.set_read_timeout(Some(POLL)).context("report socket timeout")?;
        Ok((socket, name))
    }

    /// Feeds every line that arrives to `report` until `stop` is set and nothing is left.
    pub(super) fn receive(socket: UnixDatagram, mut report: Report, stop: &AtomicBool) -> anyhow::Result<Report> {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        loop {
            match socket.recv(&mut buf) {
                Ok(n) => {
                    let line: Line = serde_json::from_slice(&buf[..n]).context("a malformed line from rank 0")?;
                    report.line(&line)?;
                }
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    // The flag is set after every rank exited, so every datagram they sent is
                    // already queued: an empty queue then means done.
                    if stop.load(Ordering::SeqCst) {
                        return Ok(report);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e).context("reading the report socket"),
            }
        }
    }

    /// Rank 0's end.
    pub(super) struct Sender {
        socket: UnixDatagram,
    }

    impl Sender {
        pub(super) fn connect(name: &str) -> anyhow::Result<Sender> {
            let addr = SocketAddr::from_abstract_name(name.as_bytes()).context("abstract socket name")?;
            let socket = UnixDatagram::unbound().context("report socket")?;
            socket.connect_addr(&addr).with_context(|| format!("cannot reach the bench front end at @{name}"))?;
            Ok(Sender { socket })
        }

        pub(super) fn send(&self, line: &Line) -> anyhow::Result<()> {
            let bytes = serde_json::to_vec(line)?;
            self.socket.send(&bytes).context("sending a line to the bench front end")?;
            Ok(())
        }
    }
}
