//! Tests of `oxcomm::compression::{pack, quant}`: wire layouts by hand, the spec's worked
//! examples (§2.6, §3.4), rounding and clamping, error bounds, and fast kernels against the
//! scalar references.

use half::{bf16, f16};
use oxcomm::compression::pack::{self, BitOrder};
use oxcomm::compression::quant::{self, QuantBits, QuantFloat, QuantType};
use oxcomm::ErrorKind;
use proptest::prelude::*;

// ------------------------------------------------------------------------------------------
// Sign packing

/// Signs: 1, 0, 1 (+0), 1 (−0), 1 (NaN), 0, 1, 0 (−∞).
const MIXED: [f32; 8] = [1.0, -1.0, 0.0, -0.0, f32::NAN, -2.0, 3.0, f32::NEG_INFINITY];

#[test]
fn pack_layout_big_and_little_by_hand() {
    let mut b = [0u8; 1];
    pack::pack_signs(&MIXED, &mut b, BitOrder::Big).unwrap();
    // Element j at bit 7 − j: 1011_1010.
    assert_eq!(b[0], 0b1011_1010);
    pack::pack_signs(&MIXED, &mut b, BitOrder::Little).unwrap();
    // Element j at bit j: 0101_1101.
    assert_eq!(b[0], 0b0101_1101);

    let mut one_hot = [-1.0f32; 16];
    one_hot[9] = 5.0; // byte 1, j = 1
    let mut b = [0u8; 2];
    pack::pack_signs(&one_hot, &mut b, BitOrder::Big).unwrap();
    assert_eq!(b, [0x00, 0x40]);
    pack::pack_signs(&one_hot, &mut b, BitOrder::Little).unwrap();
    assert_eq!(b, [0x00, 0x02]);
}

#[test]
fn zeros_and_nans_of_either_sign_pack_as_one() {
    let specials = [0.0f32, -0.0, f32::NAN, -f32::NAN, f32::from_bits(0xFFC0_0001), 0.0, -0.0, 1e-45];
    for order in [BitOrder::Big, BitOrder::Little] {
        let mut b = [0u8; 1];
        pack::pack_signs(&specials, &mut b, order).unwrap();
        assert_eq!(b[0], 0xFF, "{order:?}");
        let tiny_negative = [-1e-45f32; 8];
        pack::pack_signs(&tiny_negative, &mut b, order).unwrap();
        assert_eq!(b[0], 0x00, "{order:?}");
    }
}

/// Spec §2.6: the packed worker sign chunks of both ranks (zero padding counts as ≥ 0).
#[test]
fn spec_onebit_worker_sign_bytes() {
    let rank0 = [-6.0f32, -5., -4., -3., -2., -1., 0., 1., 2., 3., 4., 5., 6., 0., 0., 0.];
    let rank1 = [-3.0f32, 2., 0., -2., 3., 1., -1., -3., 2., 0., -2., 3., 1., 0., 0., 0.];
    let mut b = [0u8; 2];
    pack::pack_signs(&rank0, &mut b, BitOrder::Big).unwrap();
    assert_eq!(b, [0x03, 0xFF]);
    pack::pack_signs(&rank1, &mut b, BitOrder::Big).unwrap();
    assert_eq!(b, [0x6C, 0xDF]);
    // The NPU order is the same bits, each byte reversed.
    pack::pack_signs(&rank1, &mut b, BitOrder::Little).unwrap();
    assert_eq!(b, [0x6Cu8.reverse_bits(), 0xDFu8.reverse_bits()]);
}

/// Spec §2.6, server side of rank 0: average the two decompressed chunks with
/// `unpack_scaled_add(α_i / n)`, then β₀ and the server error match the worked example.
#[test]
fn spec_onebit_server_average() {
    let n = 2.0f32;
    let alpha = [3.372_684_f32, 1.854_05];
    let chunks = [0x03u8, 0x6C];
    let mut m = [0.0f32; 8];
    for (&byte, &a) in chunks.iter().zip(&alpha) {
        pack::unpack_scaled_add(&[byte], &mut m, a * (1.0 / n), BitOrder::Big).unwrap();
    }
    let beta = (m.iter().map(|v| v * v).sum::<f32>() / 8.0).sqrt();
    assert!((beta - 1.462821).abs() < 1e-5, "beta {beta}");
    let want_err = [-1.150546f32, 0.703503, 0.703503, -1.150546, 0.703503, 0.703503, -0.703503, -0.703503];
    for (k, (&mk, &w)) in m.iter().zip(&want_err).enumerate() {
        let s = if mk < 0.0 { -1.0 } else { 1.0 };
        let err = mk - beta * s;
        assert!((err - w).abs() < 1e-5, "k={k}: {err} vs {w}");
    }
    let mut sb = [0u8; 1];
    pack::pack_signs(&m, &mut sb, BitOrder::Big).unwrap();
    assert_eq!(sb[0], 0x03);
}

#[test]
fn unpack_to_signs_and_scaled() {
    let mut out = [0.0f32; 8];
    pack::unpack_signs(&[0b1011_1010], &mut out, BitOrder::Big).unwrap();
    assert_eq!(out, [1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 1.0, -1.0]);
    pack::unpack_signs(&[0b0101_1101], &mut out, BitOrder::Little).unwrap();
    assert_eq!(out, [1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 1.0, -1.0]);
    pack::unpack_scaled(&[0xF0], &mut out, 0.25, BitOrder::Big).unwrap();
    assert_eq!(out, [0.25, 0.25, 0.25, 0.25, -0.25, -0.25, -0.25, -0.25]);
    let mut acc = [1.0f32; 8];
    pack::unpack_scaled_add(&[0x0F], &mut acc, 0.5, BitOrder::Little).unwrap();
    assert_eq!(acc, [1.5, 1.5, 1.5, 1.5, 0.5, 0.5, 0.5, 0.5]);
}

