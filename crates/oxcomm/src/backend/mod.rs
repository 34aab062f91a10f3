//! Backends: ways to run a [`Communicator`](crate::Communicator)'s ops through a
//! communication library other than oxcomm's own links and algorithms.
//!
//! A backend owns the mapping of each op onto the library's calls, its own fingerprint check
//! and its byte counts. It does not own the op path itself: ordering of sync and async ops,
//! sequence numbers, argument validation and the abort-on-first-error rule stay in
//! [`crate::comm`], which hands each op to the backend after validating it.
//!
//! The only backend is MPI (module `mpi`, cargo feature `mpi`, off by default).

#[cfg(feature = "mpi")]
pub mod mpi;
