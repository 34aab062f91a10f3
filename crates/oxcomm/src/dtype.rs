//! Element types that collectives move and reduce.
//!
//! [`Element`] is implemented for f32, f64, f16, bf16, i8, u8, i16, u16, i32, u32, i64, u64,
//! and for this module's [`Bool`], [`Complex64`], [`Complex128`] and float8 types
//! ([`F8E4M3Fn`], [`F8E5M2`], [`F8E4M3Fnuz`], [`F8E5M2Fnuz`], [`F8E8M0Fnu`]). Each carries its
//! [`DType`] tag, which travels in op fingerprints and selects the reduction kernel. Which
//! reduce op applies to which dtype is [`crate::ReduceOp::fits`]'s; the float8 types only move
//! (no op fits them). This module knows nothing about communication.

use std::fmt;

use half::{bf16, f16};

mod float8;

pub use float8::{F8E4M3Fn, F8E4M3Fnuz, F8E5M2Fnuz, F8E8M0Fnu, F8E5M2};

/// The element type of a buffer, as a value (for fingerprints, logs and the CLI).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum DType {
    /// 32-bit IEEE float.
    F32 = 0,
    /// 64-bit IEEE float.
    F64 = 1,
    /// 16-bit IEEE float (`half::f16`); reduced in f32.
    F16 = 2,
    /// bfloat16 (`half::bf16`); reduced in f32.
    BF16 = 3,
    /// Signed 8-bit integer.
    I8 = 4,
    /// Unsigned 8-bit integer.
    U8 = 5,
    /// Signed 32-bit integer.
    I32 = 6,
    /// Signed 64-bit integer.
    I64 = 7,
    /// Boolean, one byte ([`Bool`]): 0 is false, anything else true; results are 0 or 1.
    Bool = 8,
    /// Signed 16-bit integer.
    I16 = 9,
    /// Unsigned 16-bit integer.
    U16 = 10,
    /// Unsigned 32-bit integer.
    U32 = 11,
    /// Unsigned 64-bit integer.
    U64 = 12,
    /// Complex number of two f32 ([`Complex64`], torch's and numpy's `complex64`).
    C64 = 13,
    /// Complex number of two f64 ([`Complex128`], torch's and numpy's `complex128`).
    C128 = 14,
    /// float8 e4m3, finite ([`F8E4M3Fn`], torch's `float8_e4m3fn`); moved, never reduced.
    F8E4M3Fn = 15,
    /// float8 e5m2 ([`F8E5M2`], torch's `float8_e5m2`); moved, never reduced.
    F8E5M2 = 16,
    /// float8 e4m3, finite, unsigned zero ([`F8E4M3Fnuz`], torch's `float8_e4m3fnuz`); moved only.
    F8E4M3Fnuz = 17,
    /// float8 e5m2, finite, unsigned zero ([`F8E5M2Fnuz`], torch's `float8_e5m2fnuz`); moved only.
    F8E5M2Fnuz = 18,
    /// float8 e8m0, exponent only ([`F8E8M0Fnu`], torch's `float8_e8m0fnu`); moved only.
    F8E8M0Fnu = 19,
}

