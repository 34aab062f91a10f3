//! `oxcomm._native` functions for the compressed collectives: DeepSpeed's 1-bit
//! error-compensated all-reduce (with its error state as a class) and the coalesced and
//! ZeRO++ quantized reduce-scatters. The algorithms are `oxcomm::compression`'s.

use std::sync::Mutex;

use oxcomm::compression::onebit::{self, OneBitState};
use oxcomm::compression::{coalesced, host_groups, qgz};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::buffer::Buf;
use crate::comm::PyComm;
use crate::errors::IntoPy;
use crate::with_elem;

/// The 1-bit all-reduce's error feedback: the worker error (padded length) and the server
/// error (one chunk), as DeepSpeed keeps them.
#[pyclass(module = "oxcomm._native", name = "OneBitState")]
pub struct PyOneBitState {
    state: Mutex<OneBitState>,
}

impl std::fmt::Debug for PyOneBitState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PyOneBitState").finish_non_exhaustive()
    }
}

fn f32_of<'b>(b: &'b Buf, name: &str) -> PyResult<&'b [f32]> {
    if b.dtype != oxcomm::DType::F32 {
        return Err(PyTypeError::new_err(format!("{name}: the 1-bit all-reduce runs on float32, not {:?}", b.dtype)));
    }
    // SAFETY: f32 checked above; the buffer's owner is held by `b`.
    Ok(unsafe { b.slice::<f32>() })
}

#[pymethods]
impl PyOneBitState {
    /// Zero errors for buffers of up to `numel` elements on `world_size` ranks.
    #[new]
    fn new(numel: usize, world_size: usize) -> PyResult<Self> {
        Ok(PyOneBitState { state: Mutex::new(OneBitState::new(numel, world_size).py()?) })
    }

    /// A state holding copies of the given errors (DeepSpeed's caller-owned error tensors).
    #[staticmethod]
    fn from_errors(worker_error: Buf, server_error: Buf, world_size: usize) -> PyResult<Self> {
        let w = f32_of(&worker_error, "worker_error")?.to_vec();
        let s = f32_of(&server_error, "server_error")?.to_vec();
        Ok(PyOneBitState { state: Mutex::new(OneBitState::from_errors(w, s, world_size).py()?) })
    }

    /// Length the buffer is padded to (a multiple of 8 × world size).
    #[getter]
    fn padded_len(&self) -> usize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).padded_len()
    }

    /// Length of one rank's chunk (the server error's length).
    #[getter]
    fn chunk_len(&self) -> usize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).chunk_len()
    }

    /// Copies the errors into the given float32 buffers (of `padded_len` and `chunk_len`).
    fn errors_into(&self, worker_out: Buf, server_out: Buf) -> PyResult<()> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for (name, out, src) in
            [("worker_out", &worker_out, st.worker_error()), ("server_out", &server_out, st.server_error())]
        {
            f32_of(out, name)?;
            if out.len() != src.len() {
                return Err(PyValueError::new_err(format!(
                    "{name}: {} elements, the state holds {}",
                    out.len(),
                    src.len()
                )));
            }
            // SAFETY: float32 checked by `f32_of`, length checked above; owner held by `out`.
            unsafe { out.slice_mut::<f32>() }.copy_from_slice(&src);
        }
        Ok(())
    }

    /// The worker error as float32 bytes.
    fn worker_error<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        PyBytes::new(py, oxcomm::dtype::as_bytes(&st.worker_error()))
    }

    /// The server error as float32 bytes.
    fn server_error<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        PyBytes::new(py, oxcomm::dtype::as_bytes(&st.server_error()))
    }

    /// Sets both errors to zero.
    fn reset(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).reset()
    }
}

/// The 1-bit error-compensated all-reduce of `buf` (float32, in place) with `state`.
#[pyfunction]
pub fn onebit_all_reduce(py: Python<'_>, comm: &PyComm, buf: Buf, state: &PyOneBitState) -> PyResult<()> {
    f32_of(&buf, "buf")?;
    let c = &comm.comm;
    py.detach(|| {
        let mut st = state.state.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: float32 checked above; the buffer's owner is held by `buf`.
        onebit::all_reduce(c, unsafe { buf.slice_mut::<f32>() }, &mut st)
    })
    .py()
}

/// DeepSpeed's 1-bit Adam on flat float32 parameters and gradients (`oxcomm::compression::
/// onebit::Adam`): exact averaging until `freeze_step`, then 1-bit compressed momenta.
#[pyclass(module = "oxcomm._native", name = "OneBitAdam")]
#[derive(Debug)]
pub struct PyOneBitAdam {
    adam: Mutex<onebit::Adam>,
}

#[pymethods]
impl PyOneBitAdam {
    #[new]
    #[pyo3(signature = (lr = 1e-3, freeze_step = 100_000, betas = (0.9, 0.999), eps = 1e-8, weight_decay = 0.0))]
    fn new(lr: f32, freeze_step: u64, betas: (f32, f32), eps: f32, weight_decay: f32) -> Self {
        let mut adam = onebit::Adam::new(lr, freeze_step);
        adam.betas = betas;
        adam.eps = eps;
        adam.weight_decay = weight_decay;
        PyOneBitAdam { adam: Mutex::new(adam) }
    }

