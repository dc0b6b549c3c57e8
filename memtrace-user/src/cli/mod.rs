//! The command line: what to trace, for how long, and where the results go.

use std::{
    ffi::OsString,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

mod subcommands;

use clap::{ArgGroup, Parser};
use hyper::Uri;
use memtrace_common::{DEFAULT_MAX_LIVE_ALLOCATIONS, MAX_LIVE_ALLOCATIONS_LIMIT};

pub use subcommands::{CheckArgs, DiffArgs, ReportArgs, ReportOutputs, ServeArgs, UsdtListArgs};

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

/// "5%" as 0.05.
pub fn parse_percent(text: &str) -> Result<f64, String> {
    text.strip_suffix('%')
        .and_then(|number| number.trim().parse::<f64>().ok())
        .filter(|percent| percent.is_finite() && *percent >= 0.0)
        .map(|percent| percent / 100.0)
        .ok_or_else(|| format!("\"{text}\" is not a percentage; write it as 5%"))
}

/// A container id or a prefix of one: 12 to 64 hex digits, kept in lower case.
fn parse_container_id(text: &str) -> Result<String, String> {
    let hex = text.bytes().all(|b| b.is_ascii_hexdigit());
    if !hex || !(12..=64).contains(&text.len()) {
        return Err(format!(
            "{text:?} is not a container id: give 12 to 64 hex digits, as `docker ps` or `crictl ps` shows it"
        ));
    }
    Ok(text.to_ascii_lowercase())
}

/// A cgroup path as /proc/PID/cgroup shows it: absolute, without `..`.
fn parse_cgroup_path(text: &str) -> Result<String, String> {
    if !text.starts_with('/') || text.split('/').any(|part| part == "..") {
        return Err(format!(
            "{text:?} is not a cgroup path: give it as /proc/PID/cgroup shows it, e.g. /kubepods/besteffort/pod<UID>"
        ));
    }
    Ok(text.trim_end_matches('/').to_owned()).map(|path| if path.is_empty() { "/".to_owned() } else { path })
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

/// `--window ON/EVERY`: allocations probed for `on` of every `every`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub on: Duration,
    pub every: Duration,
}

impl Window {
    /// The shortest window: attaching a window's probes takes a few milliseconds.
    const SHORTEST: Duration = Duration::from_millis(50);

    /// Parses `ON/EVERY`, e.g. `1s/20s`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let Some((on, every)) = text.split_once('/') else {
            return Err(format!("`{text}` is not ON/EVERY; write e.g. 1s/20s (probe 1 s of every 20 s)"));
        };
        let (on, every) = (parse_duration(on)?, parse_duration(every)?);
        if on < Self::SHORTEST {
            return Err(format!(
                "a window of {on:?} is too short to attach its probes in; use at least 50ms"
            ));
        }
        if on >= every {
            return Err(format!(
                "a window of {on:?} every {every:?} never closes; make EVERY longer than ON, e.g. 1s/20s, \
                 or leave --window out to probe all the time"
            ));
        }
        Ok(Self { on, every })
    }
}

/// Parses a human duration such as `250ms`, `2s`, `1m30s`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim()).map_err(|err| {
        format!("`{text}` is not a duration ({err}); write a number with a unit, e.g. 250ms, 2s, 1m")
    })
}

/// A byte count with an optional unit: 4096, 64K, 64KiB, 1M, 1MiB, 1G (units are powers of 1024).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let split = trimmed.find(|c: char| !c.is_ascii_digit()).unwrap_or(trimmed.len());
    let (digits, unit) = trimmed.split_at(split);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => return Err(format!("`{text}` has an unknown unit; write e.g. 4096, 64KiB, 1MiB")),
    };
    let value: u64 =
        digits.parse().map_err(|_| format!("`{text}` is not a byte count; write e.g. 512KiB"))?;
    match value.checked_mul(1 << shift) {
        Some(0) => Err("a sampling interval of 0 bytes samples nothing; leave --sample out to record \
                        every allocation"
            .to_owned()),
        Some(bytes) if bytes <= 1 << 40 => Ok(bytes),
        _ => Err(format!("`{text}` is more than 1TiB; use a smaller mean, e.g. 512KiB")),
    }
}

/// A command name as the kernel keeps it: 1 to 15 bytes.
fn parse_comm(text: &str) -> Result<String, String> {
    match text.len() {
        0 => Err("a command name is needed, as `ps -o comm` shows it".to_owned()),
        1..=15 => Ok(text.to_owned()),
        _ => Err(format!(
            "the kernel keeps only the first 15 bytes of a command name; write `{}`",
            String::from_utf8_lossy(&text.as_bytes()[..15])
        )),
    }
}

fn parse_interval(text: &str) -> Result<Duration, String> {
    let interval = parse_duration(text)?;
    if interval < Duration::from_millis(1) {
        return Err(format!("interval `{text}` is too short; use at least 1ms"));
    }
    Ok(interval)
}

/// The port `--listen` takes when none is given.
const DEFAULT_PORT: u16 = 9464;

/// Parses `--listen`: IP:PORT, or a port alone for loopback. An address that reaches other hosts
/// must be written out in full: `:9464` (every interface, in Go's shorthand) is refused.
pub fn parse_listen(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
    }
    if text.starts_with(':') {
        return Err(format!(
            "`{text}` leaves the address out; memtrace listens beyond loopback only on an address written \
             in full, e.g. 0.0.0.0{text} for every interface, or 127.0.0.1{text}"
        ));
    }
    text.parse().map_err(|_| {
        format!("`{text}` is not IP:PORT; write e.g. 127.0.0.1:{DEFAULT_PORT} or [::1]:{DEFAULT_PORT}")
    })
}

/// Parses `--push`: an http:// URL of a Pyroscope server.
pub fn parse_push_url(text: &str) -> Result<Uri, String> {
    parse_http_url(text, "http://127.0.0.1:4040, where Pyroscope listens")
}

/// Parses `--otlp-endpoint`: an http:// URL of an OTLP/HTTP receiver.
pub fn parse_otlp_url(text: &str) -> Result<Uri, String> {
    parse_http_url(
        text,
        "http://127.0.0.1:4318, where an OpenTelemetry Collector's OTLP/HTTP receiver listens",
    )
}

/// A plain http:// URL, with a path prefix but no query; `example` shows one in the errors.
fn parse_http_url(text: &str, example: &str) -> Result<Uri, String> {
    let uri: Uri =
        text.trim().parse().map_err(|err| format!("`{text}` is not a URL ({err}); write e.g. {example}"))?;
    match (uri.scheme_str(), uri.authority()) {
        (Some("http"), Some(_)) if uri.query().is_none() => Ok(uri),
        (Some("https"), _) => Err(format!(
            "`{text}`: memtrace pushes over plain HTTP only; push to a local TLS-terminating proxy \
             (http://127.0.0.1:PORT) that forwards to the server"
        )),
        _ => Err(format!("`{text}` is not an http://HOST:PORT URL; write e.g. {example}")),
    }
}

#[cfg(test)]
mod tests;