#[test]
fn pack_rejects_bad_lengths_and_writes_nothing() {
    let src = [1.0f32; 7];
    let mut dst = [0xAAu8; 1];
    let e = pack::pack_signs(&src, &mut dst, BitOrder::Big).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(dst, [0xAA]);
    let src = [1.0f32; 16];
    let e = pack::pack_signs(&src, &mut dst, BitOrder::Big).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(dst, [0xAA]);

    let mut out = [7.0f32; 9];
    for r in [
        pack::unpack_signs(&[0xFF], &mut out, BitOrder::Big),
        pack::unpack_scaled(&[0xFF], &mut out, 2.0, BitOrder::Big),
        pack::unpack_scaled_add(&[0xFF], &mut out, 2.0, BitOrder::Little),
        pack::unpack_scaled_add(&[0xFF, 0xFF], &mut out[..8], 2.0, BitOrder::Little),
    ] {
        assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidArgument);
    }
    assert_eq!(out, [7.0; 9]);
    assert_eq!(pack::packed_len(16), 2);
    // Empty is fine.
    pack::pack_signs(&[], &mut [], BitOrder::Big).unwrap();
}

fn any_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        4 => -1e3f32..1e3,
        2 => any::<f32>(),
        1 => Just(0.0f32),
        1 => Just(-0.0f32),
        1 => Just(f32::NAN),
        1 => Just(-f32::NAN),
    ]
}

fn order() -> impl Strategy<Value = BitOrder> {
    prop_oneof![Just(BitOrder::Big), Just(BitOrder::Little)]
}

fn bits_of(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn pack_matches_scalar(bytes in 0usize..70, seed in prop::collection::vec(any_f32(), 8), order in order()) {
        // Length a multiple of 8 (up to 560), values cycling through `seed` with a twist.
        let n = bytes * 8;
        let src: Vec<f32> = (0..n).map(|i| seed[i % 8] * if i % 3 == 0 { -1.0 } else { 1.0 }).collect();
        let mut fast = vec![0u8; bytes];
        let mut slow = vec![0u8; bytes];
        pack::pack_signs(&src, &mut fast, order).unwrap();
        pack::scalar::pack_signs(&src, &mut slow, order);
        prop_assert_eq!(&fast, &slow);
        // Round trip to signs: +1 unless x < 0.
        let mut signs = vec![0f32; n];
        pack::unpack_signs(&fast, &mut signs, order).unwrap();
        for (x, s) in src.iter().zip(&signs) {
            prop_assert_eq!(*s, if *x < 0.0 { -1.0 } else { 1.0 });
        }
    }

    #[test]
    fn unpack_matches_scalar(
        packed in prop::collection::vec(any::<u8>(), 0..70),
        acc_seed in prop::collection::vec(-1e3f32..1e3, 8),
        scale in prop_oneof![-1e3f32..1e3, Just(0.0f32), Just(-0.0f32), Just(f32::INFINITY)],
        order in order(),
    ) {
        let n = packed.len() * 8;
        let acc0: Vec<f32> = (0..n).map(|i| acc_seed[i % 8] + i as f32).collect();
        let (mut fast, mut slow) = (vec![0f32; n], vec![0f32; n]);
        pack::unpack_scaled(&packed, &mut fast, scale, order).unwrap();
        pack::scalar::unpack_scaled(&packed, &mut slow, scale, order);
        prop_assert_eq!(bits_of(&fast), bits_of(&slow));
        let (mut fast, mut slow) = (acc0.clone(), acc0);
        pack::unpack_scaled_add(&packed, &mut fast, scale, order).unwrap();
        pack::scalar::unpack_scaled_add(&packed, &mut slow, scale, order);
        prop_assert_eq!(bits_of(&fast), bits_of(&slow));
    }
}

// ------------------------------------------------------------------------------------------
// Fused 1-bit all-reduce passes

