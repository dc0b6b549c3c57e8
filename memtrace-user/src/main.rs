//! memtrace: trace the heap of Linux processes with eBPF and write Chrome trace-event JSON.

mod bpf_log;
mod bpf_sys;
mod cli;
mod collector;
mod doctor;
mod elf;
mod export;
mod following;
mod held_execs;
mod kernel_features;
mod model;
mod peaks;
mod privileges;
mod probes;
mod process;
mod procfs;
mod serve;
mod session;
mod skipped_exits;
mod stack_table;
mod symbolize;
mod target;
mod threads;
mod top;
mod unwind;
mod usdt;

use std::process::ExitCode;

use clap::{CommandFactory, Parser};
// Allocator discovery reads a process image; it keeps its short path.
use process::allocator;

/// Following a tree or every process, memtrace probes libc's malloc for every process, itself
/// included: a trap into the kernel per call, filtered out there, would slow memtrace's own work
/// (symbolizing a run's stacks makes millions of allocations). Its own allocator is linked in,
/// where no probe is.
#[global_allocator]
static OWN_ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in mimalloc.h (v2 and v3): how long freed pages are kept before they
/// go back to the kernel (10 ms by default).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

fn main() -> ExitCode {
    // memtrace frees large transient buffers (unwind rows, symbol tables, map dumps); giving them
    // back at once keeps its resident memory about a third lower (`--all` under a compile load,
    // measured here: peak 139 -> 107 MB).
    // SAFETY: sets an option of the linked mimalloc, which has no precondition.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
    // clap exits with status 2 on usage errors.
    let mut cli = cli::Cli::parse();
    // `memtrace serve` is a tracing run with the agent as its output.
    let serve = match cli.subcommand.take() {
        Some(cli::Subcommand::Serve(args)) => {
            let (run, options) = args.into_parts();
            cli.run = run;
            Some(options)
        }
        // `memtrace top` is a run watched live in the terminal.
        Some(cli::Subcommand::Top(args)) => {
            cli.run = *args;
            cli.live_view = true;
            None
        }
        other => {
            cli.subcommand = other;
            None
        }
    };
    // What cannot work is refused before anything is traced, as a usage error.
    let (files, mut usage) = match &cli.subcommand {
        Some(cli::Subcommand::Report(args)) => (args.files(), cli::ReportArgs::command()),
        _ => (cli.output_files(), cli::Cli::command()),
    };
    let checked = cli.check_kernel_limits().and_then(|()| export::output_file::check_distinct(&files));
    if let Err(problem) = checked {
        usage.error(clap::error::ErrorKind::ArgumentConflict, problem).exit();
    }
    let result = match &cli.subcommand {
        Some(cli::Subcommand::Usdt(args)) => {
            usdt::list::run(args.pid, args.path.as_deref()).map(|()| ExitCode::SUCCESS)
        }
        Some(cli::Subcommand::Report(args)) => export::saved::report(args),
        Some(cli::Subcommand::VerifierReport) => verifier_report().map(|()| ExitCode::SUCCESS),
        Some(cli::Subcommand::Doctor) => doctor::run(),
        Some(cli::Subcommand::Serve(_) | cli::Subcommand::Top(_)) | None => session::run(cli, serve.as_ref()),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("memtrace: error: {err:#}");
            ExitCode::from(1)
        }
    }
}

/// `memtrace verifier-report`: the programs loaded as a run loads them, then each again with the
/// verifier's statistics.
fn verifier_report() -> anyhow::Result<()> {
    let probes = probes::Probes::load(
        &probes::ProbeConfig {
            max_allocations: memtrace_common::DEFAULT_MAX_LIVE_ALLOCATIONS,
            max_stacks: memtrace_common::MAX_STACKS,
            capture_stacks: true,
            ..probes::ProbeConfig::default()
        },
        &kernel_features::KernelFeatures::probe(),
    )?;
    let report = probes.verifier_report()?;
    let problems: Vec<String> = report.iter().filter_map(|program| program.problem()).collect();
    for program in &report {
        println!("{}", serde_json::to_string(program)?);
    }
    if !problems.is_empty() {
        anyhow::bail!("the BPF programs break the stack rules:\n{}", problems.join("\n"));
    }
    Ok(())
}
