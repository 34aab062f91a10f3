//! The front end of `oxcomm check`: reads the flags, starts the ranks of each (transport,
//! world size) job — threads of this process, or this executable as worker processes through
//! [`crate::launch::launch_self`] — collects rank 0's outcomes and prints the table. A worker
//! process runs [`run_worker`], which joins the job and hands over to [`super::rank`].

use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use anyhow::{anyhow, bail, Context};
use oxcomm::rendezvous::env::{OXCOMM_TIMEOUT, OXCOMM_TRANSPORT};
use oxcomm::Transport;

use super::rank::run_checks;
use super::{checks, selected, transports, Check, CheckArgs, Outcome, COUNTS, DEFAULT_TIMEOUT_S, DTYPES};

/// Runs `oxcomm check`: 0 when every check passed, 1 when one failed.
pub fn run(args: CheckArgs) -> anyhow::Result<i32> {
    if std::env::var_os(OXCOMM_TIMEOUT).is_none() {
        std::env::set_var(OXCOMM_TIMEOUT, DEFAULT_TIMEOUT_S);
    }
    if args.worker {
        return run_worker(&args);
    }
    let transports = transports(&args.transport)?;
    if args.world_size.iter().any(|n| !(1..=64).contains(n)) {
        bail!("--world-size must be between 1 and 64");
    }
    if selected(Transport::Shm, &args.op).is_empty() {
        let names: Vec<String> = checks(Transport::Shm).iter().map(Check::name).collect();
        bail!("--op matches no check (the checks: {})", names.join(", "));
    }

    let started = Instant::now();
    println!(
        "# oxcomm check  transports: {}  ranks: {}  dtypes: {}  counts per rank block: {}",
        transports.iter().map(|t| t.as_str()).collect::<Vec<_>>().join(", "),
        args.world_size.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(", "),
        DTYPES.iter().map(|d| d.name()).collect::<Vec<_>>().join(", "),
        COUNTS.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", "),
    );
    let mut columns: Vec<(String, Vec<Outcome>)> = Vec::new();
    for &n in &args.world_size {
        for &t in &transports {
            let t0 = Instant::now();
            let outcomes = match t {
                Transport::Threads => run_threads(&args, n),
                other => run_processes(&args, other, n),
            };
            let outcomes = outcomes.unwrap_or_else(|e| {
                // The job as a whole failed: every check of it fails with that error.
                selected(t, &args.op)
                    .iter()
                    .map(|c| Outcome { name: c.name(), cases: 0, failed: 1, first: Some(format!("{e:#}")) })
                    .collect()
            });
            eprintln!("oxcomm check: {t}, {n} ranks: {:.1}s", t0.elapsed().as_secs_f64());
            columns.push((format!("{t}/{n}"), outcomes));
        }
    }
    let order: Vec<String> = selected(Transport::Shm, &args.op).iter().map(Check::name).collect();
    let (table, failed) = table(&order, &columns);
    print!("{table}");
    println!("# {:.1}s", started.elapsed().as_secs_f64());
    Ok(if failed { 1 } else { 0 })
}