fn same_sum(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// The worker pass against the unfused steps it replaces (the last call's `subtract_signs`,
/// `u + x` where `x` reaches, `pack_signs`, the sum of squares): NaN, ±0, ±∞ and a `−0`
/// in the padding, which must stay `−0` when nothing is carried.
#[test]
fn add_pack_squares_by_hand() {
    let u = [1.0f32, -0.0, 2.0, -3.0, f32::NAN, 0.5, -0.0, 4.0, -1.0, -0.0, 0.0, 1.0, -2.0, 3.0, 0.25, -0.0];
    let x = [-2.0f32, 0.0, -2.0, 3.0, 1.0, -1.0, 0.0, -4.0, 1.0, -0.0, -0.0]; // 11 of 16
    for (order, carry) in [(BitOrder::Big, 0.0), (BitOrder::Little, 0.0), (BitOrder::Big, 0.75)] {
        let mut fused = u;
        let mut signs = [0u8; 2];
        let ss = pack::add_pack_squares(&mut fused, carry, &x, &mut signs, order).unwrap();
        let mut want = u;
        pack::subtract_signs(&mut want, carry);
        for (w, &xk) in want.iter_mut().zip(&x) {
            *w += xk;
        }
        assert!(same_f32(&fused, &want), "{fused:?}");
        if carry == 0.0 {
            assert_eq!(fused[15].to_bits(), (-0.0f32).to_bits(), "padding keeps −0");
        }
        let mut want_signs = [0u8; 2];
        pack::pack_signs(&want, &mut want_signs, order).unwrap();
        assert_eq!(signs, want_signs);
        assert!(ss.is_nan()); // the NaN element
    }
    let mut u = u;
    u[4] = 7.0;
    let mut signs = [0u8; 2];
    let ss = pack::add_pack_squares(&mut u, 0.0, &[], &mut signs, BitOrder::Big).unwrap();
    let want: f64 = u.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    assert_eq!(ss, want); // small integers: exact in any order
    assert_eq!(signs, [0b1110_1111, 0b0111_0111]);
}

/// The server pass against DeepSpeed's order: `unpack_scaled_add` of each row into zeros, then
/// `+ s` (the last call's `subtract_signs` applied to `acc`), then `pack_signs`.
#[test]
fn unpack_sum_pack_squares_by_hand() {
    let rows = [0x03u8, 0xAA, 0x6C, 0x55, 0xFF, 0x00]; // 3 rows of 1 sign byte, stride 2
    let scales = [1.5f32, 0.25, -0.0];
    let acc0 = [0.5f32, -0.5, 0.0, -0.0, 2.0, -2.0, 1e-3, -1.75];
    for (order, carry) in [(BitOrder::Big, 0.0), (BitOrder::Little, 0.0), (BitOrder::Little, 0.375)] {
        let mut want = [0.0f32; 8];
        for (i, &scale) in scales.iter().enumerate() {
            pack::unpack_scaled_add(&rows[2 * i..2 * i + 1], &mut want, scale, order).unwrap();
        }
        let mut s = acc0;
        pack::subtract_signs(&mut s, carry);
        for (w, &sk) in want.iter_mut().zip(&s) {
            *w += sk;
        }
        let mut want_signs = [0u8];
        pack::pack_signs(&want, &mut want_signs, order).unwrap();
        let mut acc = acc0;
        let mut signs = [0u8];
        let ss = pack::unpack_sum_pack_squares(&rows, 2, &scales, &mut acc, carry, &mut signs, order).unwrap();
        assert!(same_f32(&acc, &want), "{acc:?} vs {want:?}");
        assert_eq!(signs, want_signs);
        let sq: f64 = want.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        assert!((ss - sq).abs() <= 1e-12 * sq, "{ss} vs {sq}");
    }
}

/// The sum of squares with every square in f64, in `SQUARE_LANES` lane order.
fn exact_squares(v: &[f32]) -> f64 {
    let mut lanes = [0f64; pack::SQUARE_LANES];
    for (k, &x) in v.iter().enumerate() {
        lanes[k % pack::SQUARE_LANES] += f64::from(x) * f64::from(x);
    }
    lanes.iter().fold(0.0, |t, &l| t + l)
}

/// Whole blocks sum their squares in f32 first: within 3 f32 roundings of the exact sum,
/// on both passes and on lengths with and without a tail after the last block.
#[test]
fn block_sums_of_squares_stay_within_f32_rounding() {
    for len in [64usize, 1000, 4096 + 24, 1 << 16] {
        // Magnitudes from 1e-6 to 1e6, both signs.
        let u0: Vec<f32> = (0..len)
            .map(|k| {
                let t = ((k as u64 * 2_654_435_761) % 1000) as f32 / 1000.0;
                (if k % 3 == 0 { -1.0 } else { 1.0 }) * 10f32.powf(12.0 * t - 6.0)
            })
            .collect();
        let want = exact_squares(&u0);
        let mut u = u0.clone();
        let mut signs = vec![0u8; len / 8];
        let got = pack::add_pack_squares(&mut u, 0.0, &[], &mut signs, BitOrder::Big).unwrap();
        assert!(((got - want) / want).abs() < 3e-7, "len {len}: {got} vs {want}");
        let mut acc = u0;
        let got = pack::unpack_sum_pack_squares(&[], 0, &[], &mut acc, 0.0, &mut signs, BitOrder::Big).unwrap();
        assert!(((got - want) / want).abs() < 3e-7, "len {len}: {got} vs {want}");
    }
}

/// Where f32 squares would overflow or lose precision (|v| ≥ 2⁶⁴, or a total below 2⁻⁶⁰),
/// the sum is every square in f64, exactly.
#[test]
fn huge_and_tiny_squares_are_summed_in_f64() {
    for v in [1e20f32, -3e25, 1e-25, -2e-30, 1e-40, 0.0] {
        let mut u0 = vec![v; 128];
        u0[77] = v * 0.5;
        let want = exact_squares(&u0);
        assert!(want.is_finite());
        let mut u = u0.clone();
        let mut signs = [0u8; 16];
        let got = pack::add_pack_squares(&mut u, 0.0, &[], &mut signs, BitOrder::Little).unwrap();
        assert_eq!(got.to_bits(), want.to_bits(), "{v}: {got} vs {want}");
        let scalar = pack::scalar::add_pack_squares(&mut u0.clone(), 0.0, &[], &mut signs, BitOrder::Little);
        assert_eq!(scalar.to_bits(), want.to_bits(), "{v}: scalar {scalar} vs {want}");
        let mut acc = u0;
        let got = pack::unpack_sum_pack_squares(&[], 0, &[], &mut acc, 0.0, &mut signs, BitOrder::Little).unwrap();
        assert_eq!(got.to_bits(), want.to_bits(), "{v}: {got} vs {want}");
    }
    // A real infinity stays infinite.
    let mut u = vec![1.0f32; 64];
    u[3] = f32::INFINITY;
    let got = pack::add_pack_squares(&mut u, 0.0, &[], &mut [0u8; 8], BitOrder::Big).unwrap();
    assert_eq!(got, f64::INFINITY);
}

#[test]
fn subtract_signs_treats_zeros_and_nan_as_positive() {
    let mut v = [1.0f32, -1.0, 0.0, -0.0, f32::NAN, -3.0, 2.5, f32::NEG_INFINITY, 0.75];
    pack::subtract_signs(&mut v, 0.5);
    let want = [0.5f32, -0.5, -0.5, -0.5, f32::NAN, -2.5, 2.0, f32::NEG_INFINITY, 0.25];
    assert!(same_f32(&v, &want), "{v:?}");
    // A zero scale leaves every value as it is, −0 included.
    let mut z = [-0.0f32, 0.0, -1.0];
    pack::subtract_signs(&mut z, 0.0);
    assert_eq!(z.map(f32::to_bits), [-0.0f32, 0.0, -1.0].map(f32::to_bits));
}

#[test]
fn fused_passes_reject_bad_lengths_and_write_nothing() {
    let mut u = [1.0f32; 16];
    let mut signs = [0xAAu8; 2];
    let big = BitOrder::Big;
    let bad = [
        pack::add_pack_squares(&mut u[..15], 1.0, &[], &mut signs[..1], big),
        pack::add_pack_squares(&mut u, 1.0, &[], &mut signs[..1], big),
        pack::add_pack_squares(&mut u[..8], 1.0, &[1.0; 9], &mut signs[..1], big),
        pack::unpack_sum_pack_squares(&[0; 2], 2, &[1.0, 1.0], &mut u[..8], 1.0, &mut signs[..1], big),
        pack::unpack_sum_pack_squares(&[0; 4], 3, &[1.0, 1.0], &mut u, 1.0, &mut signs, big),
        pack::unpack_sum_pack_squares(&[0; 4], usize::MAX, &[1.0, 1.0], &mut u[..8], 1.0, &mut signs[..1], big),
        pack::unpack_sum_pack_squares(&[0; 4], 2, &[1.0], &mut u, 1.0, &mut signs[..1], big),
    ];
    for r in bad {
        assert_eq!(r.unwrap_err().kind(), ErrorKind::InvalidArgument);
    }
    assert_eq!((u, signs), ([1.0; 16], [0xAA; 2]));
    // No rows: the sum is just `acc`; empty slices are fine.
    let ss = pack::unpack_sum_pack_squares(&[], 0, &[], &mut u[..8], 0.0, &mut signs[..1], big).unwrap();
    assert_eq!((ss, signs[0]), (8.0, 0xFF));
    assert_eq!(pack::add_pack_squares(&mut [], 1.0, &[], &mut [], BitOrder::Little).unwrap(), 0.0);
}

fn carry() -> impl Strategy<Value = f32> {
    prop_oneof![Just(0.0f32), 0f32..1e3, Just(f32::INFINITY), Just(f32::NAN)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn add_pack_squares_matches_scalar(
        bytes in 0usize..70,
        xlen in 0usize..600,
        seed in prop::collection::vec(any_f32(), 16),
        carry in carry(),
        order in order(),
    ) {
        let n = bytes * 8;
        let xlen = xlen.min(n);
        let u0: Vec<f32> = (0..n).map(|i| seed[i % 16] * if i % 5 == 0 { -1.0 } else { 1.0 }).collect();
        let x: Vec<f32> = (0..xlen).map(|i| seed[(i * 7 + 3) % 16] * (1.0 + i as f32)).collect();
        let (mut fast, mut slow) = (u0.clone(), u0);
        let (mut fast_signs, mut slow_signs) = (vec![0u8; bytes], vec![0u8; bytes]);
        let a = pack::add_pack_squares(&mut fast, carry, &x, &mut fast_signs, order).unwrap();
        let b = pack::scalar::add_pack_squares(&mut slow, carry, &x, &mut slow_signs, order);
        prop_assert!(same_f32(&fast, &slow));
        prop_assert_eq!(&fast_signs, &slow_signs);
        prop_assert!(same_sum(a, b), "{} vs {}", a, b);
    }

    #[test]
    fn unpack_sum_pack_squares_matches_scalar(
        bytes in 0usize..40,
        gap in 0usize..5,
        rows in prop::collection::vec(any::<u8>(), 0..1000),
        scales in prop::collection::vec(
            prop_oneof![-1e3f32..1e3, Just(0.0f32), Just(-0.0f32), Just(f32::INFINITY), Just(f32::NAN)], 0..5),
        acc_seed in prop::collection::vec(any_f32(), 8),
        carry in carry(),
        order in order(),
    ) {
        let n = bytes * 8;
        let stride = bytes + gap;
        let mut src = rows;
        src.resize(scales.len() * stride, 0x5A);
        let acc0: Vec<f32> = (0..n).map(|i| acc_seed[i % 8] + (i % 13) as f32).collect();
        let (mut fast, mut slow) = (acc0.clone(), acc0);
        let (mut fast_signs, mut slow_signs) = (vec![0u8; bytes], vec![0u8; bytes]);
        let a = pack::unpack_sum_pack_squares(&src, stride, &scales, &mut fast, carry, &mut fast_signs, order).unwrap();
        let b = pack::scalar::unpack_sum_pack_squares(&src, stride, &scales, &mut slow, carry, &mut slow_signs, order);
        prop_assert!(same_f32(&fast, &slow));
        prop_assert_eq!(&fast_signs, &slow_signs);
        prop_assert!(same_sum(a, b), "{} vs {}", a, b);
    }

    #[test]
    fn subtract_signs_matches_scalar(
        len in 0usize..300,
        seed in prop::collection::vec(any_f32(), 8),
        scale in prop_oneof![-1e3f32..1e3, Just(0.0f32), Just(-0.0f32), Just(f32::INFINITY)],
    ) {
        let v0: Vec<f32> = (0..len).map(|i| seed[i % 8] * if i % 3 == 0 { -1.0 } else { 1.0 }).collect();
        let (mut fast, mut slow) = (v0.clone(), v0);
        pack::subtract_signs(&mut fast, scale);
        pack::scalar::subtract_signs(&mut slow, scale);
        prop_assert!(same_f32(&fast, &slow));
    }
}

// ------------------------------------------------------------------------------------------
// Quantization

const SYM: QuantType = QuantType::Symmetric;
const ASYM: QuantType = QuantType::Asymmetric;
const I4: QuantBits = QuantBits::Int4;
const I8: QuantBits = QuantBits::Int8;

/// Quantizes `x` (converted to `T`) and returns (codes, params, dequantized as f32).
fn round_trip<T: QuantFloat>(x: &[f32], group: usize, bits: QuantBits, ty: QuantType) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let src: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
    let mut q = vec![0u8; quant::quantized_len(x.len(), bits)];
    let mut p = vec![0f32; quant::params_len(x.len(), group, ty)];
    quant::quantize(&src, group, bits, ty, &mut q, &mut p).unwrap();
    let mut out = vec![T::default(); x.len()];
    quant::dequantize(&q, &p, group, bits, ty, &mut out).unwrap();
    (q, p, out.iter().map(|&v| v.to_f32()).collect())
}

fn codes(q: &[u8], n: usize, bits: QuantBits) -> Vec<i32> {
    (0..n).map(|k| quant::scalar::code(q, k, bits)).collect()
}

/// Spec §3.4 worked example, for every input type (all values are exact in f16 and bf16).
#[test]
fn spec_int4_symmetric_example() {
    let x = [0.5f32, -1.0, 0.25, 1.0];
    fn check<T: QuantFloat>(x: &[f32]) {
        let (q, p, out) = round_trip::<T>(x, 4, I4, SYM);
        assert_eq!(q, [0x48, 0x27], "{:?}", T::DTYPE);
        assert_eq!(p, [0.125]);
        assert_eq!(out, [0.5, -1.0, 0.25, 0.875]);
    }
    check::<f32>(&x);
    check::<f16>(&x);
    check::<bf16>(&x);
}

#[test]
fn int4_even_element_is_the_high_nibble() {
    // amax 8 → multiplier 1: codes are the values themselves.
    let (q, p, out) = round_trip::<f32>(&[-2.0, 3.0, 8.0, 0.0], 4, I4, SYM);
    assert_eq!(q, [0xE3, 0x70]);
    assert_eq!(p, [1.0]);
    assert_eq!(out, [-2.0, 3.0, 7.0, 0.0]);
    assert_eq!(codes(&[0xE3, 0x70], 4, I4), [-2, 3, 7, 0]);
}

#[test]
fn stored_param_is_the_inverse_multiplier() {
    // amax 3: the multiplier is 8/3 rounded to f32, and the stored value is 1 / that.
    let (_, p, _) = round_trip::<f32>(&[3.0, -1.0], 2, I4, SYM);
    let q_scale = 8.0f32 / 3.0;
    assert_eq!(p[0].to_bits(), (1.0f32 / q_scale).to_bits());
    let (_, p, _) = round_trip::<f32>(&[-3.0, 1.0], 2, I8, SYM);
    assert_eq!(p[0].to_bits(), (1.0f32 / (128.0f32 / 3.0)).to_bits());
}

#[test]
fn all_zero_group_stores_one() {
    for bits in [I4, I8] {
        let (q, p, out) = round_trip::<f32>(&[0.0, -0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0], 4, bits, SYM);
        assert_eq!(p[0], 1.0, "{bits:?}");
        assert_eq!(codes(&q, 8, bits)[..4], [0, 0, 0, 0]);
        assert_eq!(out[..4], [0.0; 4]);
        assert_eq!(p[1], 1.0 / ((1 << (bits.bits() - 1)) as f32 / 4.0));
    }
    // Asymmetric: max == min stores scale 1 and the value as offset.
    let (q, p, out) = round_trip::<f32>(&[2.5; 4], 4, I8, ASYM);
    assert_eq!(p, [1.0, 2.5]);
    assert_eq!(codes(&q, 4, I8), [0; 4]);
    assert_eq!(out, [2.5; 4]);
}

#[test]
fn extremes_clamp_to_the_code_range() {
    // −amax maps exactly to −2^(b−1); +amax maps to 2^(b−1) and clamps to 2^(b−1) − 1.
    let (q, _, _) = round_trip::<f32>(&[-1.0, 1.0, 0.0, 0.5], 4, I4, SYM);
    assert_eq!(codes(&q, 4, I4), [-8, 7, 0, 4]);
    let (q, _, _) = round_trip::<f32>(&[-1.0, 1.0, 0.0, 0.5], 4, I8, SYM);
    assert_eq!(codes(&q, 4, I8), [-128, 127, 0, 64]);
    let (q, _, _) = round_trip::<f32>(&[1.0, -1.0, f32::INFINITY, 0.0], 4, I8, SYM);
    // amax = ∞: the multiplier is 0, so finite values give code 0 and ∞ · 0 = NaN gives 0.
    assert_eq!(codes(&q, 4, I8), [0, 0, 0, 0]);
}

#[test]
fn ties_round_half_to_even() {
    // amax 128 (int8) / 8 (int4) → multiplier 1.
    let x8 = [128.0f32, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5];
    let (q, p, _) = round_trip::<f32>(&x8, 8, I8, SYM);
    assert_eq!(p, [1.0]);
    assert_eq!(codes(&q, 8, I8), [127, 0, 2, 2, 0, -2, -2, 126]);
    let x4 = [8.0f32, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 6.5];
    let (q, p, _) = round_trip::<f32>(&x4, 8, I4, SYM);
    assert_eq!(p, [1.0]);
    assert_eq!(codes(&q, 8, I4), [7, 0, 2, 2, 0, -2, -2, 6]);
    // The reference agrees.
    let mut qs = vec![0u8; 4];
    let mut ps = vec![0f32; 1];
    quant::scalar::quantize(&x4, 8, I4, SYM, &mut qs, &mut ps).unwrap();
    assert_eq!(qs, q);
}

#[test]
fn nan_is_ignored_by_statistics_and_quantizes_to_zero() {
    let x = [f32::NAN, 1.0, -0.5, -f32::NAN];
    for ty in [SYM, ASYM] {
        for bits in [I4, I8] {
            let (q, p, _) = round_trip::<f32>(&x, 4, bits, ty);
            let c = codes(&q, 4, bits);
            assert_eq!((c[0], c[3]), (0, 0), "{ty:?} {bits:?}");
            assert!(p.iter().all(|v| v.is_finite()), "{ty:?} {bits:?}: {p:?}");
        }
    }
}

#[test]
fn asymmetric_example_by_hand() {
    // min 0, max 3: multiplier 16/3, offset 1.5; (x − 1.5)·16/3 = −8, −2.67, 2.67, 8.
    let (q, p, out) = round_trip::<f32>(&[0.0, 1.0, 2.0, 3.0], 4, I4, ASYM);
    assert_eq!(codes(&q, 4, I4), [-8, -3, 3, 7]);
    assert_eq!(q, [0x8D, 0x37]);
    assert_eq!(p[0].to_bits(), (1.0f32 / (16.0f32 / 3.0)).to_bits());
    assert_eq!(p[1], 1.5);
    let want = [0.0f32, 0.9375, 2.0625, 2.8125];
    for (o, w) in out.iter().zip(want) {
        assert!((o - w).abs() < 1e-6, "{out:?}");
    }
}

/// Deterministic data with a spread of magnitudes per group.
fn spread(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let unit = (s as i32) as f32 / 2_147_483_648.0;
            unit * [1.0f32, 1e-3, 37.0, 1e4][(i / 64) % 4]
        })
        .collect()
}

