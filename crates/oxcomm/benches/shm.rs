//! Micro-benchmark of the shared-memory transport between two threads (each rank with its
//! own segment, as two processes would have): ping-pong latency of 8-byte messages and
//! streaming throughput in 1 MiB chunks.
//!
//! Run: `cargo bench -p oxcomm --bench shm` (settings: `OXCOMM_SHM_RING_BYTES`,
//! `OXCOMM_SHM_SPIN_US`; `OXCOMM_BENCH_ITERS` round trips, default 100000).

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use oxcomm::transport::shm::{ShmConfig, ShmEndpoint};
use oxcomm::transport::{Doorbell, Link};

type Parts = (Vec<Option<Box<dyn Link>>>, Arc<dyn Doorbell>);

fn pair(job: &str, config: &ShmConfig) -> (Parts, Parts) {
    let barrier = Arc::new(Barrier::new(2));
    let mut parts: Vec<Parts> = (0..2)
        .map(|r| {
            let (job, config, barrier) = (job.to_string(), config.clone(), barrier.clone());
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(10);
                let peer = 1 - r;
                let mut ep = ShmEndpoint::create(&job, r, 2, &[peer], &config).expect("create");
                ep.attach(&[peer], deadline).expect("attach");
                ep.wait_attached(&[peer], deadline).expect("wait_attached");
                barrier.wait();
                ep.unlink_own().expect("unlink");
                ep.into_parts()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().expect("setup thread"))
        .collect();
    let b = parts.pop().expect("two");
    (parts.pop().expect("two"), b)
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
        let want = buf.len() - at;
        let n = link
            .recv_with(want, &mut |c| {
                buf[at..at + c.len()].copy_from_slice(c);
                at += c.len();
            })
            .expect("recv");
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

fn ping_pong(config: &ShmConfig, iters: usize) -> (f64, f64) {
    let job = format!("bench{}-pp", std::process::id());
    let ((mut l0, b0), (mut l1, b1)) = pair(&job, config);
    let deadline = Instant::now() + Duration::from_secs(120);
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
        m[..8].copy_from_slice(&(i as u64).to_le_bytes());
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

fn stream(config: &ShmConfig, chunk: usize, total: usize) -> f64 {
    let job = format!("bench{}-st", std::process::id());
    let ((mut l0, b0), (mut l1, b1)) = pair(&job, config);
    let deadline = Instant::now() + Duration::from_secs(120);
    let start = Arc::new(Barrier::new(2));
    let s2 = start.clone();
    let sender = std::thread::spawn(move || {
        let link = l0[1].as_mut().expect("link").as_mut();
        let data = vec![0x5Au8; chunk];
        s2.wait();
        for _ in 0..total / chunk {
            send_all(link, &*b0, &data, deadline);
        }
        l0
    });
    let link = l1[0].as_mut().expect("link").as_mut();
    let mut buf = vec![0u8; chunk];
    buf.fill(1); // touch the pages before timing
    start.wait();
    let t = Instant::now();
    for _ in 0..total / chunk {
        recv_all(link, &*b1, &mut buf, deadline);
    }
    let secs = t.elapsed().as_secs_f64();
    let _l0 = sender.join().expect("sender thread");
    assert!(buf.iter().all(|&b| b == 0x5A));
    (total / chunk * chunk) as f64 / secs / 1e9
}

fn main() {
    let config = ShmConfig::from_env().expect("OXCOMM_SHM_* settings");
    let iters = std::env::var("OXCOMM_BENCH_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000usize);
    println!(
        "shm bench: ring {} B, spin {:?}, {} CPUs",
        config.ring_bytes,
        config.spin,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let (med, p99) = ping_pong(&config, iters);
    println!("ping-pong 8 B: one-way latency median {med:.3} us, p99 {p99:.3} us ({iters} round trips)");
    let chunk = 1 << 20;
    let total = 2usize << 30;
    let mut runs: Vec<f64> = (0..5).map(|_| stream(&config, chunk, total)).collect();
    let best = runs.iter().cloned().fold(0.0, f64::max);
    let med = median(&mut runs);
    println!(
        "stream 1 MiB chunks, {} GiB per run, 5 runs: median {med:.2} GB/s, best {best:.2} GB/s \
         (copy in + copy out, 1e9 B/s)",
        total >> 30
    );
}
