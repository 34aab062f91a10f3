//! Sign bits: packing f32 signs into bytes and unpacking them to ±1 or ±scale.
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
        match order {
            BitOrder::Big => pack_avx2_impl::<true>(src, dst),
            BitOrder::Little => pack_avx2_impl::<false>(src, dst),
        }
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn pack_avx2_impl<const BIG: bool>(src: &[f32], dst: &mut [u8]) {
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
        let bits = lane_bits(order);
        let m = _mm256_loadu_si256(bits.as_ptr().cast());
        let sign = _mm256_set1_ps(-0.0);
        let s = _mm256_set1_ps(scale);
        for (&byte, chunk) in src.iter().zip(dst.chunks_exact_mut(8)) {
            let v = _mm256_set1_epi32(i32::from(byte));
            let set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(v, m), m));
            // Clear bit → flip the sign of `scale` (exactly `scale * -1`).
            let x = _mm256_xor_ps(s, _mm256_andnot_ps(set, sign));
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