/// |x − x'| ≤ stored/2 per element (≤ stored where the top of the range was clamped), plus
/// float slack, plus half an ulp of the output type for f16/bf16.
fn check_bound<T: QuantFloat>(bits: QuantBits, ty: QuantType, out_half_ulp: f32) {
    let group = 64;
    let x32 = spread(64 * 40, 99);
    // The exact input values the quantizer saw.
    let x: Vec<f32> = x32.iter().map(|&v| T::from_f32(v).to_f32()).collect();
    let (_, p, out) = round_trip::<T>(&x, group, bits, ty);
    let ppg = ty.params_per_group();
    let q_max = bits.q_max() as f32;
    for (k, (&xi, &oi)) in x.iter().zip(&out).enumerate() {
        let g = k / group;
        let scale = p[g * ppg];
        let offset = if ty == ASYM { p[g * ppg + 1] } else { 0.0 };
        let amax = x[g * group..(g + 1) * group].iter().fold(0f32, |m, v| m.max(v.abs()));
        let clamped = (xi - offset) / scale > q_max + 0.5;
        let step_bound = if clamped { scale } else { scale / 2.0 };
        // f32 rounding of x·q_scale, 1/q_scale and q·stored; the output rounding (relative,
        // plus f16's subnormal spacing 2^−24).
        let slack = amax * 1e-6 + out_half_ulp * oi.abs() + 1e-7;
        let err = (xi - oi).abs();
        assert!(
            err <= step_bound + slack,
            "{:?} {bits:?} {ty:?} k={k}: x={xi} x'={oi} err={err} scale={scale} clamped={clamped}",
            T::DTYPE
        );
    }
}

