//! Tests of `oxcomm::compression::coalesced`: the spec's `reduce_scatter_coalesced` vectors
//! (§3.1) and fallback cases (§5.4), qgZ on thread ranks laid out as hosts (§3.3) against an
//! independent sequential simulation and against the exact mean within the error bound of
//! the int4 kernels, the bytes that cross hosts, and the preconditions DeepSpeed leaves
//! unchecked (§3.7).

use half::{bf16, f16};
use oxcomm::compression::coalesced::{partition, reduce_scatter_coalesced};
use oxcomm::compression::host_groups::HostGroups;
use oxcomm::compression::qgz::{
    all_to_all_quant_reduce, all_to_all_quant_reduce_report, QuantReduceReport, TensorView,
};
use oxcomm::compression::quant::{self, QuantBits, QuantFloat, QuantType};
use oxcomm::dtype::as_bytes;
use oxcomm::{threads, DType, ErrorKind, ReduceOp};

// ------------------------------------------------------------------------------------------
// reduce_scatter_coalesced

fn f16s(v: &[f32]) -> Vec<f16> {
    v.iter().map(|&x| f16::from_f32(x)).collect()
}

/// Spec §3.1, n = 2, fp16: one input of 6 elements, every entry the rank's id.
#[test]
fn spec_coalesced_one_input() {
    let out = threads::run(2, |comm| {
        let x = f16s(&[comm.rank() as f32; 6]);
        reduce_scatter_coalesced(&comm, &[&x]).unwrap()
    })
    .unwrap();
    for o in out {
        assert_eq!(o, vec![f16s(&[0.5; 3])]);
    }
}

/// Spec §3.1: rank ρ passes `ρ·[0..5]` and `ρ·[6..8]`.
#[test]
fn spec_coalesced_two_inputs() {
    let out = threads::run(2, |comm| {
        let r = comm.rank() as f32;
        let a = f16s(&[0., 1., 2., 3., 4., 5.].map(|v| v * r));
        let b = f16s(&[6., 7., 8.].map(|v| v * r));
        reduce_scatter_coalesced(&comm, &[&a, &b]).unwrap()
    })
    .unwrap();
    assert_eq!(out[0], vec![f16s(&[0., 0.5, 1.]), f16s(&[3., 3.5])]);
    assert_eq!(out[1], vec![f16s(&[1.5, 2., 2.5]), f16s(&[4.])]);
}

/// Spec §3.1: one input of one element gives rank 0 shape (1,) and rank 1 shape (0,).
#[test]
fn spec_coalesced_one_element() {
    let out = threads::run(2, |comm| {
        let x = f16s(&[comm.rank() as f32 + 1.0]);
        reduce_scatter_coalesced(&comm, &[&x]).unwrap()
    })
    .unwrap();
    assert_eq!(out[0], vec![f16s(&[1.5])]);
    assert_eq!(out[1], vec![Vec::<f16>::new()]);
}

