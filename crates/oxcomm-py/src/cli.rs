//! `_native.cli_main`: the `oxcomm` command (launch, bench, check) run inside the Python
//! interpreter, for the package's `oxcomm` script and `python -m oxcomm` (`oxcomm/_cli.py`).
//! The command itself is `oxcomm-cli`'s; this only hands it the arguments and the command line
//! that starts it again (`[sys.executable, "-m", "oxcomm"]`), with the GIL released.

use std::ffi::OsString;

use pyo3::prelude::*;

/// Runs the `oxcomm` command line `argv` (`argv[0]` is the program name) and returns its exit
/// status. `self_command` is the program and arguments that run the command again, which
/// `bench` and `check` use to start their ranks. The GIL is released while it runs; signals
/// are the caller's to arrange (the command's `launch` installs its own handlers).
#[pyfunction]
pub fn cli_main(py: Python<'_>, argv: Vec<OsString>, self_command: Vec<OsString>) -> i32 {
    py.detach(|| oxcomm_cli::run_as(self_command, argv))
}
