//! Reads the kernel's maps and /proc into the model, for every process at one moment, and at the end
//! of the run turns the kernel's stacks into symbolized per-stack profiles.

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    time::Duration,
};

use anyhow::Result;
use memtrace_common::{StackKey, StackTotals};

use crate::{
    model::{Model, StackProfile},
    probes::Probes,
    process::{open_mapping, ObjectFile, Root},
    procfs::{self, Mapping},
    symbolize::StackSymbolizer,
};

#[derive(Default)]
pub struct Collector {
    symbolizer: StackSymbolizer,
    /// The mapped paths of each live process already indexed for symbols, so that a file is
    /// opened once per process, not at every sample.
    indexed: HashMap<u32, HashSet<PathBuf>>,
}

impl Collector {
    pub fn sample(&mut self, probes: &Probes, model: &mut Model) -> Result<()> {
        for process in model.processes.values_mut() {
            if process.released {
                self.indexed.remove(&process.pid);
                continue;
            }
            process.stats = probes.stats(process.pid)?;
            if process.stats.exited != 0 {
                process.exited = true;
            }
            if process.exited {
                continue;
            }
            // The process may exit between the reads; keep what was last seen.
            if let Some(rss) = procfs::rss_bytes(process.pid) {
                process.rss_bytes = rss;
            }
            if let Some(comm) = procfs::comm(process.pid) {
                process.comm = comm;
            }
            if let Ok(mappings) = procfs::mappings(process.pid) {
                self.index_mappings(process.pid, &mappings);
                process.mappings = mappings;
            }
        }
        model.unattributed_lost_events = probes.unattributed_lost_events()?;
        crate::usdt::collect(probes, model)?;
        Ok(())
    }

    /// Indexes the files of a process's mappings that are new since the last sample.
    fn index_mappings(&mut self, pid: u32, mappings: &[Mapping]) {
        let indexed = self.indexed.entry(pid).or_default();
        let mut root = None;
        // Stacks point into code: only executable mappings hold it.
        for mapping in mappings.iter().filter(|mapping| mapping.executable) {
            if indexed.contains(&mapping.path) {
                continue;
            }
            indexed.insert(mapping.path.clone());
            let Some(root) = root.get_or_insert_with(|| Root::of_process(pid).ok()) else { return };
            if let Ok(object) = open_mapping(pid, root, mapping) {
                self.symbolizer.index(&object);
            }
        }
    }

    /// Makes an object file of a process known, e.g. before the process maps it (a command's
    /// executable, its allocator) or while a short-lived program's files are still open.
    pub fn index_object(&mut self, object: &ObjectFile) {
        self.symbolizer.index(object);
    }

    /// Fills in every process's stacks; live blocks younger than `older` do not count as leaked.
    pub fn collect_stacks(
        &mut self,
        probes: &Probes,
        model: &mut Model,
        older: Duration,
        of_process: impl Fn(u32) -> bool,
    ) -> Result<()> {
        let now_ns = monotonic_now_ns();
        // Records from before a process's current program image (it exec'd) are not its own.
        let image_start = |tgid: u32| model.processes.get(&tgid).map(|p| p.stats.started_ns);
        let current = |tgid: u32, since_ns: u64| image_start(tgid).is_some_and(|start| since_ns >= start);
        let mut leaked: HashMap<StackKey, Leaked> = HashMap::new();
        for (key, allocation) in probes.live_allocations()? {
            if !of_process(key.tgid) || !current(key.tgid, allocation.timestamp_ns) {
                continue;
            }
            let stack = StackKey { tgid: key.tgid, _pad: 0, stack: allocation.stack };
            let entry = leaked.entry(stack).or_default();
            let age = Duration::from_nanos(now_ns.saturating_sub(allocation.timestamp_ns));
            entry.oldest_age = entry.oldest_age.max(Some(age));
            if age >= older {
                entry.bytes += allocation.size;
                entry.allocations += 1;
            }
        }
        let mut totals: HashMap<StackKey, StackTotals> = probes
            .stack_totals()?
            .into_iter()
            .filter(|(key, totals)| current(key.tgid, totals.started_ns))
            .collect();
        for key in leaked.keys() {
            totals.entry(*key).or_default();
        }
        for (key, totals) in totals {
            if !of_process(key.tgid) {
                continue;
            }
            let Some(process) = model.processes.get_mut(&key.tgid) else {
                continue;
            };
            let Some(stack) = probes.stack(key.stack)? else {
                continue;
            };
            let leak = leaked.get(&key).copied().unwrap_or_default();
            process.stacks.push(StackProfile {
                frames: self.symbolizer.resolve(&stack, &process.mappings),
                totals,
                leaked_bytes: leak.bytes,
                leaked_allocations: leak.allocations,
                oldest_age: leak.oldest_age,
            });
        }
        for process in model.processes.values_mut() {
            process.stacks.sort_by(|a, b| {
                (b.leaked_bytes, b.totals.allocated_bytes).cmp(&(a.leaked_bytes, a.totals.allocated_bytes))
            });
        }
        Ok(())
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Leaked {
    bytes: u64,
    allocations: u64,
    oldest_age: Option<Duration>,
}

/// CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns.
fn monotonic_now_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes only the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}
