//! Tests of the MPI backend (`oxcomm::mpi`, feature `mpi`), run as real MPI jobs.
//!
//! `cargo test --features mpi --test mpi` runs this binary directly; not being under an MPI
//! launcher, it starts itself with `mpirun -n N --oversubscribe --allow-run-as-root` for
//! N = 2 and 4 (each job bounded by [`JOB_DEADLINE`]; the 2-rank job joins with
//! `oxcomm::mpi::init()`, the 4-rank job with `oxcomm::init()` and `OXCOMM_BACKEND=mpi`), checks exit codes and prints one
//! `N passed, M failed` line. Under mpirun, every rank runs every case; rank 0 reports each
//! case as failed if it failed on any rank. If `mpirun` is not installed the binary says so
//! and exits 0.
//!
//! Inputs are small integers, so every result is exact and compared bit for bit with a
//! scalar reference (collectives) or with the same computation on thread ranks
//! (`compression::coalesced`). `compression::onebit` is not part of this branch, so the
//! 1-bit all-reduce is not tested here.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use oxcomm::compression::coalesced::reduce_scatter_coalesced;
use oxcomm::compression::host_groups::HostGroups;
use oxcomm::compression::qgz::{all_to_all_quant_reduce, TensorView};
use oxcomm::reduce::{scalar, ReduceOp};
use oxcomm::{threads, Communicator, DType, Element, ErrorKind};

// The any-source scenario the native transports run (its #[test]s are not built here).
#[path = "../it/any_source.rs"]
#[allow(dead_code, unused_imports)]
mod any_source;

/// World sizes the launcher runs.
const WORLDS: [usize; 2] = [2, 4];
/// How long one mpirun job may take before it is killed and counted as failed.
const JOB_DEADLINE: Duration = Duration::from_secs(300);

/// Environment variable of the ULFM job: `fake` runs the ULFM cases (over `fake_ulfm.c`).
const ENV_ULFM_JOB: &str = "OXCOMM_TEST_ULFM";

type CaseResult = Result<(), String>;

/// A named test case.
type Case = (&'static str, fn(&Communicator) -> CaseResult);

fn main() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() || std::env::var_os("PMI_SIZE").is_some() {
        std::process::exit(rank_main());
    }
    std::process::exit(launcher_main());
}

// ------------------------------------------------------------------------------------------
// Launcher: not under mpirun.

fn launcher_main() -> i32 {
    let Ok(exe) = std::env::current_exe() else {
        eprintln!("mpi tests: cannot find this test binary");
        return 1;
    };
    if Command::new("mpirun").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_err() {
        println!("mpi tests SKIPPED: `mpirun` is not installed (apt-get install openmpi-bin libopenmpi-dev)");
        println!("0 passed, 0 failed");
        return 0;
    }
    let (mut passed, mut failed) = (0usize, 0usize);
    for n in WORLDS {
        // The 4-rank job enters through `oxcomm::init()` and OXCOMM_BACKEND=mpi.
        let envs: Vec<(&str, &str)> = if n == 4 { vec![("OXCOMM_BACKEND", "mpi")] } else { vec![] };
        let (p, f) = run_job(&exe, n, &[], &envs);
        passed += p;
        failed += f;
    }
    // The ULFM job: the backend's revoke, agree and shrink over the stand-in ULFM of
    // `fake_ulfm.c` (Open MPI 4 has none), built here with mpicc and preloaded into each rank.
    match build_fake_ulfm() {
        Ok(lib) => {
            let preload = format!("LD_PRELOAD={}", lib.display());
            let (p, f) = run_job(&exe, 4, &["-x", &preload], &[(ENV_ULFM_JOB, "fake"), ("FAKE_ULFM_FAILED", "3")]);
            let _ = std::fs::remove_file(&lib);
            passed += p;
            failed += f;
        }
        Err(e) => {
            println!("ulfm job: cannot build fake_ulfm.c: {e}");
            failed += 1;
        }
    }
    println!("{passed} passed, {failed} failed");
    i32::from(failed > 0)
}

/// Runs this binary under `mpirun -n n` (with `args` and the environment `envs`), bounded by
/// [`JOB_DEADLINE`], prints its output and returns rank 0's `(passed, failed)` counts (a job
/// that fails without them counts as one failure).
fn run_job(exe: &std::path::Path, n: usize, args: &[&str], envs: &[(&str, &str)]) -> (usize, usize) {
    let t0 = Instant::now();
    let mut child = match Command::new("mpirun")
        .args(["-n", &n.to_string(), "--oversubscribe", "--allow-run-as-root"])
        .args(["--mca", "btl_vader_single_copy_mechanism", "none"])
        .args(args)
        .arg(exe)
        .envs(envs.iter().copied())
        .stdout(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            println!("mpirun -n {n}: cannot start: {e}");
            return (0, 1);
        }
    };
    // Read the job's output on a thread so the wait below can keep its deadline.
    let mut stdout = child.stdout.take().expect("piped stdout");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut s);
        s
    });
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if t0.elapsed() < JOB_DEADLINE => std::thread::sleep(Duration::from_millis(100)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let out = reader.join().unwrap_or_default();
    print!("{out}");
    // Rank 0 ends with "mpi n=N: P passed, F failed".
    let counts = out.lines().rev().find_map(|l| {
        let rest = l.strip_prefix(&format!("mpi n={n}: "))?;
        let mut it = rest.split(", ");
        let p: usize = it.next()?.strip_suffix(" passed")?.parse().ok()?;
        let f: usize = it.next()?.strip_suffix(" failed")?.parse().ok()?;
        Some((p, f))
    });
    let result = match (status, counts) {
        (Some(s), Some((p, f))) if s.success() => (p, f),
        (Some(s), counts) => {
            let (p, f) = counts.unwrap_or((0, 0));
            println!("mpirun -n {n}: exited with {s} ({p} passed, {f} failed)");
            (p, f.max(1))
        }
        (None, _) => {
            println!("mpirun -n {n}: killed after {JOB_DEADLINE:?}");
            (0, 1)
        }
    };
    println!("mpirun -n {n}: {:.1}s", t0.elapsed().as_secs_f64());
    result
}

