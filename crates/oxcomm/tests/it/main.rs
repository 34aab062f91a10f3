//! The one integration-test binary of the oxcomm crate; modules mirror the source tree.

mod collectives;
mod failures;
mod logging;
mod rendezvous;
//! The one integration-test binary of oxcomm: one module per library module.

mod reduce;
mod compression_kernels;
//! The one integration-test binary of oxcomm; one module per library module.

mod shm;