/// Every length from 0 to 11 over 1..=5 ranks, several tensors at once, with integer data
/// (summed, then divided once, truncating) and power-of-two-scaled floats (exact): each rank
/// gets exactly the ceil partition of the mean.
#[test]
fn coalesced_matches_ceil_partitions_exactly() {
    let lens = [0usize, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11];
    for n in 1..=5usize {
        let out = threads::run(n, |comm| {
            let r = comm.rank() as i32;
            let ints: Vec<Vec<i32>> = lens
                .iter()
                .enumerate()
                .map(|(t, &l)| (0..l as i32).map(|i| 100 * t as i32 + i + r).collect())
                .collect();
            let refs: Vec<&[i32]> = ints.iter().map(|v| v.as_slice()).collect();
            let floats: Vec<Vec<f64>> = ints.iter().map(|v| v.iter().map(|&x| f64::from(x) * 8.0).collect()).collect();
            let frefs: Vec<&[f64]> = floats.iter().map(|v| v.as_slice()).collect();
            (reduce_scatter_coalesced(&comm, &refs).unwrap(), reduce_scatter_coalesced(&comm, &frefs).unwrap())
        })
        .unwrap();
        let rank_sum: i32 = (0..n as i32).sum();
        for (r, (ints, floats)) in out.iter().enumerate() {
            for (t, &l) in lens.iter().enumerate() {
                let part = partition(l, n, r);
                let want: Vec<i32> =
                    part.clone().map(|i| (n as i32 * (100 * t as i32 + i as i32) + rank_sum) / n as i32).collect();
                assert_eq!(ints[t], want, "n {n} rank {r} tensor {t} (i32)");
                let want: Vec<f64> =
                    part.map(|i| 8.0 * (n as f64 * (100 * t + i) as f64 + f64::from(rank_sum)) / n as f64).collect();
                for (a, b) in floats[t].iter().zip(&want) {
                    assert!((a - b).abs() <= 1e-12 * b.abs(), "n {n} rank {r} tensor {t}: {a} vs {b}");
                }
                assert_eq!(floats[t].len(), want.len());
            }
        }
    }
}

#[test]
fn coalesced_with_no_tensors_is_empty() {
    let out = threads::run(3, |comm| reduce_scatter_coalesced::<f32>(&comm, &[]).unwrap()).unwrap();
    assert!(out.iter().all(|o| o.is_empty()));
}

// ------------------------------------------------------------------------------------------
// qgZ fallbacks (spec §5.4: world 2, one node)

#[test]
fn spec_qgz_fallback_one_dimensional() {
    let out = threads::run(2, |comm| {
        let x = vec![f16::ZERO; 10];
        all_to_all_quant_reduce_report(&comm, &[TensorView::flat(&x)], None).unwrap()
    })
    .unwrap();
    for (o, rep) in out {
        assert_eq!(o, vec![vec![f16::ZERO; 5]]);
        assert_eq!((rep.fallback, rep.quantized), (1, 0));
    }
}

#[test]
fn spec_qgz_fallback_not_divisible_by_2w() {
    let out = threads::run(2, |comm| {
        let x = vec![f16::ZERO; 49];
        all_to_all_quant_reduce_report(&comm, &[TensorView::new(&x, &[7, 7]).unwrap()], None).unwrap()
    })
    .unwrap();
    assert_eq!(out[0].0[0].len(), 25);
    assert_eq!(out[1].0[0].len(), 24);
    for (o, rep) in &out {
        assert!(o[0].iter().all(|v| *v == f16::ZERO));
        assert_eq!((rep.fallback, rep.quantized), (1, 0));
        assert_eq!(rep.inter, Default::default());
    }
}

/// The fallback is exact (the mean with ceil partitions) on a multi-host layout too, and an
/// empty 2-D tensor takes it rather than the quantized path.
#[test]
fn qgz_fallback_is_the_exact_mean_on_hosts() {
    let out = threads::run(4, |comm| {
        let groups = HostGroups::uniform(&comm, 2).unwrap();
        let r = comm.rank() as f32;
        let odd: Vec<f32> = (0..15).map(|i| i as f32 + 4.0 * r).collect(); // 15 % 8 ≠ 0
        let flat: Vec<f32> = (0..8).map(|i| i as f32 * r).collect();
        let empty: Vec<f32> = Vec::new();
        let ts = [
            TensorView::new(&odd, &[3, 5]).unwrap(),
            TensorView::flat(&flat),
            TensorView::new(&empty, &[0, 4]).unwrap(),
        ];
        all_to_all_quant_reduce_report(&comm, &ts, Some(&groups)).unwrap()
    })
    .unwrap();
    for (r, (o, rep)) in out.iter().enumerate() {
        assert_eq!((rep.fallback, rep.quantized), (3, 0));
        let want: Vec<f32> = partition(15, 4, r).map(|i| i as f32 + 6.0).collect();
        assert_eq!(o[0], want);
        let want: Vec<f32> = partition(8, 4, r).map(|i| i as f32 * 1.5).collect();
        assert_eq!(o[1], want);
        assert!(o[2].is_empty());
    }
}