/// Compiles `fake_ulfm.c` with `mpicc` into a shared library in the target directory.
fn build_fake_ulfm() -> Result<std::path::PathBuf, String> {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mpi/fake_ulfm.c");
    let dir = std::env::current_exe().map_err(|e| e.to_string())?.with_file_name("fake_ulfm");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let lib = dir.join(format!("libfake_ulfm_{}.so", std::process::id()));
    let out = Command::new("mpicc")
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&lib)
        .arg(&src)
        .output()
        .map_err(|e| format!("mpicc: {e}"))?;
    if !out.status.success() {
        return Err(format!("mpicc: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(lib)
}

// ------------------------------------------------------------------------------------------
// One rank under mpirun.

fn rank_main() -> i32 {
    let via_env = std::env::var_os("OXCOMM_BACKEND").is_some();
    let entry = if via_env { "oxcomm::init() with OXCOMM_BACKEND=mpi" } else { "oxcomm::mpi::init()" };
    let comm = match if via_env { oxcomm::init() } else { oxcomm::mpi::init() } {
        Ok(c) => c,
        Err(e) => {
            println!("FAILED: {entry}: {e}");
            return 1;
        }
    };
    let (n, me) = (comm.size(), comm.rank());
    if me == 0 {
        println!("n={n}: joined through {entry}");
    }
    let ulfm_job = std::env::var_os(ENV_ULFM_JOB).is_some();
    let all: Vec<Case> = vec![
        ("init_reads_the_mpi_world", init_reads_the_mpi_world),
        ("all_reduce_every_dtype_and_op", all_reduce_every_dtype_and_op),
        ("reduce_every_root", reduce_every_root),
        ("broadcast_every_root", broadcast_every_root),
        ("all_gather_every_dtype", all_gather_every_dtype),
        ("reduce_scatter_every_dtype_and_op", reduce_scatter_every_dtype_and_op),
        ("all_to_all_and_v", all_to_all_and_v),
        ("gather_scatter_every_root", gather_scatter_every_root),
        ("send_recv_ring_with_tags", send_recv_ring_with_tags),
        ("isend_irecv_exchange", isend_irecv_exchange),
        ("recv_from_any_source", recv_from_any_source),
        ("barriers", barriers),
        ("async_ops_in_order", async_ops_in_order),
        ("coalesced_ops", coalesced_ops),
        ("new_group_and_split", new_group_and_split),
        ("stats_count_ring_bytes", stats_count_ring_bytes),
        ("reduce_scatter_coalesced_matches_threads", reduce_scatter_coalesced_matches_threads),
        ("qgz_matches_threads", qgz_matches_threads),
        ("onebit_matches_threads", onebit_matches_threads),
        ("fault_tolerance_is_unsupported_naming_ulfm", fault_tolerance_is_unsupported_naming_ulfm),
        // Last: a mismatch aborts the communicator.
        ("fingerprint_mismatch_names_a_rank", fingerprint_mismatch_names_a_rank),
    ];
    // The ULFM job runs its own case (it revokes and shrinks the world); OXCOMM_TEST_CASES
    // (a substring of case names) picks cases when the job is started by hand or by CI on
    // another MPI library (.ci/mpi.sh on MPICH).
    let filter = std::env::var("OXCOMM_TEST_CASES").unwrap_or_default();
    let cases: Vec<Case> = if ulfm_job {
        vec![("ulfm_agree_and_shrink_map_to_mpix", ulfm_agree_and_shrink_map_to_mpix)]
    } else {
        all.into_iter().filter(|(name, _)| name.contains(filter.as_str())).collect()
    };
    let (mut passed, mut failed) = (0, 0);
    for (name, case) in cases {
        let t0 = Instant::now();
        let local = case(&comm);
        if let Err(msg) = &local {
            println!("rank {me}: {name}: {msg}");
        }
        // Agree on the verdict (a case that aborted the communicator on purpose is last).
        let mut flag = [i32::from(local.is_err())];
        let ok = if name == "fingerprint_mismatch_names_a_rank" || ulfm_job {
            local.is_ok()
        } else {
            comm.all_reduce(&mut flag, ReduceOp::Max).is_ok() && flag[0] == 0
        };
        if me == 0 {
            println!("n={n} {name} ... {} ({:.2}s)", if ok { "ok" } else { "FAILED" }, t0.elapsed().as_secs_f64());
        }
        if ok {
            passed += 1;
        } else {
            failed += 1;
        }
    }
    if me == 0 {
        println!("mpi n={n}: {passed} passed, {failed} failed");
    }
    drop(comm);
    i32::from(failed > 0)
}

// ------------------------------------------------------------------------------------------
// Helpers (the CollectiveTester's exact inputs).

macro_rules! each_dtype {
    ($f:ident ( $($arg:expr),* )) => {{
        for d in DType::ALL {
            match d {
                DType::F32 => $f::<f32>($($arg),*)?,
                DType::F64 => $f::<f64>($($arg),*)?,
                DType::F16 => $f::<f16>($($arg),*)?,
                DType::BF16 => $f::<bf16>($($arg),*)?,
                DType::I8 => $f::<i8>($($arg),*)?,
                DType::U8 => $f::<u8>($($arg),*)?,
                DType::I32 => $f::<i32>($($arg),*)?,
                DType::I64 => $f::<i64>($($arg),*)?,
                // The dtypes after the first eight (bool, i16, u16-u64, complex, float8) are
                // tested on the native backend (tests/it/dtypes.rs); not yet under MPI.
                _ => continue,
            }
        }
    }};
}

const COUNTS: [usize; 5] = [0, 1, 7, 1000, 65537];

/// Small integers, so every sum, product, min and max is exact in every dtype.
fn input<T: Element>(rank: usize, i: usize, op: ReduceOp) -> T {
    let v = match op {
        ReduceOp::Prod => {
            if (rank + i) % 3 == 0 {
                2
            } else {
                1
            }
        }
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => (rank * 37 + i * 11) % 64,
        _ => ((rank + 1) * 3 + i * 7) % 5 + 1 + (i % 2) * rank,
    };
    T::from_f64(v as f64)
}

fn inputs<T: Element>(rank: usize, count: usize, op: ReduceOp) -> Vec<T> {
    (0..count).map(|i| input(rank, i, op)).collect()
}

/// Ranks' inputs reduced in rank order with the scalar kernel.
fn expected<T: Element>(size: usize, count: usize, op: ReduceOp) -> Vec<T> {
    let mut acc = inputs::<T>(0, count, op);
    for r in 1..size {
        scalar::reduce_into(&mut acc, &inputs::<T>(r, count, op), op);
    }
    if op == ReduceOp::Avg && size > 1 {
        scalar::divide(&mut acc, size);
    }
    acc
}

fn same<T: Element>(a: &[T], b: &[T]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| bytemuck::bytes_of(x) == bytemuck::bytes_of(y))
}

fn check<T: Element>(what: &str, got: &[T], want: &[T]) -> CaseResult {
    if same(got, want) {
        return Ok(());
    }
    let i = got.iter().zip(want).position(|(a, b)| bytemuck::bytes_of(a) != bytemuck::bytes_of(b));
    Err(format!(
        "{what}: {} elements (want {}), first difference at {i:?}: {:?} vs {:?}",
        got.len(),
        want.len(),
        i.map(|i| got[i]),
        i.map(|i| want[i])
    ))
}

fn e(what: &str) -> impl Fn(oxcomm::Error) -> String + '_ {
    move |err| format!("{what}: {err}")
}

