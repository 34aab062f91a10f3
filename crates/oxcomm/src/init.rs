//! Starting a communicator for ranks that are processes: [`init`] reads the environment that
//! `oxcomm launch`, torchrun, mpirun or srun set, meets the other ranks through the
//! authenticated key-value store, decides which peers share this host, and builds shared
//! memory links to them and TCP links to the other hosts.
//!
//! [`Init`] is the explicit builder for programs that know their rank and store address
//! without the environment.
//!
//! Host identity is the hostname, the boot id and the network namespace, or
//! [`ENV_HOST_ID`] when set; ranks with equal identities talk over shared memory.

use std::any::Any;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::comm::{CommConfig, Communicator};
use crate::error::{Error, ErrorKind, Result};
use crate::rendezvous::env::{EnvInfo, Settings, TransportChoice};
use crate::rendezvous::{PrefixStore, Store, StoreClient, StoreServer};
use crate::transport::Transport;

/// Environment variable: job id shared by all ranks (set by `oxcomm launch`); names shared
/// memory segments and store keys. Default: derived from the token.
pub const ENV_JOB_ID: &str = "OXCOMM_JOB_ID";
/// Environment variable: `launcher` when the launcher already serves the store, so rank 0
/// must not start one. Default: rank 0 serves the store at `MASTER_ADDR:MASTER_PORT`.
pub const ENV_STORE: &str = "OXCOMM_STORE";
/// The value of [`ENV_STORE`] that `oxcomm launch` sets.
pub const STORE_LAUNCHER: &str = "launcher";
/// Environment variable: overrides this process's host identity (ranks with equal ids use
/// shared memory between them). Default: hostname + boot id + network namespace.
pub const ENV_HOST_ID: &str = "OXCOMM_HOST_ID";

/// Environment variable: which backend [`init`] uses: `native` (oxcomm's own transports) or
/// `mpi` (needs the cargo feature `mpi`; see [`crate::backend`]). Default: `native`.
pub const ENV_BACKEND: &str = "OXCOMM_BACKEND";

/// Environment variable: `core` pins each rank of a shared-memory job to its own core when
/// the host has a core per local rank (as mpirun's `--bind-to core`), `none` leaves placement
/// to the OS. Default: `core`.
pub const ENV_BIND: &str = "OXCOMM_BIND";

/// How many communicators this process has initialised (part of segment names, so a second
/// `init` in one process does not collide with the first).
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Builds a world communicator from the environment; see the [module docs](self). With
/// [`ENV_BACKEND`]`=mpi` (and the cargo feature `mpi`) it is `oxcomm::mpi::init()` instead.
///
/// ```no_run
/// let comm = oxcomm::init()?;
/// let mut grads = vec![1.0f32; 1024];
/// comm.all_reduce(&mut grads, oxcomm::ReduceOp::Avg)?;
/// # Ok::<(), oxcomm::Error>(())
/// ```
pub fn init() -> Result<Communicator> {
    match std::env::var(ENV_BACKEND).unwrap_or_default().trim().to_ascii_lowercase().as_str() {
        "" | "native" => {}
        #[cfg(feature = "mpi")]
        "mpi" => return crate::mpi::init(),
        #[cfg(not(feature = "mpi"))]
        "mpi" => {
            return Err(Error::unsupported(format!(
                "{ENV_BACKEND}=mpi but oxcomm was built without the `mpi` cargo feature"
            )))
        }
        other => return Err(Error::invalid(format!("{ENV_BACKEND}={other}: expected `native` or `mpi`"))),
    }
    Init::from_env()?.connect()
}

/// Joins a running job as a replacement rank ([`Init::join`] from the environment): what a
/// program started by `oxcomm launch --on-failure restart` calls when [`crate::grow::ENV_JOIN`]
/// is set, instead of [`init`]. Native backend only ([`ErrorKind::Unsupported`] with
/// [`ENV_BACKEND`]`=mpi`).
pub fn join() -> Result<Communicator> {
    match std::env::var(ENV_BACKEND).unwrap_or_default().trim().to_ascii_lowercase().as_str() {
        "" | "native" => Init::from_env()?.join(),
        _ => Err(Error::unsupported(format!(
            "join with {ENV_BACKEND}=mpi: growing back is not available on the MPI backend (ULFM has no grow)"
        ))),
    }
}

/// The job id of the next communicator this process connects or joins: `<job>-<n>` for the
/// n-th (see [`Init::connect`]).
pub(crate) fn next_job(job: &str) -> String {
    let generation = GENERATION.fetch_add(1, Ordering::SeqCst);
    format!("{job}-{generation}")
}

