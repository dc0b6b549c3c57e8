//! Reads the kernel's maps and /proc into the model, for every process at one moment, and at the end
//! of the run turns the kernel's stacks into symbolized per-stack profiles.

mod cut_stacks;
mod estimates;
pub mod oom;
pub mod owners;
pub mod peaks;
pub mod skipped_exits;
pub mod stack_table;
pub mod symbolize;
pub mod unwind;

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Result;
use memtrace_common::{ProcessStats, StackKey, StackTotals};

use crate::{
    attach::usdt::UsdtProbes,
    collect::cut_stacks::{merge_cut_consumers, merge_cut_stacks, merge_into_whole},
    collect::estimates::{apply_estimate, estimate_live, scale_totals, LiveEstimate},
    collect::owners::{classify::SeenMapping, free_pool::LiveBlock, OwnersReader},
    collect::peaks::PeakTracker,
    collect::skipped_exits::SkippedExits,
    collect::stack_table::StackTable,
    collect::symbolize::StackSymbolizer,
    interpreters::InterpreterNames,
    kernel::{Probes, Stack},
    model::{
        estimate::Estimator,
        frame::Frame,
        levels::{MemoryLevels, OsMemory},
        oom::{KillStack, OOM_STACKS},
        size_classes::usable_size,
        HeapPeak, Model, PeakConsumer, Process, StackProfile,
    },
    process::procfs::{self, Mapping},
    process::{open_mapping, ObjectFile, Root},
};

#[derive(Default)]
pub struct Collector {
    symbolizer: StackSymbolizer,
    /// The mapped paths of each live process already indexed for symbols, so that a file is
    /// opened once per process, not at every sample.
    indexed: HashMap<u32, HashSet<PathBuf>>,
    /// What the kernel's stack tables held, taken out at every sample.
    stacks: StackTable,
    /// The names of the interpreter frames (Python code objects, Perl subs) the stacks hold.
    interpreters: InterpreterNames,
    /// Each process's highest heap at a sample, and its stacks then.
    peaks: PeakTracker,
    /// What exits the kernel skipped left undone.
    skipped_exits: SkippedExits,
    /// Who owns each process's resident pages, and its allocator's free pool.
    owners: OwnersReader,
    /// The run's last sample: the free pool is measured whatever its budget says.
    last_sample: bool,
    /// Each process's `heap_rounding_bytes`, measured with its free pool.
    rounding: HashMap<u32, u64>,
    /// Each process's VmSize when its /proc/PID/maps was last read at a sample, when, and its brk
    /// heap then (`maps_unchanged`).
    maps_read: HashMap<u32, (u64, Instant, u64)>,
    /// When each process's mappings were first read between samples (`read_mappings`).
    maps_first_read: HashMap<u32, Instant>,
}

/// How long after its mappings were first read a process's are read between samples too.
const YOUNG: Duration = Duration::from_secs(2);

/// How long a process's mappings are taken as they were while its address space keeps its size.
const MAPS_REREAD: Duration = Duration::from_secs(10);

impl Collector {
    /// `rss_is_exact`: the kernel's RSS counters move with every page (kernel::features's
    /// ExactRssCounters), so a process's pages are read again only when they moved.
    pub fn new(rss_is_exact: bool) -> Self {
        Self { owners: OwnersReader::new(rss_is_exact), ..Self::default() }
    }