// ------------------------------------------------------------------------------------------
// qgZ quantized path

/// Deterministic test data: rank `s`, tensor `t`, `n` elements. Rows of different
/// magnitudes, a group of zeros, some all-negative groups and exact `±amax` hits, so scales
/// vary and the clamp of `+amax` to code 7 happens.
fn data<T: QuantFloat>(seed: u64, s: usize, t: usize, n: usize) -> Vec<T> {
    let mut x = seed ^ ((s as u64) << 32) ^ ((t as u64) << 48) ^ 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0; // [-1, 1)
            let magnitude = [1.0, 0.01, 250.0, 3.5][(i / 32) % 4];
            let v = match (i / 16) % 9 {
                0 => 0.0,
                1 => -u.abs() * magnitude,
                2 if i % 16 == 3 => magnitude,
                _ => u * magnitude,
            };
            T::from_f32(v as f32)
        })
        .collect()
}

/// One tensor shape and its qgZ sizes on W ranks.
#[derive(Clone, Copy)]
struct Case {
    shape: &'static [usize],
}

impl Case {
    fn numel(self) -> usize {
        self.shape.iter().product()
    }

    /// `(P, E)`: elements per partition and per group.
    fn sizes(self, w: usize) -> (usize, usize) {
        let n = self.numel();
        let g = self.shape[0].max(self.shape[1]).max(w);
        (n / w, n / g)
    }
}

/// 2-D and 3-D shapes that take the quantized path on 4 and 8 ranks.
const CASES: [Case; 3] = [Case { shape: &[64, 256] }, Case { shape: &[48, 16] }, Case { shape: &[4, 8, 16] }];

/// The quantized result, computed one partition at a time straight from spec §3.3 with the
/// public kernels (no swizzle, no buffers, no communication): host sums of the dequantized
/// int4 codes, requantized, summed over hosts in host order, divided by W, rounded once. The
/// f32 arithmetic is in the same order as the collective's, so the results are bit-identical.
fn simulate<T: QuantFloat>(inputs: &[Vec<T>], w: usize, dpn: usize, p: usize, e: usize, z: usize) -> Vec<T> {
    let (bits, ty) = (QuantBits::Int4, QuantType::Symmetric);
    let nodes = w / dpn;
    let quantize = |x: &[f32]| {
        let mut q = vec![0u8; x.len() / 2];
        let mut s = vec![0f32; x.len() / e];
        quant::quantize(x, e, bits, ty, &mut q, &mut s).unwrap();
        (q, s)
    };
    let quantize_t = |x: &[T]| {
        let mut q = vec![0u8; x.len() / 2];
        let mut s = vec![0f32; x.len() / e];
        quant::quantize(x, e, bits, ty, &mut q, &mut s).unwrap();
        (q, s)
    };
    let add =
        |(q, s): &(Vec<u8>, Vec<f32>), acc: &mut [f32]| quant::dequantize_add_f32(q, s, e, bits, ty, acc).unwrap();
    let mut total = vec![0f32; p];
    for node in 0..nodes {
        let part = |s: usize| &inputs[node * dpn + s][z * p..(z + 1) * p];
        if dpn == 1 {
            add(&quantize_t(part(0)), &mut total);
            continue;
        }
        let mut host = vec![0f32; p];
        for j in 0..dpn {
            add(&quantize_t(part(j)), &mut host);
        }
        if nodes == 1 {
            total = host;
        } else {
            add(&quantize(&host), &mut total);
        }
    }
    total.into_iter().map(|v| T::from_f32(v / w as f32)).collect()
}

