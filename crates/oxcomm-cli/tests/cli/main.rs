//! Integration tests of the `oxcomm` binary: one module per subcommand, `netns` for jobs
//! across hosts (network namespaces), and `mpi` for the bench on the MPI backend.

mod bench;
mod check;
mod launch;
mod mpi;
mod netns;
