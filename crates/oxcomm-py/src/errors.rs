//! oxcomm errors as Python exceptions: `oxcomm.OxcommError` and one subclass per
//! [`ErrorKind`], defined in `oxcomm/_errors.py` (so they can also derive from the matching
//! builtin, e.g. `TimeoutError`) and carrying `rank`, `peer`, `op` and `kind`.

use oxcomm::{Error, ErrorKind};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// The class name in `oxcomm._errors` for an error kind.
fn class_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidArgument => "InvalidArgumentError",
        ErrorKind::Timeout => "TimeoutError",
        ErrorKind::PeerGone => "PeerGoneError",
        ErrorKind::Mismatch => "MismatchError",
        ErrorKind::Aborted => "AbortedError",
        ErrorKind::Protocol => "ProtocolError",
        ErrorKind::Unsupported => "UnsupportedError",
        ErrorKind::Io => "IoError",
        ErrorKind::Rendezvous => "RendezvousError",
        ErrorKind::Revoked => "RevokedError",
        ErrorKind::Suspected => "SuspectedError",
        _ => "OxcommError",
    }
}

/// The error's kind as the Python attribute `kind` spells it.
fn kind_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidArgument => "invalid_argument",
        ErrorKind::Timeout => "timeout",
        ErrorKind::PeerGone => "peer_gone",
        ErrorKind::Mismatch => "mismatch",
        ErrorKind::Aborted => "aborted",
        ErrorKind::Protocol => "protocol",
        ErrorKind::Unsupported => "unsupported",
        ErrorKind::Io => "io",
        ErrorKind::Rendezvous => "rendezvous",
        ErrorKind::Revoked => "revoked",
        ErrorKind::Suspected => "suspected",
        _ => "other",
    }
}

/// Builds the Python exception for `err`.
pub fn to_py(err: Error) -> PyErr {
    Python::attach(|py| {
        let build = || -> PyResult<PyErr> {
            let module = py.import("oxcomm._errors")?;
            let cls = module.getattr(class_name(err.kind()))?;
            let inst = cls.call1((err.to_string(),))?;
            inst.setattr("rank", err.rank())?;
            inst.setattr("peer", err.peer())?;
            inst.setattr("op", err.op())?;
            inst.setattr("kind", kind_name(err.kind()))?;
            Ok(PyErr::from_value(inst))
        };
        build().unwrap_or_else(|e| PyRuntimeError::new_err(format!("{err} (and building its exception failed: {e})")))
    })
}

/// `Result<T, oxcomm::Error>` → `PyResult<T>`.
pub trait IntoPy<T> {
    /// Converts the error, if any.
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for oxcomm::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
