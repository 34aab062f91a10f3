//! Tests of the TCP transport (`oxcomm::transport::tcp`): ranks are threads of this process
//! talking over loopback (127.0.0.1, port 0), meshes built through an `InMemoryStore`.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use oxcomm::rendezvous::InMemoryStore;
use oxcomm::transport::tcp::{
    choose_bind_ip, connect_mesh, encode_frame_header, TcpConfig, TcpDoorbell, TcpEndpoint, TcpLink, MAX_FRAME_BYTES,
    TAG_DATA,
};
use oxcomm::transport::{Doorbell, Link};
use oxcomm::{CommConfig, Communicator, ErrorKind, ReduceOp, Result};

const TOKEN: &[u8] = b"test-token-0123456789abcdef";
const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

type Parts = (Vec<Option<Box<dyn Link>>>, Arc<dyn Doorbell>);

/// A job id unique to this process and call.
fn job(tag: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!("t{}-{tag}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

fn deadline(secs: u64) -> Instant {
    Instant::now() + Duration::from_secs(secs)
}

/// Runs `f` on `world` thread ranks whose communicators talk over a TCP mesh on loopback;
/// returns what each rank's `f` returned, in rank order (the collectives tester's TCP worlds).
pub(crate) fn run_on_tcp<R: Send>(world: usize, config: CommConfig, f: impl Fn(Communicator) -> R + Sync) -> Vec<R> {
    ranks_over(mesh(world, &job("tester")), config, f)
}

/// Runs `f` on a TCP communicator per rank of `parts`, one thread each; returns what each
/// returned, in rank order (a rank whose communicator cannot be built, or whose `f` panics,
/// fails the test naming it).
fn ranks_over<R: Send>(parts: Vec<Parts>, config: CommConfig, f: impl Fn(Communicator) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let f = &f;
        let ranks: Vec<_> = parts
            .into_iter()
            .enumerate()
            .map(|(r, (links, bell))| {
                let config = config.clone();
                s.spawn(move || {
                    let c = Communicator::from_links(r, links, bell, config, oxcomm::Transport::Tcp)
                        .unwrap_or_else(|e| panic!("rank {r}: {e}"));
                    f(c)
                })
            })
            .collect();
        ranks.into_iter().enumerate().map(|(r, h)| h.join().unwrap_or_else(|_| panic!("rank {r} panicked"))).collect()
    })
}