fn ops_for(d: DType) -> impl Iterator<Item = ReduceOp> {
    ReduceOp::ALL.into_iter().filter(move |op| op.fits(d))
}

// ------------------------------------------------------------------------------------------
// Cases

fn init_reads_the_mpi_world(comm: &Communicator) -> CaseResult {
    let n: usize = std::env::var("OMPI_COMM_WORLD_SIZE").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let r: usize = std::env::var("OMPI_COMM_WORLD_RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(usize::MAX);
    if (comm.size(), comm.rank(), comm.transport()) != (n, r, oxcomm::Transport::Mpi) {
        return Err(format!("size/rank/transport {} {} {} vs env {n} {r}", comm.size(), comm.rank(), comm.transport()));
    }
    Ok(())
}

fn all_reduce_every_dtype_and_op(comm: &Communicator) -> CaseResult {
    fn one<T: Element>(comm: &Communicator) -> CaseResult {
        for op in ops_for(T::DTYPE) {
            for count in COUNTS {
                let mut buf = inputs::<T>(comm.rank(), count, op);
                let what = format!("all_reduce {} {op} × {count}", T::DTYPE);
                comm.all_reduce(&mut buf, op).map_err(e(&what))?;
                check(&what, &buf, &expected::<T>(comm.size(), count, op))?;
            }
        }
        Ok(())
    }
    each_dtype!(one(comm));
    Ok(())
}

fn reduce_every_root(comm: &Communicator) -> CaseResult {
    fn one<T: Element>(comm: &Communicator) -> CaseResult {
        for root in 0..comm.size() {
            for op in ops_for(T::DTYPE) {
                let count = 1000;
                let mine = inputs::<T>(comm.rank(), count, op);
                let mut buf = mine.clone();
                let what = format!("reduce {} {op} root {root}", T::DTYPE);
                comm.reduce(&mut buf, root, op).map_err(e(&what))?;
                let want = if comm.rank() == root { expected::<T>(comm.size(), count, op) } else { mine.clone() };
                check(&what, &buf, &want)?;
                // Out of place: the root's input into its own output.
                let mut out = vec![T::default(); count];
                let what = format!("reduce_into {} {op} root {root}", T::DTYPE);
                comm.reduce_into(&mine, (comm.rank() == root).then_some(&mut out[..]), root, op).map_err(e(&what))?;
                if comm.rank() == root {
                    check(&what, &out, &want)?;
                }
            }
        }
        Ok(())
    }
    each_dtype!(one(comm));
    Ok(())
}

fn broadcast_every_root(comm: &Communicator) -> CaseResult {
    fn one<T: Element>(comm: &Communicator) -> CaseResult {
        for root in 0..comm.size() {
            for count in COUNTS {
                let mut buf = inputs::<T>(comm.rank(), count, ReduceOp::Sum);
                let what = format!("broadcast {} root {root} × {count}", T::DTYPE);
                comm.broadcast(&mut buf, root).map_err(e(&what))?;
                check(&what, &buf, &inputs::<T>(root, count, ReduceOp::Sum))?;
            }
        }
        Ok(())
    }
    each_dtype!(one(comm));
    Ok(())
}

fn all_gather_every_dtype(comm: &Communicator) -> CaseResult {
    fn one<T: Element>(comm: &Communicator) -> CaseResult {
        let n = comm.size();
        for count in COUNTS {
            let mine = inputs::<T>(comm.rank(), count, ReduceOp::Sum);
            let mut out = vec![T::default(); n * count];
            let what = format!("all_gather {} × {count}", T::DTYPE);
            comm.all_gather(&mine, &mut out).map_err(e(&what))?;
            let want: Vec<T> = (0..n).flat_map(|r| inputs::<T>(r, count, ReduceOp::Sum)).collect();
            check(&what, &out, &want)?;
            // In place (MPI_IN_PLACE): this rank's block is its contribution.
            let mut buf = vec![T::default(); n * count];
            buf[comm.rank() * count..(comm.rank() + 1) * count].copy_from_slice(&mine);
            let what = format!("all_gather_in_place {} × {count}", T::DTYPE);
            comm.all_gather_in_place(&mut buf).map_err(e(&what))?;
            check(&what, &buf, &want)?;
        }
        Ok(())
    }
    each_dtype!(one(comm));
    Ok(())
}

fn reduce_scatter_every_dtype_and_op(comm: &Communicator) -> CaseResult {
    fn one<T: Element>(comm: &Communicator) -> CaseResult {
        let (n, me) = (comm.size(), comm.rank());
        for op in ops_for(T::DTYPE) {
            for block in [0, 1, 7, 1000] {
                let input = inputs::<T>(me, n * block, op);
                let mut out = vec![T::default(); block];
                let what = format!("reduce_scatter {} {op} × {block}", T::DTYPE);
                comm.reduce_scatter(&input, &mut out, op).map_err(e(&what))?;
                let full = expected::<T>(n, n * block, op);
                check(&what, &out, &full[me * block..(me + 1) * block])?;
                // In place (MPI_IN_PLACE): the result lands in this rank's block.
                let mut buf = input;
                let what = format!("reduce_scatter_in_place {} {op} × {block}", T::DTYPE);
                comm.reduce_scatter_in_place(&mut buf, op).map_err(e(&what))?;
                check(&what, &buf[me * block..(me + 1) * block], &full[me * block..(me + 1) * block])?;
            }
        }
        Ok(())
    }
    each_dtype!(one(comm));
    Ok(())
}

fn all_to_all_and_v(comm: &Communicator) -> CaseResult {
    fn one<T: Element>(comm: &Communicator) -> CaseResult {
        let (n, me) = (comm.size(), comm.rank());
        let val = |from: usize, to: usize, i: usize| T::from_f64(((from * 7 + to * 3 + i) % 100) as f64);
        for block in [0, 1, 33] {
            let send: Vec<T> = (0..n).flat_map(|p| (0..block).map(move |i| val(me, p, i))).collect();
            let mut recv = vec![T::default(); n * block];
            let what = format!("all_to_all {} × {block}", T::DTYPE);
            comm.all_to_all(&send, &mut recv).map_err(e(&what))?;
            let want: Vec<T> = (0..n).flat_map(|p| (0..block).map(move |i| val(p, me, i))).collect();
            check(&what, &recv, &want)?;
            // In place (MPI_IN_PLACE on every rank).
            let mut buf = send;
            let what = format!("all_to_all_in_place {} × {block}", T::DTYPE);
            comm.all_to_all_in_place(&mut buf).map_err(e(&what))?;
            check(&what, &buf, &want)?;
        }
        // all_to_all_v: rank a sends (a + b) % 3 + b elements to rank b.
        let k = |a: usize, b: usize| (a + b) % 3 + b;
        let send_counts: Vec<usize> = (0..n).map(|p| k(me, p)).collect();
        let recv_counts: Vec<usize> = (0..n).map(|p| k(p, me)).collect();
        let send: Vec<T> = (0..n).flat_map(|p| (0..k(me, p)).map(move |i| val(me, p, i))).collect();
        let mut recv = vec![T::default(); recv_counts.iter().sum()];
        let what = format!("all_to_all_v {}", T::DTYPE);
        comm.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts).map_err(e(&what))?;
        let want: Vec<T> = (0..n).flat_map(|p| (0..k(p, me)).map(move |i| val(p, me, i))).collect();
        check(&what, &recv, &want)
    }
    each_dtype!(one(comm));
    Ok(())
}

