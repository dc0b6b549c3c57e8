//! The BPF side as userspace sees it: load the embedded object, attach its programs to an allocator
//! for one process, and read the kernel's maps. Every attachment is a perf-event link owned by a file
//! descriptor of this process, so the kernel removes it when memtrace exits, however it exits.

use std::num::NonZeroU32;

use anyhow::{Context, Result};
use aya::{
    maps::{Array, HashMap, MapData, MapError},
    programs::{uprobe::UProbeScope, UProbe},
    Ebpf, EbpfLoader,
};
use memtrace_common::{
    Allocation, AllocationKey, AllocatorFunction, ProcessStats, StackFrames, StackKey, StackTotals,
    GLOBAL_LOST_SLOT,
};

use crate::allocator::Allocator;

static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/memtrace.bpf.o"));

/// Names of the entry and return programs of an allocator function in memtrace-ebpf.
fn program_names(function: AllocatorFunction) -> (&'static str, Option<&'static str>) {
    use AllocatorFunction::*;
    match function {
        Malloc => ("malloc_enter", Some("malloc_exit")),
        Calloc => ("calloc_enter", Some("calloc_exit")),
        Realloc => ("realloc_enter", Some("realloc_exit")),
        Reallocarray => ("reallocarray_enter", Some("reallocarray_exit")),
        PosixMemalign => ("posix_memalign_enter", Some("posix_memalign_exit")),
        AlignedAlloc => ("aligned_alloc_enter", Some("aligned_alloc_exit")),
        Memalign => ("memalign_enter", Some("memalign_exit")),
        Valloc => ("valloc_enter", Some("valloc_exit")),
        Pvalloc => ("pvalloc_enter", Some("pvalloc_exit")),
        Free => ("free_enter", None),
    }
}

pub struct Probes {
    ebpf: Ebpf,
    /// The USDT sites attached (links memtrace creates itself) and what reading them needs.
    pub usdt: crate::usdt::UsdtProbes,
}

impl Probes {
    /// Loads every program into the kernel; `max_allocations` sizes the live-allocation table.
    pub fn load(max_allocations: u32, capture_stacks: bool) -> Result<Self> {
        let mut ebpf = EbpfLoader::new()
            .map_max_entries("ALLOCATIONS", max_allocations)
            .override_global("CAPTURE_STACKS", &u8::from(capture_stacks), true)
            .load(BPF_OBJECT)
            .context("loading the BPF programs into the kernel")?;
        for (name, program) in ebpf.programs_mut() {
            let uprobe: &mut UProbe = program
                .try_into()
                .with_context(|| format!("program {name}"))?;
            uprobe
                .load()
                .with_context(|| format!("verifying BPF program {name}"))?;
        }
        Ok(Self {
            ebpf,
            usdt: crate::usdt::UsdtProbes::default(),
        })
    }

    /// Attaches to every entry point of `allocator`, for process `pid` only.
    pub fn attach(&mut self, allocator: &Allocator, pid: u32) -> Result<()> {
        let scope =
            UProbeScope::OneProcess(NonZeroU32::new(pid).context("pid 0 cannot be traced")?);
        for resolved in &allocator.entry_points {
            let (enter, exit) = program_names(resolved.entry.function);
            self.attach_one(enter, resolved.probe_offset, allocator, scope)?;
            if let Some(exit) = exit {
                // A return probe replaces the return address on entry, so it sits at the first byte.
                self.attach_one(exit, resolved.offset, allocator, scope)?;
            }
        }
        Ok(())
    }

    fn attach_one(
        &mut self,
        program: &str,
        offset: u64,
        allocator: &Allocator,
        scope: UProbeScope,
    ) -> Result<()> {
        let uprobe: &mut UProbe = self
            .ebpf
            .program_mut(program)
            .with_context(|| format!("the BPF object has no program {program}"))?
            .try_into()?;
        uprobe
            .attach(offset, &allocator.host_path, scope)
            .with_context(|| {
                format!(
                    "attaching {program} to {}+{offset:#x}",
                    allocator.path.display()
                )
            })?;
        Ok(())
    }

    /// The kernel's totals for a process; zero before its first allocator call.
    pub fn stats(&self, pid: u32) -> Result<ProcessStats> {
        let stats: HashMap<&MapData, u32, ProcessStats> = HashMap::try_from(self.map("STATS")?)?;
        match stats.get(&pid, 0) {
            Ok(stats) => Ok(stats),
            Err(MapError::KeyNotFound) => Ok(ProcessStats::default()),
            Err(err) => Err(err).context("reading the per-process statistics map"),
        }
    }

    /// Events that could not be charged to any process (the statistics map was full).
    pub fn unattributed_lost_events(&self) -> Result<u64> {
        let lost: Array<&MapData, u64> = Array::try_from(self.map("LOST_EVENTS")?)?;
        Ok(lost.get(&GLOBAL_LOST_SLOT, 0)?)
    }

    /// Every live allocation the kernel knows, of every traced process.
    pub fn live_allocations(&self) -> Result<Vec<(AllocationKey, Allocation)>> {
        let allocations: HashMap<&MapData, AllocationKey, Allocation> =
            HashMap::try_from(self.map("ALLOCATIONS")?)?;
        collect_entries(allocations.iter(), "the live-allocation map")
    }

    /// What each (process, call stack) allocated and still holds.
    pub fn stack_totals(&self) -> Result<Vec<(StackKey, StackTotals)>> {
        let totals: HashMap<&MapData, StackKey, StackTotals> =
            HashMap::try_from(self.map("STACK_TOTALS")?)?;
        collect_entries(totals.iter(), "the per-stack totals map")
    }

    pub fn stack(&self, stack: u64) -> Result<Option<StackFrames>> {
        let stacks: HashMap<&MapData, u64, StackFrames> = HashMap::try_from(self.map("STACKS")?)?;
        match stacks.get(&stack, 0) {
            Ok(frames) => Ok(Some(frames)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(err) => Err(err).context("reading the stack map"),
        }
    }

    pub fn map(&self, name: &str) -> Result<&aya::maps::Map> {
        self.ebpf
            .map(name)
            .with_context(|| format!("the BPF object has no map {name}"))
    }

    pub fn map_mut(&mut self, name: &str) -> Result<&mut aya::maps::Map> {
        self.ebpf
            .map_mut(name)
            .with_context(|| format!("the BPF object has no map {name}"))
    }

    /// A loaded program's descriptor, for links memtrace creates itself: aya cannot attach a
    /// uprobe with a USDT semaphore.
    pub fn program_fd(&self, name: &str) -> Result<aya::programs::ProgramFd> {
        let program = self
            .ebpf
            .program(name)
            .with_context(|| format!("the BPF object has no program {name}"))?;
        Ok(program.fd()?.try_clone()?)
    }
}

fn collect_entries<K, V>(
    entries: impl Iterator<Item = Result<(K, V), MapError>>,
    what: &str,
) -> Result<Vec<(K, V)>> {
    entries
        .filter(|entry| !matches!(entry, Err(MapError::KeyNotFound)))
        .collect::<Result<_, _>>()
        .with_context(|| format!("reading {what}"))
}