/// A full TCP mesh of `world` thread ranks built through one in-memory store.
fn mesh(world: usize, job: &str) -> Vec<Parts> {
    let store = InMemoryStore::new();
    let until = deadline(20);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let store = &store;
                s.spawn(move || connect_mesh(store, r, world, LOOPBACK, TOKEN, job, until).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

type TcpParts = (Vec<Option<TcpLink>>, Arc<TcpDoorbell>);

/// A two-rank pair formed directly with endpoints (no store).
fn pair(job: &str, config: &TcpConfig) -> (Parts, Parts) {
    let (a, b) = tcp_pair(job, config);
    let boxed = |(links, bell): TcpParts| -> Parts {
        (links.into_iter().map(|l| l.map(|l| Box::new(l) as Box<dyn Link>)).collect(), bell)
    };
    (boxed(a), boxed(b))
}

/// [`pair`] with the concrete types.
fn tcp_pair(job: &str, config: &TcpConfig) -> (TcpParts, TcpParts) {
    let mut e0 = TcpEndpoint::listen_with(LOOPBACK, 0, 2, TOKEN, job, config).unwrap();
    let mut e1 = TcpEndpoint::listen_with(LOOPBACK, 1, 2, TOKEN, job, config).unwrap();
    let (a0, a1) = (e0.local_addr(), e1.local_addr());
    let until = deadline(10);
    std::thread::scope(|s| {
        let t = s.spawn(move || {
            e1.connect(&[(0, a0)], until).unwrap();
            e1.into_tcp_parts()
        });
        e0.connect(&[(1, a1)], until).unwrap();
        (e0.into_tcp_parts(), t.join().unwrap())
    })
}

/// The stream from `src` to `dst`: little-endian u64 words `word index ^ salt`, so a byte
/// out of place anywhere shows (and debug builds make it quickly).
fn pattern(src: usize, dst: usize, len: usize) -> Vec<u8> {
    let salt = ((src as u64) << 56) | ((dst as u64) << 48) | 0x5a5a;
    let mut v = Vec::with_capacity(len + 8);
    for w in 0..len.div_ceil(8) as u64 {
        v.extend_from_slice(&(w ^ salt).to_le_bytes());
    }
    v.truncate(len);
    v
}

/// Sends `bytes` bytes to every peer and receives as many from each, all at once, checking
/// every byte; returns when done or panics at the deadline.
fn stream_all(rank: usize, parts: &mut Parts, bytes: usize, until: Instant) {
    let (links, bell) = parts;
    let world = links.len();
    let out: Vec<Vec<u8>> = (0..world).map(|p| if p == rank { Vec::new() } else { pattern(rank, p, bytes) }).collect();
    let want: Vec<Vec<u8>> = (0..world).map(|p| if p == rank { Vec::new() } else { pattern(p, rank, bytes) }).collect();
    let mut inbox: Vec<Vec<u8>> = (0..world).map(|p| vec![0u8; if p == rank { 0 } else { bytes }]).collect();
    let mut sent = vec![0usize; world];
    let mut got = vec![0usize; world];
    loop {
        let epoch = bell.epoch();
        let mut progress = false;
        let mut done = true;
        for p in (0..world).filter(|&p| p != rank) {
            let link = links[p].as_mut().unwrap();
            if sent[p] < bytes {
                let end = (sent[p] + (1 << 20)).min(bytes);
                let n = link.try_send(&out[p][sent[p]..end]).unwrap();
                sent[p] += n;
                progress |= n > 0;
            }
            if got[p] < bytes {
                let n = link.try_recv(&mut inbox[p][got[p]..]).unwrap();
                got[p] += n;
                progress |= n > 0;
            }
            done &= sent[p] == bytes && got[p] == bytes;
        }
        if done {
            break;
        }
        if !progress {
            assert!(Instant::now() < until, "rank {rank}: streaming timed out (sent {sent:?}, got {got:?})");
            bell.wait(epoch, until);
        }
    }
    for p in (0..world).filter(|&p| p != rank) {
        assert!(inbox[p] == want[p], "rank {rank}: bytes from rank {p} differ");
    }
}

/// Sends all of `data` over `link` in pieces of at most `piece` bytes, sleeping on `bell` when
/// the link is full; fails at `until`.
fn send_in_pieces(link: &mut dyn Link, bell: &dyn Doorbell, data: &[u8], piece: usize, until: Instant) {
    let mut at = 0;
    while at < data.len() {
        let epoch = bell.epoch();
        let n = link.try_send(&data[at..(at + piece).min(data.len())]).unwrap();
        at += n;
        if n == 0 {
            assert!(Instant::now() < until, "sending stalled at byte {at} of {}", data.len());
            bell.wait(epoch, until);
        }
    }
}

/// Receives until the link fails or `until` passes; returns the error.
fn recv_until_error(link: &mut dyn Link, bell: &dyn Doorbell, until: Instant) -> oxcomm::Error {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let epoch = bell.epoch();
        match link.try_recv(&mut buf) {
            Err(e) => return e,
            Ok(0) => {
                assert!(Instant::now() < until, "no error before the deadline");
                bell.wait(epoch, until.min(Instant::now() + Duration::from_millis(50)));
            }
            Ok(_) => {}
        }
    }
}

#[test]
fn two_ranks_stream_both_ways_at_once() {
    let job = job("stream2");
    let parts = mesh(2, &job);
    let until = deadline(60);
    std::thread::scope(|s| {
        for (r, mut p) in parts.into_iter().enumerate() {
            s.spawn(move || stream_all(r, &mut p, 24 << 20, until));
        }
    });
}

#[test]
fn four_rank_mesh_streams_between_every_pair() {
    let job = job("stream4");
    let parts = mesh(4, &job);
    for (r, (links, _)) in parts.iter().enumerate() {
        for (p, l) in links.iter().enumerate() {
            assert_eq!(l.is_some(), p != r);
            if let Some(l) = l {
                assert_eq!((l.peer(), l.kind()), (p, oxcomm::Transport::Tcp));
            }
        }
    }
    let until = deadline(60);
    std::thread::scope(|s| {
        for (r, mut p) in parts.into_iter().enumerate() {
            s.spawn(move || stream_all(r, &mut p, 4 << 20, until));
        }
    });
}

#[test]
fn small_frames_and_recv_with_deliver_every_byte() {
    // Tiny frames force many headers per read; recv_with hands bytes out in place.
    let config = TcpConfig { frame_bytes: 7, ..TcpConfig::default() };
    let ((mut l0, b0), (mut l1, b1)) = pair(&job("small"), &config);
    let data = pattern(0, 1, 100_000);
    let until = deadline(30);
    let sender = std::thread::spawn(move || {
        send_in_pieces(l0[1].as_deref_mut().unwrap(), &*b0, &data, 1000, until);
        (l0, b0)
    });
    let link = l1[0].as_mut().unwrap();
    let mut got = Vec::new();
    let t0 = Instant::now();
    // Waits after partial progress too: the next bytes must still wake this rank.
    while got.len() < 100_000 {
        let epoch = b1.epoch();
        let n = link.recv_with(100_000 - got.len(), &mut |c| got.extend_from_slice(c)).unwrap();
        if n == 0 {
            assert!(Instant::now() < until);
            b1.wait(epoch, until);
        }
    }
    assert!(got == pattern(0, 1, 100_000));
    assert!(t0.elapsed() < Duration::from_secs(10), "a wake-up was lost: took {:?}", t0.elapsed());
    drop(sender.join().unwrap());
}

#[test]
fn a_peek_across_frames_returns_the_bytes_the_next_reads_take() {
    // 7-byte frames: a 48-byte peek spans seven of them. The receiver peeks, then takes the
    // bytes by try_recv and recv_with in turn; every peek must equal what is read next.
    let config = TcpConfig { frame_bytes: 7, ..TcpConfig::default() };
    let ((mut l0, b0), (mut l1, b1)) = pair(&job("peek"), &config);
    let total = 10_000;
    let data = pattern(0, 1, total);
    let until = deadline(30);
    let sender = std::thread::spawn(move || {
        send_in_pieces(l0[1].as_deref_mut().unwrap(), &*b0, &data, 333, until);
        (l0, b0)
    });
    let link = l1[0].as_mut().unwrap();
    let mut got = Vec::new();
    let mut turn = 0;
    while got.len() < total {
        let epoch = b1.epoch();
        let want = 48.min(total - got.len());
        let mut head = [0u8; 48];
        let n = link.peek(&mut head[..want]).unwrap();
        if n < want {
            assert!(Instant::now() < until, "peek stalled at {} bytes", got.len());
            b1.wait(epoch, until.min(Instant::now() + Duration::from_millis(50)));
            continue;
        }
        // Take a part of what was peeked, or more than it, by either call.
        let take = [5, 48, 100][turn % 3].min(total - got.len());
        let before = got.len();
        let mut read = 0;
        while read < take {
            let m = if turn % 2 == 0 {
                let mut buf = vec![0u8; take - read];
                let m = link.try_recv(&mut buf).unwrap();
                got.extend_from_slice(&buf[..m]);
                m
            } else {
                link.recv_with(take - read, &mut |c| got.extend_from_slice(c)).unwrap()
            };
            read += m;
            if m == 0 {
                assert!(Instant::now() < until, "read stalled at {} bytes", got.len());
                std::thread::yield_now();
            }
        }
        let seen = want.min(take);
        assert_eq!(&got[before..before + seen], &head[..seen], "peek at byte {before} differs from the read");
        turn += 1;
    }
    assert!(got == pattern(0, 1, total));
    drop(sender.join().unwrap());
}

#[test]
fn reads_that_end_a_frame_take_the_next_header_and_lose_no_byte() {
    // Messages of sizes around the direct-read threshold (16 KiB) and the stage (64 KiB), one
    // frame each: received once in pieces of exactly the message sizes (every read ends a
    // frame, so it also takes the next header) and once in pieces that straddle frames.
    let sizes = [1 << 20, 5, 40 << 10, 16 << 10, (16 << 10) - 1, 70 << 10, 3, (1 << 20) + 7, 64 << 10, 1];
    let total: usize = sizes.iter().sum();
    let ((mut l0, b0), (mut l1, b1)) = pair(&job("tails"), &TcpConfig::default());
    let data = pattern(0, 1, 2 * total);
    let until = deadline(60);
    let sender = std::thread::spawn(move || {
        let link = l0[1].as_mut().unwrap();
        let mut at = 0;
        for len in sizes.iter().chain(&sizes) {
            let end = at + len;
            while at < end {
                let epoch = b0.epoch();
                let n = link.try_send(&data[at..end]).unwrap();
                at += n;
                if n == 0 {
                    assert!(Instant::now() < until, "sending timed out");
                    b0.wait(epoch, until);
                }
            }
        }
        (l0, b0)
    });
    let link = l1[0].as_mut().unwrap();
    let mut got = vec![0u8; 2 * total];
    let straddling = [50 << 10, 7, 1 << 20, 20 << 10, 3 << 20];
    let pieces = sizes.iter().copied().chain(straddling.iter().copied().cycle());
    let mut at = 0;
    for piece in pieces {
        if at == got.len() {
            break;
        }
        let end = (at + piece).min(got.len());
        while at < end {
            let epoch = b1.epoch();
            let n = link.try_recv(&mut got[at..end]).unwrap();
            at += n;
            if n == 0 {
                assert!(Instant::now() < until, "receiving timed out at byte {at}");
                b1.wait(epoch, until);
            }
        }
    }
    assert!(got == pattern(0, 1, 2 * total), "bytes differ");
    drop(sender.join().unwrap());
}

/// Runs `f(rank, communicator)` on a TCP communicator per rank of `parts`, one thread each,
/// and fails the test naming the rank whose `f` panicked or returned an error.
fn on_tcp_ranks(parts: Vec<Parts>, config: CommConfig, f: impl Fn(usize, Communicator) -> Result<()> + Sync) {
    let results = ranks_over(parts, config, |c| f(c.rank(), c));
    for (r, res) in results.into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

#[test]
fn communicator_over_tcp_gives_exact_results() {
    let job = job("comm3");
    let world = 3;
    let parts = mesh(world, &job);
    let config = CommConfig { timeout: Duration::from_secs(30), max_segment_bytes: 64 << 10, ..CommConfig::default() };
    on_tcp_ranks(parts, config, |r, c| {
        assert_eq!(c.transport(), oxcomm::Transport::Tcp);
        for count in [1usize, 1000, 300_001] {
            let mut buf: Vec<i64> = (0..count).map(|i| (r * 1_000_000 + i) as i64).collect();
            c.all_reduce(&mut buf, ReduceOp::Sum)?;
            let expect: Vec<i64> = (0..count).map(|i| (3_000_000 + 3 * i) as i64).collect();
            assert!(buf == expect, "rank {r}: all_reduce of {count}");
        }
        let input: Vec<i32> = (0..5000).map(|i| (r * 10_000 + i) as i32).collect();
        let mut out = vec![0i32; 5000 * world];
        c.all_gather(&input, &mut out)?;
        for src in 0..world {
            assert!(out[src * 5000..(src + 1) * 5000].iter().enumerate().all(|(i, &v)| v == (src * 10_000 + i) as i32));
        }
        let mut b: Vec<i32> = if r == 1 { (0..70_000).collect() } else { vec![0; 70_000] };
        c.broadcast(&mut b, 1)?;
        assert!(b.iter().enumerate().all(|(i, &v)| v == i as i32), "rank {r}: broadcast");
        c.barrier()?;
        Ok(())
    });
}

/// The async 1-bit all-reduce runs in the communicator's issue order on TCP: an all-reduce
/// issued while it runs comes after it on every rank, and both give what the sync calls give.
#[test]
fn async_onebit_all_reduce_keeps_its_place_among_ops_over_tcp() {
    use oxcomm::compression::onebit::{self, OneBitState};
    let job = job("onebit-async");
    let parts = mesh(2, &job);
    let config = CommConfig { timeout: Duration::from_secs(30), ..CommConfig::default() };
    let len = 1 << 21; // 256 KiB of signs: the sync call pipelines on TCP
    on_tcp_ranks(parts, config, |r, c| {
        let x: Vec<f32> = (0..len).map(|i| ((i * 7 + r * 3) % 11) as f32 - 5.0).collect();
        let mut want = x.clone();
        onebit::all_reduce(&c, &mut want, &mut OneBitState::new(len, 2)?)?;
        let work = onebit::all_reduce_async(&c, x, OneBitState::new(len, 2)?)?;
        let mut after = vec![r as i64 + 1; 1000];
        c.all_reduce(&mut after, ReduceOp::Sum)?;
        let (got, _) = work.wait()?;
        assert!(got == want, "rank {r}: the async 1-bit all-reduce differs from the sync one");
        assert!(after.iter().all(|&v| v == 3), "rank {r}: the all-reduce issued meanwhile");
        Ok(())
    });
}

#[test]
fn wrong_token_is_rejected_while_the_real_job_forms() {
    let job = job("token");
    let mut e0 = TcpEndpoint::listen(LOOPBACK, 0, 2, TOKEN, &job).unwrap();
    let mut e1 = TcpEndpoint::listen(LOOPBACK, 1, 2, TOKEN, &job).unwrap();
    let (a0, a1) = (e0.local_addr(), e1.local_addr());
    let until = deadline(20);
    let ((mut l0, b0), (mut l1, b1)) = std::thread::scope(|s| {
        let t = s.spawn(move || {
            e1.connect(&[(0, a0)], until).unwrap();
            e1.into_parts()
        });
        // An impostor claiming rank 0 with the wrong secret, and one from another job.
        let mut rogue = TcpEndpoint::listen(LOOPBACK, 0, 2, b"wrong", &job).unwrap();
        let err = rogue.connect(&[(1, a1)], until).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Rendezvous, "{err}");
        assert!(err.to_string().contains("wrong token"), "{err}");
        let mut other = TcpEndpoint::listen(LOOPBACK, 0, 2, TOKEN, "another-job").unwrap();
        let err = other.connect(&[(1, a1)], until).unwrap_err();
        assert!(err.to_string().contains("not this job"), "{err}");
        e0.connect(&[(1, a1)], until).unwrap();
        (e0.into_parts(), t.join().unwrap())
    });
    // The real pair works.
    let n = l0[1].as_mut().unwrap().try_send(b"hello").unwrap();
    assert_eq!(n, 5);
    let mut buf = [0u8; 5];
    let mut got = 0;
    while got < 5 {
        let epoch = b1.epoch();
        got += l1[0].as_mut().unwrap().try_recv(&mut buf[got..]).unwrap();
        if got < 5 {
            b1.wait(epoch, until);
        }
    }
    assert_eq!(&buf, b"hello");
    drop(b0);
}

#[test]
fn garbage_and_silent_connections_do_not_disturb_the_job() {
    let job = job("garbage");
    let mut e0 = TcpEndpoint::listen(LOOPBACK, 0, 2, TOKEN, &job).unwrap();
    let mut e1 = TcpEndpoint::listen(LOOPBACK, 1, 2, TOKEN, &job).unwrap();
    let (a0, a1) = (e0.local_addr(), e1.local_addr());
    // Connected before rank 1 even starts accepting: a silent one and an HTTP request.
    let mut silent = TcpStream::connect(a1).unwrap();
    let mut http = TcpStream::connect(a1).unwrap();
    http.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let mut huge = TcpStream::connect(a1).unwrap();
    huge.write_all(b"OXTH\x01\x01\xff\xff").unwrap(); // a HELLO announcing 65535 bytes
    let until = deadline(20);
    let t0 = Instant::now();
    let (p0, p1) = std::thread::scope(|s| {
        let t = s.spawn(move || {
            e1.connect(&[(0, a0)], until).unwrap();
            e1.into_parts()
        });
        std::thread::sleep(Duration::from_millis(20));
        e0.connect(&[(1, a1)], until).unwrap();
        (e0.into_parts(), t.join().unwrap())
    });
    // Much less than the 10 s handshake timeout the silent client could have held.
    assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());
    // The leftover connections were cut off once the job formed.
    silent.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 16];
    assert!(matches!(silent.read(&mut b), Ok(0) | Err(_)));
    drop((p0, p1));
}

