//! oxcomm: collective communication for Rust.

#![warn(missing_docs)]

pub mod compression;
pub mod dtype;
pub mod error;
pub mod reduce;

pub use dtype::{DType, Element};
pub use error::{Error, ErrorKind, Result};
pub use reduce::ReduceOp;
pub mod transport;
