//! Per-group int8/int4 quantization in the format of DeepSpeed's quantizer kernels.
//!
//! One file over the usual ~600 lines because it is one kernel family: int8/int4, symmetric
//! and asymmetric, quantize and dequantize share the group arithmetic and the wire format
//! defined here, and each fast path is checked against the plain one beside it.
//!
//! This is the arithmetic and wire format of ZeRO++ qgZ (spec §3.4–3.6,
//! `csrc/includes/quantization_utils.h`); it never communicates. A buffer of `n` elements is
//! cut into contiguous groups of `group_size`; each group gets its own parameters.
//!
//! **Symmetric**, `b` bits, per group:
//! * `amax = max |x|`; the multiplier is `q_scale = 2^(b−1) / amax` (`1.0` when `amax == 0`);
//! * `q = clamp(round_half_even(x · q_scale), −2^(b−1), 2^(b−1) − 1)`, so `+amax` maps to
//!   `2^(b−1)` and is clamped to `2^(b−1) − 1` (error up to one step at the top of the range);
//! * **stored**: one f32 per group, the *inverse* of the multiplier, `1 / q_scale` (≈
//!   `amax / 2^(b−1)`, `1.0` for an all-zero group), exactly as DeepSpeed stores it;
//! * dequantize: `x' = q · stored`.
//!
//! **Asymmetric**, per group (as the spec describes DeepSpeed):
//! * `q_scale = 2^b / (max − min)` (`1.0` when `max == min`), `offset = (max + min) / 2`;
//! * `q = clamp(round_half_even((x − offset) · q_scale), −2^(b−1), 2^(b−1) − 1)`;
//! * **stored**: two f32 per group, interleaved `[1 / q_scale, offset]`;
//! * dequantize: `x' = q · stored_scale + offset`.
//!
//! **Layout.** int8: one two's-complement byte per element. int4: two per byte, the even
//! element in the **high** nibble: `byte = (q[2k] & 0xF) << 4 | (q[2k+1] & 0xF)` (so
//! `(−2, 3)` → `0xE3`); nibbles are sign-extended on read. Group `g` covers elements
//! `[g·E, (g+1)·E)` and bytes `[g·E·b/8, (g+1)·E·b/8)`, so an int4 group size must be even.
//!
//! **Where we differ from DeepSpeed, on purpose.** DeepSpeed reads every input as fp16 (bf16 and
//! f32 inputs are silently garbage, issue #3992); we read f32, f16 and bf16 each as what they
//! are ([`QuantFloat`]) and compute in f32. We compute the multiplier as `2^(b−1) / amax`, which
//! is the same correctly rounded f32 as DeepSpeed's `2^b / (2·amax)` except where `2·amax`
//! overflows f32 (there DeepSpeed gets 0). NaN elements are ignored by the statistics and
//! quantize to code 0 (as CUDA's `__float2int_rn` does). Upstream PR #3696 proposes a different
//! asymmetric range (`(2^b − 1)/(max − min)`, offset at `min`); we follow the spec.
//!
//! The fast kernels are plain loops written to auto-vectorise (rounding by the `1.5·2^23`
//! trick, which is round-half-even for the clamped range), compiled twice on x86-64 (baseline
//! and AVX2, picked at run time); with AVX2 the code pass is written with intrinsics and
//! prefetches the next group, and dequantization (`cvtdq2ps`, then the same multiply and adds
//! as the scalar loop) too. [`dequantize_sum_f32`] and [`dequantize_mean`] add several inputs
//! a chunk at a time, so their partial sums stay in L1. [`scalar`] is the literal reference
//! they are tested against; all paths give bit-identical codes, parameters and values.

use half::{bf16, f16};

use crate::dtype::Element;
use crate::error::{Error, Result};

/// Bits per quantized element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantBits {
    /// One signed byte per element, codes `−128..=127`.
    Int8,
    /// Two signed nibbles per byte (even element high), codes `−8..=7`.
    Int4,
}

impl QuantBits {
    /// 8 or 4.
    #[inline]
    pub fn bits(self) -> u32 {
        match self {
            QuantBits::Int8 => 8,
            QuantBits::Int4 => 4,
        }
    }

    /// The smallest code, `−2^(b−1)`.
    #[inline]
    pub fn q_min(self) -> i32 {
        -(1 << (self.bits() - 1))
    }

    /// The largest code, `2^(b−1) − 1`.
    #[inline]
    pub fn q_max(self) -> i32 {
        (1 << (self.bits() - 1)) - 1
    }
}

/// How a group's range maps to codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantType {
    /// Zero maps to code 0; one stored f32 per group (`1 / q_scale`).
    Symmetric,
    /// The group's midpoint maps to code 0; two stored f32 per group (`1 / q_scale`, offset).
    Asymmetric,
}

impl QuantType {
    /// Stored f32 parameters per group: 1 (symmetric) or 2 (asymmetric).
    #[inline]
    pub fn params_per_group(self) -> usize {
        match self {
            QuantType::Symmetric => 1,
            QuantType::Asymmetric => 2,
        }
    }
}

/// Bytes of quantized data for `n` elements: `n` (int8) or `n / 2` rounded up (int4).
#[inline]
pub fn quantized_len(n: usize, bits: QuantBits) -> usize {
    match bits {
        QuantBits::Int8 => n,
        QuantBits::Int4 => n.div_ceil(2),
    }
}

/// f32 parameters for `n` elements in groups of `group_size`: `(n / group_size) ·`
/// [`QuantType::params_per_group`] (0 when `group_size == 0`, which every kernel rejects).
#[inline]
pub fn params_len(n: usize, group_size: usize, ty: QuantType) -> usize {
    n.checked_div(group_size).unwrap_or(0) * ty.params_per_group()
}

