//! The values a check puts in and expects out: [`Pattern`] (inputs whose reduction is exact in
//! every dtype and independent of the reduction order, the idea of nccl-tests' `verifiable`)
//! and [`SENTINEL`] (what an output holds before the op writes it). Shared by `oxcomm bench
//! -c 1` and `oxcomm check` through [`super::Case::check`].

use oxcomm::{DType, ReduceOp};

/// What an output element holds before the op writes it: outside every pattern's range and
/// exact in every dtype.
pub(crate) const SENTINEL: f64 = 113.0;

/// Inputs whose reduction is exact in the dtype and independent of the order of operations:
/// small non-negative integers (sums stay below the dtype's exact-integer limit, products are
/// powers of two within its range).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pattern {
    redop: ReduceOp,
    dtype: DType,
    n: usize,
    /// Largest input of a sum/avg: `min(3, limit / n)`.
    sum_max: u64,
    /// How many ranks may contribute a 2 to a product.
    prod_twos: usize,
}

impl Pattern {
    pub(crate) fn new(redop: ReduceOp, dtype: DType, n: usize) -> Pattern {
        // Largest integer up to which every integer is exact, and the largest power-of-two
        // exponent, per dtype.
        let (limit, max_exp): (u64, usize) = match dtype {
            DType::F16 => (2048, 15),
            DType::BF16 => (256, 127),
            DType::F32 => (1 << 24, 127),
            DType::F64 => (1 << 53, 1023),
            DType::I8 => (127, 6),
            DType::U8 => (255, 7),
            DType::I32 => (i32::MAX as u64, 30),
            DType::I64 => (1 << 53, 52),
            DType::I16 => (i16::MAX as u64, 14),
            DType::U16 => (u16::MAX as u64, 15),
            DType::U32 => (u32::MAX as u64, 31),
            DType::U64 => (1 << 53, 52),
            DType::C64 => (1 << 24, 127),
            DType::C128 => (1 << 53, 1023),
            // Not checked by sums of ones (see `unsupported`).
            DType::Bool
            | DType::F8E4M3Fn
            | DType::F8E5M2
            | DType::F8E4M3Fnuz
            | DType::F8E5M2Fnuz
            | DType::F8E8M0Fnu => (0, 0),
        };
        let n = n.max(1);
        Pattern { redop, dtype, n, sum_max: (limit / n as u64).min(3), prod_twos: max_exp.min(n) }
    }

    /// Why reduced values cannot be checked exactly here, if they cannot.
    pub(crate) fn unsupported(&self) -> Option<String> {
        if self.dtype == DType::Bool || self.dtype.is_float8() {
            return Some(format!("{} reductions are not checked by the bench's patterns", self.dtype));
        }
        matches!(self.redop, ReduceOp::Sum | ReduceOp::Avg)
            .then_some(())
            .filter(|_| self.sum_max == 0)
            .map(|_| format!("{} ranks can overflow a {} sum of ones", self.n, self.dtype))
    }

    fn mix(r: usize, i: usize) -> u64 {
        let mut x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (r as u64 + 1).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        x ^= x >> 31;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^ (x >> 29)
    }

    /// A value for ops that only move data: 0..=99.
    pub(crate) fn plain(&self, r: usize, i: usize) -> f64 {
        (Self::mix(r, i) % 100) as f64
    }

    /// Rank `r`'s input at global index `i` for the reducing ops.
    pub(crate) fn input(&self, r: usize, i: usize) -> f64 {
        let m = Self::mix(r, i);
        match self.redop {
            ReduceOp::Sum | ReduceOp::Avg => (m % (self.sum_max + 1)) as f64,
            ReduceOp::Prod => {
                if r < self.prod_twos && m % 4 == 0 {
                    2.0
                } else {
                    1.0
                }
            }
            ReduceOp::Min | ReduceOp::Max => (m % 8) as f64,
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => (m % 64) as f64,
        }
    }

    /// The reduced value at global index `i`, over all ranks.
    pub(crate) fn reduced(&self, i: usize) -> f64 {
        let vals = (0..self.n).map(|r| self.input(r, i));
        match self.redop {
            ReduceOp::Sum => vals.sum(),
            ReduceOp::Avg => {
                let s: f64 = vals.sum();
                if self.dtype.is_float() || self.dtype.is_complex() {
                    s / self.n as f64
                } else {
                    (s / self.n as f64).trunc()
                }
            }
            ReduceOp::Prod => vals.product(),
            ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
            ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
            ReduceOp::BAnd => vals.map(|v| v as i64).fold(-1, |a, b| a & b) as f64,
            ReduceOp::BOr => vals.map(|v| v as i64).fold(0, |a, b| a | b) as f64,
            ReduceOp::BXor => vals.map(|v| v as i64).fold(0, |a, b| a ^ b) as f64,
        }
    }

    /// Whether `got` is the reduced value `want`: exact, except avg on floats (2 ulp).
    pub(crate) fn matches(&self, got: f64, want: f64) -> bool {
        if self.redop == ReduceOp::Avg && (self.dtype.is_float() || self.dtype.is_complex()) {
            let ulp = match self.dtype {
                DType::F16 => 2f64.powi(-10),
                DType::BF16 => 2f64.powi(-7),
                DType::F32 | DType::C64 => 2f64.powi(-23),
                _ => 2f64.powi(-52),
            };
            (got - want).abs() <= 2.0 * ulp * want.abs().max(f64::MIN_POSITIVE)
        } else {
            got == want
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_are_exact_in_their_dtype() {
        for dtype in DType::ALL {
            for redop in ReduceOp::ALL.into_iter().filter(|o| o.fits(dtype)) {
                for n in [1, 2, 3, 8, 64] {
                    let p = Pattern::new(redop, dtype, n);
                    if p.unsupported().is_some() {
                        continue;
                    }
                    for i in 0..200 {
                        let want = p.reduced(i);
                        if !(redop == ReduceOp::Avg && (dtype.is_float() || dtype.is_complex())) {
                            let round = match dtype {
                                DType::F16 => half::f16::from_f64(want).to_f64(),
                                DType::BF16 => half::bf16::from_f64(want).to_f64(),
                                DType::F32 => want as f32 as f64,
                                DType::I8 => want as i8 as f64,
                                DType::U8 => want as u8 as f64,
                                DType::I32 => want as i32 as f64,
                                _ => want,
                            };
                            assert_eq!(round, want, "{dtype} {redop} n={n} i={i}");
                        }
                        assert!(p.input(0, i) != SENTINEL && p.plain(0, i) != SENTINEL);
                    }
                }
            }
        }
    }
}
