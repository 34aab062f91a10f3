//! Ranks as real processes over shared memory: the test binary re-runs itself as the ranks
//! (`child_entry`, started by `harness::Job` with its role), with the environment `oxcomm launch` would
//! set and a store served by the parent test. Covers the CollectiveTester over shm for world
//! sizes 2, 3, 4 and 8 (and over TCP on loopback), buffers of one and several direct chunks,
//! and SIGKILL / SIGSTOP of one rank mid-collective (all-reduce; a direct all_to_all and all_gather;
//! 8-byte direct all_reduce and broadcast).

use std::time::{Duration, Instant};

use oxcomm::transport::shm::workspace::CHUNK_BYTES;
use oxcomm::{Communicator, DType, ReduceOp};

use crate::collectives::CollectiveTester;
use crate::harness::{self, Exit, Job};

/// The longest a job of these tests may run.
const LIMIT: Duration = Duration::from_secs(240);

fn spawn_job(n: usize, role: &str, timeout_s: &str) -> Job {
    spawn_job_with(n, role, timeout_s, &[])
}

fn spawn_job_with(n: usize, role: &str, timeout_s: &str, env: &[(&str, &str)]) -> Job {
    Job::of("multiproc::child_entry", role, n, timeout_s).envs(env).spawn()
}

