//! The command line: what to trace, for how long, and where the results go.

mod run;
mod subcommands;
mod values;

use clap::Parser;

pub use run::{ReportOutputs, RunArgs};
pub use subcommands::{CheckArgs, DiffArgs, ReportArgs, ServeArgs, UsdtListArgs};
pub use values::*;

#[derive(Debug, Parser)]
#[command(
    name = "memtrace",
    version,
    about = "Trace the heap of Linux processes with eBPF and write a Chrome trace (Perfetto UI, chrome://tracing)",
    // `memtrace usdt ...` needs no target, and the tracing options mean nothing to it.
    subcommand_negates_reqs = true,
    args_conflicts_with_subcommands = true,
    after_help = "Examples:\n  sudo memtrace --pid 4242\n  sudo memtrace -o run.json --summary run-summary.json -- ./server --port 8080"
)]
pub struct Cli {
    #[command(flatten)]
    pub run: RunArgs,

    #[command(subcommand)]
    pub subcommand: Option<Subcommand>,
}

#[derive(Debug, clap::Subcommand)]
pub enum Subcommand {
    /// List the USDT probes of a running process or of a file, with their argument specs
    Usdt(UsdtListArgs),
    /// Run as an agent: trace until SIGINT/SIGTERM and serve Prometheus metrics (/metrics) and
    /// the live heap profile (/debug/pprof/heap) over HTTP; takes the options of a run
    #[command(mut_arg("output", |arg| arg.help("Also write a trace file (Chrome trace-event JSON) here")))]
    Serve(Box<ServeArgs>),
    /// Make the reports again from a saved run (the summary file of `--summary PATH`), without
    /// tracing: HTML, pprof, flamegraph, Perfetto, or the text report when no output is named
    Report(ReportArgs),
    /// Compare two saved runs (summaries of `--summary`) by call stack and by function, what grew
    /// most first: allocated, allocations, peak, live, leaked and temporaries
    #[command(after_help = "Examples:\n  memtrace diff base.json new.json --json diff.json\n  \
                            memtrace diff base.json new.json --html diff.html --pprof diff.pb.gz")]
    Diff(DiffArgs),
    /// Hold a run to the memory budgets of a TOML file (peak, allocated, allocations, leaked,
    /// temporaries; absolute, or relative to a committed baseline run): trace COMMAND, or read a
    /// saved summary. Exits 0 within every budget, 1 on a breach (naming the stacks responsible),
    /// 2 on bad input
    #[command(
        after_help = "Examples:\n  sudo memtrace check --budgets memtrace.toml -- ./app --self-test\n  \
                            memtrace check --budgets memtrace.toml run.json --junit memory.xml --github\n\n\
                            A budget file:\n  [[budget]]\n  command = \"app\"            # a comm, or a glob\n  \
                            modules = [\"app\", \"libapp*.so\"]  # only stacks through these (optional)\n  \
                            peak_live_bytes = 67108864\n  leaked_bytes = 0\n  baseline = \"ci/app.json\"   \
                            # relative to this file\n  tolerance = \"5%\""
    )]
    Check(CheckArgs),
    /// Watch the traced processes live in the terminal, by live heap, growth, RSS or dark memory,
    /// with a process's call stacks and subsystems on Enter; takes the options of a run
    #[command(mut_arg("output", |arg| arg.help("Also write a trace file (Chrome trace-event JSON) here")))]
    #[command(after_help = "Keys: h/g/r/d sort by live heap, growth, RSS, dark memory; Up/Down select; \
                            Enter a process's stacks and subsystems, Esc back; q quit (as Ctrl-C ends a \
                            run)\n\nExamples:\n  sudo memtrace top --all\n  sudo memtrace top \
                            --summary run.json -- ./server --port 8080")]
    Top(Box<RunArgs>),
    /// Load every BPF program with the verifier's statistics and print the stack each one uses,
    /// one JSON line a program; exit 1 if one breaks the stack rules (memtrace-ebpf's
    /// kernel_stack.rs). For memtrace's own tests.
    #[command(hide = true)]
    VerifierReport,
    /// Say whether tracing can work on this machine: the kernel, each kernel feature memtrace uses
    /// (found or missing), the attach path and unwinder, the privileges held, and whether the
    /// kernel accepts memtrace's BPF programs (loaded, then unloaded); exits 1 when it cannot
    #[command(after_help = "Example:\n  sudo memtrace doctor")]
    Doctor,
}

#[cfg(test)]
mod tests;