/// Explicit settings for joining a job; [`Init::from_env`] fills them from the environment.
#[derive(Debug, Clone)]
pub struct Init {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Address of the key-value store (`MASTER_ADDR:MASTER_PORT`).
    pub store_addr: SocketAddr,
    /// Whether someone else (the launcher) serves the store; otherwise rank 0 does.
    pub store_served: bool,
    /// The job's shared secret.
    pub token: Vec<u8>,
    /// The job id (letters, digits, `-`, `_`).
    pub job: String,
    /// Which transports to use.
    pub transport: TransportChoice,
    /// Settings of the communicator (timeout, segment size, ...).
    pub config: CommConfig,
    /// Overrides host identity (see [`ENV_HOST_ID`]).
    pub host_id: Option<String>,
    /// Network interface for TCP links (`OXCOMM_SOCKET_IFNAME`).
    pub socket_ifname: Option<String>,
    /// Address for TCP links (`OXCOMM_SOCKET_ADDR`; wins over the interface).
    pub socket_addr: Option<std::net::IpAddr>,
    /// Pin the calling thread to its own core when every rank of a shared-memory job has one
    /// ([`ENV_BIND`]; default `true` from the environment). A library embedded in another
    /// program (the Python binding) sets it `false`: threads the caller starts later inherit
    /// the mask.
    pub pin_to_core: bool,
}

