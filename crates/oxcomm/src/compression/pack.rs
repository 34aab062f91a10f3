//! Sign bits: packing f32 signs into bytes and unpacking them to ±1 or ±scale.
//!
//! One file over the usual ~600 lines because it is one kernel family: the scalar reference,
//! the fast kernels for both bit orders and the property tests that hold them bit for bit
//! equal belong side by side.
//!
//! This is the wire format of the 1-bit error-compensated all-reduce (spec §2.2–2.3). Element
//! `k` is *non-negative* (bit 1) unless `k < 0`: `+0`, `−0` and NaN all give bit 1, as the
//! reference cupy path does (`sign(x) + 1 != 0`). Eight elements make one byte; where the bit of
//! element `8m + j` sits in byte `m` is the [`BitOrder`]. Unpacking maps bit 1 to `+scale` and
//! bit 0 to `−scale` (exactly `scale · (±1)`).
//!
//! The kernels take whole bytes only: the caller pads its buffer to a multiple of 8 elements
//! (the 1-bit all-reduce pads to a multiple of `8 · world_size` anyway). On x86-64 they use AVX2
//! when the CPU has it and SSE2 otherwise; elsewhere a portable loop. [`scalar`] is the plain
//! reference every fast path is tested against. This module knows nothing about communication.

use crate::error::{Error, Result};

/// Where the bit of element `8m + j` sits in byte `m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BitOrder {
    /// Bit `7 − j` (most significant first), as `numpy.packbits`/`cupy.packbits` with their
    /// default `bitorder="big"` and DeepSpeed's XPU kernel. The reference (NCCL/cupy) wire
    /// format.
    #[default]
    Big,
    /// Bit `j` (least significant first), as `torch_npu.npu_sign_bits_pack` (DeepSpeed's HCCL
    /// backend) and `packbits(..., bitorder="little")`.
    Little,
}

impl BitOrder {
    /// The bit position (0 = least significant) of element `j` (`j < 8`) of a byte.
    #[inline]
    pub fn shift(self, j: usize) -> u32 {
        let j = (j & 7) as u32;
        match self {
            BitOrder::Big => 7 - j,
            BitOrder::Little => j,
        }
    }
}

/// Bytes needed for the signs of `n` elements (`n` a multiple of 8 for the kernels here).
#[inline]
pub fn packed_len(n: usize) -> usize {
    n.div_ceil(8)
}

/// Packs the signs of `src` into `dst`: bit 1 unless the element is `< 0` (so `±0` and NaN
/// give 1).
///
/// `src.len()` must be a multiple of 8 and `dst.len() == src.len() / 8`; otherwise
/// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) and nothing is written.
pub fn pack_signs(src: &[f32], dst: &mut [u8], order: BitOrder) -> Result<()> {
    if src.len() % 8 != 0 {
        return Err(Error::invalid(format!(
            "pack_signs: {} elements is not a multiple of 8 (pad the buffer first)",
            src.len()
        )));
    }
    check_bytes("pack_signs", dst.len(), src.len())?;
    fast::pack(src, dst, order);
    Ok(())
}

/// Unpacks `src` to `dst` as `+1.0` (bit 1) or `−1.0` (bit 0).
///
/// Requires `dst.len() == 8 · src.len()`; otherwise
/// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) and nothing is written.
pub fn unpack_signs(src: &[u8], dst: &mut [f32], order: BitOrder) -> Result<()> {
    unpack_scaled(src, dst, 1.0, order)
}

/// Unpacks `src` to `dst[k] = scale · (±1)`: `+scale` for bit 1, `−scale` for bit 0.
///
/// Requires `dst.len() == 8 · src.len()`; otherwise
/// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) and nothing is written.
pub fn unpack_scaled(src: &[u8], dst: &mut [f32], scale: f32, order: BitOrder) -> Result<()> {
    check_bytes("unpack_scaled", src.len(), dst.len())?;
    fast::unpack::<false>(src, dst, scale, order);
    Ok(())
}

/// Unpacks `src` and accumulates: `acc[k] += scale · (±1)`.
///
/// This is one term of the server-side average in the 1-bit all-reduce (spec §2.2 step 8,
/// with `scale = α_i / n`). Requires `acc.len() == 8 · src.len()`; otherwise
/// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) and nothing is written.
pub fn unpack_scaled_add(src: &[u8], acc: &mut [f32], scale: f32, order: BitOrder) -> Result<()> {
    check_bytes("unpack_scaled_add", src.len(), acc.len())?;
    fast::unpack::<true>(src, acc, scale, order);
    Ok(())
}

// ------------------------------------------------------------------ fused 1-bit passes

/// Lanes of the sums of squares the fused kernels return: element `k` of the slice goes into
/// lane `k mod 16`, and the lanes are added in order at the end (starting from `0.0`).
///
/// The elements of each whole block of [`SQUARE_BLOCK`] (64) are first summed per lane in
/// f32, each lane's 4 squares with fused multiply-adds from `0.0` in element order, and that
/// partial is added to the lane's f64 sum; the elements after the last whole block add their
/// exact f64 squares. The f32 partials cost a third of the vector work of squaring every
/// element in f64, and each is within 4 f32 roundings (2.4·10⁻⁷ relative) of its exact value:
/// closer than the f32 norm that DeepSpeed computes. If the total is infinite (an f32 square overflowed,
/// `|v| ≥ 2⁶⁴`) or below [`SQUARE_EXACT_BELOW`] (where f32 squares lose their precision), it is
/// recomputed with every square in f64, which costs one more read of the slice. Fixing all this
/// makes the fast kernels and [`scalar`] agree bit for bit.
pub const SQUARE_LANES: usize = 16;