    /// One optimizer call: `params` updated in place, `grads` averaged in place while warming
    /// up (left as they are once frozen). Collective; hyperparameters are checked before
    /// anything is sent.
    fn step(&self, py: Python<'_>, comm: &PyComm, params: Buf, grads: Buf) -> PyResult<()> {
        f32_of(&params, "params")?;
        f32_of(&grads, "grads")?;
        if params.overlaps(&grads) {
            return Err(PyValueError::new_err("grads: shares memory with params"));
        }
        let c = &comm.comm;
        crate::interrupt::run(py, c, || {
            let mut adam = self.adam.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: both float32 (checked above) and disjoint (checked above); their owners
            // are held by `params` and `grads` for the call.
            adam.step(c, unsafe { params.slice_mut::<f32>() }, unsafe { grads.slice_mut::<f32>() })
        })
    }

    /// Optimizer calls so far.
    #[getter]
    fn step_count(&self) -> u64 {
        self.adam.lock().unwrap_or_else(|e| e.into_inner()).step_count()
    }

    /// Whether the variance is frozen and momenta go through the 1-bit all-reduce.
    #[getter]
    fn frozen(&self) -> bool {
        self.adam.lock().unwrap_or_else(|e| e.into_inner()).is_compressing()
    }

    /// The momentum as float32 bytes (empty before the first call).
    fn exp_avg<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let adam = self.adam.lock().unwrap_or_else(|e| e.into_inner());
        PyBytes::new(py, oxcomm::dtype::as_bytes(adam.exp_avg()))
    }

    /// The variance as float32 bytes (empty before the first call).
    fn exp_avg_sq<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let adam = self.adam.lock().unwrap_or_else(|e| e.into_inner());
        PyBytes::new(py, oxcomm::dtype::as_bytes(adam.exp_avg_sq()))
    }
}

/// `reduce_scatter_coalesced`: this rank's partition of the mean of each tensor, as
/// `(bytes, dtype)` pairs.
#[pyfunction]
pub fn reduce_scatter_coalesced<'py>(
    py: Python<'py>,
    comm: &PyComm,
    tensors: Vec<Buf>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let Some(first) = tensors.first() else { return Ok(Vec::new()) };
    let dtype = first.dtype;
    if let Some((i, b)) = tensors.iter().enumerate().find(|(_, b)| b.dtype != dtype) {
        return Err(PyTypeError::new_err(format!("tensors[{i}]: dtype {:?} differs from {dtype:?}", b.dtype)));
    }
    let c = &comm.comm;
    let out: Vec<Vec<u8>> = py
        .detach(|| {
            with_elem!(dtype, T => {
                // SAFETY: `T` is every buffer's dtype (checked above); owners held by `tensors`.
                let views: Vec<&[T]> = tensors.iter().map(|b| unsafe { b.slice::<T>() }).collect();
                coalesced::reduce_scatter_coalesced(c, &views)
                    .map(|parts| parts.iter().map(|p| oxcomm::dtype::as_bytes(p).to_vec()).collect())
            })
        })
        .py()?;
    Ok(out.iter().map(|b| PyBytes::new(py, b)).collect())
}

/// ZeRO++'s quantized reduce-scatter (`all_to_all_quant_reduce`): this rank's partition of
/// the mean of each tensor (float32, float16 or bfloat16; `shapes[i]` is tensor i's shape),
/// with hosts of `ranks_per_host` ranks when given.
#[pyfunction]
#[pyo3(signature = (comm, tensors, shapes, ranks_per_host = None))]
pub fn all_to_all_quant_reduce<'py>(
    py: Python<'py>,
    comm: &PyComm,
    tensors: Vec<Buf>,
    shapes: Vec<Vec<usize>>,
    ranks_per_host: Option<usize>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    if shapes.len() != tensors.len() {
        return Err(PyValueError::new_err(format!("shapes: {} shapes for {} tensors", shapes.len(), tensors.len())));
    }
    let Some(first) = tensors.first() else { return Ok(Vec::new()) };
    let dtype = first.dtype;
    if let Some((i, b)) = tensors.iter().enumerate().find(|(_, b)| b.dtype != dtype) {
        return Err(PyTypeError::new_err(format!("tensors[{i}]: dtype {:?} differs from {dtype:?}", b.dtype)));
    }
    let c = &comm.comm;
    macro_rules! run {
        ($T:ty) => {{
            py.detach(|| -> oxcomm::Result<Vec<Vec<u8>>> {
                let groups = ranks_per_host.map(|k| host_groups::HostGroups::uniform(c, k)).transpose()?;
                let views = tensors
                    .iter()
                    .zip(&shapes)
                    // SAFETY: `$T` is every buffer's dtype (checked above); owners held by `tensors`.
                    .map(|(b, s)| qgz::TensorView::new(unsafe { b.slice::<$T>() }, s))
                    .collect::<oxcomm::Result<Vec<_>>>()?;
                let parts = qgz::all_to_all_quant_reduce(c, &views, groups.as_ref())?;
                Ok(parts.iter().map(|p| oxcomm::dtype::as_bytes(p).to_vec()).collect())
            })
        }};
    }
    let out = match dtype {
        oxcomm::DType::F32 => run!(f32),
        oxcomm::DType::F16 => run!(half::f16),
        oxcomm::DType::BF16 => run!(half::bf16),
        other => {
            return Err(PyTypeError::new_err(format!(
                "tensors: the quantized reduce-scatter takes float32/16/bfloat16, not {other:?}"
            )))
        }
    }
    .py()?;
    Ok(out.iter().map(|b| PyBytes::new(py, b)).collect())
}