impl DType {
    /// Every dtype, in tag order.
    pub const ALL: [DType; 20] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::I64,
        DType::Bool,
        DType::I16,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::C64,
        DType::C128,
        DType::F8E4M3Fn,
        DType::F8E5M2,
        DType::F8E4M3Fnuz,
        DType::F8E5M2Fnuz,
        DType::F8E8M0Fnu,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 | DType::C64 => 8,
            DType::C128 => 16,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
            DType::F8E4M3Fn | DType::F8E5M2 | DType::F8E4M3Fnuz | DType::F8E5M2Fnuz | DType::F8E8M0Fnu => 1,
        }
    }

    /// The short name used by nccl-tests and torch (`float`, `half`, ... are accepted by
    /// [`DType::parse`] too).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Bool => "bool",
            DType::I16 => "i16",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::C64 => "c64",
            DType::C128 => "c128",
            DType::F8E4M3Fn => "f8e4m3fn",
            DType::F8E5M2 => "f8e5m2",
            DType::F8E4M3Fnuz => "f8e4m3fnuz",
            DType::F8E5M2Fnuz => "f8e5m2fnuz",
            DType::F8E8M0Fnu => "f8e8m0fnu",
        }
    }

    /// Whether the type is a real floating-point type that oxcomm reduces (f32, f64, f16,
    /// bf16); complex and float8 types are not (see [`DType::is_complex`], [`DType::is_float8`]).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// Whether the type is complex (reduced as pairs of floats; no order, so no min or max).
    pub fn is_complex(self) -> bool {
        matches!(self, DType::C64 | DType::C128)
    }

    /// Whether the type is a float8 type: collectives move it but no reduce op applies.
    pub fn is_float8(self) -> bool {
        matches!(self, DType::F8E4M3Fn | DType::F8E5M2 | DType::F8E4M3Fnuz | DType::F8E5M2Fnuz | DType::F8E8M0Fnu)
    }

    /// The dtype with tag `tag` (as written by `dtype as u8`).
    pub fn from_tag(tag: u8) -> Option<DType> {
        DType::ALL.get(tag as usize).copied()
    }

    /// Parses a name: `f32`/`float`/`float32`, `f64`/`double`, `f16`/`half`/`float16`,
    /// `bf16`/`bfloat16`, `i8`/`int8`, `u8`/`uint8`, `i32`/`int`/`int32`, `i64`/`int64`,
    /// `bool`, `i16`/`int16`/`short`, `u16`/`uint16`, `u32`/`uint32`, `u64`/`uint64`,
    /// `c64`/`complex64`/`cfloat`, `c128`/`complex128`/`cdouble`, and the float8 types by
    /// oxcomm's or torch's name (`f8e4m3fn`/`float8_e4m3fn`, `f8e5m2`/`float8_e5m2`, ...).
    pub fn parse(s: &str) -> Option<DType> {
        Some(match s.to_ascii_lowercase().as_str() {
            "f32" | "float" | "float32" => DType::F32,
            "f64" | "double" | "float64" => DType::F64,
            "f16" | "half" | "float16" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "i8" | "int8" => DType::I8,
            "u8" | "uint8" => DType::U8,
            "i32" | "int" | "int32" => DType::I32,
            "i64" | "int64" => DType::I64,
            "bool" => DType::Bool,
            "i16" | "int16" | "short" => DType::I16,
            "u16" | "uint16" => DType::U16,
            "u32" | "uint32" => DType::U32,
            "u64" | "uint64" => DType::U64,
            "c64" | "complex64" | "cfloat" => DType::C64,
            "c128" | "complex128" | "cdouble" => DType::C128,
            "f8e4m3fn" | "float8_e4m3fn" => DType::F8E4M3Fn,
            "f8e5m2" | "float8_e5m2" => DType::F8E5M2,
            "f8e4m3fnuz" | "float8_e4m3fnuz" => DType::F8E4M3Fnuz,
            "f8e5m2fnuz" | "float8_e5m2fnuz" => DType::F8E5M2Fnuz,
            "f8e8m0fnu" | "float8_e8m0fnu" => DType::F8E8M0Fnu,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A type that collectives can move and reduce.
///
/// Implemented for exactly one Rust type per [`DType`]; the trait is sealed. `PartialEq` and
/// `PartialOrd` are the type's own (bitwise for [`Bool`] and the float8 types, lexicographic
/// for complex numbers); reductions do not use them.
pub trait Element:
    bytemuck::Pod + Send + Sync + PartialEq + PartialOrd + fmt::Debug + Default + sealed::Sealed + 'static
{
    /// The tag of this type.
    const DTYPE: DType;
    /// Converts from f64 (rounding or truncating as `as` does for the type; a complex number
    /// gets `v` as its real part, a [`Bool`] is true for any `v != 0`).
    fn from_f64(v: f64) -> Self;
    /// Converts to f64 (exact for every type but 64-bit integers beyond 2^53; a complex
    /// number gives its real part).
    fn to_f64(self) -> f64;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! primitive_element {
    ($t:ty, $d:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    };
}

primitive_element!(f32, DType::F32);
primitive_element!(f64, DType::F64);
primitive_element!(i8, DType::I8);
primitive_element!(u8, DType::U8);
primitive_element!(i32, DType::I32);
primitive_element!(i64, DType::I64);
primitive_element!(i16, DType::I16);
primitive_element!(u16, DType::U16);
primitive_element!(u32, DType::U32);
primitive_element!(u64, DType::U64);

impl sealed::Sealed for f16 {}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline]
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    #[inline]
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
}

impl sealed::Sealed for bf16 {}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline]
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    #[inline]
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
}

