//! The fast reduction kernels behind [`super::reduce_into`], [`super::reduce_from2`] and
//! [`super::finish_avg`].
//!
//! One file over the usual ~600 lines because it is one kernel family: every reduce op and
//! dtype shares the stepping loop and the run-time CPU dispatch defined here.
//!
//! Every kernel is a plain element loop over fixed-size steps (128 bytes) that LLVM turns into
//! vector code. On x86_64 the same loops are compiled a second time inside an
//! `#[target_feature(enable = "avx2,f16c")]` function and chosen at run time when the CPU has
//! both; elsewhere (and on x86_64 CPUs without them) the build target's baseline vector set is
//! used. AVX-512 is not used: `#[target_feature(enable = "avx512f")]` needs Rust 1.89 (the
//! workspace allows 1.80), and large reductions are bound by memory bandwidth anyway.
//! No kernel reassociates, fuses or reorders floating-point operations, so every result is
//! bit-for-bit the one [`super::scalar`] computes (NaN payloads aside), which the property
//! tests check.
//!
//! f16 and bf16 are widened to f32 in blocks of [`HALF_BLOCK`] elements, reduced in f32 and
//! rounded back once, exactly as the scalar reference does element by element. The block
//! conversions: for f16, `half`'s slice conversion in the baseline build and the F16C
//! instructions themselves in the AVX2 build (the same instructions `half` uses, inlined);
//! for bf16, a branch-free loop with `half`'s exact bit semantics (`half`'s bf16 slice
//! conversion is an indexed loop that stays partly scalar, 2.5-3× slower in cache here).
//!
//! This module owns only the loops; the operator and its validation live in [`super`].

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::scalar::{cast, cast_mut};
use super::ReduceOp;
use crate::dtype::{DType, Element};

/// Bytes handled per unrolled step of the element loops (four AVX2 registers per operand).
const STEP_BYTES: usize = 128;

/// f16/bf16 elements widened to f32 at a time: two f32 blocks of this size (2 KiB) live on the
/// stack, small enough to stay in L1 next to the block being reduced.
pub(crate) const HALF_BLOCK: usize = 256;

/// The instruction set a kernel runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    /// What the build target guarantees (SSE2 on x86_64, NEON on aarch64).
    Baseline,
    /// x86_64 AVX2 with F16C (for the f16 conversions; CPUs with AVX2 have it). Only
    /// [`Isa::detect`] constructs it, after the CPU reported both features.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Isa {
    /// The best instruction set this CPU supports (the detection result is cached by std).
    #[inline]
    pub(crate) fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
            return Isa::Avx2;
        }
        Isa::Baseline
    }

    /// Every instruction set this CPU can run, for tests that compare them all with scalar.
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Isa> {
        let mut all = vec![Isa::Baseline];
        if Isa::detect() != Isa::Baseline {
            all.push(Isa::detect());
        }
        all
    }
}

