//! Copying bytes that another core has just written or read.
//!
//! From a few KiB up, glibc's `memcpy` switches to `rep movsb`. On AMD Zen, `rep movsb`
//! reading lines that another core has just written ran at 1.5–2.4 GB/s on the 2-core test
//! VM, where a plain loop of 32-byte loads and stores ran at 11–35 GB/s, depending on the hour
//! (a probe with two processes, 256 KiB per copy; the same copies between lines of one core
//! ran at 37 GB/s either way). Every copy of bulk data that crosses ranks (the shared-memory chunk
//! buffers and rings, the threads transport's queues) goes through [`copy`] instead.

/// Below this many bytes `memcpy` uses vector moves itself; [`copy`] leaves those to it.
const LOOP_FROM: usize = 1024;

/// `dst.copy_from_slice(src)` with vector loads and stores, never `rep movsb`.
///
/// # Panics
/// If the lengths differ (as `copy_from_slice`).
#[inline]
pub(crate) fn copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy: destination and source lengths differ");
    // SAFETY: both slices hold `src.len()` bytes, and a `&mut` cannot overlap a `&`.
    unsafe { copy_raw(dst.as_mut_ptr(), src.as_ptr(), src.len()) }
}

/// [`copy`] on raw pointers.
///
/// # Safety
/// `dst` is valid for `n` writes, `src` for `n` reads, and the two ranges do not overlap.
#[inline]
pub(crate) unsafe fn copy_raw(dst: *mut u8, src: *const u8, n: usize) {
    // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
    // the CPU features it is compiled for, and valid pointers and lengths).
    unsafe {
        if n < LOOP_FROM {
            std::ptr::copy_nonoverlapping(src, dst, n);
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2; the caller's contract, and `n ≥ LOOP_FROM ≥ 32`.
                x86::copy_avx2(dst, src, n);
            } else {
                // SAFETY: SSE2 is part of x86-64; as above, with `n ≥ 16`.
                x86::copy_sse2(dst, src, n);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        std::ptr::copy_nonoverlapping(src, dst, n);
    }
}

/// [`copy`] with non-temporal stores (they bypass the caches, and the core does not first read
/// each destination line, so a copy into memory that is not cached moves two thirds of the
/// bytes a plain copy moves). For large copies into the caller's buffers, which are not read
/// again before they leave the caches anyway; below [`LOOP_FROM`] bytes, and off x86-64, a
/// plain copy.
///
/// # Panics
/// If the lengths differ (as `copy_from_slice`).
#[inline]
pub(crate) fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy: destination and source lengths differ");
    // SAFETY: both slices hold `src.len()` bytes, and a `&mut` cannot overlap a `&`.
    unsafe { copy_raw_streaming(dst.as_mut_ptr(), src.as_ptr(), src.len()) }
}

