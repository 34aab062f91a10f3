//! The float8 element types and their value codec.
//!
//! oxcomm moves float8 buffers (broadcast, gathers, scatter, all-to-all, send/recv) but reduces
//! none: no [`crate::ReduceOp`] fits them. The types are therefore plain bytes with a tag; the
//! codec here exists for [`Element::to_f64`] and [`Element::from_f64`] (tests, benchmark
//! patterns, logs), not for any hot path. Each format is described by a [`Format`]: exponent
//! and mantissa widths, exponent bias and which codes are special, following the definitions
//! torch (`c10::Float8_*`) and the OCP 8-bit floating point specification use.

use std::sync::OnceLock;

use super::{sealed, DType, Element};

/// Which codes of a format are not ordinary numbers.
#[derive(Debug, Clone, Copy)]
enum Special {
    /// IEEE-like (e5m2): exponent all ones is infinity (mantissa 0) or NaN.
    Ieee,
    /// Finite (e4m3fn): only `s.1111.111` is NaN; no infinity.
    Fn,
    /// Finite, unsigned zero (the `fnuz` types): `0x80` is the only NaN; no infinity, no -0.
    Fnuz,
    /// Exponent only, unsigned (e8m0fnu): `2^(code - 127)`, `0xff` is NaN; no zero.
    E8M0,
}

/// One float8 format.
#[derive(Debug)]
pub(crate) struct Format {
    exp_bits: u32,
    man_bits: u32,
    bias: i32,
    special: Special,
    /// The code of a NaN this format writes.
    nan: u8,
    /// Decoded values of all 256 codes, computed on first use.
    table: OnceLock<[f64; 256]>,
}

impl Format {
    const fn new(exp_bits: u32, man_bits: u32, bias: i32, special: Special, nan: u8) -> Format {
        Format { exp_bits, man_bits, bias, special, nan, table: OnceLock::new() }
    }

    /// The value of `code` (NaN for NaN codes, ±infinity where the format has it).
    fn value_of(&self, code: u8) -> f64 {
        if let Special::E8M0 = self.special {
            return if code == 0xff { f64::NAN } else { 2f64.powi(i32::from(code) - 127) };
        }
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from(code >> self.man_bits) & ((1 << self.exp_bits) - 1);
        let m = i32::from(code) & ((1 << self.man_bits) - 1);
        match self.special {
            Special::Ieee if e == (1 << self.exp_bits) - 1 => {
                return if m == 0 { sign * f64::INFINITY } else { f64::NAN }
            }
            Special::Fn if code & 0x7f == 0x7f => return f64::NAN,
            Special::Fnuz if code == 0x80 => return f64::NAN,
            _ => {}
        }
        let scale = |p: i32| 2f64.powi(p);
        let magnitude = if e == 0 {
            f64::from(m) * scale(1 - self.bias - self.man_bits as i32)
        } else {
            (1.0 + f64::from(m) * scale(-(self.man_bits as i32))) * scale(e - self.bias)
        };
        sign * magnitude
    }

    fn table(&self) -> &[f64; 256] {
        self.table.get_or_init(|| {
            let mut t = [0.0; 256];
            for (code, v) in t.iter_mut().enumerate() {
                *v = self.value_of(code as u8);
            }
            t
        })
    }

    /// The value of `code`.
    pub(crate) fn decode(&self, code: u8) -> f64 {
        self.table()[usize::from(code)]
    }

    /// The code nearest to `v` (ties to the even code); NaN gives the format's NaN, and a value
    /// beyond the largest finite one gives infinity where the format has it, else NaN. A
    /// search over the 256 codes: for tests and patterns, not for data paths.
    pub(crate) fn encode(&self, v: f64) -> u8 {
        if v.is_nan() {
            return self.nan;
        }
        let table = self.table();
        if v == 0.0 && v.is_sign_negative() && matches!(self.special, Special::Ieee | Special::Fn) {
            return 0x80;
        }
        let mut best: Option<(u8, f64)> = None;
        let mut largest = 0f64;
        for (code, &x) in table.iter().enumerate() {
            if !x.is_finite() {
                continue;
            }
            largest = largest.max(x);
            let d = (x - v).abs();
            let better = match best {
                None => true,
                Some((b, bd)) => d < bd || (d == bd && code % 2 == 0 && b % 2 == 1),
            };
            if better {
                best = Some((code as u8, d));
            }
        }
        if v.abs() > largest {
            if let Special::Ieee = self.special {
                return if v > 0.0 { 0x7c } else { 0xfc };
            }
            if !matches!(self.special, Special::E8M0) || v > 0.0 {
                return self.nan;
            }
        }
        best.map_or(self.nan, |(code, _)| code)
    }
}