/// Checks rank `z`'s output of one case against the exact mean, within
/// `(steps / W) · Σ_ranks s1` plus rounding, where `s1 = amax / 8` is each rank's first-stage
/// scale of the element's group and `steps` counts quantizations on the path (2, or 1 with
/// one host or one rank per host).
///
/// Derivation: the kernels round to nearest, so a quantized value is off by at most half a
/// step, or by at most one step where `+amax · 8/amax = 8` clamps to code 7; we use one step
/// for both. Stage 1 puts an error of at most `s1_s` on every rank's value. Stage 2 requantizes
/// a host's sum, whose magnitude is at most `Σ_{s on the host} 8 · s1_s` (a dequantized code
/// is at most 8 steps), so its scale is `s2 ≤ Σ_{s on the host} s1_s` and its error at most
/// that. Summing over hosts and dividing by W gives `(1/W)(Σ_s s1_s + Σ_hosts s2) ≤
/// (2/W) Σ_s s1_s`. f32 sums and the final rounding to `T` add the slack below.
fn check_bound<T: QuantFloat>(inputs: &[Vec<T>], out: &[T], w: usize, steps: f64, p: usize, e: usize, z: usize) {
    assert_eq!(out.len(), p);
    let eps_t = match T::DTYPE {
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        _ => 2f64.powi(-24),
    };
    for (i, o) in out.iter().enumerate() {
        let k = z * p + i;
        let g = k / e;
        let mut s1_sum = 0f64;
        let mut mean = 0f64;
        for x in inputs {
            let amax = x[g * e..(g + 1) * e].iter().fold(0f64, |m, v| m.max(f64::from(v.to_f32()).abs()));
            s1_sum += amax / 8.0;
            mean += f64::from(x[k].to_f32());
        }
        mean /= w as f64;
        let bound = steps * s1_sum / w as f64;
        let slack = 1e-5 * s1_sum + eps_t * (mean.abs() + bound) + 1e-30;
        let err = (f64::from(o.to_f32()) - mean).abs();
        assert!(
            err <= bound + slack,
            "rank {z} element {i}: {} vs mean {mean}: error {err} > bound {bound}",
            o.to_f32()
        );
    }
}

/// Runs qgZ on `w` ranks as `w / dpn` hosts (`None`: one host, no groups passed) over every
/// case plus a 1-D tensor, and checks each rank against the simulation (bit-exact) and the
/// bound; the 1-D tensor must be the exact mean.
fn qgz_matches<T: QuantFloat>(w: usize, dpn: Option<usize>, seed: u64) {
    let results = threads::run(w, |comm| {
        let groups = dpn.map(|d| HostGroups::uniform(&comm, d).unwrap());
        let s = comm.rank();
        let mine: Vec<Vec<T>> = CASES.iter().enumerate().map(|(t, c)| data(seed, s, t, c.numel())).collect();
        let flat: Vec<T> = (0..10).map(|i| T::from_f32((i + 2 * s) as f32)).collect();
        let mut views: Vec<TensorView<'_, T>> =
            CASES.iter().zip(&mine).map(|(c, x)| TensorView::new(x, c.shape).unwrap()).collect();
        views.insert(1, TensorView::flat(&flat));
        all_to_all_quant_reduce_report(&comm, &views, groups.as_ref()).unwrap()
    })
    .unwrap();
    let d = dpn.unwrap_or(w);
    let steps = if d > 1 && w / d > 1 { 2.0 } else { 1.0 };
    for (t, case) in CASES.iter().enumerate() {
        let inputs: Vec<Vec<T>> = (0..w).map(|s| data(seed, s, t, case.numel())).collect();
        let (p, e) = case.sizes(w);
        for (z, (out, _)) in results.iter().enumerate() {
            let o = &out[if t == 0 { 0 } else { t + 1 }];
            let want = simulate(&inputs, w, d, p, e, z);
            assert!(
                as_bytes(o) == as_bytes(&want),
                "w {w} dpn {d} case {:?} rank {z}: differs from the simulation",
                case.shape
            );
            check_bound(&inputs, o, w, steps, p, e, z);
        }
    }
    for (z, (out, rep)) in results.iter().enumerate() {
        assert_eq!((rep.quantized, rep.fallback), (CASES.len(), 1));
        // Mean of i + 2s over s < w: i + w − 1 (every partial sum is exact in bf16 too).
        let want: Vec<T> = partition(10, w, z).map(|i| T::from_f32((i + w - 1) as f32)).collect();
        assert_eq!(out[1], want, "1-D fallback, rank {z}");
    }
}

