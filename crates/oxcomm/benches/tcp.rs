//! Micro-benchmark of the TCP transport between two thread ranks over loopback (127.0.0.1):
//! ping-pong latency of 8-byte messages, streaming throughput in 4 MiB chunks (one way, and
//! both ways at once), and all_reduce bus bandwidth at 64 MiB through a `Communicator`.
//!
//! Run: `cargo bench -p oxcomm --bench tcp` (settings: `OXCOMM_TCP_BUFFER_BYTES`,
//! `OXCOMM_TCP_FRAME_BYTES`, `OXCOMM_TCP_SPIN_US`; `OXCOMM_BENCH_ITERS` round trips, default
//! 20000; `OXCOMM_BENCH_STREAM_MIB` MiB per streaming run, default 2048;
//! `OXCOMM_BENCH_STREAM_RUNS` runs per streaming figure, default 3;
//! `OXCOMM_BENCH_STREAM_SPAN_MIB`, the size of the buffers a stream walks through, default 4:
//! the same 4 MiB each call, hot in the caches, as the ceiling is defined; `OXCOMM_BENCH_PARTS`, a
//! comma-separated subset of `latency,stream1,stream2,all_reduce`, default all;
//! `OXCOMM_BENCH_ALL_REDUCE_MIB`, comma-separated all_reduce sizes in MiB, default 64).
//! Streams and all_reduce also print the CPU time both threads used per byte of one direction
//! (`cpu … ns/B`): where the two cores are the limit, the ratio of these is the ratio of the
//! rates, whatever else the machine runs at the time.
//!
//! `stream2` (both directions at once, the rate of each) is the ceiling a 2-rank loopback
//! all_reduce's busbw is held to: `bench/tcp_ceiling.sh` runs it between all_reduce sweeps.

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

/// CPU time this thread has used (user and system), in seconds.
fn thread_cpu() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
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
/// to 0 at the same time), walking through buffers of `span` bytes (a multiple of `chunk`;
/// `chunk`: the same bytes every call, hot in the caches); returns GB/s per direction (1e9
/// B/s) and the CPU time both threads used per byte of one direction, in ns.
fn stream(config: &TcpConfig, chunk: usize, span: usize, total: usize, both: bool) -> (f64, f64) {
    let ((mut l0, b0), (mut l1, b1)) = pair(config);
    let deadline = Instant::now() + Duration::from_secs(300);
    let start = Arc::new(Barrier::new(2));
    let rounds = total / chunk;
    // Buffers are filled before the start (a fill of a large span is not streaming).
    let buffers = move || (vec![0x5Au8; span], vec![1u8; span]);
    let run = move |link: &mut dyn Link, bell: &dyn Doorbell, send: bool, recv: bool, data: &[u8], buf: &mut [u8]| {
        let cpu = thread_cpu();
        // Each call stops at the next chunk boundary.
        let upto = |at: usize| (at / chunk + 1) * chunk;
        let (mut sent, mut got) = (if send { 0 } else { total }, if recv { 0 } else { total });
        let (mut s_at, mut r_at) = (0, 0);
        while sent < rounds * chunk || got < rounds * chunk {
            let epoch = bell.epoch();
            let mut moved = 0;
            if sent < rounds * chunk {
                let n = link.try_send(&data[s_at..upto(s_at)]).expect("send");
                s_at = (s_at + n) % span;
                sent += n;
                moved += n;
            }
            if got < rounds * chunk {
                let n = link.try_recv(&mut buf[r_at..upto(r_at)]).expect("recv");
                r_at = (r_at + n) % span;
                got += n;
                moved += n;
            }
            if moved == 0 {
                assert!(Instant::now() < deadline, "stream timed out");
                bell.wait(epoch, deadline);
            }
        }
        let cpu = thread_cpu() - cpu;
        if recv {
            assert!(buf[..span.min(total)].iter().all(|&b| b == 0x5A));
        }
        cpu
    };
    let s2 = start.clone();
    let other = std::thread::spawn(move || {
        let (data, mut buf) = buffers();
        s2.wait();
        let cpu = run(l1[0].as_mut().expect("link").as_mut(), &*b1, both, true, &data, &mut buf);
        (l1, cpu)
    });
    let (data, mut buf) = buffers();
    start.wait();
    let t = Instant::now();
    let cpu0 = run(l0[1].as_mut().expect("link").as_mut(), &*b0, true, both, &data, &mut buf);
    let (_l1, cpu1) = other.join().expect("peer thread");
    let secs = t.elapsed().as_secs_f64();
    let bytes = (rounds * chunk) as f64;
    (bytes / secs / 1e9, (cpu0 + cpu1) / bytes * 1e9)
}