impl Init {
    /// Reads the environment (see [`EnvInfo`] and [`Settings`] for the variables).
    pub fn from_env() -> Result<Init> {
        Init::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`Init::from_env`] with an injectable lookup (for tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Init> {
        let env = EnvInfo::from_lookup(&get)?;
        let settings = Settings::from_lookup(&get)?;
        let addr = env.master_addr.clone().ok_or_else(|| {
            Error::new(ErrorKind::Rendezvous, "MASTER_ADDR is not set: every rank needs the store's address")
        })?;
        let port = env.master_port.ok_or_else(|| {
            Error::new(ErrorKind::Rendezvous, "MASTER_PORT is not set: every rank needs the store's port")
        })?;
        let store_addr = (addr.as_str(), port)
            .to_socket_addrs()
            .map_err(|e| Error::new(ErrorKind::Rendezvous, format!("MASTER_ADDR={addr}: cannot resolve: {e}")))?
            .next()
            .ok_or_else(|| Error::new(ErrorKind::Rendezvous, format!("MASTER_ADDR={addr} resolves to nothing")))?;
        let token = settings.token.clone().ok_or_else(|| {
            Error::new(
                ErrorKind::Rendezvous,
                "OXCOMM_TOKEN is not set: every rank must share the job's secret (oxcomm launch sets it; \
                 with mpirun or srun export the same value to every rank, e.g. OXCOMM_TOKEN=$(openssl rand -hex 32))",
            )
        })?;
        let job = get(ENV_JOB_ID).unwrap_or_else(|| job_from_token(&token));
        let config = CommConfig { timeout: settings.timeout, ..CommConfig::default() };
        Ok(Init {
            rank: env.rank,
            world_size: env.world_size,
            store_addr,
            store_served: get(ENV_STORE).is_some_and(|v| v == STORE_LAUNCHER),
            token,
            job,
            transport: settings.transport,
            config,
            host_id: get(ENV_HOST_ID),
            socket_ifname: settings.socket_ifname.clone(),
            socket_addr: settings.socket_addr,
            pin_to_core: get(ENV_BIND).is_none_or(|v| v.trim() != "none"),
        })
    }

    /// Joins the job: meets every rank through the store and builds the links. The n-th
    /// communicator a process connects uses job id `<job>-<n>` (every rank of a job connects
    /// the same number of times, so the ids agree).
    pub fn connect(mut self) -> Result<Communicator> {
        self.job = next_job(&self.job);
        let deadline = Instant::now() + self.config.timeout;
        let mut keep: Vec<Box<dyn Any + Send + Sync>> = Vec::new();
        let client = if self.rank == 0 && !self.store_served {
            let server = StoreServer::bind(self.store_addr, &self.token).map_err(|e| e.with_rank(0))?;
            let addr = server.local_addr();
            keep.push(Box::new(server));
            StoreClient::connect(addr, &self.token, deadline)?
        } else {
            StoreClient::connect(self.store_addr, &self.token, deadline).map_err(|e| e.with_rank(self.rank))?
        };
        let store: Arc<dyn Store> = Arc::new(client);
        keep.push(Box::new(store.clone()));
        let comm = self.connect_with_store(store)?;
        comm.keep_alive(keep);
        // Nobody leaves setup (and rank 0 keeps serving the store) until everyone is in.
        comm.barrier()?;
        Ok(comm)
    }

    /// Joins the job through an existing store (e.g. an [`crate::rendezvous::InMemoryStore`]
    /// shared by threads, the launcher's, or a framework's). `job` must be the same on every
    /// rank and unique among the communicators built on this store (it names the store keys
    /// and shared-memory segments); [`Init::connect`] makes it so.
    pub fn connect_with_store(&self, store: Arc<dyn Store>) -> Result<Communicator> {
        let (rank, world) = (self.rank, self.world_size);
        if rank >= world {
            return Err(Error::invalid(format!("rank {rank} out of range for world size {world}")));
        }
        crate::transport::shm::validate_job(&self.job)?;
        let job = self.job.clone();
        let origin = crate::grow::Origin { init: self.clone(), store: store.clone(), generation: 0 };
        let store = PrefixStore::new(format!("oxcomm/{job}"), store);
        let comm = self.meet(&store, &job).inspect_err(|e| publish_failure(&store, rank, e))?;
        comm.set_origin(Arc::new(origin));
        Ok(comm)
    }

    /// The body of [`Init::connect_with_store`] under the job's store prefix.
    fn meet(&self, store: &PrefixStore<Arc<dyn Store>>, job: &str) -> Result<Communicator> {
        let (rank, world) = (self.rank, self.world_size);
        let job = job.to_string();
        let deadline = Instant::now() + self.config.timeout;
        let fail = |e: Error| e.with_rank(rank);

        // Per-run randomness, from rank 0 (published before its host key, so whoever has read
        // that has it): shared-memory names are not predictable from a reused token alone.
        if rank == 0 {
            let mut nonce = [0u8; RUN_NONCE_BYTES];
            getrandom::fill(&mut nonce)
                .map_err(|e| Error::new(ErrorKind::Io, format!("the OS random source failed: {e}")).with_rank(rank))?;
            store.set(RUN_KEY, crate::rendezvous::to_hex(&nonce).as_bytes()).map_err(fail)?;
        }

        // Who shares this host?
        let host = self.host_id.clone().unwrap_or_else(host_identity);
        store.set(&format!("host/{rank}"), host.as_bytes()).map_err(fail)?;
        let mut hosts = Vec::with_capacity(world);
        for r in 0..world {
            wait_watching(store, &[&format!("host/{r}")], deadline)
                .map_err(|e| e.with_rank(rank).with_peer(r).with_op("init (waiting for every rank to join)"))?;
            hosts.push(store.get(&format!("host/{r}"), deadline).map_err(fail)?);
        }
        let run = store.get(RUN_KEY, deadline).map_err(fail)?;
        let run = std::str::from_utf8(&run)
            .ok()
            .filter(|r| r.len() == 2 * RUN_NONCE_BYTES && r.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| Error::protocol("init: the run nonce in the store is malformed").with_rank(rank))?;
        // The segment names' job part: as much of the job as fits, then the run nonce.
        let keep = job.len().min(crate::transport::shm::MAX_JOB_LEN - run.len() - 1);
        let shm_job = format!("{}-{run}", &job[..keep]);
        let local: Vec<usize> = (0..world).filter(|r| hosts[*r] == host.as_bytes() && *r != rank).collect();
        let remote: Vec<usize> = (0..world).filter(|r| hosts[*r] != host.as_bytes()).collect();
        let use_shm = !matches!(self.transport, TransportChoice::Tcp);
        if !remote.is_empty() && matches!(self.transport, TransportChoice::Shm) {
            return Err(Error::invalid(format!(
                "rank {rank}: OXCOMM_TRANSPORT=shm but {} peer(s) are on other hosts",
                remote.len()
            )));
        }
        // TCP to every peer when asked, or when no peer shares this host (but some exist).
        if !use_shm || (local.is_empty() && !remote.is_empty()) {
            tracing::info!(target: "oxcomm::init", rank, world, job = %job, "joining over TCP");
            let (ip, tcp) = self.tcp_settings()?;
            let (links, bell) = crate::transport::tcp::connect_mesh_with(
                &Watching(store),
                rank,
                world,
                ip,
                &self.token,
                &job,
                &tcp,
                deadline,
            )
            .map_err(fail)?;
            let comm = Communicator::from_links(rank, links, bell, self.config.clone(), Transport::Tcp)?;
            return calibrated(comm.with_hosts(&hosts)?, &hosts);
        }
        // The cores the local ranks share, counted before this rank is pinned to one.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if self.pin_to_core {
            let local_rank = (0..world).filter(|r| hosts[*r] == host.as_bytes() && *r < rank).count();
            bind_to_core(local_rank, local.len() + 1);
        }
        // Peers on other hosts first (every rank does the same, so nobody waits on a rank
        // that is still in the other phase), then shared memory with this host's.
        let tcp = if remote.is_empty() {
            None
        } else {
            tracing::info!(target: "oxcomm::init", rank, world, job = %job, local = local.len(), remote = remote.len(),
                "joining over shared memory and TCP");
            let (ip, tcp) = self.tcp_settings()?;
            let parts = crate::transport::tcp::connect_peers_with(
                &Watching(store),
                rank,
                world,
                &remote,
                ip,
                &self.token,
                &job,
                &tcp,
                deadline,
            )
            .map_err(fail)?;
            Some(parts)
        };
        if tcp.is_none() {
            tracing::info!(target: "oxcomm::init", rank, world, job = %job, local = local.len(), "joining over shared memory");
        }

        // Shared memory: create, tell, attach, wait until attached, unlink.
        let shm_config =
            crate::transport::shm::ShmConfig::for_local_ranks_on(local.len() + 1, cores).with_env().map_err(fail)?;
        let mut ep =
            crate::transport::shm::ShmEndpoint::create(&shm_job, rank, world, &local, &shm_config).map_err(fail)?;
        store.set(&format!("shm/{rank}"), b"1").map_err(fail)?;
        let keys: Vec<String> = local.iter().map(|r| format!("shm/{r}")).collect();
        let keys: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
        wait_watching(store, &keys, deadline).map_err(fail)?;
        // Attaching and waiting for attaches also end when another rank publishes its failure
        // (one that found a dead rank's segment unlinks it, and never attaches here).
        let watch = || Watching(store).check_job();
        ep.attach_watching(&local, deadline, &watch).map_err(fail)?;
        ep.wait_attached_watching(&local, deadline, &watch).map_err(fail)?;
        ep.unlink_own().map_err(fail)?;
        let comm = match tcp {
            None => {
                let direct = ep.direct();
                let (links, bell) = ep.into_parts();
                Communicator::from_parts(rank, links, bell, self.config.clone(), Transport::Shm, direct)?
            }
            Some((tcp_links, tcp_bell)) => {
                let (shm_links, shm_bell) = ep.into_shm_parts();
                let (links, bell) =
                    crate::transport::mixed::combine(rank, shm_links, shm_bell, tcp_links, tcp_bell).map_err(fail)?;
                Communicator::from_links(rank, links, bell, self.config.clone(), Transport::ShmTcp)?
            }
        };
        calibrated(comm.with_hosts(&hosts)?, &hosts)
    }

