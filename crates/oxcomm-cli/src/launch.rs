//! `oxcomm launch`: starts the ranks of a job on this node, like `torchrun`.
//!
//! This module owns the launcher: its flags ([`LaunchArgs`]), the plan built from them (world
//! size, this node's ranks, the store, the token and the job id), the environment each rank
//! gets (the `*` consts below), spawning the ranks, prefixing their output, forwarding
//! signals and stopping the job when a rank fails. It also holds the hidden `store-ping`
//! subcommand, a rank-side check that the launcher's store is reachable.
//!
//! It does not start processes on other hosts (run one launcher per node, as with torchrun),
//! restart failed ranks, or know anything about collectives: ranks find each other through
//! the rendezvous store the launcher serves on node 0 ([`oxcomm::rendezvous::StoreServer`]).
//! A failure on one node does not stop the launchers of the other nodes; their ranks see the
//! failure as a timeout or a lost peer. In a multi-node job node 0's launcher keeps the store
//! up until the other nodes report their ranks done (an exit barrier, as in torchrun).
//!
//! # Processes and signals
//!
//! Each rank runs in its own process group, so signals the launcher sends reach the rank's
//! own children too, and a Ctrl-C in a terminal reaches only the launcher, which forwards it.
//! On Linux each rank also gets `SIGTERM` if the launcher dies without cleaning up.
//! Stdin of the ranks is `/dev/null`.
//!
//! After `launch` returns, the launcher's process keeps handlers for `SIGINT`, `SIGTERM` and
//! `SIGCHLD` that do nothing: a caller of [`launch_self`] should exit soon after it returns.

use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use oxcomm::rendezvous::{self, EnvInfo, PrefixStore, Settings, Store, StoreClient, StoreServer};
use oxcomm::ErrorKind;
use sha2::{Digest, Sha256};
use signal_hook::consts::{SIGCHLD, SIGINT, SIGKILL, SIGTERM};
use signal_hook::iterator::Signals;

pub use oxcomm::rendezvous::env::{
    MASTER_ADDR, MASTER_PORT, OXCOMM_LOCAL_RANK, OXCOMM_LOCAL_WORLD_SIZE, OXCOMM_RANK, OXCOMM_TOKEN, OXCOMM_WORLD_SIZE,
};

// ---------------------------------------------------------------------------------------------
// Environment of a rank
// ---------------------------------------------------------------------------------------------

