//! The second parsing stage of `oxcomm bench`: [`BenchPlan`], what the flags mean together, checked
//! (which ops run and which `--op all` leaves out for the dtype, the sizes of the sweep, the
//! world size, the algorithm per op, where the ranks come from), and the flags a spawned
//! worker gets to rebuild the same plan ([`BenchPlan::worker_args`]). Every error here is one line
//! naming the flag; nothing runs.

use std::path::PathBuf;

use anyhow::{anyhow, bail};
use oxcomm::{Algorithm, DType, ReduceOp, Transport};

use super::args::{Backend, BenchArgs, ENV_BACKEND};
use super::cases::BenchOp;

/// Largest world size the bench accepts.
const MAX_WORLD: usize = 1024;

/// Everything the bench needs, checked.
#[derive(Debug, Clone)]
pub(super) struct BenchPlan {
    pub(super) ops: Vec<BenchOp>,
    /// `--op all` was given (a forced algorithm then applies only where it fits).
    pub(super) all_ops: bool,
    /// Ops `--op all` left out because they do not take the dtype, and why.
    pub(super) skipped: Vec<(BenchOp, &'static str)>,
    /// quant_reduce_scatter's `--ranks-per-host` (`None`: one host).
    pub(super) ranks_per_host: Option<usize>,
    /// `--plot`.
    pub(super) plot: Option<PathBuf>,
    pub(super) dtype: DType,
    pub(super) redop: ReduceOp,
    pub(super) root: usize,
    pub(super) sizes: Vec<u64>,
    pub(super) min_bytes: u64,
    pub(super) max_bytes: u64,
    pub(super) step: u64,
    pub(super) iters: usize,
    pub(super) warmup: usize,
    pub(super) check: bool,
    /// `--fresh-inputs`: inputs rewritten before every timed op ([`super::cases::Case::time`]).
    pub(super) fresh_inputs: bool,
    /// `None` only for a rank of a job ([`BenchPlan::in_job`]) started without --world-size (the
    /// job decides).
    pub(super) world: Option<usize>,
    pub(super) transport: Transport,
    pub(super) algorithm: Option<Algorithm>,
    pub(super) json: Option<PathBuf>,
    pub(super) csv: Option<PathBuf>,
    pub(super) quiet: bool,
    /// `--worker`: a rank started by `oxcomm launch` or by a bench front end.
    pub(super) worker: bool,
    pub(super) report_to: Option<String>,
    /// Where the communicator comes from (`OXCOMM_BACKEND`).
    pub(super) backend: Backend,
}

impl BenchPlan {
    /// Checks the flags together. `backend` is what `OXCOMM_BACKEND` asks for
    /// ([`Backend::from_env`]).
    pub(super) fn new(args: &BenchArgs, backend: Backend) -> anyhow::Result<BenchPlan> {
        let (mut ops, all_ops) = parse_ops(&args.op)?;
        let mut skipped = Vec::new();
        if all_ops {
            ops.retain(|o| match o.rejects(args.dtype) {
                Some(why) => {
                    skipped.push((*o, why));
                    false
                }
                None => true,
            });
        } else if let Some(why) = ops.iter().find_map(|o| o.rejects(args.dtype)) {
            bail!("--dtype {}: {why}", args.dtype);
        }
        if let Some(p) = &args.plot {
            crate::plot::Format::of(p)?;
        }
        if args.minbytes == 0 {
            bail!("-b/--minbytes must be at least 1");
        }
        if args.minbytes > args.maxbytes {
            bail!("-b/--minbytes {} is larger than -e/--maxbytes {}", args.minbytes, args.maxbytes);
        }
        if args.stepfactor < 2 {
            bail!("-f/--stepfactor must be at least 2");
        }
        if args.iters == 0 {
            bail!("-n/--iters must be at least 1");
        }
        let elem = args.dtype.size() as u64;
        if args.maxbytes < elem {
            bail!("-e/--maxbytes {} is smaller than one {} element ({elem} bytes)", args.maxbytes, args.dtype);
        }
        if args.maxbytes > isize::MAX as u64 / 4 {
            bail!("-e/--maxbytes {} is too large", args.maxbytes);
        }
        let mut sizes = Vec::new();
        let mut size = args.minbytes;
        while size <= args.maxbytes {
            sizes.push(size);
            match size.checked_mul(args.stepfactor) {
                Some(s) => size = s,
                None => break,
            }
        }
        if ops.iter().any(|o| o.reduces()) {
            if let Err(e) = oxcomm::reduce::check(args.redop, args.dtype) {
                bail!("--redop {} with --dtype {}: {}", args.redop, args.dtype, e.message());
            }
        }
        if let Some(a) = args.algorithm {
            let fits = |o: &BenchOp| o.algorithms().contains(&a);
            if all_ops {
                if !ops.iter().any(fits) {
                    bail!("--algorithm {a} applies to none of the ops");
                }
            } else if let Some(o) = ops.iter().find(|o| !fits(o)) {
                let names: Vec<&str> = o.algorithms().iter().map(|a| a.name()).collect();
                if names.is_empty() {
                    bail!("--algorithm {a} does not apply to {} (it is built from several collectives)", o.name());
                }
                bail!("--algorithm {a} does not apply to {} (it runs with: {})", o.name(), names.join(", "));
            }
        }
        if backend == Backend::Mpi {
            if args.transport != Transport::Shm {
                bail!(
                    "--transport {} does not apply with {ENV_BACKEND}=mpi (the ranks are the MPI job's; unset {ENV_BACKEND} to use oxcomm's transports)",
                    args.transport
                );
            }
            if let Some(a) = args.algorithm {
                bail!("--algorithm {a} does not apply with {ENV_BACKEND}=mpi (MPI picks its own algorithms)");
            }
        }
        let in_job = args.worker || backend == Backend::Mpi;
        let world = match (args.world_size, in_job) {
            (Some(0), _) => bail!("--world-size must be at least 1"),
            (Some(n), _) if n > MAX_WORLD => bail!("--world-size {n} is more than {MAX_WORLD}"),
            (Some(n), _) => Some(n),
            (None, true) => None,
            (None, false) => Some(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).max(2)),
        };
        if let Some(n) = world {
            if ops.iter().any(|o| o.rooted()) && args.root >= n {
                bail!("-r/--root {} is not below the world size {n}", args.root);
            }
        }
        if let Some(k) = args.ranks_per_host {
            check_ranks_per_host(k, world)?;
        }
        Ok(BenchPlan {
            ops,
            all_ops,
            skipped,
            ranks_per_host: args.ranks_per_host,
            plot: args.plot.clone(),
            dtype: args.dtype,
            redop: args.redop,
            root: args.root,
            sizes,
            min_bytes: args.minbytes,
            max_bytes: args.maxbytes,
            step: args.stepfactor,
            iters: args.iters,
            warmup: args.warmup_iters,
            check: args.check,
            fresh_inputs: args.fresh_inputs,
            world,
            transport: args.transport,
            algorithm: args.algorithm,
            json: args.json.clone(),
            csv: args.csv.clone(),
            quiet: args.quiet,
            worker: args.worker,
            report_to: args.report_to.clone(),
            backend,
        })
    }

