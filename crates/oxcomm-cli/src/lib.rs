//! The `oxcomm` command as a library: [`run`] parses a command line and dispatches to one
//! module per subcommand; each module owns its flags, its logic and its errors. The binary
//! (`src/main.rs`) and the Python package's `oxcomm` entry point (`oxcomm-py`, through
//! [`run_as`]) are both thin callers of it.
//!
//! Errors come back as an exit status with one line on stderr (`oxcomm: error: ...`): 2 for a
//! command line clap rejects, 1 for everything else. Nothing here ends the process; the caller
//! exits with the status.
//!
//! # Re-running itself
//!
//! `oxcomm bench` and `oxcomm check` start their ranks by running this command again with
//! other arguments. `self_command` is the one place that says how: the running executable,
//! or the prefix a caller such as the Python entry point (`python -m oxcomm`) gave [`run_as`].
//! It does not handle signals itself: `launch` installs its handlers while it runs, and the
//! caller decides what happens to signals before and after.

use std::ffi::OsString;
use std::io::Write;
use std::sync::OnceLock;

use anyhow::Context;
use clap::error::ErrorKind;
use clap::{Parser, Subcommand};

mod bench;
mod check;
mod launch;
mod plan;
mod plot;

/// Collective communication for Rust: launch jobs, benchmark and check collectives.
#[derive(Debug, Parser)]
#[command(name = "oxcomm", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start the ranks of a job on this node (like torchrun).
    Launch(launch::LaunchArgs),
    /// Time collectives over a range of sizes and print an nccl-tests style table.
    Bench(bench::BenchArgs),
    /// Run every collective on every transport with exact inputs and print a pass/fail table.
    Check(check::CheckArgs),
    /// Print each all-reduce algorithm's predicted time on a described cluster and the
    /// planner's choice (the library's cost model; runs nothing).
    Plan(plan::PlanArgs),
    /// Test helper: connect to the launcher's store from a rank and exchange a key.
    #[command(hide = true)]
    StorePing(launch::StorePingArgs),
}

/// The command line that runs this command again, set once by [`run_as`].
static SELF_COMMAND: OnceLock<Vec<OsString>> = OnceLock::new();

/// The program and leading arguments that run this command again (the subcommand and its
/// flags follow them): the prefix given to [`run_as`], else the running executable. Every
/// place that re-runs the command goes through here.
pub(crate) fn self_command() -> anyhow::Result<Vec<OsString>> {
    if let Some(prefix) = SELF_COMMAND.get() {
        return Ok(prefix.clone());
    }
    let exe = std::env::current_exe().context("cannot find the path of this executable")?;
    Ok(vec![exe.into_os_string()])
}

/// Runs the `oxcomm` command line `args` (the first item is the program name, as in
/// `std::env::args_os()`) and returns the status the process should exit with.
pub fn run<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(err) => match err.kind() {
            ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                let _ = err.print();
                return err.exit_code();
            }
            _ => {
                error_line(&one_line(&err));
                return 2;
            }
        },
    };
    let result = match cli.command {
        Command::Launch(args) => launch::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Check(args) => check::run(args),
        Command::Plan(args) => plan::run(args),
        Command::StorePing(args) => launch::store_ping(args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            error_line(&format!("{err:#}"));
            1
        }
    }
}

/// [`run`] for a caller that is not the `oxcomm` executable itself: `self_command` (e.g.
/// `[python, -m, oxcomm]`) is what starts this command again when a subcommand re-runs
/// itself. The first call in a process sets it; later calls keep the first.
pub fn run_as<I, T>(self_command: Vec<OsString>, args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    if !self_command.is_empty() {
        let _ = SELF_COMMAND.set(self_command);
    }
    run(args)
}

/// Writes `oxcomm: error: {msg}` as one line, in one write, so the line stays whole next to
/// other processes' output.
fn error_line(msg: &str) {
    let _ = std::io::stderr().write_all(format!("oxcomm: error: {msg}\n").as_bytes());
}

/// clap's message on one line: its text up to the usage section, lines joined, without the
/// leading `error: `.
fn one_line(err: &clap::Error) -> String {
    let text = err.render().to_string();
    let parts: Vec<&str> = text
        .lines()
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    parts.join(" ").trim_start_matches("error: ").to_string()
}