/// Global rank of the process, `0 .. WORLD_SIZE` (torchrun's name). The launcher also sets
/// [`OXCOMM_RANK`] to the same value.
pub const RANK: &str = "RANK";
/// Number of ranks in the job, over all nodes (torchrun's name; also [`OXCOMM_WORLD_SIZE`]).
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Index of the rank among this node's ranks (torchrun's name; also [`OXCOMM_LOCAL_RANK`]).
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Number of ranks on this node (torchrun's name; also [`OXCOMM_LOCAL_WORLD_SIZE`]).
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Rank of this node among the nodes, `--node-rank` (torchrun's name).
pub const GROUP_RANK: &str = "GROUP_RANK";
/// A short id of the job, at most 16 characters of `[a-z0-9]`, the same on every node:
/// derived from the job's token (see [`job_id`]), so it is fresh for every single-node job.
/// Ranks use it to name per-job resources (shared-memory segments, log files).
pub const OXCOMM_JOB_ID: &str = "OXCOMM_JOB_ID";
/// Set to [`STORE_LAUNCHER`] when the launcher already serves the rendezvous store at
/// [`MASTER_ADDR`]:[`MASTER_PORT`], so rank 0 must connect to it rather than serve one.
pub const OXCOMM_STORE: &str = "OXCOMM_STORE";
/// The value of [`OXCOMM_STORE`] set by this launcher.
pub const STORE_LAUNCHER: &str = "launcher";

/// Default of `--grace-period`: time the ranks have to exit after `SIGTERM` before `SIGKILL`.
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(5);

/// Longest run of output without a newline kept before it is written out as one line.
const MAX_LINE: usize = 64 << 10;

/// How long the launcher sleeps between checks of its ranks when no signal wakes it
/// (a safety net; `SIGCHLD` normally wakes it at once).
const POLL_INTERVAL: Duration = Duration::from_millis(250);

/// How long the launcher waits, after the last rank exited, for the ranks' output pipes to
/// close (a child of a rank may hold them open).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// Multi-node: how long node 0's launcher keeps serving the store, after its own ranks all
/// succeeded, for the other nodes' launchers to report that their ranks finished (torchrun's
/// exit barrier has the same default).
const EXIT_BARRIER_TIMEOUT: Duration = Duration::from_secs(300);

/// Multi-node: how long a launcher on another node tries to report to node 0's store that its
/// ranks finished.
const EXIT_REPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// After this long in the exit barrier, node 0's launcher says what it is waiting for.
const EXIT_BARRIER_NOTICE: Duration = Duration::from_secs(2);

// ---------------------------------------------------------------------------------------------
// Flags
// ---------------------------------------------------------------------------------------------

/// Flags of `oxcomm launch [FLAGS] [--] PROGRAM [ARGS...]`. torchrun's spellings with
/// underscores (`--nproc_per_node`, `--node_rank`, ...) are accepted too.
#[derive(Debug, Clone, clap::Args)]
pub struct LaunchArgs {
    /// Number of ranks to start on this node (at least 1).
    #[arg(short = 'n', long = "nproc-per-node", visible_alias = "nproc_per_node", value_name = "N")]
    pub nproc_per_node: usize,

    /// Number of nodes, each running one launcher with the same flags except --node-rank.
    /// The world size is NNODES × N.
    #[arg(long, default_value_t = 1, value_name = "K")]
    pub nnodes: usize,

    /// Rank of this node, 0 .. NNODES; its ranks are NODE_RANK×N .. NODE_RANK×N+N-1. Node 0
    /// serves the rendezvous store.
    #[arg(long = "node-rank", visible_alias = "node_rank", default_value_t = 0, value_name = "I")]
    pub node_rank: usize,

    /// Address of node 0, where the store listens. Single node: default 127.0.0.1.
    /// Required with --nnodes > 1.
    #[arg(long = "master-addr", visible_alias = "master_addr", value_name = "ADDR")]
    pub master_addr: Option<String>,

    /// Port of the store on node 0. Single node: default 0 (any free port). Required, and not
    /// 0, with --nnodes > 1.
    #[arg(long = "master-port", visible_alias = "master_port", value_name = "PORT")]
    pub master_port: Option<u16>,

    /// Seconds the ranks have to exit after SIGTERM before they get SIGKILL.
    #[arg(long = "grace-period", value_name = "SECS", default_value = "5", value_parser = parse_seconds)]
    pub grace_period: Duration,

    /// Copy the ranks' output as it is, without the "[RANK] " prefix on each line.
    #[arg(long = "no-prefix")]
    pub no_prefix: bool,

    /// The program to run as each rank, then its arguments.
    #[arg(
        value_name = "PROGRAM",
        required = true,
        num_args = 1..,
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    pub command: Vec<OsString>,
}

/// Flags of the hidden `oxcomm store-ping`, run as a rank by `oxcomm launch`: connects to the
/// store with `MASTER_ADDR`, `MASTER_PORT` and `OXCOMM_TOKEN`, publishes its rank, waits for
/// every rank's key and prints `store-ping: rank R of W ok, job ID`.
#[derive(Debug, Clone, clap::Args)]
pub struct StorePingArgs {
    /// Seconds to wait for the store and for the other ranks.
    #[arg(long, value_name = "SECS", default_value = "20", value_parser = parse_seconds)]
    pub timeout: Duration,
}

fn parse_seconds(raw: &str) -> Result<Duration, String> {
    raw.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| *s >= 0.0)
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| format!("{raw:?} is not a non-negative number of seconds"))
}

// ---------------------------------------------------------------------------------------------
// LaunchPlan: what the flags mean
// ---------------------------------------------------------------------------------------------

/// Where the ranks' store is and who serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum StorePlan {
    /// This launcher serves the store, bound to `bind`; the ranks get `advertise` (or the bound
    /// address when `None`) as `MASTER_ADDR`, and the bound port.
    Serve { bind: SocketAddr, advertise: Option<String> },
    /// Node 0's launcher serves it; the ranks only get its address.
    Remote { addr: String, port: u16 },
}

