//! The one integration-test binary of oxcomm; one module per library module.

mod shm;
