//! What memtrace knows about each traced process, as of the latest sample: the room every output
//! reads. Its parts: the frames of the call stacks (`frame`), the memory levels of a process
//! (`levels`), and how exited processes fold into their command's totals (`folding`, which works
//! on the model; the model names nothing of it).

pub mod estimate;
mod folding;
pub mod frame;
pub mod identity;
pub mod levels;
pub mod oom;
pub mod size_classes;

use std::{collections::BTreeMap, path::PathBuf, sync::Arc, time::Duration};

use memtrace_common::{ProcessStats, StackTotals};

pub use crate::process::probe_point::SingleStepped;
use crate::process::procfs::Mapping;
use estimate::figures;
use frame::Frame;
use identity::ProcessIdentity;
use levels::{FreePool, MemoryLevels};

#[derive(Debug, Clone)]
pub struct Process {
    /// Who it is: pid, command, executable, cgroup, container.
    pub identity: ProcessIdentity,
    /// The object whose allocator entry points are probed.
    pub allocator: PathBuf,
    /// Which allocator that is: "glibc", "jemalloc", ...
    pub allocator_kind: String,
    pub stats: ProcessStats,
    /// Its memory level by level, as last read (at its exit, from the kernel's own counters).
    pub memory: MemoryLevels,
    /// Its memory levels and subsystems at every sample it was traced (the last one only, once a
    /// system-wide run has released it).
    pub timeline: Vec<TimelinePoint>,
    /// When its live heap was highest, as seen at the samples, and which stacks held it then.
    pub peak: Option<HeapPeak>,
    pub exited: bool,
    /// The probes were attached before its current image ran (a launched command, an exec seen):
    /// every block it holds went through them, so its allocator's free pool can be measured.
    pub seen_from_start: bool,
    /// Its allocator's free pool by size class, as last measured (collect/owners), where known.
    pub free_pool: Option<FreePool>,
    /// Its kernel state is gone (system-wide tracing releases exited processes): the figures are
    /// final and no longer read.
    pub released: bool,
    /// File mappings as last read while the process was alive, to place address-only frames.
    pub mappings: Vec<Mapping>,
    /// Call stacks that allocated, filled in at the end of the run (empty with --no-stacks).
    pub stacks: Vec<StackProfile>,
    /// What the process's USDT probes reported.
    pub usdt: UsdtFigures,
    /// The kernel's OOM killer ended it (model/oom.rs).
    pub oom_kill: Option<oom::OomKill>,
    /// `--window`: what each allocation recorded stood for when its figures were last read (an
    /// exited process keeps the weight of its last reading).
    pub window_weight: Option<f64>,
    /// `--window`: its user CPU time inside windows and in all, which its weight comes from.
    pub window_cpu: Option<estimate::UserCpu>,
}

impl Process {
    /// Keeps only what the report and the summary show of a process that has ended: its `top`
    /// stacks (by leaked, then allocated bytes) and no mappings (its stacks are symbolized).
    pub fn keep_only_reported(&mut self, top: usize) {
        self.stacks.sort_by(|a, b| {
            (b.leaked_bytes, b.totals.allocated_bytes).cmp(&(a.leaked_bytes, a.totals.allocated_bytes))
        });
        self.stacks.truncate(top);
        self.stacks.shrink_to_fit();
        self.mappings = Vec::new();
        let last = self.timeline.pop();
        self.timeline = last.into_iter().collect();
    }
}

/// The command name the kernel recorded in a process's figures (as it first allocated after its
/// last exec, and at its exit), if any.
pub fn kernel_comm(stats: &ProcessStats) -> Option<String> {
    let name = stats.comm.split(|&b| b == 0).next().filter(|name| !name.is_empty())?;
    Some(String::from_utf8_lossy(name).into_owned())
}

/// One call stack of one process: what it allocated, what it still holds, and how old that is.
#[derive(Debug, Clone)]
pub struct StackProfile {
    /// Innermost first, starting at the allocator's caller.
    /// Shared with every other stack that has the same frame (a run holds many stacks and few
    /// distinct frames).
    pub frames: Vec<Arc<Frame>>,
    pub totals: StackTotals,
    /// Live blocks from this stack that count as leaked (older than --older, when given).
    pub leaked_bytes: u64,
    pub leaked_allocations: u64,
    /// Age of the oldest live block from this stack at the end of the run.
    pub oldest_age: Option<Duration>,
}

/// The most points a process's timeline keeps (see `Model::record_timeline`).
pub const MAX_TIMELINE_POINTS: usize = 4096;

