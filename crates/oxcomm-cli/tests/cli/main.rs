//! Integration tests of the `oxcomm` binary: one module per subcommand, `netns` for jobs
//! across hosts (network namespaces), and `mpi` for the bench on the MPI backend.

mod bench;
mod check;
mod launch;
mod mpi;
mod netns;
mod plan;

/// The process harness of the library's integration tests: the `oxcomm` binary started with a
/// deadline, its output read as it comes, and its whole process tree killed on drop.
#[path = "../../../oxcomm/tests/it/harness.rs"]
mod harness;
