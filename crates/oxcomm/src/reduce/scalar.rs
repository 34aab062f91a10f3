//! The plain element-by-element reference kernels. Every fast kernel is property-tested
//! against these; they are also the fallback for types and ops without a fast path.

use half::{bf16, f16};

use super::ReduceOp;
use crate::dtype::{Bool, Complex128, Complex64, DType, Element};

/// Casts a slice of `T` to a slice of `U` when both are the same dtype.
#[inline]
pub(crate) fn cast<T: Element, U: Element>(s: &[T]) -> &[U] {
    debug_assert_eq!(T::DTYPE, U::DTYPE);
    bytemuck::cast_slice(s)
}

/// Mutable version of [`cast`].
#[inline]
pub(crate) fn cast_mut<T: Element, U: Element>(s: &mut [T]) -> &mut [U] {
    debug_assert_eq!(T::DTYPE, U::DTYPE);
    bytemuck::cast_slice_mut(s)
}

macro_rules! float_loop {
    ($dst:expr, $src:expr, $op:expr, $to:expr, $from:expr) => {{
        let (dst, src) = ($dst, $src);
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = $from($to(*d) + $to(*s));
                }
            }
            ReduceOp::Prod => {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = $from($to(*d) * $to(*s));
                }
            }
            ReduceOp::Min => {
                for (d, s) in dst.iter_mut().zip(src) {
                    let (a, b) = ($to(*d), $to(*s));
                    *d = $from(if a.is_nan() || b.is_nan() {
                        a + b
                    } else if b < a {
                        b
                    } else {
                        a
                    });
                }
            }
            ReduceOp::Max => {
                for (d, s) in dst.iter_mut().zip(src) {
                    let (a, b) = ($to(*d), $to(*s));
                    *d = $from(if a.is_nan() || b.is_nan() {
                        a + b
                    } else if b > a {
                        b
                    } else {
                        a
                    });
                }
            }
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => {
                panic!("bitwise reduce op on a float type")
            }
        }
    }};
}

macro_rules! int_loop {
    ($dst:expr, $src:expr, $op:expr) => {{
        let (dst, src) = ($dst, $src);
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = d.wrapping_add(*s);
                }
            }
            ReduceOp::Prod => {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = d.wrapping_mul(*s);
                }
            }
            ReduceOp::Min => {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = (*d).min(*s);
                }
            }
            ReduceOp::Max => {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = (*d).max(*s);
                }
            }
            ReduceOp::BAnd => {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d &= *s;
                }
            }
            ReduceOp::BOr => {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d |= *s;
                }
            }
            ReduceOp::BXor => {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d ^= *s;
                }
            }
        }
    }};
}

/// Bool: Sum, Max and BOr are a logical or, Prod, Min and BAnd a logical and, BXor a
/// logical xor (torch's definitions); any non-zero byte is true and results are 0 or 1.
fn bool_loop(dst: &mut [Bool], src: &[Bool], op: ReduceOp) {
    let f: fn(bool, bool) -> bool = match op {
        ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => |a, b| a | b,
        ReduceOp::Prod | ReduceOp::Min | ReduceOp::BAnd => |a, b| a & b,
        ReduceOp::BXor => |a, b| a ^ b,
        ReduceOp::Avg => panic!("avg reduce op on bool"),
    };
    for (d, s) in dst.iter_mut().zip(src) {
        *d = Bool::from(f(d.get(), s.get()));
    }
}

macro_rules! complex_loop {
    ($dst:expr, $src:expr, $op:expr) => {{
        let (dst, src) = ($dst, $src);
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => {
                for (d, s) in dst.iter_mut().zip(src) {
                    d.re += s.re;
                    d.im += s.im;
                }
            }
            ReduceOp::Prod => {
                for (d, s) in dst.iter_mut().zip(src) {
                    let (re, im) = (d.re * s.re - d.im * s.im, d.re * s.im + d.im * s.re);
                    d.re = re;
                    d.im = im;
                }
            }
            _ => panic!("reduce op {} on a complex type", $op),
        }
    }};
}

fn id<T>(x: T) -> T {
    x
}