    /// The address TCP links bind and their settings.
    fn tcp_settings(&self) -> Result<(std::net::IpAddr, crate::transport::tcp::TcpConfig)> {
        let ip =
            crate::transport::tcp::choose_bind_ip(self.store_addr, self.socket_ifname.as_deref(), self.socket_addr)
                .map_err(|e| e.with_rank(self.rank))?;
        let tcp = crate::transport::tcp::TcpConfig::from_env().map_err(|e| e.with_rank(self.rank))?;
        Ok((ip, tcp))
    }
}

/// `comm` after measuring its links for the planner, when its ranks span several hosts and
/// neither `OXCOMM_NET_ALPHA_US` nor `OXCOMM_NET_GBPS` describes them, unless
/// `OXCOMM_NET_CALIBRATE=0` (default 1: a few milliseconds at start-up; see
/// `NativeBackend::calibrate`). A bad value of any of the three is an error.
fn calibrated<L: PartialEq>(comm: Communicator, hosts: &[L]) -> Result<Communicator> {
    let described = crate::algorithms::cost::Network::from_env()?.is_some();
    let on = match std::env::var("OXCOMM_NET_CALIBRATE").ok().as_deref().map(str::trim) {
        None | Some("") | Some("1") => true,
        Some("0") => false,
        Some(v) => return Err(Error::invalid(format!("OXCOMM_NET_CALIBRATE={v:?} must be 0 or 1"))),
    };
    let spans_hosts = hosts.iter().any(|h| *h != hosts[0]);
    if on && !described && spans_hosts {
        comm.calibrate_links()?;
    }
    Ok(comm)
}

