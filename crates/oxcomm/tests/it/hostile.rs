//! Hostile peers over real sockets (issue 16, item 1): a fake rank 0 that completes the TCP
//! handshake with the job's token and then answers the agreement phase with verdicts that no
//! honest rank 0 sends. The honest ranks must fail with a `Protocol` error naming rank 0, fast,
//! without a panic or an allocation sized by the peer.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use oxcomm::rendezvous::InMemoryStore;
use oxcomm::transport::tcp::connect_mesh;
use oxcomm::transport::{Doorbell, Link};
use oxcomm::{CommConfig, Communicator, ErrorKind};

const TOKEN: &[u8] = b"hostile-token-0123456789abcdef";

type Parts = (Vec<Option<Box<dyn Link>>>, Arc<dyn Doorbell>);

fn job(tag: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!("h{}-{tag}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Sends all of `bytes` on `link`, or panics at `until`.
fn send_all(link: &mut dyn Link, bell: &dyn Doorbell, bytes: &[u8], until: Instant) {
    let mut sent = 0;
    while sent < bytes.len() {
        let epoch = bell.epoch();
        let n = link.try_send(&bytes[sent..]).expect("fake peer: send");
        sent += n;
        if n == 0 {
            assert!(Instant::now() < until, "fake peer: send timed out");
            bell.wait(epoch, until.min(Instant::now() + Duration::from_millis(20)));
        }
    }
}

/// Receives exactly `buf.len()` bytes from `link`, or panics at `until`.
fn recv_exact(link: &mut dyn Link, bell: &dyn Doorbell, buf: &mut [u8], until: Instant) {
    let mut got = 0;
    while got < buf.len() {
        let epoch = bell.epoch();
        let n = link.try_recv(&mut buf[got..]).expect("fake peer: recv");
        got += n;
        if n == 0 {
            assert!(Instant::now() < until, "fake peer: recv timed out");
            bell.wait(epoch, until.min(Instant::now() + Duration::from_millis(20)));
        }
    }
}

/// A 3-rank TCP job whose rank 0 is the fake: it reads each honest rank's 48-byte fingerprint
/// and answers with `status`, `word` and the rank's own fingerprint, then `tail`. Ranks 1 and
/// 2 run a real communicator and call `barrier()`; returns their errors and how long they took.
fn hostile_verdict(status: u8, word: u64, tail: &[u8]) -> Vec<(oxcomm::Error, Duration)> {
    let job = job("verdict");
    let store = InMemoryStore::new();
    let world = 3;
    let until = Instant::now() + Duration::from_secs(20);
    let parts: Vec<Parts> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let (store, job) = (&store, &job);
                s.spawn(move || connect_mesh(store, r, world, "127.0.0.1".parse().unwrap(), TOKEN, job, until).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut parts = parts.into_iter();
    let (mut fake_links, fake_bell) = parts.next().unwrap();
    let config = CommConfig { timeout: Duration::from_secs(20), ..CommConfig::default() };
    std::thread::scope(|s| {
        let honest: Vec<_> = parts
            .enumerate()
            .map(|(i, (links, bell))| {
                let config = config.clone();
                s.spawn(move || {
                    let c = Communicator::from_links(i + 1, links, bell, config, oxcomm::Transport::Tcp).unwrap();
                    let t0 = Instant::now();
                    let err = c.barrier().expect_err("a hostile verdict must fail the barrier");
                    (err, t0.elapsed())
                })
            })
            .collect();
        for link in fake_links.iter_mut().skip(1) {
            let link = link.as_deref_mut().unwrap();
            let mut fp = [0u8; 48];
            recv_exact(link, &*fake_bell, &mut fp, until);
            let mut v = [0u8; 64];
            v[0] = status;
            v[8..16].copy_from_slice(&word.to_le_bytes());
            v[16..].copy_from_slice(&fp);
            send_all(link, &*fake_bell, &v, until);
            if !tail.is_empty() {
                send_all(link, &*fake_bell, tail, until);
            }
        }
        let out: Vec<_> = honest.into_iter().map(|h| h.join().expect("an honest rank panicked")).collect();
        drop(fake_links);
        out
    })
}

fn assert_names_rank_0(case: &str, errs: &[(oxcomm::Error, Duration)]) {
    for (e, took) in errs {
        assert_eq!(e.kind(), ErrorKind::Protocol, "{case}: {e}");
        assert_eq!(e.peer(), Some(0), "{case}: {e}");
        assert!(e.to_string().contains("rank 0"), "{case}: {e}");
        assert!(*took < Duration::from_secs(5), "{case}: took {took:?}: {e}");
    }
}

const MISMATCH: u8 = 1;
const MISSING: u8 = 2;

#[test]
fn a_missing_verdict_with_no_ranks_is_a_protocol_error_naming_rank_0() {
    assert_names_rank_0("missing, word 0", &hostile_verdict(MISSING, 0, &[]));
}

#[test]
fn a_missing_verdict_whose_length_wraps_is_a_protocol_error() {
    // 8 × 2^61 wraps to 0 in 64-bit arithmetic.
    assert_names_rank_0("missing, word 2^61", &hostile_verdict(MISSING, 1 << 61, &[]));
    assert_names_rank_0("missing, word u64::MAX", &hostile_verdict(MISSING, u64::MAX, &[]));
}

#[test]
fn a_missing_verdict_announcing_8_tib_allocates_nothing() {
    assert_names_rank_0("missing, word 2^40", &hostile_verdict(MISSING, 1 << 40, &[]));
}

#[test]
fn a_mismatch_verdict_naming_rank_1000_is_a_protocol_error() {
    assert_names_rank_0("mismatch, rank 1000", &hostile_verdict(MISMATCH, 1000, &[]));
}

#[test]
fn a_missing_rank_list_with_a_bad_rank_id_is_a_protocol_error() {
    assert_names_rank_0("missing 1, id 1000", &hostile_verdict(MISSING, 1, &1000u64.to_le_bytes()));
}

#[test]
fn an_unknown_verdict_status_is_a_protocol_error() {
    assert_names_rank_0("status 9", &hostile_verdict(9, 0, &[]));
}

#[test]
fn an_abort_frame_naming_a_rank_outside_the_world_is_a_protocol_error() {
    use oxcomm::transport::tcp::TcpEndpoint;
    let job = job("abort");
    // Concrete links, so the test can write a raw frame header.
    let mut e0 = TcpEndpoint::listen("127.0.0.1".parse().unwrap(), 0, 2, TOKEN, &job).unwrap();
    let mut e1 = TcpEndpoint::listen("127.0.0.1".parse().unwrap(), 1, 2, TOKEN, &job).unwrap();
    let (a0, a1) = (e0.local_addr(), e1.local_addr());
    let until = Instant::now() + Duration::from_secs(20);
    let ((mut l0, b0), (mut l1, _b1)) = std::thread::scope(|s| {
        let t = s.spawn(move || {
            e1.connect(&[(0, a0)], until).unwrap();
            e1.into_tcp_parts()
        });
        e0.connect(&[(1, a1)], until).unwrap();
        (e0.into_tcp_parts(), t.join().unwrap())
    });
    // Tag 2 is an abort frame; its length word is `culprit << 3 | cause`.
    let header = oxcomm::transport::tcp::encode_frame_header(2, 0, (1000 << 3) | 2);
    l1[0].as_mut().unwrap().inject_raw(&header, until).unwrap();
    let link = l0[1].as_mut().unwrap();
    let mut buf = [0u8; 16];
    let err = loop {
        let epoch = b0.epoch();
        match link.try_recv(&mut buf) {
            Err(e) => break e,
            Ok(_) => {
                assert!(Instant::now() < until, "no error before the deadline");
                b0.wait(epoch, until.min(Instant::now() + Duration::from_millis(20)));
            }
        }
    };
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    assert_eq!(err.peer(), Some(1), "{err}");
    assert!(err.to_string().contains("rank 1000"), "{err}");
}

/// Two endpoints of a 2-rank job on loopback.
fn endpoints(job: &str) -> (oxcomm::transport::tcp::TcpEndpoint, oxcomm::transport::tcp::TcpEndpoint) {
    use oxcomm::transport::tcp::TcpEndpoint;
    let ip = "127.0.0.1".parse().unwrap();
    (TcpEndpoint::listen(ip, 0, 2, TOKEN, job).unwrap(), TcpEndpoint::listen(ip, 1, 2, TOKEN, job).unwrap())
}

#[test]
fn silent_connections_do_not_lock_the_real_peer_out() {
    use std::net::TcpStream;
    let job = job("flood");
    let (mut e0, mut e1) = endpoints(&job);
    let (a0, a1) = (e0.local_addr(), e1.local_addr());
    let until = Instant::now() + Duration::from_secs(30);
    // 64 silent connections wait in rank 1's backlog before it accepts ...
    let mut silent: Vec<TcpStream> = (0..64).map(|_| TcpStream::connect(a1).unwrap()).collect();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let t = s.spawn(move || e1.connect(&[(0, a0)], until));
        // ... and 64 more arrive while it does, so every handshake slot is held by a stranger
        // when the real rank 0 knocks.
        std::thread::sleep(Duration::from_millis(100));
        silent.extend((0..64).map(|_| TcpStream::connect(a1).unwrap()));
        std::thread::sleep(Duration::from_millis(100));
        e0.connect(&[(1, a1)], until).expect("rank 0 must get in despite the flood");
        t.join().unwrap().expect("rank 1 must accept rank 0 despite the flood");
    });
    // Far below the 10 s handshake timeout the strangers could have held each slot for.
    assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());
    drop(silent);
}

