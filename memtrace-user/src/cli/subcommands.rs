//! The arguments of the subcommands that do not trace (`usdt`, `report`, `diff`, `check`) and of
//! `serve`, which traces with the options of a run (`RunArgs`) and its own.

use std::{ffi::OsString, net::SocketAddr, path::PathBuf, time::Duration};

use clap::ArgGroup;
use hyper::Uri;

use super::{
    run::{ReportOutputs, RunArgs},
    values::{parse_host_name, parse_interval, parse_listen, parse_otlp_url, parse_percent, parse_push_url},
};

#[derive(Debug, clap::Args)]
pub struct DiffArgs {
    /// The summaries of the runs to compare against (several: one base, their mean, each
    /// stack's figures that vary among them beyond --tolerance marked noisy), then the summary of
    /// the run compared
    #[arg(value_name = "BASE.json... NEW.json", num_args = 2.., required = true)]
    pub runs: Vec<PathBuf>,
    /// With several base runs: how far a figure may vary among them before it is noisy
    #[arg(long, value_name = "PERCENT", default_value = "5%", value_parser = parse_percent)]
    pub tolerance: f64,
    /// Also write the comparison as JSON here (every stack and function)
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// Also write it as a differential pprof profile here (gzipped; the base run's samples
    /// negated and labelled pprof::base, as `go tool pprof -diff_base` builds one): `go tool
    /// pprof -top PATH`
    #[arg(long, value_name = "PATH")]
    pub pprof: Option<PathBuf>,
    /// Also write it as an HTML page here: the table, and differential flamegraphs of leaked and
    /// allocated bytes (red grew, blue shrank)
    #[arg(long, value_name = "PATH")]
    pub html: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The budget file (TOML): [[budget]] tables, each with a command and its limits
    #[arg(long, value_name = "PATH")]
    pub budgets: PathBuf,
    /// A saved run to check (the summary of `memtrace --summary`), instead of tracing a command
    #[arg(value_name = "SUMMARY.json", required_unless_present = "command", conflicts_with = "command")]
    pub summary: Option<PathBuf>,
    /// Keep the traced command's summary here (to commit as a baseline); a temporary file otherwise
    #[arg(long = "save", value_name = "PATH", requires = "command")]
    pub save: Option<PathBuf>,
    /// Also write the verdict as JUnit XML here (a testcase a budget's figure)
    #[arg(long, value_name = "PATH")]
    pub junit: Option<PathBuf>,
    /// Also print each breach as a GitHub Actions annotation on the budget's line (`::error ...`)
    #[arg(long)]
    pub github: bool,
    /// How many call stacks a breach names
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub top: usize,
    /// Command to run and trace (with memtrace's defaults: exact, every call stack)
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

#[derive(Debug, clap::Parser)]
#[command(
    name = "memtrace report",
    after_help = "Examples:\n  memtrace report run.json --html run.html\n  \
                        memtrace report run.json --pprof heap.pb.gz --flamegraph live.svg"
)]
pub struct ReportArgs {
    /// The summary a run wrote with --summary
    #[arg(value_name = "RUN.json")]
    pub summary: PathBuf,

    #[command(flatten)]
    pub reports: ReportOutputs,

    /// How many leaking call stacks the reports list
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub top: usize,
}

impl ReportArgs {
    /// The summary read and each output file to write, with the argument that names it: no
    /// output may overwrite the summary or another output.
    pub fn files(&self) -> Vec<(&'static str, &std::path::Path)> {
        let outputs = self.reports.named().into_iter().filter_map(|(flag, path)| Some((flag, path?)));
        std::iter::once(("the summary", self.summary.as_path())).chain(outputs).collect()
    }
}

/// `memtrace serve`: a run (every option of one: what to trace, the kernel tables, the outputs
/// written at its end) whose live output is the agent's endpoints. With `-- COMMAND` it serves
/// while the command runs; a trace file is written only when `-o` names one.
#[derive(Debug, clap::Args)]
#[command(
    group(ArgGroup::new("pushes").multiple(true).args(["push", "otlp_endpoint"])),
    after_help = "Examples:\n  sudo memtrace serve --all\n  sudo memtrace serve --listen 127.0.0.1:9464 --comm nginx\n  sudo memtrace serve --pid 4242 --children"
)]
pub struct ServeArgs {
    #[command(flatten)]
    pub run: RunArgs,

    /// Address to serve on: IP:PORT, or a port alone for 127.0.0.1. Anything but loopback must
    /// be written out in full, e.g. 0.0.0.0:9464; the endpoints have no authentication
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9464", value_parser = parse_listen)]
    pub listen: SocketAddr,

    /// Processes with series of their own in /metrics, the largest by live heap; the rest are
    /// summed under comm="other"
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_series_processes: u32,

    /// Push the heap profile of each process (the largest --max-series-processes) to this
    /// Pyroscope-compatible server at every --push-interval, e.g. http://127.0.0.1:4040
    #[arg(long, value_name = "URL", value_parser = parse_push_url)]
    pub push: Option<Uri>,

    /// POST the heap profile of each process (the largest --max-series-processes) as one OTLP
    /// profiles request to URL/v1development/profiles at every --push-interval (OTLP/HTTP,
    /// protobuf), e.g. http://127.0.0.1:4318 where an OpenTelemetry Collector listens
    #[arg(long, value_name = "URL", value_parser = parse_otlp_url)]
    pub otlp_endpoint: Option<Uri>,

    /// How often to push with --push and --otlp-endpoint
    #[arg(long, value_name = "DUR", default_value = "15s", value_parser = parse_interval, requires = "pushes")]
    pub push_interval: Duration,

    /// The host's name in what is pushed (default: this system's host name); in a Kubernetes pod,
    /// the node's name from the downward API, e.g. --host-name $(NODE_NAME)
    #[arg(long, value_name = "NAME", value_parser = parse_host_name)]
    pub host_name: Option<String>,

    /// Keep the heap profile (gzipped pprof) of every traced process the kernel's OOM killer ends
    /// as a file in this directory (made if missing); with --push it also goes in the next push
    #[arg(long, value_name = "DIR")]
    pub oom_dir: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
#[command(group(ArgGroup::new("source").required(true).args(["pid", "path"])))]
pub struct UsdtListArgs {
    /// Every object the process maps
    #[arg(short, long, value_name = "PID", value_parser = clap::value_parser!(u32).range(1..))]
    pub pid: Option<u32>,

    /// An executable or a shared library
    #[arg(value_name = "PATH")]
    pub path: Option<PathBuf>,
}
