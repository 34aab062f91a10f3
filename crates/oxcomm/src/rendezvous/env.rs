//! This process's place in the job, read from the launcher's environment ([`EnvInfo`]), and
//! the `OXCOMM_*` settings of setup ([`Settings`]).
//!
//! Every reader takes an injectable lookup (`Fn(&str) -> Option<String>`) so tests never touch
//! the real environment; `from_env()` passes `std::env::var`. It knows nothing about stores,
//! collectives or transports; it only parses and cross-checks variables.
//!
//! # Launchers, in order of precedence
//!
//! | source | rank | world size | local rank | local world size |
//! | --- | --- | --- | --- | --- |
//! | [`EnvSource::Oxcomm`] | `OXCOMM_RANK` | `OXCOMM_WORLD_SIZE` | `OXCOMM_LOCAL_RANK` | `OXCOMM_LOCAL_WORLD_SIZE` |
//! | [`EnvSource::Torchrun`] | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` | `LOCAL_WORLD_SIZE` |
//! | [`EnvSource::OpenMpi`] | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` | `OMPI_COMM_WORLD_LOCAL_SIZE` |
//! | [`EnvSource::Pmi`] (MPICH, Intel MPI) | `PMI_RANK` | `PMI_SIZE` | `MPI_LOCALRANKID` | `MPI_LOCALNRANKS` |
//! | [`EnvSource::Slurm`] | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_LOCALID` | `SLURM_TASKS_PER_NODE` (e.g. `2(x3),1`, with `SLURM_NODEID`), else `SLURM_NTASKS_PER_NODE` |
//!
//! A source is in use when its rank variable is set; the first such source wins, and then all
//! four of its variables are required. `oxcomm`'s own variables come first because only its
//! launcher (or a user, deliberately) sets them. `MASTER_ADDR` / `MASTER_PORT` are read
//! whatever the source.
//!
//! Contradictions are errors: rank ≥ world size, local rank ≥ local world size, local world
//! size > world size, and two per-process launchers (oxcomm, torchrun, Open MPI, PMI) that
//! report the **same world size but a different rank**. Launchers with different world sizes
//! are nested launches (torchrun started once per node by `mpirun`), not contradictions: the
//! first one wins. Slurm's variables are never cross-checked, because `mpirun` or `torchrun`
//! inside a batch step inherit the step's `SLURM_PROCID`. Every error is
//! [`ErrorKind::Rendezvous`] and names the variable and its value.

use std::net::IpAddr;
use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};

const LOG: &str = "oxcomm::rendezvous";

/// Rank set by oxcomm's launcher (highest precedence).
pub const OXCOMM_RANK: &str = "OXCOMM_RANK";
/// World size set by oxcomm's launcher.
pub const OXCOMM_WORLD_SIZE: &str = "OXCOMM_WORLD_SIZE";
/// Local rank (index among this host's ranks) set by oxcomm's launcher.
pub const OXCOMM_LOCAL_RANK: &str = "OXCOMM_LOCAL_RANK";
/// Number of ranks on this host, set by oxcomm's launcher.
pub const OXCOMM_LOCAL_WORLD_SIZE: &str = "OXCOMM_LOCAL_WORLD_SIZE";
/// Host of the rendezvous store (torchrun's name; read for every source). Default: none.
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// Port of the rendezvous store, 1–65535 (torchrun's name; read for every source).
/// Default: none.
pub const MASTER_PORT: &str = "MASTER_PORT";

/// Which launcher's variables an [`EnvInfo`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EnvSource {
    /// oxcomm's own launcher: `OXCOMM_RANK`, `OXCOMM_WORLD_SIZE`, ...
    Oxcomm,
    /// torchrun / `torch.distributed.launch`: `RANK`, `WORLD_SIZE`, ...
    Torchrun,
    /// Open MPI's `mpirun`: `OMPI_COMM_WORLD_*`.
    OpenMpi,
    /// A PMI launcher (MPICH Hydra, Intel MPI): `PMI_RANK`, `PMI_SIZE`, `MPI_LOCAL*`.
    Pmi,
    /// Slurm's `srun`: `SLURM_PROCID`, `SLURM_NTASKS`, ...
    Slurm,
}