/// Defines `$name(isa, args..)`, which runs the `#[inline(always)]` loop `$body(args..)`
/// compiled for `isa`: once for the baseline target and, on x86_64, once more inside an
/// `#[target_feature(enable = "avx2,f16c")]` function (`$avx2_body`, when given, replaces
/// `$body` there). The slices are passed as arguments of those functions (not captured by a
/// closure) so that LLVM knows they do not alias, which it needs to vectorise: with captured
/// slices the f32 loops came out scalar.
macro_rules! multiversion {
    (
        $(#[$doc:meta])*
        fn $name:ident[$($gen:tt)*]($($arg:ident: $ty:ty),*) where [$($bound:tt)*]
            = $body:expr $(, $avx2_body:expr)?;
    ) => {
        $(#[$doc])*
        #[inline(always)]
        fn $name<$($gen)*>(isa: Isa, $($arg: $ty),*) where $($bound)* {
            fn baseline<$($gen)*>($($arg: $ty),*) where $($bound)* {
                $body($($arg),*)
            }

            /// # Safety
            /// The CPU must support AVX2 and F16C.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,f16c")]
            unsafe fn avx2<$($gen)*>($($arg: $ty),*) where $($bound)* {
                multiversion!(@pick $body $(, $avx2_body)?)($($arg),*)
            }

            match isa {
                Isa::Baseline => baseline($($arg),*),
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `Isa::Avx2` is only constructed after `is_x86_feature_detected!`
                // reported both AVX2 and F16C, the one requirement of `avx2`.
                Isa::Avx2 => unsafe { avx2($($arg),*) },
            }
        }
    };
    (@pick $body:expr) => { $body };
    (@pick $body:expr, $avx2_body:expr) => { $avx2_body };
}

/// The arithmetic every element type has. Float `min`/`max` propagate NaN exactly as
/// [`super::scalar`] does: `a + b` when either is NaN, otherwise the smaller (larger) with
/// ties going to `a`.
trait Lane: Copy {
    fn add(a: Self, b: Self) -> Self;
    fn mul(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
}

/// The bitwise operators of integer elements.
trait IntLane: Lane {
    fn and(a: Self, b: Self) -> Self;
    fn or(a: Self, b: Self) -> Self;
    fn xor(a: Self, b: Self) -> Self;
}

macro_rules! float_lane {
    ($t:ty) => {
        impl Lane for $t {
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a + b
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                a * b
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                if a.is_nan() || b.is_nan() {
                    a + b
                } else if b < a {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                if a.is_nan() || b.is_nan() {
                    a + b
                } else if b > a {
                    b
                } else {
                    a
                }
            }
        }
    };
}

macro_rules! int_lane {
    ($t:ty) => {
        impl Lane for $t {
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                a.wrapping_mul(b)
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                Ord::min(a, b)
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                Ord::max(a, b)
            }
        }
        impl IntLane for $t {
            #[inline(always)]
            fn and(a: Self, b: Self) -> Self {
                a & b
            }
            #[inline(always)]
            fn or(a: Self, b: Self) -> Self {
                a | b
            }
            #[inline(always)]
            fn xor(a: Self, b: Self) -> Self {
                a ^ b
            }
        }
    };
}

float_lane!(f32);
float_lane!(f64);
int_lane!(i8);
int_lane!(u8);
int_lane!(i32);
int_lane!(i64);
int_lane!(i16);
int_lane!(u16);
int_lane!(u32);
int_lane!(u64);

// ---------------------------------------------------------------------------------------------
// The three loop shapes. Each walks whole steps of STEP_BYTES (a constant trip count that
// LLVM unrolls into vector code without bounds checks), then the remainder element by element.

/// `dst[i] = f(dst[i], src[i])`.
#[inline(always)]
fn zip_in_place<T: Copy>(dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T) {
    let step = STEP_BYTES / std::mem::size_of::<T>();
    let mut d_steps = dst.chunks_exact_mut(step);
    let mut s_steps = src.chunks_exact(step);
    for (d, s) in (&mut d_steps).zip(&mut s_steps) {
        for (x, y) in d.iter_mut().zip(s) {
            *x = f(*x, *y);
        }
    }
    let (d_rest, s_rest) = (d_steps.into_remainder(), s_steps.remainder());
    for (x, y) in d_rest.iter_mut().zip(s_rest) {
        *x = f(*x, *y);
    }
}

/// `dst[i] = f(a[i], b[i])`.
#[inline(always)]
fn zip_from2<T: Copy>(dst: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
    let step = STEP_BYTES / std::mem::size_of::<T>();
    let mut d_steps = dst.chunks_exact_mut(step);
    let mut a_steps = a.chunks_exact(step);
    let mut b_steps = b.chunks_exact(step);
    for ((d, x), y) in (&mut d_steps).zip(&mut a_steps).zip(&mut b_steps) {
        for ((o, x), y) in d.iter_mut().zip(x).zip(y) {
            *o = f(*x, *y);
        }
    }
    let rest = d_steps.into_remainder();
    for ((o, x), y) in rest.iter_mut().zip(a_steps.remainder()).zip(b_steps.remainder()) {
        *o = f(*x, *y);
    }
}

/// `buf[i] = f(buf[i])`.
#[inline(always)]
fn map_in_place<T: Copy>(buf: &mut [T], f: impl Fn(T) -> T) {
    let step = STEP_BYTES / std::mem::size_of::<T>();
    let mut steps = buf.chunks_exact_mut(step);
    for s in &mut steps {
        for x in s.iter_mut() {
            *x = f(*x);
        }
    }
    for x in steps.into_remainder() {
        *x = f(*x);
    }
}

/// How a block of f16/bf16 is widened to f32 and narrowed back (rounding to nearest even).
/// An implementation may require at most AVX2 and F16C: it runs in the baseline build only if
/// it requires nothing ([`SliceExt`], [`Bf16Bits`]), otherwise only in the AVX2 build.
trait Convert<H> {
    /// `dst[i] = src[i] as f32`; the slices have equal lengths.
    ///
    /// # Safety
    /// The CPU must have the features the implementation names.
    unsafe fn widen(src: &[H], dst: &mut [f32]);

    /// `dst[i] = src[i]` rounded to `H`; the slices have equal lengths.
    ///
    /// # Safety
    /// The CPU must have the features the implementation names.
    unsafe fn narrow(src: &[f32], dst: &mut [H]);
}

/// `half`'s slice conversions (F16C when `half` detects it, else software; needs nothing).
struct SliceExt;

impl<H> Convert<H> for SliceExt
where
    [H]: HalfFloatSliceExt,
{
    #[inline(always)]
    unsafe fn widen(src: &[H], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }

    #[inline(always)]
    unsafe fn narrow(src: &[f32], dst: &mut [H]) {
        dst.convert_from_f32_slice(src)
    }
}

/// f16 conversions with the F16C instructions themselves, so that they inline into the AVX2
/// kernels (`half`'s slice conversion checks the CPU and calls out per 8 elements). Same
/// instructions and rounding (`_MM_FROUND_TO_NEAREST_INT`) as `half` uses on such CPUs.
#[cfg(target_arch = "x86_64")]
struct F16c;

#[cfg(target_arch = "x86_64")]
impl Convert<f16> for F16c {
    /// # Safety
    /// The CPU must support AVX and F16C.
    #[inline(always)]
    unsafe fn widen(src: &[f16], dst: &mut [f32]) {
        use std::arch::x86_64::{_mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
        let mut s8 = src.chunks_exact(8);
        let mut d8 = dst.chunks_exact_mut(8);
        for (s, d) in (&mut s8).zip(&mut d8) {
            // SAFETY: `s` holds 8 f16 (16 bytes, the unaligned load's width) and `d` 8 f32 (the
            // unaligned store's width); the caller guarantees F16C and AVX.
            unsafe { _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(s.as_ptr().cast()))) }
        }
        for (s, d) in s8.remainder().iter().zip(d8.into_remainder()) {
            *d = s.to_f32();
        }
    }

    /// # Safety
    /// The CPU must support AVX and F16C.
    #[inline(always)]
    unsafe fn narrow(src: &[f32], dst: &mut [f16]) {
        use std::arch::x86_64::{_mm256_cvtps_ph, _mm256_loadu_ps, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT};
        let mut s8 = src.chunks_exact(8);
        let mut d8 = dst.chunks_exact_mut(8);
        for (s, d) in (&mut s8).zip(&mut d8) {
            // SAFETY: `s` holds 8 f32 (the unaligned load's width) and `d` 8 f16 (16 bytes, the
            // unaligned store's width); the caller guarantees F16C and AVX.
            unsafe {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(s.as_ptr()));
                _mm_storeu_si128(d.as_mut_ptr().cast(), h)
            }
        }
        for (s, d) in s8.remainder().iter().zip(d8.into_remainder()) {
            *d = f16::from_f32(*s);
        }
    }
}