/// A process's memory at one sample.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TimelinePoint {
    /// Microseconds since tracing began.
    pub ts_us: u64,
    pub memory: MemoryLevels,
    /// Bytes per USDT subsystem, as the process last reported them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub subsystems: BTreeMap<String, i64>,
}

/// The highest live heap a process had at any sample (heaptrack's "peak memory consumers"), and
/// the stacks that held it then. Samples are an interval apart: the true peak may lie between
/// two of them, so this is the peak at interval resolution (`stats.peak_live_bytes` is the exact
/// height, without the stacks).
#[derive(Debug, Clone)]
pub struct HeapPeak {
    /// Microseconds since tracing began.
    pub ts_us: u64,
    pub heap_live_bytes: i64,
    /// The stacks with live bytes at that sample, most first.
    pub consumers: Vec<PeakConsumer>,
}

/// One stack's share of the heap at its peak.
#[derive(Debug, Clone)]
pub struct PeakConsumer {
    /// Innermost first, as in `StackProfile`.
    pub frames: Vec<Arc<Frame>>,
    pub live_bytes: i64,
    pub live_allocations: i64,
}

/// One reading of every process, taken at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// Microseconds since tracing began.
    pub ts_us: u64,
    /// Shared by every process's memory dump of this sample.
    pub dump_id: u64,
}

#[derive(Debug, Default)]
pub struct Model {
    /// The processes traced, by pid: those running, and those exited whose pid is not in use again.
    pub processes: BTreeMap<u32, Process>,
    /// Exited processes whose pid a later process took: reported as they ended.
    pub retired: Vec<Process>,
    /// Losses the kernel could not charge to a process.
    pub unattributed_lost_events: u64,
    /// USDT reports the kernel could not record (a full map, an unreadable argument).
    pub usdt_lost_events: u64,
    /// System-wide tracing: how full the kernel's tables are, to show they stay bounded.
    pub kernel_maps: Option<KernelMaps>,
    /// `--sample`: live figures, frees, peaks and stacks are estimates from sampled allocations.
    pub sampling: Option<estimate::Sampling>,
    /// `--app-sampled`: allocations come from the allocators' own sampled probes.
    pub app_sampled: Option<AppSampled>,
    /// `--window`: allocations are probed in windows, and heap figures are estimates.
    pub windows: Option<estimate::Windows>,
    /// Exited processes beyond `--keep-exited`, summed per command (folding.rs).
    pub folded: Folded,
    /// The pids of released processes, in the order they were released, for folding.
    pub released_order: std::collections::VecDeque<u32>,
    /// Probes the kernel single-steps (a second trap per call), each function once.
    pub single_stepped: Vec<SingleStepped>,
    /// Library loads (dlopen) of traced processes that were held until the library's unwind table
    /// was in.
    pub library_loads_held: u64,
}

/// Folded totals by command name and container (`ProcessIdentity::display_name`, see folding.rs).
pub type Folded = BTreeMap<String, FoldedProcesses>;

/// What the folded exited processes of one command did, summed.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FoldedProcesses {
    pub comm: String,
    /// The container they ran in (`ProcessIdentity::container_name`), where they ran in one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    pub processes: u64,
    pub allocations: u64,
    pub frees: u64,
    pub allocated_bytes: u64,
    pub freed_bytes: u64,
    /// Bytes still live when each exited (leaked at exit), summed.
    pub live_bytes_at_exit: i64,
    /// The highest peak of any of them.
    pub peak_live_bytes: i64,
    pub temporary_allocations: u64,
    pub untracked_frees: u64,
    pub failed_allocations: u64,
    pub lost_events: u64,
}

/// `--app-sampled`: allocations come only from the allocators' own sampled probes (OpenTelemetry's
/// `otel_memory:alloc(ptr, size, weighted_bytes)` and `otel_memory:free(ptr)`). Each sample is
/// recorded as `weighted_bytes`, the bytes it stands for, so every byte figure is the allocator's
/// estimate; counts of allocations, frees and live blocks count samples.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AppSampled {
    #[serde(skip_deserializing, default = "AppSampled::probes")]
    pub probes: &'static str,
    #[serde(skip_deserializing, default = "AppSampled::estimated")]
    pub estimated: &'static [&'static str],
    #[serde(skip_deserializing, default = "AppSampled::samples")]
    pub samples: &'static [&'static str],
}

impl Default for AppSampled {
    fn default() -> Self {
        Self { probes: Self::probes(), estimated: Self::estimated(), samples: Self::samples() }
    }
}