/// A float type the quantizer reads and writes: f32, f16 or bf16 (sealed).
///
/// Values are widened to f32 exactly; results are rounded to the type once (nearest, ties to
/// even).
pub trait QuantFloat: Element + sealed::Sealed {
    /// Widens to f32 (exact).
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type: nearest, ties to even (exact for f32).
    ///
    /// Prefer this to [`Element::from_f64`] for f16/bf16: `half`'s f64 conversions drop the
    /// low mantissa bits before rounding and can round ties the wrong way.
    fn from_f32(v: f32) -> Self;
}

impl QuantFloat for f32 {
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline]
    fn from_f32(v: f32) -> f32 {
        v
    }
}

impl QuantFloat for f16 {
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline]
    fn from_f32(v: f32) -> f16 {
        f16::from_f32(v)
    }
}

impl QuantFloat for bf16 {
    #[inline]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
    #[inline]
    fn from_f32(v: f32) -> bf16 {
        bf16::from_f32(v)
    }
}

mod sealed {
    use half::slice::HalfFloatSliceExt;
    use half::{bf16, f16};

    /// Moving chunks (at most `buf.len()` elements) in and out of f32.
    pub trait Sealed: Sized {
        /// `src` as f32: `src` itself for f32, else widened into `buf[..src.len()]`.
        fn load<'a>(src: &'a [Self], buf: &'a mut [f32]) -> &'a [f32];
        /// Where to write `dst.len()` f32 results: `dst` itself for f32, else
        /// `buf[..dst.len()]`.
        fn out<'a>(dst: &'a mut [Self], buf: &'a mut [f32]) -> &'a mut [f32];
        /// After writing through [`Sealed::out`]: rounds `buf[..dst.len()]` into `dst` (no-op
        /// for f32, whose results are already in place).
        fn finish(buf: &[f32], dst: &mut [Self]);
    }

    impl Sealed for f32 {
        #[inline]
        fn load<'a>(src: &'a [f32], _buf: &'a mut [f32]) -> &'a [f32] {
            src
        }
        #[inline]
        fn out<'a>(dst: &'a mut [f32], _buf: &'a mut [f32]) -> &'a mut [f32] {
            dst
        }
        #[inline]
        fn finish(_buf: &[f32], _dst: &mut [f32]) {}
    }

    impl Sealed for f16 {
        #[inline]
        fn load<'a>(src: &'a [f16], buf: &'a mut [f32]) -> &'a [f32] {
            let n = src.len().min(buf.len());
            let b = &mut buf[..n];
            src[..n].convert_to_f32_slice(b);
            b
        }
        #[inline]
        fn out<'a>(dst: &'a mut [f16], buf: &'a mut [f32]) -> &'a mut [f32] {
            let n = dst.len().min(buf.len());
            &mut buf[..n]
        }
        #[inline]
        fn finish(buf: &[f32], dst: &mut [f16]) {
            let n = dst.len().min(buf.len());
            dst[..n].convert_from_f32_slice(&buf[..n]);
        }
    }

    impl Sealed for bf16 {
        #[inline]
        fn load<'a>(src: &'a [bf16], buf: &'a mut [f32]) -> &'a [f32] {
            let n = src.len().min(buf.len());
            for (d, s) in buf.iter_mut().zip(src) {
                *d = f32::from_bits(u32::from(s.to_bits()) << 16);
            }
            &buf[..n]
        }
        #[inline]
        fn out<'a>(dst: &'a mut [bf16], buf: &'a mut [f32]) -> &'a mut [f32] {
            let n = dst.len().min(buf.len());
            &mut buf[..n]
        }
        #[inline]
        fn finish(buf: &[f32], dst: &mut [bf16]) {
            for (d, &s) in dst.iter_mut().zip(buf) {
                *d = bf16::from_f32(s);
            }
        }
    }
}

/// Quantizes `src` group by group into `out_q` (codes) and `out_params` (per-group stored
/// parameters), in the format described in the [module docs](self).
///
/// Requires `group_size > 0`, `src.len() % group_size == 0`, an even `group_size` for int4,
/// `out_q.len() ==` [`quantized_len`]`(src.len(), bits)` and `out_params.len() ==`
/// [`params_len`]`(src.len(), group_size, ty)`; otherwise
/// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) and nothing is written.
pub fn quantize<T: QuantFloat>(
    src: &[T],
    group_size: usize,
    bits: QuantBits,
    ty: QuantType,
    out_q: &mut [u8],
    out_params: &mut [f32],
) -> Result<()> {
    let f = Format::check("quantize", src.len(), group_size, bits, ty, out_q.len(), out_params.len())?;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        unsafe { avx2::quantize(src, f, out_q, out_params) };
        return Ok(());
    }
    quantize_driver::<T, false>(src, f, out_q, out_params);
    Ok(())
}

/// Dequantizes `q` with `params` into `out` (`x' = q · scale [+ offset]`, rounded once to `T`).
///
/// The inverse layout of [`quantize`]: requires `group_size > 0`, `out.len() % group_size ==
/// 0`, an even `group_size` for int4, `q.len() ==` [`quantized_len`]`(out.len(), bits)` and
/// `params.len() ==` [`params_len`]`(out.len(), group_size, ty)`; otherwise
/// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) and nothing is written.
pub fn dequantize<T: QuantFloat>(
    q: &[u8],
    params: &[f32],
    group_size: usize,
    bits: QuantBits,
    ty: QuantType,
    out: &mut [T],
) -> Result<()> {
    let f = Format::check("dequantize", out.len(), group_size, bits, ty, q.len(), params.len())?;
    sum_dispatch(&[(q, params)], f, Start::Set, None, out);
    Ok(())
}