/// bf16 conversions as branch-free element loops that vectorise (`half`'s bf16 slice
/// conversion is an indexed loop of scalar conversions whose last 32 elements per call stay
/// scalar). Bit for bit what `bf16::to_f32` and `bf16::from_f32` return, NaN payloads
/// included: NaNs are quieted, everything else rounds to nearest even. Needs no CPU feature.
struct Bf16Bits;

impl Convert<bf16> for Bf16Bits {
    #[inline(always)]
    unsafe fn widen(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            let x = s.to_bits() as u32;
            let quiet = if x & 0x7fff > 0x7f80 { x | 0x40 } else { x };
            *d = f32::from_bits(quiet << 16);
        }
    }

    #[inline(always)]
    unsafe fn narrow(src: &[f32], dst: &mut [bf16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            let x = s.to_bits();
            // Adding 0x7fff plus the kept part's lowest bit carries into the kept part exactly
            // when the dropped half is above one half, or equal to it with an odd kept part.
            let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
            let nan = x & 0x7fff_ffff > 0x7f80_0000;
            *d = bf16::from_bits(if nan { (x >> 16) | 0x40 } else { rounded } as u16);
        }
    }
}

/// The f16 converter of the AVX2 kernels.
#[cfg(target_arch = "x86_64")]
const F16_AVX2: F16c = F16c;
#[cfg(not(target_arch = "x86_64"))]
const F16_AVX2: SliceExt = SliceExt;