    /// Reads every traced process as of now, `ts_us` into the run.
    pub fn sample(
        &mut self,
        probes: &Probes,
        usdt: &UsdtProbes,
        model: &mut Model,
        ts_us: u64,
    ) -> Result<()> {
        let mut read = HashMap::new();
        for process in model.processes.values().filter(|process| !process.released) {
            read.insert(process.identity.pid, probes.stats(process.identity.pid)?);
        }
        let estimators = model.estimators();
        let image_start = |tgid: u32| read.get(&tgid).map(|stats: &ProcessStats| stats.started_ns);
        // Sampling weighs each block by its size, so the live table is read; under windows every
        // block of a process weighs the same, and the kernel's counts of what was recorded serve.
        let sampled = match estimators.of(None) {
            Some(poisson @ Estimator::Poisson(_)) => Some(estimate_live(probes, poisson, image_start)?),
            _ => None,
        };
        let mut seen = SeenMappings::default();
        for process in model.processes.values_mut() {
            let Some(stats) = read.get(&process.identity.pid).filter(|_| !process.released) else {
                continue;
            };
            let previous_peak = process.stats.peak_live_bytes;
            process.stats = *stats;
            let estimator = estimators.of(process.window_cpu);
            if let Some(estimator) = estimator {
                let live = match &sampled {
                    Some(sampled) => sampled.get(&process.identity.pid).copied().unwrap_or_default(),
                    None => LiveEstimate::of_recorded(stats, estimator),
                };
                apply_estimate(&mut process.stats, estimator, live, previous_peak);
                process.window_weight = estimator.window_weight();
            }
            if process.stats.exited != 0 {
                process.exited = true;
            }
            // The kernel names the process as it first allocated after its last exec, and at exit.
            if let Some(comm) = crate::model::kernel_comm(&process.stats) {
                process.identity.rename(comm);
            }
            self.read_levels(process, !estimators.any(), &mut seen, probes);
        }
        self.measure_free_pools(probes, model, ts_us)?;
        let live =
            self.stacks.drain(probes, |tgid| model.processes.get(&tgid).map(|p| p.stats.started_ns))?;
        self.interpreters.drain(probes)?;
        self.peaks.record(model, &live, ts_us);
        self.read_oom_kills(probes, model, &live)?;
        // Read once for the sample: each program's statistics are a syscall.
        let skipped = probes.skipped_runs()?;
        self.skipped_exits.recover(probes, skipped.exits(), model)?;
        model.unattributed_lost_events =
            probes.global_lost_events()? + skipped.lost() + self.skipped_exits.lost();
        usdt.collect(probes, model)?;
        Ok(())
    }

    /// A process's memory levels: read from /proc and its pages' owners while it runs; at its
    /// exit, what the kernel counted then, with the owners last read.
    fn read_levels(&mut self, process: &mut Process, exact: bool, seen: &mut SeenMappings, probes: &Probes) {
        let whole = exact && every_block_seen(process);
        if process.exited {
            let owners = self.owners.last(process.identity.pid, whole);
            // What the kernel counted as it exited, else what was last seen.
            if let Some(memory) = MemoryLevels::at_exit(&process.stats, procfs::page_size(), owners) {
                process.memory = memory;
                process.memory.heap_rounding_bytes = self.rounding(process.identity.pid, whole);
            }
            return;
        }
        // The process may exit between the reads; keep what was last seen.
        let os = procfs::os_memory(process.identity.pid);
        let brk_heap_bytes = match os.and_then(|os| self.maps_unchanged(process.identity.pid, os)) {
            Some(brk_heap_bytes) => Some(brk_heap_bytes),
            None => self.read_mappings_of(process, os),
        };
        if let (Some(os), Some(brk_heap_bytes)) = (os, brk_heap_bytes) {
            let owners =
                self.owners.read(process.identity.pid, os, whole, || seen.of(probes, process.identity.pid));
            process.memory = MemoryLevels::of(os, &process.stats, brk_heap_bytes, owners);
            process.memory.heap_rounding_bytes = self.rounding(process.identity.pid, whole);
            process.free_pool = self.owners.free_pool(process.identity.pid).filter(|_| whole).cloned();
        }
        if let Some(comm) = procfs::comm(process.identity.pid) {
            process.identity.rename(comm);
        }
    }

    /// A process's `heap_rounding_bytes` as last measured, where every live block was seen.
    fn rounding(&self, pid: u32, whole: bool) -> Option<u64> {
        self.rounding.get(&pid).copied().filter(|_| whole)
    }

    /// The run's next sample is its last: its free pools are measured whatever the budget.
    pub fn last_sample_next(&mut self) {
        self.last_sample = true;
    }

