//! [`LaunchPlan`]: what the flags of `oxcomm launch` mean, checked: the world size, this
//! node's ranks, where the rendezvous store is and who serves it ([`StorePlan`]), the job's
//! token and id. Pure: it reads the environment only through the lookup it is given and
//! starts nothing.

use std::ffi::OsString;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use oxcomm::rendezvous;
use oxcomm::rendezvous::env::OXCOMM_TOKEN;
use sha2::{Digest, Sha256};

use super::args::{LaunchArgs, OnFailure};

/// Where the ranks' store is and who serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum StorePlan {
    /// This launcher serves the store, bound to `bind`; the ranks get `advertise` (or the bound
    /// address when `None`) as `MASTER_ADDR`, and the bound port.
    Serve { bind: SocketAddr, advertise: Option<String> },
    /// Node 0's launcher serves it; the ranks only get its address.
    Remote { addr: String, port: u16 },
}

/// Everything [`execute`] needs, checked.
#[derive(Debug, Clone)]
pub(super) struct LaunchPlan {
    pub(super) nproc: usize,
    pub(super) nnodes: usize,
    pub(super) node_rank: usize,
    pub(super) world_size: usize,
    pub(super) store: StorePlan,
    pub(super) token: String,
    pub(super) job_id: String,
    pub(super) program: OsString,
    pub(super) args: Vec<OsString>,
    pub(super) prefix: bool,
    pub(super) grace: Duration,
    pub(super) on_failure: OnFailure,
    pub(super) max_restarts: usize,
}

impl LaunchPlan {
    /// Checks `args`; `get` reads the launcher's environment (only `OXCOMM_TOKEN`, for
    /// multi-node jobs).
    pub(super) fn new(args: &LaunchArgs, get: impl Fn(&str) -> Option<String>) -> anyhow::Result<LaunchPlan> {
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
            on_failure: args.on_failure,
            max_restarts: args.max_restarts,
        })
    }
}

/// The first address `host:port` resolves to.
pub(super) fn resolve(host: &str, port: u16) -> anyhow::Result<SocketAddr> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::args::tests::parse;

    fn no_env(_: &str) -> Option<String> {
        None
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
}