fn gather_scatter_every_root(comm: &Communicator) -> CaseResult {
    fn one<T: Element>(comm: &Communicator) -> CaseResult {
        let (n, me) = (comm.size(), comm.rank());
        for root in 0..n {
            let count = 17;
            let mine = inputs::<T>(me, count, ReduceOp::Sum);
            let all: Vec<T> = (0..n).flat_map(|r| inputs::<T>(r, count, ReduceOp::Sum)).collect();
            let mut out = vec![T::default(); n * count];
            let what = format!("gather {} root {root}", T::DTYPE);
            comm.gather(&mine, (me == root).then_some(&mut out[..]), root).map_err(e(&what))?;
            if me == root {
                check(&what, &out, &all)?;
            }
            let mut got = vec![T::default(); count];
            let what = format!("scatter {} root {root}", T::DTYPE);
            comm.scatter((me == root).then_some(&all[..]), &mut got, root).map_err(e(&what))?;
            check(&what, &got, &mine)?;
            // In place at the root (MPI_IN_PLACE): its own block stays where it is.
            let mut buf = if me == root { vec![T::default(); n * count] } else { mine.clone() };
            if me == root {
                buf[me * count..(me + 1) * count].copy_from_slice(&mine);
            }
            let what = format!("gather_in_place {} root {root}", T::DTYPE);
            comm.gather_in_place(&mut buf, root).map_err(e(&what))?;
            check(&what, &buf, if me == root { &all } else { &mine })?;
            let mut buf = if me == root { all.clone() } else { vec![T::default(); count] };
            let what = format!("scatter_in_place {} root {root}", T::DTYPE);
            comm.scatter_in_place(&mut buf, root).map_err(e(&what))?;
            check(&what, &buf, if me == root { &all } else { &mine })?;
        }
        Ok(())
    }
    each_dtype!(one(comm));
    Ok(())
}

