//! Integration tests of the `oxcomm` binary: one module per subcommand.

mod bench;
mod check;
mod launch;
