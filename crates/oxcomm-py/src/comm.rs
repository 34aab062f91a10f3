//! `oxcomm.Communicator` over [`oxcomm::Communicator`]: every collective, point-to-point,
//! barriers, groups, coalesced and object collectives, on caller buffers ([`Buf`]).
//!
//! Sync ops run on the calling thread with the GIL released. `async_op=True` ops run through
//! [`oxcomm::Communicator::run_async`] on the communicator's worker, in issue order with every
//! other op of this rank, and return a [`PyWork`] that holds the buffers until the op is done.
//!
//! One file because it is one class: PyO3 (without its `multiple-pymethods` feature, which
//! needs `inventory` and a link-time registry) takes one `#[pymethods]` block per class, and
//! every method here is a thin argument check around one [`oxcomm::Communicator`] call. Names
//! (dtypes, reduce ops, transports) are read by the library's parsers, never matched here.

use std::sync::Arc;
use std::time::Duration;

use oxcomm::rendezvous::env::{OXCOMM_SOCKET_ADDR, OXCOMM_SOCKET_IFNAME};
use oxcomm::rendezvous::{Store, TransportChoice};
use oxcomm::{Communicator, ReduceOp};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::buffer::Buf;
use crate::errors::IntoPy;
use crate::store::PyStore;
use crate::with_elem;
use crate::work::{PyWork, RecvAnyInto, RecvInto};

/// A reduce op by name (`"sum"`, `"avg"`, … as `oxcomm.ReduceOp` passes them; the library's
/// parser).
pub fn parse_op(name: &str) -> PyResult<ReduceOp> {
    ReduceOp::parse(name)
        .ok_or_else(|| PyValueError::new_err(format!("op: unknown reduce op {:?}", name.to_ascii_lowercase())))
}

/// Checks that every buffer of an op has `dtype`, naming the argument that differs.
fn same_dtype(first: &Buf, others: &[(&str, &Buf)]) -> PyResult<()> {
    for (name, b) in others {
        if b.dtype != first.dtype {
            return Err(PyTypeError::new_err(format!("{name}: dtype {:?} differs from {:?}", b.dtype, first.dtype)));
        }
    }
    Ok(())
}

/// Store keys where `from_store`'s rank 0 publishes the job's secret and id, for the other
/// ranks and for newcomers (`join_from_store`: they must meet under the members' job id).
const TOKEN_KEY: &str = "oxcomm/py/token";
const JOB_KEY: &str = "oxcomm/py/job";

/// The checked arguments `from_store` and `join_from_store` share: the store's address (for
/// the TCP interface), the transport and the timeout.
fn store_settings(
    timeout: f64,
    transport: Option<String>,
    master_addr: Option<String>,
) -> PyResult<(std::net::SocketAddr, TransportChoice, Duration)> {
    if !(timeout.is_finite() && timeout > 0.0) {
        return Err(PyValueError::new_err(format!("timeout: {timeout} is not a positive number of seconds")));
    }
    let transport = match transport.as_deref() {
        None => TransportChoice::Auto,
        Some(name) => TransportChoice::parse(name).ok_or_else(|| {
            PyValueError::new_err(format!("transport: {:?} is not auto, shm or tcp", name.to_ascii_lowercase()))
        })?,
    };
    let addr = master_addr.unwrap_or_else(|| "127.0.0.1".to_string());
    let store_addr = std::net::ToSocketAddrs::to_socket_addrs(&(addr.as_str(), 0))
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| PyValueError::new_err(format!("master_addr: cannot resolve {addr:?}")))?;
    Ok((store_addr, transport, Duration::from_secs_f64(timeout)))
}

/// A newcomer's wait for the members' job keys that ran out: no job met at this store.
fn no_members(e: oxcomm::Error, timeout: Duration) -> oxcomm::Error {
    if e.kind() != oxcomm::ErrorKind::Timeout {
        return e;
    }
    oxcomm::Error::new(
        oxcomm::ErrorKind::Timeout,
        format!(
            "join: no job met at this store within {timeout:?} (the members call Communicator.from_store \
             on the same store, then grow): {}",
            e.message()
        ),
    )
}