impl EnvSource {
    /// A short lowercase name ("torchrun", "openmpi", ...).
    pub fn as_str(self) -> &'static str {
        match self {
            EnvSource::Oxcomm => "oxcomm",
            EnvSource::Torchrun => "torchrun",
            EnvSource::OpenMpi => "openmpi",
            EnvSource::Pmi => "pmi",
            EnvSource::Slurm => "slurm",
        }
    }
}

/// This process's place in the job, as its launcher described it. See the
/// [module docs](self) for the variables read and the checks made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvInfo {
    /// This process's rank in the job, `< world_size`.
    pub rank: usize,
    /// Number of ranks in the job, `>= 1`.
    pub world_size: usize,
    /// Index of this process among the ranks on its host, `< local_world_size`.
    pub local_rank: usize,
    /// Number of ranks on this host, `<= world_size`.
    pub local_world_size: usize,
    /// `MASTER_ADDR`, if set.
    pub master_addr: Option<String>,
    /// `MASTER_PORT`, if set.
    pub master_port: Option<u16>,
    /// The launcher whose variables were used.
    pub source: EnvSource,
}

/// Names of one launcher's four variables.
struct Vars {
    source: EnvSource,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    /// `None` for Slurm, whose local size needs parsing (see [`slurm_local_size`]).
    local_size: Option<&'static str>,
}

/// Launchers in order of precedence.
const SOURCES: [Vars; 5] = [
    Vars {
        source: EnvSource::Oxcomm,
        rank: OXCOMM_RANK,
        size: OXCOMM_WORLD_SIZE,
        local_rank: OXCOMM_LOCAL_RANK,
        local_size: Some(OXCOMM_LOCAL_WORLD_SIZE),
    },
    Vars {
        source: EnvSource::Torchrun,
        rank: "RANK",
        size: "WORLD_SIZE",
        local_rank: "LOCAL_RANK",
        local_size: Some("LOCAL_WORLD_SIZE"),
    },
    Vars {
        source: EnvSource::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        local_size: Some("OMPI_COMM_WORLD_LOCAL_SIZE"),
    },
    Vars {
        source: EnvSource::Pmi,
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        local_rank: "MPI_LOCALRANKID",
        local_size: Some("MPI_LOCALNRANKS"),
    },
    Vars {
        source: EnvSource::Slurm,
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
        local_size: None,
    },
];

fn rendezvous(message: String) -> Error {
    Error::new(ErrorKind::Rendezvous, message)
}

/// The value of `name` and the name, for messages.
struct Lookup<'a, F> {
    get: &'a F,
}

impl<F: Fn(&str) -> Option<String>> Lookup<'_, F> {
    fn count(&self, name: &str) -> Result<Option<usize>> {
        let Some(raw) = (self.get)(name) else {
            return Ok(None);
        };
        raw.trim()
            .parse::<usize>()
            .map(Some)
            .map_err(|_| rendezvous(format!("{name}={raw:?} is not a non-negative integer")))
    }

    fn required(&self, name: &str, because: &str) -> Result<usize> {
        self.count(name)?
            .ok_or_else(|| rendezvous(format!("{because} is set but {name} is not; the launcher must set both")))
    }
}