impl AppSampled {
    fn probes() -> &'static str {
        "otel_memory:alloc, otel_memory:free"
    }

    fn estimated() -> &'static [&'static str] {
        const ESTIMATED: [&str; 8] = figures::joined(figures::BYTES, figures::BY_STACK);
        &ESTIMATED
    }

    fn samples() -> &'static [&'static str] {
        &figures::COUNTS
    }
}

/// Occupancy of the kernel's tables at the end of a system-wide run (`kernel_maps` in the summary).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KernelMaps {
    /// Processes with figures in the kernel at the end.
    pub processes: usize,
    pub live_allocations: usize,
    pub stack_totals: usize,
    /// USDT subsystem, `--usdt` counter and dump round entries at the end.
    pub usdt_entries: usize,
    /// The most processes the kernel held figures for at any sample.
    pub peak_processes: usize,
    /// Exited processes whose kernel state was released during the run.
    pub released_processes: usize,
    /// Object files with an unwind table in the kernel at the end, and the rows they take.
    pub unwind_files: usize,
    pub unwind_rows: usize,
}

impl Model {
    /// How each process's recorded allocations stand for all of them (`Estimators::of`, with the
    /// process's `window_cpu`).
    pub fn estimators(&self) -> estimate::Estimators {
        estimate::Estimators { sampling: self.sampling, windows: self.windows }
    }

    /// The one place a process enters the model, with its identity (`ProcessIdentity::read`).
    pub fn add_process(&mut self, identity: ProcessIdentity, allocator: PathBuf) {
        self.processes.insert(
            identity.pid,
            Process {
                identity,
                allocator,
                allocator_kind: String::new(),
                stats: ProcessStats::default(),
                memory: MemoryLevels::default(),
                timeline: Vec::new(),
                peak: None,
                exited: false,
                seen_from_start: false,
                free_pool: None,
                released: false,
                mappings: Vec::new(),
                stacks: Vec::new(),
                usdt: UsdtFigures::default(),
                oom_kill: None,
                window_weight: None,
                window_cpu: None,
            },
        );
    }

    pub fn lost_events(&self) -> u64 {
        self.unattributed_lost_events
            + self.usdt_lost_events
            + self.every_process().map(|p| p.stats.lost_events).sum::<u64>()
            + self.folded.values().map(|folded| folded.lost_events).sum::<u64>()
    }

    /// Every process traced, each once, in the order they were seen (pids may repeat: a pid used
    /// again is another process).
    pub fn every_process(&self) -> impl Iterator<Item = &Process> {
        self.retired.iter().chain(self.processes.values())
    }

    /// Adds every traced process's memory as of now to its timeline. A timeline keeps at most
    /// `MAX_TIMELINE_POINTS`: when full, every other point goes (a run of days keeps its shape at a
    /// coarser step, in bounded memory).
    pub fn record_timeline(&mut self, ts_us: u64) {
        for process in self.processes.values_mut().filter(|p| !p.released) {
            if process.timeline.len() >= MAX_TIMELINE_POINTS {
                let mut index = 0;
                process.timeline.retain(|_| {
                    index += 1;
                    index % 2 == 0
                });
            }
            process.timeline.push(TimelinePoint {
                ts_us,
                memory: process.memory,
                subsystems: process.usdt.subsystems.clone(),
            });
        }
    }

    /// A new process has the pid of an exited, released one: the old one is kept as it ended.
    pub fn retire(&mut self, pid: u32) {
        if let Some(process) = self.processes.remove(&pid) {
            self.retired.push(process);
        }
    }
}

/// How a run ended, for the exporters' closing words.
#[derive(Debug, Clone, Copy)]
pub struct RunEnd {
    pub duration: Duration,
}

/// Bytes per function, as a profiler reports time: exclusive where the function called the
/// allocator itself, inclusive where it is anywhere on the stack.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FunctionTotals {
    pub name: String,
    /// The interpreter ("python", "perl") whose function (a Perl sub) this is, for a script's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interpreter: Option<String>,
    pub live_inclusive_bytes: i64,
    pub live_exclusive_bytes: i64,
    pub allocated_inclusive_bytes: u64,
    pub allocated_exclusive_bytes: u64,
}