/// Reference `dst[i] = op(dst[i], src[i])`. Integers wrap on overflow; floats follow IEEE,
/// with NaN propagating through Min and Max; f16/bf16 compute in f32; complex numbers add
/// part by part and multiply as `(a·c − b·d) + (a·d + b·c)i`; bool as [`ReduceOp`] says.
///
/// # Panics
/// On an op that does not fit the type ([`ReduceOp::fits`]), float8 included.
pub fn reduce_into<T: Element>(dst: &mut [T], src: &[T], op: ReduceOp) {
    match T::DTYPE {
        DType::F32 => float_loop!(cast_mut::<T, f32>(dst), cast::<T, f32>(src), op, id, id),
        DType::F64 => float_loop!(cast_mut::<T, f64>(dst), cast::<T, f64>(src), op, id, id),
        DType::F16 => float_loop!(cast_mut::<T, f16>(dst), cast::<T, f16>(src), op, f16::to_f32, f16::from_f32),
        DType::BF16 => float_loop!(cast_mut::<T, bf16>(dst), cast::<T, bf16>(src), op, bf16::to_f32, bf16::from_f32),
        DType::I8 => int_loop!(cast_mut::<T, i8>(dst), cast::<T, i8>(src), op),
        DType::U8 => int_loop!(cast_mut::<T, u8>(dst), cast::<T, u8>(src), op),
        DType::I32 => int_loop!(cast_mut::<T, i32>(dst), cast::<T, i32>(src), op),
        DType::I64 => int_loop!(cast_mut::<T, i64>(dst), cast::<T, i64>(src), op),
        DType::I16 => int_loop!(cast_mut::<T, i16>(dst), cast::<T, i16>(src), op),
        DType::U16 => int_loop!(cast_mut::<T, u16>(dst), cast::<T, u16>(src), op),
        DType::U32 => int_loop!(cast_mut::<T, u32>(dst), cast::<T, u32>(src), op),
        DType::U64 => int_loop!(cast_mut::<T, u64>(dst), cast::<T, u64>(src), op),
        DType::Bool => bool_loop(cast_mut::<T, Bool>(dst), cast::<T, Bool>(src), op),
        DType::C64 => complex_loop!(cast_mut::<T, Complex64>(dst), cast::<T, Complex64>(src), op),
        DType::C128 => complex_loop!(cast_mut::<T, Complex128>(dst), cast::<T, Complex128>(src), op),
        DType::F8E4M3Fn | DType::F8E5M2 | DType::F8E4M3Fnuz | DType::F8E5M2Fnuz | DType::F8E8M0Fnu => {
            panic!("reduce op {op} on {}: float8 types are moved, not reduced", T::DTYPE)
        }
    }
}

/// Reference `dst[i] = op(a[i], b[i])`: by definition `a` copied into `dst`, then
/// [`reduce_into`] with `b` (so ties and NaN payloads follow `a` as the left operand).
pub fn reduce_from2<T: Element>(dst: &mut [T], a: &[T], b: &[T], op: ReduceOp) {
    dst.copy_from_slice(a);
    reduce_into(dst, b, op);
}

/// Reference division by `n`, which must be at least 1 (integer types truncate toward zero;
/// the quotient is computed in i128, so it is exact for every `n`; complex numbers divide
/// both parts).
///
/// # Panics
/// For bool and float8 types, which have no average.
pub fn divide<T: Element>(buf: &mut [T], n: usize) {
    let wide = n as i128;
    match T::DTYPE {
        DType::F32 => cast_mut::<T, f32>(buf).iter_mut().for_each(|x| *x /= n as f32),
        DType::F64 => cast_mut::<T, f64>(buf).iter_mut().for_each(|x| *x /= n as f64),
        DType::F16 => cast_mut::<T, f16>(buf).iter_mut().for_each(|x| *x = f16::from_f32(x.to_f32() / n as f32)),
        DType::BF16 => cast_mut::<T, bf16>(buf).iter_mut().for_each(|x| *x = bf16::from_f32(x.to_f32() / n as f32)),
        DType::I8 => cast_mut::<T, i8>(buf).iter_mut().for_each(|x| *x = (*x as i128 / wide) as i8),
        DType::U8 => cast_mut::<T, u8>(buf).iter_mut().for_each(|x| *x = (*x as i128 / wide) as u8),
        DType::I32 => cast_mut::<T, i32>(buf).iter_mut().for_each(|x| *x = (*x as i128 / wide) as i32),
        DType::I64 => cast_mut::<T, i64>(buf).iter_mut().for_each(|x| *x = (*x as i128 / wide) as i64),
        DType::I16 => cast_mut::<T, i16>(buf).iter_mut().for_each(|x| *x = (*x as i128 / wide) as i16),
        DType::U16 => cast_mut::<T, u16>(buf).iter_mut().for_each(|x| *x = (*x as i128 / wide) as u16),
        DType::U32 => cast_mut::<T, u32>(buf).iter_mut().for_each(|x| *x = (*x as i128 / wide) as u32),
        DType::U64 => cast_mut::<T, u64>(buf).iter_mut().for_each(|x| *x = (*x as i128 / wide) as u64),
        DType::C64 => cast_mut::<T, Complex64>(buf).iter_mut().for_each(|x| {
            x.re /= n as f32;
            x.im /= n as f32;
        }),
        DType::C128 => cast_mut::<T, Complex128>(buf).iter_mut().for_each(|x| {
            x.re /= n as f64;
            x.im /= n as f64;
        }),
        DType::Bool | DType::F8E4M3Fn | DType::F8E5M2 | DType::F8E4M3Fnuz | DType::F8E5M2Fnuz | DType::F8E8M0Fnu => {
            panic!("avg on {}: the type has no average", T::DTYPE)
        }
    }
}
