//! Throughput of the compression kernels on one core, beside a plain memory copy of the same
//! size measured in the same run.
//!
//! `cargo bench -p oxcomm --bench compress` runs 64 MiB of f32 (16 Mi elements; `COMPRESS_ELEMS`
//! sets another count, e.g. `1048576` for the 4 MiB of the 1-bit target), median of 15
//! timed runs after one warm-up, all buffers written before timing. Rates are GB/s (10^9 bytes)
//! of f32 data (the input of pack/quantize, the output of unpack/dequantize), so each is
//! comparable with the copy. A second table times the 1-bit all-reduce's three fused passes
//! on 2 threads at once, each with the buffers of one rank of a 2-rank call, beside only their
//! memory traffic (the floor any kernel of that op meets on this machine). Without `--bench`
//! (as under `cargo test --all-targets`) it runs a tiny smoke pass instead.

use std::hint::black_box;
use std::time::{Duration, Instant};

use half::f16;
use oxcomm::compression::pack::{self, BitOrder};
use oxcomm::compression::quant::{self, QuantBits, QuantType};

/// Elements per quantization group (qgZ's groups are `min(d0, d1)`: rows of a few thousand).
const GROUP: usize = 2048;

fn median_time(runs: usize, mut f: impl FnMut()) -> Duration {
    f(); // warm-up
    let mut t: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    t.sort();
    t[t.len() / 2]
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    // `COMPRESS_ELEMS` overrides the length (e.g. `1048576` for the 4 MiB of the 1-bit target).
    let elems = std::env::var("COMPRESS_ELEMS").ok().and_then(|v| v.parse::<usize>().ok());
    let (n, runs) = if full { (elems.unwrap_or(16 << 20) / 64 * 64, 15) } else { (1 << 16, 1) };
    let bytes = (n * 4) as f64;

    // Deterministic data in [-1, 1), every page written before timing.
    let mut x = 0x9E37_79B9u32;
    let src: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as i32) as f32 / 2_147_483_648.0
        })
        .collect();
    let src16: Vec<f16> = src.iter().map(|&v| f16::from_f32(v)).collect();
    let mut dst = vec![1.0f32; n];
    let mut signs = vec![1u8; n / 8];
    let mut q4 = vec![1u8; quant::quantized_len(n, QuantBits::Int4)];
    let mut q8 = vec![1u8; quant::quantized_len(n, QuantBits::Int8)];
    let mut params = vec![1.0f32; quant::params_len(n, GROUP, QuantType::Symmetric)];
    let mut params64 = vec![1.0f32; quant::params_len(n, 64, QuantType::Symmetric)];

    let mut rows: Vec<(String, f64, Duration)> = Vec::new();
    let mut row = |name: &str, b: f64, t: Duration| rows.push((name.to_string(), b, t));

    let t = median_time(runs, || dst.copy_from_slice(black_box(&src)));
    row("copy_from_slice (same bytes)", bytes, t);
    let t = median_time(runs, || {
        pack::pack_signs(black_box(&src), &mut signs, BitOrder::Big).unwrap();
    });
    row("pack_signs (big order)", bytes, t);
    let t = median_time(runs, || {
        pack::unpack_scaled_add(black_box(&signs), &mut dst, 1e-3, BitOrder::Big).unwrap();
    });
    row("unpack_scaled_add", bytes, t);
    // The memory floor of the worker pass: read two arrays, write one, no arithmetic to speak of.
    let t = median_time(runs, || {
        for (d, s) in dst.iter_mut().zip(black_box(&src)) {
            *d += *s;
        }
    });
    row("u += x (the worker pass's memory traffic)", bytes, t);
    // The fused passes of the 1-bit all-reduce (`dst` plays the error buffer).
    let t = median_time(runs, || {
        black_box(pack::add_pack_squares(&mut dst, 1e-3, black_box(&src), &mut signs, BitOrder::Big).unwrap());
    });
    row("add_pack_squares (e, u = x + e, signs, Σu²)", bytes, t);
    let t = median_time(runs, || pack::subtract_signs(&mut dst, black_box(1e-3)));
    row("subtract_signs (e ← u − α·sgn u)", bytes, t);
    let rows2 = [signs.clone(), signs.clone()].concat();
    let t = median_time(runs, || {
        let (acc, out) = (&mut dst[..n / 2], &mut signs[..n / 16]);
        let scales = [1e-3, 2e-3];
        black_box(pack::unpack_sum_pack_squares(&rows2, n / 16, &scales, acc, 1e-3, out, BitOrder::Big).unwrap());
    });
    row("unpack_sum_pack_squares, 2 rows (f32 bytes ×2)", bytes, t);
    let sym = QuantType::Symmetric;
    let t = median_time(runs, || {
        quant::quantize(black_box(&src), GROUP, QuantBits::Int4, sym, &mut q4, &mut params).unwrap();
    });
    row("quantize int4 sym", bytes, t);
    let t = median_time(runs, || {
        quant::quantize(black_box(&src), GROUP, QuantBits::Int8, sym, &mut q8, &mut params).unwrap();
    });
    row("quantize int8 sym", bytes, t);
    quant::quantize(&src, GROUP, QuantBits::Int4, sym, &mut q4, &mut params).unwrap();
    let t = median_time(runs, || {
        quant::dequantize(black_box(&q4), &params, GROUP, QuantBits::Int4, sym, &mut dst).unwrap();
    });
    row("dequantize int4 sym", bytes, t);
    let t = median_time(runs, || {
        quant::dequantize_add_f32(black_box(&q4), &params, GROUP, QuantBits::Int4, sym, &mut dst).unwrap();
    });
    row("dequantize_add_f32 int4 sym", bytes, t);
    // qgZ's reduction: two int4 inputs summed in f32 (the second a copy of the first).
    let (q4b, paramsb) = (q4.clone(), params.clone());
    let two = [(&q4[..], &params[..]), (&q4b[..], &paramsb[..])];
    let t = median_time(runs, || {
        quant::dequantize_sum_f32(black_box(&two), GROUP, QuantBits::Int4, sym, &mut dst).unwrap();
    });
    row("dequantize_sum_f32 int4 sym, 2 inputs", bytes, t);
    // qgZ's host-sum step as it runs: 4096 elements (two groups) at a time, summed into an
    // L1-sized scratch and requantized from it.
    let mut block = vec![0f32; 4096.min(n)];
    let mut q4_out = vec![0u8; q4.len()];
    let mut p_out = vec![0f32; params.len()];
    let t = median_time(runs, || {
        let bytes_per = block.len() / 2;
        let groups_per = block.len() / GROUP;
        for (b, (qo, po)) in q4_out.chunks_exact_mut(bytes_per).zip(p_out.chunks_exact_mut(groups_per)).enumerate() {
            let (qs, ps) = (b * bytes_per..(b + 1) * bytes_per, b * groups_per..(b + 1) * groups_per);
            let ins = [(&q4[qs.clone()], &params[ps.clone()]), (&q4b[qs], &paramsb[ps])];
            quant::dequantize_sum_f32(black_box(&ins), GROUP, QuantBits::Int4, sym, &mut block).unwrap();
            quant::quantize(&block, GROUP, QuantBits::Int4, sym, qo, po).unwrap();
        }
    });
    row("fused sum of 2 int4 inputs + requantize, by block", bytes, t);
    let t = median_time(runs, || {
        quant::dequantize_mean(black_box(&two), GROUP, QuantBits::Int4, sym, 4.0, &mut dst).unwrap();
    });
    row("dequantize_mean int4 sym, 2 inputs, f32 out", bytes, t);
    let t = median_time(runs, || {
        quant::quantize(black_box(&src), 64, QuantBits::Int4, sym, &mut q4, &mut params64).unwrap();
    });
    row("quantize int4 sym, group 64", bytes, t);
    let t = median_time(runs, || {
        quant::quantize(black_box(&src16), GROUP, QuantBits::Int4, sym, &mut q4, &mut params).unwrap();
    });
    row("quantize int4 sym, f16 input (f32-equiv. bytes)", bytes, t);

    let copy = rows[0].2.as_secs_f64();
    println!("compress kernels: {n} f32 elements ({} MiB), group {GROUP}, median of {runs} runs", (n * 4) >> 20);
    println!("{:<50} {:>10} {:>10} {:>10}", "kernel", "ms", "GB/s", "vs copy");
    for (name, b, t) in &rows {
        let s = t.as_secs_f64();
        println!("{name:<50} {:>10.3} {:>10.2} {:>9.2}x", s * 1e3, b / s / 1e9, copy / s);
    }

    // The 1-bit all-reduce's passes as two ranks run them at once, without the exchanges:
    // each thread owns x (n), the worker error u (n) and the server error m (n/2), as a rank
    // of a 2-rank call does, and runs either the three fused passes or only their memory
    // traffic (u += x, m += 1, x written).
    println!();
    println!("1-bit passes per call on 2 threads at once (each: x, u of {n}, m of {}), median of the slower", n / 2);
    println!("{:<50} {:>10}", "passes", "ms");
    let rounds = if full { 60 } else { 2 };
    let fused = two_threads(n, rounds, |x, u, m, signs| {
        let (rows, out) = signs.split_at_mut(n / 8);
        black_box(pack::add_pack_squares(u, 1e-3, x, rows, BitOrder::Big).unwrap());
        black_box(pack::unpack_sum_pack_squares(rows, n / 16, &[1e-3, 2e-3], m, 1e-3, out, BitOrder::Big).unwrap());
        for (half, row) in x.chunks_mut(n / 2).zip(rows.chunks(n / 16)) {
            pack::unpack_scaled(row, half, 1e-3, BitOrder::Big).unwrap();
        }
    });
    println!("{:<50} {:>10.3}", "worker + server (2 rows) + output", fused.as_secs_f64() * 1e3);
    let traffic = two_threads(n, rounds, |x, u, m, _| {
        for (u, x) in u.iter_mut().zip(x.iter()) {
            *u += *x;
        }
        for m in m.iter_mut() {
            *m += 1.0;
        }
        x.fill(black_box(0.5));
    });
    println!("{:<50} {:>10.3}", "their memory traffic only", traffic.as_secs_f64() * 1e3);
}

