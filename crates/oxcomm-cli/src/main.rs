//! The `oxcomm` command. This file only parses the command line and dispatches to one module
//! per subcommand; each module owns its flags, its logic and its errors. Errors end the process
//! with one line on stderr (`oxcomm: error: ...`) and exit status 1.

use std::io::Write;

use clap::{Parser, Subcommand};

mod launch;

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
    /// Test helper: connect to the launcher's store from a rank and exchange a key.
    #[command(hide = true)]
    StorePing(launch::StorePingArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Launch(args) => launch::run(args),
        Command::StorePing(args) => launch::store_ping(args),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(err) => {
            // One write, so the line stays whole next to other processes' output.
            let _ = std::io::stderr().write_all(format!("oxcomm: error: {err:#}\n").as_bytes());
            std::process::exit(1);
        }
    }
}