impl EnvInfo {
    /// Reads the real process environment; see [`EnvInfo::from_lookup`].
    pub fn from_env() -> Result<EnvInfo> {
        EnvInfo::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the launcher variables through `get` (which returns a variable's value, or
    /// `None` when it is unset). Errors are [`ErrorKind::Rendezvous`] naming the variable.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<EnvInfo> {
        let lookup = Lookup { get: &get };
        let Some(index) = SOURCES.iter().position(|v| get(v.rank).is_some()) else {
            let names: Vec<&str> = SOURCES.iter().map(|v| v.rank).collect();
            return Err(rendezvous(format!("no launcher found: none of {} is set", names.join(", "))));
        };
        let vars = &SOURCES[index];
        let rank = lookup.required(vars.rank, vars.rank)?;
        let world_size = lookup.required(vars.size, vars.rank)?;
        let local_rank = lookup.required(vars.local_rank, vars.rank)?;
        let (local_size_name, local_world_size) = match vars.local_size {
            Some(name) => (name.to_owned(), lookup.required(name, vars.rank)?),
            None => slurm_local_size(&get)?,
        };

        if world_size == 0 {
            return Err(rendezvous(format!("{}=0: a job has at least one rank", vars.size)));
        }
        if rank >= world_size {
            return Err(rendezvous(format!("{}={rank} is not below {}={world_size}", vars.rank, vars.size)));
        }
        if local_rank >= local_world_size {
            return Err(rendezvous(format!(
                "{}={local_rank} is not below {local_size_name}={local_world_size}",
                vars.local_rank
            )));
        }
        if local_world_size > world_size {
            return Err(rendezvous(format!("{local_size_name}={local_world_size} exceeds {}={world_size}", vars.size)));
        }

        // Per-process launchers below the winner must agree when they describe the same job.
        for other in &SOURCES[index + 1..] {
            if other.source == EnvSource::Slurm {
                continue;
            }
            let (Some(other_rank), Some(other_size)) = (lookup.count(other.rank)?, lookup.count(other.size)?) else {
                continue;
            };
            if other_size == world_size && other_rank != rank {
                return Err(rendezvous(format!(
                    "{}={rank} contradicts {}={other_rank} (both launchers report world size \
                     {world_size})",
                    vars.rank, other.rank
                )));
            }
            if other_size != world_size {
                tracing::debug!(
                    target: LOG,
                    "nested launch: using {} ({}={world_size}) over {} ({}={other_size})",
                    vars.source.as_str(),
                    vars.size,
                    other.source.as_str(),
                    other.size
                );
            }
        }

        let master_addr = get(MASTER_ADDR).filter(|s| !s.trim().is_empty());
        let master_port = match get(MASTER_PORT) {
            None => None,
            Some(raw) => match raw.trim().parse::<u16>() {
                Ok(port) if port != 0 => Some(port),
                _ => return Err(rendezvous(format!("{MASTER_PORT}={raw:?} is not a port number (1-65535)"))),
            },
        };
        Ok(EnvInfo { rank, world_size, local_rank, local_world_size, master_addr, master_port, source: vars.source })
    }
}

/// Slurm's tasks on this node: `SLURM_TASKS_PER_NODE` (the step's actual layout, e.g.
/// `2(x3),1` = three nodes with 2 tasks then one with 1; our entry chosen by `SLURM_NODEID`,
/// needed only when the layout is not uniform), else `SLURM_NTASKS_PER_NODE`. Returns the
/// variable used (for messages) and the count.
fn slurm_local_size(get: &impl Fn(&str) -> Option<String>) -> Result<(String, usize)> {
    const TASKS_PER_NODE: &str = "SLURM_TASKS_PER_NODE";
    const NTASKS_PER_NODE: &str = "SLURM_NTASKS_PER_NODE";
    const NODEID: &str = "SLURM_NODEID";
    let lookup = Lookup { get };
    if let Some(raw) = get(TASKS_PER_NODE) {
        let layout = parse_tasks_per_node(&raw).ok_or_else(|| {
            rendezvous(format!("{TASKS_PER_NODE}={raw:?} is not a Slurm task layout like \"2(x3),1\""))
        })?;
        let uniform = layout.windows(2).all(|w| w[0].0 == w[1].0);
        let node = match lookup.count(NODEID)? {
            Some(node) => node,
            None if uniform => 0,
            None if get(NTASKS_PER_NODE).is_some() => {
                let n = lookup.required(NTASKS_PER_NODE, "SLURM_PROCID")?;
                return Ok((NTASKS_PER_NODE.to_owned(), n));
            }
            None => {
                return Err(rendezvous(format!(
                    "{TASKS_PER_NODE}={raw:?} differs between nodes but {NODEID} is not set"
                )))
            }
        };
        let mut first = 0usize;
        for &(tasks, nodes) in &layout {
            if node < first.saturating_add(nodes) {
                return Ok((TASKS_PER_NODE.to_owned(), tasks));
            }
            first = first.saturating_add(nodes);
        }
        return Err(rendezvous(format!("{NODEID}={node} is past the {first} nodes of {TASKS_PER_NODE}={raw:?}")));
    }
    let n = lookup.required(NTASKS_PER_NODE, "SLURM_PROCID")?;
    Ok((NTASKS_PER_NODE.to_owned(), n))
}

/// Parses Slurm's compressed layout (`"2(x3),1"`) into `(tasks, nodes)` runs; `None` if it
/// is malformed or a count is zero.
fn parse_tasks_per_node(raw: &str) -> Option<Vec<(usize, usize)>> {
    let mut runs = Vec::new();
    for item in raw.trim().split(',') {
        let item = item.trim();
        let (tasks, nodes) = match item.split_once('(') {
            None => (item, "1"),
            Some((tasks, rest)) => (tasks, rest.strip_prefix('x')?.strip_suffix(')')?),
        };
        let tasks: usize = tasks.parse().ok()?;
        let nodes: usize = nodes.parse().ok()?;
        if tasks == 0 || nodes == 0 {
            return None;
        }
        runs.push((tasks, nodes));
    }
    Some(runs)
}

// ---------------------------------------------------------------------------------------------
// Settings
// ---------------------------------------------------------------------------------------------

/// The value of [`OXCOMM_TRANSPORT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TransportChoice {
    /// Shared memory between ranks on one host, TCP across hosts.
    #[default]
    Auto,
    /// Shared memory only (all ranks must be on one host).
    Shm,
    /// TCP only, also between ranks on one host.
    Tcp,
}

