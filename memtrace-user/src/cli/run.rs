//! The options of a tracing run (`RunArgs`), which `memtrace top` and `memtrace serve` take as
//! they are: what to trace, for how long, and where the results go.

use std::{ffi::OsString, path::PathBuf, time::Duration};

use clap::ArgGroup;
use memtrace_common::{DEFAULT_MAX_LIVE_ALLOCATIONS, MAX_LIVE_ALLOCATIONS_LIMIT};

use super::values::{
    parse_bytes, parse_cgroup_path, parse_comm, parse_container_id, parse_duration, parse_interval, Window,
};

/// What to trace, for how long, and where the results go: the options of a run, which `memtrace top`
/// takes as they are.
#[derive(Debug, clap::Args)]
#[group(skip)]
#[command(
    group(ArgGroup::new("target").required(true).args(["pids", "command", "all", "comms", "containers", "cgroups"]).multiple(true)),
    // --comm, --container and --cgroup imply --all; --pid, --all and a command exclude each other.
    group(ArgGroup::new("system_wide").args(["all", "comms", "containers", "cgroups"]).multiple(true)),
)]
pub struct RunArgs {
    /// Attach to a running process (repeatable)
    #[arg(short, long = "pid", value_name = "PID", value_parser = clap::value_parser!(u32).range(1..),
          conflicts_with_all = ["command", "system_wide"])]
    pub pids: Vec<u32>,

    /// With --pid: trace every descendant of the targets too, those running now and those they
    /// start later
    #[arg(long, requires = "pids")]
    pub children: bool,

    /// With a command: trace the command alone, not the processes it starts (their probes stay
    /// per process, so other processes on the machine pay nothing)
    #[arg(long, requires = "command")]
    pub no_children: bool,

    /// Trace every process on the machine, including those started later
    #[arg(short, long, conflicts_with = "command")]
    pub all: bool,

    /// Trace only processes with this command name, as `ps -o comm` shows it (repeatable; implies --all)
    #[arg(long = "comm", value_name = "NAME", conflicts_with = "command", value_parser = parse_comm)]
    pub comms: Vec<String>,

    /// Trace only the processes of this container, also those it starts later: its id, or a
    /// prefix of at least 12 hex digits as `docker ps` shows it (repeatable; implies --all)
    #[arg(long = "container", value_name = "ID", conflicts_with = "command", value_parser = parse_container_id)]
    pub containers: Vec<String>,

    /// Trace only the processes in this cgroup and below it, as /proc/PID/cgroup shows its path
    /// (e.g. /kubepods/besteffort/pod<UID>), also those started there later (repeatable; implies --all)
    #[arg(long = "cgroup", value_name = "PATH", conflicts_with = "command", value_parser = parse_cgroup_path)]
    pub cgroups: Vec<String>,

    /// containerd's socket, asked for the pod, namespace and container name of each container
    /// (its io.kubernetes.* labels); nothing is asked where it does not exist
    #[arg(long, value_name = "PATH", default_value = crate::process::containerd::DEFAULT_SOCKET)]
    pub containerd_socket: PathBuf,

    /// With --all or --comm: leave this process out (repeatable)
    #[arg(long = "exclude-pid", value_name = "PID", requires = "system_wide")]
    pub exclude_pids: Vec<u32>,

    /// Trace file to write (Chrome trace-event JSON) [default: memtrace-<date>-<time>.json]
    #[arg(short, long, value_name = "PATH")]
    pub output: Option<PathBuf>,

    /// How often to sample the counters, e.g. 250ms, 1s, 2s
    #[arg(short, long, value_name = "DUR", default_value = "1s", value_parser = parse_interval)]
    pub interval: Duration,

    /// Stop tracing after this long, e.g. 30s, 5m
    #[arg(short, long, value_name = "DUR", value_parser = parse_duration)]
    pub duration: Option<Duration>,

    /// Write a JSON summary of the run here at the end
    #[arg(long, value_name = "PATH")]
    pub summary: Option<PathBuf>,

    /// Capacity of the kernel's live-allocation table; allocations beyond it are counted as lost.
    /// At most 134217728; each takes two 48-byte slots of kernel memory (96 MiB by default)
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_LIVE_ALLOCATIONS,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_LIVE_ALLOCATIONS_LIMIT)))]
    pub max_allocations: u32,

    /// Capacity of the kernel's stack tables (distinct stacks, and (process, stack) totals):
    /// memtrace empties them at every sample, so they must hold what one interval brings. Stacks
    /// beyond it are counted as lost. Each stack takes about 1 KiB of kernel memory while held
    #[arg(long, value_name = "N", default_value_t = memtrace_common::MAX_STACKS,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_LIVE_ALLOCATIONS_LIMIT)))]
    pub max_stacks: u32,

    /// How many exited processes keep a report of their own; those that exited before them are
    /// folded into per-command totals (the summary's `folded`), so a long run stays in bounded
    /// memory
    #[arg(long, value_name = "N", default_value_t = 1000)]
    pub keep_exited: usize,

    /// The allocator's symbol prefix or name: glibc, jemalloc, tcmalloc, mimalloc, je_, tc_, mi_,
    /// _rjem_ (Rust's jemallocator), or any prefix [default: found per process]
    #[arg(long, value_name = "NAME")]
    pub allocator: Option<String>,

    /// The object file that holds the allocator, as the target sees its path [default: found per
    /// process, as the dynamic linker resolves malloc]
    #[arg(long, value_name = "PATH")]
    pub lib: Option<PathBuf>,

    /// Do not record call stacks (cheaper; no leak report, pprof or flamegraph)
    #[arg(long)]
    pub no_stacks: bool,

    /// Do not read interpreters' frames (CPython 3.11's and 3.13's functions in the stacks of a python3
    /// process, Perl 5.36's subs in a perl's): native frames alone
    #[arg(long)]
    pub no_interpreter_frames: bool,

    /// Print the kernel side's own diagnostics on stderr as they happen (`memtrace: bpf: ...`):
    /// why a new stack ends short (the reason, as `unwind_stops` counts it, and the last frame's
    /// address), and each event a full table loses
    #[arg(long)]
    pub debug_bpf: bool,

    /// Sample allocations, a mean of BYTES apart (e.g. 512KiB): only sampled ones take a stack and
    /// a live record, and live figures, frees, peaks and stacks become unbiased estimates
    /// (allocations and allocated bytes stay exact)
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub sample: Option<u64>,

    /// Take allocations only from the allocators' own sampled probes (OpenTelemetry's USDT
    /// otel_memory:alloc and otel_memory:free), never from uprobes on malloc and free: only the
    /// allocator's samples enter the kernel, so the traced programs pay next to nothing. Byte
    /// figures become the allocator's estimates; processes without those probes get no heap figures
    #[arg(long, conflicts_with_all = ["sample", "empty_probes"])]
    pub app_sampled: bool,

    /// Probe allocations in windows, ON of every EVERY (e.g. 1s/20s): malloc, calloc and the
    /// memalign family are probed only inside windows, while free and realloc stay probed, so each
    /// block a window recorded is followed until it is freed and its stack stays exact. The traced
    /// programs pay for allocation probes only inside windows; heap figures become estimates
    /// (the windows' scaled by each process's user CPU time over its user CPU time inside windows)
    #[arg(long, value_name = "ON/EVERY", value_parser = Window::parse,
          conflicts_with_all = ["sample", "app_sampled", "empty_probes"])]
    pub window: Option<Window>,

    /// Attach programs that do nothing at the same probe points: the floor of exact tracing, for
    /// `cargo xtask bench`; every figure reads zero
    #[arg(long, hide = true)]
    pub empty_probes: bool,

    /// Count as leaked only live blocks at least this old at the end, e.g. 10s
    #[arg(long, value_name = "DUR", value_parser = parse_duration, default_value = "0s")]
    pub older: Duration,

    /// How many leaking call stacks the report and the summary list
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub top: usize,

    #[command(flatten)]
    pub reports: ReportOutputs,

    /// This USDT subsystem's memory comes out of malloc (repeatable): in the trace's memory dumps
    /// it owns part of `malloc`, so no total counts it twice
    #[arg(long = "heap-subsystem", value_name = "NAME")]
    pub heap_subsystems: Vec<String>,

    /// Count hits of a USDT probe, or track its argument N (arg0 is the first) as a counter; PATH
    /// limits it to one executable or library (repeatable), e.g. myapp:request or ./libfoo.so:foo:alloc=arg1
    #[arg(long = "usdt", value_name = "[PATH:]PROVIDER:NAME[=argN]",
          value_parser = crate::attach::usdt::UsdtRequest::parse)]
    pub usdt: Vec<crate::attach::usdt::UsdtRequest>,

    /// Command to run and trace from its first instruction
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

