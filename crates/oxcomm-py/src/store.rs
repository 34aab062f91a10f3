//! oxcomm's rendezvous [`Store`] over a Python store object: a `torch.distributed.Store`
//! (TCPStore, PrefixStore, FileStore, HashStore) or anything with its methods `set`, `get`,
//! `add`, `wait`, `check` and `delete_key`. Every call takes the GIL for its duration; oxcomm
//! uses the store at set-up only.

use std::time::Instant;

use oxcomm::rendezvous::Store;
use oxcomm::{Error, ErrorKind, Result};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

/// A Python store object.
#[derive(Debug)]
pub struct PyStore {
    store: Py<PyAny>,
}

impl PyStore {
    /// Wraps `store`.
    pub fn new(store: Py<PyAny>) -> PyStore {
        PyStore { store }
    }
}

/// A Python exception from the store as an oxcomm error (torch's store raises a timeout
/// error when `wait` or `get` runs out of time).
fn store_error(py: Python<'_>, what: &str, e: PyErr) -> Error {
    let name = e.get_type(py).name().map(|n| n.to_string()).unwrap_or_default();
    let text = e.to_string();
    let kind = if name.contains("Timeout") || text.to_ascii_lowercase().contains("timeout") {
        ErrorKind::Timeout
    } else {
        ErrorKind::Rendezvous
    };
    Error::new(kind, format!("the store's {what} failed: {text}"))
}

/// Seconds left until `deadline` as a `datetime.timedelta` (at least a millisecond).
fn timedelta<'py>(py: Python<'py>, deadline: Instant) -> PyResult<Bound<'py, PyAny>> {
    let secs = deadline.saturating_duration_since(Instant::now()).as_secs_f64().max(1e-3);
    py.import("datetime")?.getattr("timedelta")?.call((), Some(&[("seconds", secs)].into_py_dict(py)?))
}

use pyo3::types::IntoPyDict;

impl Store for PyStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        Python::attach(|py| {
            self.store
                .call_method1(py, "set", (key, PyBytes::new(py, value)))
                .map_err(|e| store_error(py, "set", e))?;
            Ok(())
        })
    }

    fn get(&self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        self.wait(&[key], deadline)?;
        Python::attach(|py| {
            let v = self.store.call_method1(py, "get", (key,)).map_err(|e| store_error(py, "get", e))?;
            v.extract::<Vec<u8>>(py).map_err(|e| store_error(py, "get", e))
        })
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Python::attach(|py| {
            let keys = PyList::new(py, [key]).map_err(|e| store_error(py, "check", e))?;
            let there: bool = self
                .store
                .call_method1(py, "check", (keys,))
                .and_then(|v| v.extract(py))
                .map_err(|e| store_error(py, "check", e))?;
            if !there {
                return Ok(None);
            }
            let v = self.store.call_method1(py, "get", (key,)).map_err(|e| store_error(py, "get", e))?;
            v.extract::<Vec<u8>>(py).map(Some).map_err(|e| store_error(py, "get", e))
        })
    }

    fn wait(&self, keys: &[&str], deadline: Instant) -> Result<()> {
        Python::attach(|py| {
            let list = PyList::new(py, keys).map_err(|e| store_error(py, "wait", e))?;
            let td = timedelta(py, deadline).map_err(|e| store_error(py, "wait", e))?;
            self.store.call_method1(py, "wait", (list, td)).map_err(|e| {
                let e = store_error(py, "wait", e);
                Error::new(e.kind(), format!("{} (waiting for {keys:?})", e.message()))
            })?;
            Ok(())
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        Python::attach(|py| {
            self.store
                .call_method1(py, "add", (key, delta))
                .and_then(|v| v.extract(py))
                .map_err(|e| store_error(py, "add", e))
        })
    }

    fn delete(&self, key: &str) -> Result<bool> {
        Python::attach(|py| {
            self.store
                .call_method1(py, "delete_key", (key,))
                .and_then(|v| v.extract(py))
                .map_err(|e| store_error(py, "delete_key", e))
        })
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<Vec<u8>> {
        // torch's compare_set takes an empty expected value for "not set".
        Python::attach(|py| {
            let expected = PyBytes::new(py, expected.unwrap_or_default());
            self.store
                .call_method1(py, "compare_set", (key, expected, PyBytes::new(py, new)))
                .and_then(|v| v.extract(py))
                .map_err(|e| store_error(py, "compare_set", e))
        })
    }
}
