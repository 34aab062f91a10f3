//! `oxcomm::reduce`: the public kernels equal the scalar reference bit for bit (all NaNs
//! counted equal) for every dtype × op, over random lengths and unaligned subslices; `check`
//! rejects what does not fit; `finish_avg` divides only for `Avg`.

use half::{bf16, f16};
use oxcomm::reduce::{self, check, finish_avg, reduce_from2, reduce_into, scalar};
use oxcomm::{Element, ErrorKind, ReduceOp};
use proptest::prelude::*;
use proptest::sample::select;

/// Element values worth testing: mostly small numbers (ties, exact sums), plus raw bit patterns
/// and the edges (NaN, ±inf, ±0, subnormals, MIN/MAX).
trait Gen: Element {
    fn value() -> BoxedStrategy<Self>;
}

macro_rules! gen_float {
    ($t:ty, $bits:ty, $from_bits:expr, [$($special:expr),* $(,)?]) => {
        impl Gen for $t {
            fn value() -> BoxedStrategy<Self> {
                prop_oneof![
                    3 => (-4i32..=4).prop_map(|v| <$t as Element>::from_f64(v as f64 * 0.5)),
                    1 => any::<$bits>().prop_map($from_bits),
                    1 => select(vec![$($special),*]),
                ]
                .boxed()
            }
        }
    };
}

gen_float!(
    f32,
    u32,
    f32::from_bits,
    [
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        f32::from_bits(1),
        f32::MIN_POSITIVE,
        f32::MAX,
        f32::MIN,
    ]
);
gen_float!(
    f64,
    u64,
    f64::from_bits,
    [
        f64::NAN,
        -f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.0,
        -0.0,
        f64::from_bits(1),
        f64::MIN_POSITIVE,
        f64::MAX,
        f64::MIN,
    ]
);
gen_float!(
    f16,
    u16,
    f16::from_bits,
    [
        f16::NAN,
        -f16::NAN,
        f16::INFINITY,
        f16::NEG_INFINITY,
        f16::ZERO,
        f16::NEG_ZERO,
        f16::from_bits(1),
        f16::MIN_POSITIVE,
        f16::MAX,
        f16::MIN,
    ]
);
gen_float!(
    bf16,
    u16,
    bf16::from_bits,
    [
        bf16::NAN,
        -bf16::NAN,
        bf16::INFINITY,
        bf16::NEG_INFINITY,
        bf16::ZERO,
        bf16::NEG_ZERO,
        bf16::from_bits(1),
        bf16::MIN_POSITIVE,
        bf16::MAX,
        bf16::MIN,
    ]
);

macro_rules! gen_int {
    ($t:ty) => {
        impl Gen for $t {
            fn value() -> BoxedStrategy<Self> {
                prop_oneof![
                    2 => any::<$t>(),
                    2 => (-4i32..=4).prop_map(|v| v as $t),
                    1 => select(vec![<$t>::MIN, <$t>::MAX, 0 as $t, 1 as $t]),
                ]
                .boxed()
            }
        }
    };
}

gen_int!(i8);
gen_int!(u8);
gen_int!(i32);
gen_int!(i64);
gen_int!(i16);
gen_int!(u16);
gen_int!(u32);
gen_int!(u64);

/// Two buffers of `len + offset` elements whose subslices `[offset..]` are what is reduced, so
/// the kernels see lengths that are not multiples of a vector and unaligned starts.
#[derive(Debug, Clone)]
struct Case<T> {
    a: Vec<T>,
    b: Vec<T>,
    a_off: usize,
    b_off: usize,
    n: usize,
}

impl<T: Gen> Case<T> {
    fn strategy() -> impl Strategy<Value = Case<T>> {
        (0usize..2000, 0usize..8, 0usize..8).prop_flat_map(|(len, a_off, b_off)| {
            (
                proptest::collection::vec(T::value(), len + a_off),
                proptest::collection::vec(T::value(), len + b_off),
                prop_oneof![1usize..=9, select(vec![16usize, 1000, 1 << 24, (1 << 24) + 1])],
            )
                .prop_map(move |(a, b, n)| Case { a, b, a_off, b_off, n })
        })
    }