/// `dst[i] = f(dst[i], src[i])` for f16/bf16, computed in f32 one block at a time.
///
/// # Safety
/// The CPU must have the features `C` names.
#[inline(always)]
unsafe fn half_in_place<H, C: Convert<H>, F: Fn(f32, f32) -> f32>(dst: &mut [H], src: &[H], f: F) {
    let (mut wa, mut wb) = ([0f32; HALF_BLOCK], [0f32; HALF_BLOCK]);
    for (d, s) in dst.chunks_mut(HALF_BLOCK).zip(src.chunks(HALF_BLOCK)) {
        let (wa, wb) = (&mut wa[..d.len()], &mut wb[..d.len()]);
        // SAFETY: the caller guarantees `C`'s features; all slices have `d.len()` elements.
        unsafe {
            C::widen(d, wa);
            C::widen(s, wb);
            zip_in_place(wa, wb, &f);
            C::narrow(wa, d);
        }
    }
}

/// `dst[i] = f(a[i], b[i])` for f16/bf16, computed in f32 one block at a time.
///
/// # Safety
/// The CPU must have the features `C` names.
#[inline(always)]
unsafe fn half_from2<H, C: Convert<H>, F: Fn(f32, f32) -> f32>(dst: &mut [H], a: &[H], b: &[H], f: F) {
    let (mut wa, mut wb) = ([0f32; HALF_BLOCK], [0f32; HALF_BLOCK]);
    let blocks = dst.chunks_mut(HALF_BLOCK).zip(a.chunks(HALF_BLOCK)).zip(b.chunks(HALF_BLOCK));
    for ((d, x), y) in blocks {
        let (wa, wb) = (&mut wa[..d.len()], &mut wb[..d.len()]);
        // SAFETY: the caller guarantees `C`'s features; all slices have `d.len()` elements.
        unsafe {
            C::widen(x, wa);
            C::widen(y, wb);
            zip_in_place(wa, wb, &f);
            C::narrow(wa, d);
        }
    }
}

/// `buf[i] = f(buf[i])` for f16/bf16, computed in f32 one block at a time.
///
/// # Safety
/// The CPU must have the features `C` names.
#[inline(always)]
unsafe fn half_map<H, C: Convert<H>, F: Fn(f32) -> f32>(buf: &mut [H], f: F) {
    let mut w = [0f32; HALF_BLOCK];
    for b in buf.chunks_mut(HALF_BLOCK) {
        let w = &mut w[..b.len()];
        // SAFETY: the caller guarantees `C`'s features; both slices have `b.len()` elements.
        unsafe {
            C::widen(b, w);
            map_in_place(w, &f);
            C::narrow(w, b);
        }
    }
}

