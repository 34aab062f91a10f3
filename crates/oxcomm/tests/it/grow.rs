//! Growing back (issue 39, item 4): `Communicator::grow` on the members and `Init::join` on
//! the newcomers, on thread ranks that meet through an in-memory store (over shared memory
//! and over TCP) and on ranks that are processes (shm, TCP, shm+TCP), where a SIGKILLed rank
//! is replaced by a new process that joins: kill → shrink → grow back → right sums on the full
//! size; two grows in a row; a newcomer that never comes (the members time out naming its
//! rank); and the errors a grow or join must give before anything is sent.

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use oxcomm::rendezvous::{InMemoryStore, Store, TransportChoice};
use oxcomm::{threads, CommConfig, Communicator, ErrorKind, Init, ReduceOp};

use crate::harness::{self, Job};

/// Rank `rank` of `size` of the thread job `job` on `store`, op deadline `timeout_ms`.
fn init(rank: usize, size: usize, job: &str, transport: TransportChoice, timeout_ms: u64) -> Init {
    Init {
        rank,
        world_size: size,
        store_addr: "127.0.0.1:1".parse().unwrap(),
        store_served: true,
        token: vec![7; 32],
        job: job.to_owned(),
        transport,
        config: CommConfig { timeout: Duration::from_millis(timeout_ms), ..CommConfig::default() },
        host_id: Some("one-host".into()),
        socket_ifname: None,
        socket_addr: Some("127.0.0.1".parse().unwrap()),
        pin_to_core: false,
    }
}

/// `[rank + 1; 3]` summed over `comm`, checked against 1 + 2 + … + size.
fn sum_ok(comm: &Communicator) -> oxcomm::Result<()> {
    let mut v = [comm.rank() as f64 + 1.0; 3];
    comm.all_reduce(&mut v, ReduceOp::Sum)?;
    let n = comm.size() as f64;
    assert_eq!(v, [n * (n + 1.0) / 2.0; 3], "rank {} of {}", comm.rank(), comm.size());
    Ok(())
}

/// Runs all-reduces until one fails (a member left); panics if none does within 30 s.
fn until_failure(comm: &Communicator) -> oxcomm::Error {
    let start = Instant::now();
    loop {
        if let Err(e) = sum_ok(comm) {
            return e;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "rank {}: no failure", comm.rank());
    }
}

/// One round on a communicator of 4: the rank `leaving` leaves (drops it), the others find
/// out, shrink to 3, grow back to 4 (a newcomer takes rank 3) and check the sums. Returns the
/// grown communicator, or `None` on the rank that left.
fn leave_shrink_grow(comm: Communicator, leaving: usize) -> Option<Communicator> {
    if comm.rank() == leaving {
        sum_ok(&comm).unwrap();
        return None;
    }
    // The leaver may go while this rank still finishes the first op: that one may fail too.
    if sum_ok(&comm).is_ok() {
        until_failure(&comm);
    }
    let small = comm.shrink().unwrap();
    assert_eq!(comm.failed_ranks(), vec![leaving]);
    assert_eq!(small.size(), 3);
    let grown = small.grow(4).unwrap();
    assert_eq!((grown.rank(), grown.size()), (small.rank(), 4), "members keep their rank order");
    for _ in 0..20 {
        sum_ok(&grown).unwrap();
    }
    Some(grown)
}

/// Four thread ranks: rank 3 leaves and a newcomer joins (generation 1), then rank 1 leaves
/// and a second newcomer joins (generation 2). The second newcomer starts only after the
/// first grow ended, and must skip generation 1 (closed) for generation 2.
fn leave_and_grow_back_twice(transport: TransportChoice) {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let job = harness::job_id("gt");
    let (first_done, first_grown) = mpsc::channel();
    let members: Vec<_> = (0..4)
        .map(|r| {
            let (store, job, first_done) = (store.clone(), job.clone(), first_done.clone());
            std::thread::spawn(move || {
                let comm = init(r, 4, &job, transport, 30_000).connect_with_store(store).unwrap();
                let grown = leave_shrink_grow(comm, 3)?;
                first_done.send(()).unwrap();
                leave_shrink_grow(grown, 1).map(|c| c.rank())
            })
        })
        .collect();
    let newcomer = move |store: Arc<dyn Store>, job: String| {
        std::thread::spawn(move || {
            let comm = init(99, 99, &job, transport, 30_000).join_with_store(store).unwrap();
            assert_eq!((comm.rank(), comm.size()), (3, 4));
            for _ in 0..20 {
                sum_ok(&comm).unwrap();
            }
            comm
        })
    };
    // The first newcomer is there before any grow opens: it waits for generation 1.
    let first = newcomer(store.clone(), job.clone());
    let comm = first.join().unwrap();
    let second = std::thread::spawn({
        let (store, job) = (store.clone(), job.clone());
        move || {
            for _ in 0..3 {
                first_grown.recv_timeout(Duration::from_secs(30)).unwrap();
            }
            newcomer(store, job).join().unwrap().rank()
        }
    });
    // The first newcomer takes part in the second round as rank 3, and ends as rank 2.
    assert_eq!(leave_shrink_grow(comm, 1).map(|c| c.rank()), Some(2));
    let ranks: Vec<Option<usize>> = members.into_iter().map(|h| h.join().unwrap()).collect();
    // Old 0, 1, 2 (3 left) → 0, 1, 2; then 1 left: old 0 → 0, old 2 → 1 (its rank 2 → 1).
    assert_eq!(ranks, vec![Some(0), None, Some(1), None]);
    assert_eq!(second.join().unwrap(), 3);
    assert!(harness::leftovers(&job).is_empty());
}