#[test]
fn round_trip_error_is_at_most_half_a_step() {
    for ty in [SYM, ASYM] {
        for bits in [I4, I8] {
            check_bound::<f32>(bits, ty, 0.0);
            check_bound::<f16>(bits, ty, 2f32.powi(-11));
            check_bound::<bf16>(bits, ty, 2f32.powi(-8));
        }
    }
}

#[test]
fn dequantize_add_accumulates() {
    let x = spread(256, 5);
    for (bits, ty) in [(I4, SYM), (I8, SYM), (I4, ASYM), (I8, ASYM)] {
        let mut q = vec![0u8; quant::quantized_len(256, bits)];
        let mut p = vec![0f32; quant::params_len(256, 32, ty)];
        quant::quantize(&x, 32, bits, ty, &mut q, &mut p).unwrap();
        let mut deq = vec![0f32; 256];
        quant::dequantize(&q, &p, 32, bits, ty, &mut deq).unwrap();
        let acc0: Vec<f32> = (0..256).map(|i| i as f32 * 0.25).collect();
        let mut acc = acc0.clone();
        quant::dequantize_add_f32(&q, &p, 32, bits, ty, &mut acc).unwrap();
        for i in 0..256 {
            assert_eq!(acc[i].to_bits(), (acc0[i] + deq[i]).to_bits(), "{bits:?} {ty:?} {i}");
        }
    }
}

