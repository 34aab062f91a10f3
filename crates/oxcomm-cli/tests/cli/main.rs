//! Integration tests of the `oxcomm` binary: one module per subcommand, and `netns` for jobs
//! across hosts (network namespaces).

mod bench;
mod check;
mod launch;
mod netns;