impl TransportChoice {
    /// Every choice, in the order error messages list them.
    pub const ALL: [TransportChoice; 3] = [TransportChoice::Auto, TransportChoice::Shm, TransportChoice::Tcp];

    /// The value's name: `auto`, `shm` or `tcp` (for `shm` and `tcp`, the name of the
    /// transport it picks).
    pub fn as_str(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Shm => "shm",
            TransportChoice::Tcp => "tcp",
        }
    }

    /// The choice named `s` (any case, surrounding blanks ignored): one of the names
    /// [`TransportChoice::as_str`] gives. The one parser of [`OXCOMM_TRANSPORT`]'s values,
    /// also used by the Python package's `transport=` argument.
    pub fn parse(s: &str) -> Option<TransportChoice> {
        let s = s.trim();
        TransportChoice::ALL.into_iter().find(|c| c.as_str().eq_ignore_ascii_case(s))
    }
}

impl std::fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `OXCOMM_*` settings of setup. Unset or empty variables take their defaults.
#[derive(Clone, PartialEq, Eq)]
pub struct Settings {
    /// [`OXCOMM_TOKEN`], decoded; `None` when unset or empty.
    pub token: Option<Vec<u8>>,
    /// [`OXCOMM_TIMEOUT`]; default [`DEFAULT_TIMEOUT`].
    pub timeout: Duration,
    /// [`OXCOMM_SOCKET_IFNAME`]; default none.
    pub socket_ifname: Option<String>,
    /// [`OXCOMM_SOCKET_ADDR`]; default none.
    pub socket_addr: Option<IpAddr>,
    /// [`OXCOMM_TRANSPORT`]; default [`TransportChoice::Auto`].
    pub transport: TransportChoice,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            token: None,
            timeout: DEFAULT_TIMEOUT,
            socket_ifname: None,
            socket_addr: None,
            transport: TransportChoice::Auto,
        }
    }
}

impl std::fmt::Debug for Settings {
    /// Never prints the token, only whether one is set.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("timeout", &self.timeout)
            .field("socket_ifname", &self.socket_ifname)
            .field("socket_addr", &self.socket_addr)
            .field("transport", &self.transport)
            .finish()
    }
}

impl Settings {
    /// Reads the real process environment; see [`Settings::from_lookup`].
    pub fn from_env() -> Result<Settings> {
        Settings::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the settings through `get`. A malformed value is an [`ErrorKind::Rendezvous`]
    /// error naming the variable (the token's value is never echoed).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Settings> {
        // Unset and empty are the same: `OXCOMM_TRANSPORT= cmd` means the default.
        let get = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        Ok(Settings {
            token: read_token(&get),
            timeout: read_timeout(&get)?,
            socket_ifname: get(OXCOMM_SOCKET_IFNAME).map(|s| s.trim().to_owned()),
            socket_addr: read_socket_addr(&get)?,
            transport: read_transport(&get)?,
        })
    }
}