#[test]
fn a_dropped_peer_is_reported_as_peer_gone() {
    let ((mut l0, b0), (l1, b1)) = pair(&job("gone"), &TcpConfig::default());
    // Bytes sent before the drop are still delivered, then the loss is reported.
    let mut l1 = l1;
    assert_eq!(l1[0].as_mut().unwrap().try_send(b"last").unwrap(), 4);
    drop((l1, b1));
    let link = l0[1].as_mut().unwrap();
    let until = deadline(10);
    let mut buf = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let epoch = b0.epoch();
        got += link.try_recv(&mut buf[got..]).unwrap();
        if got < 4 {
            b0.wait(epoch, until);
        }
    }
    assert_eq!(&buf, b"last");
    let t0 = Instant::now();
    let err = recv_until_error(link.as_mut(), b0.as_ref(), until);
    assert_eq!(err.kind(), ErrorKind::PeerGone, "{err}");
    assert_eq!(err.peer(), Some(1));
    assert!(err.to_string().contains("rank 1"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(2));
    // The link stays failed, and check_peer says so too.
    assert_eq!(link.check_peer().unwrap_err().kind(), ErrorKind::PeerGone);
    assert_eq!(link.try_send(b"x").unwrap_err().kind(), ErrorKind::PeerGone);
}

