//! The flags of `oxcomm launch` ([`LaunchArgs`]) and of the hidden `oxcomm store-ping`
//! ([`StorePingArgs`]), as typed: each value well-formed on its own. What they mean together
//! is [`super::plan`]'s question.

use std::ffi::OsString;
use std::time::Duration;

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

    /// What to do when a rank fails (exits with a non-zero status or is killed): `abort` stops
    /// every other rank (SIGTERM, then SIGKILL after the grace period); `continue` lets the
    /// others run on (they shrink it out: `Communicator::shrink`); `restart` also starts a
    /// replacement with `OXCOMM_JOIN=1`, which joins the survivors' next grow
    /// (`oxcomm::join`, `Communicator::grow`), at most --max-restarts times.
    #[arg(long = "on-failure", value_enum, default_value_t = OnFailure::Abort, value_name = "WHAT")]
    pub on_failure: OnFailure,

    /// With --on-failure restart: how many replacements this launcher starts in all; a failure
    /// after that is handled as with `continue`.
    #[arg(long = "max-restarts", value_name = "N", default_value_t = 3)]
    pub max_restarts: usize,

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

/// What `oxcomm launch` does when a rank fails (`--on-failure`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnFailure {
    /// Stop every other rank (the default).
    Abort,
    /// Let the other ranks run on without it.
    Continue,
    /// Let them run on and start a replacement that joins them.
    Restart,
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use clap::Parser;

    use crate::launch::DEFAULT_GRACE_PERIOD;

    #[derive(Debug, Parser)]
    struct Wrapper {
        #[command(flatten)]
        launch: LaunchArgs,
    }

    pub(in crate::launch) fn parse(args: &[&str]) -> Result<LaunchArgs, clap::Error> {
        Wrapper::try_parse_from(std::iter::once("launch").chain(args.iter().copied())).map(|w| w.launch)
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
    fn on_failure_defaults_to_abort_and_takes_three_values() {
        let args = parse(&["-n", "2", "prog"]).unwrap();
        assert_eq!((args.on_failure, args.max_restarts), (OnFailure::Abort, 3));
        let args = parse(&["-n", "2", "--on-failure", "restart", "--max-restarts", "1", "prog"]).unwrap();
        assert_eq!((args.on_failure, args.max_restarts), (OnFailure::Restart, 1));
        assert_eq!(parse(&["-n", "2", "--on-failure=continue", "prog"]).unwrap().on_failure, OnFailure::Continue);
        assert!(parse(&["-n", "2", "--on-failure", "retry", "prog"]).is_err());
        assert!(parse(&["-n", "2", "--max-restarts", "-1", "prog"]).is_err());
    }
}