/// [`copy_streaming`] on raw pointers.
///
/// # Safety
/// `dst` is valid for `n` writes, `src` for `n` reads, and the two ranges do not overlap.
#[inline]
pub(crate) unsafe fn copy_raw_streaming(dst: *mut u8, src: *const u8, n: usize) {
    if n < LOOP_FROM {
        // SAFETY: the caller's contract (valid, non-overlapping ranges of `n` bytes).
        unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the caller's contract, and `n ≥ LOOP_FROM`; the AVX2 path runs only where
        // the CPU has it, SSE2 is part of x86-64.
        unsafe {
            if std::arch::is_x86_feature_detected!("avx2") {
                x86::stream_avx2(dst, src, n);
            } else {
                x86::stream_sse2(dst, src, n);
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // SAFETY: the caller's contract (valid, non-overlapping ranges of `n` bytes).
        unsafe { std::ptr::copy_nonoverlapping(src, dst, n) }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The body of a copy with vectors of `$v` bytes: the first vector unaligned, then from
    /// the next `$v`-byte boundary of `dst` (the bytes in between are written twice, with the
    /// same values), four vectors a step, and the last vector unaligned over bytes already
    /// written.
    macro_rules! vector_copy {
        ($dst:ident, $src:ident, $n:ident, $v:expr, $load:ident, $store:ident, $storeu:ident) => {{
            const V: usize = $v;
            $storeu($dst.cast(), $load($src.cast()));
            let skip = V - ($dst as usize & (V - 1));
            let (mut d, mut s, mut left) = ($dst.add(skip), $src.add(skip), $n - skip);
            while left >= 4 * V {
                let a = $load(s.cast());
                let b = $load(s.add(V).cast());
                let c = $load(s.add(2 * V).cast());
                let e = $load(s.add(3 * V).cast());
                $store(d.cast(), a);
                $store(d.add(V).cast(), b);
                $store(d.add(2 * V).cast(), c);
                $store(d.add(3 * V).cast(), e);
                (d, s, left) = (d.add(4 * V), s.add(4 * V), left - 4 * V);
            }
            while left >= V {
                $store(d.cast(), $load(s.cast()));
                (d, s, left) = (d.add(V), s.add(V), left - V);
            }
            if left > 0 {
                $storeu($dst.add($n - V).cast(), $load($src.add($n - V).cast()));
            }
        }};
    }

    /// # Safety
    /// The CPU supports AVX2; `n ≥ 32`; `dst` valid for `n` writes, `src` for `n` reads, no
    /// overlap.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn copy_avx2(dst: *mut u8, src: *const u8, n: usize) {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            vector_copy!(dst, src, n, 32, _mm256_loadu_si256, _mm256_store_si256, _mm256_storeu_si256);
        }
    }

    /// [`copy_avx2`] with non-temporal stores, fenced before returning (so the bytes are
    /// ordered before whatever this thread publishes next).
    ///
    /// # Safety
    /// As [`copy_avx2`].
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn stream_avx2(dst: *mut u8, src: *const u8, n: usize) {
        // SAFETY: as in `copy_avx2`; the streaming stores write the same aligned vectors.
        unsafe {
            vector_copy!(dst, src, n, 32, _mm256_loadu_si256, _mm256_stream_si256, _mm256_storeu_si256);
        }
        _mm_sfence();
    }

    /// [`copy_sse2`] with non-temporal stores, fenced before returning.
    ///
    /// # Safety
    /// As [`copy_sse2`].
    pub(super) unsafe fn stream_sse2(dst: *mut u8, src: *const u8, n: usize) {
        // SAFETY: as in `copy_sse2`; the streaming stores write the same aligned vectors.
        unsafe {
            vector_copy!(dst, src, n, 16, _mm_loadu_si128, _mm_stream_si128, _mm_storeu_si128);
        }
        // SAFETY: SSE is part of x86-64.
        unsafe { _mm_sfence() };
    }

    /// # Safety
    /// `n ≥ 16`; `dst` valid for `n` writes, `src` for `n` reads, no overlap.
    pub(super) unsafe fn copy_sse2(dst: *mut u8, src: *const u8, n: usize) {
        // SAFETY: the caller upholds this function's contract (see its `# Safety` section:
        // the CPU features it is compiled for, and valid pointers and lengths).
        unsafe {
            vector_copy!(dst, src, n, 16, _mm_loadu_si128, _mm_store_si128, _mm_storeu_si128);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length around the thresholds and vector sizes, at every alignment of both ends.
    #[test]
    fn copies_exactly_at_every_length_and_alignment() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let lens = [0, 1, 15, 16, 31, 32, 33, 1023, 1024, 1025, 1055, 1056, 1057, 1151, 1152, 1153, 4000];
        for &n in &lens {
            for so in 0..33 {
                for d_off in [0, 1, 7, 16, 31, 32] {
                    for (name, f) in [("copy", copy as fn(&mut [u8], &[u8])), ("streaming", copy_streaming)] {
                        let mut dst = vec![0xEEu8; n + 80];
                        f(&mut dst[d_off..d_off + n], &src[so..so + n]);
                        assert_eq!(&dst[d_off..d_off + n], &src[so..so + n], "{name} n={n} so={so} do={d_off}");
                        assert!(dst[..d_off].iter().all(|&b| b == 0xEE), "{name} wrote before dst: n={n}");
                        assert!(dst[d_off + n..].iter().all(|&b| b == 0xEE), "{name} wrote past dst: n={n}");
                    }
                }
            }
        }
    }

    /// The SSE2 paths, which AVX2 machines would otherwise never run.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn sse2_path_copies_exactly() {
        let src: Vec<u8> = (0..3000u32).map(|i| (i * 7 + 3) as u8).collect();
        for n in [16, 17, 63, 64, 65, 1024, 2999 - 20] {
            for so in [0, 3, 16] {
                for d_off in [0, 5, 16] {
                    for f in [x86::copy_sse2 as unsafe fn(*mut u8, *const u8, usize), x86::stream_sse2] {
                        let mut dst = vec![0u8; n + 40];
                        // SAFETY: `dst[d_off..]` holds ≥ n bytes, `src[so..]` too; distinct vectors.
                        unsafe { f(dst.as_mut_ptr().add(d_off), src.as_ptr().add(so), n) };
                        assert_eq!(&dst[d_off..d_off + n], &src[so..so + n]);
                        assert!(dst[d_off + n..].iter().all(|&b| b == 0));
                    }
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn length_mismatch_panics() {
        copy(&mut [0u8; 4], &[0u8; 5]);
    }
}
