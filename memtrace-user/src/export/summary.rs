//! The machine-readable end of a run (`--summary PATH`), in the format of the output contract.
//! It also carries what every report needs to be made again later (`memtrace report`, see
//! `saved.rs`): every call stack with its totals, each distinct frame once in `frame_table`, and
//! each process's timeline and heap peak. Long lists are written one entry per line, so the file
//! stays small and readable.

use std::{
    collections::{BTreeMap, HashMap},
    io::Write,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::Result;
use memtrace_common::{interpreter_stop, unwind_stop, ProcessStats, StackTotals};
use serde::{Deserialize, Serialize, Serializer};

use super::{exporter::Exporter, output_file::OutputFile};
use crate::model::{
    estimate::{Sampling, UserCpu, Windows},
    frame::Frame,
    identity::Container,
    levels::{FreeClass, FreePool, MemoryLevels},
    oom::OomKill,
    AppSampled, FoldedProcesses, FunctionTotals, HeapPeak, KernelMaps, Model, PeakConsumer, Process, RunEnd,
    SingleStepped, StackProfile, TimelinePoint, UsdtProbeCounter,
};

pub const SUMMARY_VERSION: u32 = 1;

#[derive(Debug, Serialize, Deserialize)]
pub struct Summary {
    pub version: u32,
    pub duration_s: f64,
    pub lost_events: u64,
    pub processes: Vec<ProcessSummary>,
    /// System-wide runs: how full the kernel's tables were, to show they stay bounded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_maps: Option<KernelMaps>,
    /// `--sample`: the mean bytes between samples and which figures are estimates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling: Option<Sampling>,
    /// `--app-sampled`: which probes gave the allocations, which figures are estimates and which
    /// count samples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_sampled: Option<AppSampled>,
    /// `--window`: how long allocations were probed, what each recorded one stands for, and which
    /// figures are estimates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub windows: Option<Windows>,
    /// Every distinct stack frame of the run, once: the `frame_ids` of stacks index it.
    #[serde(default, serialize_with = "one_line_each")]
    pub frame_table: Vec<Frame>,
    /// Exited processes beyond `--keep-exited`, summed per command, most processes first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub folded: Vec<FoldedProcesses>,
    /// Probes the kernel single-steps, a second trap at every call: each function and its file.
    #[serde(default)]
    pub single_stepped: Vec<SingleStepped>,
    /// Library loads (dlopen) of traced processes held until the library's unwind table was in.
    #[serde(default)]
    pub library_loads_held: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ProcessSummary {
    pub pid: u32,
    pub comm: String,
    /// The program file, where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executable: Option<PathBuf>,
    /// Its cgroup path, where known (model/identity.rs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// The container and pod its cgroup names: `id`, `pod_uid`, `cgroup`, and `pod`,
    /// `namespace`, `name` where the container runtime said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<Container>,
    pub allocator: PathBuf,
    pub allocator_kind: String,
    /// Whether the process ended during the run (its figures are final).
    pub exited: bool,
    /// The kernel's totals: allocations, frees, allocated, freed, live and peak bytes, untracked
    /// and failed calls, lost events, temporary allocations and bytes, and the frees the
    /// allocator's library made itself of blocks it did not hand out through a probed call
    /// (`allocator_internal_frees`: glibc's tcache flush at thread exit, not untracked frees).
    #[serde(flatten)]
    pub stats: ProcessStats,
    pub rss_bytes: u64,
    /// The process's memory level by level, as last read (`levels.rs` says what each means).
    pub memory: MemorySummary,
    /// Stacks taken, by why the unwinder ended them (`whole`: at the outermost frame), and stacks
    /// whose interpreter frames ended short, by why (`interpreter_unreadable`,
    /// `interpreter_depth_limit`).
    pub unwind_stops: BTreeMap<String, u64>,
    /// Bytes per subsystem, as the process last reported them (memtrace:report_total/report_delta).
    pub subsystems: BTreeMap<String, i64>,
    /// Each `--usdt` option (as written): its hits and, for `=argN`, the argument's latest value.
    pub usdt: BTreeMap<String, UsdtProbeCounter>,
    /// The call stacks holding the most leaked bytes, most first.
    pub leaks: Vec<Leak>,
    /// Bytes per function, inclusive and exclusive, most live (inclusive) first.
    pub functions: Vec<FunctionTotals>,
    /// Every call stack that allocated, with its totals (empty with --no-stacks; for a process
    /// that exited under --all, the stacks its report shows).
    #[serde(default, serialize_with = "one_line_each")]
    pub stacks: Vec<StackSummary>,
    /// Its memory levels and subsystems at every sample (at most `MAX_TIMELINE_POINTS`).
    #[serde(default, serialize_with = "one_line_each")]
    pub timeline: Vec<TimelinePoint>,
    /// When its live heap was highest at a sample, and the stacks that held it then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak: Option<PeakSummary>,
    /// The kernel's OOM killer ended it: when, where, and what it held then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_kill: Option<OomKillSummary>,
    /// `--window`: what each recorded allocation of its figures stands for (its user CPU time over
    /// that inside windows, or the run's wall-time weight; as of its last reading).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_weight: Option<f64>,
    /// `--window`: its user CPU time inside windows and in all (`inside_s`, `total_s`), which
    /// its weight is worked out from where there is enough inside.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_cpu: Option<UserCpu>,
}

/// A process the kernel's OOM killer ended (model/oom.rs).
#[derive(Debug, Serialize, Deserialize)]
pub struct OomKillSummary {
    /// Seconds since tracing began.
    pub at_s: f64,
    /// Its memory cgroup (path in the memory controller's hierarchy); null where unread.
    pub cgroup: Option<String>,
    /// The lowest memory limit on that cgroup or an ancestor; null where none is set.
    pub limit_bytes: Option<u64>,
    /// The live heap at the kill.
    pub live_bytes: i64,
    pub live_allocations: i64,
    /// Resident bytes at the kill; null where unread.
    pub rss_bytes: Option<u64>,
    /// The stacks that held the most at the kill, most first.
    #[serde(serialize_with = "one_line_each")]
    pub stacks: Vec<PeakStack>,
}

/// A process's memory levels, and its allocator's free pool by size class where it was measured.
#[derive(Debug, Serialize, Deserialize)]
pub struct MemorySummary {
    #[serde(flatten)]
    pub levels: MemoryLevels,
    /// glibc arenas: the main one and each thread arena (0 for other allocators).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator_arenas: Option<u32>,
    /// The gaps between live blocks in the allocator's mappings by power-of-two size class, with
    /// their resident whole pages (which add up to allocator_free_resident_bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator_free_by_size: Option<Vec<FreeClass>>,
    /// When the free pool was measured, in seconds since tracing began (within a budget: it may
    /// be older than the other levels).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator_free_measured_at_s: Option<f64>,
}

impl MemorySummary {
    fn of(process: &Process) -> Self {
        let pool = process.free_pool.as_ref();
        Self {
            levels: process.memory,
            allocator_arenas: pool.map(|pool| pool.arenas),
            allocator_free_by_size: pool.map(|pool| pool.classes.clone()),
            allocator_free_measured_at_s: pool.map(|pool| pool.measured_at_us as f64 / 1e6),
        }
    }

    /// The free pool again, as a saved summary holds it.
    pub fn free_pool(&self) -> Option<FreePool> {
        let classes = self.allocator_free_by_size.clone()?;
        let measured_at_us = (self.allocator_free_measured_at_s.unwrap_or_default() * 1e6).round() as u64;
        Some(FreePool { arenas: self.allocator_arenas.unwrap_or_default(), classes, measured_at_us })
    }
}

/// One call stack of a process and what it allocated, held and leaked.
#[derive(Debug, Serialize, Deserialize)]
pub struct StackSummary {
    /// Indices into `frame_table`, innermost first.
    pub frame_ids: Vec<u32>,
    #[serde(flatten)]
    pub totals: StackTotals,
    pub leaked_bytes: u64,
    pub leaked_allocations: u64,
    /// Age of its oldest live block at the end of the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_age_s: Option<f64>,
}

/// The heap at its highest sample (heaptrack's peak memory consumers), at interval resolution.
#[derive(Debug, Serialize, Deserialize)]
pub struct PeakSummary {
    pub live_bytes: i64,
    /// Seconds since tracing began.
    pub at_s: f64,
    /// The stacks with live bytes then, most first.
    #[serde(serialize_with = "one_line_each")]
    pub stacks: Vec<PeakStack>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct PeakStack {
    pub live_bytes: i64,
    pub live_allocations: i64,
    /// Function names, innermost first.
    pub stack: Vec<String>,
    /// Indices into `frame_table`, innermost first.
    pub frame_ids: Vec<u32>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Leak {
    pub bytes: u64,
    pub allocations: u64,
    /// Function names, innermost first, starting at the allocator's caller.
    pub stack: Vec<String>,
    pub oldest_age_s: f64,
    pub frames: Vec<Frame>,
}

impl Summary {
    pub fn of(model: &Model, end: RunEnd, top: usize) -> Self {
        let mut table = FrameTable::default();
        let processes = model.every_process().map(|p| ProcessSummary::of(p, top, &mut table)).collect();
        Self {
            version: SUMMARY_VERSION,
            duration_s: seconds(end.duration),
            lost_events: model.lost_events(),
            processes,
            kernel_maps: model.kernel_maps,
            sampling: model.sampling,
            app_sampled: model.app_sampled,
            windows: model.windows,
            frame_table: table.frames,
            folded: model.folded_by_count().into_iter().cloned().collect(),
            single_stepped: model.single_stepped.clone(),
            library_loads_held: model.library_loads_held,
        }
    }
}

impl ProcessSummary {
    fn of(process: &Process, top: usize, table: &mut FrameTable) -> Self {
        let stats = &process.stats;
        Self {
            pid: process.identity.pid,
            comm: process.identity.comm.clone(),
            executable: process.identity.executable.clone(),
            cgroup: process.identity.cgroup.clone(),
            container: process.identity.container.clone(),
            allocator: process.allocator.clone(),
            allocator_kind: process.allocator_kind.clone(),
            exited: process.exited,
            stats: *stats,
            rss_bytes: process.memory.rss_bytes(),
            memory: MemorySummary::of(process),
            unwind_stops: unwind_stop::NAMES
                .iter()
                .zip(stats.unwind_stops)
                .chain(interpreter_stop::NAMES.iter().zip(stats.interpreter_stops))
                .map(|(name, count)| (name.to_string(), count))
                .collect(),
            subsystems: process.usdt.subsystems.clone(),
            usdt: process.usdt.probes.clone(),
            leaks: process.leaks(top).map(Leak::of).collect(),
            functions: process.function_totals(),
            stacks: process.stacks.iter().map(|stack| StackSummary::of(stack, table)).collect(),
            timeline: process.timeline.clone(),
            peak: process.peak.as_ref().map(|peak| PeakSummary::of(peak, table)),
            oom_kill: process.oom_kill.as_ref().map(|kill| OomKillSummary::of(kill, table)),
            window_weight: process.window_weight,
            window_cpu: process.window_cpu,
        }
    }
}

impl OomKillSummary {
    fn of(kill: &OomKill, table: &mut FrameTable) -> Self {
        Self {
            at_s: kill.ts_us as f64 / 1e6,
            cgroup: kill.cgroup.clone(),
            limit_bytes: kill.limit_bytes,
            live_bytes: kill.live_bytes,
            live_allocations: kill.live_allocations,
            rss_bytes: kill.rss_bytes,
            stacks: kill
                .stacks
                .iter()
                .map(|stack| {
                    PeakStack::of_frames(&stack.frames, stack.live_bytes, stack.live_allocations, table)
                })
                .collect(),
        }
    }
}

impl StackSummary {
    fn of(stack: &StackProfile, table: &mut FrameTable) -> Self {
        Self {
            frame_ids: table.ids(&stack.frames),
            totals: stack.totals,
            leaked_bytes: stack.leaked_bytes,
            leaked_allocations: stack.leaked_allocations,
            oldest_age_s: stack.oldest_age.map(seconds),
        }
    }
}

impl PeakSummary {
    fn of(peak: &HeapPeak, table: &mut FrameTable) -> Self {
        Self {
            live_bytes: peak.heap_live_bytes,
            at_s: peak.ts_us as f64 / 1e6,
            stacks: peak.consumers.iter().map(|consumer| PeakStack::of(consumer, table)).collect(),
        }
    }
}

impl PeakStack {
    fn of(consumer: &PeakConsumer, table: &mut FrameTable) -> Self {
        Self::of_frames(&consumer.frames, consumer.live_bytes, consumer.live_allocations, table)
    }

    fn of_frames(
        frames: &[Arc<Frame>],
        live_bytes: i64,
        live_allocations: i64,
        table: &mut FrameTable,
    ) -> Self {
        Self {
            live_bytes,
            live_allocations,
            stack: frames.iter().map(|frame| frame.name()).collect(),
            frame_ids: table.ids(frames),
        }
    }
}

impl Leak {
    fn of(stack: &StackProfile) -> Self {
        Self {
            bytes: stack.leaked_bytes,
            allocations: stack.leaked_allocations,
            stack: stack.frames.iter().map(|frame| frame.name()).collect(),
            oldest_age_s: stack.oldest_age.map_or(0.0, seconds),
            frames: stack.frames.iter().map(|frame| Frame::clone(frame)).collect(),
        }
    }
}

/// The summary's `frame_table`: each distinct frame once, in the order first met.
#[derive(Default)]
struct FrameTable {
    frames: Vec<Frame>,
    ids: HashMap<Arc<Frame>, u32>,
}

impl FrameTable {
    fn ids(&mut self, frames: &[Arc<Frame>]) -> Vec<u32> {
        frames
            .iter()
            .map(|frame| {
                *self.ids.entry(Arc::clone(frame)).or_insert_with(|| {
                    self.frames.push(Frame::clone(frame));
                    (self.frames.len() - 1) as u32
                })
            })
            .collect()
    }
}

/// Writes each entry of a long list as one compact line of JSON, in a file otherwise indented for
/// people to read: a run's thousands of stacks and timeline points stay a line each.
fn one_line_each<T: Serialize, S: Serializer>(items: &[T], serializer: S) -> Result<S::Ok, S::Error> {
    use serde::ser::{Error, SerializeSeq};
    let mut list = serializer.serialize_seq(Some(items.len()))?;
    for item in items {
        let line = serde_json::to_string(item).map_err(S::Error::custom)?;
        let raw = serde_json::value::RawValue::from_string(line).map_err(S::Error::custom)?;
        list.serialize_element(&raw)?;
    }
    list.end()
}

/// Seconds, to the millisecond.
fn seconds(duration: Duration) -> f64 {
    (duration.as_secs_f64() * 1000.0).round() / 1000.0
}

/// Writes the summary at the end of the run into a file opened at the start, so that an unwritable
/// path is reported before anything is traced.
pub struct SummaryFile {
    file: OutputFile,
    /// How many leaking stacks to list per process.
    top: usize,
}

impl SummaryFile {
    pub fn create(path: &Path, top: usize) -> Result<Self> {
        Ok(Self { file: OutputFile::create(path, "summary", "--summary")?, top })
    }
}

impl Exporter for SummaryFile {
    fn written(&self) -> Option<String> {
        Some(format!("summary written to {}", self.file.path().display()))
    }

    fn finish(&mut self, model: &Model, end: RunEnd) -> Result<()> {
        let mut text = serde_json::to_string_pretty(&Summary::of(model, end, self.top))?;
        text.push('\n');
        self.file.commit(|file| file.write_all(text.as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_has_the_contract_fields() {
        let mut model = Model::default();
        model.add_process(
            crate::model::identity::ProcessIdentity::new(7, "server".into()),
            "/lib/libc.so.6".into(),
        );
        let process = model.processes.get_mut(&7).unwrap();
        process.stats.allocations = 10;
        process.stats.live_bytes = 100;
        process.stats.lost_events = 2;
        model.unattributed_lost_events = 1;
        let value =
            serde_json::to_value(Summary::of(&model, RunEnd { duration: Duration::from_millis(1500) }, 10))
                .unwrap();
        assert_eq!(value["version"], 1);
        assert_eq!(value["duration_s"], 1.5);
        assert_eq!(value["lost_events"], 3);
        let process = &value["processes"][0];
        for field in [
            "pid",
            "comm",
            "allocations",
            "frees",
            "allocated_bytes",
            "freed_bytes",
            "live_allocations",
            "live_bytes",
            "peak_live_bytes",
            "untracked_frees",
            "failed_allocations",
            "rss_bytes",
            "subsystems",
            "leaks",
        ] {
            assert!(process.get(field).is_some(), "missing {field}");
        }
        assert_eq!(process["comm"], "server");
        assert_eq!(process["allocations"], 10);
    }
}
