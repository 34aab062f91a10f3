//! The `oxcomm` executable: everything is in the library ([`oxcomm_cli::run`]); this only
//! exits with the status it returns.

fn main() {
    std::process::exit(oxcomm_cli::run(std::env::args_os()));
}