#[test]
fn issue39_grow_back_twice_over_shm() {
    leave_and_grow_back_twice(TransportChoice::Shm);
}

#[test]
fn issue39_grow_back_twice_over_tcp() {
    leave_and_grow_back_twice(TransportChoice::Tcp);
}

#[test]
fn issue39_a_newcomer_that_never_comes_is_named_by_every_member() {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let job = harness::job_id("gn");
    let out: Vec<_> = (0..3)
        .map(|r| {
            let (store, job) = (store.clone(), job.clone());
            std::thread::spawn(move || {
                let comm = init(r, 3, &job, TransportChoice::Tcp, 1500).connect_with_store(store).unwrap();
                let t = Instant::now();
                (comm.grow(4).unwrap_err(), t.elapsed())
            })
        })
        .collect();
    for (r, h) in out.into_iter().enumerate() {
        let (e, took) = h.join().unwrap();
        assert_eq!((e.kind(), e.peer()), (ErrorKind::Timeout, Some(3)), "rank {r}: {e}");
        assert!(e.to_string().contains("grow to 4 ranks"), "rank {r}: {e}");
        assert!(e.to_string().contains("waiting for newcomer rank 3"), "rank {r}: {e}");
        assert!(took < Duration::from_secs(10), "rank {r} took {took:?}");
    }
}

/// A grow that timed out closed its generation; the members' next grow opens the next one,
/// where a newcomer that came late joins (it skips the closed one). Before, the retry reopened
/// the closed generation: the newcomer waited for the next, the members for it, until both
/// timed out.
#[test]
fn issue39_a_grow_tried_again_after_a_timeout_meets_a_late_newcomer() {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let job = harness::job_id("gr");
    let (timed_out, late) = mpsc::channel();
    let members: Vec<_> = (0..2)
        .map(|r| {
            let (store, job, timed_out) = (store.clone(), job.clone(), timed_out.clone());
            std::thread::spawn(move || {
                let comm = init(r, 2, &job, TransportChoice::Tcp, 1000).connect_with_store(store).unwrap();
                assert_eq!(comm.grow(3).unwrap_err().peer(), Some(2));
                timed_out.send(()).unwrap();
                comm.set_timeout(Duration::from_secs(30));
                let grown = comm.grow(3).unwrap();
                sum_ok(&grown).unwrap();
                grown.rank()
            })
        })
        .collect();
    for _ in 0..2 {
        late.recv_timeout(Duration::from_secs(30)).unwrap();
    }
    let newcomer = init(99, 99, &job, TransportChoice::Tcp, 30_000).join_with_store(store).unwrap();
    sum_ok(&newcomer).unwrap();
    assert_eq!((newcomer.rank(), newcomer.size()), (2, 3));
    let ranks: Vec<usize> = members.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(ranks, vec![0, 1]);
}