static E4M3FN: Format = Format::new(4, 3, 7, Special::Fn, 0x7f);
static E5M2: Format = Format::new(5, 2, 15, Special::Ieee, 0x7f);
static E4M3FNUZ: Format = Format::new(4, 3, 8, Special::Fnuz, 0x80);
static E5M2FNUZ: Format = Format::new(5, 2, 16, Special::Fnuz, 0x80);
static E8M0FNU: Format = Format::new(8, 0, 127, Special::E8M0, 0xff);

macro_rules! float8_element {
    ($(#[$doc:meta])* $t:ident, $dtype:expr, $format:expr) => {
        $(#[$doc])*
        ///
        /// The raw byte (`.0`) is what moves; equality and order are those of the bytes.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
        #[derive(bytemuck::Pod, bytemuck::Zeroable)]
        #[repr(transparent)]
        pub struct $t(pub u8);

        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $dtype;
            fn from_f64(v: f64) -> Self {
                $t($format.encode(v))
            }
            fn to_f64(self) -> f64 {
                $format.decode(self.0)
            }
        }
    };
}

float8_element!(
    /// float8 e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinity, NaN `s.1111.111`.
    F8E4M3Fn,
    DType::F8E4M3Fn,
    E4M3FN
);
float8_element!(
    /// float8 e5m2: 5 exponent bits (bias 15), 2 mantissa bits, IEEE infinities and NaNs.
    F8E5M2,
    DType::F8E5M2,
    E5M2
);
float8_element!(
    /// float8 e4m3fnuz: 4 exponent bits (bias 8), 3 mantissa bits, NaN `0x80`, no -0.
    F8E4M3Fnuz,
    DType::F8E4M3Fnuz,
    E4M3FNUZ
);
float8_element!(
    /// float8 e5m2fnuz: 5 exponent bits (bias 16), 2 mantissa bits, NaN `0x80`, no -0.
    F8E5M2Fnuz,
    DType::F8E5M2Fnuz,
    E5M2FNUZ
);
float8_element!(
    /// float8 e8m0fnu: an unsigned power of two `2^(code - 127)`, NaN `0xff`, no zero.
    F8E8M0Fnu,
    DType::F8E8M0Fnu,
    E8M0FNU
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_decode_and_round_trip() {
        // The largest finite values and one subnormal of each format, as torch defines them.
        assert_eq!(F8E4M3Fn(0x7e).to_f64(), 448.0);
        assert!(F8E4M3Fn(0x7f).to_f64().is_nan());
        assert_eq!(F8E4M3Fn(0x01).to_f64(), 2f64.powi(-9));
        assert_eq!(F8E5M2(0x7b).to_f64(), 57344.0);
        assert_eq!(F8E5M2(0x7c).to_f64(), f64::INFINITY);
        assert_eq!(F8E4M3Fnuz(0x7f).to_f64(), 240.0);
        assert!(F8E4M3Fnuz(0x80).to_f64().is_nan());
        assert_eq!(F8E5M2Fnuz(0x7f).to_f64(), 57344.0);
        assert_eq!(F8E8M0Fnu(127).to_f64(), 1.0);
        assert!(F8E8M0Fnu(0xff).to_f64().is_nan());
        for v in [-4.0, -1.5, -0.0, 0.0, 0.25, 1.0, 3.0, 16.0] {
            assert_eq!(F8E4M3Fn::from_f64(v).to_f64(), v);
            assert_eq!(F8E5M2::from_f64(v).to_f64(), v);
        }
        assert_eq!(F8E4M3Fn::from_f64(-0.0), F8E4M3Fn(0x80));
        assert_eq!(F8E5M2::from_f64(1e9), F8E5M2(0x7c));
        assert!(F8E4M3Fn::from_f64(1e9).to_f64().is_nan());
        assert_eq!(F8E8M0Fnu::from_f64(0.5).to_f64(), 0.5);
        // Every finite code of every format round-trips through f64.
        for code in 0..=255u8 {
            for (v, back) in [
                (F8E4M3Fn(code).to_f64(), F8E4M3Fn::from_f64(F8E4M3Fn(code).to_f64()).0),
                (F8E5M2(code).to_f64(), F8E5M2::from_f64(F8E5M2(code).to_f64()).0),
                (F8E4M3Fnuz(code).to_f64(), F8E4M3Fnuz::from_f64(F8E4M3Fnuz(code).to_f64()).0),
                (F8E5M2Fnuz(code).to_f64(), F8E5M2Fnuz::from_f64(F8E5M2Fnuz(code).to_f64()).0),
                (F8E8M0Fnu(code).to_f64(), F8E8M0Fnu::from_f64(F8E8M0Fnu(code).to_f64()).0),
            ] {
                if v.is_finite() {
                    assert_eq!(back, code, "code {code:#x} value {v}");
                }
            }
        }
    }
}
