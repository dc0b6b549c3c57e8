//! The BPF side as userspace sees it: load the embedded object, attach its programs to an allocator
//! for one process, and read the kernel's maps. Every attachment is a perf-event link owned by a file
//! descriptor of this process, so the kernel removes it when memtrace exits, however it exits.

use std::{collections::HashSet, num::NonZeroU32};

use anyhow::{bail, Context, Result};
use aya::{
    maps::{Array, HashMap, MapData, MapError, RingBuf},
    programs::{
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope},
        Program, UProbe,
    },
    Ebpf, EbpfLoader,
};
use memtrace_common::{
    Allocation, AllocationKey, AllocatorFunction, ProcessStats, StackFrames, StackKey, StackTotals,
    DEFAULT_MAX_LIVE_ALLOCATIONS, GLOBAL_LOST_SLOT, MAX_COMMS,
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

/// How the kernel side is set up for a run.
#[derive(Debug, Clone, Default)]
pub struct ProbeConfig {
    /// Capacity of the live-allocation table.
    pub max_allocations: u32,
    pub capture_stacks: bool,
    /// Set for system-wide tracing, where probes fire in every process.
    pub system_wide: Option<ProcessFilter>,
}

/// Which processes system-wide tracing leaves out.
#[derive(Debug, Clone, Default)]
pub struct ProcessFilter {
    /// memtrace itself, which must never trace its own allocations.
    pub self_tgid: u32,
    pub excluded_pids: Vec<u32>,
    /// Trace only processes with one of these command names (`--comm`); all when empty.
    pub only_comms: Vec<String>,
}

/// Where the probes on an allocator fire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Process(u32),
    AllProcesses,
}

/// How many entries the kernel's tables hold, to show they stay bounded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MapOccupancy {
    pub processes: usize,
    pub live_allocations: usize,
    pub stack_totals: usize,
    /// USDT subsystem and `--usdt` counter entries.
    pub usdt_entries: usize,
}

pub struct Probes {
    ebpf: Ebpf,
    /// The USDT sites attached (links memtrace creates itself) and what reading them needs.
    pub usdt: crate::usdt::UsdtProbes,
    /// (kind, path) of every allocator attached; attachment cookie i + 1 names entry i.
    allocators: Vec<(String, std::path::PathBuf)>,
}

impl Probes {
    /// Loads every program into the kernel.
    pub fn load(config: &ProbeConfig) -> Result<Self> {
        let filter = config.system_wide.clone().unwrap_or_default();
        let only_comms = filter.only_comms.iter().map(|comm| comm_bytes(comm)).collect::<Result<Vec<_>>>()?;
        let mut ebpf = EbpfLoader::new()
            .map_max_entries("ALLOCATIONS", config.max_allocations)
            .override_global("CAPTURE_STACKS", &u8::from(config.capture_stacks), true)
            .override_global("FILTER_PROCESSES", &u8::from(config.system_wide.is_some()), true)
            .override_global("SELF_TGID", &filter.self_tgid, true)
            .override_global("FILTER_COMMS", &u8::from(!only_comms.is_empty()), true)
            .load(BPF_OBJECT)
            .with_context(|| loading_failed(config.max_allocations))?;
        for (name, program) in ebpf.programs_mut() {
            match program {
                Program::UProbe(program) => program.load(),
                Program::RawTracePoint(program) => program.load(),
                _ => bail!("BPF program {name} is of a kind memtrace does not load"),
            }
            .with_context(|| format!("verifying BPF program {name}"))?;
        }
        let mut excluded: HashMap<&mut MapData, u32, u8> =
            HashMap::try_from(ebpf.map_mut("EXCLUDED_PIDS").context("no map EXCLUDED_PIDS")?)?;
        for pid in &filter.excluded_pids {
            excluded.insert(pid, 1, 0).context("too many --exclude-pid")?;
        }
        let mut comms: HashMap<&mut MapData, [u8; 16], u8> =
            HashMap::try_from(ebpf.map_mut("ALLOWED_COMMS").context("no map ALLOWED_COMMS")?)?;
        for comm in &only_comms {
            comms.insert(comm, 1, 0).with_context(|| format!("more than {MAX_COMMS} --comm names"))?;
        }
        Ok(Self { ebpf, usdt: crate::usdt::UsdtProbes::default(), allocators: Vec::new() })
    }