/// Everything [`execute`] needs, checked.
#[derive(Debug, Clone)]
struct LaunchPlan {
    nproc: usize,
    nnodes: usize,
    node_rank: usize,
    world_size: usize,
    store: StorePlan,
    token: String,
    job_id: String,
    program: OsString,
    args: Vec<OsString>,
    prefix: bool,
    grace: Duration,
}

impl LaunchPlan {
    /// Checks `args`; `get` reads the launcher's environment (only `OXCOMM_TOKEN`, for
    /// multi-node jobs).
    fn new(args: &LaunchArgs, get: impl Fn(&str) -> Option<String>) -> anyhow::Result<LaunchPlan> {
        let nproc = args.nproc_per_node;
        if nproc == 0 {
            bail!("-n/--nproc-per-node must be at least 1");
        }
        if args.nnodes == 0 {
            bail!("--nnodes must be at least 1");
        }
        if args.node_rank >= args.nnodes {
            bail!("--node-rank {} is not below --nnodes {}", args.node_rank, args.nnodes);
        }
        let world_size = nproc
            .checked_mul(args.nnodes)
            .filter(|w| *w <= i32::MAX as usize)
            .ok_or_else(|| anyhow!("--nnodes {} × -n {nproc} ranks is too many", args.nnodes))?;
        let (program, rest) =
            args.command.split_first().ok_or_else(|| anyhow!("no program given: oxcomm launch -n N PROGRAM"))?;

        let (store, token) = if args.nnodes == 1 {
            let host = args.master_addr.as_deref().unwrap_or("127.0.0.1");
            let bind = resolve(host, args.master_port.unwrap_or(0))?;
            let advertise = args.master_addr.clone().filter(|_| !bind.ip().is_unspecified());
            (StorePlan::Serve { bind, advertise }, rendezvous::generate_token())
        } else {
            let addr = args.master_addr.clone().ok_or_else(|| {
                anyhow!("--master-addr is required with --nnodes {}: the address of node 0", args.nnodes)
            })?;
            let port = match args.master_port {
                None | Some(0) => bail!(
                    "--master-port is required with --nnodes {} and must not be 0: every node must know it",
                    args.nnodes
                ),
                Some(port) => port,
            };
            let token = get(OXCOMM_TOKEN).filter(|t| !t.trim().is_empty()).ok_or_else(|| {
                anyhow!(
                    "{OXCOMM_TOKEN} is not set: a multi-node job needs a secret shared by every node, \
                     e.g. `export {OXCOMM_TOKEN}=$(openssl rand -hex 32)` with the same value on all nodes"
                )
            })?;
            let store = if args.node_rank == 0 {
                StorePlan::Serve { bind: resolve(&addr, port)?, advertise: Some(addr) }
            } else {
                StorePlan::Remote { addr, port }
            };
            (store, token.trim().to_owned())
        };
        Ok(LaunchPlan {
            nproc,
            nnodes: args.nnodes,
            node_rank: args.node_rank,
            world_size,
            store,
            job_id: job_id(&token),
            token,
            program: program.clone(),
            args: rest.to_vec(),
            prefix: !args.no_prefix,
            grace: args.grace_period,
        })
    }
}

/// The first address `host:port` resolves to.
fn resolve(host: &str, port: u16) -> anyhow::Result<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve the master address {host:?}"))?
        .next()
        .ok_or_else(|| anyhow!("the master address {host:?} resolves to no address"))
}

/// The job id for `token`: the first 80 bits of SHA-256("oxcomm-job-id/v1\0" ‖ token) in
/// base 32 (`a-z`, `2-7`), 16 characters. Every node holding the same token gets the same id.
pub fn job_id(token: &str) -> String {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let digest = Sha256::new().chain_update(b"oxcomm-job-id/v1\0").chain_update(token.as_bytes()).finalize();
    let bits = digest[..10].iter().fold(0u128, |acc, &b| (acc << 8) | u128::from(b));
    (0..16).rev().map(|i| ALPHABET[((bits >> (5 * i)) & 31) as usize] as char).collect()
}

// ---------------------------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------------------------