/// A boolean element: one byte, 0 for false and anything else for true (torch's and numpy's
/// `bool` are one byte holding 0 or 1). Reductions write 0 or 1. A newtype rather than Rust's
/// `bool`, for which a byte other than 0 or 1 would be undefined behaviour.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub struct Bool(pub u8);

impl Bool {
    /// The truth value (any non-zero byte is true).
    #[inline]
    pub fn get(self) -> bool {
        self.0 != 0
    }
}

impl From<bool> for Bool {
    #[inline]
    fn from(b: bool) -> Bool {
        Bool(u8::from(b))
    }
}

impl sealed::Sealed for Bool {}
impl Element for Bool {
    const DTYPE: DType = DType::Bool;
    #[inline]
    fn from_f64(v: f64) -> Self {
        Bool::from(v != 0.0)
    }
    #[inline]
    fn to_f64(self) -> f64 {
        f64::from(u8::from(self.get()))
    }
}

macro_rules! complex_element {
    ($(#[$doc:meta])* $t:ident, $part:ty, $d:expr) => {
        $(#[$doc])*
        ///
        /// Laid out as numpy and torch lay it out: the real part, then the imaginary part.
        /// `PartialOrd` is lexicographic (complex numbers have no order; no reduction uses it).
        #[derive(Debug, Clone, Copy, Default, PartialEq, PartialOrd, bytemuck::Pod, bytemuck::Zeroable)]
        #[repr(C)]
        pub struct $t {
            /// Real part.
            pub re: $part,
            /// Imaginary part.
            pub im: $part,
        }

        impl $t {
            /// The number `re + im·i`.
            #[inline]
            pub fn new(re: $part, im: $part) -> $t {
                $t { re, im }
            }
        }

        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
            #[inline]
            fn from_f64(v: f64) -> Self {
                $t { re: v as $part, im: 0.0 }
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self.re as f64
            }
        }
    };
}

complex_element!(
    /// A complex number of two f32 (numpy's and torch's `complex64`).
    Complex64,
    f32,
    DType::C64
);
complex_element!(
    /// A complex number of two f64 (numpy's and torch's `complex128`).
    Complex128,
    f64,
    DType::C128
);

/// Views a typed slice as bytes.
#[inline]
pub fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

/// Views a typed slice as mutable bytes.
#[inline]
pub fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::parse(d.name()), Some(d));
            assert_eq!(DType::from_tag(d as u8), Some(d));
        }
        assert_eq!(DType::parse("bfloat16"), Some(DType::BF16));
        assert_eq!(DType::parse("nope"), None);
    }

    #[test]
    fn sizes_match_rust() {
        assert_eq!(DType::F16.size(), std::mem::size_of::<f16>());
        assert_eq!(<bf16 as Element>::DTYPE, DType::BF16);
        assert_eq!(<i64 as Element>::DTYPE.size(), 8);
        assert_eq!(DType::Bool.size(), std::mem::size_of::<Bool>());
        assert_eq!(DType::U16.size(), std::mem::size_of::<u16>());
        assert_eq!(DType::C64.size(), std::mem::size_of::<Complex64>());
        assert_eq!(DType::C128.size(), std::mem::size_of::<Complex128>());
        assert_eq!(DType::F8E5M2.size(), std::mem::size_of::<F8E5M2>());
        assert_eq!(<Complex128 as Element>::DTYPE, DType::C128);
    }

    #[test]
    fn torch_names_parse() {
        for (name, d) in [
            ("bool", DType::Bool),
            ("int16", DType::I16),
            ("uint16", DType::U16),
            ("uint32", DType::U32),
            ("uint64", DType::U64),
            ("complex64", DType::C64),
            ("complex128", DType::C128),
            ("float8_e4m3fn", DType::F8E4M3Fn),
            ("float8_e5m2", DType::F8E5M2),
            ("float8_e4m3fnuz", DType::F8E4M3Fnuz),
            ("float8_e5m2fnuz", DType::F8E5M2Fnuz),
            ("float8_e8m0fnu", DType::F8E8M0Fnu),
        ] {
            assert_eq!(DType::parse(name), Some(d), "{name}");
        }
        assert!(DType::ALL.iter().enumerate().all(|(i, d)| *d as usize == i));
    }
}