/// Elements per block whose squares are summed in f32 first (see [`SQUARE_LANES`]).
pub const SQUARE_BLOCK: usize = 64;

/// Totals of squares below this (2⁻⁶⁰) are recomputed with every square in f64 (see
/// [`SQUARE_LANES`]): an f32 square below 2⁻¹²⁶ is subnormal, so each element may be off by
/// up to 2⁻¹⁴⁹, which this threshold keeps below 2⁻⁸⁹ · len relative.
pub const SQUARE_EXACT_BELOW: f64 = 8.673617379884035e-19;

/// The worker's pass of the 1-bit all-reduce (spec §2.2 steps 1–3 and 5, with step 4 of the
/// previous call): for every `k`, `e = u[k] − carry · sgn(u[k])` (the error update the previous
/// call left to do, as [`subtract_signs`]; `carry = 0` keeps `u[k]` exactly), then `u[k] ←
/// x[k] + e` where `x` reaches (`x` is taken as padded with zeros: past it `u[k] ← e`), the
/// signs of the new `u` packed into `signs`, and `Σ u[k]²` over all of `u` returned
/// (accumulated as [`SQUARE_LANES`] says).
///
/// Requires `u.len()` a multiple of 8, `x.len() ≤ u.len()` and `signs.len() == u.len() / 8`;
/// otherwise [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) and nothing is
/// written.
pub fn add_pack_squares(u: &mut [f32], carry: f32, x: &[f32], signs: &mut [u8], order: BitOrder) -> Result<f64> {
    check_bytes("add_pack_squares", signs.len(), u.len())?;
    if x.len() > u.len() {
        return Err(Error::invalid(format!("add_pack_squares: {} inputs do not fit {} elements", x.len(), u.len())));
    }
    Ok(fast::add_pack_squares(u, carry, x, signs, order))
}

/// The server's pass of the 1-bit all-reduce (spec §2.2 steps 8, 9, 10 and 12, with step 11
/// of the previous call): `acc[k] ← (Σᵢ scales[i] · (±1)) + (acc[k] − carry · sgn(acc[k]))`,
/// the signs of row `i` read from `src[i · stride ..][.. acc.len() / 8]` and added in row
/// order to `0.0` (as [`unpack_scaled_add`] into a zeroed buffer would; `carry` as in
/// [`add_pack_squares`]), then the signs of the new `acc` packed into `signs` and `Σ acc[k]²`
/// returned (as [`SQUARE_LANES`] says).
///
/// Requires `acc.len()` a multiple of 8, `signs.len() == acc.len() / 8` and `src` long enough
/// for `scales.len()` rows (rows may overlap); otherwise
/// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) and nothing is written.
pub fn unpack_sum_pack_squares(
    src: &[u8],
    stride: usize,
    scales: &[f32],
    acc: &mut [f32],
    carry: f32,
    signs: &mut [u8],
    order: BitOrder,
) -> Result<f64> {
    check_bytes("unpack_sum_pack_squares", signs.len(), acc.len())?;
    let row = acc.len() / 8;
    let needed = match scales.len() {
        0 => Some(0),
        rows => (rows - 1).checked_mul(stride).and_then(|b| b.checked_add(row)),
    };
    if needed.is_none_or(|b| b > src.len()) {
        return Err(Error::invalid(format!(
            "unpack_sum_pack_squares: {} rows of {row} bytes every {stride} do not fit {} bytes",
            scales.len(),
            src.len()
        )));
    }
    Ok(fast::unpack_sum_pack_squares(src, stride, scales, acc, carry, signs, order))
}

/// The error update of the 1-bit all-reduce (spec §2.2 steps 4 and 11): `v[k] ← v[k] −
/// scale · sgn(v[k])` with `sgn = −1` for `v < 0`, else `+1` (`±0` and NaN give `+1`).
pub fn subtract_signs(v: &mut [f32], scale: f32) {
    fast::subtract_signs(v, scale);
}

fn check_bytes(what: &str, bytes: usize, elems: usize) -> Result<()> {
    if elems % 8 != 0 || bytes != elems / 8 {
        return Err(Error::invalid(format!(
            "{what}: {bytes} packed bytes do not hold {elems} elements (need elements = 8 × bytes)"
        )));
    }
    Ok(())
}

/// The one-element-at-a-time reference the fast kernels are tested against.
///
/// These functions do not check lengths: they process the whole bytes that both slices cover
/// (`min(bytes, elements / 8)`) and leave the rest untouched.
pub mod scalar {
    use super::BitOrder;

    /// Reference for [`pack_signs`](super::pack_signs).
    pub fn pack_signs(src: &[f32], dst: &mut [u8], order: BitOrder) {
        for (chunk, byte) in src.chunks_exact(8).zip(dst.iter_mut()) {
            let mut b = 0u8;
            for (j, &x) in chunk.iter().enumerate() {
                let bit = if x < 0.0 { 0 } else { 1 };
                b |= bit << order.shift(j);
            }
            *byte = b;
        }
    }