multiversion! {
    /// [`zip_in_place`] for `isa`.
    fn in_place[T: Copy, F: Fn(T, T) -> T](dst: &mut [T], src: &[T], f: F) where [] = zip_in_place;
}
multiversion! {
    /// [`zip_from2`] for `isa`.
    fn from2[T: Copy, F: Fn(T, T) -> T](dst: &mut [T], a: &[T], b: &[T], f: F) where [] = zip_from2;
}
multiversion! {
    /// [`map_in_place`] for `isa`.
    fn map[T: Copy, F: Fn(T) -> T](buf: &mut [T], f: F) where [] = map_in_place;
}
// The half kernels take two converters: `B`, which must need no CPU feature, for the baseline
// build, and `C`, which may need AVX2 and F16C, for the AVX2 build.
multiversion! {
    /// [`half_in_place`] for `isa`, converting with `B` or `C`.
    fn wide_in_place[H, B: Convert<H>, C: Convert<H>, F: Fn(f32, f32) -> f32](
        dst: &mut [H], src: &[H], b: B, c: C, f: F
    ) where []
        = |d, s, _: B, _: C, f| {
            // SAFETY: `B` needs no CPU feature.
            unsafe { half_in_place::<H, B, F>(d, s, f) }
        },
        |d, s, _: B, _: C, f| {
            // SAFETY: this is the AVX2 + F16C build, all that `C` may need.
            unsafe { half_in_place::<H, C, F>(d, s, f) }
        };
}
multiversion! {
    /// [`half_from2`] for `isa`, converting with `B` or `C`.
    fn wide_from2[H, B: Convert<H>, C: Convert<H>, F: Fn(f32, f32) -> f32](
        dst: &mut [H], x: &[H], y: &[H], b: B, c: C, f: F
    ) where []
        = |d, x, y, _: B, _: C, f| {
            // SAFETY: `B` needs no CPU feature.
            unsafe { half_from2::<H, B, F>(d, x, y, f) }
        },
        |d, x, y, _: B, _: C, f| {
            // SAFETY: this is the AVX2 + F16C build, all that `C` may need.
            unsafe { half_from2::<H, C, F>(d, x, y, f) }
        };
}
multiversion! {
    /// [`half_map`] for `isa`, converting with `B` or `C`.
    fn wide_map[H, B: Convert<H>, C: Convert<H>, F: Fn(f32) -> f32](
        buf: &mut [H], b: B, c: C, f: F
    ) where []
        = |w, _: B, _: C, f| {
            // SAFETY: `B` needs no CPU feature.
            unsafe { half_map::<H, B, F>(w, f) }
        },
        |w, _: B, _: C, f| {
            // SAFETY: this is the AVX2 + F16C build, all that `C` may need.
            unsafe { half_map::<H, C, F>(w, f) }
        };
}

// ---------------------------------------------------------------------------------------------
// Operator dispatch: pick the element function once per call, outside the loop.

/// Calls `$apply!(f)` with the element function of `$op` for a float lane type `$t`.
macro_rules! float_op {
    ($op:expr, $t:ty, $apply:ident) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => $apply!(<$t as Lane>::add),
            ReduceOp::Prod => $apply!(<$t as Lane>::mul),
            ReduceOp::Min => $apply!(<$t as Lane>::min),
            ReduceOp::Max => $apply!(<$t as Lane>::max),
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => {
                panic!("bitwise reduce op on a float type")
            }
        }
    };
}

/// Calls `$apply!(f)` with the element function of `$op` for an integer lane type `$t`.
macro_rules! int_op {
    ($op:expr, $t:ty, $apply:ident) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => $apply!(<$t as Lane>::add),
            ReduceOp::Prod => $apply!(<$t as Lane>::mul),
            ReduceOp::Min => $apply!(<$t as Lane>::min),
            ReduceOp::Max => $apply!(<$t as Lane>::max),
            ReduceOp::BAnd => $apply!(<$t as IntLane>::and),
            ReduceOp::BOr => $apply!(<$t as IntLane>::or),
            ReduceOp::BXor => $apply!(<$t as IntLane>::xor),
        }
    };
}

