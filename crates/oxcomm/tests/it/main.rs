//! The one integration-test binary of the oxcomm crate; modules mirror the source tree.

mod collectives;
mod compression_kernels;
mod failures;
mod logging;
mod onebit;
mod reduce;
mod rendezvous;
mod shm;