/// `recv_any`/`irecv_any` (MPI_Iprobe over the candidates): the native transports' scenario.
fn recv_from_any_source(comm: &Communicator) -> CaseResult {
    let bad = any_source::scenario(comm);
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!("{bad:?}"))
    }
}

fn send_recv_ring_with_tags(comm: &Communicator) -> CaseResult {
    let (n, me) = (comm.size(), comm.rank());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    for (tag, count) in [(0u32, 1usize), (7, 1000), (99, 300_000)] {
        let mine: Vec<i32> = (0..count as i32).map(|i| i * 10 + me as i32).collect();
        let mut got = vec![0i32; count];
        // Even ranks send first, odd ranks receive first.
        if me % 2 == 0 {
            comm.send(&mine, next, tag).map_err(e("send"))?;
            comm.recv(&mut got, prev, tag).map_err(e("recv"))?;
        } else {
            comm.recv(&mut got, prev, tag).map_err(e("recv"))?;
            comm.send(&mine, next, tag).map_err(e("send"))?;
        }
        let want: Vec<i32> = (0..count as i32).map(|i| i * 10 + prev as i32).collect();
        check(&format!("recv tag {tag} from {prev}"), &got, &want)?;
    }
    Ok(())
}

fn isend_irecv_exchange(comm: &Communicator) -> CaseResult {
    let (n, me) = (comm.size(), comm.rank());
    let count = 1 << 20;
    let mut works = Vec::new();
    for p in (0..n).filter(|&p| p != me) {
        let data: Vec<f32> = (0..count).map(|i| (i % 1000) as f32 + me as f32).collect();
        works.push((p, comm.isend(data, p, 5), comm.irecv(vec![0f32; count], p, 5)));
    }
    for (p, s, r) in works {
        s.wait().map_err(e("isend"))?;
        let got = r.wait().map_err(e("irecv"))?;
        let want: Vec<f32> = (0..count).map(|i| (i % 1000) as f32 + p as f32).collect();
        check(&format!("irecv from {p}"), &got, &want)?;
    }
    Ok(())
}

/// Revoke, agree and shrink (issue 39) need ULFM, which Open MPI 4 lacks and MPICH's ch4
/// device only pretends to have (its MPIX_Comm_* abort the process; .ci/mpi.sh runs this case
/// on Debian's MPICH too): an `Unsupported` error that names ULFM (and, on MPICH ch4, the
/// device), and the communicator goes on (nothing was revoked).
fn fault_tolerance_is_unsupported_naming_ulfm(comm: &Communicator) -> CaseResult {
    let version = mpi::environment::library_version().unwrap_or_default();
    let want = if version.contains("MPICH") && version.contains("ch4") { "ch4" } else { "ULFM" };
    let errors = [("revoke", comm.revoke().err()), ("agree", comm.agree(1).err()), ("shrink", comm.shrink().err())];
    for (what, err) in errors {
        let err = err.ok_or_else(|| format!("{what} succeeded on the MPI backend"))?;
        let text = err.to_string();
        if err.kind() != oxcomm::ErrorKind::Unsupported || !text.contains("ULFM") || !text.contains(want) {
            return Err(format!("{what}: {err}"));
        }
    }
    if comm.is_revoked() {
        return Err("the communicator was revoked".into());
    }
    comm.barrier().map_err(e("barrier after them"))
}