/// The kernel of each dtype in a function generic over `T`: `$prim!(type, op table)` for the
/// primitive types, `$widened!(half type, base, AVX2)` for f16/bf16 (reduced in f32), and
/// `$reference` (the scalar loops) for bool and complex; float8 is never reduced (the
/// reference loops panic on it).
macro_rules! by_dtype {
    ($prim:ident, $widened:ident, $reference:expr) => {
        match T::DTYPE {
            DType::F32 => $prim!(f32, float_op),
            DType::F64 => $prim!(f64, float_op),
            DType::F16 => $widened!(f16, SliceExt, F16_AVX2),
            DType::BF16 => $widened!(bf16, Bf16Bits, Bf16Bits),
            DType::I8 => $prim!(i8, int_op),
            DType::U8 => $prim!(u8, int_op),
            DType::I32 => $prim!(i32, int_op),
            DType::I64 => $prim!(i64, int_op),
            DType::I16 => $prim!(i16, int_op),
            DType::U16 => $prim!(u16, int_op),
            DType::U32 => $prim!(u32, int_op),
            DType::U64 => $prim!(u64, int_op),
            DType::Bool
            | DType::C64
            | DType::C128
            | DType::F8E4M3Fn
            | DType::F8E5M2
            | DType::F8E4M3Fnuz
            | DType::F8E5M2Fnuz
            | DType::F8E8M0Fnu => $reference,
        }
    };
}

/// `dst[i] = op(dst[i], src[i])` with the kernels for `isa`. Lengths must be equal.
pub(crate) fn reduce_into_with<T: Element>(isa: Isa, dst: &mut [T], src: &[T], op: ReduceOp) {
    debug_assert_eq!(dst.len(), src.len());
    macro_rules! prim {
        ($t:ty, $which:ident) => {{
            let (dst, src) = (cast_mut::<T, $t>(dst), cast::<T, $t>(src));
            macro_rules! apply {
                ($f:expr) => {
                    in_place(isa, dst, src, $f)
                };
            }
            $which!(op, $t, apply)
        }};
    }
    macro_rules! widened {
        ($h:ty, $base:expr, $avx2:expr) => {{
            let (dst, src) = (cast_mut::<T, $h>(dst), cast::<T, $h>(src));
            macro_rules! apply {
                ($f:expr) => {
                    wide_in_place(isa, dst, src, $base, $avx2, $f)
                };
            }
            float_op!(op, f32, apply)
        }};
    }
    by_dtype!(prim, widened, super::scalar::reduce_into(dst, src, op))
}

/// `dst[i] = op(a[i], b[i])` with the kernels for `isa`. Lengths must be equal.
pub(crate) fn reduce_from2_with<T: Element>(isa: Isa, dst: &mut [T], a: &[T], b: &[T], op: ReduceOp) {
    debug_assert!(dst.len() == a.len() && dst.len() == b.len());
    macro_rules! prim {
        ($t:ty, $which:ident) => {{
            let (dst, a, b) = (cast_mut::<T, $t>(dst), cast::<T, $t>(a), cast::<T, $t>(b));
            macro_rules! apply {
                ($f:expr) => {
                    from2(isa, dst, a, b, $f)
                };
            }
            $which!(op, $t, apply)
        }};
    }
    macro_rules! widened {
        ($h:ty, $base:expr, $avx2:expr) => {{
            let (dst, a, b) = (cast_mut::<T, $h>(dst), cast::<T, $h>(a), cast::<T, $h>(b));
            macro_rules! apply {
                ($f:expr) => {
                    wide_from2(isa, dst, a, b, $base, $avx2, $f)
                };
            }
            float_op!(op, f32, apply)
        }};
    }
    by_dtype!(prim, widened, super::scalar::reduce_from2(dst, a, b, op))
}

/// Largest divisor for which i8/u8 quotients are computed in f32 (exact there, see
/// [`divide_with`]); larger ones take the scalar path.
const F32_EXACT: usize = 1 << 24;

/// Largest divisor for which i32 quotients are computed in f64.
const F64_EXACT: u64 = 1 << 53;