/// The settings of a rank that meets through a Python store (the store serves itself; host
/// and interface from the environment, as `oxcomm.init()` reads them).
#[allow(clippy::too_many_arguments)]
fn store_init(
    rank: usize,
    world_size: usize,
    store_addr: std::net::SocketAddr,
    token: Vec<u8>,
    job: String,
    transport: TransportChoice,
    timeout: Duration,
    pin_to_core: bool,
) -> oxcomm::Init {
    oxcomm::Init {
        rank,
        world_size,
        store_addr,
        store_served: true,
        token,
        job,
        transport,
        config: oxcomm::CommConfig { timeout, ..Default::default() },
        host_id: std::env::var(oxcomm::init::ENV_HOST_ID).ok(),
        socket_ifname: std::env::var(OXCOMM_SOCKET_IFNAME).ok(),
        socket_addr: std::env::var(OXCOMM_SOCKET_ADDR).ok().and_then(|a| a.parse().ok()),
        pin_to_core,
    }
}

/// One rank's handle on a group of ranks.
#[pyclass(module = "oxcomm._native", name = "Communicator")]
pub struct PyComm {
    pub comm: Communicator,
}

impl std::fmt::Debug for PyComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PyComm").field("comm", &self.comm).finish()
    }
}

impl PyComm {
    /// Runs `f` now (GIL released) or, with `async_op`, on the worker behind a [`PyWork`].
    fn launch(
        &self,
        py: Python<'_>,
        async_op: bool,
        f: impl FnOnce(&Communicator) -> oxcomm::Result<()> + Send + 'static,
    ) -> PyResult<Option<PyWork>> {
        if async_op {
            let work = self.comm.run_async(f);
            return Ok(Some(PyWork::new(Box::new(work), self.comm.clone())));
        }
        let comm = &self.comm;
        crate::interrupt::run(py, comm, || f(comm))?;
        Ok(None)
    }
}

#[pymethods]
impl PyComm {
    /// Joins a job through a Python key-value store (a `torch.distributed.Store`): rank 0
    /// makes the job's secret and id and publishes them there, every rank meets the others
    /// through it and builds shared-memory links to the ranks on its host and TCP links to
    /// the others. Nothing pins the calling thread unless `pin_to_core`.
    #[staticmethod]
    #[pyo3(signature = (store, rank, world_size, *, timeout = 300.0, transport = None, master_addr = None, pin_to_core = false))]
    #[allow(clippy::too_many_arguments)]
    fn from_store(
        py: Python<'_>,
        store: Py<PyAny>,
        rank: usize,
        world_size: usize,
        timeout: f64,
        transport: Option<String>,
        master_addr: Option<String>,
        pin_to_core: bool,
    ) -> PyResult<PyComm> {
        if rank >= world_size {
            return Err(PyValueError::new_err(format!("rank: {rank} out of range for world_size {world_size}")));
        }
        let (store_addr, transport, timeout) = store_settings(timeout, transport, master_addr)?;
        let store: Arc<dyn Store> = Arc::new(PyStore::new(store));
        let comm = py
            .detach(move || -> oxcomm::Result<Communicator> {
                let deadline = std::time::Instant::now() + timeout;
                let (token, job) = if rank == 0 {
                    let token = oxcomm::rendezvous::generate_token();
                    let job = format!("py{}", &oxcomm::rendezvous::generate_token()[..16]);
                    store.set(TOKEN_KEY, token.as_bytes())?;
                    store.set(JOB_KEY, job.as_bytes())?;
                    (token.into_bytes(), job)
                } else {
                    let token = store.get(TOKEN_KEY, deadline)?;
                    let job = String::from_utf8_lossy(&store.get(JOB_KEY, deadline)?).into_owned();
                    (token, job)
                };
                let init = store_init(rank, world_size, store_addr, token, job, transport, timeout, pin_to_core);
                let comm = init.connect_with_store(store)?;
                // Nobody leaves set-up until every rank is in (the store may go away after).
                comm.barrier()?;
                Ok(comm)
            })
            .py()?;
        Ok(PyComm { comm })
    }

