//! Reduction operators and kernels: `dst[i] = op(dst[i], src[i])`.
//!
//! [`ReduceOp`] names the operator; [`reduce_into`] applies it to two equal-length slices of
//! any [`Element`] type in place, [`reduce_from2`] out of place, and [`finish_avg`] divides by
//! the group size for [`ReduceOp::Avg`]. All three run vectorised kernels (AVX2 chosen at run
//! time on x86_64) whose results equal, bit for bit, those of [`scalar`], the plain reference
//! they are tested against. f16 and bf16 are widened to f32 for every operation and rounded
//! once per call. Bool, complex and the 16-bit integer types take the scalar kernels; float8
//! types are never reduced ([`ReduceOp::fits`] says which op applies to which dtype). This
//! module knows nothing about communication.

use std::fmt;

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

mod fast;
pub mod scalar;

/// A reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Sum (logical or for bool, as torch defines it).
    Sum = 0,
    /// Sum divided by the group size (integer division, truncating, for integer types; not
    /// for bool).
    Avg = 1,
    /// Product (complex product for complex types; logical and for bool).
    Prod = 2,
    /// Minimum (for floats, NaN propagates; logical and for bool; not for complex types).
    Min = 3,
    /// Maximum (for floats, NaN propagates; logical or for bool; not for complex types).
    Max = 4,
    /// Bitwise and (integer types and bool only).
    BAnd = 5,
    /// Bitwise or (integer types and bool only).
    BOr = 6,
    /// Bitwise xor (integer types and bool only).
    BXor = 7,
}

impl ReduceOp {
    /// Every operator.
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::BAnd,
        ReduceOp::BOr,
        ReduceOp::BXor,
    ];

    /// Lowercase name as nccl-tests prints it (`sum`, `avg`, `prod`, `min`, `max`, `band`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
        }
    }

    /// Parses a name as printed by [`ReduceOp::name`] (also `product`, `and`, `or`, `xor`).
    pub fn parse(s: &str) -> Option<ReduceOp> {
        Some(match s.to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "avg" | "mean" => ReduceOp::Avg,
            "prod" | "product" => ReduceOp::Prod,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "band" | "and" => ReduceOp::BAnd,
            "bor" | "or" => ReduceOp::BOr,
            "bxor" | "xor" => ReduceOp::BXor,
            _ => return None,
        })
    }

    /// The op with tag `tag` (as written by `op as u8`).
    pub fn from_tag(tag: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.get(tag as usize).copied()
    }

    /// Whether the operator applies to `dtype`: bitwise ops need an integer type or bool,
    /// complex types take only Sum, Avg and Prod (they have no order), bool takes all but Avg
    /// (as torch: its average is not a bool), and float8 types take none (they only move).
    pub fn fits(self, dtype: DType) -> bool {
        let bitwise = matches!(self, ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor);
        if dtype.is_float8() {
            false
        } else if dtype.is_complex() {
            matches!(self, ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Prod)
        } else if dtype == DType::Bool {
            self != ReduceOp::Avg
        } else {
            !bitwise || !dtype.is_float()
        }
    }

    /// The operator used while combining partial results: `Avg` combines as `Sum`.
    pub fn combiner(self) -> ReduceOp {
        match self {
            ReduceOp::Avg => ReduceOp::Sum,
            op => op,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Rejects an operator that does not apply to `dtype`: a bitwise op on a float type with
/// [`crate::ErrorKind::InvalidArgument`], any other combination [`ReduceOp::fits`] refuses
/// (float8, min/max/bitwise on complex, avg on bool) with [`crate::ErrorKind::Unsupported`].
/// Callers add the rank and the op.
pub fn check(op: ReduceOp, dtype: DType) -> Result<()> {
    if op.fits(dtype) {
        return Ok(());
    }
    let why = if dtype.is_float8() {
        "float8 types are moved, not reduced"
    } else if dtype.is_complex() {
        "complex types reduce with sum, avg and prod only"
    } else if dtype == DType::Bool {
        "the average of bools is not a bool"
    } else {
        return Err(Error::invalid(format!(
            "reduce op {op} does not apply to {dtype} (bitwise ops need an integer type)"
        )));
    };
    Err(Error::unsupported(format!("reduce op {op} on {dtype} is not supported ({why})")))
}

/// `dst[i] = op(dst[i], src[i])` for every i; `Avg` acts as `Sum` (see [`finish_avg`]).
///
/// # Panics
/// If the lengths differ or the op does not fit the type; callers validate with [`check`]
/// before communicating.
#[inline]
pub fn reduce_into<T: Element>(dst: &mut [T], src: &[T], op: ReduceOp) {
    assert_eq!(dst.len(), src.len(), "reduce_into: length mismatch");
    fast::reduce_into(dst, src, op);
}

/// `dst[i] = op(a[i], b[i])` for every i, out of place (`a` is the left operand, as `dst` is
/// in [`reduce_into`]); `Avg` acts as `Sum`. Reads `a` and `b` once and writes `dst` once,
/// instead of a copy followed by [`reduce_into`].
///
/// # Panics
/// If the lengths differ or the op does not fit the type; callers validate with [`check`]
/// before communicating.
#[inline]
pub fn reduce_from2<T: Element>(dst: &mut [T], a: &[T], b: &[T], op: ReduceOp) {
    assert_eq!(dst.len(), a.len(), "reduce_from2: length mismatch");
    assert_eq!(dst.len(), b.len(), "reduce_from2: length mismatch");
    fast::reduce_from2(dst, a, b, op);
}

/// Divides every element by `n` (the last step of [`ReduceOp::Avg`]); a no-op for other ops.
#[inline]
pub fn finish_avg<T: Element>(buf: &mut [T], op: ReduceOp, n: usize) {
    if op == ReduceOp::Avg && n > 1 {
        fast::divide(buf, n);
    }
}
