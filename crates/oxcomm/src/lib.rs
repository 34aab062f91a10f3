//! oxcomm: collective communication for Rust.

#![warn(missing_docs)]

pub mod algorithms;
pub mod backend;
pub mod comm;
pub mod compression;
pub mod dtype;
pub mod engine;
pub mod error;
#[cfg(target_os = "linux")]
pub mod init;
pub mod logging;
pub mod reduce;
pub mod rendezvous;
pub mod threads;
pub mod transport;
pub mod wire;

#[cfg(feature = "mpi")]
pub use backend::mpi;

pub use algorithms::Algorithm;
pub use comm::{CommConfig, Communicator, OpOptions, Work};
pub use dtype::{DType, Element};
pub use error::{Error, ErrorKind, Result};
#[cfg(target_os = "linux")]
pub use init::{init, Init};
pub use reduce::ReduceOp;