/// Entry point of the child ranks. It does nothing in a normal test run (no role set).
#[test]
fn child_entry() {
    let Some(role) = harness::role() else { return };
    let comm = oxcomm::init().unwrap_or_else(|e| {
        eprintln!("init failed: {e}");
        std::process::exit(3)
    });
    match role.as_str() {
        "tester" => full_matrix(&comm, CollectiveTester::new().counts(&[0, 1, 7, 1000, 65537])),
        "quick" => {
            let t = CollectiveTester::new().counts(&[0, 7, 1000]).segments(&[1 << 20]);
            let mut bad = t.rank_all_reduce(&comm);
            bad.extend(t.rank_gather_scatter(&comm));
            bad.extend(t.rank_all_gather(&comm));
            bad.extend(t.rank_reduce_scatter(&comm));
            // The direct all_gather and reduce_scatter's chunked path, f32 only.
            let big = t.counts(&BIG_BLOCKS).dtypes(&[DType::F32]);
            bad.extend(big.rank_all_gather(&comm));
            bad.extend(big.rank_reduce_scatter(&comm));
            report(&comm, bad);
        }
        "dtypes" => {
            // bool, the 16-bit and unsigned integers, complex and float8 over shared memory
            // (the direct algorithms included).
            let t =
                CollectiveTester::new().dtypes(crate::dtypes::NEW_DTYPES).counts(&[0, 7, 1000]).segments(&[1 << 20]);
            let mut bad = t.rank_all_reduce(&comm);
            bad.extend(t.rank_rooted(&comm));
            bad.extend(t.rank_gather_scatter(&comm));
            bad.extend(t.rank_all_gather(&comm));
            bad.extend(t.rank_reduce_scatter(&comm));
            report(&comm, bad);
        }
        "chunks" => {
            // Exactly one chunk per rank (f32), and several with an odd remainder: the direct
            // paths' chunked steps, against every other algorithm of each op.
            // With single copy on (OXCOMM_SHM_SINGLE_COPY=1, where the host allows it),
            // all_gather's and all_to_all's blocks from 512 KiB (131072 and 300001 elements of
            // 4 or 8 bytes) move by it after the first such op, the others (and in-place
            // all_to_all) through slots and the chunk buffers; by default everything goes
            // through those.
            let t = CollectiveTester::new().counts(&[3001, 131_072, 300_001]).segments(&[1 << 20]);
            let mut bad = t.rank_rooted(&comm);
            bad.extend(t.rank_gather_scatter(&comm));
            println!("read directly {} can read parent {}", comm.stats().bytes_read_directly, can_read_parent());
            report(&comm, bad);
        }
        "parts" => {
            // Mid sizes, where a chunk moves part by part (PART_BYTES = 16 KiB) and readers
            // follow the writer: a part and one element more (f64: just above the small
            // path), exactly four parts (f32), eleven parts and a tail, and one element past
            // half a chunk; broadcast, gather, scatter, all_gather, all_to_all(_v), in place
            // and apart, back to back.
            let t = CollectiveTester::new().counts(&[4097, 16_384, 40_961, 65_543]).segments(&[1 << 20]);
            let mut bad = t.rank_rooted(&comm);
            bad.extend(t.rank_gather_scatter(&comm));
            bad.extend(t.rank_all_gather(&comm));
            report(&comm, bad);
        }
        "stream_in" => {
            // Chunk steps above the streaming size (256 KiB moved), which stream their
            // copy-in only where the cores look far apart (OXCOMM_SHM_STREAM_IN=always forces
            // it): a chunk and one element, and one and a half chunks with an odd tail (f32
            // and f64: blocks of 512 KiB–2.3 MiB); and slot payloads of 4–32 KiB, which stream
            // from 4 KiB likewise; every data-moving op, in place and apart, back to back. The
            // reducing ops too: all_reduce and reduce stream their copy-in and their reduced
            // slice, reduce_scatter its copy-in, and all three their slot payloads.
            let t = CollectiveTester::new()
                .counts(&[1_025, 6_145, 8_191, 131_073, 196_611])
                .dtypes(&[oxcomm::DType::F32, oxcomm::DType::F64])
                .segments(&[1 << 20]);
            let mut bad = t.rank_rooted(&comm);
            bad.extend(t.rank_gather_scatter(&comm));
            bad.extend(t.rank_all_gather(&comm));
            bad.extend(t.rank_all_reduce(&comm));
            bad.extend(t.rank_reduce_scatter(&comm));
            report(&comm, bad);
        }
        "chunks_f32" => {
            // 8 ranks on few cores: several chunks with an odd remainder, f32 only.
            let t = CollectiveTester::new().counts(&[300_001]).dtypes(&[oxcomm::DType::F32]).segments(&[1 << 20]);
            let mut bad = t.rank_rooted(&comm);
            bad.extend(t.rank_gather_scatter(&comm));
            report(&comm, bad);
        }
        "streaming" => {
            // Outputs of at least 16 MiB, where the direct ops' copy-out steps switch to
            // non-temporal stores (f32, 16 MiB + 20 bytes per rank's block: an odd tail).
            let t = CollectiveTester::new()
                .counts(&[(16 << 20) / 4 + 5])
                .dtypes(&[oxcomm::DType::F32])
                .segments(&[1 << 20]);
            let mut bad = t.rank_rooted(&comm);
            bad.extend(t.rank_gather_scatter(&comm));
            bad.extend(t.rank_all_gather(&comm));
            report(&comm, bad);
        }
        "hosts" => {
            // Two simulated hosts of two ranks: shared memory inside, TCP across, and the
            // hierarchical algorithms picked by the planner (all_reduce also forced).
            assert_eq!(comm.transport(), oxcomm::Transport::ShmTcp);
            assert_eq!(comm.hosts(), vec![0, 0, 1, 1]);
            assert!(comm.host_layout().is_some());
            // The links were measured at start-up, halving-doubling against the ring too.
            let net = comm.links_model().expect("a job across hosts plans with a links model");
            assert!(net.alpha > 0.0 && net.beta > 0.0, "{net:?}");
            assert!(net.halving_over_ring.is_finite() && net.halving_over_ring > 0.0, "{net:?}");
            full_matrix(&comm, CollectiveTester::new().counts(&[0, 7, 1000, 65537]).segments(&[1 << 20]));
        }
        "loop" => {
            // All-reduce forever; the parent kills or stops one rank.
            let mut buf = vec![1.0f32; 1 << 20];
            println!("ready");
            loop {
                if let Err(e) = comm.all_reduce(&mut buf, ReduceOp::Sum) {
                    eprintln!("ERROR: {e}");
                    std::process::exit(7);
                }
                buf.fill(1.0);
            }
        }
        "loop_all_to_all" => {
            // Direct all-to-all of several chunk steps forever; the parent kills one rank.
            let send = vec![1.0f32; comm.size() << 18];
            let mut recv = vec![0.0f32; comm.size() << 18];
            println!("ready");
            loop {
                if let Err(e) = comm.all_to_all(&send, &mut recv) {
                    eprintln!("ERROR: {e}");
                    std::process::exit(7);
                }
            }
        }
        "loop_broadcast" => {
            // Direct broadcasts of a few parts from rank 0 forever; the parent kills the root.
            let mut buf = vec![1.0f32; 50_001];
            println!("ready");
            loop {
                if let Err(e) = comm.broadcast(&mut buf, 0) {
                    eprintln!("ERROR: {e}");
                    std::process::exit(7);
                }
            }
        }
        "loop_all_gather" => {
            // Direct all-gathers of several chunks forever; the parent kills one rank.
            let input = vec![1.0f32; 300_007];
            let mut out = vec![0.0f32; input.len() * comm.size()];
            println!("ready");
            loop {
                if let Err(e) = comm.all_gather(&input, &mut out) {
                    eprintln!("ERROR: {e}");
                    std::process::exit(7);
                }
            }
        }
        "loop_small" | "loop_small_broadcast" => {
            // 8-byte ops on the direct path forever: a full arrival and a loose one in turn
            // (all_reduce, broadcast from rank 0), or loose ones alone (broadcasts, where the
            // root runs ahead); the parent stops one rank.
            let mut buf = vec![1.0f32; 2];
            let with_all_reduce = role == "loop_small";
            println!("ready");
            loop {
                let r = if with_all_reduce { comm.all_reduce(&mut buf, ReduceOp::Sum) } else { Ok(()) };
                let r = r.and_then(|()| comm.broadcast(&mut buf, 0));
                if let Err(e) = r {
                    eprintln!("ERROR: {e}");
                    std::process::exit(7);
                }
                buf.fill(1.0);
            }
        }
        "wait_on_last_direct" | "wait_on_last_recv" => {
            // The last rank takes part in no op (the parent kills it); the others block in
            // one that waits for it: an 8-byte all_reduce (the direct path), or a receive
            // from it (the engine over the link).
            let last = comm.size() - 1;
            println!("ready");
            if comm.rank() == last {
                std::thread::sleep(LIMIT);
                std::process::exit(0);
            }
            let mut buf = vec![1.0f32; 2];
            let r = if role == "wait_on_last_direct" {
                comm.all_reduce(&mut buf, ReduceOp::Sum)
            } else {
                comm.recv(&mut buf, last, 0)
            };
            match r {
                Ok(()) => println!("COMPLETED"),
                Err(e) => {
                    eprintln!("ERROR {:?}: {e}", e.kind());
                    std::process::exit(7);
                }
            }
        }
        "eager" => report(&comm, eager_rooted_ops(&comm)),
        "mid_all_reduce" => report(&comm, mid_all_reduce_ops(&comm)),
        "any_source" => report(&comm, crate::any_source::scenario(&comm)),
        other => panic!("unknown role {other}"),
    }
    drop(comm);
    std::process::exit(0);
}