#[test]
fn quant_rejects_bad_shapes_and_writes_nothing() {
    let x = [1.0f32; 12];
    let mut q = [0xAAu8; 12];
    let mut p = [9.0f32; 12];
    let cases: [(usize, QuantBits, QuantType, usize, usize); 6] = [
        (0, I8, SYM, 12, 0),  // group 0
        (5, I8, SYM, 12, 2),  // 12 % 5 != 0
        (3, I4, SYM, 6, 4),   // odd int4 group
        (4, I4, SYM, 5, 3),   // codes too short
        (4, I8, SYM, 12, 4),  // params too long
        (4, I8, ASYM, 12, 3), // asymmetric needs 2 per group
    ];
    for (g, bits, ty, ql, pl) in cases {
        let e = quant::quantize(&x, g, bits, ty, &mut q[..ql], &mut p[..pl]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{g} {bits:?} {ty:?}");
        let mut out = [7.0f32; 12];
        let e = quant::dequantize(&q[..ql], &p[..pl], g, bits, ty, &mut out).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        let e = quant::dequantize_add_f32(&q[..ql], &p[..pl], g, bits, ty, &mut out).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert_eq!(out, [7.0; 12]);
    }
    assert_eq!(q, [0xAA; 12]);
    assert_eq!(p, [9.0; 12]);
    // Empty input is fine.
    quant::quantize::<f32>(&[], 4, I4, SYM, &mut [], &mut []).unwrap();
}

#[test]
fn size_helpers() {
    assert_eq!(quant::quantized_len(10, I8), 10);
    assert_eq!(quant::quantized_len(10, I4), 5);
    assert_eq!(quant::params_len(12, 4, SYM), 3);
    assert_eq!(quant::params_len(12, 4, ASYM), 6);
    assert_eq!(quant::params_len(12, 0, ASYM), 0);
    assert_eq!((I4.q_min(), I4.q_max(), I8.q_min(), I8.q_max()), (-8, 7, -128, 127));
}

fn same_f32(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

/// The fast quantizer and dequantizer against the scalar reference, bit for bit.
fn fast_matches_scalar<T: QuantFloat>(
    x: &[f32],
    group: usize,
    bits: QuantBits,
    ty: QuantType,
) -> Result<(), TestCaseError> {
    let src: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
    let n = src.len();
    let (ql, pl) = (quant::quantized_len(n, bits), quant::params_len(n, group, ty));
    let (mut qf, mut pf) = (vec![0u8; ql], vec![0f32; pl]);
    let (mut qs, mut ps) = (vec![0u8; ql], vec![0f32; pl]);
    quant::quantize(&src, group, bits, ty, &mut qf, &mut pf).unwrap();
    quant::scalar::quantize(&src, group, bits, ty, &mut qs, &mut ps).unwrap();
    prop_assert_eq!(&qf, &qs, "codes {:?} {:?} {:?} group {}", T::DTYPE, bits, ty, group);
    prop_assert!(same_f32(&pf, &ps), "params {:?} vs {:?}", pf, ps);

    let mut out = vec![T::default(); n];
    quant::dequantize(&qf, &pf, group, bits, ty, &mut out).unwrap();
    let mut want = vec![0f32; n];
    quant::scalar::dequantize_f32(&qf, &pf, group, bits, ty, &mut want).unwrap();
    for (k, (o, w32)) in out.iter().zip(&want).enumerate() {
        let w = T::from_f32(*w32);
        let (a, b) = (o.to_f32(), w.to_f32());
        prop_assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "dequantize {:?} {:?} {:?} group {} k={}: {} vs {} (f32 {}, code {}, params {:?})",
            T::DTYPE,
            bits,
            ty,
            group,
            k,
            a,
            b,
            w32,
            quant::scalar::code(&qf, k, bits),
            &pf
        );
    }
    Ok(())
}

fn quant_case() -> impl Strategy<Value = (Vec<f32>, usize, QuantBits, QuantType)> {
    (1usize..40, 1usize..6, prop_oneof![Just(I4), Just(I8)], prop_oneof![Just(SYM), Just(ASYM)]).prop_flat_map(
        |(half_group, groups, bits, ty)| {
            // Even groups of 2..78 elements; longer than a kernel's vector width and chunk
            // boundaries are exercised by the larger fixed test below.
            let group = half_group * 2;
            (prop::collection::vec(any_f32(), group * groups), Just(group), Just(bits), Just(ty))
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn quant_fast_matches_scalar((x, group, bits, ty) in quant_case()) {
        fast_matches_scalar::<f32>(&x, group, bits, ty)?;
        fast_matches_scalar::<f16>(&x, group, bits, ty)?;
        fast_matches_scalar::<bf16>(&x, group, bits, ty)?;
    }
}

/// Groups longer than the 1024-element chunk of the f16/bf16 path, and odd tails of vector
/// loops.
#[test]
fn quant_fast_matches_scalar_on_long_groups() {
    let mut x = spread(3 * 2600, 17);
    x[5] = f32::NAN;
    x[2000] = -0.0;
    x[4000] = f32::INFINITY;
    for (group, bits, ty) in [(2600, I4, SYM), (2600, I8, ASYM), (1300, I4, ASYM), (7800, I8, SYM), (26, I4, SYM)] {
        fast_matches_scalar::<f32>(&x, group, bits, ty).unwrap();
        fast_matches_scalar::<f16>(&x, group, bits, ty).unwrap();
        fast_matches_scalar::<bf16>(&x, group, bits, ty).unwrap();
    }
}

/// bf16 and f32 inputs are read as what they are (DeepSpeed reads every input as fp16).
#[test]
fn bf16_and_f32_inputs_are_not_reinterpreted() {
    let x = [1000.0f32, -250.0, 3.0e5, 0.0];
    let (_, p32, _) = round_trip::<f32>(&x, 4, I8, SYM);
    let (_, pb, _) = round_trip::<bf16>(&x, 4, I8, SYM);
    let want = 1.0 / (128.0f32 / 3.0e5);
    assert_eq!(p32[0], want);
    // 3.0e5 is not exact in bf16: it rounds to 299008.
    assert_eq!(pb[0], 1.0 / (128.0f32 / 299_008.0));
}

/// The output is rounded once, from the f32 result: −3 · 0.120117195 = −0.36035159 (f32 bits
/// 0xBEB88001) lies just above a bf16 tie and must round away from it. (`half`'s
/// `bf16::from_f64` drops the low bits first and rounds it to −0.359375.)
#[test]
fn narrow_outputs_round_once_from_f32() {
    let q = [0xDDu8; 4]; // eight codes of −3
    let scale = [0.120117195f32];
    let mut out = [bf16::ZERO; 8];
    quant::dequantize(&q, &scale, 8, I4, SYM, &mut out).unwrap();
    assert_eq!((-3.0f32 * scale[0]).to_bits(), 0xBEB8_8001);
    assert_eq!(out, [bf16::from_f32(-0.361_328_13); 8]);
}

/// `dequantize_sum_f32` and `dequantize_mean` against the scalar reference: `0 + Σ` of the
/// inputs' scalar dequantizations in input order, then (mean) divided by `d` and rounded once
/// to `T`, bit for bit. `d = 4` takes the multiply-by-reciprocal path, `d = 3` the division.
fn sums_match_scalar<T: QuantFloat>(
    xs: &[Vec<f32>],
    group: usize,
    bits: QuantBits,
    ty: QuantType,
) -> Result<(), TestCaseError> {
    let n = xs[0].len();
    let (ql, pl) = (quant::quantized_len(n, bits), quant::params_len(n, group, ty));
    let coded: Vec<(Vec<u8>, Vec<f32>)> = xs
        .iter()
        .map(|x| {
            let (mut q, mut p) = (vec![0u8; ql], vec![0f32; pl]);
            quant::scalar::quantize(x, group, bits, ty, &mut q, &mut p).unwrap();
            (q, p)
        })
        .collect();
    let inputs: Vec<(&[u8], &[f32])> = coded.iter().map(|(q, p)| (&q[..], &p[..])).collect();
    let mut want = vec![0f32; n];
    let mut one = vec![0f32; n];
    for (q, p) in &inputs {
        quant::scalar::dequantize_f32(q, p, group, bits, ty, &mut one).unwrap();
        for (w, v) in want.iter_mut().zip(&one) {
            *w += *v;
        }
    }
    let mut sum = vec![1f32; n];
    quant::dequantize_sum_f32(&inputs, group, bits, ty, &mut sum).unwrap();
    prop_assert!(same_f32(&sum, &want), "sum {:?} {:?} group {}: {:?} vs {:?}", bits, ty, group, sum, want);
    for d in [3.0f32, 4.0] {
        let mut mean = vec![T::default(); n];
        quant::dequantize_mean(&inputs, group, bits, ty, d, &mut mean).unwrap();
        for (k, (m, w)) in mean.iter().zip(&want).enumerate() {
            let (a, b) = (m.to_f32(), T::from_f32(*w / d).to_f32());
            prop_assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "mean /{} k={}: {} vs {}",
                d,
                k,
                a,
                b
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn quant_sums_match_scalar(
        (xs, group, bits, ty) in (1usize..40, 1usize..4, 0usize..4, prop_oneof![Just(I4), Just(I8)], prop_oneof![Just(SYM), Just(ASYM)])
            .prop_flat_map(|(half_group, groups, k, bits, ty)| {
                let n = half_group * 2 * groups;
                (prop::collection::vec(prop::collection::vec(any_f32(), n), k..=k), Just(half_group * 2), Just(bits), Just(ty))
            })
    ) {
        if xs.is_empty() {
            // No inputs: zeros (checked on a fixed length).
            let mut out = vec![1f32; 8];
            quant::dequantize_sum_f32(&[], 4, bits, ty, &mut out).unwrap();
            prop_assert_eq!(out, vec![0f32; 8]);
        } else {
            sums_match_scalar::<f32>(&xs, group, bits, ty)?;
            sums_match_scalar::<f16>(&xs, group, bits, ty)?;
            sums_match_scalar::<bf16>(&xs, group, bits, ty)?;
        }
    }
}

/// The sums over groups longer than a chunk (1024) and with vector tails, with NaN, −0 and
/// ∞ among the inputs.
#[test]
fn quant_sums_match_scalar_on_long_groups() {
    let mut a = spread(2 * 2600, 3);
    let b = spread(2 * 2600, 4);
    a[7] = f32::NAN;
    a[3000] = -0.0;
    a[4100] = f32::NEG_INFINITY;
    for (group, bits, ty) in [(2600, I4, SYM), (1300, I8, ASYM), (26, I4, ASYM)] {
        sums_match_scalar::<f32>(&[a.clone(), b.clone()], group, bits, ty).unwrap();
        sums_match_scalar::<f16>(&[a.clone(), b.clone(), a.clone()], group, bits, ty).unwrap();
    }
}

/// Every input of a sum is checked before anything is written.
#[test]
fn quant_sums_reject_a_bad_input_and_write_nothing() {
    let (q, p) = (vec![0u8; 8], vec![1f32; 2]);
    let mut out = vec![5f32; 16];
    let e = quant::dequantize_sum_f32(&[(&q, &p), (&q[..7], &p)], 8, I4, SYM, &mut out).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let e = quant::dequantize_mean(&[(&q, &p[..1])], 8, I4, SYM, 2.0, &mut out).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(out, vec![5f32; 16]);
}