    /// Joins a running job as a newcomer, through the store its ranks met at with
    /// `from_store`: reads the job's secret and id there, waits (at most `timeout` in all)
    /// for the members to call `grow`, takes the first free rank after theirs and meets
    /// them. The returned communicator is the grown one (its `rank` and `size` say where this
    /// process stands); its ops' deadline is `timeout`.
    #[staticmethod]
    #[pyo3(signature = (store, *, timeout = 300.0, transport = None, master_addr = None, pin_to_core = false))]
    fn join_from_store(
        py: Python<'_>,
        store: Py<PyAny>,
        timeout: f64,
        transport: Option<String>,
        master_addr: Option<String>,
        pin_to_core: bool,
    ) -> PyResult<PyComm> {
        let (store_addr, transport, timeout) = store_settings(timeout, transport, master_addr)?;
        let store: Arc<dyn Store> = Arc::new(PyStore::new(store));
        let comm = py
            .detach(move || -> oxcomm::Result<Communicator> {
                let start = std::time::Instant::now();
                let deadline = start + timeout;
                let token = store.get(TOKEN_KEY, deadline).map_err(|e| no_members(e, timeout))?;
                let job = String::from_utf8_lossy(&store.get(JOB_KEY, deadline).map_err(|e| no_members(e, timeout))?)
                    .into_owned();
                // What is left of `timeout` bounds the join; the grown communicator's ops get
                // the whole of it (the members' grow gives theirs their own timeout).
                let left = deadline.saturating_duration_since(std::time::Instant::now()).max(Duration::from_millis(1));
                let init = store_init(0, 1, store_addr, token, job, transport, left, pin_to_core);
                let comm = init.join_with_store(store)?;
                comm.set_timeout(timeout);
                Ok(comm)
            })
            .py()?;
        Ok(PyComm { comm })
    }

    /// This rank within the group.
    #[getter]
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Number of ranks in the group.
    #[getter]
    fn size(&self) -> usize {
        self.comm.size()
    }

    /// This rank in the world.
    #[getter]
    fn world_rank(&self) -> usize {
        self.comm.world_rank()
    }

    /// Number of ranks in the world.
    #[getter]
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// `"threads"`, `"shm"`, `"tcp"`, `"shm+tcp"` or `"mpi"`.
    #[getter]
    fn transport(&self) -> String {
        self.comm.transport().to_string()
    }

    /// World rank of every group rank.
    #[getter]
    fn members(&self) -> Vec<usize> {
        self.comm.members().to_vec()
    }

    /// Sum over the group of every rank's `factor × buf` (torch's `PREMUL_SUM`), in place. A
    /// factor with a fraction on an integer buffer, or any on a bool one, is a `ValueError`,
    /// not a truncated product.
    #[pyo3(signature = (buf, factor, async_op = false))]
    fn all_reduce_premul_sum(&self, py: Python<'_>, buf: Buf, factor: f64, async_op: bool) -> PyResult<Option<PyWork>> {
        let exact = buf.dtype.is_float() || buf.dtype.is_complex() || factor.fract() == 0.0;
        let exact = exact && buf.dtype != oxcomm::DType::Bool;
        if !exact || !factor.is_finite() {
            return Err(PyValueError::new_err(format!(
                "all_reduce_premul_sum: factor {factor} does not scale a {} buffer exactly",
                buf.dtype
            )));
        }
        self.launch(py, async_op, move |c| {
            with_elem!(buf.dtype, T => {
                let factor = <T as oxcomm::Element>::from_f64(factor);
                // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!`) and its
                // owner lives as long as the slice (see `Buf::slice`).
                c.all_reduce_premul_sum(unsafe { buf.slice_mut::<T>() }, factor)
            })
        })
    }

    #[pyo3(signature = (buf, op, async_op = false))]
    fn all_reduce(&self, py: Python<'_>, buf: Buf, op: &str, async_op: bool) -> PyResult<Option<PyWork>> {
        let op = parse_op(op)?;
        // SAFETY (all `slice`/`slice_mut` below): `T` is the buffer's own dtype, chosen by
        // `with_elem!`, and the buffer (with its owner) lives in the closure.
        self.launch(
            py,
            async_op,
            // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!` or checked above) and its owner
            // lives as long as the slice (see `Buf::slice`).
            move |c| with_elem!(buf.dtype, T => c.all_reduce(unsafe { buf.slice_mut::<T>() }, op)),
        )
    }

