//! Reduction kernels against `copy_from_slice`, single-threaded, over 64 MiB buffers.
//!
//! Run with `cargo bench --bench reduce`. Every buffer is allocated and written once before
//! timing; each case runs once to warm up, then `RUNS` times, and the median is reported.
//! GB/s are 10^9 bytes per second, given under two conventions, stated on every line:
//! - `buf`: the size of the destination buffer (64 MiB) divided by the time;
//! - `r+w`: bytes read plus bytes written, divided by the time: 3 × 64 MiB for `dst += src`
//!   and `dst = a + b`, 2 × 64 MiB for a copy.

use std::hint::black_box;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use oxcomm::reduce::{reduce_from2, reduce_into, scalar};
use oxcomm::{Element, ReduceOp};

/// Bytes in every buffer.
const BYTES: usize = 64 << 20;

/// Timed runs per case (after one warm-up run).
const RUNS: usize = 15;

/// Median time of `RUNS` runs of `f`, after one warm-up run.
fn median(mut f: impl FnMut()) -> Duration {
    f();
    let mut times: Vec<Duration> = (0..RUNS)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[RUNS / 2]
}

/// A buffer of `BYTES` with every page written.
fn buffer<T: Element>(v: f64) -> Vec<T> {
    let n = BYTES / std::mem::size_of::<T>();
    (0..n).map(|i| T::from_f64(v + (i % 7) as f64)).collect()
}

fn gbs(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Prints one case: time, then GB/s under both conventions (`streams` buffers read or written).
fn line(name: &str, t: Duration, streams: usize) -> Duration {
    println!(
        "{name:<40} {:>8.3} ms  {:>6.2} GB/s buf (64 MiB)  {:>6.2} GB/s r+w ({streams} x 64 MiB)",
        t.as_secs_f64() * 1e3,
        gbs(BYTES, t),
        gbs(streams * BYTES, t),
    );
    t
}

/// `dst += src` over 64 MiB of `T`, through the fast kernel.
fn sum_case<T: Element>(name: &str) -> Duration {
    let (mut dst, src) = (buffer::<T>(0.0), buffer::<T>(1.0));
    let t = median(|| reduce_into(black_box(&mut dst[..]), black_box(&src[..]), ReduceOp::Sum));
    black_box(&dst);
    line(name, t, 3)
}

fn main() {
    println!("oxcomm reduce bench: {} MiB buffers, median of {RUNS} runs after 1 warm-up, one thread", BYTES >> 20);

    let kernel = sum_case::<f32>("f32 sum kernel (dst += src)");

    let (mut dst, src) = (buffer::<f32>(0.0), buffer::<f32>(1.0));
    let copy = median(|| black_box(&mut dst[..]).copy_from_slice(black_box(&src[..])));
    black_box(&dst);
    line("copy_from_slice", copy, 2);

    let (k, c) = (kernel.as_secs_f64(), copy.as_secs_f64());
    println!("ratio kernel/copy: time {:.2}; GB/s buf {:.2}; GB/s r+w {:.2}", k / c, c / k, 1.5 * c / k);

    let (a, b) = (buffer::<f32>(0.0), buffer::<f32>(1.0));
    let t = median(|| {
        let d = black_box(&mut dst[..]);
        reduce_from2(d, black_box(&a[..]), black_box(&b[..]), ReduceOp::Sum)
    });
    line("f32 sum out of place (dst = a + b)", t, 3);
    drop((a, b, dst, src));

    let (mut dst, src) = (buffer::<f32>(0.0), buffer::<f32>(1.0));
    let t = median(|| scalar::reduce_into(black_box(&mut dst[..]), &src[..], ReduceOp::Sum));
    line("f32 sum scalar reference (dst += src)", t, 3);
    drop((dst, src));

    sum_case::<f16>("f16 sum kernel (dst += src)");
    sum_case::<bf16>("bf16 sum kernel (dst += src)");
    sum_case::<i32>("i32 sum kernel (dst += src)");

    println!("in cache: {} KiB buffers, {CACHE_REPS} calls per run (compute-bound cost)", CACHE_BYTES >> 10);
    cached_case::<f32>("f32 sum kernel, in cache");
    cached_case::<f16>("f16 sum kernel, in cache");
    cached_case::<bf16>("bf16 sum kernel, in cache");
    cached_case::<i32>("i32 sum kernel, in cache");
}

/// Bytes per buffer for the in-cache cases (two of them fit in L2).
const CACHE_BYTES: usize = 64 << 10;

/// Calls per timed run of an in-cache case, so a run moves as many bytes as the 64 MiB cases.
const CACHE_REPS: usize = BYTES / CACHE_BYTES;

/// `dst += src` over `CACHE_BYTES`, `CACHE_REPS` times; reported per 64 MiB of buffer.
fn cached_case<T: Element>(name: &str) -> Duration {
    let n = CACHE_BYTES / std::mem::size_of::<T>();
    let mut dst: Vec<T> = (0..n).map(|i| T::from_f64((i % 7) as f64)).collect();
    let src: Vec<T> = (0..n).map(|i| T::from_f64((i % 5) as f64)).collect();
    let t = median(|| {
        for _ in 0..CACHE_REPS {
            reduce_into(black_box(&mut dst[..]), black_box(&src[..]), ReduceOp::Sum);
        }
    });
    line(name, t, 3)
}