/// Runs `pass(x, u, m, signs)` `rounds` times on each of 2 threads with buffers of its own,
/// both threads starting each round together; the median over rounds of the slower thread.
fn two_threads(
    n: usize,
    rounds: usize,
    pass: impl Fn(&mut [f32], &mut [f32], &mut [f32], &mut [u8]) + Sync,
) -> Duration {
    let barrier = std::sync::Barrier::new(2);
    let times: Vec<Vec<Duration>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|t| {
                let (barrier, pass) = (&barrier, &pass);
                s.spawn(move || {
                    let mut x: Vec<f32> = (0..n).map(|k| ((k * 7 + t) % 101) as f32 / 50.0 - 1.0).collect();
                    let (mut u, mut m, mut signs) =
                        (vec![0.25f32; n], vec![0.5f32; n / 2], vec![0x5Au8; n / 8 + n / 16]);
                    (0..rounds + 1)
                        .map(|_| {
                            barrier.wait();
                            let start = Instant::now();
                            pass(&mut x, &mut u, &mut m, &mut signs);
                            start.elapsed()
                        })
                        .skip(1)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("bench thread")).collect()
    });
    let mut slower: Vec<Duration> = times[0].iter().zip(&times[1]).map(|(a, b)| *a.max(b)).collect();
    slower.sort();
    slower[slower.len() / 2]
}