    /// The blocking all-reduce of one host buffer, by address and indices instead of a
    /// buffer tuple and names: the torch backend's small-op path (`torch.distributed.all_reduce`
    /// of a contiguous CPU tensor), where making and parsing the tuple and its strings were a
    /// third of the binding's cost (`docs/perf_torch_path.md`). `dtype` indexes the module's
    /// `DTYPES` and `op` its `REDUCE_OPS` (the library's orders); the caller checked the buffer
    /// as `oxcomm/_buffers.py` does and holds it until the call returns. The op itself is
    /// `all_reduce`'s: same checks, same errors, the GIL released while it runs.
    #[pyo3(signature = (addr, count, dtype, op))]
    fn all_reduce_at(&self, py: Python<'_>, addr: usize, count: usize, dtype: usize, op: usize) -> PyResult<()> {
        let buf = Buf::borrowed(addr, count, dtype)?;
        let op = *ReduceOp::ALL
            .get(op)
            .ok_or_else(|| PyValueError::new_err(format!("op: index {op} is not one of oxcomm's reduce ops")))?;
        let comm = &self.comm;
        let run = || {
            // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!`); its Python owner
            // is held by the caller for this blocking call (see `Buf::borrowed`).
            with_elem!(buf.dtype, T => comm.all_reduce(unsafe { buf.slice_mut::<T>() }, op))
        };
        crate::interrupt::run(py, comm, run)
    }

    #[pyo3(signature = (input, output, op, async_op = false))]
    fn all_reduce_into(
        &self,
        py: Python<'_>,
        input: Buf,
        output: Buf,
        op: &str,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        let op = parse_op(op)?;
        same_dtype(&input, &[("output", &output)])?;
        self.launch(py, async_op, move |c| {
            // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!` or checked above) and its owner
            // lives as long as the slice (see `Buf::slice`).
            with_elem!(input.dtype, T => c.all_reduce_into(unsafe { input.slice::<T>() }, unsafe { output.slice_mut::<T>() }, op))
        })
    }

    #[pyo3(signature = (buf, root, op, async_op = false))]
    fn reduce(&self, py: Python<'_>, buf: Buf, root: usize, op: &str, async_op: bool) -> PyResult<Option<PyWork>> {
        let op = parse_op(op)?;
        self.launch(
            py,
            async_op,
            // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!` or checked above) and its owner
            // lives as long as the slice (see `Buf::slice`).
            move |c| with_elem!(buf.dtype, T => c.reduce(unsafe { buf.slice_mut::<T>() }, root, op)),
        )
    }

    #[pyo3(signature = (buf, root, async_op = false))]
    fn broadcast(&self, py: Python<'_>, buf: Buf, root: usize, async_op: bool) -> PyResult<Option<PyWork>> {
        self.launch(
            py,
            async_op,
            // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!` or checked above) and its owner
            // lives as long as the slice (see `Buf::slice`).
            move |c| with_elem!(buf.dtype, T => c.broadcast(unsafe { buf.slice_mut::<T>() }, root)),
        )
    }

    #[pyo3(signature = (input, output, async_op = false))]
    fn all_gather(&self, py: Python<'_>, input: Buf, output: Buf, async_op: bool) -> PyResult<Option<PyWork>> {
        same_dtype(&input, &[("output", &output)])?;
        self.launch(py, async_op, move |c| {
            // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!` or checked above) and its owner
            // lives as long as the slice (see `Buf::slice`).
            with_elem!(input.dtype, T => c.all_gather(unsafe { input.slice::<T>() }, unsafe { output.slice_mut::<T>() }))
        })
    }