impl Process {
    /// Every function on any stack, most live bytes (inclusive) first.
    pub fn function_totals(&self) -> Vec<FunctionTotals> {
        let mut by_name: BTreeMap<String, FunctionTotals> = BTreeMap::new();
        for stack in &self.stacks {
            let mut seen = std::collections::HashSet::new();
            // The innermost frame holds the bytes itself; so does the innermost of an
            // interpreter's frames, among the script's functions.
            let innermost_script = stack.frames.iter().position(|frame| frame.interpreter.is_some());
            for (depth, frame) in stack.frames.iter().enumerate() {
                let name = frame.function_name();
                // A recursive function counts once per stack.
                if !seen.insert(name.clone()) {
                    continue;
                }
                let totals = by_name.entry(name.clone()).or_insert_with(|| FunctionTotals {
                    name,
                    interpreter: frame.interpreter.clone(),
                    ..FunctionTotals::default()
                });
                totals.live_inclusive_bytes += stack.totals.live_bytes;
                totals.allocated_inclusive_bytes += stack.totals.allocated_bytes;
                if depth == 0 || Some(depth) == innermost_script {
                    totals.live_exclusive_bytes += stack.totals.live_bytes;
                    totals.allocated_exclusive_bytes += stack.totals.allocated_bytes;
                }
            }
        }
        let mut functions: Vec<_> = by_name.into_values().collect();
        functions.sort_by(|a, b| {
            (b.live_inclusive_bytes, b.allocated_inclusive_bytes)
                .cmp(&(a.live_inclusive_bytes, a.allocated_inclusive_bytes))
                .then_with(|| a.name.cmp(&b.name))
        });
        functions
    }

    /// Stacks holding leaked bytes, most first, at most `top`.
    pub fn leaks(&self, top: usize) -> impl Iterator<Item = &StackProfile> {
        let mut leaks: Vec<&StackProfile> = self.stacks.iter().filter(|s| s.leaked_bytes > 0).collect();
        leaks.sort_by_key(|leak| std::cmp::Reverse(leak.leaked_bytes));
        leaks.into_iter().take(top)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(name: &str) -> Frame {
        Frame {
            function: Some(name.into()),
            file: None,
            line: None,
            module: "m".into(),
            offset: 0,
            interpreter: None,
        }
    }

    fn stack(names: &[&str], live: i64, allocated: u64) -> StackProfile {
        StackProfile {
            frames: names.iter().map(|n| Arc::new(frame(n))).collect(),
            totals: StackTotals {
                allocations: 1,
                allocated_bytes: allocated,
                live_allocations: 1,
                live_bytes: live,
                ..StackTotals::default()
            },
            leaked_bytes: live as u64,
            leaked_allocations: 1,
            oldest_age: None,
        }
    }

    #[test]
    fn inclusive_and_exclusive_bytes_per_function() {
        let mut model = Model::default();
        model.add_process(crate::model::identity::ProcessIdentity::new(1, "p".into()), "/libc".into());
        let process = model.processes.get_mut(&1).unwrap();
        process.stacks = vec![
            stack(&["leaf_a", "middle", "main"], 100, 300),
            stack(&["leaf_b", "middle", "main"], 10, 20),
            stack(&["middle", "main"], 1, 1),
            stack(&["recurse", "recurse", "main"], 5, 5),
        ];
        let functions = process.function_totals();
        let get = |name: &str| functions.iter().find(|f| f.name == name).unwrap().clone();
        assert_eq!(functions[0].name, "main");
        assert_eq!(get("main").live_inclusive_bytes, 116);
        assert_eq!(get("main").live_exclusive_bytes, 0);
        assert_eq!(get("middle").live_inclusive_bytes, 111);
        assert_eq!(get("middle").live_exclusive_bytes, 1);
        assert_eq!(get("middle").allocated_inclusive_bytes, 321);
        assert_eq!(get("leaf_a").allocated_exclusive_bytes, 300);
        assert_eq!(get("recurse").live_inclusive_bytes, 5, "recursion counts once");
        let leaks: Vec<_> = process.leaks(2).map(|s| s.leaked_bytes).collect();
        assert_eq!(leaks, [100, 10]);
    }
}

/// What one process's USDT probes reported, as of the latest sample.
#[derive(Debug, Clone, Default)]
pub struct UsdtFigures {
    /// memtrace:report_total / report_delta: the current bytes of each subsystem, by name.
    pub subsystems: BTreeMap<String, i64>,
    /// The `--usdt` counters, by the option as written.
    pub probes: BTreeMap<String, UsdtProbeCounter>,
}

/// A `--usdt` counter of one process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UsdtProbeCounter {
    pub hits: u64,
    /// The tracked argument at the latest hit (`=argN` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<i64>,
}