/// The ULFM job (under `fake_ulfm.c`, world rank 3 "failed" as only rank 0 knows): `agree`
/// is the AND of all 64 bits of the flags and names rank 3 on every rank; `shrink` revokes the
/// communicator (MPIX_Comm_revoke on its MPI communicators) and returns the other three, ranks
/// in the old order, on which collectives and point-to-point messages work; rank 3 gets an
/// error instead.
fn ulfm_agree_and_shrink_map_to_mpix(comm: &Communicator) -> CaseResult {
    let (n, me) = (comm.size(), comm.rank());
    let failed_rank = n - 1;
    let flag = match me {
        1 => !(1u64 << 40),
        2 => !(1u64 << 3),
        _ => u64::MAX,
    };
    let agreed = comm.agree(flag).map_err(e("agree"))?;
    let want = oxcomm::Agreed { flag: !(1u64 << 40 | 1 << 3), failed: vec![failed_rank] };
    if agreed != want {
        return Err(format!("agree: {agreed:?}, expected {want:?}"));
    }
    if comm.failed_ranks() != [failed_rank] {
        return Err(format!("failed_ranks after agree: {:?}", comm.failed_ranks()));
    }
    let small = comm.shrink();
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name; the symbol, when present, is
    // `int fake_ulfm_revokes(void)` of fake_ulfm.c.
    let revokes = unsafe {
        let p = libc::dlsym(libc::RTLD_DEFAULT, c"fake_ulfm_revokes".as_ptr());
        if p.is_null() {
            return Err("fake_ulfm.c is not loaded".into());
        }
        std::mem::transmute::<*mut libc::c_void, extern "C" fn() -> i32>(p)()
    };
    if revokes < 2 {
        return Err(format!("shrink called MPIX_Comm_revoke {revokes} times (world and point-to-point: 2)"));
    }
    match comm.all_reduce(&mut [1.0f32], ReduceOp::Sum) {
        Err(err) if err.kind() == ErrorKind::Revoked => {}
        other => return Err(format!("all_reduce on the shrunk-away communicator: {other:?}, expected Revoked")),
    }
    if me == failed_rank {
        return match small {
            Err(_) => Ok(()),
            Ok(c) => Err(format!("the failed rank got a communicator of {}", c.size())),
        };
    }
    let small = small.map_err(e("shrink"))?;
    if (small.size(), small.rank()) != (n - 1, me) {
        return Err(format!("shrunk: rank {} of {}, expected {me} of {}", small.rank(), small.size(), n - 1));
    }
    let mut v = [me as f32 + 1.0; 3];
    small.all_reduce(&mut v, ReduceOp::Sum).map_err(e("all_reduce on the shrunk communicator"))?;
    let sum = (1..n).sum::<usize>() as f32;
    check("all_reduce on the shrunk communicator", &v, &[sum; 3])?;
    // A ring of blocking sends (rank 0 sends first; the others receive first). No async op:
    // its worker thread could drop the last handle on MPI after this thread exits.
    let (to, from) = ((me + 1) % (n - 1), (me + n - 2) % (n - 1));
    let mut got = vec![0u32; 5];
    if me == 0 {
        small.send(&[me as u32; 5], to, 9).map_err(e("send on the shrunk communicator"))?;
    }
    small.recv(&mut got, from, 9).map_err(e("recv on the shrunk communicator"))?;
    if me != 0 {
        small.send(&[me as u32; 5], to, 9).map_err(e("send on the shrunk communicator"))?;
    }
    check("recv on the shrunk communicator", &got, &[from as u32; 5])
}

fn barriers(comm: &Communicator) -> CaseResult {
    for _ in 0..10 {
        comm.barrier().map_err(e("barrier"))?;
    }
    comm.monitored_barrier(Duration::from_secs(60)).map_err(e("monitored_barrier"))?;
    comm.barrier_async().wait().map_err(e("barrier_async"))
}

fn async_ops_in_order(comm: &Communicator) -> CaseResult {
    let n = comm.size();
    let works: Vec<_> = (0..8).map(|k| comm.all_reduce_async(vec![k as i64; 1000], ReduceOp::Sum)).collect();
    let mut b = vec![comm.rank() as i64; 3];
    comm.broadcast(&mut b, 0).map_err(e("broadcast between async ops"))?;
    check("broadcast", &b, &[0; 3])?;
    for (k, w) in works.into_iter().enumerate() {
        let got = w.wait().map_err(e("all_reduce_async"))?;
        check(&format!("all_reduce_async #{k}"), &got, &vec![(k * n) as i64; 1000])?;
    }
    let g = comm.all_gather_async(vec![comm.rank() as u8; 2]).wait().map_err(e("all_gather_async"))?;
    let want: Vec<u8> = (0..n as u8).flat_map(|r| [r, r]).collect();
    check("all_gather_async", &g, &want)
}

