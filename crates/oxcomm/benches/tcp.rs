//! Micro-benchmark of the TCP transport between two thread ranks over loopback (127.0.0.1):
//! ping-pong latency of 8-byte messages, streaming throughput in 4 MiB chunks (one way, and
//! both ways at once), and all_reduce bus bandwidth at 64 MiB through a `Communicator`.
//!
//! Run: `cargo bench -p oxcomm --bench tcp` (settings: `OXCOMM_TCP_BUFFER_BYTES`,
//! `OXCOMM_TCP_FRAME_BYTES`, `OXCOMM_TCP_SPIN_US`; `OXCOMM_BENCH_ITERS` round trips, default
//! 20000; `OXCOMM_BENCH_STREAM_MIB` MiB per streaming run, default 2048).

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use oxcomm::transport::tcp::{TcpConfig, TcpEndpoint};
use oxcomm::transport::{Doorbell, Link};
use oxcomm::{CommConfig, Communicator, ReduceOp};

type Parts = (Vec<Option<Box<dyn Link>>>, Arc<dyn Doorbell>);

const TOKEN: &[u8] = b"bench-token";

fn pair(config: &TcpConfig) -> (Parts, Parts) {
    let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let job = format!("bench{}", std::process::id());
    let mut e0 = TcpEndpoint::listen_with(ip, 0, 2, TOKEN, &job, config).expect("listen");
    let mut e1 = TcpEndpoint::listen_with(ip, 1, 2, TOKEN, &job, config).expect("listen");
    let (a0, a1) = (e0.local_addr(), e1.local_addr());
    let deadline = Instant::now() + Duration::from_secs(10);
    let t = std::thread::spawn(move || {
        e1.connect(&[(0, a0)], deadline).expect("connect");
        e1.into_parts()
    });
    e0.connect(&[(1, a1)], deadline).expect("connect");
    (e0.into_parts(), t.join().expect("setup thread"))
}

fn send_all(link: &mut dyn Link, bell: &dyn Doorbell, mut data: &[u8], deadline: Instant) {
    while !data.is_empty() {
        let epoch = bell.epoch();
        let n = link.try_send(data).expect("send");
        data = &data[n..];
        if n == 0 {
            assert!(Instant::now() < deadline, "send timed out");
            bell.wait(epoch, deadline);
        }
    }
}