/// Blocks (elements per rank) for the direct all_gather and reduce_scatter's chunked path:
/// exactly one f32 chunk of all_gather (and of reduce_scatter on 2 ranks), and several chunks
/// with an odd remainder.
const BIG_BLOCKS: [usize; 2] = [CHUNK_BYTES / 4, 2 * CHUNK_BYTES / 4 + 12_345];

/// Runs every case of `t` on this rank and reports; all_gather and reduce_scatter also with
/// [`BIG_BLOCKS`].
fn full_matrix(comm: &Communicator, t: CollectiveTester) {
    let mut bad = t.rank_all_reduce(comm);
    bad.extend(t.rank_rooted(comm));
    bad.extend(t.rank_gather_scatter(comm));
    bad.extend(t.rank_all_gather(comm));
    bad.extend(t.rank_reduce_scatter(comm));
    let big = t.counts(&BIG_BLOCKS).segments(&[1 << 20]);
    bad.extend(big.rank_all_gather(comm));
    bad.extend(big.rank_reduce_scatter(comm));
    report(comm, bad);
}

/// The word a rank reads from the parent test process to find out whether this host lets
/// processes read each other's memory (`process_vm_readv`), independently of oxcomm.
static PARENT_WORD: u64 = 0x5eed_cafe_f00d_0042;
const PARENT_WORD_AT: &str = "OXCOMM_TEST_PARENT_WORD";