    /// Measures the allocator's free pool of every running process whose every live block is in
    /// the kernel's table, when the budget allows (collect/owners/mod.rs).
    fn measure_free_pools(&mut self, probes: &Probes, model: &mut Model, ts_us: u64) -> Result<()> {
        if model.estimators().any() || !self.owners.free_pool_due(self.last_sample) {
            return Ok(());
        }
        let wanted: HashMap<u32, u64> = model
            .processes
            .values()
            .filter(|p| !p.exited && !p.released && every_block_seen(p))
            .map(|p| (p.identity.pid, p.stats.started_ns))
            .collect();
        if wanted.is_empty() {
            return Ok(());
        }
        let started = owners::CpuTime::now();
        let mut blocks: HashMap<u32, Vec<LiveBlock>> = HashMap::new();
        for (key, allocation) in probes.live_allocations()? {
            // Records from before the process's current image are not its own.
            if wanted.get(&key.tgid).is_some_and(|&image_start| allocation.timestamp_ns >= image_start) {
                let block = LiveBlock { address: key.address, size: allocation.size };
                blocks.entry(key.tgid).or_default().push(block);
            }
        }
        let measured: Vec<(u32, Vec<LiveBlock>, u64)> = wanted
            .keys()
            .map(|&pid| {
                let mut blocks = blocks.remove(&pid).unwrap_or_default();
                blocks.sort_unstable();
                let kind = &model.processes[&pid].allocator_kind;
                match rounding_of(kind, &blocks) {
                    Some(bytes) => self.rounding.insert(pid, bytes),
                    None => self.rounding.remove(&pid),
                };
                (pid, blocks, chunk_header(kind))
            })
            .collect();
        self.owners.measure_free_pools(measured, started, ts_us);
        for (&pid, process) in model.processes.iter_mut().filter(|(pid, _)| wanted.contains_key(pid)) {
            process.memory.allocator_free_resident_bytes =
                self.owners.last(pid, true).and_then(|o| o.allocator_free);
            process.memory.heap_rounding_bytes = self.rounding.get(&pid).copied();
            process.free_pool = self.owners.free_pool(pid).cloned();
        }
        Ok(())
    }

    /// Reads the mappings of every young live process again, between samples (for unwind
    /// tables: a program starting up maps its libraries); returns whether any was young. A
    /// process is young for YOUNG after its mappings were first read; older ones are read at the
    /// samples, when their address space moved.
    pub fn read_mappings(&mut self, model: &mut Model) -> bool {
        let mut young = false;
        for process in model.processes.values_mut().filter(|p| !p.exited && !p.released) {
            let first_read = self.maps_first_read.entry(process.identity.pid).or_insert_with(Instant::now);
            if first_read.elapsed() < YOUNG {
                young = true;
                self.read_mappings_of(process, None);
            }
        }
        young
    }

    /// The brk heap as last read, if /proc/PID/maps need not be read again: the address space
    /// (VmSize) is what it was then, and that was less than MAPS_REREAD ago. A mapping made or
    /// unmapped, a library loaded, the brk heap moved, all change VmSize; what does not (an
    /// mprotect, a mapping replaced by one of the same size) is seen within MAPS_REREAD.
    fn maps_unchanged(&self, pid: u32, os: OsMemory) -> Option<u64> {
        let (address_space, read_at, brk_heap_bytes) = *self.maps_read.get(&pid)?;
        (address_space == os.address_space_bytes && read_at.elapsed() < MAPS_REREAD).then_some(brk_heap_bytes)
    }