/// Pins the calling thread to the `local_rank`-th core it may run on, when there is one per
/// local rank; otherwise (or if the OS refuses) leaves it alone. Waiting ranks spin briefly
/// before sleeping, which only pays off when ranks do not share a core.
/// Store key (under the job's prefix) of rank 0's per-run nonce.
const RUN_KEY: &str = "run";
/// Bytes of the per-run nonce (12 hex digits in segment names).
const RUN_NONCE_BYTES: usize = 6;
/// Store key (under the job's prefix) where the first rank that fails during init says so:
/// `"{rank}\n{error}"`.
const FAILED_KEY: &str = "failed";
/// How often a rank waiting on the store during init looks for a published failure.
const FAILURE_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// Publishes this rank's init failure (first one wins; best effort: the store may be the
/// thing that failed). A failure that only repeats another rank's is not published again.
fn publish_failure(store: &PrefixStore<Arc<dyn Store>>, rank: usize, e: &Error) {
    if e.kind() == ErrorKind::Rendezvous && e.message().contains("failed during init") {
        return;
    }
    let _ = store.compare_set(FAILED_KEY, None, format!("{rank}\n{e}").as_bytes());
}

/// Waits for `keys` until `deadline`, and fails at once (naming the rank) when some rank
/// publishes an init failure meanwhile.
fn wait_watching(store: &PrefixStore<Arc<dyn Store>>, keys: &[&str], deadline: Instant) -> Result<()> {
    loop {
        let now = Instant::now();
        let slice = deadline.min(now + FAILURE_POLL);
        match store.wait(keys, slice) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::Timeout => {}
            Err(e) => return Err(e),
        }
        if let Some(failed) = store.try_get(FAILED_KEY)? {
            return Err(init_failure(&failed));
        }
        if slice >= deadline {
            return Err(Error::new(ErrorKind::Timeout, format!("timed out waiting for store key(s) {keys:?}")));
        }
    }
}

/// The job's store as the TCP set-up sees it: its waits (for peers' addresses) also fail at
/// once when some rank publishes an init failure.
struct Watching<'a>(&'a PrefixStore<Arc<dyn Store>>);

impl Store for Watching<'_> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.0.set(key, value)
    }
    fn get(&self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        wait_watching(self.0, &[key], deadline)?;
        self.0.get(key, deadline)
    }
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.0.try_get(key)
    }
    fn wait(&self, keys: &[&str], deadline: Instant) -> Result<()> {
        wait_watching(self.0, keys, deadline)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.0.add(key, delta)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.0.delete(key)
    }
    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<Vec<u8>> {
        self.0.compare_set(key, expected, new)
    }
    fn check_job(&self) -> Result<()> {
        match self.0.try_get(FAILED_KEY)? {
            Some(failed) => Err(init_failure(&failed)),
            None => Ok(()),
        }
    }
}

/// The error of a rank that read another rank's published init failure (the value of
/// [`FAILED_KEY`]), checked like any peer's bytes.
fn init_failure(value: &[u8]) -> Error {
    let text = String::from_utf8_lossy(&value[..value.len().min(4096)]);
    let (who, why) = text.split_once('\n').unwrap_or((&text, ""));
    match who.parse::<usize>() {
        Ok(r) => Error::new(ErrorKind::Rendezvous, format!("rank {r} failed during init: {why}")).with_peer(r),
        Err(_) => Error::protocol(format!("a malformed init failure in the store: {text:?}")),
    }
}

fn bind_to_core(local_rank: usize, local_size: usize) {
    use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};
    let Ok(allowed) = sched_getaffinity(None) else { return };
    let cores: Vec<usize> = (0..CpuSet::MAX_CPU).filter(|c| allowed.is_set(*c)).collect();
    if local_size > cores.len() {
        return;
    }
    let mut set = CpuSet::new();
    set.set(cores[local_rank]);
    match sched_setaffinity(None, &set) {
        Ok(()) => tracing::debug!(target: "oxcomm::init", local_rank, core = cores[local_rank], "pinned"),
        Err(e) => tracing::debug!(target: "oxcomm::init", local_rank, "not pinned: {e}"),
    }
}

/// A job id from the token: 16 hex digits of its SHA-256.
pub fn job_from_token(token: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let d = Sha256::digest([b"oxcomm-job/v1\0".as_slice(), token].concat());
    d.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// This host's identity: hostname, boot id and network namespace.
pub fn host_identity() -> String {
    let name = rustix::system::uname().nodename().to_string_lossy().into_owned();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let netns = std::fs::read_link("/proc/self/ns/net").map(|p| p.display().to_string()).unwrap_or_default();
    format!("{name}/{}/{netns}", boot.trim())
}