#[test]
fn a_refusal_tells_an_unauthenticated_peer_nothing_about_the_job() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    let job = job("secretjobname");
    let (mut e0, mut e1) = endpoints(&job);
    let (a0, a1) = (e0.local_addr(), e1.local_addr());
    let until = Instant::now() + Duration::from_secs(30);
    std::thread::scope(|s| {
        let t = s.spawn(move || e1.connect(&[(0, a0)], until));
        // A HELLO (magic, version 1, code 1, body length) from "another-job", world 7, rank 5 -> 3.
        let other = b"another-job";
        let mut body = vec![0x42u8; 32];
        for w in [7u32, 5, 3] {
            body.extend_from_slice(&w.to_le_bytes());
        }
        body.extend_from_slice(&(other.len() as u16).to_le_bytes());
        body.extend_from_slice(other);
        let mut msg = b"OXTH\x01\x01".to_vec();
        msg.extend_from_slice(&(body.len() as u16).to_le_bytes());
        msg.extend_from_slice(&body);
        let mut c = TcpStream::connect(a1).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(&msg).unwrap();
        let mut reply = Vec::new();
        let _ = c.read_to_end(&mut reply);
        assert!(reply.len() > 8 && reply[5] == 5, "expected a REJECT, got {reply:?}");
        let text = String::from_utf8_lossy(&reply[8..]).into_owned();
        assert!(text.contains("not this job"), "{text}");
        assert!(!text.contains(&job) && !text.contains("secretjobname"), "the REJECT echoes the job id: {text}");
        assert!(!text.contains('2') && !text.contains('1'), "the REJECT gives world size or rank away: {text}");
        e0.connect(&[(1, a1)], until).unwrap();
        t.join().unwrap().unwrap();
    });
}

