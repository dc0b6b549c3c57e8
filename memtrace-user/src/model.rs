//! What memtrace knows about each traced process, as of the latest sample.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use memtrace_common::ProcessStats;

#[derive(Debug, Clone)]
pub struct Process {
    pub pid: u32,
    pub comm: String,
    /// The object whose allocator entry points are probed.
    pub allocator: PathBuf,
    pub stats: ProcessStats,
    /// Last resident set size read while the process was alive.
    pub rss_bytes: u64,
    pub exited: bool,
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
    pub processes: BTreeMap<u32, Process>,
    /// Losses the kernel could not charge to a process.
    pub unattributed_lost_events: u64,
}

impl Model {
    pub fn add_process(&mut self, pid: u32, comm: String, allocator: PathBuf) {
        self.processes.insert(
            pid,
            Process {
                pid,
                comm,
                allocator,
                stats: ProcessStats::default(),
                rss_bytes: 0,
                exited: false,
            },
        );
    }

    pub fn lost_events(&self) -> u64 {
        self.unattributed_lost_events
            + self
                .processes
                .values()
                .map(|p| p.stats.lost_events)
                .sum::<u64>()
    }
}

/// How a run ended, for the exporters' closing words.
#[derive(Debug, Clone, Copy)]
pub struct RunEnd {
    pub duration: Duration,
}
