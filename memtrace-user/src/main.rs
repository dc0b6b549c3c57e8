//! memtrace: trace the heap of Linux processes with eBPF and write Chrome trace-event JSON.

mod attach;
mod check;
mod cli;
mod collect;
mod diff;
mod doctor;
mod export;
mod follow;
mod interpreters;
mod kernel;
mod model;
mod plan;
mod privileges;
mod process;
mod serve;
mod session;
mod top;

use std::process::ExitCode;

use clap::{CommandFactory, Parser};

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
    let cli = cli::Cli::parse();
    let result = match cli.subcommand {
        Some(cli::Subcommand::Usdt(args)) => {
            attach::usdt::list::run(args.pid, args.path.as_deref()).map(|()| ExitCode::SUCCESS)
        }
        Some(cli::Subcommand::Report(args)) => report(args),
        Some(cli::Subcommand::Diff(args)) => {
            let outputs = diff::DiffOutputs {
                json: args.json.as_deref(),
                pprof: args.pprof.as_deref(),
                html: args.html.as_deref(),
            };
            let (new, base) = args.runs.split_last().expect("clap asks for two runs at least");
            diff::run(base, new, args.tolerance, &outputs)
        }
        Some(cli::Subcommand::Check(args)) => gate(args),
        Some(cli::Subcommand::VerifierReport) => verifier_report().map(|()| ExitCode::SUCCESS),
        Some(cli::Subcommand::Doctor) => doctor::run(),
        // `memtrace serve` is a tracing run with the agent as its output.
        Some(cli::Subcommand::Serve(args)) => {
            let (run, mode) = plan::resolve::serve(*args);
            trace(run, mode)
        }
        // `memtrace top` is a run watched live in the terminal.
        Some(cli::Subcommand::Top(run)) => trace(*run, plan::Mode::Top),
        None => trace(cli.run, plan::Mode::Trace),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("memtrace: error: {err:#}");
            ExitCode::from(1)
        }
    }
}

/// A tracing run: what cannot work is refused as a usage error before anything is traced; the
/// rest is resolved, with the kernel's features, into the plan the session runs.
fn trace(run: cli::RunArgs, mode: plan::Mode) -> anyhow::Result<ExitCode> {
    let checked =
        run.check_kernel_limits().and_then(|()| export::output_file::check_distinct(&run.output_files()));
    refuse_usage(checked, cli::Cli::command());
    let plan = plan::resolve::plan(run, mode, kernel::features::KernelFeatures::probe())?;
    session::run(plan)
}

/// `memtrace check`: the run to check, traced first where a command is given (with memtrace's
/// defaults, its trace file and summary in a temporary directory unless `--save` keeps the
/// summary), then held to the budgets.
fn gate(args: cli::CheckArgs) -> anyhow::Result<ExitCode> {
    let scratch = tempfile::tempdir()?;
    let (summary, traced) = match &args.summary {
        Some(summary) => (summary.clone(), ExitCode::SUCCESS),
        None => {
            let summary = args.save.clone().unwrap_or_else(|| scratch.path().join("summary.json"));
            let mut line: Vec<std::ffi::OsString> =
                vec!["memtrace".into(), "--summary".into(), summary.clone().into()];
            line.extend(["-o".into(), scratch.path().join("trace.json").into_os_string(), "--".into()]);
            line.extend(args.command.iter().cloned());
            (summary, trace(cli::Cli::try_parse_from(line)?.run, plan::Mode::Trace)?)
        }
    };
    let gate = check::Gate {
        budgets: &args.budgets,
        summary: &summary,
        junit: args.junit.as_deref(),
        github: args.github,
        top: args.top,
    };
    let verdict = check::run(&gate);
    // A run that failed is no measure of the program: the gate fails with it.
    if traced != ExitCode::SUCCESS && verdict == ExitCode::SUCCESS {
        eprintln!(
            "memtrace check: the traced command failed, so the gate fails though its memory is within budget"
        );
        return Ok(traced);
    }
    Ok(verdict)
}

/// `memtrace report`: the reports again from a saved run, none of them over another or the summary.
fn report(args: cli::ReportArgs) -> anyhow::Result<ExitCode> {
    refuse_usage(export::output_file::check_distinct(&args.files()), cli::ReportArgs::command());
    export::saved::report(&args.summary, &plan::resolve::report_files(args.reports), args.top)
}

/// Exits with clap's usage error (status 2) if `checked` found a problem.
fn refuse_usage(checked: Result<(), String>, mut usage: clap::Command) {
    if let Err(problem) = checked {
        usage.error(clap::error::ErrorKind::ArgumentConflict, problem).exit();
    }
}

/// `memtrace verifier-report`: the programs loaded as a run loads them, then each again with the
/// verifier's statistics.
fn verifier_report() -> anyhow::Result<()> {
    let config = kernel::ProbeConfig {
        max_allocations: memtrace_common::DEFAULT_MAX_LIVE_ALLOCATIONS,
        max_stacks: memtrace_common::MAX_STACKS,
        capture_stacks: true,
        ..kernel::ProbeConfig::default()
    };
    let kernel = plan::Kernel::resolve(kernel::features::KernelFeatures::probe(), &config.reach)?;
    let probes = kernel::Probes::load(&config, &kernel.layout()?, kernel.link_kind)?;
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