/// Runs `oxcomm launch`: returns the exit status the launcher should exit with (0 when every
/// rank succeeded, the first failed rank's status, or 128 + signal when the launcher was
/// interrupted). Errors are about the launch itself (bad flags, program not found, store
/// cannot bind).
pub fn run(args: LaunchArgs) -> anyhow::Result<i32> {
    let plan = LaunchPlan::new(&args, |name| std::env::var(name).ok())?;
    execute(&plan)
}

/// Runs this command again ([`crate::self_command`]) with `args` as `n` local ranks, with the
/// same environment, output handling, signals and failure handling as `oxcomm launch -n n`
/// (a fresh token and store on 127.0.0.1). Returns the launcher's exit status (see [`run`]).
/// Used by `oxcomm bench` to start itself.
pub fn launch_self(n: usize, args: Vec<String>, prefix: bool) -> anyhow::Result<i32> {
    let mut command = crate::self_command()?;
    command.extend(args.into_iter().map(OsString::from));
    let args = LaunchArgs {
        nproc_per_node: n,
        nnodes: 1,
        node_rank: 0,
        master_addr: None,
        master_port: None,
        grace_period: DEFAULT_GRACE_PERIOD,
        no_prefix: !prefix,
        command,
    };
    let plan = LaunchPlan::new(&args, |_| None)?;
    execute(&plan)
}

// ---------------------------------------------------------------------------------------------
// Running the job
// ---------------------------------------------------------------------------------------------

/// What wakes the launcher's main loop.
enum Event {
    Signal(i32),
    OutputClosed,
}

/// One rank this launcher started.
struct Rank {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
}

/// Why the launcher is stopping the job.
#[derive(Debug, Clone, Copy)]
enum Stop {
    /// A rank failed; exit with its status.
    Failed(i32),
    /// The launcher got this signal; exit with 128 + it.
    Signaled(i32),
}

