//! The machine-readable end of a run (`--summary PATH`), in the format of the output contract.

use std::{
    collections::BTreeMap,
    io::Write,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Result;
use memtrace_common::unwind_stop;
use serde::Serialize;

use super::{output_file::OutputFile, Exporter};
use crate::levels::MemoryLevels;
use crate::model::{KernelMaps, Model, Process, RunEnd, Sampling, StackProfile};

pub const SUMMARY_VERSION: u32 = 1;

#[derive(Debug, Serialize)]
pub struct Summary {
    pub version: u32,
    pub duration_s: f64,
    pub lost_events: u64,
    pub processes: Vec<ProcessSummary>,
    /// System-wide runs: how full the kernel's tables were, to show they stay bounded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel_maps: Option<KernelMaps>,
    /// `--sample`: the mean bytes between samples and which figures are estimates.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sampling: Option<Sampling>,
}

#[derive(Debug, Serialize)]
pub struct ProcessSummary {
    pub pid: u32,
    pub comm: String,
    pub allocator: PathBuf,
    pub allocator_kind: String,
    /// Whether the process ended during the run (its figures are final).
    pub exited: bool,
    pub allocations: u64,
    pub frees: u64,
    pub allocated_bytes: u64,
    pub freed_bytes: u64,
    pub live_allocations: i64,
    pub live_bytes: i64,
    pub peak_live_bytes: i64,
    pub untracked_frees: u64,
    pub failed_allocations: u64,
    pub lost_events: u64,
    pub rss_bytes: u64,
    /// The process's memory level by level, as last read (`levels.rs` says what each means).
    pub memory: MemoryLevels,
    /// Allocations freed before their thread allocated anything else, and their bytes.
    pub temporary_allocations: u64,
    pub temporary_bytes: u64,
    /// Stacks taken, by why the unwinder ended them (`whole`: at the outermost frame).
    pub unwind_stops: BTreeMap<&'static str, u64>,
    /// Bytes per subsystem, as the process last reported them (memtrace:report_total/report_delta).
    pub subsystems: BTreeMap<String, i64>,
    /// Each `--usdt` option (as written): its hits and, for `=argN`, the argument's latest value.
    pub usdt: BTreeMap<String, UsdtCounterSummary>,
    /// The call stacks holding the most leaked bytes, most first.
    pub leaks: Vec<Leak>,
    /// Bytes per function, inclusive and exclusive, most live (inclusive) first.
    pub functions: Vec<FunctionSummary>,
}

#[derive(Debug, Serialize)]
pub struct UsdtCounterSummary {
    pub hits: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<i64>,
}

#[derive(Debug, Serialize)]
pub struct Leak {
    pub bytes: u64,
    pub allocations: u64,
    /// Function names, innermost first, starting at the allocator's caller.
    pub stack: Vec<String>,
    pub oldest_age_s: f64,
    pub frames: Vec<FrameSummary>,
}

#[derive(Debug, Serialize)]
pub struct FrameSummary {
    pub function: Option<String>,
    pub file: Option<String>,
    pub line: Option<u32>,
    pub module: String,
    pub offset: u64,
}

#[derive(Debug, Serialize)]
pub struct FunctionSummary {
    pub name: String,
    pub live_inclusive_bytes: i64,
    pub live_exclusive_bytes: i64,
    pub allocated_inclusive_bytes: u64,
    pub allocated_exclusive_bytes: u64,
}

impl Summary {
    pub fn of(model: &Model, end: RunEnd, top: usize) -> Self {
        Self {
            version: SUMMARY_VERSION,
            duration_s: seconds(end.duration),
            lost_events: model.lost_events(),
            processes: model.every_process().map(|p| ProcessSummary::of(p, top)).collect(),
            kernel_maps: model.kernel_maps,
            sampling: model.sampling,
        }
    }
}

impl ProcessSummary {
    fn of(process: &Process, top: usize) -> Self {
        let stats = &process.stats;
        Self {
            pid: process.pid,
            comm: process.comm.clone(),
            allocator: process.allocator.clone(),
            allocator_kind: process.allocator_kind.clone(),
            exited: process.exited,
            allocations: stats.allocations,
            frees: stats.frees,
            allocated_bytes: stats.allocated_bytes,
            freed_bytes: stats.freed_bytes,
            live_allocations: stats.live_allocations,
            live_bytes: stats.live_bytes,
            peak_live_bytes: stats.peak_live_bytes,
            untracked_frees: stats.untracked_frees,
            failed_allocations: stats.failed_allocations,
            lost_events: stats.lost_events,
            rss_bytes: process.memory.rss_bytes(),
            memory: process.memory,
            temporary_allocations: stats.temporary_allocations,
            temporary_bytes: stats.temporary_bytes,
            unwind_stops: unwind_stop::NAMES.iter().copied().zip(stats.unwind_stops).collect(),
            subsystems: process.usdt.subsystems.clone(),
            usdt: process
                .usdt
                .probes
                .iter()
                .map(|(label, counter)| {
                    (label.clone(), UsdtCounterSummary { hits: counter.hits, value: counter.value })
                })
                .collect(),
            leaks: process.leaks(top).map(Leak::of).collect(),
            functions: process
                .function_totals()
                .into_iter()
                .map(|f| FunctionSummary {
                    name: f.name,
                    live_inclusive_bytes: f.live_inclusive_bytes,
                    live_exclusive_bytes: f.live_exclusive_bytes,
                    allocated_inclusive_bytes: f.allocated_inclusive_bytes,
                    allocated_exclusive_bytes: f.allocated_exclusive_bytes,
                })
                .collect(),
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
            frames: stack
                .frames
                .iter()
                .map(|f| FrameSummary {
                    function: f.function.clone(),
                    file: f.file.clone(),
                    line: f.line,
                    module: f.module.clone(),
                    offset: f.offset,
                })
                .collect(),
        }
    }
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
        model.add_process(7, "server".into(), "/lib/libc.so.6".into());
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