    /// Whether this process is one rank of a job someone else started (`--worker`, or an MPI
    /// launcher's rank): the bench then runs on `oxcomm::init()` here instead of starting
    /// ranks, and the job decides the world size.
    pub(super) fn in_job(&self) -> bool {
        self.worker || self.backend == Backend::Mpi
    }

    /// The algorithm forced on `op`, if any.
    pub(super) fn algorithm_for(&self, op: BenchOp) -> Option<Algorithm> {
        self.algorithm.filter(|a| op.algorithms().contains(a))
    }

    /// The flags a worker gets to rebuild this plan (everything that changes what is run).
    pub(super) fn worker_args(&self, world: usize, report_to: &str) -> Vec<String> {
        let ops = if self.all_ops {
            "all".to_string()
        } else {
            self.ops.iter().map(|o| o.name()).collect::<Vec<_>>().join(",")
        };
        let mut a: Vec<String> = vec![
            "bench".into(),
            "--worker".into(),
            "--report-to".into(),
            report_to.into(),
            "--world-size".into(),
            world.to_string(),
            "--transport".into(),
            Transport::Shm.as_str().into(),
            "--op".into(),
            ops,
            "--dtype".into(),
            self.dtype.name().into(),
            "--redop".into(),
            self.redop.name().into(),
            "--root".into(),
            self.root.to_string(),
            "-b".into(),
            self.min_bytes.to_string(),
            "-e".into(),
            self.max_bytes.to_string(),
            "-f".into(),
            self.step.to_string(),
            "-n".into(),
            self.iters.to_string(),
            "-w".into(),
            self.warmup.to_string(),
            "-c".into(),
            if self.check { "1" } else { "0" }.into(),
            "--quiet".into(),
        ];
        if let Some(alg) = self.algorithm {
            a.push("--algorithm".into());
            a.push(alg.name().into());
        }
        if let Some(k) = self.ranks_per_host {
            a.push("--ranks-per-host".into());
            a.push(k.to_string());
        }
        if self.fresh_inputs {
            a.push("--fresh-inputs".into());
        }
        a
    }

    /// Bytes of buffers one rank allocates: three buffers of the largest size.
    pub(super) fn bytes_per_rank(&self) -> u64 {
        3 * self.max_bytes
    }
}