fn execute(plan: &LaunchPlan) -> anyhow::Result<i32> {
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
        match spawn_rank(plan, local_rank, &master_addr, master_port, tx) {
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
    let (mut code, stop) = supervise(plan, &mut ranks, rx, &mut closed);
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

/// Starts local rank `local_rank`; returns it and the number of output readers started.
fn spawn_rank(
    plan: &LaunchPlan,
    local_rank: usize,
    master_addr: &str,
    master_port: u16,
    tx: &mpsc::Sender<Event>,
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
        .env(OXCOMM_JOB_ID, &plan.job_id)
        .env(OXCOMM_STORE, STORE_LAUNCHER);
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
    Ok((Rank { rank, child, status: None }, pipes))
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
/// if it did. Counts the output readers that finished meanwhile in `closed`.
fn supervise(
    plan: &LaunchPlan,
    ranks: &mut [Rank],
    rx: &mpsc::Receiver<Event>,
    closed: &mut usize,
) -> (i32, Option<Stop>) {
    let mut stop: Option<Stop> = None;
    let mut kill_at: Option<Instant> = None;
    loop {
        let mut newly_failed = false;
        for rank in ranks.iter_mut().filter(|r| r.status.is_none()) {
            match rank.child.try_wait() {
                Ok(Some(status)) => {
                    rank.status = Some(status);
                    if stop.is_none() && !status.success() {
                        let code = exit_code(status);
                        eprintln!(
                            "oxcomm launch: rank {} exited with status {code}{}; stopping the other ranks",
                            rank.rank,
                            describe_signal(status)
                        );
                        stop = Some(Stop::Failed(code));
                        kill_at = Some(Instant::now() + plan.grace);
                        newly_failed = true;
                    }
                }
                Ok(None) => {}
                Err(err) => eprintln!("oxcomm launch: cannot check rank {}: {err}", rank.rank),
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
        None => 0,
        Some(Stop::Failed(code)) => code,
        Some(Stop::Signaled(signal)) => 128 + signal,
    };
    if stop.is_some() {
        // Whatever the ranks left behind in their groups goes too.
        signal_all(ranks, SIGKILL);
    }
    (code, stop)
}

/// Multi-node jobs only: keeps node 0's store up until every node's ranks are done, so ranks
/// on a slower node can still use it after node 0's ranks exit. Each launcher of nodes 1..K
/// sets `oxcomm-launch/{job id}/exit/{node}` once its ranks have exited; node 0's launcher,
/// when its own ranks all succeeded, waits for those keys (at most
/// [`EXIT_BARRIER_TIMEOUT`]). When node 0's ranks failed or it was interrupted, it closes the
/// store at once, which tells the ranks elsewhere that the job is over.
struct ExitBarrier<'a> {
    plan: &'a LaunchPlan,
    token: &'a [u8],
    master_addr: &'a str,
    master_port: u16,
}

impl ExitBarrier<'_> {
    fn key(&self, node: usize) -> String {
        format!("oxcomm-launch/{}/exit/{node}", self.plan.job_id)
    }

    /// Returns the signal that interrupted the wait, if one did.
    fn run(&self, server: Option<&StoreServer>, stop: Option<Stop>, rx: &mpsc::Receiver<Event>) -> Option<i32> {
        match server {
            None => {
                self.report();
                None
            }
            Some(_) if stop.is_some() => None,
            Some(server) => self.wait(server, rx),
        }
    }

    /// On nodes 1..K: tells node 0 this node's ranks are done. Failing to reach it is fine:
    /// node 0's launcher has then already gone.
    fn report(&self) {
        let deadline = Instant::now() + EXIT_REPORT_TIMEOUT;
        let Ok(addr) = resolve(self.master_addr, self.master_port) else { return };
        if let Ok(client) = StoreClient::connect(addr, self.token, deadline) {
            let _ = client.with_op_timeout(EXIT_REPORT_TIMEOUT).set(&self.key(self.plan.node_rank), b"done");
        }
    }

    /// On node 0: waits for every other node's report, a signal, or the timeout.
    fn wait(&self, server: &StoreServer, rx: &mpsc::Receiver<Event>) -> Option<i32> {
        let start = Instant::now();
        let deadline = start + EXIT_BARRIER_TIMEOUT;
        let local = server.local_addr();
        let addr = match local.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), local.port()),
            IpAddr::V6(ip) if ip.is_unspecified() => {
                SocketAddr::new(std::net::Ipv6Addr::LOCALHOST.into(), local.port())
            }
            _ => local,
        };
        let client = match StoreClient::connect(addr, self.token, start + EXIT_REPORT_TIMEOUT) {
            Ok(client) => client,
            Err(err) => {
                eprintln!("oxcomm launch: cannot wait for the other nodes: {err}");
                return None;
            }
        };
        let keys: Vec<String> = (1..self.plan.nnodes).map(|node| self.key(node)).collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut told = false;
        loop {
            let now = Instant::now();
            match client.wait(&key_refs, deadline.min(now + POLL_INTERVAL)) {
                Ok(()) => return None,
                Err(err) if err.kind() == ErrorKind::Timeout => {}
                Err(err) => {
                    eprintln!("oxcomm launch: cannot wait for the other nodes: {err}");
                    return None;
                }
            }
            if Instant::now() >= deadline {
                eprintln!(
                    "oxcomm launch: gave up after {}s waiting for the other nodes' ranks to finish",
                    EXIT_BARRIER_TIMEOUT.as_secs()
                );
                return None;
            }
            if !told && start.elapsed() >= EXIT_BARRIER_NOTICE {
                eprintln!(
                    "oxcomm launch: this node's ranks are done; serving the store until the other nodes' \
                     ranks finish (at most {}s)",
                    EXIT_BARRIER_TIMEOUT.as_secs()
                );
                told = true;
            }
            while let Ok(event) = rx.try_recv() {
                if let Event::Signal(signal @ (SIGINT | SIGTERM)) = event {
                    return Some(signal);
                }
            }
        }
    }
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

// ---------------------------------------------------------------------------------------------
// Output
// ---------------------------------------------------------------------------------------------

/// Where a rank's stream is copied to.
#[derive(Debug, Clone, Copy)]
enum Sink {
    Stdout,
    Stderr,
}

impl Sink {
    /// Writes `line` in one piece while holding the stream's lock, so lines of different ranks
    /// never interleave. Errors (a closed pipe) are ignored: the ranks' output is still drained.
    fn write_line(self, line: &[u8]) {
        let _ = match self {
            Sink::Stdout => {
                let mut out = io::stdout().lock();
                out.write_all(line).and_then(|()| out.flush())
            }
            Sink::Stderr => {
                let mut err = io::stderr().lock();
                err.write_all(line).and_then(|()| err.flush())
            }
        };
    }
}

/// Starts a thread copying `src` to `sink`; returns 1 if it started (0 if not, after which the
/// rank's output on that stream is lost but the rank can still write: the pipe is closed and
/// it gets `EPIPE`).
fn start_pump(
    src: impl Read + Send + 'static,
    prefix: Option<String>,
    sink: Sink,
    tx: &mpsc::Sender<Event>,
    rank: usize,
) -> usize {
    let tx = tx.clone();
    let started = std::thread::Builder::new().name(format!("oxcomm-launch-out-{rank}")).spawn(move || {
        pump(src, prefix.as_deref().map(str::as_bytes), |line| sink.write_line(line));
        let _ = tx.send(Event::OutputClosed);
    });
    usize::from(started.is_ok())
}

/// Copies `src` to `write` one line at a time, each with `prefix` in front. With a prefix, a
/// last line without a newline gets one (so the next rank's line starts on its own). A run of
/// more than [`MAX_LINE`] bytes without a newline is written out in pieces of that size.
fn pump(src: impl Read, prefix: Option<&[u8]>, mut write: impl FnMut(&[u8])) {
    let prefix = prefix.unwrap_or_default();
    let mut reader = BufReader::with_capacity(MAX_LINE, src);
    let mut line = prefix.to_vec();
    let mut emit = |line: &mut Vec<u8>| {
        if !prefix.is_empty() && line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        write(line);
        line.truncate(prefix.len());
    };
    loop {
        let buf = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        if buf.is_empty() {
            break;
        }
        let (take, complete) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        line.extend_from_slice(&buf[..take]);
        reader.consume(take);
        if complete || line.len() - prefix.len() >= MAX_LINE {
            emit(&mut line);
        }
    }
    if line.len() > prefix.len() {
        emit(&mut line);
    }
}

// ---------------------------------------------------------------------------------------------
// store-ping
// ---------------------------------------------------------------------------------------------

/// Runs the hidden `oxcomm store-ping` (see [`StorePingArgs`]); returns the exit status.
pub fn store_ping(args: StorePingArgs) -> anyhow::Result<i32> {
    let info = EnvInfo::from_env().context("store-ping must run as a rank of `oxcomm launch`")?;
    let settings = Settings::from_env()?;
    if std::env::var(OXCOMM_STORE).ok().as_deref() != Some(STORE_LAUNCHER) {
        bail!("{OXCOMM_STORE} is not {STORE_LAUNCHER:?}: no launcher serves the store");
    }
    let (Some(host), Some(port)) = (info.master_addr.as_deref(), info.master_port) else {
        bail!("{MASTER_ADDR} and {MASTER_PORT} must be set");
    };
    let token = settings.token.ok_or_else(|| anyhow!("{OXCOMM_TOKEN} is not set"))?;
    let job = std::env::var(OXCOMM_JOB_ID).with_context(|| format!("{OXCOMM_JOB_ID} is not set"))?;
    let deadline = Instant::now() + args.timeout;
    let addr = resolve(host, port)?;
    let client = StoreClient::connect(addr, &token, deadline)
        .with_context(|| format!("cannot connect to the store at {addr}"))?;
    let store = PrefixStore::new(format!("store-ping/{job}"), &client);
    store.set(&format!("rank/{}", info.rank), info.rank.to_string().as_bytes())?;
    store.add("count", 1)?;
    let keys: Vec<String> = (0..info.world_size).map(|r| format!("rank/{r}")).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    store.wait(&key_refs, deadline).context("waiting for the other ranks")?;
    for (r, key) in keys.iter().enumerate() {
        let value = store.get(key, deadline)?;
        if value != r.to_string().as_bytes() {
            bail!("store key {key} holds {:?}, not {r}", String::from_utf8_lossy(&value));
        }
    }
    println!("store-ping: rank {} of {} ok, job {job}", info.rank, info.world_size);
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Wrapper {
        #[command(flatten)]
        launch: LaunchArgs,
    }

    fn parse(args: &[&str]) -> Result<LaunchArgs, clap::Error> {
        Wrapper::try_parse_from(std::iter::once("launch").chain(args.iter().copied())).map(|w| w.launch)
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn program_arguments_are_kept_verbatim() {
        let args = parse(&["-n", "2", "sh", "-c", "echo -n x", "--no-prefix"]).unwrap();
        assert_eq!(args.nproc_per_node, 2);
        assert!(!args.no_prefix);
        assert_eq!(args.command, ["sh", "-c", "echo -n x", "--no-prefix"]);
        let args = parse(&["--no-prefix", "-n", "1", "--", "-weird"]).unwrap();
        assert!(args.no_prefix);
        assert_eq!(args.command, ["-weird"]);
    }

    #[test]
    fn torchrun_spellings_are_aliases() {
        for flags in [
            ["--nproc-per-node=3", "--nnodes=2", "--node-rank=1", "--master-addr=h", "--master-port=9"],
            ["--nproc_per_node=3", "--nnodes=2", "--node_rank=1", "--master_addr=h", "--master_port=9"],
        ] {
            let mut all = flags.to_vec();
            all.push("prog");
            let args = parse(&all).unwrap();
            assert_eq!(args.nproc_per_node, 3);
            assert_eq!(args.nnodes, 2);
            assert_eq!(args.node_rank, 1);
            assert_eq!(args.master_addr.as_deref(), Some("h"));
            assert_eq!(args.master_port, Some(9));
        }
    }

    #[test]
    fn flags_need_values_and_a_program() {
        assert!(parse(&["prog"]).is_err(), "-n is required");
        assert!(parse(&["-n", "2"]).is_err(), "a program is required");
        assert!(parse(&["-n", "2", "--grace-period", "-1", "prog"]).is_err());
        let args = parse(&["-n", "2", "--grace-period", "0.5", "prog"]).unwrap();
        assert_eq!(args.grace_period, Duration::from_millis(500));
        assert_eq!(parse(&["-n", "2", "prog"]).unwrap().grace_period, DEFAULT_GRACE_PERIOD);
    }

    #[test]
    fn single_node_plan_serves_on_loopback_with_a_fresh_token() {
        let args = parse(&["-n", "4", "prog", "a"]).unwrap();
        let a = LaunchPlan::new(&args, no_env).unwrap();
        let b = LaunchPlan::new(&args, no_env).unwrap();
        assert_eq!(a.world_size, 4);
        assert_eq!(a.store, StorePlan::Serve { bind: "127.0.0.1:0".parse().unwrap(), advertise: None });
        assert_eq!(a.token.len(), 64);
        assert_ne!(a.token, b.token);
        assert_ne!(a.job_id, b.job_id);
        assert_eq!(a.program, "prog");
        assert_eq!(a.args, ["a"]);
        // OXCOMM_TOKEN of the launcher is ignored on one node: every job gets its own.
        let c = LaunchPlan::new(&args, |_| Some("shared".into())).unwrap();
        assert_ne!(c.token, "shared");
    }

    #[test]
    fn bad_counts_are_errors() {
        for flags in
            [&["-n", "0"][..], &["-n", "1", "--nnodes", "0"], &["-n", "1", "--nnodes", "2", "--node-rank", "2"]]
        {
            let mut all = flags.to_vec();
            all.push("prog");
            assert!(LaunchPlan::new(&parse(&all).unwrap(), no_env).is_err(), "{flags:?}");
        }
    }

    #[test]
    fn multi_node_plan_needs_address_port_and_token() {
        let token = |name: &str| (name == OXCOMM_TOKEN).then(|| "s3cret".to_owned());
        let base = ["-n", "2", "--nnodes", "3", "--node-rank", "1"];
        let with = |extra: &[&str]| {
            let mut all = base.to_vec();
            all.extend_from_slice(extra);
            all.push("prog");
            parse(&all).unwrap()
        };
        assert!(LaunchPlan::new(&with(&["--master-port", "7000"]), token).is_err());
        assert!(LaunchPlan::new(&with(&["--master-addr", "10.0.0.1"]), token).is_err());
        assert!(LaunchPlan::new(&with(&["--master-addr", "10.0.0.1", "--master-port", "0"]), token).is_err());
        let full = with(&["--master-addr", "10.0.0.1", "--master-port", "7000"]);
        let err = LaunchPlan::new(&full, no_env).unwrap_err().to_string();
        assert!(err.contains("OXCOMM_TOKEN") && err.contains("every node"), "{err}");

        let plan = LaunchPlan::new(&full, token).unwrap();
        assert_eq!(plan.world_size, 6);
        assert_eq!(plan.node_rank, 1);
        assert_eq!(plan.store, StorePlan::Remote { addr: "10.0.0.1".into(), port: 7000 });
        assert_eq!(plan.token, "s3cret");
        assert_eq!(plan.job_id, job_id("s3cret"));

        let node0 =
            parse(&["-n", "2", "--nnodes", "3", "--master-addr", "127.0.0.1", "--master-port", "7000", "p"]).unwrap();
        let plan = LaunchPlan::new(&node0, token).unwrap();
        assert_eq!(
            plan.store,
            StorePlan::Serve { bind: "127.0.0.1:7000".parse().unwrap(), advertise: Some("127.0.0.1".into()) }
        );
    }

    #[test]
    fn job_ids_are_short_lowercase_and_stable() {
        let id = job_id("token");
        assert_eq!(id.len(), 16);
        assert!(id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()), "{id}");
        assert_eq!(id, job_id("token"));
        assert_ne!(id, job_id("token2"));
    }

    fn pumped(input: &[u8], prefix: Option<&str>) -> Vec<Vec<u8>> {
        let mut lines = Vec::new();
        pump(input, prefix.map(str::as_bytes), |line| lines.push(line.to_vec()));
        lines
    }

    #[test]
    fn pump_prefixes_each_line_and_ends_a_partial_one() {
        assert_eq!(pumped(b"a\nbc\npartial", Some("[3] ")), [&b"[3] a\n"[..], b"[3] bc\n", b"[3] partial\n"]);
        assert_eq!(pumped(b"a\npartial", None), [&b"a\n"[..], b"partial"]);
        assert_eq!(pumped(b"\n\n", Some("[0] ")), [&b"[0] \n"[..], b"[0] \n"]);
        assert!(pumped(b"", Some("[0] ")).is_empty());
    }

    #[test]
    fn pump_splits_overlong_lines() {
        let long = vec![b'x'; MAX_LINE * 2 + 10];
        let lines = pumped(&long, Some("[1] "));
        assert_eq!(lines.len(), 3);
        assert!(lines.iter().all(|l| l.starts_with(b"[1] ") && l.ends_with(b"\n")));
        assert_eq!(lines.iter().map(|l| l.len() - 5).sum::<usize>(), long.len());
    }

    #[test]
    fn exit_codes_follow_the_shell() {
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGKILL)), 137);
        assert_eq!(describe_signal(ExitStatus::from_raw(libc::SIGKILL)), " (killed by SIGKILL)");
        assert_eq!(describe_signal(ExitStatus::from_raw(0)), "");
    }

    /// Run as a rank by `launch_self_starts_this_executable`: checks its environment. Ignored
    /// in normal runs; without a launcher's environment it does nothing.
    #[test]
    #[ignore = "a rank of launch_self_starts_this_executable"]
    fn rank_probe() {
        let Ok(rank) = std::env::var(OXCOMM_RANK) else { return };
        assert_eq!(std::env::var(RANK).unwrap(), rank);
        assert_eq!(std::env::var(WORLD_SIZE).unwrap(), "2");
        assert_eq!(std::env::var(OXCOMM_STORE).unwrap(), STORE_LAUNCHER);
        assert_eq!(std::env::var(OXCOMM_TOKEN).unwrap().len(), 64);
    }

    #[test]
    fn launch_self_starts_this_executable() {
        let args = ["launch::tests::rank_probe", "--exact", "--ignored", "--quiet", "--test-threads=1"];
        let code = launch_self(2, args.iter().map(|s| s.to_string()).collect(), true).unwrap();
        assert_eq!(code, 0);
    }
}
