//! Communicators over MPI (cargo feature `mpi`): `OXCOMM_BACKEND=mpi`, or [`init`] directly.
//!
//! This is the entry point; how each op maps onto MPI, the fingerprint check, deadlines,
//! threads and byte counts are documented with the backend, [`crate::backend::mpi`].

use crate::backend::AnyBackend;
use crate::comm::{CommConfig, Communicator};
use crate::error::Result;

pub use crate::backend::mpi::ENV_MPI_CHECK;

/// Starts a world communicator over MPI with the default [`CommConfig`]. Run the program
/// with `mpirun -n N` or `srun -n N`; see [`crate::backend::mpi`].
///
/// ```no_run
/// let comm = oxcomm::mpi::init()?;
/// let mut grads = vec![1.0f32; 1024];
/// comm.all_reduce(&mut grads, oxcomm::ReduceOp::Avg)?;
/// # Ok::<(), oxcomm::Error>(())
/// ```
pub fn init() -> Result<Communicator> {
    init_with(CommConfig::default())
}

/// [`init`] with explicit settings (only `timeout` matters: it bounds waiting for earlier
/// async ops and [`Communicator::monitored_barrier`]; MPI picks its own algorithms and
/// segments).
pub fn init_with(config: CommConfig) -> Result<Communicator> {
    let (rank, size, backend) = crate::backend::mpi::start()?;
    Ok(Communicator::from_backend(rank, size, AnyBackend::Mpi(backend), config))
}