#[test]
fn check_peer_and_send_notice_a_dropped_peer() {
    let ((mut l0, b0), p1) = pair(&job("gone2"), &TcpConfig::default());
    let link = l0[1].as_mut().unwrap();
    link.check_peer().unwrap();
    drop(p1);
    let until = deadline(10);
    // check_peer notices without any read.
    loop {
        match link.check_peer() {
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::PeerGone, "{e}");
                assert_eq!(e.peer(), Some(1));
                break;
            }
            Ok(()) => {
                assert!(Instant::now() < until);
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
    drop(b0);

    // A sender to a peer that went away fails with PeerGone too (EPIPE / ECONNRESET).
    let ((mut l0, b0), p1) = pair(&job("gone3"), &TcpConfig::default());
    drop(p1);
    let link = l0[1].as_mut().unwrap();
    let chunk = vec![0u8; 1 << 20];
    let err = loop {
        let epoch = b0.epoch();
        match link.try_send(&chunk) {
            Err(e) => break e,
            Ok(0) => {
                assert!(Instant::now() < until, "sending to a dropped peer never failed");
                b0.wait(epoch, until.min(Instant::now() + Duration::from_millis(50)));
            }
            Ok(_) => {}
        }
    };
    assert_eq!(err.kind(), ErrorKind::PeerGone, "{err}");
}

#[test]
fn a_communicator_whose_peer_dropped_fails_promptly_naming_it() {
    let parts = mesh(2, &job("commgone"));
    let config = CommConfig { timeout: Duration::from_secs(30), ..CommConfig::default() };
    let mut it = parts.into_iter();
    let (l0, b0) = it.next().unwrap();
    drop(it.next().unwrap());
    let c = Communicator::from_links(0, l0, b0, config, oxcomm::Transport::Tcp).unwrap();
    let t0 = Instant::now();
    let mut buf = vec![1.0f32; 1000];
    let err = c.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PeerGone, "{err}");
    assert_eq!(err.peer(), Some(1), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());
}