    /// Reference for [`unpack_scaled`](super::unpack_scaled).
    pub fn unpack_scaled(src: &[u8], dst: &mut [f32], scale: f32, order: BitOrder) {
        for (&byte, chunk) in src.iter().zip(dst.chunks_exact_mut(8)) {
            for (j, out) in chunk.iter_mut().enumerate() {
                let sign = if (byte >> order.shift(j)) & 1 == 1 { 1.0 } else { -1.0 };
                *out = scale * sign;
            }
        }
    }

    /// Reference for [`unpack_scaled_add`](super::unpack_scaled_add).
    pub fn unpack_scaled_add(src: &[u8], acc: &mut [f32], scale: f32, order: BitOrder) {
        for (&byte, chunk) in src.iter().zip(acc.chunks_exact_mut(8)) {
            for (j, out) in chunk.iter_mut().enumerate() {
                let sign = if (byte >> order.shift(j)) & 1 == 1 { 1.0 } else { -1.0 };
                *out += scale * sign;
            }
        }
    }

    /// `Σ` of per-lane sums of squares in lane order (see [`SQUARE_LANES`](super::SQUARE_LANES)).
    pub(super) fn lane_total(lanes: &[f64; super::SQUARE_LANES]) -> f64 {
        lanes.iter().fold(0.0, |t, &l| t + l)
    }

    /// The sum of squares of `len` elements, added one at a time in order, as
    /// [`SQUARE_LANES`](super::SQUARE_LANES) says.
    struct Squares {
        lanes: [f64; super::SQUARE_LANES],
        partial: [f32; super::SQUARE_LANES],
        /// Elements below this are in whole blocks.
        blocked: usize,
    }

    impl Squares {
        fn new(groups: usize) -> Squares {
            let len = 8 * groups;
            Squares {
                lanes: [0.0; super::SQUARE_LANES],
                partial: [0.0; super::SQUARE_LANES],
                blocked: len - len % super::SQUARE_BLOCK,
            }
        }

        /// Element `k` (every `k` in order from 0) is `v`.
        fn add(&mut self, k: usize, v: f32) {
            let lane = k % super::SQUARE_LANES;
            if k >= self.blocked {
                self.lanes[lane] += f64::from(v) * f64::from(v);
                return;
            }
            self.partial[lane] = v.mul_add(v, self.partial[lane]);
            if k % super::SQUARE_BLOCK == super::SQUARE_BLOCK - 1 {
                for (sum, partial) in self.lanes.iter_mut().zip(&mut self.partial) {
                    *sum += f64::from(std::mem::take(partial));
                }
            }
        }

        fn total(&self) -> f64 {
            lane_total(&self.lanes)
        }
    }

    /// `total`, or the sum of squares of `v` recomputed with every square in f64 where
    /// `total` is infinite or below [`SQUARE_EXACT_BELOW`](super::SQUARE_EXACT_BELOW) (see
    /// [`SQUARE_LANES`](super::SQUARE_LANES)). NaN stays NaN.
    pub(super) fn settle(total: f64, v: &[f32]) -> f64 {
        if !(total.is_infinite() || total < super::SQUARE_EXACT_BELOW) {
            return total;
        }
        let mut lanes = [0f64; super::SQUARE_LANES];
        for block in v.chunks(super::SQUARE_LANES) {
            for (sum, &x) in lanes.iter_mut().zip(block) {
                *sum += f64::from(x) * f64::from(x);
            }
        }
        lane_total(&lanes)
    }

    /// The sign bit of one element: 1 unless `x < 0`.
    fn bit(x: f32) -> u8 {
        if x < 0.0 {
            0
        } else {
            1
        }
    }

    /// `v − scale · sgn(v)`.
    fn minus_signed(v: f32, scale: f32) -> f32 {
        let sign = if v < 0.0 { -1.0 } else { 1.0 };
        v - scale * sign
    }

    /// `±1.0` for a bit.
    fn sign_of_bit(byte: u8, j: usize, order: BitOrder) -> f32 {
        if (byte >> order.shift(j)) & 1 == 1 {
            1.0
        } else {
            -1.0
        }
    }

    /// Reference for [`add_pack_squares`](super::add_pack_squares) (`x` may be shorter than
    /// `u`; whole bytes only).
    pub fn add_pack_squares(u: &mut [f32], carry: f32, x: &[f32], signs: &mut [u8], order: BitOrder) -> f64 {
        let mut squares = Squares::new(signs.len().min(u.len() / 8));
        for (m, (chunk, byte)) in u.chunks_exact_mut(8).zip(signs.iter_mut()).enumerate() {
            let mut b = 0u8;
            for (j, v) in chunk.iter_mut().enumerate() {
                let k = 8 * m + j;
                *v = minus_signed(*v, carry);
                if let Some(&xk) = x.get(k) {
                    *v += xk;
                }
                squares.add(k, *v);
                b |= bit(*v) << order.shift(j);
            }
            *byte = b;
        }
        settle(squares.total(), &u[..8 * signs.len().min(u.len() / 8)])
    }