/// Whether this rank can read [`PARENT_WORD`] in its parent (whose address the parent put in
/// [`PARENT_WORD_AT`]).
fn can_read_parent() -> bool {
    let Some(addr) = std::env::var(PARENT_WORD_AT).ok().and_then(|a| a.parse::<usize>().ok()) else { return false };
    let mut word = 0u64;
    let local = libc::iovec { iov_base: (&mut word as *mut u64).cast(), iov_len: 8 };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: 8 };
    // SAFETY: `local` is this process's `word`; the kernel checks the remote address.
    let got = unsafe { libc::process_vm_readv(libc::getppid(), &local, 1, &remote, 1, 0) };
    got == 8 && word == PARENT_WORD
}

/// Runs the "chunks" role on `n` ranks, with single copy turned on or left off (its default),
/// and checks that every rank read from its peers directly exactly when it could.
fn run_chunks(n: usize, single_copy: bool) {
    let addr = (&PARENT_WORD as *const u64 as usize).to_string();
    let mut env = vec![(PARENT_WORD_AT, addr.as_str())];
    if single_copy {
        env.push(("OXCOMM_SHM_SINGLE_COPY", "1"));
    }
    let mut job = spawn_job_with(n, "chunks", "60", &env);
    let results = job.wait_all(LIMIT);
    for (r, Exit { code, out, .. }) in results.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {r} of {n} failed:\n{out}");
        let line = out.lines().find_map(|l| l.strip_prefix("read directly ")).expect("a 'read directly' line");
        let (bytes, can) = line.split_once(" can read parent ").expect("two fields");
        let (bytes, can): (u64, bool) = (bytes.parse().unwrap(), can.parse().unwrap());
        if single_copy && can {
            assert!(bytes > 0, "rank {r} of {n} read nothing directly although it can read its parent");
        } else {
            assert_eq!(bytes, 0, "rank {r} of {n} read directly with single copy off or impossible");
        }
    }
    job.assert_clean();
}