fn coalesced_ops(comm: &Communicator) -> CaseResult {
    let (n, me) = (comm.size(), comm.rank());
    let mut a = inputs::<f32>(me, 10, ReduceOp::Sum);
    let mut b = inputs::<f32>(me, 3, ReduceOp::Sum);
    comm.all_reduce_coalesced(&mut [&mut a[..], &mut b[..]], ReduceOp::Sum).map_err(e("all_reduce_coalesced"))?;
    check("all_reduce_coalesced a", &a, &expected::<f32>(n, 10, ReduceOp::Sum))?;
    check("all_reduce_coalesced b", &b, &expected::<f32>(n, 3, ReduceOp::Sum))?;
    // Avg is finished by the communicator on every buffer, as on the native backend.
    let (mut a, mut b) = (inputs::<i32>(me, 4, ReduceOp::Avg), inputs::<i32>(me, 7, ReduceOp::Avg));
    comm.all_reduce_coalesced(&mut [&mut a[..], &mut b[..]], ReduceOp::Avg).map_err(e("all_reduce_coalesced avg"))?;
    check("all_reduce_coalesced avg a", &a, &expected::<i32>(n, 4, ReduceOp::Avg))?;
    check("all_reduce_coalesced avg b", &b, &expected::<i32>(n, 7, ReduceOp::Avg))?;
    let (x, y) = (vec![me as i32; 2], vec![-(me as i32); 5]);
    let (mut ox, mut oy) = (vec![0i32; 2 * n], vec![0i32; 5 * n]);
    comm.all_gather_coalesced(&[&x, &y], &mut [&mut ox[..], &mut oy[..]]).map_err(e("all_gather_coalesced"))?;
    check("all_gather_coalesced x", &ox, &(0..n as i32).flat_map(|r| [r; 2]).collect::<Vec<_>>())?;
    check("all_gather_coalesced y", &oy, &(0..n as i32).flat_map(|r| [-r; 5]).collect::<Vec<_>>())
}

fn new_group_and_split(comm: &Communicator) -> CaseResult {
    let (n, me) = (comm.size(), comm.rank());
    // new_group of the even ranks, listed in reverse order.
    let evens: Vec<usize> = (0..n).filter(|r| r % 2 == 0).rev().collect();
    let g = comm.new_group(&evens).map_err(e("new_group"))?;
    match (&g, me % 2 == 0) {
        (Some(g), true) => {
            let want_rank = evens.iter().position(|&r| r == me).unwrap_or(usize::MAX);
            if (g.rank(), g.size(), g.members()) != (want_rank, evens.len(), &evens[..]) {
                return Err(format!("new_group: rank {} size {} members {:?}", g.rank(), g.size(), g.members()));
            }
            let mut v = [me as i32 + 1];
            g.all_reduce(&mut v, ReduceOp::Sum).map_err(e("all_reduce in new_group"))?;
            check("all_reduce in new_group", &v, &[evens.iter().map(|&r| r as i32 + 1).sum()])?;
            // The group's rank 0 is the highest even rank.
            let mut b = [me as i64];
            g.broadcast(&mut b, 0).map_err(e("broadcast in new_group"))?;
            check("broadcast in new_group", &b, &[evens[0] as i64])?;
        }
        (None, false) => {}
        (g, _) => return Err(format!("new_group returned {:?} on rank {me}", g.as_ref().map(|g| g.rank()))),
    }
    // split by parity, ordered by descending world rank; rank 0 opts out.
    let color = (me != 0).then_some((me % 2) as u32 * 1_000_000_007 % 4_000_000_000);
    let s = comm.split(color, -(me as i64)).map_err(e("split"))?;
    if me == 0 {
        return if s.is_none() { Ok(()) } else { Err("split(None) returned a group".into()) };
    }
    let s = s.ok_or("split returned no group")?;
    let mut members: Vec<usize> = (1..n).filter(|r| r % 2 == me % 2).collect();
    members.reverse();
    if s.members() != &members[..] {
        return Err(format!("split members {:?}, want {members:?}", s.members()));
    }
    let mut v = vec![1u8; 5];
    s.all_reduce(&mut v, ReduceOp::Sum).map_err(e("all_reduce in split"))?;
    check("all_reduce in split", &v, &[members.len() as u8; 5])?;
    // Sub-sub-group from the split group, and point-to-point inside it.
    if s.size() > 1 {
        let peer = (s.rank() + 1) % s.size();
        let from = (s.rank() + s.size() - 1) % s.size();
        let w = s.isend(vec![s.rank() as i64; 4], peer, 3);
        let got = s.irecv(vec![0i64; 4], from, 3).wait().map_err(e("irecv in split"))?;
        w.wait().map_err(e("isend in split"))?;
        check("p2p in split", &got, &[from as i64; 4])?;
    }
    Ok(())
}

fn stats_count_ring_bytes(comm: &Communicator) -> CaseResult {
    let n = comm.size();
    let mut buf = vec![1.0f32; 1 << 16];
    let before = comm.stats();
    comm.all_reduce(&mut buf, ReduceOp::Sum).map_err(e("all_reduce"))?;
    let after = comm.stats();
    let want = (2 * (n - 1) * (4 << 16) / n) as u64;
    if after.bytes_sent - before.bytes_sent != want || after.bytes_received - before.bytes_received != want {
        return Err(format!("all_reduce of 256 KiB counted {before:?} -> {after:?}, want {want} each way"));
    }
    Ok(())
}