    /// Reference for [`unpack_sum_pack_squares`](super::unpack_sum_pack_squares).
    pub fn unpack_sum_pack_squares(
        src: &[u8],
        stride: usize,
        scales: &[f32],
        acc: &mut [f32],
        carry: f32,
        signs: &mut [u8],
        order: BitOrder,
    ) -> f64 {
        let mut squares = Squares::new(signs.len().min(acc.len() / 8));
        for (m, (chunk, byte)) in acc.chunks_exact_mut(8).zip(signs.iter_mut()).enumerate() {
            let mut b = 0u8;
            for (j, v) in chunk.iter_mut().enumerate() {
                let mut sum = 0.0f32;
                for (i, &scale) in scales.iter().enumerate() {
                    sum += scale * sign_of_bit(src[i * stride + m], j, order);
                }
                *v = sum + minus_signed(*v, carry);
                squares.add(8 * m + j, *v);
                b |= bit(*v) << order.shift(j);
            }
            *byte = b;
        }
        settle(squares.total(), &acc[..8 * signs.len().min(acc.len() / 8)])
    }

    /// Reference for [`subtract_signs`](super::subtract_signs).
    pub fn subtract_signs(v: &mut [f32], scale: f32) {
        for x in v {
            *x = minus_signed(*x, scale);
        }
    }
}

/// Dispatch to the best kernel for this CPU. Lengths are already checked.
mod fast {
    use super::BitOrder;

    pub(super) fn pack(src: &[f32], dst: &mut [u8], order: BitOrder) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2 (checked just above).
                unsafe { super::x86::pack_avx2(src, dst, order) };
            } else {
                super::x86::pack_sse2(src, dst, order);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        super::portable::pack(src, dst, order);
    }

    pub(super) fn add_pack_squares(u: &mut [f32], carry: f32, x: &[f32], signs: &mut [u8], order: BitOrder) -> f64 {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above); the caller checked
            // the lengths (`u.len() == 8 · signs.len()`, `x.len() ≤ u.len()`).
            let total = unsafe { super::x86::add_pack_squares_avx2(u, carry, x, signs, order) };
            return super::scalar::settle(total, &u[..8 * signs.len()]);
        }
        super::scalar::add_pack_squares(u, carry, x, signs, order)
    }

    pub(super) fn unpack_sum_pack_squares(
        src: &[u8],
        stride: usize,
        scales: &[f32],
        acc: &mut [f32],
        carry: f32,
        signs: &mut [u8],
        order: BitOrder,
    ) -> f64 {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above); the caller checked
            // the lengths (`acc.len() == 8 · signs.len()`, every row inside `src`).
            let total =
                unsafe { super::x86::unpack_sum_pack_squares_avx2(src, stride, scales, acc, carry, signs, order) };
            return super::scalar::settle(total, &acc[..8 * signs.len()]);
        }
        super::scalar::unpack_sum_pack_squares(src, stride, scales, acc, carry, signs, order)
    }

    pub(super) fn subtract_signs(v: &mut [f32], scale: f32) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            unsafe { super::x86::subtract_signs_avx2(v, scale) };
            return;
        }
        super::scalar::subtract_signs(v, scale)
    }

    pub(super) fn unpack<const ADD: bool>(src: &[u8], dst: &mut [f32], scale: f32, order: BitOrder) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2 (checked just above).
                unsafe { super::x86::unpack_avx2::<ADD>(src, dst, scale, order) };
            } else {
                super::x86::unpack_sse2::<ADD>(src, dst, scale, order);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        super::portable::unpack::<ADD>(src, dst, scale, order);
    }
}

/// Branch-free loops without intrinsics, for targets other than x86-64 (and tested everywhere).
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
mod portable {
    use super::BitOrder;

    pub(super) fn pack(src: &[f32], dst: &mut [u8], order: BitOrder) {
        for (chunk, byte) in src.chunks_exact(8).zip(dst.iter_mut()) {
            let mut b = 0u8;
            for (j, &x) in chunk.iter().enumerate() {
                // Bit 0 only for x < 0: NaN (unordered) and ±0 give 1.
                b |= u8::from(x >= 0.0 || x.is_nan()) << order.shift(j);
            }
            *byte = b;
        }
    }

    pub(super) fn unpack<const ADD: bool>(src: &[u8], dst: &mut [f32], scale: f32, order: BitOrder) {
        let s = scale.to_bits();
        for (&byte, chunk) in src.iter().zip(dst.chunks_exact_mut(8)) {
            for (j, out) in chunk.iter_mut().enumerate() {
                // Bit 0 flips the sign of `scale`: exactly `scale * -1.0`.
                let clear = u32::from((byte >> order.shift(j)) & 1 ^ 1);
                let v = f32::from_bits(s ^ (clear << 31));
                if ADD {
                    *out += v;
                } else {
                    *out = v;
                }
            }
        }
    }
}

