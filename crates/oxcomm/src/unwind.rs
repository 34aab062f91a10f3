//! Turning a panic inside an op into an error.
//!
//! An op runs code this crate does not control (a [`crate::transport::Link`] written by the
//! application, a reduction that hits a bug) while it holds the communicator's turn and links.
//! If that code panics, the op must not unwind past the communicator: its peers would wait for
//! it until their deadline, its `Work` handle would never complete and the ops queued behind it
//! would wait their turn. [`catch`] runs an op body and turns a panic into an
//! [`ErrorKind::Aborted`] error that names this rank as the culprit, so the communicator can
//! abort with it (closing the links with this rank as the cause) like after any other error.
//!
//! This module knows nothing about ops; the communicator decides what to do with the error.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::{Error, ErrorKind, Result};

/// The message a panic carried (`panic!("...")` payloads are `&str` or `String`).
pub(crate) fn message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a panic payload that is not a string)".to_string())
}

/// The error of a panic in an op of world rank `rank`, with the panic's `message`.
pub(crate) fn panicked(rank: usize, message: &str) -> Error {
    Error::new(ErrorKind::Aborted, format!("panicked inside the op ({message}); the communicator is aborted"))
        .with_peer(rank)
        .with_rank(rank)
}

/// Runs `f`; `Err` only if it panicked, with [`panicked`]'s error. Whatever `f` was changing
/// is left as the panic found it: the caller must abort the communicator on that error.
pub(crate) fn guard<R>(rank: usize, f: impl FnOnce() -> R) -> Result<R> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| panicked(rank, &message(&*p)))
}

/// [`guard`] for a fallible `f`: its own error, or the panic's.
pub(crate) fn catch<R>(rank: usize, f: impl FnOnce() -> Result<R>) -> Result<R> {
    guard(rank, f).and_then(|r| r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_aborted_error_naming_the_rank() {
        let e = catch::<()>(3, || panic!("boom {}", 7)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Aborted);
        assert_eq!((e.rank(), e.peer()), (Some(3), Some(3)));
        assert!(e.message().contains("boom 7"), "{e}");
        assert_eq!(catch(0, || Ok(5)).unwrap(), 5);
        assert_eq!(catch::<()>(0, || Err(Error::invalid("x"))).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert!(guard(0, || Err::<(), _>(Error::invalid("x"))).unwrap().is_err());
    }
}