    fn a(&self) -> &[T] {
        &self.a[self.a_off..]
    }

    fn b(&self) -> &[T] {
        &self.b[self.b_off..]
    }
}

/// Equal bits, except that any NaN equals any NaN (payloads are not specified).
fn same_bits<T: Element>(x: T, y: T) -> bool {
    let nan = |v: T| T::DTYPE.is_float() && v.to_f64().is_nan();
    (nan(x) && nan(y)) || bytemuck::bytes_of(&x) == bytemuck::bytes_of(&y)
}

fn assert_same<T: Element>(got: &[T], want: &[T], what: &str) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len(), "{}: length", what);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        prop_assert!(same_bits(g, w), "{}: element {} is {:?}, scalar says {:?}", what, i, g, w);
    }
    Ok(())
}

/// Every op that fits `T`, through the public (fast) kernels and through `scalar`.
fn fast_equals_scalar<T: Gen>(case: &Case<T>) -> Result<(), TestCaseError> {
    let (a, b) = (case.a(), case.b());
    for op in ReduceOp::ALL.into_iter().filter(|op| op.fits(T::DTYPE)) {
        let what = format!("{} {op} × {}", T::DTYPE, a.len());

        let mut want = a.to_vec();
        scalar::reduce_into(&mut want, b, op);
        // Reduce in place inside the unaligned subslice itself.
        let mut buf = case.a.clone();
        reduce_into(&mut buf[case.a_off..], b, op);
        assert_same(&buf[case.a_off..], &want, &format!("reduce_into {what}"))?;

        let mut want2 = vec![T::default(); a.len()];
        scalar::reduce_from2(&mut want2, a, b, op);
        assert_same(&want2, &want, &format!("scalar reduce_from2 {what}"))?;
        let mut out = vec![T::default(); a.len() + case.b_off];
        reduce_from2(&mut out[case.b_off..], a, b, op);
        assert_same(&out[case.b_off..], &want, &format!("reduce_from2 {what}"))?;
    }

    let mut want = a.to_vec();
    scalar::divide(&mut want, case.n);
    let mut got = case.a.clone();
    finish_avg(&mut got[case.a_off..], ReduceOp::Avg, case.n);
    let what = format!("finish_avg {} × {} / {}", T::DTYPE, a.len(), case.n);
    assert_same(&got[case.a_off..], &want, &what)?;

    for op in [ReduceOp::Sum, ReduceOp::Max] {
        let mut untouched = a.to_vec();
        finish_avg(&mut untouched, op, case.n);
        assert_same(&untouched, a, &format!("finish_avg with {op} changes nothing"))?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn f32_fast_equals_scalar(case in Case::<f32>::strategy()) { fast_equals_scalar(&case)?; }
    #[test]
    fn f64_fast_equals_scalar(case in Case::<f64>::strategy()) { fast_equals_scalar(&case)?; }
    #[test]
    fn f16_fast_equals_scalar(case in Case::<f16>::strategy()) { fast_equals_scalar(&case)?; }
    #[test]
    fn bf16_fast_equals_scalar(case in Case::<bf16>::strategy()) { fast_equals_scalar(&case)?; }
    #[test]
    fn i8_fast_equals_scalar(case in Case::<i8>::strategy()) { fast_equals_scalar(&case)?; }
    #[test]
    fn u8_fast_equals_scalar(case in Case::<u8>::strategy()) { fast_equals_scalar(&case)?; }
    #[test]
    fn i32_fast_equals_scalar(case in Case::<i32>::strategy()) { fast_equals_scalar(&case)?; }
    #[test]
    fn i64_fast_equals_scalar(case in Case::<i64>::strategy()) { fast_equals_scalar(&case)?; }
    #[test]
    fn i16_fast_equals_scalar(case in Case::<i16>::strategy()) { fast_equals_scalar(&case)?; }
    #[test]
    fn u16_fast_equals_scalar(case in Case::<u16>::strategy()) { fast_equals_scalar(&case)?; }
    #[test]
    fn u32_fast_equals_scalar(case in Case::<u32>::strategy()) { fast_equals_scalar(&case)?; }
    #[test]
    fn u64_fast_equals_scalar(case in Case::<u64>::strategy()) { fast_equals_scalar(&case)?; }
}

#[test]
fn check_rejects_bitwise_ops_on_floats_only() {
    // The types after the first eight have their own table (`tests/it/dtypes.rs`).
    for dtype in crate::collectives::BASE_DTYPES {
        for op in ReduceOp::ALL {
            let bitwise = matches!(op, ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor);
            match check(op, dtype) {
                Ok(()) => assert!(!(bitwise && dtype.is_float()), "{op} on {dtype} accepted"),
                Err(e) => {
                    assert!(bitwise && dtype.is_float(), "{op} on {dtype} rejected: {e}");
                    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
                    assert!(e.to_string().contains(op.name()), "{e}");
                }
            }
        }
    }
}

#[test]
fn nan_propagates_through_min_and_max() {
    for op in [ReduceOp::Min, ReduceOp::Max] {
        let mut dst = vec![1.0f32, f32::NAN, f32::NAN, -0.0];
        reduce_into(&mut dst, &[f32::NAN, 2.0, f32::NAN, 0.0], op);
        assert!(dst[..3].iter().all(|x| x.is_nan()), "{op}: {dst:?}");
        // Ties keep the left operand, as the reference does.
        assert_eq!(dst[3].to_bits(), (-0.0f32).to_bits(), "{op}");

        let mut h = vec![bf16::from_f32(1.0); 300];
        let mut other = vec![bf16::from_f32(3.0); 300];
        other[299] = bf16::NAN;
        reduce_into(&mut h, &other, op);
        assert!(h[299].is_nan());
    }
}

#[test]
fn integer_ops_wrap() {
    let mut d = vec![i8::MAX; 100];
    reduce_into(&mut d, &[1i8; 100], ReduceOp::Sum);
    assert!(d.iter().all(|&x| x == i8::MIN));
    let mut d = vec![i32::MAX; 77];
    reduce_into(&mut d, &[2i32; 77], ReduceOp::Prod);
    assert!(d.iter().all(|&x| x == -2));
    let mut out = vec![0u8; 33];
    reduce_from2(&mut out, &[200u8; 33], &[100u8; 33], ReduceOp::Sum);
    assert!(out.iter().all(|&x| x == 44));
}

#[test]
fn half_types_round_once_per_call() {
    // 2049 is not an f16; 2048 + 1 rounds to even (2048) once, from the exact f32 sum.
    let mut d = vec![f16::from_f32(2048.0); 513];
    reduce_into(&mut d, &vec![f16::from_f32(1.0); 513], ReduceOp::Sum);
    assert!(d.iter().all(|&x| x == f16::from_f32(2048.0)));
    let mut d = vec![f16::from_f32(2048.0); 513];
    reduce_into(&mut d, &vec![f16::from_f32(3.0); 513], ReduceOp::Sum);
    assert!(d.iter().all(|&x| x == f16::from_f32(2052.0)));
}

#[test]
fn finish_avg_ignores_one_and_zero_ranks() {
    for n in [0, 1] {
        let mut v = vec![7i32, -7];
        finish_avg(&mut v, ReduceOp::Avg, n);
        assert_eq!(v, [7, -7]);
    }
    let mut v = vec![7i32, -7];
    finish_avg(&mut v, ReduceOp::Avg, 2);
    assert_eq!(v, [3, -3], "integer avg truncates toward zero");
}

#[test]
#[should_panic(expected = "length mismatch")]
fn reduce_into_rejects_unequal_lengths() {
    reduce_into(&mut [1.0f32; 3], &[1.0; 4], ReduceOp::Sum);
}

#[test]
#[should_panic(expected = "length mismatch")]
fn reduce_from2_rejects_unequal_lengths() {
    reduce_from2(&mut [0u8; 3], &[1; 3], &[1; 2], ReduceOp::Sum);
}

#[test]
fn combiner_of_avg_is_sum() {
    assert_eq!(ReduceOp::Avg.combiner(), ReduceOp::Sum);
    assert_eq!(reduce::ReduceOp::Max.combiner(), ReduceOp::Max);
}