#[test]
fn bad_frame_headers_are_protocol_errors() {
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("announces", encode_frame_header(TAG_DATA, 0, MAX_FRAME_BYTES as u32 + 1).to_vec()),
        ("sequence number 5", encode_frame_header(TAG_DATA, 5, 10).to_vec()),
        ("tag 77", encode_frame_header(77, 0, 10).to_vec()),
        ("magic", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()),
    ];
    for (expect, bytes) in cases {
        let ((mut l0, b0), (mut l1, _b1)) = tcp_pair(&job("badframe"), &TcpConfig::default());
        let until = deadline(10);
        l1[0].as_mut().unwrap().inject_raw(&bytes, until).unwrap();
        let err = recv_until_error(l0[1].as_mut().unwrap(), b0.as_ref(), until);
        assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
        assert!(err.to_string().contains(expect), "{err} should mention {expect:?}");
        assert!(err.to_string().contains("rank 1"), "{err}");
    }
}

#[test]
fn choose_bind_ip_prefers_explicit_then_interface_then_route() {
    let store: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let explicit: IpAddr = "10.1.2.3".parse().unwrap();
    assert_eq!(choose_bind_ip(store, Some("lo"), Some(explicit)).unwrap(), explicit);
    assert_eq!(choose_bind_ip(store, Some("lo"), None).unwrap(), LOOPBACK);
    let err = choose_bind_ip(store, Some("no-such-if0"), None).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Rendezvous);
    assert!(err.to_string().contains("no-such-if0"), "{err}");
    assert_eq!(choose_bind_ip(store, None, None).unwrap(), LOOPBACK);
}