/// `--ranks-per-host K` must be positive and divide the world size (when it is known).
pub(super) fn check_ranks_per_host(k: usize, world: Option<usize>) -> anyhow::Result<()> {
    if k == 0 {
        bail!("--ranks-per-host must be at least 1");
    }
    if let Some(n) = world {
        if n % k != 0 {
            bail!("--ranks-per-host {k} does not divide the world size {n}");
        }
    }
    Ok(())
}

/// `--op` as a list of ops; `all` means every op.
fn parse_ops(raw: &str) -> anyhow::Result<(Vec<BenchOp>, bool)> {
    if raw.trim().eq_ignore_ascii_case("all") {
        return Ok((BenchOp::ALL.to_vec(), true));
    }
    let mut ops = Vec::new();
    for part in raw.split(',') {
        let op = BenchOp::parse(part).ok_or_else(|| {
            let names: Vec<&str> = BenchOp::ALL.iter().map(|o| o.name()).collect();
            anyhow!("--op: unknown op {:?} (one of: {}, or all)", part.trim(), names.join(", "))
        })?;
        if !ops.contains(&op) {
            ops.push(op);
        }
    }
    Ok((ops, false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn plan_on(backend: Backend, argv: &[&str]) -> anyhow::Result<BenchPlan> {
        let cli = Cli::try_parse_from(std::iter::once("bench").chain(argv.iter().copied()))?;
        BenchPlan::new(&cli.args, backend)
    }

    fn plan(argv: &[&str]) -> anyhow::Result<BenchPlan> {
        plan_on(Backend::Native, argv)
    }

    #[test]
    fn defaults_sweep_8_bytes_to_64_mib() {
        let p = plan(&[]).unwrap();
        assert_eq!(p.sizes.first(), Some(&8));
        assert_eq!(p.sizes.last(), Some(&(64 << 20)));
        assert_eq!(p.sizes.len(), 24);
        assert_eq!(p.ops, vec![BenchOp::AllReduce]);
        assert!(p.world.unwrap() >= 2);
        assert_eq!((p.iters, p.warmup, p.check), (20, 5, true));
        assert!(!p.in_job());
    }

    #[test]
    fn bad_plans_are_errors() {
        for argv in [
            &["-b", "0"][..],
            &["-b", "1M", "-e", "1K"],
            &["-f", "1"],
            &["-n", "0"],
            &["--op", "all_reduce,nope"],
            &["--dtype", "f32", "--redop", "band"],
            &["--op", "broadcast", "--algorithm", "ring"],
            &["--world-size", "0"],
            &["--world-size", "2", "--op", "reduce", "--root", "2"],
            &["-e", "2", "--dtype", "f64"],
        ] {
            assert!(plan(argv).is_err(), "{argv:?} should be rejected");
        }
        // --op all with an algorithm applies it where it fits.
        let p = plan(&["--op", "all", "--algorithm", "ring"]).unwrap();
        assert_eq!(p.algorithm_for(BenchOp::AllReduce), Some(Algorithm::Ring));
        assert_eq!(p.algorithm_for(BenchOp::Broadcast), None);
    }

    #[test]
    fn worker_args_rebuild_the_plan() {
        let p = plan(&["--op", "all_gather,reduce", "-b", "1K", "-e", "4K", "-f", "4", "--dtype", "bf16", "-c", "0"])
            .unwrap();
        let argv = p.worker_args(3, "sock");
        let q = plan(&argv[1..].iter().map(|s| s.as_str()).collect::<Vec<_>>()).unwrap();
        assert_eq!(q.ops, p.ops);
        assert_eq!(q.sizes, p.sizes);
        assert_eq!((q.dtype, q.check, q.world, q.worker), (p.dtype, false, Some(3), true));
        assert_eq!(q.report_to.as_deref(), Some("sock"));
    }

    /// Under `OXCOMM_BACKEND=mpi` the process is a rank of the MPI job: the job decides the
    /// world size, and the flags that pick oxcomm's own transports or algorithms are errors.
    #[test]
    fn an_mpi_rank_runs_in_the_job() {
        let p = plan_on(Backend::Mpi, &["-b", "8", "-e", "64K", "--op", "all"]).unwrap();
        assert!(p.in_job());
        assert_eq!(p.world, None);
        assert_eq!(plan_on(Backend::Mpi, &["--world-size", "4"]).unwrap().world, Some(4));
        let err = |argv: &[&str]| plan_on(Backend::Mpi, argv).unwrap_err().to_string();
        assert!(err(&["--transport", "tcp"]).contains("does not apply with OXCOMM_BACKEND=mpi"));
        assert!(err(&["--transport", "threads"]).contains("does not apply with OXCOMM_BACKEND=mpi"));
        assert!(err(&["--algorithm", "ring"]).contains("MPI picks its own algorithms"));
    }
}
