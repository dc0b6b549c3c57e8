//! The run, resolved once: main parses the command line and resolves it here, with the kernel's
//! features, into a [`Plan`]: the mode, the targets, the probes, the timing, the outputs (their
//! defaults filled in), what is kept of exited processes, and the kernel's facts. Everything after
//! main reads the plan's parts; the command line itself stops at [`resolve`].

mod kernel;
mod mode;
pub mod resolve;

use std::{ffi::OsString, path::PathBuf, time::Duration};

pub use self::{
    kernel::Kernel,
    mode::{Mode, PushTarget, ServeOptions},
};
use crate::{
    attach::usdt::UsdtRequest,
    kernel::{ProcessFilter, Reach},
    process::allocator::Overrides,
};

/// One tracing run, as the command line and the kernel make it.
pub struct Plan {
    pub mode: Mode,
    pub targets: Targets,
    pub probes: ProbePlan,
    pub timing: Timing,
    pub outputs: Outputs,
    pub retention: Retention,
    pub kernel: Kernel,
    pub runtimes: Runtimes,
}

/// The container runtimes asked for what a container's cgroup path does not say: its pod,
/// namespace and container name.
#[derive(Debug, Clone)]
pub struct Runtimes {
    /// `--containerd-socket`: containerd's gRPC socket.
    pub containerd_socket: PathBuf,
}

/// What a run traces.
#[derive(Debug, Clone)]
pub enum Targets {
    /// `--pid` (as given: a thread's id is taken for its process when the run starts), and with
    /// `--children` every descendant of them, running now or started later.
    Pids { pids: Vec<u32>, children: bool },
    /// A command launched and traced from its first instruction, with its arguments, and unless
    /// `--no-children` every process it starts.
    Command { argv: Vec<OsString>, children: bool },
    /// `--all` or `--comm`: every process on the machine, including those started later, but
    /// those the filter leaves out.
    System(ProcessFilter),
}

impl Targets {
    /// Every process on the machine is a candidate: --all, or --comm, which implies it.
    pub fn system_wide(&self) -> bool {
        matches!(self, Targets::System(_))
    }

    /// Whether the targets' descendants are traced: a command's are unless --no-children, named
    /// processes' only with --children.
    pub fn follows_children(&self) -> bool {
        match self {
            Targets::Pids { children, .. } | Targets::Command { children, .. } => *children,
            Targets::System(_) => false,
        }
    }

    /// The processes `--pid` names (none for a command or system-wide).
    pub fn pids(&self) -> &[u32] {
        match self {
            Targets::Pids { pids, .. } => pids,
            _ => &[],
        }
    }

    /// Which processes the kernel side counts.
    pub fn reach(&self) -> Reach {
        match self {
            Targets::System(filter) => Reach::AllProcesses(filter.clone()),
            _ if self.follows_children() => Reach::Tree,
            _ => Reach::Targets,
        }
    }
}

/// What is probed, and how the kernel side is sized.
pub struct ProbePlan {
    pub tables: Tables,
    /// Call stacks are recorded (not with `--no-stacks`).
    pub stacks: bool,
    /// Interpreters' frames are read into them (not with `--no-interpreter-frames`).
    pub interpreter_frames: bool,
    /// `--sample`: the mean bytes between sampled allocations; None records every allocation.
    pub sample: Option<u64>,
    /// `--empty-probes`: programs that do nothing, at the same probe points.
    pub empty_probes: bool,
    /// `--window`: the allocation-only entry points are probed in windows.
    pub window: Option<crate::cli::Window>,
    /// `--app-sampled`: allocations from the allocators' otel_memory probes, none from uprobes.
    pub app_sampled: bool,
    /// `--debug-bpf`: the kernel side's diagnostics on stderr.
    pub debug_bpf: bool,
    /// `--allocator` and `--lib`, in place of the allocator found per process.
    pub allocator: Overrides,
    /// `--usdt`: the probes counted or tracked.
    pub usdt: Vec<UsdtRequest>,
    /// Unwind tables are built on a worker thread (`--all`, where the machine's files are many and
    /// start-up must stay fast), and their loading is not said process by process.
    pub unwind_in_background: bool,
}

/// The capacities of the kernel's tables.
#[derive(Debug, Clone, Copy)]
pub struct Tables {
    /// `--max-allocations`: the live-allocation table.
    pub max_allocations: u32,
    /// `--max-stacks`: the stack tables, emptied at every sample.
    pub max_stacks: u32,
}

/// When the run samples, and when it ends.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// `--interval`: how often the counters are sampled.
    pub interval: Duration,
    /// `--duration`: tracing stops after this long.
    pub duration: Option<Duration>,
    /// The run ends when every target has exited: not system-wide, nor for the agent without a
    /// command, which traces until a signal ends it.
    pub ends_with_targets: bool,
}

/// Every file the run writes, with its defaults filled in.
pub struct Outputs {
    /// The trace file: `-o`, or memtrace-DATE-TIME.json for a plain run; the agent and the live
    /// view write one only when `-o` names it.
    pub trace: Option<PathBuf>,
    /// `--heap-subsystem`: USDT subsystems whose memory the trace counts inside malloc's.
    pub heap_subsystems: Vec<String>,
    /// `--summary`.
    pub summary: Option<PathBuf>,
    pub reports: ReportFiles,
    /// `--top`: how many leaking call stacks the report and the summary list.
    pub top: usize,
    /// `--older`: only live blocks at least this old at the end count as leaked.
    pub older: Duration,
}

/// The reports a run writes at its end, and `memtrace report` writes again from a summary.
#[derive(Debug, Clone, Default)]
pub struct ReportFiles {
    pub pprof: Option<PathBuf>,
    pub flamegraph: Option<PathBuf>,
    pub perfetto: Option<PathBuf>,
    pub html: Option<PathBuf>,
    /// `--otlp`: the heap profile as an OTLP profiles request.
    pub otlp: Option<PathBuf>,
}

/// What is kept of processes that exited, so that a long run stays in bounded memory.
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    /// `--keep-exited`: exited processes with a report of their own; those that exited before
    /// them are folded into per-command totals.
    pub keep_exited: usize,
    /// System-wide, thousands of processes come and go: a released one keeps only what its
    /// report shows (this many call stacks).
    pub trim_released: Option<usize>,
    /// `memtrace serve` without a command: released processes leave the model once their final
    /// figures went to the exporters, and no stacks are kept for reports (the agent has none).
    /// With a command, serve is a run with live endpoints, and reports like a run.
    pub forget_released: bool,
}