/// Prints the failures and exits 1, or prints "rank N ok".
/// Back-to-back small rooted ops (roots rotating, values new every iteration), where a rank
/// runs up to `SLOTS - 1` (`EAGER`) direct ops ahead of the slowest, with a full op now and then: every
/// result is checked, so a slot rewritten while a peer still reads it shows as a wrong value.
fn eager_rooted_ops(comm: &Communicator) -> Vec<String> {
    let (n, me) = (comm.size(), comm.rank());
    let value = |i: usize, r: usize, j: usize| (i * 1000 + r * 10 + j) as i64;
    let mut bad = Vec::new();
    let mut expect = |what: &str, i: usize, got: &[i64], want: &[i64]| {
        if got != want && bad.len() < 5 {
            bad.push(format!("{what} #{i} on rank {me}: {got:?}, expected {want:?}"));
        }
    };
    for i in 0..600 {
        if i % 100 == 0 {
            // A burst of broadcasts while the last rank sleeps: the root runs as far ahead as
            // the slots let it, and the sleeper then reads every value it published.
            if me == n - 1 {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            for j in 0..40 {
                let mut x = [if me == 0 { value(i, j, 0) } else { -1 }];
                comm.broadcast(&mut x, 0).unwrap();
                expect("burst broadcast", i + j, &x, &[value(i, j, 0)]);
            }
        }
        let root = i % n;
        let mut buf: Vec<i64> = (0..3).map(|j| if me == root { value(i, root, j) } else { -1 }).collect();
        comm.broadcast(&mut buf, root).unwrap();
        expect("broadcast", i, &buf, &(0..3).map(|j| value(i, root, j)).collect::<Vec<_>>());

        let mine: Vec<i64> = (0..2).map(|j| value(i, me, j)).collect();
        let mut all = vec![-1i64; 2 * n];
        comm.gather(&mine, (me == root).then_some(&mut all[..]), root).unwrap();
        if me == root {
            expect("gather", i, &all, &(0..n).flat_map(|r| (0..2).map(move |j| value(i, r, j))).collect::<Vec<_>>());
        }

        let input: Vec<i64> = (0..2 * n).map(|j| value(i, j / 2, j % 2)).collect();
        let mut out = vec![-1i64; 2];
        comm.scatter((me == root).then_some(&input[..]), &mut out, root).unwrap();
        expect("scatter", i, &out, &[value(i, me, 0), value(i, me, 1)]);

        let mut sum = vec![value(i, me, 0)];
        comm.reduce(&mut sum, root, ReduceOp::Sum).unwrap();
        if me == root {
            expect("reduce", i, &sum, &[(0..n).map(|r| value(i, r, 0)).sum()]);
        }
        if i % 97 == 0 {
            let mut x = [me as i64];
            comm.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            expect("all_reduce", i, &x, &[(n * (n - 1) / 2) as i64]);
        }
    }
    bad
}

/// Back-to-back direct all-reduces of sizes that take the chunked path's rotating places
/// (`shm_direct/all_reduce.rs`, `chunk_place`) around its boundaries, odd lengths among them,
/// sizes mixed so that a half's consecutive uses differ in size and place, values new every op,
/// in place and out of place (both in one op: even ranks apart, odd in place, then swapped): a
/// place rewritten while a peer still reads it shows as a wrong value.
fn mid_all_reduce_ops(comm: &Communicator) -> Vec<String> {
    let (n, me) = (comm.size(), comm.rank());
    // f32 elements: just above the inline limit (32 KiB + 4 B), 64 KiB, 64 KiB + 4 B, one page,
    // 128 KiB, 256 KiB (two places a half), 256 KiB + 4 B (one place), just below a chunk, a
    // chunk and an odd tail (a rotating tail chunk after a full one).
    let sizes = [8193usize, 16_384, 16_385, 1031, 32_768, 65_536, 65_537, 131_071, 131_072 + 3001];
    let value = |i: usize, r: usize, j: usize| ((i * 7 + r * 13 + j) % 1009) as f32;
    let mut bad = Vec::new();
    for i in 0..60 {
        let count = sizes[(i * 5 + i / sizes.len()) % sizes.len()];
        let input: Vec<f32> = (0..count).map(|j| value(i, me, j)).collect();
        let want: Vec<f32> = (0..count).map(|j| (0..n).map(|r| value(i, r, j)).sum()).collect();
        let apart = (me + i) % 2 == 0;
        let got = if apart {
            let mut out = vec![-1.0f32; count];
            comm.all_reduce_into(&input, &mut out, ReduceOp::Sum).unwrap();
            out
        } else {
            let mut buf = input;
            comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            buf
        };
        if let Some(j) = (0..count).find(|&j| got[j] != want[j]) {
            if bad.len() < 5 {
                let how = if apart { "out of place" } else { "in place" };
                bad.push(format!(
                    "all_reduce #{i} of {count} f32 {how} on rank {me}: [{j}] = {}, expected {}",
                    got[j], want[j]
                ));
            }
        }
    }
    bad
}

fn report(comm: &Communicator, bad: Vec<String>) {
    if !bad.is_empty() {
        eprintln!("{} failures, first: {:#?}", bad.len(), &bad[..bad.len().min(5)]);
        std::process::exit(1);
    }
    println!("rank {} ok", comm.rank());
}

fn run_tester(n: usize, role: &str) {
    run_tester_with(n, role, &[]);
}

fn run_tester_with(n: usize, role: &str, env: &[(&str, &str)]) {
    expect_success(spawn_job_with(n, role, "60", env), role);
}

/// Waits for every rank of `job` (running `role`), requires each to exit 0, and that the job
/// left nothing behind.
fn expect_success(mut job: Job, role: &str) {
    let results = job.wait_all(LIMIT);
    let n = results.len();
    for (r, Exit { code, out, .. }) in results.iter().enumerate() {
        assert_eq!(*code, Some(0), "{role}: rank {r} of {n} failed:\n{out}");
    }
    job.assert_clean();
}

#[test]
fn shm_back_to_back_small_rooted_ops_2_ranks() {
    run_tester(2, "eager");
}

#[test]
fn shm_back_to_back_small_rooted_ops_3_ranks() {
    run_tester(3, "eager");
}

#[test]
fn shm_back_to_back_small_rooted_ops_5_ranks_on_2_cores() {
    run_tester(5, "eager");
}

#[test]
fn shm_mid_all_reduce_places_2_ranks() {
    run_tester(2, "mid_all_reduce");
}

#[test]
fn shm_mid_all_reduce_places_3_ranks() {
    run_tester(3, "mid_all_reduce");
}

#[test]
fn shm_collectives_2_ranks() {
    run_tester(2, "tester");
}

#[test]
fn shm_collectives_3_ranks() {
    run_tester(3, "tester");
}

#[test]
fn shm_collectives_4_ranks() {
    run_tester(4, "tester");
}

#[test]
fn shm_chunked_rooted_and_movement_with_single_copy_2_ranks() {
    run_chunks(2, true);
}

#[test]
fn shm_chunked_rooted_and_movement_with_single_copy_3_ranks() {
    run_chunks(3, true);
}

#[test]
fn shm_chunked_rooted_and_movement_with_single_copy_4_ranks() {
    run_chunks(4, true);
}

#[test]
fn shm_chunked_rooted_and_movement_2_ranks() {
    run_chunks(2, false);
}

#[test]
fn shm_chunked_rooted_and_movement_3_ranks() {
    run_chunks(3, false);
}

#[test]
fn shm_mid_sizes_move_part_by_part_2_ranks() {
    run_tester(2, "parts");
}

#[test]
fn shm_mid_sizes_move_part_by_part_3_ranks() {
    run_tester(3, "parts");
}

#[test]
fn shm_mid_sizes_move_part_by_part_with_single_copy_2_ranks() {
    run_tester_with(2, "parts", &[("OXCOMM_SHM_SINGLE_COPY", "1")]);
}

#[test]
fn shm_mid_sizes_by_whole_chunks_where_ranks_share_cores_2_ranks() {
    // Waits that do not spin are how the transport says ranks share cores: readers then wait
    // for each writer's whole chunk, and the copy-in does not stream (whatever this host has).
    run_tester_with(2, "parts", &[("OXCOMM_SHM_SPIN_US", "0")]);
}

#[test]
fn shm_large_chunk_steps_stream_their_copy_in_where_cores_are_far_2_ranks() {
    // Streamed copy-ins of whole chunks (what a rank does while the cores look far apart),
    // with single copy off so all_gather and all_to_all take the chunks too.
    run_tester_with(2, "stream_in", &[("OXCOMM_SHM_STREAM_IN", "always"), ("OXCOMM_SHM_SINGLE_COPY", "0")]);
}

#[test]
fn shm_large_chunk_steps_stream_their_copy_in_where_cores_are_far_3_ranks() {
    run_tester_with(3, "stream_in", &[("OXCOMM_SHM_STREAM_IN", "always"), ("OXCOMM_SHM_SINGLE_COPY", "0")]);
}

#[test]
fn shm_large_chunk_steps_with_plain_copy_in_2_ranks() {
    run_tester_with(2, "stream_in", &[("OXCOMM_SHM_STREAM_IN", "never"), ("OXCOMM_SHM_SINGLE_COPY", "0")]);
}

#[test]
fn shm_streamed_copy_out_of_large_outputs_2_ranks() {
    run_tester(2, "streaming");
}

#[test]
fn shm_chunked_rooted_and_movement_8_ranks_on_2_cores() {
    run_tester(8, "chunks_f32");
}

#[test]
fn shm_collectives_8_ranks_on_2_cores() {
    run_tester(8, "quick");
}

#[test]
fn new_dtypes_over_shm() {
    run_tester(3, "dtypes");
}

#[test]
fn mixed_shm_and_tcp_2_simulated_hosts_of_2_ranks() {
    run_on_two_hosts("hosts");
}

/// Runs `role` on 4 ranks, 2 per simulated host: rank r claims host identity
/// `OXCOMM_HOST_ID`, and ranks with different ids talk over TCP on loopback, as if on other
/// hosts.
fn run_on_two_hosts(role: &str) {
    let hosts = ["host-a", "host-a", "host-b", "host-b"];
    let spec = Job::of("multiproc::child_entry", role, 4, "60");
    expect_success(
        hosts.iter().enumerate().fold(spec, |spec, (r, h)| spec.rank_env(r, "OXCOMM_HOST_ID", h)).spawn(),
        role,
    );
}

#[test]
fn recv_from_any_source_over_shm_3_ranks() {
    run_tester(3, "any_source");
}

#[test]
fn recv_from_any_source_over_tcp_4_ranks() {
    run_tester_with(4, "any_source", &[("OXCOMM_TRANSPORT", "tcp")]);
}

#[test]
fn recv_from_any_source_over_shm_and_tcp_2_hosts_of_2_ranks() {
    run_on_two_hosts("any_source");
}

#[test]
fn tcp_collectives_3_processes_on_loopback() {
    run_tester_with(3, "quick", &[("OXCOMM_TRANSPORT", "tcp")]);
}

/// Waits until the ranks are inside their op loop.
fn wait_ready(job: &mut Job, settle: Duration) {
    // The loop prints "ready" before its first op; give the ops time to get going.
    std::thread::sleep(settle);
    job.assert_running();
}

#[test]
fn killed_rank_is_named_by_every_survivor_within_2s() {
    killed_rank_is_named(4, "loop", 2);
}

#[test]
fn killed_rank_mid_direct_all_to_all_is_named_by_every_survivor() {
    killed_rank_is_named(3, "loop_all_to_all", 1);
}

/// Kills `victim` of `n` ranks running `role` mid-op; every survivor must fail naming it
/// within 2 s.
fn killed_rank_is_named(n: usize, role: &str, victim: usize) {
    let mut job = spawn_job(n, role, "60");
    wait_ready(&mut job, Duration::from_millis(1500));
    let killed_at = Instant::now();
    job.signal(victim, libc::SIGKILL);
    let results = job.wait_all(Duration::from_secs(20));
    let took = killed_at.elapsed();
    for (r, Exit { code, out, .. }) in results.iter().enumerate() {
        if r == victim {
            continue;
        }
        assert_eq!(*code, Some(7), "rank {r}:\n{out}");
        assert!(out.contains(&format!("rank {victim}")), "rank {r} does not name rank {victim}:\n{out}");
    }
    assert!(took < Duration::from_secs(2), "survivors took {took:?}");
    assert!(job.leftovers().is_empty(), "segments left: {:?}", job.leftovers());
}

#[test]
fn killed_root_mid_direct_broadcast_is_named_by_every_survivor_within_2s() {
    // The others wait for the root's next part.
    killed_rank_is_named(3, "loop_broadcast", 0);
}

#[test]
fn killed_rank_mid_direct_all_gather_is_named_by_every_survivor_within_2s() {
    killed_rank_is_named(4, "loop_all_gather", 2);
}

/// Issue 39: a SIGKILLed shared-memory peer is named by the survivors blocked in an op on it
/// at once, through the death watcher (a pidfd per peer process), not at their next periodic
/// peer check: with that check set to 10 minutes (`OXCOMM_PEER_CHECK_MS`) and the op timeout
/// to 20 s, only the watcher can make the survivors fail with the peer's death; without it
/// they time out (and this fails on the error's kind, not on a clock).
fn killed_peer_is_named_without_the_periodic_check(role: &str) {
    let env = [("OXCOMM_PEER_CHECK_MS", "600000")];
    let mut job = spawn_job_with(3, role, "20", &env);
    for r in 0..3 {
        job.wait_line(r, Duration::from_secs(60), |l| l == "ready");
    }
    // Let the survivors get into their wait (either way, only the watcher can tell them).
    std::thread::sleep(Duration::from_millis(200));
    job.signal(2, libc::SIGKILL);
    let survivors = job.wait_ranks(&[0, 1], Duration::from_secs(60));
    for (r, Exit { code, out, .. }) in [0, 1].into_iter().zip(&survivors) {
        assert_eq!(*code, Some(7), "rank {r}:\n{out}");
        assert!(
            out.contains("ERROR PeerGone") && out.contains("rank 2"),
            "rank {r} does not name the dead rank 2:\n{out}"
        );
    }
    job.wait_all(Duration::from_secs(20));
    assert!(job.leftovers().is_empty(), "segments left: {:?}", job.leftovers());
}

#[test]
fn issue39_killed_peer_is_named_at_once_by_a_direct_all_reduce() {
    killed_peer_is_named_without_the_periodic_check("wait_on_last_direct");
}

#[test]
fn issue39_killed_peer_is_named_at_once_by_a_recv_over_the_link() {
    killed_peer_is_named_without_the_periodic_check("wait_on_last_recv");
}

/// A rank stopped while the others run 8-byte direct ops (which read no clock of their own
/// and stamp their heartbeat once per tick of the coarse clock unless they wait): every
/// survivor still times out at its deadline naming the stopped rank and the op it was in.
#[test]
fn stopped_rank_mid_small_direct_ops_times_out_naming_it_and_the_op() {
    stopped_rank_is_named("loop_small", &["all_reduce #", "broadcast #"]);
}

/// As above with broadcasts alone: the root runs ahead and waits for the stopped rank, and
/// the third rank waits for the root, which is alive and stamps its heartbeat as it waits, so
/// the stopped rank is named by its stale heartbeat (or by the root's verdict).
#[test]
fn stopped_rank_mid_small_direct_broadcasts_times_out_naming_it() {
    stopped_rank_is_named("loop_small_broadcast", &["all_reduce #", "broadcast #"]);
}

/// Stops rank 1 of 3 running `role` (deadline 2 s): both survivors exit by themselves within
/// the deadline + 4 s, naming rank 1 and, when `ops` is not empty, one of `ops` (`"all_reduce #"`).
/// The stopped one is killed when the job is dropped.
fn stopped_rank_is_named(role: &str, ops: &[&str]) {
    let mut job = spawn_job(3, role, "2");
    wait_ready(&mut job, Duration::from_millis(1500));
    let victim = 1;
    let stopped_at = Instant::now();
    job.signal(victim, libc::SIGSTOP);
    let survivors = job.wait_ranks(&[0, 2], Duration::from_secs(15));
    for (r, Exit { code, out, .. }) in [0, 2].into_iter().zip(&survivors) {
        assert_eq!(*code, Some(7), "rank {r}: {out}");
        assert!(out.contains("timed out") && out.contains("rank 1"), "rank {r}: {out}");
        assert!(ops.is_empty() || ops.iter().any(|op| out.contains(op)), "rank {r} names none of {ops:?}: {out}");
    }
    let took = stopped_at.elapsed();
    assert!(took >= Duration::from_millis(1500) && took < Duration::from_secs(6), "took {took:?}");
}

#[test]
fn stopped_rank_times_out_at_the_deadline_naming_it() {
    stopped_rank_is_named("loop", &[]);
}