/// `buf[i] /= n` with the kernels for `isa`, as [`super::scalar::divide`] does it (integers
/// truncate toward zero). `n` must be at least 1.
///
/// Integer division does not vectorise, so i8/u8/i16/u16 divide in f32 and i32/u32 in f64, then truncate.
/// That is exact: for integers `x` and `n` with `|x| < 2^p` (p = 24 or 53, the mantissa bits)
/// and `n` representable, a non-integer `x / n` is at least `1/n` away from the next integer,
/// more than half an ulp of `x / n` (at most `|x|/n · 2^-p`), so rounding the quotient never
/// crosses an integer and truncation gives the integer quotient. i64 and u64 divide as integers.
pub(crate) fn divide_with<T: Element>(isa: Isa, buf: &mut [T], n: usize) {
    debug_assert!(n >= 1);
    match T::DTYPE {
        DType::F32 => {
            let (buf, d) = (cast_mut::<T, f32>(buf), n as f32);
            map(isa, buf, |x| x / d)
        }
        DType::F64 => {
            let (buf, d) = (cast_mut::<T, f64>(buf), n as f64);
            map(isa, buf, |x| x / d)
        }
        DType::F16 => {
            let (buf, d) = (cast_mut::<T, f16>(buf), n as f32);
            wide_map(isa, buf, SliceExt, F16_AVX2, |x| x / d)
        }
        DType::BF16 => {
            let (buf, d) = (cast_mut::<T, bf16>(buf), n as f32);
            wide_map(isa, buf, Bf16Bits, Bf16Bits, |x| x / d)
        }
        DType::I8 if n <= F32_EXACT => {
            let (buf, d) = (cast_mut::<T, i8>(buf), n as f32);
            map(isa, buf, |x| (x as f32 / d) as i8)
        }
        DType::U8 if n <= F32_EXACT => {
            let (buf, d) = (cast_mut::<T, u8>(buf), n as f32);
            map(isa, buf, |x| (x as f32 / d) as u8)
        }
        DType::I32 if (n as u64) <= F64_EXACT => {
            let (buf, d) = (cast_mut::<T, i32>(buf), n as f64);
            map(isa, buf, |x| (x as f64 / d) as i32)
        }
        DType::I16 if n <= F32_EXACT => {
            let (buf, d) = (cast_mut::<T, i16>(buf), n as f32);
            map(isa, buf, |x| (x as f32 / d) as i16)
        }
        DType::U16 if n <= F32_EXACT => {
            let (buf, d) = (cast_mut::<T, u16>(buf), n as f32);
            map(isa, buf, |x| (x as f32 / d) as u16)
        }
        DType::U32 if (n as u64) <= F64_EXACT => {
            let (buf, d) = (cast_mut::<T, u32>(buf), n as f64);
            map(isa, buf, |x| (x as f64 / d) as u32)
        }
        DType::U64 => {
            let (buf, d) = (cast_mut::<T, u64>(buf), n as u64);
            map(isa, buf, |x| x / d)
        }
        DType::I64 if i64::try_from(n).is_ok() => {
            let (buf, d) = (cast_mut::<T, i64>(buf), n as i64);
            map(isa, buf, |x| x / d)
        }
        _ => super::scalar::divide(buf, n),
    }
}

/// [`reduce_into_with`] on the best instruction set of this CPU.
#[inline]
pub(crate) fn reduce_into<T: Element>(dst: &mut [T], src: &[T], op: ReduceOp) {
    reduce_into_with(Isa::detect(), dst, src, op)
}

/// [`reduce_from2_with`] on the best instruction set of this CPU.
#[inline]
pub(crate) fn reduce_from2<T: Element>(dst: &mut [T], a: &[T], b: &[T], op: ReduceOp) {
    reduce_from2_with(Isa::detect(), dst, a, b, op)
}

/// [`divide_with`] on the best instruction set of this CPU.
#[inline]
pub(crate) fn divide<T: Element>(buf: &mut [T], n: usize) {
    divide_with(Isa::detect(), buf, n)
}

#[cfg(test)]
mod tests {
    //! Every instruction set against the scalar reference, with a fixed pseudo-random stream
    //! (the integration tests in `tests/it/reduce.rs` cover the detected one with proptest).

    use super::*;
    use crate::reduce::scalar;