/// Dequantizes `q` with `params` and adds the result to `acc`: `acc[k] += x'[k]`.
///
/// The reduction step of quantized reduce-scatter (spec §3.5) in f32. Same requirements as
/// [`dequantize`] with `acc` in place of `out`.
pub fn dequantize_add_f32(
    q: &[u8],
    params: &[f32],
    group_size: usize,
    bits: QuantBits,
    ty: QuantType,
    acc: &mut [f32],
) -> Result<()> {
    let f = Format::check("dequantize_add_f32", acc.len(), group_size, bits, ty, q.len(), params.len())?;
    sum_dispatch(&[(q, params)], f, Start::Add, None, acc);
    Ok(())
}

/// Dequantizes several inputs of the same shape and sums them in f32, in input order,
/// starting from `+0.0`: `out[k] = ((0 + x'_0[k]) + x'_1[k]) + …`.
///
/// Bit for bit what zeroing `out` and calling [`dequantize_add_f32`] once per input computes,
/// in one pass over `out` (each block of `out` stays in cache while every input is added).
/// Each input is `(codes, params)` with the requirements of [`dequantize`] for `out.len()`
/// elements; otherwise [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) and
/// nothing is written. No inputs give zeros.
pub fn dequantize_sum_f32(
    inputs: &[(&[u8], &[f32])],
    group_size: usize,
    bits: QuantBits,
    ty: QuantType,
    out: &mut [f32],
) -> Result<()> {
    let f = check_inputs("dequantize_sum_f32", inputs, out.len(), group_size, bits, ty)?;
    sum_dispatch(inputs, f, Start::Zero, None, out);
    Ok(())
}

/// Dequantizes several inputs, sums them in f32 as [`dequantize_sum_f32`] does, divides each
/// sum by `divisor` and rounds it once to `T`: `out[k] = T::from_f32(sum[k] / divisor)`.
///
/// The last step of quantized reduce-scatter (the mean over ranks), without an f32 buffer of
/// the whole output. Same requirements and errors as [`dequantize_sum_f32`].
pub fn dequantize_mean<T: QuantFloat>(
    inputs: &[(&[u8], &[f32])],
    group_size: usize,
    bits: QuantBits,
    ty: QuantType,
    divisor: f32,
    out: &mut [T],
) -> Result<()> {
    let f = check_inputs("dequantize_mean", inputs, out.len(), group_size, bits, ty)?;
    sum_dispatch(inputs, f, Start::Zero, Some(divisor), out);
    Ok(())
}

/// [`Format::check`] of every input of a sum (and of the group shape when there are none).
fn check_inputs(
    what: &str,
    inputs: &[(&[u8], &[f32])],
    n: usize,
    group_size: usize,
    bits: QuantBits,
    ty: QuantType,
) -> Result<Format> {
    let want = (quantized_len(n, bits), params_len(n, group_size, ty));
    let mut f = Format::check(what, n, group_size, bits, ty, want.0, want.1)?;
    for &(q, p) in inputs {
        f = Format::check(what, n, group_size, bits, ty, q.len(), p.len())?;
    }
    Ok(f)
}

/// Runs [`sum_driver`] with AVX2 where the CPU has it.
fn sum_dispatch<T: QuantFloat>(
    inputs: &[(&[u8], &[f32])],
    f: Format,
    start: Start,
    divisor: Option<f32>,
    out: &mut [T],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        unsafe { avx2::sum(inputs, f, start, divisor, out) };
        return;
    }
    sum_driver::<T, false>(inputs, f, start, divisor, out);
}

/// Checked shape of one call.
#[derive(Debug, Clone, Copy)]
struct Format {
    group_size: usize,
    bits: QuantBits,
    ty: QuantType,
}

impl Format {
    fn check(
        what: &str,
        n: usize,
        group_size: usize,
        bits: QuantBits,
        ty: QuantType,
        q_len: usize,
        p_len: usize,
    ) -> Result<Format> {
        if group_size == 0 {
            return Err(Error::invalid(format!("{what}: group size is 0")));
        }
        if n % group_size != 0 {
            return Err(Error::invalid(format!("{what}: {n} elements do not split into groups of {group_size}")));
        }
        if bits == QuantBits::Int4 && group_size % 2 != 0 {
            return Err(Error::invalid(format!(
                "{what}: int4 needs an even group size (two codes per byte), got {group_size}"
            )));
        }
        let want_q = quantized_len(n, bits);
        if q_len != want_q {
            return Err(Error::invalid(format!(
                "{what}: quantized buffer has {q_len} bytes, {n} elements at {} bits need {want_q}",
                bits.bits()
            )));
        }
        let want_p = params_len(n, group_size, ty);
        if p_len != want_p {
            return Err(Error::invalid(format!(
                "{what}: params buffer has {p_len} floats, {} groups of {group_size} ({ty:?}) need {want_p}",
                n / group_size
            )));
        }
        Ok(Format { group_size, bits, ty })
    }

    /// Bytes of codes per group.
    fn group_bytes(self) -> usize {
        quantized_len(self.group_size, self.bits)
    }
}

/// Per-group parameters: the multiplier used to quantize and what is stored.
#[derive(Debug, Clone, Copy)]
struct GroupParams {
    q_scale: f32,
    stored_scale: f32,
    offset: f32,
}

fn symmetric_params(amax: f32, bits: QuantBits) -> GroupParams {
    let half_range = (1u32 << (bits.bits() - 1)) as f32;
    let q_scale = if amax == 0.0 { 1.0 } else { half_range / amax };
    GroupParams { q_scale, stored_scale: 1.0 / q_scale, offset: 0.0 }
}

