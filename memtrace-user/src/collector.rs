//! Reads the kernel's maps and /proc into the model, for every process at one moment, and at the end
//! of the run turns the kernel's stacks into symbolized per-stack profiles.

use std::{collections::HashMap, time::Duration};

use anyhow::Result;
use memtrace_common::{StackKey, StackTotals};

use crate::{
    model::{Model, StackProfile},
    probes::Probes,
    procfs,
    symbolize::StackSymbolizer,
};

#[derive(Default)]
pub struct Collector {
    symbolizer: StackSymbolizer,
}

impl Collector {
    pub fn sample(&mut self, probes: &Probes, model: &mut Model) -> Result<()> {
        for process in model.processes.values_mut() {
            if process.released {
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
                for mapping in &mappings {
                    self.symbolizer.index(&procfs::in_root_of(process.pid, &mapping.path), &mapping.path);
                }
                process.mappings = mappings;
            }
        }
        model.unattributed_lost_events = probes.unattributed_lost_events()?;
        crate::usdt::collect(probes, model)?;
        Ok(())
    }

    /// Makes an object file of a process known: `readable` is where to open it now (through
    /// /proc/PID/root), `path` where it stays after the process exits.
    pub fn index_object_of_process(&mut self, readable: &std::path::Path, path: &std::path::Path) {
        self.symbolizer.index(readable, path);
    }

    /// Makes an object file known before the process maps it (a command's executable, its allocator).
    pub fn index_object(&mut self, path: &std::path::Path) {
        self.symbolizer.index(path, path);
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