    /// Attaches to every entry point of `allocator`, for one process or for all that map it.
    pub fn attach(&mut self, allocator: &Allocator, scope: Scope) -> Result<()> {
        let scope = match scope {
            Scope::Process(pid) => {
                UProbeScope::OneProcess(NonZeroU32::new(pid).context("pid 0 cannot be traced")?)
            }
            Scope::AllProcesses => UProbeScope::AllProcesses,
        };
        self.allocators.push((allocator.kind.clone(), allocator.path.clone()));
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

    /// The allocator whose probes saw a process first: (kind, path) for `ProcessStats::allocator`.
    pub fn allocator_named(&self, cookie: u64) -> Option<&(String, std::path::PathBuf)> {
        self.allocators.get(usize::try_from(cookie).ok()?.checked_sub(1)?)
    }

    fn attach_one(
        &mut self,
        program: &str,
        offset: u64,
        allocator: &Allocator,
        scope: UProbeScope,
    ) -> Result<()> {
        let cookie = self.allocators.len() as u64;
        let uprobe: &mut UProbe = self
            .ebpf
            .program_mut(program)
            .with_context(|| format!("the BPF object has no program {program}"))?
            .try_into()?;
        uprobe
            .attach(
                UProbeAttachPoint {
                    location: UProbeAttachLocation::AbsoluteOffset(offset),
                    cookie: Some(cookie),
                },
                &allocator.host_path,
                scope,
            )
            .with_context(|| format!("attaching {program} to {}+{offset:#x}", allocator.path.display()))?;
        Ok(())
    }

    /// Follows processes as they exec and exit (system-wide tracing); returns the ring buffer
    /// that announces execs.
    pub fn follow_processes(&mut self) -> Result<RingBuf<MapData>> {
        // Raw tracepoints attach by name, with no tracefs needed.
        for (program, event) in
            [("process_exit", "sched_process_exit"), ("process_exec", "sched_process_exec")]
        {
            let tracepoint: &mut aya::programs::RawTracePoint = self
                .ebpf
                .program_mut(program)
                .with_context(|| format!("the BPF object has no program {program}"))?
                .try_into()?;
            tracepoint.attach(event).with_context(|| format!("attaching to sched:{event}"))?;
        }
        let events = self.ebpf.take_map("EXEC_EVENTS").context("the BPF object has no map EXEC_EVENTS")?;
        Ok(RingBuf::try_from(events)?)
    }

    /// Every process the kernel has figures for.
    pub fn traced_processes(&self) -> Result<Vec<(u32, ProcessStats)>> {
        let stats: HashMap<&MapData, u32, ProcessStats> = HashMap::try_from(self.map("STATS")?)?;
        collect_entries(stats.iter(), "the per-process statistics map")
    }

    /// Forgets exited processes in the kernel, so the tables do not fill up over a long run.
    pub fn release(&mut self, tgids: &HashSet<u32>) -> Result<()> {
        if tgids.is_empty() {
            return Ok(());
        }
        let mut stats: HashMap<&mut MapData, u32, ProcessStats> =
            HashMap::try_from(self.ebpf.map_mut("STATS").context("no map STATS")?)?;
        for tgid in tgids {
            let _ = stats.remove(tgid);
        }
        let mut allocations: HashMap<&mut MapData, AllocationKey, Allocation> =
            HashMap::try_from(self.ebpf.map_mut("ALLOCATIONS").context("no map ALLOCATIONS")?)?;
        let doomed: Vec<AllocationKey> =
            allocations.keys().filter_map(Result::ok).filter(|key| tgids.contains(&key.tgid)).collect();
        for key in &doomed {
            let _ = allocations.remove(key);
        }
        let mut totals: HashMap<&mut MapData, StackKey, StackTotals> =
            HashMap::try_from(self.ebpf.map_mut("STACK_TOTALS").context("no map STACK_TOTALS")?)?;
        let doomed: Vec<StackKey> =
            totals.keys().filter_map(Result::ok).filter(|key| tgids.contains(&key.tgid)).collect();
        for key in &doomed {
            let _ = totals.remove(key);
        }
        crate::usdt::release(self, tgids)
    }

    pub fn occupancy(&self) -> Result<MapOccupancy> {
        let stats: HashMap<&MapData, u32, ProcessStats> = HashMap::try_from(self.map("STATS")?)?;
        let allocations: HashMap<&MapData, AllocationKey, Allocation> =
            HashMap::try_from(self.map("ALLOCATIONS")?)?;
        let totals: HashMap<&MapData, StackKey, StackTotals> = HashMap::try_from(self.map("STACK_TOTALS")?)?;
        Ok(MapOccupancy {
            processes: stats.keys().count(),
            live_allocations: allocations.keys().count(),
            stack_totals: totals.keys().count(),
            usdt_entries: crate::usdt::occupancy(self)?,
        })
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
        let totals: HashMap<&MapData, StackKey, StackTotals> = HashMap::try_from(self.map("STACK_TOTALS")?)?;
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
        self.ebpf.map(name).with_context(|| format!("the BPF object has no map {name}"))
    }

    pub fn map_mut(&mut self, name: &str) -> Result<&mut aya::maps::Map> {
        self.ebpf.map_mut(name).with_context(|| format!("the BPF object has no map {name}"))
    }

    /// A loaded program's descriptor, for links memtrace creates itself: aya cannot attach a
    /// uprobe with a USDT semaphore.
    pub fn program_fd(&self, name: &str) -> Result<aya::programs::ProgramFd> {
        let program =
            self.ebpf.program(name).with_context(|| format!("the BPF object has no program {name}"))?;
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

/// What to say when the kernel refuses the BPF object: a large live-allocation table is the usual
/// reason (the kernel preallocates every entry, about 100 bytes each).
fn loading_failed(max_allocations: u32) -> String {
    if max_allocations <= DEFAULT_MAX_LIVE_ALLOCATIONS {
        return "loading the BPF programs into the kernel".to_owned();
    }
    let megabytes = u64::from(max_allocations) * 100 / 1_000_000;
    format!(
        "loading the BPF programs into the kernel, with a live-allocation table of --max-allocations \
         {max_allocations} entries (about {megabytes} MB of kernel memory; lower it if the kernel \
         cannot allocate that)"
    )
}

/// A command name as the kernel stores it: at most 15 bytes and a NUL.
fn comm_bytes(comm: &str) -> Result<[u8; 16]> {
    if comm.is_empty() {
        bail!("--comm needs a command name, as `ps -o comm` shows it");
    }
    if comm.len() > 15 {
        bail!("--comm {comm:?} is longer than the 15 bytes the kernel keeps of a command name");
    }
    let mut bytes = [0u8; 16];
    bytes[..comm.len()].copy_from_slice(comm.as_bytes());
    Ok(bytes)
}
