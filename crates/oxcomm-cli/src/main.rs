//! The `oxcomm` command. This file only parses the command line and dispatches to one module
//! per subcommand; each module owns its flags, its logic and its errors. Errors end the process
//! with one line on stderr (`oxcomm: error: ...`): exit status 2 for a command line clap
//! rejects, 1 for everything else.

use std::io::Write;

use clap::error::ErrorKind;
use clap::{Parser, Subcommand};

mod bench;
mod check;
mod launch;
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
    /// Test helper: connect to the launcher's store from a rank and exchange a key.
    #[command(hide = true)]
    StorePing(launch::StorePingArgs),
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

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => match err.kind() {
            ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => err.exit(),
            _ => {
                error_line(&one_line(&err));
                std::process::exit(2);
            }
        },
    };
    let result = match cli.command {
        Command::Launch(args) => launch::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Check(args) => check::run(args),
        Command::StorePing(args) => launch::store_ping(args),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(err) => {
            error_line(&format!("{err:#}"));
            std::process::exit(1);
        }
    }
}