#[test]
fn an_object_length_beyond_the_bound_is_a_protocol_error_naming_the_root() {
    let job = job("objlen");
    let store = InMemoryStore::new();
    let until = Instant::now() + Duration::from_secs(20);
    let ip = "127.0.0.1".parse().unwrap();
    let ((mut fake_links, fake_bell), (links, bell)) = std::thread::scope(|s| {
        let t = s.spawn(|| connect_mesh(&store, 1, 2, ip, TOKEN, &job, until).unwrap());
        (connect_mesh(&store, 0, 2, ip, TOKEN, &job, until).unwrap(), t.join().unwrap())
    });
    let config = CommConfig { timeout: Duration::from_secs(20), ..CommConfig::default() };
    let (err, took) = std::thread::scope(|s| {
        let honest = s.spawn(move || {
            let c = Communicator::from_links(1, links, bell, config, oxcomm::Transport::Tcp).unwrap();
            let t0 = Instant::now();
            let err = c.broadcast_bytes(None, 0).expect_err("an 8 TiB object must be refused");
            (err, t0.elapsed())
        });
        // Rank 0 agrees to the broadcast of the length, then announces 2^43 bytes.
        let link = fake_links[1].as_deref_mut().unwrap();
        let mut fp = [0u8; 48];
        recv_exact(link, &*fake_bell, &mut fp, until);
        let mut v = [0u8; 64];
        v[16..].copy_from_slice(&fp);
        send_all(link, &*fake_bell, &v, until);
        send_all(link, &*fake_bell, &(1i64 << 43).to_le_bytes(), until);
        honest.join().expect("the honest rank panicked")
    });
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    assert_eq!(err.peer(), Some(0), "{err}");
    assert!(err.to_string().contains("rank 0 announced an object of 8796093022208 bytes"), "{err}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
}