impl RunArgs {
    /// What the kernel would refuse, found before anything is loaded: a usage error.
    pub fn check_kernel_limits(&self) -> Result<(), String> {
        if self.comms.len() > memtrace_common::MAX_COMMS as usize {
            return Err(format!("at most {} --comm names", memtrace_common::MAX_COMMS));
        }
        if self.exclude_pids.len() > memtrace_common::MAX_EXCLUDED_PIDS as usize {
            return Err(format!("at most {} --exclude-pid", memtrace_common::MAX_EXCLUDED_PIDS));
        }
        Ok(())
    }

    /// Each output file the run writes, with the option that names it.
    pub fn output_files(&self) -> Vec<(&'static str, &std::path::Path)> {
        let named = [("-o/--output", self.output.as_deref()), ("--summary", self.summary.as_deref())];
        named.into_iter().chain(self.reports.named()).filter_map(|(flag, path)| Some((flag, path?))).collect()
    }
}

/// The reports a run writes at its end, and `memtrace report` writes again from a summary.
#[derive(Debug, Default, clap::Args)]
pub struct ReportOutputs {
    /// Write a gzipped pprof profile (alloc_objects, alloc_space, inuse_objects, inuse_space)
    #[arg(long, value_name = "PATH")]
    pub pprof: Option<PathBuf>,

    /// Write an SVG flamegraph of live bytes by call stack
    #[arg(long, value_name = "PATH")]
    pub flamegraph: Option<PathBuf>,

    /// Write a native Perfetto trace (protobuf): counter tracks for every memory level and
    /// subsystem at every sample, and the heap profile (a native-heap flamegraph in Perfetto UI)
    #[arg(long, value_name = "PATH")]
    pub perfetto: Option<PathBuf>,

    /// Write an HTML report (one self-contained file, works offline): timeline, treemap,
    /// flamegraphs, leaks, temporary allocations, the heap peak
    #[arg(long, value_name = "PATH")]
    pub html: Option<PathBuf>,

    /// Write the heap profile as an OpenTelemetry profiles request (OTLP
    /// ExportProfilesServiceRequest, protobuf): one Profile per sample type, per process
    #[arg(long, value_name = "PATH")]
    pub otlp: Option<PathBuf>,
}

impl ReportOutputs {
    /// Each report's option and the path it names, if any.
    pub fn named(&self) -> [(&'static str, Option<&std::path::Path>); 5] {
        [
            ("--pprof", self.pprof.as_deref()),
            ("--flamegraph", self.flamegraph.as_deref()),
            ("--perfetto", self.perfetto.as_deref()),
            ("--html", self.html.as_deref()),
            ("--otlp", self.otlp.as_deref()),
        ]
    }
}