/// all_reduce of `count` f32 on 2 ranks; returns the median seconds, busbw in GB/s, and the
/// CPU time both ranks used per byte of busbw (per byte each direction of the link carries),
/// in ns.
fn all_reduce(config: &TcpConfig, count: usize, iters: usize) -> (f64, f64, f64) {
    let (p0, p1) = pair(config);
    let comm_config = CommConfig { timeout: Duration::from_secs(120), ..CommConfig::default() };
    let ranks: Vec<(Vec<f64>, f64)> = std::thread::scope(|s| {
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
                    let mut cpu = 0.0;
                    for i in 0..iters + 2 {
                        c.barrier().expect("barrier");
                        let (t0, c0) = (Instant::now(), thread_cpu());
                        c.all_reduce(&mut buf, ReduceOp::Sum).expect("all_reduce");
                        if i >= 2 {
                            t.push(t0.elapsed().as_secs_f64());
                            cpu += thread_cpu() - c0;
                        }
                    }
                    (t, cpu)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    let cpu: f64 = ranks.iter().map(|r| r.1).sum();
    let mut times = ranks.into_iter().next().map(|r| r.0).unwrap_or_default();
    let secs = median(&mut times);
    let n = 2.0;
    let algbw = (count * 4) as f64 / secs / 1e9;
    let busbw = algbw * 2.0 * (n - 1.0) / n;
    (secs, busbw, cpu / (busbw * 1e9 * secs * iters as f64) * 1e9)
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
    let stream_runs =
        std::env::var("OXCOMM_BENCH_STREAM_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(3usize).max(1);
    let parts = std::env::var("OXCOMM_BENCH_PARTS").unwrap_or_else(|_| "latency,stream1,stream2,all_reduce".into());
    let part = |name: &str| parts.split(',').any(|p| p.trim() == name);
    if part("latency") {
        let (med, p99) = ping_pong(&config, iters);
        println!("ping-pong 8 B: one-way latency median {med:.2} us, p99 {p99:.2} us ({iters} round trips)");
    }
    let chunk = 4 << 20;
    let total = mib << 20;
    let span_mib = std::env::var("OXCOMM_BENCH_STREAM_SPAN_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(4usize);
    let span = (span_mib << 20).max(chunk) / chunk * chunk;
    for (both, name) in [(false, "stream1"), (true, "stream2")] {
        if !part(name) {
            continue;
        }
        let (mut runs, mut cpu): (Vec<f64>, Vec<f64>) =
            (0..stream_runs).map(|_| stream(&config, chunk, span, total, both)).unzip();
        let best = runs.iter().cloned().fold(0.0, f64::max);
        let med = median(&mut runs);
        println!(
            "stream 4 MiB chunks{}, {mib} MiB per run, {}, {stream_runs} runs: median {med:.2} GB/s, best {best:.2} GB/s per direction, cpu {:.3} ns/B",
            if span > chunk { format!(" through {} MiB buffers", span >> 20) } else { String::new() },
            if both { "both directions at once" } else { "one direction" },
            median(&mut cpu)
        );
    }
    if part("all_reduce") {
        let sizes = std::env::var("OXCOMM_BENCH_ALL_REDUCE_MIB").unwrap_or_else(|_| "64".into());
        for mib in sizes.split(',').filter_map(|v| v.trim().parse::<usize>().ok()) {
            let count = (mib << 20) / 4;
            let (secs, busbw, cpu) = all_reduce(&config, count, 10);
            println!(
                "all_reduce {mib} MiB f32, 2 ranks: median {:.2} ms, busbw {busbw:.2} GB/s, cpu {cpu:.3} ns/B",
                secs * 1e3
            );
        }
    }
}