fn reduce_scatter_coalesced_matches_threads(comm: &Communicator) -> CaseResult {
    let (n, me) = (comm.size(), comm.rank());
    let lens = [0usize, 1, 5, 8, 11, 1000];
    let make = |r: usize| -> Vec<Vec<f16>> {
        lens.iter()
            .enumerate()
            .map(|(t, &l)| (0..l).map(|i| f16::from_f32(((t + i + r) % 7) as f32)).collect())
            .collect()
    };
    let reference = threads::run(n, |c| {
        let x = make(c.rank());
        let refs: Vec<&[f16]> = x.iter().map(|v| v.as_slice()).collect();
        reduce_scatter_coalesced(&c, &refs)
    })
    .map_err(e("thread ranks"))?;
    let want = reference[me].clone().map_err(e("thread ranks"))?;
    let x = make(me);
    let refs: Vec<&[f16]> = x.iter().map(|v| v.as_slice()).collect();
    let got = reduce_scatter_coalesced(comm, &refs).map_err(e("reduce_scatter_coalesced"))?;
    for (t, (g, w)) in got.iter().zip(&want).enumerate() {
        check(&format!("reduce_scatter_coalesced tensor {t}"), g, w)?;
    }
    Ok(())
}

fn qgz_matches_threads(comm: &Communicator) -> CaseResult {
    let (n, me) = (comm.size(), comm.rank());
    let shapes: [&[usize]; 3] = [&[8, 16], &[16, 32], &[10]];
    let make = |r: usize| -> Vec<Vec<f32>> {
        shapes
            .iter()
            .enumerate()
            .map(|(t, s)| {
                let numel: usize = s.iter().product();
                (0..numel).map(|i| (((i * 13 + t * 5 + r * 3) % 17) as f32 - 8.0) * 0.25).collect()
            })
            .collect()
    };
    let dpns: Vec<Option<usize>> = if n >= 4 { vec![None, Some(2)] } else { vec![None, Some(1)] };
    for dpn in dpns {
        let run = |c: &Communicator| -> oxcomm::Result<Vec<Vec<f32>>> {
            let x = make(c.rank());
            let views: Vec<TensorView<'_, f32>> =
                x.iter().zip(shapes).map(|(v, s)| TensorView::new(v, s)).collect::<oxcomm::Result<_>>()?;
            let groups = dpn.map(|d| HostGroups::uniform(c, d)).transpose()?;
            all_to_all_quant_reduce(c, &views, groups.as_ref())
        };
        let reference = threads::run(n, |c| run(&c)).map_err(e("thread ranks"))?;
        let want = reference[me].clone().map_err(e("thread ranks"))?;
        let got = run(comm).map_err(e("all_to_all_quant_reduce"))?;
        for (t, (g, w)) in got.iter().zip(&want).enumerate() {
            check(&format!("qgZ (ranks per host {dpn:?}) tensor {t}"), g, w)?;
        }
    }
    Ok(())
}

/// The 1-bit all-reduce over MPI gives bit for bit what it gives on thread ranks, over
/// several steps (so the error feedback state is exercised too).
fn onebit_matches_threads(comm: &Communicator) -> CaseResult {
    use oxcomm::compression::onebit::{self, OneBitState};
    let (n, me) = (comm.size(), comm.rank());
    let len = 1000; // needs padding for every n in 2..=8
    let input = |r: usize, step: usize| -> Vec<f32> {
        (0..len).map(|i| (((i * 7 + r * 13 + step * 5) % 23) as f32 - 11.0) * 0.125).collect()
    };
    let run = |c: &Communicator| -> oxcomm::Result<Vec<Vec<f32>>> {
        let mut state = OneBitState::new(len, c.size())?;
        (0..4)
            .map(|step| {
                let mut buf = input(c.rank(), step);
                onebit::all_reduce(c, &mut buf, &mut state)?;
                Ok(buf)
            })
            .collect()
    };
    let reference = threads::run(n, |c| run(&c)).map_err(e("thread ranks"))?;
    let want = reference[me].clone().map_err(e("thread ranks"))?;
    let got = run(comm).map_err(e("onebit::all_reduce"))?;
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        check(&format!("1-bit all_reduce step {step}"), g, w)?;
    }
    Ok(())
}

fn fingerprint_mismatch_names_a_rank(comm: &Communicator) -> CaseResult {
    let me = comm.rank();
    // The last rank all-reduces i32 while the others all-reduce f32.
    let last = comm.size() - 1;
    let err = if me == last {
        comm.all_reduce(&mut [1i32; 4], ReduceOp::Sum).err()
    } else {
        comm.all_reduce(&mut [1f32; 4], ReduceOp::Sum).err()
    };
    let err = err.ok_or("a mismatched all_reduce succeeded")?;
    let want_peer = if me == last { 0 } else { last };
    if err.kind() != ErrorKind::Mismatch || err.peer() != Some(want_peer) {
        return Err(format!("want a mismatch naming rank {want_peer}, got {:?} {err}", err.kind()));
    }
    if !err.to_string().contains("this rank called all_reduce") {
        return Err(format!("message: {err}"));
    }
    // Every later op fails at once with the cause.
    let later = comm.barrier().err().ok_or("barrier after a mismatch succeeded")?;
    if later.kind() != ErrorKind::Aborted {
        return Err(format!("later op: {later}"));
    }
    Ok(())
}