fn asymmetric_params(min: f32, max: f32, bits: QuantBits) -> GroupParams {
    let range = (1u32 << bits.bits()) as f32;
    let q_scale = if max == min { 1.0 } else { range / (max - min) };
    GroupParams { q_scale, stored_scale: 1.0 / q_scale, offset: (max + min) / 2.0 }
}

/// Elements widened/produced per step for f16/bf16 (a 4 KiB f32 scratch; even, so an int4
/// chunk is whole bytes).
const CHUNK: usize = 1024;

// ---------------------------------------------------------------------------------------------
// Drivers: the group loops. `#[inline(always)]` so that the AVX2 wrappers below compile the
// whole loop nest, kernels included, for AVX2.

/// `AVX2` selects the explicit AVX2 code pass; it is `true` only in the instantiation made by
/// [`avx2::quantize`], whose caller has checked that the CPU supports AVX2.
#[inline(always)]
fn quantize_driver<T: QuantFloat, const AVX2: bool>(src: &[T], f: Format, out_q: &mut [u8], out_params: &mut [f32]) {
    let mut buf = [0f32; CHUNK];
    let chunk_bytes = quantized_len(CHUNK, f.bits);
    let groups = src
        .chunks_exact(f.group_size)
        .zip(out_q.chunks_exact_mut(f.group_bytes()))
        .zip(out_params.chunks_exact_mut(f.ty.params_per_group()));
    for (gi, ((group, q), stored)) in groups.enumerate() {
        // The next group, which the AVX2 code pass prefetches while it works on this one.
        let next = src.get((gi + 1) * f.group_size..(gi + 2) * f.group_size).unwrap_or(&[]);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = next;
        // Pass 1: statistics.
        let p = match f.ty {
            QuantType::Symmetric => {
                let mut amax_bits = 0u32;
                for c in group.chunks(CHUNK) {
                    let x = T::load(c, &mut buf);
                    #[cfg(target_arch = "x86_64")]
                    if AVX2 {
                        // SAFETY: `AVX2` is only true when the CPU supports AVX2 (see above).
                        amax_bits = amax_bits.max(unsafe { x86::abs_max_bits(x) });
                        continue;
                    }
                    amax_bits = amax_bits.max(kernel::abs_max_bits(x));
                }
                symmetric_params(f32::from_bits(amax_bits), f.bits)
            }
            QuantType::Asymmetric => {
                let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
                for c in group.chunks(CHUNK) {
                    let (l, h) = kernel::min_max(T::load(c, &mut buf));
                    lo = if l < lo { l } else { lo };
                    hi = if h > hi { h } else { hi };
                }
                asymmetric_params(lo, hi, f.bits)
            }
        };
        // Pass 2: codes.
        let mut next_chunks = next.chunks(CHUNK);
        for (c, qc) in group.chunks(CHUNK).zip(q.chunks_mut(chunk_bytes)) {
            let x = T::load(c, &mut buf);
            let ahead: &[u8] = bytemuck::cast_slice(next_chunks.next().unwrap_or(&[]));
            #[cfg(target_arch = "x86_64")]
            if AVX2 {
                // SAFETY: `AVX2` is only true when the CPU supports AVX2 (see above); `qc`
                // holds exactly the codes of `x` (both cut from the same checked shapes).
                unsafe { x86::quantize(x, p, f, qc, ahead) };
                continue;
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = ahead;
            match (f.bits, f.ty) {
                (QuantBits::Int8, QuantType::Symmetric) => kernel::quantize_i8::<false>(x, p.offset, p.q_scale, qc),
                (QuantBits::Int8, QuantType::Asymmetric) => kernel::quantize_i8::<true>(x, p.offset, p.q_scale, qc),
                (QuantBits::Int4, QuantType::Symmetric) => kernel::quantize_i4::<false>(x, p.offset, p.q_scale, qc),
                (QuantBits::Int4, QuantType::Asymmetric) => kernel::quantize_i4::<true>(x, p.offset, p.q_scale, qc),
            }
        }
        match stored {
            [s] => *s = p.stored_scale,
            [s, o] => {
                *s = p.stored_scale;
                *o = p.offset;
            }
            _ => {}
        }
    }
}

/// `(stored_scale, offset)` of a group's parameter slice.
#[inline(always)]
fn read_params(p: &[f32]) -> (f32, f32) {
    match *p {
        [s] => (s, 0.0),
        [s, o, ..] => (s, o),
        [] => (1.0, 0.0),
    }
}

/// How the first input of a sum meets `out`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// `out = x'` (one input: plain dequantization).
    Set,
    /// `out += x'` (accumulate into what `out` holds).
    Add,
    /// `out = 0 + x'` (a fresh sum: `−0.0` becomes `+0.0`, as adding to a zeroed buffer does).
    Zero,
}

