//! The one integration-test binary of the oxcomm crate; modules mirror the source tree.

mod any_source;
mod collectives;
mod comm_logging;
mod compression_kernels;
mod dtypes;
mod failures;
mod faults;
mod ft;
mod fuzz;
mod harness;
#[cfg(unix)]
mod hostile;
#[cfg(target_os = "linux")]
mod init_failure;
mod layers;
mod logging;
mod multiproc;
mod objects;
mod onebit;
mod p2p_batches;
mod quant_collectives;
mod reduce;
mod rendezvous;
mod shm;
#[cfg(unix)]
mod tcp;
mod unwind;
