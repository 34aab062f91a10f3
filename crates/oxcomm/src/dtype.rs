//! Element types that collectives move and reduce.
//!
//! [`Element`] is implemented for f32, f64, f16, bf16, i8, u8, i32 and i64. Each carries its
//! [`DType`] tag, which travels in op fingerprints and selects the reduction kernel. This module
//! knows nothing about communication.

use std::fmt;

use half::{bf16, f16};

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
}

impl DType {
    /// Every dtype, in tag order.
    pub const ALL: [DType; 8] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::I64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::I8 | DType::U8 => 1,
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
        }
    }

    /// Whether the type is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// The dtype with tag `tag` (as written by `dtype as u8`).
    pub fn from_tag(tag: u8) -> Option<DType> {
        DType::ALL.get(tag as usize).copied()
    }

    /// Parses a name: `f32`/`float`/`float32`, `f64`/`double`, `f16`/`half`/`float16`,
    /// `bf16`/`bfloat16`, `i8`/`int8`, `u8`/`uint8`, `i32`/`int`/`int32`, `i64`/`int64`.
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
/// Implemented for exactly the eight types of [`DType`]; the trait is sealed.
pub trait Element:
    bytemuck::Pod + Send + Sync + PartialEq + PartialOrd + fmt::Debug + Default + sealed::Sealed + 'static
{
    /// The tag of this type.
    const DTYPE: DType;
    /// Converts from f64 (rounding or truncating as `as` does for the type).
    fn from_f64(v: f64) -> Self;
    /// Converts to f64 (exact for every type but i64 beyond 2^53).
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
    }
}