    /// A process's mappings as /proc shows them now, their new files indexed for symbols; the
    /// last ones seen stay when the process has gone. Returns the size of its brk heap.
    fn read_mappings_of(&mut self, process: &mut Process, os: Option<OsMemory>) -> Option<u64> {
        let maps = procfs::maps(process.identity.pid).ok()?;
        if let Some(os) = os {
            self.maps_read
                .insert(process.identity.pid, (os.address_space_bytes, Instant::now(), maps.brk_heap_bytes));
        }
        self.index_mappings(process.identity.pid, &maps.files);
        process.mappings = maps.files;
        Some(maps.brk_heap_bytes)
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

    /// Forgets the stacks of processes reported and released, and which files of theirs were
    /// indexed (a released process may leave the model at once, folded: this is its last word).
    pub fn forget(&mut self, probes: &Probes, tgids: &HashSet<u32>) -> Result<()> {
        for &tgid in tgids {
            self.peaks.forget(tgid);
            self.indexed.remove(&tgid);
            self.owners.forget(tgid);
            self.maps_read.remove(&tgid);
            self.maps_first_read.remove(&tgid);
            self.rounding.remove(&tgid);
        }
        self.interpreters.forget(tgids);
        self.stacks.forget(probes, tgids)
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
        let estimators = model.estimators();
        let estimator_of = |tgid: u32| estimators.of(model.processes.get(&tgid).and_then(|p| p.window_cpu));
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
                let weight =
                    estimator_of(key.tgid).map_or(1.0, |estimator| estimator.count_weight(allocation.size));
                entry.bytes += weight * allocation.size as f64;
                entry.allocations += weight;
            }
        }
        let mut totals = self.stacks.totals(probes, image_start)?;
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
            let Some(stack) = self.stacks.frames(probes, key.stack)? else {
                continue;
            };
            let leak = leaked.get(&key).copied().unwrap_or_default();
            let estimator = estimators.of(process.window_cpu);
            process.stacks.push(StackProfile {
                frames: self.resolve(key.tgid, &stack, &process.mappings),
                totals: estimator.map_or(totals, |estimator| scale_totals(estimator, totals)),
                leaked_bytes: leak.bytes.round() as u64,
                leaked_allocations: leak.allocations.round() as u64,
                oldest_age: leak.oldest_age,
            });
        }
        for process in model.processes.values_mut() {
            merge_cut_stacks(&mut process.stacks);
            process.stacks.sort_by(|a, b| {
                (b.leaked_bytes, b.totals.allocated_bytes).cmp(&(a.leaked_bytes, a.totals.allocated_bytes))
            });
        }
        self.symbolize_peaks(probes, model, of_process)
    }

    /// Gives each OOM victim whose heap is yet to be read its live heap and the stacks that held
    /// the most, from `live` as just read: the victim ran no allocator call after the kill, so its
    /// live blocks are those it had then, kept in the kernel's tables until its release.
    fn read_oom_kills(
        &mut self,
        probes: &Probes,
        model: &mut Model,
        live: &[(StackKey, StackTotals)],
    ) -> Result<()> {
        let estimators = model.estimators();
        for process in model.processes.values_mut() {
            let estimator = estimators.of(process.window_cpu);
            let Some(kill) = process.oom_kill.as_mut().filter(|kill| !kill.read) else { continue };
            let image_start = process.stats.started_ns;
            let mut held: Vec<&(StackKey, StackTotals)> = live
                .iter()
                .filter(|(key, totals)| {
                    key.tgid == process.identity.pid
                        && totals.live_bytes > 0
                        && totals.started_ns >= image_start
                })
                .collect();
            held.sort_by_key(|(_, totals)| std::cmp::Reverse(totals.live_bytes));
            held.truncate(OOM_STACKS);
            let mut stacks = Vec::with_capacity(held.len());
            for (key, totals) in held {
                let Some(frames) = self.stacks.frames(probes, key.stack)? else { continue };
                let totals = estimator.map_or(*totals, |estimator| scale_totals(estimator, *totals));
                stacks.push(PeakConsumer {
                    frames: self.resolve(process.identity.pid, &frames, &process.mappings),
                    live_bytes: totals.live_bytes,
                    live_allocations: totals.live_allocations,
                });
            }
            kill.live_bytes = process.stats.live_bytes;
            kill.live_allocations = process.stats.live_allocations;
            // Stacks cut short before the unwind tables were loaded join the whole ones they
            // begin, among the kill's own (the process's stacks are read at its release).
            let whole = stacks.iter().map(|stack| stack.frames.clone()).collect();
            kill.stacks = merge_into_whole(stacks, whole)
                .into_iter()
                .map(|PeakConsumer { frames, live_bytes, live_allocations }| KillStack {
                    frames,
                    live_bytes,
                    live_allocations,
                })
                .collect();
            kill.read = true;
        }
        Ok(())
    }

    /// A stack of process `tgid`, symbolized, its interpreter frames where they ran.
    fn resolve(&self, tgid: u32, stack: &Stack, mappings: &[Mapping]) -> Vec<Arc<Frame>> {
        let native = self.symbolizer.resolve(stack.frames(), mappings);
        self.interpreters.interleave(tgid, stack.frames(), native)
    }

    /// Gives each process the heap peak the samples saw, its stacks symbolized.
    fn symbolize_peaks(
        &mut self,
        probes: &Probes,
        model: &mut Model,
        of_process: impl Fn(u32) -> bool,
    ) -> Result<()> {
        let estimators = model.estimators();
        for process in model.processes.values_mut().filter(|p| of_process(p.identity.pid)) {
            let estimator = estimators.of(process.window_cpu);
            let Some(raw) = self.peaks.peak_of(process.identity.pid, process.stats.started_ns) else {
                continue;
            };
            let mut consumers = Vec::with_capacity(raw.stacks.len());
            for (stack, totals) in &raw.stacks {
                let Some(frames) = self.stacks.frames(probes, *stack)? else { continue };
                let totals = estimator.map_or(*totals, |estimator| scale_totals(estimator, *totals));
                consumers.push(PeakConsumer {
                    frames: self.resolve(process.identity.pid, &frames, &process.mappings),
                    live_bytes: totals.live_bytes,
                    live_allocations: totals.live_allocations,
                });
            }
            let consumers = merge_cut_consumers(consumers, &process.stacks);
            process.peak =
                Some(HeapPeak { ts_us: raw.ts_us, heap_live_bytes: raw.heap_live_bytes, consumers });
        }
        Ok(())
    }
}