#[test]
fn setup_arguments_are_checked() {
    assert_eq!(TcpEndpoint::listen(LOOPBACK, 2, 2, TOKEN, "j").unwrap_err().kind(), ErrorKind::InvalidArgument);
    assert_eq!(TcpEndpoint::listen(LOOPBACK, 0, 2, TOKEN, "").unwrap_err().kind(), ErrorKind::InvalidArgument);
    let mut e = TcpEndpoint::listen(LOOPBACK, 0, 3, TOKEN, "j").unwrap();
    let a = e.local_addr();
    assert_eq!(e.connect(&[(0, a)], deadline(1)).unwrap_err().kind(), ErrorKind::InvalidArgument);
    assert_eq!(e.connect(&[(1, a), (1, a)], deadline(1)).unwrap_err().kind(), ErrorKind::InvalidArgument);
    let bad = TcpConfig { frame_bytes: 0, ..TcpConfig::default() };
    assert!(TcpEndpoint::listen_with(LOOPBACK, 0, 2, TOKEN, "j", &bad).is_err());
    let env = TcpConfig::from_lookup(|k| (k == "OXCOMM_TCP_SPIN_US").then(|| "7".to_string())).unwrap();
    assert_eq!(env.spin, Duration::from_micros(7));
    assert!(!env.spin_loaded);
    let loaded = TcpConfig::from_lookup(|k| (k == "OXCOMM_TCP_SPIN_LOADED").then(|| "1".to_string())).unwrap();
    assert!(loaded.spin_loaded);
    assert!(TcpConfig::from_lookup(|k| (k == "OXCOMM_TCP_SPIN_LOADED").then(|| "2".to_string())).is_err());
    assert!(TcpConfig::from_lookup(|_| Some("x".into())).is_err());
    // Nobody accepts at a missing peer: a timeout naming it, no hang.
    let mut e = TcpEndpoint::listen(LOOPBACK, 1, 2, TOKEN, "j").unwrap();
    let err = e.connect(&[(0, a)], Instant::now() + Duration::from_millis(200)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert_eq!(err.peer(), Some(0));
}

/// Environment variable that turns [`child_process_role`] into rank 0 of
/// [`a_killed_peer_process_is_reported_promptly`]; its value is `"{job} {rank 1's address}"`.
const CHILD_ENV: &str = "OXCOMM_TEST_TCP_CHILD";

/// Bytes the child sends before it waits to be killed.
const CHILD_BYTES: usize = 1 << 20;

#[test]
fn child_process_role() {
    let Ok(arg) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (job, addr) = arg.split_once(' ').unwrap();
    let mut e = TcpEndpoint::listen(LOOPBACK, 0, 2, TOKEN, job).unwrap();
    e.connect(&[(1, addr.parse().unwrap())], deadline(20)).unwrap();
    let (mut links, bell) = e.into_parts();
    let link = links[1].as_mut().unwrap();
    let data = pattern(0, 1, CHILD_BYTES);
    let mut at = 0;
    let until = deadline(20);
    while at < data.len() {
        let epoch = bell.epoch();
        let n = link.try_send(&data[at..]).unwrap();
        at += n;
        if n == 0 {
            bell.wait(epoch, until);
        }
    }
    // Wait to be killed (bounded, in case the parent died first).
    std::thread::sleep(Duration::from_secs(30));
    std::process::exit(0);
}

#[test]
fn a_killed_peer_process_is_reported_promptly() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let job = job("kill");
    let mut e = TcpEndpoint::listen(LOOPBACK, 1, 2, TOKEN, &job).unwrap();
    let mut command = crate::harness::child_command("tcp::child_process_role");
    command.env(CHILD_ENV, format!("{job} {}", e.local_addr()));
    let mut child = crate::harness::Proc::spawn(command);
    // Lower ranks' addresses are not used: the child connects to us.
    let unused: SocketAddr = "127.0.0.1:9".parse().unwrap();
    e.connect(&[(0, unused)], deadline(30)).unwrap();
    let (mut links, bell) = e.into_parts();
    let link = links[0].as_mut().unwrap();
    let mut buf = vec![0u8; CHILD_BYTES];
    let mut got = 0;
    let until = deadline(30);
    let t0 = Instant::now();
    while got < buf.len() {
        let epoch = bell.epoch();
        got += link.try_recv(&mut buf[got..]).unwrap();
        if got < buf.len() {
            assert!(Instant::now() < until);
            bell.wait(epoch, until);
        }
    }
    assert!(buf == pattern(0, 1, CHILD_BYTES));
    assert!(t0.elapsed() < Duration::from_secs(10), "a wake-up was lost: took {:?}", t0.elapsed());
    child.signal(libc::SIGKILL);
    let t0 = Instant::now();
    let err = recv_until_error(link.as_mut(), bell.as_ref(), deadline(10));
    child.wait(Duration::from_secs(10));
    assert_eq!(err.kind(), ErrorKind::PeerGone, "{err}");
    assert_eq!(err.peer(), Some(0));
    assert!(t0.elapsed() < Duration::from_secs(2), "took {:?}", t0.elapsed());
}