    /// xorshift64*: deterministic, good enough to scatter bits.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
    }

    /// Random elements: mostly small values (so ties and exact results are common), some raw
    /// bit patterns (NaN, infinities, subnormals, signed zeros).
    fn fill<T: Element>(rng: &mut Rng, len: usize) -> Vec<T> {
        (0..len)
            .map(|_| {
                let r = rng.next();
                if r % 4 == 0 {
                    let mut v = T::default();
                    let bytes = bytemuck::bytes_of_mut(&mut v);
                    // 8 random bytes at a time (complex128 elements have 16).
                    for chunk in bytes.chunks_mut(8) {
                        let raw = rng.next().to_le_bytes();
                        chunk.copy_from_slice(&raw[..chunk.len()]);
                    }
                    v
                } else {
                    T::from_f64(((r >> 8) % 9) as f64 - 4.0)
                }
            })
            .collect()
    }

    fn same<T: Element>(a: &[T], b: &[T]) -> bool {
        let nan = |x: T| T::DTYPE.is_float() && x.to_f64().is_nan();
        a.len() == b.len()
            && a.iter().zip(b).all(|(&x, &y)| (nan(x) && nan(y)) || bytemuck::bytes_of(&x) == bytemuck::bytes_of(&y))
    }

    fn every_isa_matches_scalar<T: Element>() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ T::DTYPE as u64);
        for isa in Isa::available() {
            for len in (0..300).step_by(7).chain([511, 512, 513, 1000]) {
                let off = len % 3;
                let a = fill::<T>(&mut rng, len + off);
                let b = fill::<T>(&mut rng, len + 1);
                let (a, b) = (&a[off..], &b[1..]);
                for op in ReduceOp::ALL.into_iter().filter(|op| op.fits(T::DTYPE)) {
                    let mut want = a.to_vec();
                    scalar::reduce_into(&mut want, b, op);
                    let mut got = a.to_vec();
                    reduce_into_with(isa, &mut got, b, op);
                    assert!(same(&got, &want), "{isa:?} {} {op} len {len}", T::DTYPE);
                    let mut got = vec![T::default(); len];
                    reduce_from2_with(isa, &mut got, a, b, op);
                    assert!(same(&got, &want), "{isa:?} {} {op} from2 len {len}", T::DTYPE);
                }
                for n in [1, 2, 3, 7, 1000, 1 << 24, (1 << 24) + 1, usize::MAX] {
                    if !ReduceOp::Avg.fits(T::DTYPE) {
                        break;
                    }
                    let mut want = a.to_vec();
                    scalar::divide(&mut want, n);
                    let mut got = a.to_vec();
                    divide_with(isa, &mut got, n);
                    assert!(same(&got, &want), "{isa:?} {} divide {n} len {len}", T::DTYPE);
                }
            }
        }
    }

    #[test]
    fn every_isa_matches_scalar_for_every_dtype() {
        every_isa_matches_scalar::<f32>();
        every_isa_matches_scalar::<f64>();
        every_isa_matches_scalar::<f16>();
        every_isa_matches_scalar::<bf16>();
        every_isa_matches_scalar::<i8>();
        every_isa_matches_scalar::<u8>();
        every_isa_matches_scalar::<i32>();
        every_isa_matches_scalar::<i64>();
        every_isa_matches_scalar::<i16>();
        every_isa_matches_scalar::<u16>();
        every_isa_matches_scalar::<u32>();
        every_isa_matches_scalar::<u64>();
        every_isa_matches_scalar::<crate::dtype::Bool>();
        every_isa_matches_scalar::<crate::dtype::Complex64>();
        every_isa_matches_scalar::<crate::dtype::Complex128>();
    }

    #[test]
    fn int_division_in_float_is_exact_at_the_edges() {
        for isa in Isa::available() {
            let edges = vec![i32::MIN, i32::MAX, -1, 1, i32::MIN + 1, 0, 65_537 * 3 - 1];
            for n in [2usize, 3, 65_537, (1 << 31) - 1, 1 << 31, (1 << 31) + 1, 1 << 53] {
                let (mut v, mut want) = (edges.clone(), edges.clone());
                scalar::divide(&mut want, n);
                divide_with(isa, &mut v, n);
                assert_eq!(v, want, "{isa:?} n {n}");
            }
        }
    }
}