#[test]
fn qgz_2_hosts_x_2_ranks_f32() {
    qgz_matches::<f32>(4, Some(2), 1);
}

#[test]
fn qgz_2_hosts_x_4_ranks_f32() {
    qgz_matches::<f32>(8, Some(4), 2);
}

#[test]
fn qgz_2_hosts_x_2_ranks_f16_and_bf16() {
    qgz_matches::<f16>(4, Some(2), 3);
    qgz_matches::<bf16>(4, Some(2), 4);
}

#[test]
fn qgz_2_hosts_x_4_ranks_bf16() {
    qgz_matches::<bf16>(8, Some(4), 5);
}

/// One host (no groups): one quantization, the host sums are the answer.
#[test]
fn qgz_one_host() {
    qgz_matches::<f32>(4, None, 6);
}

/// One rank per host: the reduction step is skipped, codes go straight across hosts.
#[test]
fn qgz_one_rank_per_host() {
    qgz_matches::<f32>(4, Some(1), 7);
}

/// The quantized path and the exact fallback agree on the mean (DeepSpeed's quantized path
/// would give `dpn ×` the mean): all-equal inputs quantize exactly.
#[test]
fn qgz_returns_the_mean_not_sum_over_hosts() {
    let out = threads::run(4, |comm| {
        let groups = HostGroups::uniform(&comm, 2).unwrap();
        // −v or 0, with v a power of two per rank and per host sum, so that every stage is
        // exact: −amax maps to code −8 with the scale amax/8.
        let v = [1.0f32, 1.0, 2.0, 2.0][comm.rank()];
        let x: Vec<f32> = (0..64).map(|i| if i % 2 == 0 { -v } else { 0.0 }).collect();
        all_to_all_quant_reduce(&comm, &[TensorView::new(&x, &[8, 8]).unwrap()], Some(&groups)).unwrap()
    })
    .unwrap();
    // Host sums −2 and −4; the mean is −6/4 = −1.5 (DeepSpeed's Σ/nodes would be −3).
    for (z, o) in out.iter().enumerate() {
        let want: Vec<f32> = (16 * z..16 * (z + 1)).map(|i| if i % 2 == 0 { -1.5 } else { 0.0 }).collect();
        assert_eq!(o[0], want, "rank {z}");
    }
}

// ------------------------------------------------------------------------------------------
// Bytes across hosts