/// Issue 40: over TCP a small all-reduce folds its agreement into recursive doubling's
/// messages. A rank that calls the op with another count, or another op that agrees through
/// rank 0 (broadcast), still makes every rank fail with a mismatch at once, and no buffer is
/// written.
#[test]
fn folded_all_reduce_mismatches_fail_every_rank_at_once_without_writing() {
    for world in [2, 4, 5] {
        for case in ["count", "broadcast on rank 0", "broadcast on rank 1"] {
            let config = CommConfig { timeout: Duration::from_secs(20), ..CommConfig::default() };
            let t0 = Instant::now();
            let out = run_on_tcp(world, config, |c| {
                let r = c.rank();
                let mut buf: Vec<f32> = vec![r as f32 + 1.0; if case == "count" && r == 1 { 999 } else { 1000 }];
                let before = buf.clone();
                let res = match case {
                    "broadcast on rank 0" if r == 0 => c.broadcast(&mut buf, 0),
                    "broadcast on rank 1" if r == 1 => c.broadcast(&mut buf, 0),
                    _ => c.all_reduce(&mut buf, ReduceOp::Sum),
                };
                (res, buf == before)
            });
            for (r, (res, untouched)) in out.into_iter().enumerate() {
                let e = res.expect_err(&format!("world {world}, {case}: rank {r} did not fail"));
                assert_eq!(e.kind(), ErrorKind::Mismatch, "world {world}, {case}: rank {r}: {e}");
                assert!(untouched, "world {world}, {case}: rank {r} wrote its buffer");
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "world {world}, {case}: took {:?}", t0.elapsed());
        }
    }
}