/// `out` = the sum of the dequantized `inputs` (how it starts: `start`), divided by
/// `divisor` when given, rounded once to `T`. Works a chunk of at most [`CHUNK`] elements of
/// one group at a time, so that the f32 partial sums stay in L1 while every input is added.
///
/// `AVX2` selects the intrinsics of [`x86::dequantize`]; it is `true` only in the
/// instantiation made by [`avx2::sum`], whose caller has checked that the CPU supports AVX2.
#[inline(always)]
fn sum_driver<T: QuantFloat, const AVX2: bool>(
    inputs: &[(&[u8], &[f32])],
    f: Format,
    start: Start,
    divisor: Option<f32>,
    out: &mut [T],
) {
    let mut buf = [0f32; CHUNK];
    let chunk_bytes = quantized_len(CHUNK, f.bits);
    let (gb, ppg) = (f.group_bytes(), f.ty.params_per_group());
    for (g, group) in out.chunks_exact_mut(f.group_size).enumerate() {
        for (c, dc) in group.chunks_mut(CHUNK).enumerate() {
            let o = T::out(dc, &mut buf);
            if inputs.is_empty() && start != Start::Add {
                o.fill(0.0);
            }
            for (j, &(q, p)) in inputs.iter().enumerate() {
                let (scale, offset) = read_params(&p[g * ppg..][..ppg]);
                let qc = &q[g * gb + c * chunk_bytes..][..quantized_len(o.len(), f.bits)];
                let mode = if j == 0 { start } else { Start::Add };
                dequantize_chunk::<AVX2>(qc, scale, offset, f, mode, o);
            }
            match divisor.map(|d| (d, exact_reciprocal(d))) {
                Some((_, Some(r))) => o.iter_mut().for_each(|v| *v *= r),
                Some((d, None)) => o.iter_mut().for_each(|v| *v /= d),
                None => {}
            }
            T::finish(&buf, dc);
        }
    }
}

/// `1 / d` when it is exact and `x · (1 / d)` is therefore `x / d` for every `x` (both are the
/// correctly rounded value of the same real number): `d` a normal power of two whose
/// reciprocal is normal too. Multiplying is several times faster than dividing.
fn exact_reciprocal(d: f32) -> Option<f32> {
    let r = 1.0 / d;
    let pow2 = |v: f32| v.is_normal() && v.to_bits() & 0x007f_ffff == 0;
    (pow2(d) && pow2(r)).then_some(r)
}

/// One input's codes `q` dequantized into `o` as `mode` says (monomorphised per case).
#[inline(always)]
fn dequantize_chunk<const AVX2: bool>(q: &[u8], scale: f32, offset: f32, f: Format, mode: Start, o: &mut [f32]) {
    macro_rules! run {
        ($m:expr) => {{
            const M: u8 = $m;
            #[cfg(target_arch = "x86_64")]
            if AVX2 {
                // SAFETY: `AVX2` is only true when the CPU supports AVX2 (see above); `q`
                // holds exactly the codes of `o` (both cut from the same checked shapes).
                unsafe {
                    match (f.bits, f.ty) {
                        (QuantBits::Int8, QuantType::Symmetric) => {
                            x86::dequantize::<false, false, M>(q, scale, offset, o)
                        }
                        (QuantBits::Int8, QuantType::Asymmetric) => {
                            x86::dequantize::<false, true, M>(q, scale, offset, o)
                        }
                        (QuantBits::Int4, QuantType::Symmetric) => {
                            x86::dequantize::<true, false, M>(q, scale, offset, o)
                        }
                        (QuantBits::Int4, QuantType::Asymmetric) => {
                            x86::dequantize::<true, true, M>(q, scale, offset, o)
                        }
                    }
                }
                return;
            }
            match (f.bits, f.ty) {
                (QuantBits::Int8, QuantType::Symmetric) => kernel::dequantize_i8::<M, false>(q, scale, offset, o),
                (QuantBits::Int8, QuantType::Asymmetric) => kernel::dequantize_i8::<M, true>(q, scale, offset, o),
                (QuantBits::Int4, QuantType::Symmetric) => kernel::dequantize_i4::<M, false>(q, scale, offset, o),
                (QuantBits::Int4, QuantType::Asymmetric) => kernel::dequantize_i4::<M, true>(q, scale, offset, o),
            }
        }};
    }
    match mode {
        Start::Set => run!(kernel::SET),
        Start::Add => run!(kernel::ADD),
        Start::Zero => run!(kernel::ZERO_ADD),
    }
}

/// The drivers compiled with AVX2 enabled.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Format, QuantFloat, Start};

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize<T: QuantFloat>(src: &[T], f: Format, out_q: &mut [u8], out_params: &mut [f32]) {
        super::quantize_driver::<T, true>(src, f, out_q, out_params)
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn sum<T: QuantFloat>(
        inputs: &[(&[u8], &[f32])],
        f: Format,
        start: Start,
        divisor: Option<f32>,
        out: &mut [T],
    ) {
        super::sum_driver::<T, true>(inputs, f, start, divisor, out)
    }
}