/// Bytes sent by the quantized path's inter-host phase (the only traffic that crosses hosts)
/// against an exact ring reduce-scatter of the same data, in f32 and in f16, measured with
/// `comm.stats()` deltas in the same run.
///
/// In the ring, rank r sends only to r + 1 (plus a 48-byte fingerprint to rank 0 during
/// agreement), so the ring's cross-host bytes are the `bytes_sent` of the ranks whose
/// successor is on another host: the last rank of each host. We require the qgZ inter phase
/// to send at most 1/8 of that for f32 and 1/4 for f16, and no more than its int4 payload plus
/// the agreement overhead.
fn cross_host_bytes(w: usize, dpn: usize) {
    let case = CASES[0];
    let (p, e) = case.sizes(w);
    let nodes = w / dpn;
    let rows = threads::run(w, |comm| {
        let groups = HostGroups::uniform(&comm, dpn).unwrap();
        let x: Vec<f32> = data(9, comm.rank(), 0, case.numel());
        let x16: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let (_, rep) =
            all_to_all_quant_reduce_report(&comm, &[TensorView::new(&x, case.shape).unwrap()], Some(&groups)).unwrap();
        let mut o = vec![0f32; p];
        let before = comm.stats();
        comm.reduce_scatter(&x, &mut o, ReduceOp::Avg).unwrap();
        let rs32 = comm.stats().bytes_sent - before.bytes_sent;
        let mut o16 = vec![f16::ZERO; p];
        let before = comm.stats();
        comm.reduce_scatter(&x16, &mut o16, ReduceOp::Avg).unwrap();
        let rs16 = comm.stats().bytes_sent - before.bytes_sent;
        (rep, rs32, rs16)
    })
    .unwrap();
    let inter: u64 = rows.iter().map(|(rep, ..)| rep.inter.bytes_sent).sum();
    let boundary = |r: &usize| r % dpn == dpn - 1;
    let cross32: u64 = (0..w).filter(boundary).map(|r| rows[r].1).sum();
    let cross16: u64 = (0..w).filter(boundary).map(|r| rows[r].2).sum();
    let payload_per_rank = ((nodes - 1) * (p / 2 + 4 * (p / e))) as u64;
    for (r, (rep, rs32, _)) in rows.iter().enumerate() {
        let QuantReduceReport { inter, intra, .. } = *rep;
        assert!(inter.bytes_sent >= payload_per_rank, "rank {r}: {inter:?}");
        assert!(inter.bytes_sent <= payload_per_rank + 256, "rank {r}: {inter:?} vs payload {payload_per_rank}");
        assert!(intra.bytes_sent + inter.bytes_sent < rs32 / 4, "rank {r}: qgZ moved {intra:?} + {inter:?}");
    }
    assert!(8 * inter <= cross32, "{w} ranks: qgZ sent {inter} bytes across hosts, f32 ring {cross32}");
    assert!(4 * inter <= cross16, "{w} ranks: qgZ sent {inter} bytes across hosts, f16 ring {cross16}");
    let total32: u64 = rows.iter().map(|r| r.1).sum();
    eprintln!(
        "{nodes} hosts x {dpn}: qgZ inter-host {inter} B, f32 ring reduce-scatter {total32} B total / {cross32} B \
         across hosts, f16 ring {cross16} B across hosts"
    );
}

#[test]
fn qgz_cross_host_bytes_2x2() {
    cross_host_bytes(4, 2);
}

#[test]
fn qgz_cross_host_bytes_2x4() {
    cross_host_bytes(8, 4);
}

// ------------------------------------------------------------------------------------------
// Preconditions (spec §3.7): errors before anything is sent, on every rank

/// Shape (40, 8) on 16 ranks passes DeepSpeed's `N % 2W` check but has G = 40 groups, not a
/// multiple of 16: DeepSpeed misroutes data silently; we refuse.
#[test]
fn qgz_rejects_groups_not_a_multiple_of_w() {
    let out = threads::run(16, |comm| {
        let x = vec![1.0f32; 320];
        let e = all_to_all_quant_reduce(&comm, &[TensorView::new(&x, &[40, 8]).unwrap()], None).unwrap_err();
        // Nothing was sent, and the communicator still works.
        let sent = comm.stats().bytes_sent;
        let mut v = [1i32];
        comm.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        (e, sent, v[0])
    })
    .unwrap();
    for (e, sent, v) in out {
        assert_eq!(sent, 0);
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("not a multiple of W = 16"), "{e}");
        assert_eq!(v, 16);
    }
}

/// Shape (7, 8) on 4 ranks: G = 8, E = 7, odd, cannot be int4-packed per group.
#[test]
fn qgz_rejects_odd_groups() {
    let out = threads::run(4, |comm| {
        let x = vec![1.0f32; 56];
        all_to_all_quant_reduce(&comm, &[TensorView::new(&x, &[7, 8]).unwrap()], None).unwrap_err()
    })
    .unwrap();
    for e in out {
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("odd"), "{e}");
    }
}