fn recv_all(link: &mut dyn Link, bell: &dyn Doorbell, buf: &mut [u8], deadline: Instant) {
    let mut at = 0;
    while at < buf.len() {
        let epoch = bell.epoch();
        let n = link.try_recv(&mut buf[at..]).expect("recv");
        at += n;
        if n == 0 {
            assert!(Instant::now() < deadline, "recv timed out");
            bell.wait(epoch, deadline);
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// One-way latency of 8-byte messages: (median, p99) in µs.
fn ping_pong(config: &TcpConfig, iters: usize) -> (f64, f64) {
    let ((mut l0, b0), (mut l1, b1)) = pair(config);
    let deadline = Instant::now() + Duration::from_secs(300);
    let warm = iters / 10;
    let echo = std::thread::spawn(move || {
        let link = l1[0].as_mut().expect("link").as_mut();
        let mut m = [0u8; 8];
        for _ in 0..warm + iters {
            recv_all(link, &*b1, &mut m, deadline);
            send_all(link, &*b1, &m, deadline);
        }
    });
    let link = l0[1].as_mut().expect("link").as_mut();
    let mut m = [0u8; 8];
    let mut samples = Vec::with_capacity(iters);
    for i in 0..warm + iters {
        m.copy_from_slice(&(i as u64).to_le_bytes());
        let t = Instant::now();
        send_all(link, &*b0, &m, deadline);
        recv_all(link, &*b0, &mut m, deadline);
        if i >= warm {
            samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
        assert_eq!(u64::from_le_bytes(m), i as u64);
    }
    echo.join().expect("echo thread");
    let med = median(&mut samples);
    let p99 = samples[samples.len() * 99 / 100];
    (med, p99)
}

/// Streams `total` bytes in `chunk`-byte calls from rank 0 to rank 1 (and, if `both`, from 1
/// to 0 at the same time); returns GB/s per direction (1e9 B/s).
fn stream(config: &TcpConfig, chunk: usize, total: usize, both: bool) -> f64 {
    let ((mut l0, b0), (mut l1, b1)) = pair(config);
    let deadline = Instant::now() + Duration::from_secs(300);
    let start = Arc::new(Barrier::new(2));
    let rounds = total / chunk;
    let run = move |link: &mut dyn Link, bell: &dyn Doorbell, send: bool, recv: bool| {
        let data = vec![0x5Au8; chunk];
        let mut buf = vec![1u8; chunk];
        let (mut sent, mut got) = (if send { 0 } else { total }, if recv { 0 } else { total });
        let (mut s_at, mut r_at) = (0, 0);
        while sent < rounds * chunk || got < rounds * chunk {
            let epoch = bell.epoch();
            let mut moved = 0;
            if sent < rounds * chunk {
                let n = link.try_send(&data[s_at..]).expect("send");
                s_at = (s_at + n) % chunk;
                sent += n;
                moved += n;
            }
            if got < rounds * chunk {
                let n = link.try_recv(&mut buf[r_at..]).expect("recv");
                r_at = (r_at + n) % chunk;
                got += n;
                moved += n;
            }
            if moved == 0 {
                assert!(Instant::now() < deadline, "stream timed out");
                bell.wait(epoch, deadline);
            }
        }
        if recv {
            assert!(buf.iter().all(|&b| b == 0x5A));
        }
    };
    let s2 = start.clone();
    let other = std::thread::spawn(move || {
        s2.wait();
        run(l1[0].as_mut().expect("link").as_mut(), &*b1, both, true);
        l1
    });
    start.wait();
    let t = Instant::now();
    run(l0[1].as_mut().expect("link").as_mut(), &*b0, true, both);
    let _l1 = other.join().expect("peer thread");
    let secs = t.elapsed().as_secs_f64();
    (rounds * chunk) as f64 / secs / 1e9
}

/// all_reduce of `count` f32 on 2 ranks; returns (median seconds, busbw GB/s).
fn all_reduce(config: &TcpConfig, count: usize, iters: usize) -> (f64, f64) {
    let (p0, p1) = pair(config);
    let comm_config = CommConfig { timeout: Duration::from_secs(120), ..CommConfig::default() };
    let mut times: Vec<Vec<f64>> = std::thread::scope(|s| {
        let hs: Vec<_> = [p0, p1]
            .into_iter()
            .enumerate()
            .map(|(r, (links, bell))| {
                let comm_config = comm_config.clone();
                s.spawn(move || {
                    let c = Communicator::from_links(r, links, bell, comm_config, oxcomm::transport::Transport::Tcp)
                        .expect("communicator");
                    let mut buf = vec![1.0f32; count];
                    let mut t = Vec::new();
                    for i in 0..iters + 2 {
                        c.barrier().expect("barrier");
                        let t0 = Instant::now();
                        c.all_reduce(&mut buf, ReduceOp::Sum).expect("all_reduce");
                        if i >= 2 {
                            t.push(t0.elapsed().as_secs_f64());
                        }
                    }
                    t
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    let secs = median(&mut times[0]);
    let n = 2.0;
    let algbw = (count * 4) as f64 / secs / 1e9;
    (secs, algbw * 2.0 * (n - 1.0) / n)
}

fn main() {
    let config = TcpConfig::from_env().expect("OXCOMM_TCP_* settings");
    let iters = std::env::var("OXCOMM_BENCH_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000usize);
    let mib = std::env::var("OXCOMM_BENCH_STREAM_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(2048usize);
    println!(
        "tcp bench (loopback): socket buffers {} B, frames {} B, spin {:?}, {} CPUs",
        config.socket_buffer_bytes,
        config.frame_bytes,
        config.spin,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let (med, p99) = ping_pong(&config, iters);
    println!("ping-pong 8 B: one-way latency median {med:.2} us, p99 {p99:.2} us ({iters} round trips)");
    let chunk = 4 << 20;
    let total = mib << 20;
    for both in [false, true] {
        let mut runs: Vec<f64> = (0..3).map(|_| stream(&config, chunk, total, both)).collect();
        let best = runs.iter().cloned().fold(0.0, f64::max);
        let med = median(&mut runs);
        println!(
            "stream 4 MiB chunks, {mib} MiB per run, {}, 3 runs: median {med:.2} GB/s, best {best:.2} GB/s per direction",
            if both { "both directions at once" } else { "one direction" }
        );
    }
    let count = 16 << 20; // 64 MiB of f32
    let (secs, busbw) = all_reduce(&config, count, 10);
    println!("all_reduce 64 MiB f32, 2 ranks: median {:.2} ms, busbw {busbw:.2} GB/s", secs * 1e3);
}