    #[pyo3(signature = (input, output, op, async_op = false))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        input: Buf,
        output: Buf,
        op: &str,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        let op = parse_op(op)?;
        same_dtype(&input, &[("output", &output)])?;
        self.launch(py, async_op, move |c| {
            // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!` or checked above) and its owner
            // lives as long as the slice (see `Buf::slice`).
            with_elem!(input.dtype, T => c.reduce_scatter(unsafe { input.slice::<T>() }, unsafe { output.slice_mut::<T>() }, op))
        })
    }

    #[pyo3(signature = (send, recv, async_op = false))]
    fn all_to_all(&self, py: Python<'_>, send: Buf, recv: Buf, async_op: bool) -> PyResult<Option<PyWork>> {
        same_dtype(&send, &[("recv", &recv)])?;
        self.launch(py, async_op, move |c| {
            // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!` or checked above) and its owner
            // lives as long as the slice (see `Buf::slice`).
            with_elem!(send.dtype, T => c.all_to_all(unsafe { send.slice::<T>() }, unsafe { recv.slice_mut::<T>() }))
        })
    }

    #[pyo3(signature = (send, send_counts, recv, recv_counts, async_op = false))]
    fn all_to_all_v(
        &self,
        py: Python<'_>,
        send: Buf,
        send_counts: Vec<usize>,
        recv: Buf,
        recv_counts: Vec<usize>,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        same_dtype(&send, &[("recv", &recv)])?;
        self.launch(py, async_op, move |c| {
            with_elem!(send.dtype, T => c.all_to_all_v(
                // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!` or checked above) and its owner
                // lives as long as the slice (see `Buf::slice`).
                unsafe { send.slice::<T>() }, &send_counts, unsafe { recv.slice_mut::<T>() }, &recv_counts))
        })
    }

    #[pyo3(signature = (input, output, root, async_op = false))]
    fn gather(
        &self,
        py: Python<'_>,
        input: Buf,
        output: Option<Buf>,
        root: usize,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        if let Some(o) = &output {
            same_dtype(&input, &[("output", o)])?;
        }
        self.launch(py, async_op, move |c| {
            with_elem!(input.dtype, T => c.gather(
                // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!` or checked above) and its owner
                // lives as long as the slice (see `Buf::slice`).
                unsafe { input.slice::<T>() }, output.as_ref().map(|o| unsafe { o.slice_mut::<T>() }), root))
        })
    }

    #[pyo3(signature = (input, output, root, async_op = false))]
    fn scatter(
        &self,
        py: Python<'_>,
        input: Option<Buf>,
        output: Buf,
        root: usize,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        if let Some(i) = &input {
            same_dtype(&output, &[("input", i)])?;
        }
        self.launch(py, async_op, move |c| {
            with_elem!(output.dtype, T => c.scatter(
                // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!` or checked above) and its owner
                // lives as long as the slice (see `Buf::slice`).
                input.as_ref().map(|i| unsafe { i.slice::<T>() }), unsafe { output.slice_mut::<T>() }, root))
        })
    }

    #[pyo3(signature = (input, output, root, op, async_op = false))]
    fn reduce_into(
        &self,
        py: Python<'_>,
        input: Buf,
        output: Option<Buf>,
        root: usize,
        op: &str,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        let op = parse_op(op)?;
        if let Some(o) = &output {
            same_dtype(&input, &[("output", o)])?;
        }
        self.launch(py, async_op, move |c| {
            with_elem!(input.dtype, T => c.reduce_into(
                // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!` or checked above) and its owner
                // lives as long as the slice (see `Buf::slice`).
                unsafe { input.slice::<T>() }, output.as_ref().map(|o| unsafe { o.slice_mut::<T>() }), root, op))
        })
    }

    #[pyo3(signature = (buf, async_op = false))]
    fn all_gather_in_place(&self, py: Python<'_>, buf: Buf, async_op: bool) -> PyResult<Option<PyWork>> {
        self.launch(
            py,
            async_op,
            // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!`) and its owner lives as
            // long as the slice (see `Buf::slice`).
            move |c| with_elem!(buf.dtype, T => c.all_gather_in_place(unsafe { buf.slice_mut::<T>() })),
        )
    }

    #[pyo3(signature = (buf, op, async_op = false))]
    fn reduce_scatter_in_place(&self, py: Python<'_>, buf: Buf, op: &str, async_op: bool) -> PyResult<Option<PyWork>> {
        let op = parse_op(op)?;
        self.launch(
            py,
            async_op,
            // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!`) and its owner lives as
            // long as the slice (see `Buf::slice`).
            move |c| with_elem!(buf.dtype, T => c.reduce_scatter_in_place(unsafe { buf.slice_mut::<T>() }, op)),
        )
    }

    #[pyo3(signature = (buf, async_op = false))]
    fn all_to_all_in_place(&self, py: Python<'_>, buf: Buf, async_op: bool) -> PyResult<Option<PyWork>> {
        self.launch(
            py,
            async_op,
            // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!`) and its owner lives as
            // long as the slice (see `Buf::slice`).
            move |c| with_elem!(buf.dtype, T => c.all_to_all_in_place(unsafe { buf.slice_mut::<T>() })),
        )
    }

    #[pyo3(signature = (buf, root, async_op = false))]
    fn gather_in_place(&self, py: Python<'_>, buf: Buf, root: usize, async_op: bool) -> PyResult<Option<PyWork>> {
        self.launch(
            py,
            async_op,
            // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!`) and its owner lives as
            // long as the slice (see `Buf::slice`).
            move |c| with_elem!(buf.dtype, T => c.gather_in_place(unsafe { buf.slice_mut::<T>() }, root)),
        )
    }

    #[pyo3(signature = (buf, root, async_op = false))]
    fn scatter_in_place(&self, py: Python<'_>, buf: Buf, root: usize, async_op: bool) -> PyResult<Option<PyWork>> {
        self.launch(
            py,
            async_op,
            // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!`) and its owner lives as
            // long as the slice (see `Buf::slice`).
            move |c| with_elem!(buf.dtype, T => c.scatter_in_place(unsafe { buf.slice_mut::<T>() }, root)),
        )
    }

    #[pyo3(signature = (buf, dst, tag = 0))]
    fn send(&self, py: Python<'_>, buf: Buf, dst: usize, tag: u32) -> PyResult<()> {
        let comm = &self.comm;
        // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!` or checked above) and its owner
        // lives as long as the slice (see `Buf::slice`).
        crate::interrupt::run(py, comm, || with_elem!(buf.dtype, T => comm.send(unsafe { buf.slice::<T>() }, dst, tag)))
    }

    /// Receives into `buf` from `src`, or from whichever rank sends first a message with
    /// `tag` when `src` is `None`; returns the sender's rank.
    #[pyo3(signature = (buf, src, tag = 0))]
    fn recv(&self, py: Python<'_>, buf: Buf, src: Option<usize>, tag: u32) -> PyResult<usize> {
        let comm = &self.comm;
        crate::interrupt::run(py, comm, || {
            with_elem!(buf.dtype, T => {
                // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!` or checked above) and its owner
                // lives as long as the slice (see `Buf::slice`).
                let dst = unsafe { buf.slice_mut::<T>() };
                match src {
                    Some(src) => comm.recv(dst, src, tag).map(|()| src),
                    None => comm.recv_any(dst, tag),
                }
            })
        })
    }

    /// Starts sending a copy of `buf` (pending sends and receives start together).
    #[pyo3(signature = (buf, dst, tag = 0))]
    fn isend(&self, buf: Buf, dst: usize, tag: u32) -> PyWork {
        with_elem!(buf.dtype, T => {
            // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!` or checked above) and its owner
            // lives as long as the slice (see `Buf::slice`).
            let work = self.comm.isend(unsafe { buf.slice::<T>() }.to_vec(), dst, tag);
            PyWork::new(Box::new(work), self.comm.clone())
        })
    }

    /// Starts receiving into `buf` (filled when the handle completes) from `src`, or from any
    /// rank when `src` is `None` (the handle's `source_rank()` then names the sender).
    #[pyo3(signature = (buf, src, tag = 0))]
    fn irecv(&self, buf: Buf, src: Option<usize>, tag: u32) -> PyWork {
        with_elem!(buf.dtype, T => match src {
            Some(src) => {
                let work = self.comm.irecv(vec![T::default(); buf.len()], src, tag);
                PyWork::new(Box::new(RecvInto::<T> { work, dst: buf }), self.comm.clone())
            }
            None => {
                let work = self.comm.irecv_any(vec![T::default(); buf.len()], tag);
                PyWork::new(Box::new(RecvAnyInto::<T> { work, dst: buf, source: None }), self.comm.clone())
            }
        })
    }

    #[pyo3(signature = (async_op = false))]
    fn barrier(&self, py: Python<'_>, async_op: bool) -> PyResult<Option<PyWork>> {
        self.launch(py, async_op, |c| c.barrier())
    }

    /// A barrier whose error lists every rank that did not arrive within `timeout` seconds.
    fn monitored_barrier(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(PyValueError::new_err(format!("timeout: {timeout} is not a positive number of seconds")));
        }
        let comm = &self.comm;
        crate::interrupt::run(py, comm, || comm.monitored_barrier(Duration::from_secs_f64(timeout)))
    }

    #[pyo3(signature = (bufs, op, async_op = false))]
    fn all_reduce_coalesced(
        &self,
        py: Python<'_>,
        bufs: Vec<Buf>,
        op: &str,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        let op = parse_op(op)?;
        let Some(first) = bufs.first() else { return self.launch(py, async_op, |_| Ok(())) };
        let named: Vec<(String, &Buf)> = bufs.iter().enumerate().map(|(i, b)| (format!("bufs[{i}]"), b)).collect();
        same_dtype(first, &named.iter().map(|(n, b)| (n.as_str(), *b)).collect::<Vec<_>>())?;
        for (i, a) in bufs.iter().enumerate() {
            if let Some(j) = bufs[i + 1..].iter().position(|b| a.overlaps(b)) {
                return Err(PyValueError::new_err(format!(
                    "bufs[{}]: shares memory with bufs[{i}]; each tensor of a coalesced all-reduce must be its own memory",
                    i + 1 + j
                )));
            }
        }
        self.launch(py, async_op, move |c| {
            with_elem!(bufs[0].dtype, T => {
                // SAFETY: `T` is every buffer's dtype (checked above), the buffers are
                // disjoint (checked above) and their owners live in the closure.
                let mut slices: Vec<&mut [T]> = bufs.iter().map(|b| unsafe { b.slice_mut::<T>() }).collect();
                c.all_reduce_coalesced(&mut slices, op)
            })
        })
    }

    #[pyo3(signature = (inputs, outputs, async_op = false))]
    fn all_gather_coalesced(
        &self,
        py: Python<'_>,
        inputs: Vec<Buf>,
        outputs: Vec<Buf>,
        async_op: bool,
    ) -> PyResult<Option<PyWork>> {
        if inputs.len() != outputs.len() {
            return Err(PyValueError::new_err(format!(
                "outputs: {} buffers for {} inputs",
                outputs.len(),
                inputs.len()
            )));
        }
        let Some(first) = inputs.first() else { return self.launch(py, async_op, |_| Ok(())) };
        let named: Vec<(String, &Buf)> = inputs
            .iter()
            .enumerate()
            .map(|(i, b)| (format!("inputs[{i}]"), b))
            .chain(outputs.iter().enumerate().map(|(i, b)| (format!("outputs[{i}]"), b)))
            .collect();
        same_dtype(first, &named.iter().map(|(n, b)| (n.as_str(), *b)).collect::<Vec<_>>())?;
        self.launch(py, async_op, move |c| {
            with_elem!(inputs[0].dtype, T => {
                // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!` or checked above) and its owner
                // lives as long as the slice (see `Buf::slice`).
                let ins: Vec<&[T]> = inputs.iter().map(|b| unsafe { b.slice::<T>() }).collect();
                // SAFETY: `T` is the buffer's own dtype (chosen by `with_elem!` or checked above) and its owner
                // lives as long as the slice (see `Buf::slice`).
                let mut outs: Vec<&mut [T]> = outputs.iter().map(|b| unsafe { b.slice_mut::<T>() }).collect();
                c.all_gather_coalesced(&ins, &mut outs)
            })
        })
    }

    /// A sub-group of the listed group ranks (collective: every rank calls it with the same
    /// list); `None` outside it.
    fn new_group(&self, py: Python<'_>, ranks: Vec<usize>) -> PyResult<Option<PyComm>> {
        let comm = &self.comm;
        Ok(crate::interrupt::run(py, comm, || comm.new_group(&ranks))?.map(|comm| PyComm { comm }))
    }

    /// A sub-group over this communicator's links that only its members call (the same list,
    /// groups of one list made in the same order on every member); `None` outside it.
    fn group(&self, ranks: Vec<usize>) -> PyResult<Option<PyComm>> {
        Ok(self.comm.members_group(&ranks).py()?.map(|comm| PyComm { comm }))
    }

    /// The deadline of this group's ops, in seconds.
    #[getter]
    fn timeout(&self) -> f64 {
        self.comm.timeout().as_secs_f64()
    }

    /// Sets the deadline of this group's ops (the world and other groups keep theirs).
    #[setter]
    fn set_timeout(&self, seconds: f64) -> PyResult<()> {
        if !(seconds.is_finite() && seconds > 0.0) {
            return Err(PyValueError::new_err(format!("timeout: {seconds} is not a positive number of seconds")));
        }
        self.comm.set_timeout(Duration::from_secs_f64(seconds));
        Ok(())
    }

    /// Splits by `color` (`None` joins no group), ordered by `key` then rank. Collective.
    fn split(&self, py: Python<'_>, color: Option<u32>, key: i64) -> PyResult<Option<PyComm>> {
        let comm = &self.comm;
        Ok(crate::interrupt::run(py, comm, || comm.split(color, key))?.map(|comm| PyComm { comm }))
    }

    /// The root's bytes on every rank (`data` is ignored elsewhere; `None` at the root fails
    /// every rank).
    fn broadcast_bytes<'py>(
        &self,
        py: Python<'py>,
        data: Option<Vec<u8>>,
        root: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let comm = &self.comm;
        let out = crate::interrupt::run(py, comm, || comm.broadcast_bytes(data, root))?;
        Ok(PyBytes::new(py, &out))
    }

    /// Every rank's bytes, in rank order.
    fn all_gather_bytes<'py>(&self, py: Python<'py>, data: Vec<u8>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let comm = &self.comm;
        let out = crate::interrupt::run(py, comm, || comm.all_gather_bytes(&data))?;
        Ok(out.iter().map(|b| PyBytes::new(py, b)).collect())
    }

    /// DeepSpeed's comms-logger table (every rank must call it with `show_straggler`).
    #[pyo3(signature = (show_straggler = false))]
    fn log_summary(&self, py: Python<'_>, show_straggler: bool) -> PyResult<String> {
        let comm = &self.comm;
        crate::interrupt::run(py, comm, || comm.log_summary(show_straggler))
    }

    /// This rank's last ops as JSON Lines (the flight recorder).
    fn flight_record(&self) -> String {
        self.comm.flight_record()
    }

    /// Aborts the communicator: its links close (peers notice) and later ops fail at once.
    fn abort(&self, reason: &str) {
        self.comm.abort(reason)
    }

    /// Revokes the communicator on every member: every pending and later op of it (and of
    /// the world and groups that share its links) fails at once, here and on every peer, with
    /// `RevokedError` naming this rank. `agree` and `shrink` still work.
    fn revoke(&self) -> PyResult<()> {
        self.comm.revoke().py()
    }

    /// Whether the communicator is revoked (by this rank, a peer, or a failure).
    fn is_revoked(&self) -> bool {
        self.comm.is_revoked()
    }

    /// The group ranks this rank knows have failed (ascending); the same on every survivor
    /// after `agree` or `shrink`.
    fn failed_ranks(&self) -> Vec<usize> {
        self.comm.failed_ranks()
    }

    /// Fault-tolerant agreement among the survivors: `(the AND of their flags, the failed
    /// ranks)`, the same on every member that returns. Collective over the world communicator.
    fn agree(&self, py: Python<'_>, flag: u64) -> PyResult<(u64, Vec<usize>)> {
        let comm = &self.comm;
        let agreed = crate::interrupt::run(py, comm, || comm.agree(flag))?;
        Ok((agreed.flag, agreed.failed))
    }

    /// A new communicator of the survivors, ranks renumbered in the old order, on the links
    /// the job already has. Collective over the survivors of the world communicator.
    fn shrink(&self, py: Python<'_>) -> PyResult<PyComm> {
        let comm = &self.comm;
        Ok(PyComm { comm: crate::interrupt::run(py, comm, || comm.shrink())? })
    }

    /// This world communicator grown back to `new_size` ranks: the members keep their ranks
    /// and `new_size - size` newcomers (`join_from_store`, or `oxcomm.join()` under
    /// `oxcomm launch --on-failure restart`) take the ranks after them. Collective over every
    /// member; waits at most the communicator's timeout for the newcomers (a `TimeoutError`
    /// naming the first missing rank in `peer`). The returned communicator has links of its
    /// own; this one stays usable.
    fn grow(&self, py: Python<'_>, new_size: usize) -> PyResult<PyComm> {
        let comm = &self.comm;
        Ok(PyComm { comm: crate::interrupt::run(py, comm, || comm.grow(new_size))? })
    }

    fn __repr__(&self) -> String {
        format!(
            "<oxcomm.Communicator rank {} of {} (world rank {} of {}) over {}>",
            self.comm.rank(),
            self.comm.size(),
            self.comm.world_rank(),
            self.comm.world_size(),
            self.comm.transport()
        )
    }
}