/// SSE2 (always present on x86-64) and AVX2 kernels.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::BitOrder;

    /// For every sign byte, the 8 lanes' f32 sign bits to flip: lane `j` holds `0x8000_0000`
    /// where element `j`'s bit is clear (so `scale ^ mask` is exactly `scale · (±1)`). One
    /// table per bit order, 8 KiB each, aligned for 32-byte loads: unpacking a byte is one
    /// load instead of a broadcast, a mask and a compare.
    #[repr(C, align(32))]
    struct SignMasks([[u32; 8]; 256]);

    const fn sign_masks(big: bool) -> SignMasks {
        let mut t = [[0u32; 8]; 256];
        let mut byte = 0;
        while byte < 256 {
            let mut j = 0;
            while j < 8 {
                let shift = if big { 7 - j } else { j };
                if (byte >> shift) & 1 == 0 {
                    t[byte][j] = 0x8000_0000;
                }
                j += 1;
            }
            byte += 1;
        }
        SignMasks(t)
    }

    static SIGN_MASKS_BIG: SignMasks = sign_masks(true);
    static SIGN_MASKS_LITTLE: SignMasks = sign_masks(false);

    /// The sign-flip lanes of `byte` (see [`SignMasks`]).
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn flips<const BIG: bool>(byte: u8) -> __m256 {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            let table = if BIG { &SIGN_MASKS_BIG.0 } else { &SIGN_MASKS_LITTLE.0 };
            // `table[byte]` is 8 u32 at a 32-byte-aligned address.
            _mm256_load_ps(table[usize::from(byte)].as_ptr().cast())
        }
    }

    /// Every byte with its bits in reverse order (a movemask's bit `j` → bit `7 − j`).
    static REVERSED: [u8; 256] = {
        let mut t = [0u8; 256];
        let mut b = 0;
        while b < 256 {
            t[b] = (b as u8).reverse_bits();
            b += 1;
        }
        t
    };

    /// Signs of 8 floats per byte with two 4-lane compares.
    pub(super) fn pack_sse2(src: &[f32], dst: &mut [u8], order: BitOrder) {
        match order {
            BitOrder::Big => pack_sse2_impl::<true>(src, dst),
            BitOrder::Little => pack_sse2_impl::<false>(src, dst),
        }
    }

    fn pack_sse2_impl<const BIG: bool>(src: &[f32], dst: &mut [u8]) {
        for (chunk, byte) in src.chunks_exact(8).zip(dst.iter_mut()) {
            // SAFETY: SSE2 is part of the x86-64 baseline; `chunk` has 8 floats, so both
            // unaligned 4-float loads are in bounds.
            unsafe {
                let zero = _mm_setzero_ps();
                let a = _mm_loadu_ps(chunk.as_ptr());
                let b = _mm_loadu_ps(chunk.as_ptr().add(4));
                // `!(x < 0)`: true for x ≥ 0, ±0 and NaN (an unordered compare).
                if BIG {
                    // Reverse lanes so that movemask bit i holds element 3 − i.
                    let a = _mm_shuffle_ps::<0b00_01_10_11>(a, a);
                    let b = _mm_shuffle_ps::<0b00_01_10_11>(b, b);
                    let ma = _mm_movemask_ps(_mm_cmpnlt_ps(a, zero));
                    let mb = _mm_movemask_ps(_mm_cmpnlt_ps(b, zero));
                    *byte = ((ma << 4) | mb) as u8;
                } else {
                    let ma = _mm_movemask_ps(_mm_cmpnlt_ps(a, zero));
                    let mb = _mm_movemask_ps(_mm_cmpnlt_ps(b, zero));
                    *byte = (ma | (mb << 4)) as u8;
                }
            }
        }
    }

    /// Signs of 8 floats per byte with one 8-lane compare.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn pack_avx2(src: &[f32], dst: &mut [u8], order: BitOrder) {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            match order {
                BitOrder::Big => pack_avx2_impl::<true>(src, dst),
                BitOrder::Little => pack_avx2_impl::<false>(src, dst),
            }
        }
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn pack_avx2_impl<const BIG: bool>(src: &[f32], dst: &mut [u8]) {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            let zero = _mm256_setzero_ps();
            let reverse = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
            for (chunk, byte) in src.chunks_exact(8).zip(dst.iter_mut()) {
                // `chunk` has 8 floats: the unaligned 8-float load is in bounds.
                let v = _mm256_loadu_ps(chunk.as_ptr());
                let v = if BIG { _mm256_permutevar8x32_ps(v, reverse) } else { v };
                // `!(x < 0)`, unordered-quiet: true for x ≥ 0, ±0 and NaN.
                let m = _mm256_cmp_ps::<_CMP_NLT_UQ>(v, zero);
                *byte = _mm256_movemask_ps(m) as u8;
            }
        }
    }

    /// Lane masks: lane j tests the bit of element j.
    fn lane_bits(order: BitOrder) -> [i32; 8] {
        let mut m = [0i32; 8];
        for (j, x) in m.iter_mut().enumerate() {
            *x = 1 << order.shift(j);
        }
        m
    }

    pub(super) fn unpack_sse2<const ADD: bool>(src: &[u8], dst: &mut [f32], scale: f32, order: BitOrder) {
        let bits = lane_bits(order);
        for (&byte, chunk) in src.iter().zip(dst.chunks_exact_mut(8)) {
            // SAFETY: SSE2 is part of the x86-64 baseline; `chunk` has 8 floats, so both
            // unaligned 4-float loads/stores are in bounds; `bits` has 8 i32.
            unsafe {
                let sign = _mm_set1_ps(-0.0);
                let s = _mm_set1_ps(scale);
                let v = _mm_set1_epi32(i32::from(byte));
                let ma = _mm_loadu_si128(bits.as_ptr().cast());
                let mb = _mm_loadu_si128(bits.as_ptr().add(4).cast());
                let set_a = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(v, ma), ma));
                let set_b = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(v, mb), mb));
                // Clear bit → flip the sign of `scale` (exactly `scale * -1`).
                let a = _mm_xor_ps(s, _mm_andnot_ps(set_a, sign));
                let b = _mm_xor_ps(s, _mm_andnot_ps(set_b, sign));
                let p = chunk.as_mut_ptr();
                if ADD {
                    _mm_storeu_ps(p, _mm_add_ps(_mm_loadu_ps(p), a));
                    _mm_storeu_ps(p.add(4), _mm_add_ps(_mm_loadu_ps(p.add(4)), b));
                } else {
                    _mm_storeu_ps(p, a);
                    _mm_storeu_ps(p.add(4), b);
                }
            }
        }
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn unpack_avx2<const ADD: bool>(src: &[u8], dst: &mut [f32], scale: f32, order: BitOrder) {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            match order {
                BitOrder::Big => unpack_avx2_impl::<ADD, true>(src, dst, scale),
                BitOrder::Little => unpack_avx2_impl::<ADD, false>(src, dst, scale),
            }
        }
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn unpack_avx2_impl<const ADD: bool, const BIG: bool>(src: &[u8], dst: &mut [f32], scale: f32) {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            let s = _mm256_set1_ps(scale);
            for (&byte, chunk) in src.iter().zip(dst.chunks_exact_mut(8)) {
                // Clear bit → flip the sign of `scale` (exactly `scale * -1`).
                let x = _mm256_xor_ps(s, flips::<BIG>(byte));
                // `chunk` has 8 floats: the unaligned 8-float load/store is in bounds.
                let p = chunk.as_mut_ptr();
                if ADD {
                    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), x));
                } else {
                    _mm256_storeu_ps(p, x);
                }
            }
        }
    }

    /// The sign byte of 8 floats, element `j` at bit `7 − j` (`BIG`) or `j`: bit 1 unless
    /// `x < 0`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn sign_byte<const BIG: bool>(v: __m256) -> u8 {
        // `!(x < 0)`, unordered-quiet: true for x ≥ 0, ±0 and NaN.
        let m = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NLT_UQ>(v, _mm256_setzero_ps())) as u8;
        // Reversing the byte in a table keeps the lane permute off the vector ports.
        if BIG {
            REVERSED[usize::from(m)]
        } else {
            m
        }
    }

    /// `lo += v[0..4]²`, `hi += v[4..8]²` in f64. The square of an f32 is exact in f64, so
    /// the fused multiply-add rounds once, exactly as the scalar reference's `+= v * v`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn add_squares(v: __m256, lo: &mut __m256d, hi: &mut __m256d) {
        let a = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
        let b = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v));
        *lo = _mm256_fmadd_pd(a, a, *lo);
        *hi = _mm256_fmadd_pd(b, b, *hi);
    }

    /// The four accumulators of 4 lanes each, added in lane order as the scalar reference
    /// adds its [`SQUARE_LANES`](super::SQUARE_LANES).
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn lane_total(acc: [__m256d; 4]) -> f64 {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            let mut lanes = [0f64; super::SQUARE_LANES];
            for (i, a) in acc.into_iter().enumerate() {
                // `lanes` has 16 f64: lanes `4i .. 4i + 4` are in bounds for i < 4.
                _mm256_storeu_pd(lanes.as_mut_ptr().add(4 * i), a);
            }
            super::scalar::lane_total(&lanes)
        }
    }

    /// `v − scale · sgn(v)`: `sgn(v) = +1` for `!(v < 0)` (±0 and NaN included), so `scale`
    /// is flipped (exactly `scale * -1`) where `v < 0`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn minus_signed(v: __m256, scale: __m256) -> __m256 {
        let nonneg = _mm256_cmp_ps::<_CMP_NLT_UQ>(v, _mm256_setzero_ps());
        let negated = _mm256_xor_ps(scale, _mm256_set1_ps(-0.0));
        _mm256_sub_ps(v, _mm256_blendv_ps(negated, scale, nonneg))
    }

    /// The 8 elements of `u` at `k` after `u ← x + (u − carry · sgn(u))`, `x` where it
    /// reaches (`xl` elements).
    ///
    /// # Safety
    /// The CPU must support AVX2; `up` is valid for reads and writes of `k + 8` floats and
    /// `xp` for reads of `xl` floats.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn add_group(up: *mut f32, carry: __m256, xp: *const f32, xl: usize, k: usize) -> __m256 {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            let p = up.add(k);
            let e = minus_signed(_mm256_loadu_ps(p), carry);
            let v = if k + 8 <= xl {
                _mm256_add_ps(_mm256_loadu_ps(xp.add(k)), e)
            } else if k < xl {
                // Lanes below `xl − k` add `x`; the others keep `e` as it is (as the scalar
                // reference does: adding a padding `0.0` would turn `−0` into `+0`). Masked-off
                // lanes of the load are not read.
                let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((xl - k) as i32), lanes);
                let x = _mm256_maskload_ps(xp.add(k), mask);
                _mm256_blendv_ps(e, _mm256_add_ps(x, e), _mm256_castsi256_ps(mask))
            } else {
                e
            };
            _mm256_storeu_ps(p, v);
            v
        }
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn add_pack_squares_avx2(
        u: &mut [f32],
        carry: f32,
        x: &[f32],
        signs: &mut [u8],
        order: BitOrder,
    ) -> f64 {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            match order {
                BitOrder::Big => add_pack_squares_impl::<true>(u, carry, x, signs),
                BitOrder::Little => add_pack_squares_impl::<false>(u, carry, x, signs),
            }
        }
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn add_pack_squares_impl<const BIG: bool>(u: &mut [f32], carry: f32, x: &[f32], signs: &mut [u8]) -> f64 {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            let carry = _mm256_set1_ps(carry);
            let groups = signs.len().min(u.len() / 8);
            let xl = x.len().min(u.len());
            let (up, xp, sp) = (u.as_mut_ptr(), x.as_ptr(), signs.as_mut_ptr());
            let mut acc = [_mm256_setzero_pd(); 4];
            // Whole blocks of 8 groups: x covers the first `full` groups, so those skip the
            // bounds tests of `add_group`.
            let full = groups.min(xl / 8);
            let mut g = 0;
            while g + BLOCK_GROUPS <= full {
                // `g + 8 ≤ full`: all 8 groups' floats of `u` and `x` and their sign bytes are in
                // bounds.
                g = squares_block(&mut acc, g, |g| {
                    let p = up.add(8 * g);
                    let v = _mm256_add_ps(_mm256_loadu_ps(xp.add(8 * g)), minus_signed(_mm256_loadu_ps(p), carry));
                    _mm256_storeu_ps(p, v);
                    *sp.add(g) = sign_byte::<BIG>(v);
                    v
                });
            }
            while g + BLOCK_GROUPS <= groups {
                // In bounds as above; `add_group` reads `x` only below `xl`.
                g = squares_block(&mut acc, g, |g| {
                    let v = add_group(up, carry, xp, xl, 8 * g);
                    *sp.add(g) = sign_byte::<BIG>(v);
                    v
                });
            }
            let [a0, a1, a2, a3] = &mut acc;
            // The groups after the last whole block, each square in f64; group `g` feeds lanes
            // `8 · (g mod 2) ..` as in the scalar reference (`g` is even here).
            while g < groups {
                let v = add_group(up, carry, xp, xl, 8 * g);
                *sp.add(g) = sign_byte::<BIG>(v);
                if g % 2 == 0 {
                    add_squares(v, a0, a1);
                } else {
                    add_squares(v, a2, a3);
                }
                g += 1;
            }
            lane_total(acc)
        }
    }

    /// Groups per block of [`SQUARE_BLOCK`](super::SQUARE_BLOCK) elements.
    const BLOCK_GROUPS: usize = super::SQUARE_BLOCK / 8;

    /// Runs `group` on the 8 groups from `g` (a multiple of 8) in order and adds the squares
    /// of what each returns to `acc` as [`SQUARE_LANES`](super::SQUARE_LANES) says: even
    /// groups' lanes in f32 in one register and odd groups' in another, then both in f64 into
    /// `acc` (lanes 0–3, 4–7, 8–11, 12–15). Returns `g + 8`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `group` must be safe to call for these groups.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn squares_block(acc: &mut [__m256d; 4], g: usize, mut group: impl FnMut(usize) -> __m256) -> usize {
        let (mut even, mut odd) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for step in 0..BLOCK_GROUPS / 2 {
            let v = group(g + 2 * step);
            even = _mm256_fmadd_ps(v, v, even);
            let v = group(g + 2 * step + 1);
            odd = _mm256_fmadd_ps(v, v, odd);
        }
        for (i, half) in [
            _mm256_castps256_ps128(even),
            _mm256_extractf128_ps::<1>(even),
            _mm256_castps256_ps128(odd),
            _mm256_extractf128_ps::<1>(odd),
        ]
        .into_iter()
        .enumerate()
        {
            acc[i] = _mm256_add_pd(acc[i], _mm256_cvtps_pd(half));
        }
        g + BLOCK_GROUPS
    }

    /// The 8 elements of `acc` at group `g` after `acc ← Σᵢ scales[i] · (±1) + (acc − carry ·
    /// sgn(acc))`.
    ///
    /// # Safety
    /// The CPU must support AVX2; `src` is valid for reads at `i · stride + g` for every row
    /// `i < scales.len()`, and `accp` for reads and writes of `8g + 8` floats.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn sum_group<const BIG: bool>(
        src: *const u8,
        stride: usize,
        scales: &[f32],
        g: usize,
        accp: *mut f32,
        carry: __m256,
    ) -> __m256 {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            let mut m = _mm256_setzero_ps();
            for (i, &scale) in scales.iter().enumerate() {
                // Clear bit → flip the sign of `scale` (exactly `scale * -1`).
                m = _mm256_add_ps(m, _mm256_xor_ps(_mm256_set1_ps(scale), flips::<BIG>(*src.add(i * stride + g))));
            }
            let p = accp.add(8 * g);
            let m = _mm256_add_ps(m, minus_signed(_mm256_loadu_ps(p), carry));
            _mm256_storeu_ps(p, m);
            m
        }
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; every row `i < scales.len()` has `acc.len() / 8` bytes at
    /// `src[i · stride ..]`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn unpack_sum_pack_squares_avx2(
        src: &[u8],
        stride: usize,
        scales: &[f32],
        acc: &mut [f32],
        carry: f32,
        signs: &mut [u8],
        order: BitOrder,
    ) -> f64 {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            let carry = _mm256_set1_ps(carry);
            match order {
                BitOrder::Big => unpack_sum_pack_squares_impl::<true>(src, stride, scales, acc, carry, signs),
                BitOrder::Little => unpack_sum_pack_squares_impl::<false>(src, stride, scales, acc, carry, signs),
            }
        }
    }

    /// # Safety
    /// As [`unpack_sum_pack_squares_avx2`].
    #[target_feature(enable = "avx2,fma")]
    unsafe fn unpack_sum_pack_squares_impl<const BIG: bool>(
        src: &[u8],
        stride: usize,
        scales: &[f32],
        acc: &mut [f32],
        carry: __m256,
        signs: &mut [u8],
    ) -> f64 {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            let groups = signs.len().min(acc.len() / 8);
            let (ap, sp, src) = (acc.as_mut_ptr(), signs.as_mut_ptr(), src.as_ptr());
            let mut sums = [_mm256_setzero_pd(); 4];
            let mut g = 0;
            // Whole blocks, then the rest with each square in f64, as in `add_pack_squares_impl`;
            // `g < groups` keeps each group of `acc`, `signs` and every row in bounds (the
            // caller's contract).
            while g + BLOCK_GROUPS <= groups {
                g = squares_block(&mut sums, g, |g| {
                    let v = sum_group::<BIG>(src, stride, scales, g, ap, carry);
                    *sp.add(g) = sign_byte::<BIG>(v);
                    v
                });
            }
            let [a0, a1, a2, a3] = &mut sums;
            while g < groups {
                let v = sum_group::<BIG>(src, stride, scales, g, ap, carry);
                *sp.add(g) = sign_byte::<BIG>(v);
                if g % 2 == 0 {
                    add_squares(v, a0, a1);
                } else {
                    add_squares(v, a2, a3);
                }
                g += 1;
            }
            lane_total(sums)
        }
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn subtract_signs_avx2(v: &mut [f32], scale: f32) {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            let s = _mm256_set1_ps(scale);
            let mut chunks = v.chunks_exact_mut(8);
            for chunk in &mut chunks {
                // `chunk` has 8 floats: the unaligned 8-float load/store is in bounds.
                let p = chunk.as_mut_ptr();
                _mm256_storeu_ps(p, minus_signed(_mm256_loadu_ps(p), s));
            }
            super::scalar::subtract_signs(chunks.into_remainder(), scale);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let special = [0.0, -0.0, f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
        let mut x = seed.wrapping_mul(2654435761) | 1;
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                if i % 11 == 3 {
                    special[(x as usize) % special.len()]
                } else {
                    (x as i32) as f32 * 1e-9
                }
            })
            .collect()
    }

    /// Every kernel this CPU can run, against the scalar reference.
    #[test]
    fn every_path_matches_scalar() {
        for order in [BitOrder::Big, BitOrder::Little] {
            for n in [0, 8, 16, 24, 64, 1000 * 8] {
                let src = data(n, n as u32 + 1);
                let mut want = vec![0u8; n / 8];
                scalar::pack_signs(&src, &mut want, order);
                let mut got = vec![0u8; n / 8];
                portable::pack(&src, &mut got, order);
                assert_eq!(got, want, "portable pack {order:?} n={n}");
                #[cfg(target_arch = "x86_64")]
                {
                    got.fill(0);
                    x86::pack_sse2(&src, &mut got, order);
                    assert_eq!(got, want, "sse2 pack {order:?} n={n}");
                    if std::arch::is_x86_feature_detected!("avx2") {
                        got.fill(0);
                        // SAFETY: AVX2 checked just above.
                        unsafe { x86::pack_avx2(&src, &mut got, order) };
                        assert_eq!(got, want, "avx2 pack {order:?} n={n}");
                    }
                }

                let acc0 = data(n, 7);
                for scale in [1.0f32, 0.3, -2.5] {
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    let mut want = vec![0f32; n];
                    scalar::unpack_scaled(&got_bytes(&src, order), &mut want, scale, order);
                    let mut want_add = acc0.clone();
                    scalar::unpack_scaled_add(&got_bytes(&src, order), &mut want_add, scale, order);
                    let packed = got_bytes(&src, order);
                    let mut out = vec![0f32; n];
                    let mut acc = acc0.clone();
                    portable::unpack::<false>(&packed, &mut out, scale, order);
                    portable::unpack::<true>(&packed, &mut acc, scale, order);
                    assert_eq!(bits(&out), bits(&want));
                    assert_eq!(bits(&acc), bits(&want_add));
                    #[cfg(target_arch = "x86_64")]
                    {
                        let mut out = vec![0f32; n];
                        let mut acc = acc0.clone();
                        x86::unpack_sse2::<false>(&packed, &mut out, scale, order);
                        x86::unpack_sse2::<true>(&packed, &mut acc, scale, order);
                        assert_eq!(bits(&out), bits(&want));
                        assert_eq!(bits(&acc), bits(&want_add));
                        if std::arch::is_x86_feature_detected!("avx2") {
                            let mut out = vec![0f32; n];
                            let mut acc = acc0.clone();
                            // SAFETY: AVX2 checked just above.
                            unsafe {
                                x86::unpack_avx2::<false>(&packed, &mut out, scale, order);
                                x86::unpack_avx2::<true>(&packed, &mut acc, scale, order);
                            }
                            assert_eq!(bits(&out), bits(&want));
                            assert_eq!(bits(&acc), bits(&want_add));
                        }
                    }
                }
            }
        }
    }

    fn got_bytes(src: &[f32], order: BitOrder) -> Vec<u8> {
        let mut b = vec![0u8; src.len() / 8];
        scalar::pack_signs(src, &mut b, order);
        b
    }
}