#[test]
fn issue39_grow_and_join_reject_bad_input_before_sending_anything() {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let job = harness::job_id("gb");
    let grow_keys = |g: &str| store.try_get(&format!("oxcomm/{job}/grow/{g}")).unwrap();
    let out: Vec<_> = (0..2)
        .map(|r| {
            let (store, job) = (store.clone(), job.clone());
            std::thread::spawn(move || {
                let comm = init(r, 2, &job, TransportChoice::Shm, 10_000).connect_with_store(store).unwrap();
                let e = comm.grow(1).unwrap_err();
                comm.barrier().unwrap(); // not revoked, nothing sent
                e
            })
        })
        .collect();
    for h in out {
        let e = h.join().unwrap();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("fewer than the communicator's 2"), "{e}");
    }
    assert_eq!((grow_keys("1"), grow_keys("latest")), (None, None), "a bad grow opened a generation");
    // A newcomer for whom no grow opens times out saying so, having claimed nothing.
    let t = Instant::now();
    let e = init(0, 1, &job, TransportChoice::Shm, 300).join_with_store(store.clone()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.to_string().contains("no grow with a free rank opened"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(grow_keys("1/claimed"), None);
}

#[test]
fn issue39_grow_of_a_world_met_without_a_store_or_of_a_group_is_unsupported() {
    threads::run(2, |comm| {
        let e = comm.grow(3).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        assert!(e.to_string().contains("without a store"), "{e}");
        let g = comm.new_group(&[0, 1]).unwrap().unwrap();
        assert_eq!(g.grow(3).unwrap_err().kind(), ErrorKind::Unsupported);
        comm.barrier().unwrap();
    })
    .unwrap();
}

// ---------------------------------------------------------------------------------------------
// Ranks as processes: a killed rank replaced by a new process
// ---------------------------------------------------------------------------------------------

/// How long a scenario may take.
const LIMIT: Duration = Duration::from_secs(60);

/// Entry point of the child ranks. It does nothing in a normal test run (no role set).
#[test]
fn child_entry() {
    let Some(role) = harness::role() else { return };
    assert_eq!(role, "grow");
    let code = if std::env::var("OXCOMM_TEST_JOIN").is_ok() { newcomer() } else { member() };
    std::process::exit(code)
}

/// A member: all-reduces until one fails (the parent kills rank 2), shrinks, grows back to 4.
fn member() -> i32 {
    let comm = harness::init_child();
    let mut done = 0u64;
    let err = loop {
        if done == 200 {
            println!("READY");
        }
        match sum_ok(&comm) {
            Ok(()) => done += 1,
            Err(e) => break e,
        }
    };
    let since = Instant::now();
    println!("FAILED {err}");
    let small = match comm.shrink() {
        Ok(s) => s,
        Err(e) => {
            println!("SHRINK FAILED {e}");
            return 6;
        }
    };
    println!("SHRUNK size={} failed={:?}", small.size(), comm.failed_ranks());
    match small.grow(4) {
        Ok(grown) => after_grow(&grown, since),
        Err(e) => {
            println!("GROW FAILED {e}");
            6
        }
    }
}

/// A newcomer: joins, then does what the members do on the grown communicator.
fn newcomer() -> i32 {
    match oxcomm::join() {
        Ok(grown) => after_grow(&grown, Instant::now()),
        Err(e) => {
            println!("JOIN FAILED {e}");
            7
        }
    }
}

fn after_grow(grown: &Communicator, since: Instant) -> i32 {
    println!("GROWN rank={} size={} ms={}", grown.rank(), grown.size(), since.elapsed().as_millis());
    for _ in 0..20 {
        if let Err(e) = sum_ok(grown) {
            println!("GROWN OP FAILED {e}");
            return 6;
        }
    }
    match grown.barrier() {
        Ok(()) => 0,
        Err(e) => {
            println!("BARRIER FAILED {e}");
            6
        }
    }
}

/// Four ranks (`host_of` rank's host id, if any); rank 2 is SIGKILLed in the loop; once the
/// survivors have shrunk, a new process joins (on rank 2's host); all four end with right
/// sums, the members keeping their order.
fn kill_shrink_grow(transport: Option<&str>, host_of: Option<fn(usize) -> &'static str>) {
    let mut spec = Job::of("grow::child_entry", "grow", 4, "60");
    if let Some(t) = transport {
        spec = spec.env("OXCOMM_TRANSPORT", t);
    }
    if let Some(host) = host_of {
        for r in 0..4 {
            spec = spec.rank_env(r, "OXCOMM_HOST_ID", host(r));
        }
    }
    let mut job = spec.spawn();
    job.wait_line(2, LIMIT, |l| l == "READY");
    job.signal(2, libc::SIGKILL);
    job.wait_line(0, LIMIT, |l| l.starts_with("SHRUNK "));
    // The rank it replaces, as `oxcomm launch --on-failure restart` says (join does not use it).
    let mut env = vec![("OXCOMM_TEST_JOIN", "1"), ("RANK", "2"), ("LOCAL_RANK", "2")];
    if let Some(host) = host_of {
        env.push(("OXCOMM_HOST_ID", host(2)));
    }
    let newcomer = job.spawn_extra(&env);
    let exits = job.wait_all(LIMIT);
    for (who, want) in [(0, 0), (1, 1), (3, 2), (newcomer, 3)] {
        let e = &exits[who];
        assert_eq!(e.code, Some(0), "process {who}:\n{}", e.out);
        assert!(e.out.contains(&format!("GROWN rank={want} size=4 ")), "process {who}:\n{}", e.out);
    }
    for who in [0, 1, 3] {
        assert!(exits[who].out.contains("SHRUNK size=3 failed=[2]"), "process {who}:\n{}", exits[who].out);
        // From the failed op to the grown communicator (shown with --nocapture).
        let grown = exits[who].out.lines().find(|l| l.starts_with("GROWN ")).unwrap_or_default();
        println!("member {who}: {grown}");
    }
    job.assert_clean();
}

mod issue39_kill_shrink_grow_back {
    use super::*;

    #[test]
    fn shm() {
        kill_shrink_grow(None, None);
    }

    #[test]
    fn tcp() {
        kill_shrink_grow(Some("tcp"), None);
    }

    #[test]
    fn shm_tcp() {
        kill_shrink_grow(None, Some(|r| if r < 2 { "host-a" } else { "host-b" }));
    }
}