/// The code pass written with AVX2 intrinsics: round with `cvtps2dq` (nearest-even in the
/// default FP environment), narrow with saturating packs, pair int4 nibbles with `maddubs`.
/// About half the instructions of the auto-vectorised loop; tails go to [`kernel`].
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{kernel, Format, GroupParams, QuantBits, QuantType};

    /// Codes of `x` into `out`, prefetching `ahead` (the same part of the next group) so that
    /// its read from memory overlaps this group's arithmetic.
    ///
    /// # Safety
    /// The CPU must support AVX2, and `out.len()` must be `quantized_len(x.len(), f.bits)`
    /// with `x.len()` even for int4.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize(x: &[f32], p: GroupParams, f: Format, out: &mut [u8], ahead: &[u8]) {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            match (f.bits, f.ty) {
                (QuantBits::Int8, QuantType::Symmetric) => quantize_blocks::<false, false>(x, p, out, ahead),
                (QuantBits::Int8, QuantType::Asymmetric) => quantize_blocks::<false, true>(x, p, out, ahead),
                (QuantBits::Int4, QuantType::Symmetric) => quantize_blocks::<true, false>(x, p, out, ahead),
                (QuantBits::Int4, QuantType::Asymmetric) => quantize_blocks::<true, true>(x, p, out, ahead),
            }
        }
    }

    /// The codes of the 8 floats at `ptr` as i32, clamped to `[lo, hi]`. NaN gives 0 for int8;
    /// for int4 (`NAN_IS_MIN`) it gives `i32::MIN`, which the packs saturate to the byte
    /// `0x80`, whose low nibble is code 0, saving the NaN mask.
    ///
    /// # Safety
    /// The CPU must support AVX2 and `ptr` must be valid for reading 8 floats.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn codes8<const ASYM: bool, const NAN_IS_MIN: bool>(
        ptr: *const f32,
        offset: __m256,
        scale: __m256,
        lo: __m256,
        hi: __m256,
    ) -> __m256i {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            let v = _mm256_loadu_ps(ptr);
            let v = if ASYM { _mm256_sub_ps(v, offset) } else { v };
            let v = _mm256_mul_ps(v, scale);
            if NAN_IS_MIN {
                // `max`/`min` return their second operand when either is NaN: NaN stays NaN and
                // converts to `i32::MIN`.
                _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, v)))
            } else {
                let v = _mm256_and_ps(v, _mm256_cmp_ps::<_CMP_ORD_Q>(v, v));
                _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi))
            }
        }
    }

    /// `max |x|` over non-NaN elements as f32 bits, as [`kernel::abs_max_bits`]: `maxps`
    /// returns its second operand when the first is NaN, so NaN elements are skipped; four
    /// accumulators hide the latency.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn abs_max_bits(x: &[f32]) -> u32 {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
            let mut acc = [_mm256_setzero_ps(); 4];
            let blocks = x.chunks_exact(32);
            let tail = blocks.remainder();
            for c in blocks {
                for (i, a) in acc.iter_mut().enumerate() {
                    // `c` has 32 floats: offsets 0, 8, 16 and 24 are in bounds.
                    let v = _mm256_and_ps(_mm256_loadu_ps(c.as_ptr().add(8 * i)), abs);
                    *a = _mm256_max_ps(v, *a);
                }
            }
            let m = _mm256_max_ps(_mm256_max_ps(acc[0], acc[1]), _mm256_max_ps(acc[2], acc[3]));
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), m);
            // Non-negative, non-NaN floats order as their bit patterns.
            lanes.iter().fold(kernel::abs_max_bits(tail), |b, l| b.max(l.to_bits()))
        }
    }

    /// # Safety
    /// As [`quantize`].
    #[target_feature(enable = "avx2")]
    unsafe fn quantize_blocks<const INT4: bool, const ASYM: bool>(
        x: &[f32],
        p: GroupParams,
        out: &mut [u8],
        ahead: &[u8],
    ) {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            // Bytes of `ahead` to prefetch per 32-element block (whole cache lines).
            let per_block = ahead.len().div_ceil((x.len() / 32).max(1)).next_multiple_of(64);
            let mut lines = ahead.chunks(per_block.max(64));
            let (lo, hi) = if INT4 { (-8.0, 7.0) } else { (-128.0, 127.0) };
            let (vlo, vhi) = (_mm256_set1_ps(lo), _mm256_set1_ps(hi));
            let scale = _mm256_set1_ps(p.q_scale);
            let offset = _mm256_set1_ps(p.offset);
            let natural = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            let low_nibble = _mm256_set1_epi8(0x0F);
            let even_high = _mm256_set1_epi16(0x0110); // bytes [16, 1]: 16·even + odd
            let bytes_per_block = if INT4 { 16 } else { 32 };
            let blocks = x.chunks_exact(32);
            let tail = blocks.remainder();
            let mut outs = out.chunks_exact_mut(bytes_per_block);
            for (c, o) in blocks.zip(&mut outs) {
                if let Some(l) = lines.next() {
                    for line in l.chunks(64) {
                        _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast());
                    }
                }
                // `c` has 32 floats: the loads at 0, 8, 16 and 24 are in bounds.
                let ptr = c.as_ptr();
                let a = codes8::<ASYM, INT4>(ptr, offset, scale, vlo, vhi);
                let b = codes8::<ASYM, INT4>(ptr.add(8), offset, scale, vlo, vhi);
                let c = codes8::<ASYM, INT4>(ptr.add(16), offset, scale, vlo, vhi);
                let d = codes8::<ASYM, INT4>(ptr.add(24), offset, scale, vlo, vhi);
                let ab = _mm256_packs_epi32(a, b);
                let cd = _mm256_packs_epi32(c, d);
                // 32 codes as i8, in element order.
                let q = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), natural);
                if INT4 {
                    let pairs = _mm256_maddubs_epi16(_mm256_and_si256(q, low_nibble), even_high);
                    let packed = _mm256_permute4x64_epi64::<0b00_00_10_00>(_mm256_packus_epi16(pairs, pairs));
                    // `o` has 16 bytes.
                    _mm_storeu_si128(o.as_mut_ptr().cast(), _mm256_castsi256_si128(packed));
                } else {
                    // `o` has 32 bytes.
                    _mm256_storeu_si256(o.as_mut_ptr().cast(), q);
                }
            }
            let rest = outs.into_remainder();
            if INT4 {
                kernel::quantize_i4::<ASYM>(tail, p.offset, p.q_scale, rest);
            } else {
                kernel::quantize_i8::<ASYM>(tail, p.offset, p.q_scale, rest);
            }
        }
    }

    /// The codes of 32 elements at `ptr` as four vectors of 8 i32, in element order.
    ///
    /// # Safety
    /// The CPU must support AVX2 and `ptr` must be valid for reading 16 bytes (int4) or 32
    /// bytes (int8).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn codes32<const INT4: bool>(ptr: *const u8) -> [__m256i; 4] {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            let (lo16, hi16) = if INT4 {
                let b = _mm_loadu_si128(ptr.cast());
                let nibble = _mm_set1_epi8(0x0F);
                let eight = _mm_set1_epi8(8);
                // Sign-extend a nibble n: (n ^ 8) − 8.
                let even = _mm_sub_epi8(_mm_xor_si128(_mm_and_si128(_mm_srli_epi16::<4>(b), nibble), eight), eight);
                let odd = _mm_sub_epi8(_mm_xor_si128(_mm_and_si128(b, nibble), eight), eight);
                (_mm_unpacklo_epi8(even, odd), _mm_unpackhi_epi8(even, odd))
            } else {
                (_mm_loadu_si128(ptr.cast()), _mm_loadu_si128(ptr.add(16).cast()))
            };
            [
                _mm256_cvtepi8_epi32(lo16),
                _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(lo16)),
                _mm256_cvtepi8_epi32(hi16),
                _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(hi16)),
            ]
        }
    }

    /// `out[k] (=, +=, = 0 +) q[k] · scale [+ offset]` as [`kernel::dequantize_i8`] and
    /// [`kernel::dequantize_i4`] with the same `MODE`, 32 elements at a time: the same
    /// multiplications and additions in the same order, so the same bits.
    ///
    /// # Safety
    /// The CPU must support AVX2, and `q.len()` must be `quantized_len(out.len(), bits)` with
    /// `out.len()` even for int4.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn dequantize<const INT4: bool, const ASYM: bool, const MODE: u8>(
        q: &[u8],
        scale: f32,
        offset: f32,
        out: &mut [f32],
    ) {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            let vscale = _mm256_set1_ps(scale);
            let voffset = _mm256_set1_ps(offset);
            let zero = _mm256_setzero_ps();
            let bytes_per_block = if INT4 { 16 } else { 32 };
            let mut blocks = out.chunks_exact_mut(32);
            let mut codes = q.chunks_exact(bytes_per_block);
            for (o, c) in (&mut blocks).zip(&mut codes) {
                // `c` has the 16 or 32 code bytes of the 32 floats of `o`.
                let ints = codes32::<INT4>(c.as_ptr());
                let ptr = o.as_mut_ptr();
                for (i, v) in ints.into_iter().enumerate() {
                    let v = _mm256_mul_ps(_mm256_cvtepi32_ps(v), vscale);
                    let v = if ASYM { _mm256_add_ps(v, voffset) } else { v };
                    // `o` has 32 floats: offsets 0, 8, 16 and 24 are in bounds.
                    let at = ptr.add(8 * i);
                    let v = match MODE {
                        kernel::SET => v,
                        kernel::ADD => _mm256_add_ps(_mm256_loadu_ps(at), v),
                        _ => _mm256_add_ps(zero, v),
                    };
                    _mm256_storeu_ps(at, v);
                }
            }
            let rest = blocks.into_remainder();
            let q_rest = codes.remainder();
            if INT4 {
                kernel::dequantize_i4::<MODE, ASYM>(q_rest, scale, offset, rest);
            } else {
                kernel::dequantize_i8::<MODE, ASYM>(q_rest, scale, offset, rest);
            }
        }
    }
}