/// The table (rows in the order of `order`, then any others) and whether anything failed.
fn table(order: &[String], columns: &[(String, Vec<Outcome>)]) -> (String, bool) {
    let present = |n: &String| columns.iter().any(|(_, os)| os.iter().any(|o| &o.name == n));
    let mut names: Vec<&str> = order.iter().filter(|n| present(n)).map(String::as_str).collect();
    for (_, outcomes) in columns {
        for o in outcomes {
            if !names.contains(&o.name.as_str()) {
                names.push(&o.name);
            }
        }
    }
    let width = names.iter().map(|n| n.len()).max().unwrap_or(2).max(10);
    let mut t = String::new();
    let _ = write!(t, "{:<width$}", "# op");
    for (label, _) in columns {
        let _ = write!(t, "  {label:>12}");
    }
    t.push('\n');
    let (mut cases, mut failures) = (0, Vec::new());
    for name in &names {
        let _ = write!(t, "{name:<width$}");
        for (label, outcomes) in columns {
            let cell = match outcomes.iter().find(|o| o.name == *name) {
                None => "-".to_string(),
                Some(o) => {
                    cases += o.cases;
                    if o.failed > 0 {
                        failures.push(format!("{label} {name}: {}", o.first.as_deref().unwrap_or("failed")));
                        "FAIL".to_string()
                    } else {
                        "ok".to_string()
                    }
                }
            };
            let _ = write!(t, "  {cell:>12}");
        }
        t.push('\n');
    }
    for f in &failures {
        let _ = writeln!(t, "# FAIL {f}");
    }
    if failures.is_empty() {
        let _ = writeln!(t, "# {cases} cases, all passed: OK");
    } else {
        let _ = writeln!(t, "# {cases} cases, {} checks failed: FAILED", failures.len());
    }
    (t, !failures.is_empty())
}

fn run_threads(args: &CheckArgs, n: usize) -> anyhow::Result<Vec<Outcome>> {
    let checks = selected(Transport::Threads, &args.op);
    let results = oxcomm::threads::run(n, |comm| run_checks(&comm, &checks, args.inject_failure.as_deref()))?;
    results.into_iter().next().ok_or_else(|| anyhow!("no rank 0"))?
}

#[cfg(target_os = "linux")]
fn run_processes(args: &CheckArgs, transport: Transport, n: usize) -> anyhow::Result<Vec<Outcome>> {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let path = std::env::temp_dir().join(format!("oxcomm-check-{}-{nanos:x}.json", std::process::id()));
    let mut argv: Vec<String> = vec![
        "check".into(),
        "--worker".into(),
        "--results".into(),
        path.display().to_string(),
        "--transport".into(),
        transport.as_str().into(),
        "--world-size".into(),
        n.to_string(),
    ];
    if !args.op.is_empty() {
        argv.push("--op".into());
        argv.push(args.op.join(","));
    }
    if let Some(op) = &args.inject_failure {
        argv.push("--inject-failure".into());
        argv.push(op.clone());
    }
    // The workers inherit this and build their links accordingly.
    std::env::set_var(OXCOMM_TRANSPORT, transport.as_str());
    let code = crate::launch::launch_self(n, argv, true);
    let read = read_results(&path);
    let _ = std::fs::remove_file(&path);
    let code = code?;
    match read {
        Ok(outcomes) if code == 0 => Ok(outcomes),
        Ok(_) => bail!("a rank exited with status {code}"),
        Err(e) if code != 0 => Err(e.context(format!("a rank exited with status {code}"))),
        Err(e) => Err(e),
    }
}

#[cfg(not(target_os = "linux"))]
fn run_processes(_args: &CheckArgs, transport: Transport, _n: usize) -> anyhow::Result<Vec<Outcome>> {
    bail!("--transport {transport} needs Linux")
}

fn read_results(path: &Path) -> anyhow::Result<Vec<Outcome>> {
    let text = std::fs::read_to_string(path).context("rank 0 wrote no results")?;
    serde_json::from_str(&text).context("rank 0's results are malformed")
}

#[cfg(target_os = "linux")]
fn run_worker(args: &CheckArgs) -> anyhow::Result<i32> {
    let comm = oxcomm::init().context("cannot join the job")?;
    let transport = match args.transport.first() {
        Some(t) => transports(std::slice::from_ref(t))?[0],
        None => comm.transport(),
    };
    let checks = selected(transport, &args.op);
    let outcomes = run_checks(&comm, &checks, args.inject_failure.as_deref())?;
    if comm.rank() == 0 {
        if let Some(path) = &args.results {
            std::fs::write(path, serde_json::to_vec(&outcomes)?)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
    }
    Ok(0)
}

#[cfg(not(target_os = "linux"))]
fn run_worker(_args: &CheckArgs) -> anyhow::Result<i32> {
    bail!("--worker needs Linux (oxcomm::init)")
}
