//! The `oxcomm._native` Python extension: oxcomm's communicator, its async work handles, the
//! compressed collectives and a store adapter, for the `oxcomm` Python package beside it
//! (`python/oxcomm`), which turns numpy arrays and torch tensors into buffers and defines the
//! exception classes.

mod buffer;
mod cli;
mod comm;
mod compressed;
mod errors;
mod interrupt;
mod store;
mod work;

use pyo3::prelude::*;

use crate::errors::IntoPy;

/// Joins the job the environment describes (`oxcomm launch`, torchrun with `OXCOMM_TOKEN`,
/// mpirun, srun), as `oxcomm::init()`. Does not pin the calling thread unless
/// `OXCOMM_BIND=core` is set.
#[pyfunction]
fn init(py: Python<'_>) -> PyResult<comm::PyComm> {
    let comm = py
        .detach(|| {
            let mut init = oxcomm::Init::from_env()?;
            init.pin_to_core = std::env::var(oxcomm::init::ENV_BIND).is_ok_and(|v| v.trim() == "core");
            init.connect()
        })
        .py()?;
    Ok(comm::PyComm { comm })
}

/// Joins a running job as a replacement rank (`oxcomm::join()`): what a program started by
/// `oxcomm launch --on-failure restart` calls when `OXCOMM_JOIN` is set, instead of `init`.
/// Waits for the members to grow (at most `OXCOMM_TIMEOUT`) and takes a free rank after
/// theirs. Pins the calling thread only under `OXCOMM_BIND=core`, as `init`. Native backend
/// only (`UnsupportedError` with `OXCOMM_BACKEND=mpi`).
#[pyfunction]
fn join(py: Python<'_>) -> PyResult<comm::PyComm> {
    let comm = py
        .detach(|| {
            let backend = std::env::var(oxcomm::init::ENV_BACKEND).unwrap_or_default();
            if !matches!(backend.trim().to_ascii_lowercase().as_str(), "" | "native") {
                return Err(oxcomm::Error::unsupported(format!(
                    "join with {}={}: growing back is only available on the native backend",
                    oxcomm::init::ENV_BACKEND,
                    backend.trim()
                )));
            }
            let mut init = oxcomm::Init::from_env()?;
            init.pin_to_core = std::env::var(oxcomm::init::ENV_BIND).is_ok_and(|v| v.trim() == "core");
            init.join()
        })
        .py()?;
    Ok(comm::PyComm { comm })
}

/// A fresh job secret (hex), as `oxcomm launch` makes one.
#[pyfunction]
fn generate_token() -> String {
    oxcomm::rendezvous::generate_token()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<comm::PyComm>()?;
    m.add_class::<work::PyWork>()?;
    m.add_class::<compressed::PyOneBitState>()?;
    m.add_class::<compressed::PyOneBitAdam>()?;
    // The orders in which `Communicator.all_reduce_at` numbers dtypes and reduce ops.
    m.add("DTYPES", oxcomm::DType::ALL.map(|d| d.name()).to_vec())?;
    m.add("REDUCE_OPS", oxcomm::ReduceOp::ALL.map(|o| o.name()).to_vec())?;
    m.add_function(wrap_pyfunction!(init, m)?)?;
    m.add_function(wrap_pyfunction!(join, m)?)?;
    m.add_function(wrap_pyfunction!(generate_token, m)?)?;
    m.add_function(wrap_pyfunction!(cli::cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(compressed::onebit_all_reduce, m)?)?;
    m.add_function(wrap_pyfunction!(compressed::reduce_scatter_coalesced, m)?)?;
    m.add_function(wrap_pyfunction!(compressed::all_to_all_quant_reduce, m)?)?;
    Ok(())
}
