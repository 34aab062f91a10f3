//! Tests of the shared-memory transport (`oxcomm::transport::shm`): ranks are threads of this
//! process (each with its own segment), plus one test with a real child process.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use oxcomm::transport::shm::{segment_name, ShmConfig, ShmEndpoint};
use oxcomm::transport::{Doorbell, Link};
use oxcomm::{Error, ErrorKind, Result};

/// Environment variable that turns [`child_process_role`] into the child of
/// [`bytes_cross_a_real_process_boundary`]; its value is the job name.
const CHILD_ENV: &str = "OXCOMM_TEST_SHM_CHILD_JOB";

/// A job name unique to this process and call, so parallel tests never collide.
fn job(tag: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!("t{}-{tag}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Files in /dev/shm that belong to `job`.
fn leftovers(job: &str) -> Vec<String> {
    let prefix = format!("oxcomm-{job}-");
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

type Parts = (Vec<Option<Box<dyn Link>>>, Arc<dyn Doorbell>);

/// Sets up a full shm mesh of `world` thread ranks and returns each rank's links and bell.
fn mesh(job: &str, world: usize, config: &ShmConfig) -> Vec<Parts> {
    let barrier = Arc::new(Barrier::new(world));
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let (job, config, barrier) = (job.to_string(), config.clone(), barrier.clone());
            std::thread::spawn(move || {
                let peers: Vec<usize> = (0..world).filter(|&p| p != r).collect();
                let mut ep = ShmEndpoint::create(&job, r, world, &peers, &config).unwrap();
                let deadline = Instant::now() + Duration::from_secs(10);
                ep.attach(&peers, deadline).unwrap();
                if r % 2 == 0 {
                    barrier.wait(); // everyone attached (the caller's store, in real use)
                } else {
                    ep.wait_attached(&peers, deadline).unwrap();
                    barrier.wait();
                }
                ep.unlink_own().unwrap();
                ep.into_parts()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// A deterministic byte stream per (from, to): `pattern()[(i + offset) % len]`.
fn pattern() -> &'static [u8] {
    static P: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    P.get_or_init(|| {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        (0..1_000_003)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    })
}

fn stream_offset(from: usize, to: usize) -> usize {
    (from * 7919 + to * 104_729) % pattern().len()
}

/// Bytes `[at, at + len)` of the stream `from → to` (len ≤ pattern length).
fn stream_bytes(from: usize, to: usize, at: usize, len: usize, out: &mut Vec<u8>) {
    let p = pattern();
    out.clear();
    let mut i = (at + stream_offset(from, to)) % p.len();
    while out.len() < len {
        let take = (len - out.len()).min(p.len() - i);
        out.extend_from_slice(&p[i..i + take]);
        i = 0;
    }
}

/// A tiny seeded generator for chunk sizes.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

fn timeout(what: &str) -> Error {
    Error::new(ErrorKind::Timeout, format!("test timed out: {what}"))
}

/// Moves `total` bytes of each stream `rank → p` and checks every byte of `p → rank`, for
/// all peers at once, with random chunk sizes; sleeps on the doorbell when nothing moves.
fn exchange(
    rank: usize,
    links: &mut [Option<Box<dyn Link>>],
    bell: &dyn Doorbell,
    total: usize,
    max_chunk: usize,
    seed: u64,
) -> Result<()> {
    let world = links.len();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut sent = vec![0usize; world];
    let mut got = vec![0usize; world];
    let mut rng = Rng(seed | 1);
    let (mut out, mut want) = (Vec::new(), Vec::new());
    let mut inbox = vec![0u8; max_chunk];
    loop {
        let epoch = bell.epoch();
        let mut moved = false;
        let mut done = true;
        for p in 0..world {
            let Some(link) = links[p].as_mut() else {
                continue;
            };
            if sent[p] < total {
                let len = (1 + rng.below(max_chunk)).min(total - sent[p]);
                stream_bytes(rank, p, sent[p], len, &mut out);
                let n = link.try_send(&out)?;
                sent[p] += n;
                moved |= n > 0;
            }
            if got[p] < total {
                let len = (1 + rng.below(max_chunk)).min(total - got[p]);
                let n = if rng.below(2) == 0 {
                    link.try_recv(&mut inbox[..len])?
                } else {
                    let mut at = 0;
                    let n = link.recv_with(len, &mut |c| {
                        inbox[at..at + c.len()].copy_from_slice(c);
                        at += c.len();
                    })?;
                    assert_eq!(at, n);
                    n
                };
                stream_bytes(p, rank, got[p], n, &mut want);
                assert!(inbox[..n] == want[..], "rank {rank}: bytes from {p} at {} differ", got[p]);
                got[p] += n;
                moved |= n > 0;
            }
            done &= sent[p] == total && got[p] == total;
        }
        if done {
            return Ok(());
        }
        if !moved {
            if Instant::now() >= deadline {
                return Err(timeout("exchange"));
            }
            // Only peers we still wait on: a finished peer may have dropped its links.
            for (p, link) in links.iter_mut().enumerate() {
                if let Some(link) = link.as_mut().filter(|_| sent[p] < total || got[p] < total) {
                    link.check_peer()?;
                }
            }
            bell.wait(epoch, deadline);
        }
    }
}

fn run_exchange(world: usize, ring_bytes: usize, total: usize, max_chunk: usize) {
    let job = job("x");
    let config = ShmConfig { ring_bytes, ..ShmConfig::default() };
    let parts = mesh(&job, world, &config);
    assert!(leftovers(&job).is_empty(), "names unlinked after setup");
    let handles: Vec<_> = parts
        .into_iter()
        .enumerate()
        .map(|(r, (mut links, bell))| {
            std::thread::spawn(move || {
                exchange(r, &mut links, &*bell, total, max_chunk, 1 + r as u64).unwrap();
                assert!(links.iter().flatten().all(|l| l.kind() == oxcomm::Transport::Shm));
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert!(leftovers(&job).is_empty());
}

#[test]
fn ring_wraps_with_random_chunk_sizes() {
    // A 4 KiB ring and chunks up to 3000 bytes: wraps hundreds of times at odd offsets.
    run_exchange(2, 4096, 1 << 20, 3000);
}

#[test]
fn two_ranks_stream_many_mib_in_order() {
    run_exchange(2, 1 << 20, 48 << 20, 256 << 10);
}

#[test]
fn four_ranks_all_to_all() {
    run_exchange(4, 64 << 10, 4 << 20, 20_000);
}

#[test]
fn eight_ranks_share_few_cores_without_starving() {
    // More ranks than cores: waits must yield and sleep, not spin the peers off the CPU.
    let t0 = Instant::now();
    run_exchange(8, 16 << 10, 512 << 10, 9000);
    assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
}

#[test]
fn doorbell_wait_times_out_at_its_deadline() {
    let job = job("bell");
    let mut parts = mesh(&job, 2, &ShmConfig::default());
    let (_links, bell) = parts.remove(0);
    let epoch = bell.epoch();
    let t0 = Instant::now();
    bell.wait(epoch, t0 + Duration::from_millis(300));
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took <= Duration::from_millis(500),
        "waited {took:?} for a 300 ms deadline"
    );
}

#[test]
fn doorbell_wakes_promptly_when_a_peer_sends() {
    let job = job("wake");
    let mut parts = mesh(&job, 2, &ShmConfig::default());
    let (mut links1, _bell1) = parts.pop().unwrap();
    let (_links0, bell0) = parts.pop().unwrap();
    let epoch = bell0.epoch();
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        let sent_at = Instant::now();
        assert_eq!(links1[0].as_mut().unwrap().try_send(b"hi").unwrap(), 2);
        (sent_at, links1)
    });
    let t0 = Instant::now();
    bell0.wait(epoch, t0 + Duration::from_secs(10));
    let woke_at = Instant::now();
    let (sent_at, _links1) = sender.join().unwrap();
    assert_ne!(bell0.epoch(), epoch);
    let late = woke_at.saturating_duration_since(sent_at);
    assert!(late < Duration::from_millis(200), "woke {late:?} after the ring");
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn peer_that_closed_its_link_is_reported_gone_after_its_bytes() {
    let job = job("gone");
    let mut parts = mesh(&job, 2, &ShmConfig::default());
    let (mut links1, _bell1) = parts.pop().unwrap();
    let (mut links0, _bell0) = parts.pop().unwrap();
    let to0 = links1[0].as_mut().unwrap();
    assert_eq!(to0.try_send(b"last words").unwrap(), 10);
    drop(links1);

    let from1 = links0[1].as_mut().unwrap();
    from1.check_peer().unwrap(); // bytes still queued: not gone yet
    let mut buf = [0u8; 64];
    assert_eq!(from1.try_recv(&mut buf).unwrap(), 10);
    assert_eq!(&buf[..10], b"last words");
    let err = from1.check_peer().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PeerGone);
    assert_eq!(err.peer(), Some(1));
    assert!(err.to_string().contains("rank 1"), "{err}");
    assert_eq!(from1.try_recv(&mut buf).unwrap_err().kind(), ErrorKind::PeerGone);
    assert_eq!(from1.try_send(b"x").unwrap_err().kind(), ErrorKind::PeerGone);
}

#[test]
fn foreign_segment_is_rejected() {
    let job = job("foreign");
    // Rank 1's name holds garbage of a plausible size.
    let path = format!("/dev/shm{}", segment_name(&job, 1));
    std::fs::write(&path, vec![0xABu8; 8192]).unwrap();
    let mut ep = ShmEndpoint::create(&job, 0, 2, &[1], &ShmConfig::default()).unwrap();
    let err = ep.attach(&[1], Instant::now() + Duration::from_secs(5)).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    assert!(err.to_string().contains("magic"), "{err}");
    assert_eq!(err.peer(), Some(1));
    drop(ep);
    assert!(leftovers(&job).is_empty());
}

#[test]
fn segment_of_another_world_is_rejected() {
    let job = job("world");
    let other = ShmEndpoint::create(&job, 1, 3, &[0], &ShmConfig::default()).unwrap();
    let mut ep = ShmEndpoint::create(&job, 0, 2, &[1], &ShmConfig::default()).unwrap();
    let err = ep.attach(&[1], Instant::now() + Duration::from_secs(5)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    assert!(err.to_string().contains("world size 3, expected 2"), "{err}");
    drop((other, ep));
    assert!(leftovers(&job).is_empty());
}

#[test]
fn stale_segment_of_a_dead_process_is_rejected() {
    let job = job("stale");
    // A valid segment, saved, with its owner pid replaced by one that has exited.
    let seg = ShmEndpoint::create(&job, 1, 2, &[0], &ShmConfig::default()).unwrap();
    let path = format!("/dev/shm{}", segment_name(&job, 1));
    let mut bytes = std::fs::read(&path).unwrap();
    drop(seg);
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = child.id();
    child.wait().unwrap();
    bytes[32..40].copy_from_slice(&u64::from(dead_pid).to_le_bytes()); // Header::owner_pid
    std::fs::write(&path, &bytes).unwrap();

    let mut ep = ShmEndpoint::create(&job, 0, 2, &[1], &ShmConfig::default()).unwrap();
    let err = ep.attach(&[1], Instant::now() + Duration::from_secs(5)).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    assert!(err.to_string().contains("not running"), "{err}");
}

#[test]
fn existing_name_is_a_clear_error() {
    let job = job("exists");
    let first = ShmEndpoint::create(&job, 0, 2, &[1], &ShmConfig::default()).unwrap();
    let err = ShmEndpoint::create(&job, 0, 2, &[1], &ShmConfig::default()).unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");
    drop(first);
    assert!(leftovers(&job).is_empty());
}

#[test]
fn attach_times_out_when_the_peer_never_comes() {
    let job = job("absent");
    let mut ep = ShmEndpoint::create(&job, 0, 2, &[1], &ShmConfig::default()).unwrap();
    let t0 = Instant::now();
    let err = ep.attach(&[1], t0 + Duration::from_millis(200)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(t0.elapsed() < Duration::from_secs(2));
}

#[test]
fn bad_arguments_are_rejected() {
    let c = ShmConfig::default();
    let bad = |r: Result<ShmEndpoint>| r.unwrap_err().kind();
    assert_eq!(bad(ShmEndpoint::create("a/b", 0, 2, &[1], &c)), ErrorKind::InvalidArgument);
    assert_eq!(bad(ShmEndpoint::create("ok", 2, 2, &[1], &c)), ErrorKind::InvalidArgument);
    assert_eq!(bad(ShmEndpoint::create("ok", 0, 2, &[0], &c)), ErrorKind::InvalidArgument);
    assert_eq!(bad(ShmEndpoint::create("ok", 0, 3, &[1, 1], &c)), ErrorKind::InvalidArgument);
}

#[test]
fn no_files_left_after_setup_and_drop() {
    let job = job("clean");
    // Dropped without unlinking: the owner's drop removes the name.
    let ep = ShmEndpoint::create(&job, 0, 3, &[1, 2], &ShmConfig::default()).unwrap();
    assert_eq!(leftovers(&job).len(), 1);
    drop(ep);
    assert!(leftovers(&job).is_empty());
    // A full mesh, parts dropped.
    drop(mesh(&job, 3, &ShmConfig::default()));
    assert!(leftovers(&job).is_empty());
}

/// Both sides of the handshake: send one byte, receive one byte.
fn handshake(link: &mut dyn Link, bell: &dyn Doorbell, deadline: Instant) -> Result<()> {
    let mut sent = false;
    let mut got = false;
    while !(sent && got) {
        let epoch = bell.epoch();
        let mut moved = false;
        if !sent {
            sent = link.try_send(&[0x5A])? == 1;
            moved |= sent;
        }
        if !got {
            let mut b = [0u8; 1];
            got = link.try_recv(&mut b)? == 1;
            assert!(!got || b[0] == 0x5A);
            moved |= got;
        }
        if !(moved || sent && got) {
            if Instant::now() >= deadline {
                return Err(timeout("handshake"));
            }
            link.check_peer()?;
            bell.wait(epoch, deadline);
        }
    }
    Ok(())
}

/// One rank of the cross-process test; `rank` 1 runs in the child.
fn process_rank(job: &str, rank: usize) -> Parts {
    let peer = 1 - rank;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut ep = ShmEndpoint::create(job, rank, 2, &[peer], &ShmConfig::default()).unwrap();
    ep.attach(&[peer], deadline).unwrap();
    ep.wait_attached(&[peer], deadline).unwrap();
    ep.unlink_own().unwrap();
    let (mut links, bell) = ep.into_parts();
    handshake(links[peer].as_mut().unwrap().as_mut(), &*bell, deadline).unwrap();
    (links, bell)
}

const CROSS_PROCESS_BYTES: usize = 16 << 20;

/// The child role of [`bytes_cross_a_real_process_boundary`]; does nothing when run as an
/// ordinary test.
#[test]
fn child_process_role() {
    let Ok(job) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (mut links, bell) = process_rank(&job, 1);
    exchange(1, &mut links, &*bell, CROSS_PROCESS_BYTES, 1 << 16, 7).unwrap();
    // Exit without dropping anything: the parent must notice the process, not a flag.
    std::process::exit(0);
}

#[test]
fn bytes_cross_a_real_process_boundary() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let job = job("proc");
    let mut command = crate::harness::child_command("shm::child_process_role");
    command.env(CHILD_ENV, &job);
    let mut child = crate::harness::Proc::spawn(command);
    let (mut links, bell) = process_rank(&job, 0);
    exchange(0, &mut links, &*bell, CROSS_PROCESS_BYTES, 1 << 16, 3).unwrap();
    assert!(leftovers(&job).is_empty());

    // The child exits without closing its link: check_peer must see the process go.
    let link = links[1].as_mut().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let err = loop {
        match link.check_peer() {
            Err(e) => break e,
            Ok(()) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(()) => panic!("child's exit not noticed"),
        }
    };
    let code = child.wait(Duration::from_secs(20));
    assert_eq!(code, Some(0), "child failed:\n{}", child.output());
    assert_eq!(err.kind(), ErrorKind::PeerGone);
    assert_eq!(err.peer(), Some(1));
    assert!(err.to_string().contains("process exited"), "{err}");
}
