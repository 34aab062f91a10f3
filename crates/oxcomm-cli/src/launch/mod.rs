//! `oxcomm launch`: starts the ranks of a job on this node, like `torchrun`.
//!
//! This folder owns the launcher, one file per step:
//!
//! | file | owns |
//! | --- | --- |
//! | `mod.rs` | the entry points ([`run`], [`launch_self`]) and the environment each rank gets (the consts below, beside oxcomm's own names from [`oxcomm::rendezvous::env`] and [`oxcomm::init`]) |
//! | `args.rs` | the flags as typed ([`LaunchArgs`], [`StorePingArgs`]) |
//! | `plan.rs` | what the flags mean (`LaunchPlan`: world size, this node's ranks, the store, the token and the job id) |
//! | `supervise.rs` | serving the store, spawning the ranks, watching them, forwarding signals, stopping the job when a rank fails |
//! | `output.rs` | the output pump: each rank's lines, prefixed, copied whole |
//! | `exit.rs` | the exit barrier of multi-node jobs |
//! | `store_ping.rs` | the hidden `store-ping` subcommand, a rank-side check that the launcher's store is reachable |
//!
//! It does not start processes on other hosts (run one launcher per node, as with torchrun),
//! or know anything about collectives: ranks find each other through the rendezvous store the
//! launcher serves on node 0 ([`oxcomm::rendezvous::StoreServer`]). When a rank fails it stops
//! the others (the default), or with `--on-failure continue` lets them go on, or with
//! `--on-failure restart` also starts a replacement of the failed rank with
//! [`oxcomm::grow::ENV_JOIN`] set (it joins the others through the store; at most
//! `--max-restarts` in all); every rank gets [`ON_FAILURE`].
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
use std::time::Duration;

mod args;
mod exit;
mod output;
mod plan;
mod store_ping;
mod supervise;

pub use args::{LaunchArgs, OnFailure, StorePingArgs};
pub use store_ping::store_ping;

use plan::LaunchPlan;
use supervise::execute;

// ---------------------------------------------------------------------------------------------
// Environment of a rank (oxcomm's own `OXCOMM_*` names are the library's constants)
// ---------------------------------------------------------------------------------------------

/// Global rank of the process, `0 .. WORLD_SIZE` (torchrun's name). The launcher also sets
/// [`OXCOMM_RANK`](oxcomm::rendezvous::env::OXCOMM_RANK) to the same value.
pub const RANK: &str = "RANK";
/// Number of ranks in the job, over all nodes (torchrun's name; also [`OXCOMM_WORLD_SIZE`](oxcomm::rendezvous::env::OXCOMM_WORLD_SIZE)).
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Index of the rank among this node's ranks (torchrun's name; also [`OXCOMM_LOCAL_RANK`](oxcomm::rendezvous::env::OXCOMM_LOCAL_RANK)).
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Number of ranks on this node (torchrun's name; also [`OXCOMM_LOCAL_WORLD_SIZE`](oxcomm::rendezvous::env::OXCOMM_LOCAL_WORLD_SIZE)).
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Rank of this node among the nodes, `--node-rank` (torchrun's name).
pub const GROUP_RANK: &str = "GROUP_RANK";

/// `--on-failure` as the ranks see it (`abort`, `continue` or `restart`), so a program knows
/// whether a replacement will come to join a grow.
pub const ON_FAILURE: &str = "OXCOMM_ON_FAILURE";

/// Default of `--grace-period`: time the ranks have to exit after `SIGTERM` before `SIGKILL`.
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(5);

/// Runs `oxcomm launch`: returns the exit status the launcher should exit with (0 when every
/// rank succeeded, the first failed rank's status, or 128 + signal when the launcher was
/// interrupted). Errors are about the launch itself (bad flags, program not found, store
/// cannot bind).
pub fn run(args: LaunchArgs) -> anyhow::Result<i32> {
    let plan = LaunchPlan::new(&args, |name| std::env::var(name).ok())?;
    execute(&plan)
}

/// Runs this command again (`crate::self_command`) with `args` as `n` local ranks, with the
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
        on_failure: OnFailure::Abort,
        max_restarts: 0,
        command,
    };
    let plan = LaunchPlan::new(&args, |_| None)?;
    execute(&plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxcomm::init::{ENV_STORE, STORE_LAUNCHER};
    use oxcomm::rendezvous::env::{OXCOMM_RANK, OXCOMM_TOKEN};

    /// Run as a rank by `launch_self_starts_this_executable`: checks its environment. Ignored
    /// in normal runs; without a launcher's environment it does nothing.
    #[test]
    #[ignore = "a rank of launch_self_starts_this_executable"]
    fn rank_probe() {
        let Ok(rank) = std::env::var(OXCOMM_RANK) else { return };
        assert_eq!(std::env::var(RANK).unwrap(), rank);
        assert_eq!(std::env::var(WORLD_SIZE).unwrap(), "2");
        assert_eq!(std::env::var(ENV_STORE).unwrap(), STORE_LAUNCHER);
        assert_eq!(std::env::var(OXCOMM_TOKEN).unwrap().len(), 64);
    }

    #[test]
    fn launch_self_starts_this_executable() {
        let args = ["launch::tests::rank_probe", "--exact", "--ignored", "--quiet", "--test-threads=1"];
        let code = launch_self(2, args.iter().map(|s| s.to_string()).collect(), true).unwrap();
        assert_eq!(code, 0);
    }
}
