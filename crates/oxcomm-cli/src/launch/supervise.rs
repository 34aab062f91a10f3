//! Running the job: serving the store (node 0), spawning each rank with its environment in
//! its own process group, watching them, forwarding signals, what happens when one fails
//! (`--on-failure`: stopping every rank, `SIGTERM` then `SIGKILL` after the grace period; or
//! letting the others go on; or also starting a replacement that joins them) and the
//! launcher's exit status.
//! The output pump is [`super::output`]'s; the multi-node exit barrier [`super::exit`]'s.

use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use oxcomm::grow::ENV_JOIN;
use oxcomm::init::{ENV_JOB_ID, ENV_STORE, STORE_LAUNCHER};
use oxcomm::rendezvous::env::{
    MASTER_ADDR, MASTER_PORT, OXCOMM_LOCAL_RANK, OXCOMM_LOCAL_WORLD_SIZE, OXCOMM_RANK, OXCOMM_TOKEN, OXCOMM_WORLD_SIZE,
};
use oxcomm::rendezvous::{Settings, StoreServer};
use signal_hook::consts::{SIGCHLD, SIGINT, SIGKILL, SIGTERM};
use signal_hook::iterator::Signals;

use super::args::OnFailure;
use super::exit::ExitBarrier;
use super::output::{start_pump, Sink};
use super::plan::{LaunchPlan, StorePlan};
use super::{GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, ON_FAILURE, RANK, WORLD_SIZE};

/// How long the launcher sleeps between checks of its ranks when no signal wakes it
/// (a safety net; `SIGCHLD` normally wakes it at once).
pub(super) const POLL_INTERVAL: Duration = Duration::from_millis(250);

/// How long the launcher waits, after the last rank exited, for the ranks' output pipes to
/// close (a child of a rank may hold them open).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// What wakes the launcher's main loop.
pub(super) enum Event {
    Signal(i32),
    OutputClosed,
}

/// One rank this launcher started.
struct Rank {
    rank: usize,
    local_rank: usize,
    child: Child,
    status: Option<ExitStatus>,
}

/// Why the launcher is stopping the job.
#[derive(Debug, Clone, Copy)]
pub(super) enum Stop {
    /// A rank failed; exit with its status.
    Failed(i32),
    /// The launcher got this signal; exit with 128 + it.
    Signaled(i32),
}

pub(super) fn execute(plan: &LaunchPlan) -> anyhow::Result<i32> {
    let (tx, rx) = mpsc::channel();
    // Register before spawning, so no SIGCHLD or SIGINT is missed.
    let mut signals = Signals::new([SIGINT, SIGTERM, SIGCHLD]).context("cannot install signal handlers")?;
    let signal_handle = signals.handle();
    let signal_tx = tx.clone();
    let signal_thread = std::thread::Builder::new()
        .name("oxcomm-launch-signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                if signal_tx.send(Event::Signal(signal)).is_err() {
                    break;
                }
            }
        })
        .context("cannot start the signal thread")?;

    let result = serve_and_supervise(plan, &tx, &rx);

    signal_handle.close();
    let _ = signal_thread.join();
    result
}

fn serve_and_supervise(plan: &LaunchPlan, tx: &mpsc::Sender<Event>, rx: &mpsc::Receiver<Event>) -> anyhow::Result<i32> {
    // The server decodes the token exactly as the ranks will (hex → bytes).
    let token_bytes = Settings::from_lookup(|name| (name == OXCOMM_TOKEN).then(|| plan.token.clone()))
        .context("bad OXCOMM_TOKEN")?
        .token
        .unwrap_or_default();
    let (server, master_addr, master_port) = match &plan.store {
        StorePlan::Serve { bind, advertise } => {
            let server = StoreServer::bind(*bind, &token_bytes)
                .with_context(|| format!("cannot serve the rendezvous store on {bind}"))?;
            let local = server.local_addr();
            let host = match advertise {
                Some(host) => host.clone(),
                None if local.ip().is_unspecified() => match local.ip() {
                    IpAddr::V4(_) => Ipv4Addr::LOCALHOST.to_string(),
                    IpAddr::V6(_) => "::1".to_owned(),
                },
                None => local.ip().to_string(),
            };
            (Some(server), host, local.port())
        }
        StorePlan::Remote { addr, port } => (None, addr.clone(), *port),
    };

    let mut ranks = Vec::with_capacity(plan.nproc);
    let mut readers = 0usize;
    for local_rank in 0..plan.nproc {
        match spawn_rank(plan, local_rank, &master_addr, master_port, tx, false) {
            Ok((rank, pipes)) => {
                ranks.push(rank);
                readers += pipes;
            }
            Err(err) => {
                signal_all(&ranks, SIGKILL);
                for rank in &mut ranks {
                    let _ = rank.child.wait();
                }
                return Err(err);
            }
        }
    }
    let mut closed = 0;
    let mut replace = |local_rank: usize| {
        let (rank, pipes) = spawn_rank(plan, local_rank, &master_addr, master_port, tx, true)?;
        readers += pipes;
        Ok(rank)
    };
    let (mut code, stop) = supervise(plan, &mut ranks, rx, &mut closed, &mut replace);
    drain(rx, readers, closed);
    if plan.nnodes > 1 {
        let barrier = ExitBarrier { plan, token: &token_bytes, master_addr: &master_addr, master_port };
        if let Some(signal) = barrier.run(server.as_ref(), stop, rx) {
            code = 128 + signal;
        }
    }
    drop(server);
    Ok(code)
}

