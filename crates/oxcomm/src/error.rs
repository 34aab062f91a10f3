//! The one error type of the library.
//!
//! An [`Error`] says *who* (this rank, the peer), *what* (the op, its sequence number, dtype and
//! count) and *why* (an [`ErrorKind`] plus a message). Its `Display` reads like
//! `rank 2: all_reduce #17 (f32 × 1048576): timed out after 30s waiting for rank 3`.
//!
//! This module knows nothing about transports or collectives; it only carries their context.

use std::fmt;

/// What went wrong, coarsely; match on this rather than on message text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// An argument was rejected before any communication (length, root, rank list, op/type).
    InvalidArgument,
    /// A deadline passed while waiting for a peer that is still there (or silent).
    Timeout,
    /// A peer is gone: its process died, its connection closed or its thread returned.
    PeerGone,
    /// Ranks called different collectives (op, dtype, count, root or sequence differ).
    Mismatch,
    /// The communicator was aborted by an earlier error; the message carries that cause.
    Aborted,
    /// A peer or store sent bytes that do not follow the protocol (bad magic, oversized frame).
    Protocol,
    /// The feature exists in the API but is not built for this backend or configuration.
    Unsupported,
    /// An operating-system call failed.
    Io,
    /// Finding the other ranks failed (missing or contradictory environment, store refused us).
    Rendezvous,
    /// The communicator was revoked ([`crate::Communicator::revoke`], or a fault that aborted
    /// it on some rank): every op of it fails on every member; the error names who revoked it.
    /// [`crate::Communicator::agree`] and [`crate::Communicator::shrink`] still work.
    Revoked,
    /// A member showed no sign of life inside oxcomm for the heartbeat lapse while an op
    /// waited for it ([`crate::CommConfig::suspect_after`]): it is stopped, or stuck outside
    /// the library. The error names it and the op it was last seen in; the communicator is
    /// revoked, and [`crate::Communicator::shrink`] leaves it out.
    Suspected,
}

impl ErrorKind {
    /// A short lowercase name, used in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::Timeout => "timed out",
            ErrorKind::PeerGone => "peer gone",
            ErrorKind::Mismatch => "collective mismatch",
            ErrorKind::Aborted => "communicator aborted",
            ErrorKind::Protocol => "protocol error",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Io => "i/o error",
            ErrorKind::Rendezvous => "rendezvous failed",
            ErrorKind::Revoked => "communicator revoked",
            ErrorKind::Suspected => "peer suspected",
        }
    }
}

/// An error with the context of the rank and op that saw it.
///
/// Errors are cheap to clone: a communicator keeps the first one it saw and returns it (as
/// [`ErrorKind::Aborted`] wrapping the original) from every later op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    rank: Option<usize>,
    peer: Option<usize>,
    op: Option<String>,
    /// Whether a peer's close told it (the peer aborted because of `peer`): a revocation
    /// queued ahead of that close says more.
    told_by_close: bool,
}

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A new error of `kind` with a human message (no rank or op yet).
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error { kind, message: message.into(), rank: None, peer: None, op: None, told_by_close: false }
    }

    /// Shorthand for [`ErrorKind::InvalidArgument`].
    pub fn invalid(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidArgument, message)
    }

    /// Shorthand for [`ErrorKind::Unsupported`].
    pub fn unsupported(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Unsupported, message)
    }

    /// Shorthand for [`ErrorKind::Protocol`].
    pub fn protocol(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Protocol, message)
    }

    /// An [`ErrorKind::Io`] error from an OS error, with what we were doing.
    pub fn io(what: impl fmt::Display, err: std::io::Error) -> Error {
        let kind = match err.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => ErrorKind::Timeout,
            std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::UnexpectedEof => ErrorKind::PeerGone,
            _ => ErrorKind::Io,
        };
        Error::new(kind, format!("{what}: {err}"))
    }

    /// Marks an error a peer's close told (see [`Error::told_by_close`]).
    pub(crate) fn told_by_a_close(mut self) -> Error {
        self.told_by_close = true;
        self
    }

    /// Whether a peer's close told this error, rather than what this rank saw itself.
    pub(crate) fn told_by_close(&self) -> bool {
        self.told_by_close
    }

    /// Sets the rank that reports the error, unless already set.
    pub fn with_rank(mut self, rank: usize) -> Error {
        self.rank.get_or_insert(rank);
        self
    }

    /// Sets the peer involved, unless already set.
    pub fn with_peer(mut self, peer: usize) -> Error {
        self.peer.get_or_insert(peer);
        self
    }

    /// Sets the op description (e.g. `all_reduce #17 (f32 × 1048576)`), unless already set.
    pub fn with_op(mut self, op: impl Into<String>) -> Error {
        if self.op.is_none() {
            self.op = Some(op.into());
        }
        self
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The rank that reported the error, if known.
    pub fn rank(&self) -> Option<usize> {
        self.rank
    }

    /// The peer involved (the one we waited for, or that disagreed), if any.
    pub fn peer(&self) -> Option<usize> {
        self.peer
    }

    /// The op description, if the error happened inside one.
    pub fn op(&self) -> Option<&str> {
        self.op.as_deref()
    }

    /// The message without the rank/op prefix.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The error a later op sees after this one aborted the communicator (a revocation stays
    /// one: every later op of a revoked communicator fails with [`ErrorKind::Revoked`], naming
    /// who revoked it).
    pub fn aborted(&self, later_op: impl Into<String>) -> Error {
        if self.kind == ErrorKind::Revoked {
            return Error {
                kind: ErrorKind::Revoked,
                message: self.message.clone(),
                rank: self.rank,
                peer: self.peer,
                op: Some(later_op.into()),
                told_by_close: false,
            };
        }
        Error {
            kind: ErrorKind::Aborted,
            message: format!("communicator aborted by an earlier error: {self}"),
            rank: self.rank,
            peer: self.peer,
            op: Some(later_op.into()),
            told_by_close: false,
        }
    }

    /// Whether this error is of `kind` (an [`ErrorKind::Aborted`] error reports `Aborted`; its
    /// message carries the original cause).
    pub fn is(&self, kind: ErrorKind) -> bool {
        self.kind == kind
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(rank) = self.rank {
            write!(f, "rank {rank}: ")?;
        }
        if let Some(op) = &self.op {
            write!(f, "{op}: ")?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_reads_like_the_style_guide() {
        let e = Error::new(ErrorKind::Timeout, "timed out after 30s waiting for rank 3")
            .with_peer(3)
            .with_op("all_reduce #17 (f32 × 1048576)")
            .with_rank(2);
        assert_eq!(e.to_string(), "rank 2: all_reduce #17 (f32 × 1048576): timed out after 30s waiting for rank 3");
        assert_eq!(e.peer(), Some(3));
        let later = e.aborted("barrier #18");
        assert_eq!(later.kind(), ErrorKind::Aborted);
        assert!(later.to_string().contains("timed out after 30s"));
    }

    #[test]
    fn first_context_wins() {
        let e = Error::invalid("x").with_rank(1).with_rank(2).with_op("a").with_op("b");
        assert_eq!(e.rank(), Some(1));
        assert_eq!(e.op(), Some("a"));
    }
}