#[test]
fn host_groups_preconditions() {
    let out = threads::run(4, |comm| {
        let bad_size = HostGroups::uniform(&comm, 3).unwrap_err();
        let zero = HostGroups::uniform(&comm, 0).unwrap_err();
        let g = HostGroups::uniform(&comm, 2).unwrap();
        let facts = (g.hosts(), g.ranks_per_host(), g.host(), g.local_rank(), g.intra().size(), g.inter().size());
        // Swapped groups do not match the layout.
        let swapped = HostGroups::from_parts(&comm, 2, g.inter().clone(), g.intra().clone()).unwrap_err();
        // Groups built for the world, used on a sub-communicator.
        let sub = comm.split(Some((comm.rank() % 2) as u32), 0).unwrap().unwrap();
        let x = vec![1.0f32; 64];
        let foreign = all_to_all_quant_reduce(&sub, &[TensorView::new(&x, &[8, 8]).unwrap()], Some(&g)).unwrap_err();
        (bad_size, zero, facts, swapped, foreign)
    })
    .unwrap();
    for (r, (bad_size, zero, facts, swapped, foreign)) in out.into_iter().enumerate() {
        for e in [bad_size, zero, swapped, foreign] {
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        }
        assert_eq!(facts, (2, 2, r / 2, r % 2, 2, 2));
    }
    assert_eq!(TensorView::new(&[1.0f32; 6], &[4, 2]).unwrap_err().kind(), ErrorKind::InvalidArgument);
}

/// A tensor large enough that steps 3–5 run in stripes (two, of 187 and 188 groups per
/// partition) with the inter-host exchange on a helper thread: still bit-identical to the
/// simulation.
#[test]
fn qgz_large_tensor_in_stripes_matches_simulation() {
    let (w, dpn) = (4, 2);
    let case = Case { shape: &[1040, 1500] };
    let results = threads::run(w, |comm| {
        let groups = HostGroups::uniform(&comm, dpn).unwrap();
        let x: Vec<f32> = data(5, comm.rank(), 0, case.numel());
        all_to_all_quant_reduce(&comm, &[TensorView::new(&x, case.shape).unwrap()], Some(&groups)).unwrap()
    })
    .unwrap();
    let inputs: Vec<Vec<f32>> = (0..w).map(|s| data(5, s, 0, case.numel())).collect();
    let (p, e) = case.sizes(w);
    for (z, out) in results.iter().enumerate() {
        let want = simulate(&inputs, w, dpn, p, e, z);
        assert!(as_bytes(&out[0]) == as_bytes(&want), "rank {z}: differs from the simulation");
    }
}

/// Host groups from the communicator's own topology: contiguous hosts give the same result as
/// `uniform` (bit for bit); one host gives none; interleaved hosts are an argument error.
#[test]
fn qgz_host_groups_from_topology() {
    let config = oxcomm::CommConfig::default();
    let out = threads::run_on_hosts(&[0, 0, 1, 1], config.clone(), |comm| {
        let x: Vec<f32> = (0..4096).map(|i| ((i * 7 + comm.rank() * 13) % 29) as f32 - 14.0).collect();
        let t = [TensorView::new(&x, &[4, 1024]).unwrap()];
        let topo = HostGroups::from_topology(&comm).unwrap().expect("two hosts of two ranks");
        let uniform = HostGroups::uniform(&comm, 2).unwrap();
        let a = all_to_all_quant_reduce_report(&comm, &t, Some(&topo)).unwrap();
        let b = all_to_all_quant_reduce_report(&comm, &t, Some(&uniform)).unwrap();
        (a.0 == b.0, a.1.quantized)
    })
    .unwrap();
    assert!(out.iter().all(|(same, q)| *same && *q == 1), "{out:?}");
    let none = threads::run(4, |comm| HostGroups::from_topology(&comm).unwrap().is_none()).unwrap();
    assert!(none.iter().all(|n| *n));
    let bad = threads::run_on_hosts(&[0, 1, 0, 1], config, |comm| HostGroups::from_topology(&comm).unwrap_err().kind())
        .unwrap();
    assert!(bad.iter().all(|k| *k == ErrorKind::InvalidArgument));
}