/// Element loops, written so that LLVM vectorises them (no branches, no libm calls).
mod kernel {
    /// `1.5 · 2^23`: for `|v| ≤ 2^22`, `v + MAGIC` rounds `v` to an integer, ties to even (the
    /// default IEEE mode), and the low bits of the sum's bit pattern are that integer in two's
    /// complement.
    const MAGIC: f32 = 12_582_912.0;

    /// `max |x|` over non-NaN elements, as f32 bits (0 when all are NaN or zero). Integer order
    /// of non-negative float bit patterns is float order, so this vectorises as integer max.
    #[inline(always)]
    pub(super) fn abs_max_bits(x: &[f32]) -> u32 {
        let mut m = 0i32;
        for &v in x {
            let b = (v.to_bits() & 0x7fff_ffff) as i32;
            let b = if b > 0x7f80_0000 { 0 } else { b };
            m = if b > m { b } else { m };
        }
        m as u32
    }

    /// `(min, max)` over non-NaN elements (`(+∞, −∞)` when all are NaN).
    #[inline(always)]
    pub(super) fn min_max(x: &[f32]) -> (f32, f32) {
        let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
        for &v in x {
            lo = if v < lo { v } else { lo };
            hi = if v > hi { v } else { hi };
        }
        (lo, hi)
    }

    /// The code of one element as the low bits of a `u32` (two's complement).
    #[inline(always)]
    fn code<const ASYM: bool>(x: f32, offset: f32, q_scale: f32, lo: f32, hi: f32) -> u32 {
        let v = if ASYM { (x - offset) * q_scale } else { x * q_scale };
        #[allow(clippy::eq_op)] // NaN test that vectorises to one compare
        let v = if v == v { v } else { 0.0 };
        let v = if v < lo { lo } else { v };
        let v = if v > hi { hi } else { v };
        (v + MAGIC).to_bits()
    }