/// Whether every live block of the process went through the probes (traced from its image's
/// start, nothing lost), so that its allocator's free pool can be measured; sampling aside.
/// What `kind`'s size classes add to `blocks` (`MemoryLevels::heap_rounding_bytes`); None where
/// they are unknown.
fn rounding_of(kind: &str, blocks: &[LiveBlock]) -> Option<u64> {
    blocks.iter().try_fold(0, |sum, block| Some(sum + usable_size(kind, block.size)? - block.size))
}

fn every_block_seen(process: &Process) -> bool {
    process.seen_from_start && process.stats.lost_events == 0
}

/// The bytes an allocator keeps before each block it hands out: glibc's chunk header (its size
/// field and the previous chunk's, which a block in use may hold data in); none known elsewhere.
fn chunk_header(allocator_kind: &str) -> u64 {
    match allocator_kind {
        "glibc" => 16,
        _ => 0,
    }
}

/// The mappings the probes saw each process make, read from the kernel once a sample and only
/// when some process's pages are classified again.
#[derive(Default)]
struct SeenMappings {
    by_process: Option<HashMap<u32, Vec<SeenMapping>>>,
}

impl SeenMappings {
    fn of(&mut self, probes: &Probes, pid: u32) -> Vec<SeenMapping> {
        let by_process = self.by_process.get_or_insert_with(|| {
            let mut by_process: HashMap<u32, Vec<SeenMapping>> = HashMap::new();
            for (key, region) in probes.regions().unwrap_or_default() {
                let Some(owner) = classify_region(region.kind) else { continue };
                let mapping = SeenMapping { start: key.start, end: key.start + region.len, owner };
                by_process.entry(key.tgid).or_default().push(mapping);
            }
            by_process.values_mut().for_each(|mappings| mappings.sort_unstable_by_key(|m| m.start));
            by_process
        });
        by_process.remove(&pid).unwrap_or_default()
    }
}

/// Whose memory a mapping the probes followed is (`region_kind`).
fn classify_region(kind: u64) -> Option<owners::classify::Owner> {
    use memtrace_common::region_kind;
    use owners::classify::Owner;
    match kind {
        region_kind::ALLOCATOR => Some(Owner::Allocator),
        region_kind::PROGRAM => Some(Owner::Program),
        region_kind::STACK => Some(Owner::Stack),
        _ => None,
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Leaked {
    /// Estimates under sampling, hence fractional.
    bytes: f64,
    allocations: f64,
    oldest_age: Option<Duration>,
}

/// CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns.
pub(crate) fn monotonic_now_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes only the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}
