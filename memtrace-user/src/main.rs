//! memtrace: trace the heap of Linux processes with eBPF and write Chrome trace-event JSON.

mod allocator;
mod cli;
mod collector;
mod export;
mod model;
mod privileges;
mod probes;
mod procfs;
mod session;
mod target;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // clap exits with status 2 on usage errors.
    let cli = cli::Cli::parse();
    match session::run(cli) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("memtrace: error: {err:#}");
            ExitCode::from(1)
        }
    }
}