    #[inline(always)]
    pub(super) fn quantize_i8<const ASYM: bool>(x: &[f32], offset: f32, q_scale: f32, out: &mut [u8]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = code::<ASYM>(v, offset, q_scale, -128.0, 127.0) as u8;
        }
    }

    #[inline(always)]
    pub(super) fn quantize_i4<const ASYM: bool>(x: &[f32], offset: f32, q_scale: f32, out: &mut [u8]) {
        for (o, pair) in out.iter_mut().zip(x.chunks_exact(2)) {
            let even = code::<ASYM>(pair[0], offset, q_scale, -8.0, 7.0);
            let odd = code::<ASYM>(pair[1], offset, q_scale, -8.0, 7.0);
            *o = ((even << 4) | (odd & 0xF)) as u8;
        }
    }

    #[inline(always)]
    fn value<const ASYM: bool>(q: i8, scale: f32, offset: f32) -> f32 {
        let v = f32::from(q) * scale;
        if ASYM {
            v + offset
        } else {
            v
        }
    }

    /// [`put`] mode: `o = v`.
    pub(super) const SET: u8 = 0;
    /// [`put`] mode: `o += v`.
    pub(super) const ADD: u8 = 1;
    /// [`put`] mode: `o = 0 + v` (`−0.0` becomes `+0.0`, as adding to a zeroed buffer does).
    pub(super) const ZERO_ADD: u8 = 2;

    #[inline(always)]
    fn put<const MODE: u8>(o: &mut f32, v: f32) {
        match MODE {
            SET => *o = v,
            ADD => *o += v,
            _ => *o = 0.0 + v,
        }
    }

    #[inline(always)]
    pub(super) fn dequantize_i8<const MODE: u8, const ASYM: bool>(q: &[u8], scale: f32, offset: f32, out: &mut [f32]) {
        for (o, &b) in out.iter_mut().zip(q) {
            put::<MODE>(o, value::<ASYM>(b as i8, scale, offset));
        }
    }

    #[inline(always)]
    pub(super) fn dequantize_i4<const MODE: u8, const ASYM: bool>(q: &[u8], scale: f32, offset: f32, out: &mut [f32]) {
        for (pair, &b) in out.chunks_exact_mut(2).zip(q) {
            let even = (b as i8) >> 4;
            let odd = ((b << 4) as i8) >> 4;
            if let [e, o] = pair {
                put::<MODE>(e, value::<ASYM>(even, scale, offset));
                put::<MODE>(o, value::<ASYM>(odd, scale, offset));
            }
        }
    }
}

/// The literal, one-element-at-a-time reference the fast kernels are tested against.
///
/// Same formats, checks and results as the fast functions, written straight from the formulas
/// in the [module docs](super) (`f32::round_ties_even`, then clamp).
pub mod scalar {
    use super::{params_len, quantized_len, Format, QuantBits, QuantFloat, QuantType};
    use crate::error::Result;

    /// Reference for [`quantize`](super::quantize).
    pub fn quantize<T: QuantFloat>(
        src: &[T],
        group_size: usize,
        bits: QuantBits,
        ty: QuantType,
        out_q: &mut [u8],
        out_params: &mut [f32],
    ) -> Result<()> {
        let f = Format::check("quantize", src.len(), group_size, bits, ty, out_q.len(), out_params.len())?;
        let (q_min, q_max) = (bits.q_min() as f32, bits.q_max() as f32);
        let ppg = ty.params_per_group();
        for (g, group) in src.chunks_exact(f.group_size).enumerate() {
            let x: Vec<f32> = group.iter().map(|&v| v.to_f32()).collect();
            let p = match ty {
                QuantType::Symmetric => {
                    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    super::symmetric_params(amax, bits)
                }
                QuantType::Asymmetric => {
                    let lo = x.iter().fold(f32::INFINITY, |m, &v| m.min(v));
                    let hi = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                    super::asymmetric_params(lo, hi, bits)
                }
            };
            for (i, &v) in x.iter().enumerate() {
                let scaled = match ty {
                    QuantType::Symmetric => v * p.q_scale,
                    QuantType::Asymmetric => (v - p.offset) * p.q_scale,
                };
                let r = scaled.round_ties_even();
                let code = if r.is_nan() { 0 } else { r.clamp(q_min, q_max) as i32 };
                let k = g * f.group_size + i;
                match bits {
                    QuantBits::Int8 => out_q[k] = code as u8,
                    QuantBits::Int4 => {
                        let nibble = (code & 0xF) as u8;
                        let byte = &mut out_q[k / 2];
                        *byte = if k % 2 == 0 { (*byte & 0x0F) | (nibble << 4) } else { (*byte & 0xF0) | nibble };
                    }
                }
            }
            out_params[g * ppg] = p.stored_scale;
            if ty == QuantType::Asymmetric {
                out_params[g * ppg + 1] = p.offset;
            }
        }
        debug_assert_eq!(out_q.len(), quantized_len(src.len(), bits));
        debug_assert_eq!(out_params.len(), params_len(src.len(), group_size, ty));
        Ok(())
    }

    /// The signed code of element `k`.
    pub fn code(q: &[u8], k: usize, bits: QuantBits) -> i32 {
        match bits {
            QuantBits::Int8 => i32::from(q[k] as i8),
            QuantBits::Int4 => {
                let b = q[k / 2];
                let nibble = if k % 2 == 0 { b >> 4 } else { b & 0xF };
                i32::from(((nibble << 4) as i8) >> 4)
            }
        }
    }

    /// Reference for [`dequantize`](super::dequantize), as f32 (before rounding to a narrower
    /// output type).
    pub fn dequantize_f32(
        q: &[u8],
        params: &[f32],
        group_size: usize,
        bits: QuantBits,
        ty: QuantType,
        out: &mut [f32],
    ) -> Result<()> {
        let f = Format::check("dequantize", out.len(), group_size, bits, ty, q.len(), params.len())?;
        let ppg = ty.params_per_group();
        for (k, o) in out.iter_mut().enumerate() {
            let g = k / f.group_size;
            let scale = params[g * ppg];
            let v = code(q, k, bits) as f32 * scale;
            *o = match ty {
                QuantType::Symmetric => v,
                QuantType::Asymmetric => v + params[g * ppg + 1],
            };
        }
        Ok(())
    }
}