/// The job's shared secret for the store handshake. Either hex (an even number of hex digits,
/// decoded to bytes; what [`super::generate_token`] makes) or any other string, used as its
/// raw bytes. Empty or unset: no token (an empty secret, which authenticates nothing).
pub const OXCOMM_TOKEN: &str = "OXCOMM_TOKEN";

fn read_token(get: &impl Fn(&str) -> Option<String>) -> Option<Vec<u8>> {
    let raw = get(OXCOMM_TOKEN)?;
    Some(super::from_hex(raw.trim()).unwrap_or_else(|| raw.into_bytes()))
}

/// Seconds (integer or decimal, > 0) that setup and each collective may wait.
/// Default [`DEFAULT_TIMEOUT`].
pub const OXCOMM_TIMEOUT: &str = "OXCOMM_TIMEOUT";
/// Default of [`OXCOMM_TIMEOUT`]: 300 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

fn read_timeout(get: &impl Fn(&str) -> Option<String>) -> Result<Duration> {
    let Some(raw) = get(OXCOMM_TIMEOUT) else {
        return Ok(DEFAULT_TIMEOUT);
    };
    raw.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| *s > 0.0)
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| rendezvous(format!("{OXCOMM_TIMEOUT}={raw:?} is not a positive number of seconds")))
}

/// Network interface whose address TCP links and the store bind to (e.g. `eth0`).
/// Default: none (the transport decides).
pub const OXCOMM_SOCKET_IFNAME: &str = "OXCOMM_SOCKET_IFNAME";

/// IP address to bind and advertise, overriding [`OXCOMM_SOCKET_IFNAME`]. Default: none.
pub const OXCOMM_SOCKET_ADDR: &str = "OXCOMM_SOCKET_ADDR";

fn read_socket_addr(get: &impl Fn(&str) -> Option<String>) -> Result<Option<IpAddr>> {
    let Some(raw) = get(OXCOMM_SOCKET_ADDR) else {
        return Ok(None);
    };
    raw.trim()
        .parse::<IpAddr>()
        .map(Some)
        .map_err(|_| rendezvous(format!("{OXCOMM_SOCKET_ADDR}={raw:?} is not an IP address")))
}

/// Transport between processes: `auto` (shared memory on one host, TCP across hosts),
/// `shm` or `tcp`. Default `auto`.
pub const OXCOMM_TRANSPORT: &str = "OXCOMM_TRANSPORT";

fn read_transport(get: &impl Fn(&str) -> Option<String>) -> Result<TransportChoice> {
    let Some(raw) = get(OXCOMM_TRANSPORT) else {
        return Ok(TransportChoice::default());
    };
    TransportChoice::parse(&raw)
        .ok_or_else(|| rendezvous(format!("{OXCOMM_TRANSPORT}={raw:?} is not one of auto, shm, tcp")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_choices_round_trip() {
        for c in TransportChoice::ALL {
            assert_eq!(TransportChoice::parse(c.as_str()), Some(c));
        }
        assert_eq!(TransportChoice::parse(" TCP "), Some(TransportChoice::Tcp));
        assert_eq!(TransportChoice::parse("threads"), None);
    }

    #[test]
    fn slurm_layouts_parse() {
        assert_eq!(parse_tasks_per_node("2(x3),1"), Some(vec![(2, 3), (1, 1)]));
        assert_eq!(parse_tasks_per_node("4"), Some(vec![(4, 1)]));
        assert_eq!(parse_tasks_per_node("2(3)"), None);
        assert_eq!(parse_tasks_per_node("2(x3"), None);
        assert_eq!(parse_tasks_per_node("0"), None);
        assert_eq!(parse_tasks_per_node(""), None);
        assert_eq!(parse_tasks_per_node("a,1"), None);
    }
}