/// Starts local rank `local_rank` (a replacement that joins the running job when `join`);
/// returns it and the number of output readers started.
fn spawn_rank(
    plan: &LaunchPlan,
    local_rank: usize,
    master_addr: &str,
    master_port: u16,
    tx: &mpsc::Sender<Event>,
    join: bool,
) -> anyhow::Result<(Rank, usize)> {
    let rank = plan.node_rank * plan.nproc + local_rank;
    let mut command = Command::new(&plan.program);
    command.args(&plan.args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    let numbers = [
        (RANK, rank),
        (OXCOMM_RANK, rank),
        (WORLD_SIZE, plan.world_size),
        (OXCOMM_WORLD_SIZE, plan.world_size),
        (LOCAL_RANK, local_rank),
        (OXCOMM_LOCAL_RANK, local_rank),
        (LOCAL_WORLD_SIZE, plan.nproc),
        (OXCOMM_LOCAL_WORLD_SIZE, plan.nproc),
        (GROUP_RANK, plan.node_rank),
        (MASTER_PORT, usize::from(master_port)),
    ];
    for (name, value) in numbers {
        command.env(name, value.to_string());
    }
    command
        .env(MASTER_ADDR, master_addr)
        .env(OXCOMM_TOKEN, &plan.token)
        .env(ENV_JOB_ID, &plan.job_id)
        .env(ENV_STORE, STORE_LAUNCHER)
        .env(
            ON_FAILURE,
            match plan.on_failure {
                OnFailure::Abort => "abort",
                OnFailure::Continue => "continue",
                OnFailure::Restart => "restart",
            },
        );
    if join {
        command.env(ENV_JOIN, "1");
    }
    die_with_launcher(&mut command);

    let mut child = command.spawn().map_err(|err| {
        let program = plan.program.to_string_lossy();
        match err.kind() {
            io::ErrorKind::NotFound => anyhow!("cannot start rank {rank}: program {program:?} not found"),
            _ => anyhow!("cannot start rank {rank}: {program:?}: {err}"),
        }
    })?;
    let prefix = plan.prefix.then(|| format!("[{rank}] "));
    let mut pipes = 0;
    if let Some(out) = child.stdout.take() {
        pipes += start_pump(out, prefix.clone(), Sink::Stdout, tx, rank);
    }
    if let Some(err) = child.stderr.take() {
        pipes += start_pump(err, prefix, Sink::Stderr, tx, rank);
    }
    Ok((Rank { rank, local_rank, child, status: None }, pipes))
}

/// On Linux, asks the kernel to send the rank `SIGTERM` when the launcher's thread dies, so a
/// launcher killed with `SIGKILL` leaves no ranks behind.
#[cfg(target_os = "linux")]
fn die_with_launcher(command: &mut Command) {
    // SAFETY: `getpid` is async-signal-safe.
    let launcher = unsafe { libc::getpid() };
    // SAFETY: the closure runs in the child between fork and exec; it only calls `prctl` and
    // `getppid`, which are async-signal-safe, and allocates nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The launcher may have died before prctl: then nobody would stop this rank.
            if libc::getppid() != launcher {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_launcher(_command: &mut Command) {}

/// Waits for the ranks; returns the launcher's exit status and why it stopped the job early,
/// if it did. Counts the output readers that finished meanwhile in `closed`. With
/// `--on-failure continue` or `restart` a failed rank does not stop the others (`replace`
/// starts its replacement), and the status is 0 when some rank succeeded, else the first
/// failure's.
fn supervise(
    plan: &LaunchPlan,
    ranks: &mut Vec<Rank>,
    rx: &mpsc::Receiver<Event>,
    closed: &mut usize,
    replace: &mut dyn FnMut(usize) -> anyhow::Result<Rank>,
) -> (i32, Option<Stop>) {
    let mut stop: Option<Stop> = None;
    let mut kill_at: Option<Instant> = None;
    let mut first_failure: Option<i32> = None;
    let mut restarts = 0usize;
    loop {
        let mut newly_failed = false;
        let mut replacements = Vec::new();
        for rank in ranks.iter_mut().filter(|r| r.status.is_none()) {
            match rank.child.try_wait() {
                Ok(Some(status)) => {
                    rank.status = Some(status);
                    if stop.is_none() && !status.success() {
                        let code = exit_code(status);
                        let what = format!(
                            "oxcomm launch: rank {} exited with status {code}{}",
                            rank.rank,
                            describe_signal(status)
                        );
                        first_failure.get_or_insert(code);
                        match plan.on_failure {
                            OnFailure::Abort => {
                                eprintln!("{what}; stopping the other ranks");
                                stop = Some(Stop::Failed(code));
                                kill_at = Some(Instant::now() + plan.grace);
                                newly_failed = true;
                            }
                            OnFailure::Restart if restarts < plan.max_restarts => {
                                restarts += 1;
                                eprintln!(
                                    "{what}; starting a replacement that joins the others (restart {restarts} of {})",
                                    plan.max_restarts
                                );
                                replacements.push(rank.local_rank);
                            }
                            OnFailure::Restart => eprintln!(
                                "{what}; no restarts left (--max-restarts {}): the others go on",
                                plan.max_restarts
                            ),
                            OnFailure::Continue => eprintln!("{what}; the others go on (--on-failure continue)"),
                        }
                    }
                }
                Ok(None) => {}
                Err(err) => eprintln!("oxcomm launch: cannot check rank {}: {err}", rank.rank),
            }
        }
        for local_rank in replacements {
            match replace(local_rank) {
                Ok(rank) => ranks.push(rank),
                Err(err) => eprintln!("oxcomm launch: {err}; the others go on"),
            }
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            break;
        }
        if newly_failed {
            // Stop the others: their groups, so their children go too.
            signal_all(ranks, SIGTERM);
        }
        if kill_at.is_some_and(|t| t <= Instant::now()) {
            signal_all(ranks, SIGKILL);
            kill_at = None;
        }
        let wait = kill_at.map_or(POLL_INTERVAL, |t| t.saturating_duration_since(Instant::now()).min(POLL_INTERVAL));
        match rx.recv_timeout(wait) {
            Ok(Event::Signal(signal)) if signal == SIGINT || signal == SIGTERM => {
                if stop.is_none() {
                    stop = Some(Stop::Signaled(signal));
                    signal_all(ranks, signal);
                    kill_at = Some(Instant::now() + plan.grace);
                } else {
                    // A second interrupt: no more grace.
                    signal_all(ranks, SIGKILL);
                    kill_at = None;
                }
            }
            Ok(Event::OutputClosed) => *closed += 1,
            Ok(Event::Signal(_)) | Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => std::thread::sleep(wait),
        }
    }
    let code = match stop {
        None if ranks.iter().any(|r| r.status.is_some_and(|s| s.success())) => 0,
        None => first_failure.unwrap_or(0),
        Some(Stop::Failed(code)) => code,
        Some(Stop::Signaled(signal)) => 128 + signal,
    };
    if stop.is_some() {
        // Whatever the ranks left behind in their groups goes too.
        signal_all(ranks, SIGKILL);
    }
    (code, stop)
}

/// Sends `signal` to the process group of every rank. A group whose leader was reaped keeps
/// its id reserved while any member lives, so this never reaches an unrelated process.
fn signal_all(ranks: &[Rank], signal: i32) {
    for rank in ranks {
        let Ok(pid) = libc::pid_t::try_from(rank.child.id()) else { continue };
        // SAFETY: `kill` has no memory-safety preconditions; `-pid` names the rank's own
        // process group (it was started with `process_group(0)`).
        let sent = unsafe { libc::kill(-pid, signal) };
        if sent != 0 && rank.status.is_none() {
            // SAFETY: as above; the rank is not reaped yet, so `pid` is still ours.
            unsafe { libc::kill(pid, signal) };
        }
    }
}

/// The shell's convention: the exit code, or 128 + the signal that killed the process.
fn exit_code(status: ExitStatus) -> i32 {
    status.code().or_else(|| status.signal().map(|s| 128 + s)).unwrap_or(1)
}

fn describe_signal(status: ExitStatus) -> String {
    let Some(signal) = status.signal() else { return String::new() };
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => return format!(" (killed by signal {signal})"),
    };
    format!(" (killed by {name})")
}

/// Waits, at most [`DRAIN_TIMEOUT`], until all `readers` output readers have finished;
/// `closed` of them already have.
fn drain(rx: &mpsc::Receiver<Event>, readers: usize, mut closed: usize) {
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    while closed < readers {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Event::OutputClosed) => closed += 1,
            Ok(Event::Signal(_)) => {}
            Err(_) => break,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_shell() {
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGKILL)), 137);
        assert_eq!(describe_signal(ExitStatus::from_raw(libc::SIGKILL)), " (killed by SIGKILL)");
        assert_eq!(describe_signal(ExitStatus::from_raw(0)), "");
    }
}
