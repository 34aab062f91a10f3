//! Caller memory as op buffers: a numpy array's or a torch CPU tensor's data, by address.
//!
//! The Python layer (`oxcomm/_buffers.py`) checks what Python can see — CPU device, a dtype
//! oxcomm reduces, C-contiguous, writable where the op writes — and hands over
//! `(address, element count, dtype name, owner)`. This module turns that into slices for the
//! length of one op and keeps the owner alive as long as an async op may touch the memory.
//! It knows nothing about ops.

use oxcomm::DType;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

/// One buffer: where its elements start, how many there are, their type, and the Python
/// object that owns the memory (held so it cannot be freed while an op uses it; `None` for a
/// buffer of a blocking call, whose caller holds the owner for the call: [`Buf::borrowed`]).
#[derive(Debug)]
pub struct Buf {
    addr: usize,
    len: usize,
    pub dtype: DType,
    _owner: Option<Py<PyAny>>,
}

impl<'a, 'py> FromPyObject<'a, 'py> for Buf {
    type Error = PyErr;

    fn extract(ob: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let (addr, len, dtype, owner): (usize, usize, String, Py<PyAny>) = ob.extract()?;
        let dtype = parse_dtype(&dtype)?;
        if len > 0 && addr == 0 {
            return Err(PyTypeError::new_err("a buffer of non-zero length at address 0"));
        }
        Ok(Buf { addr, len, dtype, _owner: Some(owner) })
    }
}

/// The dtype named by the Python layer (one of [`DType::name`]'s names; the library's parser).
pub fn parse_dtype(name: &str) -> PyResult<DType> {
    DType::parse(name).ok_or_else(|| PyTypeError::new_err(format!("oxcomm does not reduce dtype {name}")))
}

impl Buf {
    /// A buffer of a blocking call whose Python caller checked it as `FromPyObject` callers
    /// do (`oxcomm/_buffers.py`) and holds its owner until the call returns, so nothing is
    /// held here. `dtype` is an index into [`DType::ALL`] (the module's `DTYPES`).
    pub fn borrowed(addr: usize, len: usize, dtype: usize) -> PyResult<Buf> {
        let dtype = *DType::ALL
            .get(dtype)
            .ok_or_else(|| PyTypeError::new_err(format!("dtype index {dtype} is not one of oxcomm's dtypes")))?;
        if len > 0 && addr == 0 {
            return Err(PyTypeError::new_err("a buffer of non-zero length at address 0"));
        }
        Ok(Buf { addr, len, dtype, _owner: None })
    }

    /// Element count.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the two buffers share a byte (then they may not both be handed to Rust as
    /// slices of which one is mutable).
    pub fn overlaps(&self, other: &Buf) -> bool {
        let end = |b: &Buf| b.addr + b.len * b.dtype.size();
        self.len > 0 && other.len > 0 && self.addr < end(other) && other.addr < end(self)
    }

    /// The elements as `T`.
    ///
    /// # Safety
    /// `T` must be the Rust type of `self.dtype`, and no other reference to the same memory may
    /// be used while the slice lives (the Python layer checked the buffer is C-contiguous; two
    /// arguments of one op that overlap are the caller's error, as in torch).
    pub unsafe fn slice<T>(&self) -> &[T] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the owner (held by `self`) keeps `len` contiguous elements of `T` alive at
        // `addr` (checked by the Python layer); the caller guarantees `T` and exclusivity.
        unsafe { std::slice::from_raw_parts(self.addr as *const T, self.len) }
    }

    /// The elements as `T`, writable.
    ///
    /// # Safety
    /// As [`Buf::slice`], and the memory is writable (the Python layer refused read-only arrays).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut<T>(&self) -> &mut [T] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as in `slice`; writable memory, checked by the Python layer.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut T, self.len) }
    }
}

/// Runs `$body` with `$T` bound to the Rust element type of `$dtype`.
#[macro_export]
macro_rules! with_elem {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            oxcomm::DType::F32 => {
                type $T = f32;
                $body
            }
            oxcomm::DType::F64 => {
                type $T = f64;
                $body
            }
            oxcomm::DType::F16 => {
                type $T = half::f16;
                $body
            }
            oxcomm::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            oxcomm::DType::I8 => {
                type $T = i8;
                $body
            }
            oxcomm::DType::U8 => {
                type $T = u8;
                $body
            }
            oxcomm::DType::I32 => {
                type $T = i32;
                $body
            }
            oxcomm::DType::I64 => {
                type $T = i64;
                $body
            }
            oxcomm::DType::Bool => {
                type $T = oxcomm::dtype::Bool;
                $body
            }
            oxcomm::DType::I16 => {
                type $T = i16;
                $body
            }
            oxcomm::DType::U16 => {
                type $T = u16;
                $body
            }
            oxcomm::DType::U32 => {
                type $T = u32;
                $body
            }
            oxcomm::DType::U64 => {
                type $T = u64;
                $body
            }
            oxcomm::DType::C64 => {
                type $T = oxcomm::dtype::Complex64;
                $body
            }
            oxcomm::DType::C128 => {
                type $T = oxcomm::dtype::Complex128;
                $body
            }
            oxcomm::DType::F8E4M3Fn => {
                type $T = oxcomm::dtype::F8E4M3Fn;
                $body
            }
            oxcomm::DType::F8E5M2 => {
                type $T = oxcomm::dtype::F8E5M2;
                $body
            }
            oxcomm::DType::F8E4M3Fnuz => {
                type $T = oxcomm::dtype::F8E4M3Fnuz;
                $body
            }
            oxcomm::DType::F8E5M2Fnuz => {
                type $T = oxcomm::dtype::F8E5M2Fnuz;
                $body
            }
            oxcomm::DType::F8E8M0Fnu => {
                type $T = oxcomm::dtype::F8E8M0Fnu;
                $body
            }
        }
    };
}
