//! The BPF side as userspace sees it: load the embedded object, attach its programs to an allocator
//! for one process or for all, and read the kernel's maps, each through its typed accessor
//! (tables.rs). Every attachment is a link owned by a file descriptor of this process, so the
//! kernel removes it when memtrace exits, however it exits. What to attach is decided above this
//! room (following, and usdt for USDT sites), which calls in here and is never called back.

mod embedded;
pub mod features;
mod kernel_btf;
mod links;
mod live_table;
mod loader;
pub mod log;
mod map_ops;
mod per_cpu;
mod stack;
pub mod sys;
pub mod tables;
mod thread_slots;
pub mod unwind_tables;
mod usdt_tables;
pub mod verifier_report;
mod windows;
pub use map_ops::ArrayCell;
pub use map_ops::Taken;
pub use stack::Stack;

use std::{collections::HashSet, os::fd::AsFd, path::Path};

use anyhow::{bail, Context, Result};
use aya::{
    maps::{MapData, RingBuf},
    programs::Program,
    Ebpf, EbpfLoader,
};
use memtrace_common::{
    programs, reach, Allocation, AllocationKey, AllocatorCode, AllocatorFunction, ImageKey,
    InterpreterCodeKey, KernelLayout, PerlSub, ProbeCookie, ProcessStats, PythonCode, Region, RegionKey,
    StackKey, StackTotals, DEFAULT_MAX_LIVE_ALLOCATIONS, GLOBAL_LOST_SLOT, MAX_ALLOCATOR_CODES, MAX_CGROUPS,
    MAX_COMMS, MAX_PROCESSES,
};

use embedded::BPF_OBJECT;
pub use kernel_btf::kernel_layout;
use links::{CallPrograms, Calls, Direction, Links};
pub use links::{Scope, Site};
use live_table::{LiveTable, TableSize};
use loader::MultiPrograms;
pub use per_cpu::with_per_cpu_sums;

use crate::{
    kernel::features::{KernelFeatures, LinkKind},
    kernel::log::BpfLog,
    kernel::sys::prog_info,
    process::{
        allocator::Allocator,
        cgroup::CgroupFilter,
        entry_points::ResolvedEntryPoint,
        map_calls::MapCalls,
        probe_point::{ProbePoint, SingleStepped},
    },
};

/// The uprobe programs of memtrace-ebpf (each named once, in memtrace_common::programs, which the
/// build checks against the object): every allocator entry point, every allocator return, and
/// every USDT site.
const ALLOCATOR_ENTRY: &str = programs::ALLOC_ENTER.name;
const ALLOCATOR_RETURN: &str = programs::ALLOC_EXIT.name;
const USDT_SITE: &str = programs::USDT_SITE.name;
/// The allocator's own sampled probes (`--app-sampled`).
const SAMPLED_SITE: &str = programs::SAMPLED_SITE.name;
/// Programs that do nothing, on the allocator's probe points: the floor `cargo xtask bench` measures.
const EMPTY_ENTRY: &str = programs::EMPTY_ENTER.name;
const EMPTY_RETURN: &str = programs::EMPTY_EXIT.name;
/// The C library's mapping calls, at entry and at return.
const MAP_ENTRY: &str = programs::MAP_ENTER.name;
const MAP_RETURN: &str = programs::MAP_EXIT.name;
const UPROBE_PROGRAMS: [&str; 10] = [
    FORK_RETURN,
    LIBRARY_LOADED,
    ALLOCATOR_ENTRY,
    ALLOCATOR_RETURN,
    USDT_SITE,
    SAMPLED_SITE,
    EMPTY_ENTRY,
    EMPTY_RETURN,
    MAP_ENTRY,
    MAP_RETURN,
];

/// Set to `perf` to link every probe site with a perf event of its own, as on kernels without
/// uprobe_multi (tests compare both routes).
pub const LINK_KIND_VARIABLE: &str = "MEMTRACE_LINKS";

/// How the kernel side is set up for a run.
#[derive(Debug, Clone, Default)]
pub struct ProbeConfig {
    /// Capacity of the live-allocation table.
    pub max_allocations: u32,
    /// Capacity of the stack tables (STACKS, STACK_TOTALS).
    pub max_stacks: u32,
    pub capture_stacks: bool,
    /// Attach the empty programs instead of the allocator programs (`--empty-probes`).
    pub empty_probes: bool,
    /// `--sample`: mean bytes between sampled allocations; 0 records every allocation.
    pub sample_mean: u64,
    /// `--window`: the allocation-only entry points are probed in windows (`open_window`).
    pub windowed: bool,
    /// Which processes count.
    pub reach: Reach,
    /// `--debug-bpf`: print the kernel side's diagnostics.
    pub debug_bpf: bool,
}

/// Which processes a run traces, as the kernel side filters them.
#[derive(Debug, Clone, Default)]
pub enum Reach {
    /// The processes named with `add_target`, each through links that carry its pid.
    #[default]
    Targets,
    /// The processes named with `add_target` and all their descendants, each through links that
    /// carry its pid (no other process pays for a probe): the kernel keeps the tree from fork and
    /// exit, and holds each new process at its return from fork until its links are in.
    Tree,
    /// Every process, but these.
    AllProcesses(ProcessFilter),
}

impl Reach {
    /// How probes that serve `pid` are attached.
    pub fn scope_for(&self, pid: u32) -> Scope {
        match self {
            Reach::Targets | Reach::Tree => Scope::Process(pid),
            Reach::AllProcesses(_) => Scope::AllProcesses,
        }
    }

    fn kernel_value(&self) -> u8 {
        match self {
            Reach::Targets => reach::TARGETS,
            Reach::Tree => reach::TREE,
            Reach::AllProcesses(_) => reach::ALL,
        }
    }
}

/// Which processes system-wide tracing leaves out.
#[derive(Debug, Clone, Default)]
pub struct ProcessFilter {
    /// memtrace itself, which must never trace its own allocations.
    pub self_tgid: u32,
    pub excluded_pids: Vec<u32>,
    /// Trace only processes with one of these command names (`--comm`); all when empty.
    pub only_comms: Vec<String>,
    /// Trace only processes in these cgroups or below them (`--container`, `--cgroup`).
    pub cgroups: CgroupFilter,
}

/// How many entries the kernel's tables hold, to show they stay bounded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MapOccupancy {
    pub processes: usize,
    pub live_allocations: usize,
    pub stack_totals: usize,
    /// USDT subsystem, `--usdt` counter and dump round entries.
    pub usdt_entries: usize,
}

/// An allocator whose probes are attached, as `ProcessStats::allocator` names it.
#[derive(Debug, Clone, Default)]
pub struct AttachedAllocator {
    /// glibc, jemalloc, ... (`Allocator::kind`).
    pub kind: String,
    pub path: std::path::PathBuf,
    /// The file itself, attached for one process or many.
    pub file: crate::process::FileId,
}

/// Which links a probe joins: the run's, or (`--window`) those of the open window.
#[derive(Clone, Copy, PartialEq, Eq)]
enum LinkSet {
    Run,
    Window,
}

/// Where and how sites are attached.
struct Attach<'a> {
    path: &'a std::path::Path,
    scope: Scope,
    direction: Direction,
    set: LinkSet,
}

/// The entry and return sites of an allocator's entry points (cookie `index` names the
/// allocator). Both probes of a function sit at one point, its first the kernel emulates where the
/// stack pointer has not moved (process/probe_point.rs); the cookie says where its arguments are.
fn call_sites(index: u32, points: &[&ResolvedEntryPoint]) -> (Vec<Site>, Vec<Site>) {
    let site = |point: &ResolvedEntryPoint| Site {
        offset: point.probe_offset(),
        cookie: ProbeCookie::new(index, point.entry.function).with_registers(point.probe.registers).0,
        semaphore: None,
    };
    let entries = points.iter().map(|point| site(point)).collect();
    let returns =
        points.iter().filter(|point| point.entry.function.has_return()).map(|point| site(point)).collect();
    (entries, returns)
}

/// The program that marks exits: its runs the kernel skips lose no event of a traced process by
/// themselves (the collector finds such exits in /proc; `skipped_exit_runs`).
const EXIT_PROGRAM: &str = programs::PROCESS_EXIT.name;
/// The return probe on the C library's fork that holds a followed tree's new process: a run the
/// kernel skips loses no event by itself; the child it would have held is found at a later sample
/// (`Following::probe_late_forks`) and counted there.
const FORK_RETURN: &str = programs::FORK_RETURN.name;
/// The return probe on the C library's dlopen that holds a traced process until the library's
/// unwind table is in: a run the kernel skips loses no event; the table is written at the next
/// refresh, and stacks cut short meanwhile are counted (`unwind_stops`).
const LIBRARY_LOADED: &str = programs::LIBRARY_LOADED.name;
/// The program that reads an exiting process's memory at do_exit's entry.
const EXIT_READER: &str = programs::EXIT_BEGINS.name;

/// The runs of each program the kernel skipped, as read at one moment.
pub struct SkippedRuns {
    /// Programs with runs skipped, and how many.
    by_program: Vec<(String, u64)>,
}

impl SkippedRuns {
    /// The programs whose skipped runs are events lost, and how many: all but process_exit, whose
    /// skipped runs leave undone what is done from /proc instead (collect/skipped_exits.rs), the
    /// exit reader, fork_return, whose misses are counted as processes probed late, and
    /// library_loaded, whose misses cut stacks short for a moment (counted as such).
    pub fn lossy(&self) -> impl Iterator<Item = (&str, u64)> {
        self.by_program
            .iter()
            .filter(|(name, _)| {
                ![EXIT_PROGRAM, EXIT_READER, FORK_RETURN, LIBRARY_LOADED].contains(&name.as_str())
            })
            .map(|(name, runs)| (name.as_str(), *runs))
    }

    /// Events lost to skipped runs.
    pub fn lost(&self) -> u64 {
        self.lossy().map(|(_, runs)| runs).sum()
    }

    /// Runs of process_exit skipped, for every task of the system that exited while another's exit
    /// ran on its CPU (a preemptible kernel): most are of processes not traced.
    pub fn exits(&self) -> u64 {
        self.by_program.iter().filter(|(name, _)| name == EXIT_PROGRAM).map(|(_, runs)| runs).sum()
    }
}

pub struct Probes {
    ebpf: Ebpf,
    /// The uprobe programs loaded for uprobe_multi links, or None where aya loaded them for
    /// per-site perf links.
    multi: Option<MultiPrograms>,
    /// The live-allocation table.
    live: LiveTable,
    links: Links,
    allocator_programs: CallPrograms,
    /// Whether mapping calls are probed: not with the empty programs.
    follow_mappings: bool,
    /// Whether library loads are watched: stacks are unwound from tables.
    watch_libraries: bool,
    /// USDT probe sites attached (one probe per site, whatever it is used for).
    usdt_sites: usize,
    /// Sites of the allocator's sampled probes attached.
    sampled_sites: usize,
    /// Whether the exit reader (fentry on do_exit) is attached.
    exit_reader: bool,
    /// Every allocator attached; attachment cookie i + 1 names entry i.
    allocators: Vec<AttachedAllocator>,
    /// Probes attached where the kernel single-steps, each function of each file once.
    single_stepped: Vec<SingleStepped>,
    /// The (file, function) pairs of `single_stepped`.
    single_stepped_seen: std::collections::HashSet<(crate::process::FileId, String)>,
    /// Whether a tree is followed (`Reach::Tree`): its processes are probed one by one.
    follows_tree: bool,
    /// The C libraries whose fork has the tree's return probe (`watch_forks`).
    fork_watched: std::collections::HashSet<crate::process::FileId>,
    /// `--window`: the allocators' windowed probes, and whether a window is open.
    windows: Option<windows::Windows>,
    /// `--debug-bpf`'s printer; last, so that it prints what the probes wrote until detached.
    _bpf_log: Option<BpfLog>,
}

impl Probes {
    /// Loads every program into the kernel, with the kernel's struct layout (from its BTF), for
    /// the links `link_kind` says.
    pub fn load(config: &ProbeConfig, layout: &KernelLayout, link_kind: LinkKind) -> Result<Self> {
        let filter = match &config.reach {
            Reach::AllProcesses(filter) => filter.clone(),
            _ => ProcessFilter::default(),
        };
        let only_comms = filter.only_comms.iter().map(|comm| comm_bytes(comm)).collect::<Result<Vec<_>>>()?;
        let live_size = TableSize::for_records(config.max_allocations);
        let globals = Globals {
            config,
            layout,
            self_tgid: filter.self_tgid,
            filter_comms: !only_comms.is_empty(),
            filter_cgroups: !filter.cgroups.is_empty(),
        };
        let mut ebpf = load_object(&globals, &live_size)?;
        let multi = load_multi(&ebpf, link_kind)?;
        load_programs(&mut ebpf)?;
        let bpf_log = config.debug_bpf.then(|| BpfLog::start(&mut ebpf)).transpose()?;
        write_filter(&mut ebpf, &filter.excluded_pids, &only_comms)?;
        let live = LiveTable::open(
            tables::LIVE_SLOTS.find(&ebpf).context("no live-allocation table")?,
            tables::LIVE_RECORDS.find(&ebpf).context("no live-allocation count")?,
            &live_size,
        )?;
        let windows = config.windowed.then(|| windows::Windows::open_first(&ebpf)).transpose()?;
        let mut probes = Self {
            ebpf,
            multi,
            live,
            links: Links::default(),
            allocator_programs: if config.empty_probes {
                CallPrograms { entry: EMPTY_ENTRY, exit: EMPTY_RETURN }
            } else {
                CallPrograms { entry: ALLOCATOR_ENTRY, exit: ALLOCATOR_RETURN }
            },
            follow_mappings: !config.empty_probes,
            watch_libraries: config.capture_stacks && !config.empty_probes,
            usdt_sites: 0,
            sampled_sites: 0,
            exit_reader: false,
            allocators: Vec::new(),
            single_stepped: Vec::new(),
            single_stepped_seen: std::collections::HashSet::new(),
            follows_tree: matches!(config.reach, Reach::Tree),
            fork_watched: std::collections::HashSet::new(),
            windows,
            _bpf_log: bpf_log,
        };
        // Exits release each thread's allocator slot and mark processes exited, in every mode.
        probes.attach_raw_tracepoint(programs::PROCESS_EXIT)?;
        probes.exit_reader = probes.attach_exit_reader().is_ok();
        if let Reach::Tree = config.reach {
            probes.attach_raw_tracepoint(programs::PROCESS_FORK)?;
        }
        Ok(probes)
    }

    /// How this run links probe sites.
    pub fn link_kind(&self) -> LinkKind {
        if self.multi.is_some() {
            LinkKind::Multi
        } else {
            LinkKind::PerfEvent
        }
    }

    /// Attaches the uprobe program `program` at `sites` of one file.
    fn attach_sites(
        &mut self,
        program: &str,
        path: &std::path::Path,
        sites: &[Site],
        scope: Scope,
        direction: Direction,
    ) -> Result<()> {
        let at = Attach { path, scope, direction, set: LinkSet::Run };
        self.attach_sites_in(program, sites, at)
    }

    /// Attaches `program` at `sites` into the links `at.set` names.
    fn attach_sites_in(&mut self, program: &str, sites: &[Site], at: Attach<'_>) -> Result<()> {
        let kind = self.link_kind();
        let fd = match &mut self.multi {
            Some(multi) => multi.program(program)?,
            None => uprobe(&mut self.ebpf, program)?.fd()?.as_fd(),
        };
        let links = match (at.set, &mut self.windows) {
            (LinkSet::Window, Some(windows)) => &mut windows.links,
            _ => &mut self.links,
        };
        links.attach(kind, fd, at.path, sites, at.scope, at.direction)
    }

    /// Loads every uprobe program a run could attach, as `memtrace doctor` checks them: a run
    /// loads each only when it first attaches it.
    pub fn load_every_program(&mut self) -> Result<()> {
        for name in UPROBE_PROGRAMS {
            match &mut self.multi {
                Some(multi) => multi.program(name).map(drop)?,
                None => uprobe(&mut self.ebpf, name).map(drop)?,
            }
        }
        Ok(())
    }

    /// Attaches the USDT handler at `sites` of one file, each site's cookie indexing its uses in
    /// `USDT_SPECS`.
    pub fn attach_usdt_sites(&mut self, path: &Path, sites: &[Site], scope: Scope) -> Result<()> {
        if sites.is_empty() {
            return Ok(());
        }
        self.attach_sites(USDT_SITE, path, sites, scope, Direction::Entry)?;
        self.usdt_sites += sites.len();
        Ok(())
    }

    /// Attaches the handler of the allocator's sampled probes at `sites` of one file (each
    /// site's cookie indexes its spec in `USDT_SPECS`).
    pub fn attach_sampled_sites(&mut self, path: &Path, sites: &[Site], scope: Scope) -> Result<()> {
        if sites.is_empty() {
            return Ok(());
        }
        self.attach_sites(SAMPLED_SITE, path, sites, scope, Direction::Entry)?;
        self.sampled_sites += sites.len();
        Ok(())
    }

    /// How many of the allocator's sampled probe sites are attached (`--app-sampled`).
    pub fn sampled_sites(&self) -> usize {
        self.sampled_sites
    }

    /// How many USDT probe sites are attached (one probe per site, whatever it is used for).
    pub fn usdt_sites(&self) -> usize {
        self.usdt_sites
    }

    /// Detaches every probe at once; what the kernel counted stays readable in the maps.
    pub fn detach(&mut self) {
        self.links.detach();
        if let Some(windows) = &mut self.windows {
            windows.links.detach();
        }
    }

    /// Attaches to every entry point of `allocator`, for one process or for all that map it: one
    /// link for the entries and one for the returns, and with `--window` another two for the
    /// entry points only windows probe.
    pub fn attach(&mut self, allocator: &Allocator, scope: Scope) -> Result<()> {
        if let Scope::Process(0) = scope {
            bail!("pid 0 cannot be traced");
        }
        let index = self.allocator_index(allocator)?;
        let windowed = self.windows.is_some();
        let (in_windows, always): (Vec<_>, Vec<_>) =
            allocator.entry_points.iter().partition(|point| windowed && point.entry.function.windowed());
        let path = &allocator.host_path;
        let (entries, returns) = call_sites(index, &always);
        let calls = Calls { programs: self.allocator_programs, path, entries: &entries, returns: &returns };
        self.attach_calls(calls, scope, LinkSet::Run)
            .with_context(|| format!("attaching to the allocator in {}", allocator.path.display()))?;
        if !in_windows.is_empty() {
            let (entries, returns) = call_sites(index, &in_windows);
            let sites = windows::WindowedSites { programs: self.allocator_programs, entries, returns, scope };
            let calls = windows::WindowedCalls::new(sites, path, allocator.path.clone())?;
            self.attach_windowed(calls)
                .with_context(|| format!("attaching to the allocator in {}", allocator.path.display()))?;
        }
        Ok(())
    }

    /// The cookie index of `allocator`'s file: its own from the first attachment, however many
    /// processes it is attached for (a followed tree's are per process).
    fn allocator_index(&mut self, allocator: &Allocator) -> Result<u32> {
        let file = allocator.object.id;
        if let Some(at) = self.allocators.iter().position(|known| known.file == file) {
            return Ok(at as u32 + 1);
        }
        self.allocators.push(AttachedAllocator {
            kind: allocator.kind.clone(),
            path: allocator.path.clone(),
            file,
        });
        for point in allocator.entry_points.iter().filter(|point| !point.probe.emulated) {
            self.note_single_stepped((file, &allocator.path), &point.name, &point.probe);
        }
        let index = self.allocators.len() as u32;
        self.note_allocator_code(index, allocator)?;
        Ok(index)
    }

    /// Detaches the probes attached for `pid` alone (a followed tree's process that is gone, or
    /// whose pid a new process took).
    pub fn detach_process(&mut self, pid: u32) {
        self.links.detach_scope(Scope::Process(pid));
    }

    /// Keeps one file's windowed calls for every window, attached now if a window is open.
    fn attach_windowed(&mut self, calls: windows::WindowedCalls) -> Result<()> {
        if self.windows.as_ref().is_some_and(|windows| windows.is_open()) {
            self.attach_calls(calls.borrowed(), calls.sites.scope, LinkSet::Window)?;
        }
        if let Some(windows) = &mut self.windows {
            windows.calls.push(calls);
        }
        Ok(())
    }

    /// `--window`: opens a window, attaching every allocator's windowed probes. A file that cannot
    /// be probed any more (its one process gone, the file deleted) is left out of later windows.
    pub fn open_window(&mut self) -> Result<()> {
        let Some(windows) = self.windows.as_mut().filter(|windows| !windows.is_open()) else {
            return Ok(());
        };
        windows.advance()?;
        let calls = std::mem::take(&mut windows.calls);
        let mut kept = Vec::with_capacity(calls.len());
        for calls in calls {
            match self.attach_calls(calls.borrowed(), calls.sites.scope, LinkSet::Window) {
                Ok(()) => kept.push(calls),
                Err(err) if calls.process_gone() => drop(err),
                Err(err) => eprintln!(
                    "memtrace: warning: {} is no longer probed in windows: {err:#}",
                    calls.path.display()
                ),
            }
        }
        if let Some(windows) = &mut self.windows {
            windows.calls = kept;
        }
        Ok(())
    }

    /// `--window`: closes the window: the generation moves on, so that its probes count no more
    /// while they are detached and a call entered in it that never returns through its probe is
    /// known to be abandoned; then its probes are detached.
    pub fn close_window(&mut self) -> Result<()> {
        let Some(windows) = self.windows.as_mut().filter(|windows| windows.is_open()) else {
            return Ok(());
        };
        windows.advance()?;
        windows.links.detach();
        Ok(())
    }

    /// Attaches one file's calls, entries and returns, each a link. Returns first: a call entered
    /// before its return probe existed never returns through it, so an entry seen without its
    /// return would leave the thread inside a call for good. A return whose entry was not seen is
    /// ignored.
    fn attach_calls(&mut self, calls: Calls<'_>, scope: Scope, set: LinkSet) -> Result<()> {
        let Calls { programs, path, entries, returns } = calls;
        self.attach_sites_in(
            programs.exit,
            returns,
            Attach { path, scope, direction: Direction::Return, set },
        )?;
        self.attach_sites_in(
            programs.entry,
            entries,
            Attach { path, scope, direction: Direction::Entry, set },
        )
    }

    /// Attaches to the mapping calls of `calls`' file (mmap, munmap, mremap), which follow anonymous
    /// mappings: one link for the entries and one for the returns (`attach_calls`).
    /// Not with the empty programs: the floor is the allocator's probe points alone.
    pub fn attach_map_calls(&mut self, calls: &MapCalls, scope: Scope) -> Result<()> {
        self.watch_forks(calls)?;
        self.watch_library_loads(calls, scope)?;
        if !self.follow_mappings {
            return Ok(());
        }
        let sites: Vec<Site> = calls
            .sites
            .iter()
            .map(|site| Site {
                offset: site.probe_offset(),
                cookie: ProbeCookie::map_call(site.function).with_registers(site.probe.registers).0,
                semaphore: None,
            })
            .collect();
        for site in calls.sites.iter().filter(|site| !site.probe.emulated) {
            self.note_single_stepped(
                (calls.object.id, &calls.object.path),
                site.function.symbol(),
                &site.probe,
            );
        }
        let programs = CallPrograms { entry: MAP_ENTRY, exit: MAP_RETURN };
        let path = &calls.object.host_path;
        self.attach_calls(Calls { programs, path, entries: &sites, returns: &sites }, scope, LinkSet::Run)
            .with_context(|| {
                format!("attaching to mmap, munmap and mremap in {}", calls.object.path.display())
            })
    }

    /// A followed tree's new processes are caught as they return from the C library's fork: a
    /// return probe on `calls`' file's fork, for every process (few call fork), once per file.
    fn watch_forks(&mut self, calls: &MapCalls) -> Result<()> {
        let Some(fork) = calls.fork.filter(|_| self.follows_tree) else { return Ok(()) };
        if !self.fork_watched.insert(calls.object.id) {
            return Ok(());
        }
        let site = Site { offset: fork, cookie: 0, semaphore: None };
        let path = &calls.object.host_path;
        self.attach_sites(FORK_RETURN, path, &[site], Scope::AllProcesses, Direction::Return)
            .with_context(|| format!("attaching to fork in {}", calls.object.path.display()))
    }

    /// A traced process that loads a library is held at the return of `calls`' file's dlopen
    /// until the library's unwind table is in (where processes are held at all): code that runs
    /// right after the load (a Python extension's module init) allocates with whole stacks.
    fn watch_library_loads(&mut self, calls: &MapCalls, scope: Scope) -> Result<()> {
        if !self.watch_libraries || calls.library_loads.is_empty() {
            return Ok(());
        }
        let sites: Vec<Site> = calls
            .library_loads
            .iter()
            .map(|site| Site { offset: site.probe_offset(), cookie: 0, semaphore: None })
            .collect();
        for site in calls.library_loads.iter().filter(|site| !site.probe.emulated) {
            self.note_single_stepped((calls.object.id, &calls.object.path), site.function, &site.probe);
        }
        let path = &calls.object.host_path;
        self.attach_sites(LIBRARY_LOADED, path, &sites, scope, Direction::Return)
            .with_context(|| format!("attaching to dlopen in {}", calls.object.path.display()))
    }

    /// Remembers a probe the kernel single-steps, once per function (or USDT probe) and file,
    /// whatever path names the file (`file`: its identity, and the path shown).
    pub fn note_single_stepped(
        &mut self,
        file: (crate::process::FileId, &std::path::Path),
        function: &str,
        probe: &ProbePoint,
    ) {
        if self.single_stepped_seen.insert((file.0, function.to_owned())) {
            self.single_stepped.push(SingleStepped {
                file: file.1.to_owned(),
                function: function.to_owned(),
                instruction: probe.instruction.clone(),
            });
        }
    }

    /// Probes attached where the kernel single-steps: each function of each file once.
    pub fn single_stepped(&self) -> &[SingleStepped] {
        &self.single_stepped
    }

    /// The allocator whose probes saw a process first, from `ProcessStats::allocator`.
    pub fn allocator_named(&self, index: u64) -> Option<&AttachedAllocator> {
        self.allocators.get(usize::try_from(index).ok()?.checked_sub(1)?)
    }

    /// Names a process to trace (`Reach::Targets`, `Reach::Tree`): its execs are announced, and
    /// with a tree, the processes it forks from now on are traced too.
    pub fn add_target(&mut self, pid: u32) -> Result<()> {
        let mut targets = tables::TARGETS.writable(&mut self.ebpf)?;
        targets.insert(pid, 1, 0).with_context(|| format!("more than {MAX_PROCESSES} processes to trace"))
    }

    /// The processes the kernel traces by pid (`Reach::Targets`, `Reach::Tree`): those named, and
    /// with a tree the descendants it added at fork.
    pub fn tree_processes(&self) -> Result<Vec<u32>> {
        Ok(tables::TARGETS.entries(&self.ebpf)?.into_iter().map(|(pid, _)| pid).collect())
    }

    /// The switch of the exec tracepoint's stops, for the exec hold (follow::hold).
    pub fn hold_switch(&self) -> Result<map_ops::ArrayCell> {
        tables::HOLD_EXECS.cell(&self.ebpf, 0)
    }

    /// Lets later execs of a program file go on unstopped: its allocators are probed.
    pub fn know_image(&mut self, image: ImageKey) -> Result<()> {
        let mut known = tables::KNOWN_IMAGES.writable(&mut self.ebpf)?;
        known.insert(image, 1, 0).context("remembering a probed program")
    }

    /// Follows processes as they exec; returns the ring buffer that announces the execs of traced
    /// processes.
    pub fn follow_processes(&mut self) -> Result<RingBuf<MapData>> {
        self.attach_raw_tracepoint(programs::PROCESS_EXEC)?;
        tables::EXEC_EVENTS.take(&mut self.ebpf)
    }

    /// Hears of the OOM killer's victims (oom:mark_victim); returns the ring buffer that announces
    /// them. An error where the kernel has no such tracepoint.
    pub fn watch_oom_kills(&mut self) -> Result<RingBuf<MapData>> {
        self.attach_raw_tracepoint(programs::OOM_VICTIM)?;
        tables::OOM_EVENTS.take(&mut self.ebpf)
    }

    /// Tells the free probe where allocator `index`'s code lies around it, so that a free its own
    /// library makes (glibc's tcache flush at thread exit) is told from the program's.
    fn note_allocator_code(&mut self, index: u32, allocator: &Allocator) -> Result<()> {
        let free =
            allocator.entry_points.iter().find(|point| point.entry.function == AllocatorFunction::Free);
        let Some((before, after)) = free.map(|point| point.code_around_probe) else { return Ok(()) };
        if index >= MAX_ALLOCATOR_CODES {
            return Ok(());
        }
        tables::ALLOCATOR_CODES.set(&mut self.ebpf, index, &AllocatorCode { before, after })
    }

    /// The exit levels' reader at do_exit's entry (fentry), for kernels whose sched_process_exit
    /// comes after the task's memory is released; an error where the kernel has no fentry.
    fn attach_exit_reader(&mut self) -> Result<()> {
        let programs::ProgramKind::Fentry(function) = programs::EXIT_BEGINS.kind else {
            bail!("BPF program {EXIT_READER} is no fentry program: {:?}", programs::EXIT_BEGINS.kind);
        };
        let btf = aya::Btf::from_sys_fs().context("reading the kernel's BTF")?;
        let program: &mut aya::programs::FEntry = self
            .ebpf
            .program_mut(EXIT_READER)
            .with_context(|| format!("the BPF object has no program {EXIT_READER}"))?
            .try_into()?;
        program.load(function, &btf).context("verifying the exit reader")?;
        program.attach().with_context(|| format!("attaching the exit reader to {function}"))?;
        Ok(())
    }

    /// Whether exit levels are read at do_exit's entry too (see `attach_exit_reader`).
    pub fn reads_exits_early(&self) -> bool {
        self.exit_reader
    }

    /// Attaches raw tracepoint `program` to the tracepoint the table names for it: by name, with
    /// no tracefs needed.
    fn attach_raw_tracepoint(&mut self, program: programs::Program) -> Result<()> {
        let programs::ProgramKind::RawTracepoint(event) = program.kind else {
            bail!("BPF program {} is no raw tracepoint: {:?}", program.name, program.kind);
        };
        let tracepoint: &mut aya::programs::RawTracePoint = self
            .ebpf
            .program_mut(program.name)
            .with_context(|| format!("the BPF object has no program {}", program.name))?
            .try_into()?;
        tracepoint.attach(event).with_context(|| format!("attaching to tracepoint {event}"))?;
        Ok(())
    }

    /// Every process the kernel has figures for.
    pub fn traced_processes(&self) -> Result<Vec<(u32, ProcessStats)>> {
        tables::STATS.entries(&self.ebpf)
    }

    /// Every anonymous mapping the probes follow, of every process, with who made it.
    pub fn regions(&self) -> Result<Vec<(RegionKey, Region)>> {
        tables::REGIONS.entries(&self.ebpf)
    }

    /// Forgets exited processes in the kernel, so the tables do not fill up over a long run.
    pub fn release(&mut self, tgids: &HashSet<u32>) -> Result<()> {
        if tgids.is_empty() {
            return Ok(());
        }
        let mut stats = tables::STATS.writable(&mut self.ebpf)?;
        for tgid in tgids {
            let _ = stats.remove(tgid);
        }
        self.live.release(tgids)?;
        tables::STACK_TOTALS.release(&self.ebpf, tgids, |key| key.tgid)?;
        tables::REGIONS.release(&self.ebpf, tgids, |key| key.tgid)?;
        if self.usdt_written() {
            tables::SUBSYSTEMS.release(&self.ebpf, tgids, |key| key.tgid)?;
            tables::USDT_COUNTERS.release(&self.ebpf, tgids, |key| key.tgid)?;
            tables::DUMP_ROUNDS.release(&self.ebpf, tgids, |pid_tgid| (pid_tgid >> 32) as u32)?;
        }
        Ok(())
    }

    /// Whether the USDT maps may hold anything: only the programs on attached sites write them. An
    /// empty map's read still walks its 16,384 buckets, at every refresh and sample.
    fn usdt_written(&self) -> bool {
        self.usdt_sites > 0
    }

    pub fn occupancy(&self) -> Result<MapOccupancy> {
        Ok(MapOccupancy {
            processes: tables::STATS.entries(&self.ebpf)?.len(),
            live_allocations: self.live.len(),
            stack_totals: tables::STACK_TOTALS.entries(&self.ebpf)?.len(),
            usdt_entries: self.usdt_figures().len()?,
        })
    }

    /// The kernel's totals for a process; zero before its first allocator call.
    pub fn stats(&self, pid: u32) -> Result<ProcessStats> {
        Ok(tables::STATS.get(&self.ebpf, &pid)?.unwrap_or_default())
    }

    /// Events that could not be charged to any process (the statistics map was full).
    pub fn global_lost_events(&self) -> Result<u64> {
        tables::LOST_EVENTS.get(&self.ebpf, GLOBAL_LOST_SLOT)
    }

    /// The stack every program uses, as this kernel's verifier reports it.
    pub fn verifier_report(&self) -> Result<Vec<verifier_report::ProgramStack>> {
        let attach_type = match self.link_kind() {
            LinkKind::Multi => aya_obj::generated::bpf_attach_type::BPF_TRACE_UPROBE_MULTI as u32,
            LinkKind::PerfEvent => 0,
        };
        verifier_report::report(BPF_OBJECT, &self.ebpf, attach_type)
    }

    /// How many runs of each program the kernel has skipped so far (its recursion guard: the
    /// program was already running on that CPU).
    pub fn skipped_runs(&self) -> Result<SkippedRuns> {
        let mut by_program = Vec::new();
        for (name, program) in self.ebpf.programs() {
            // Programs aya did not load (the uprobes, where uprobe_multi links are used) have no fd.
            let Ok(fd) = program.fd() else { continue };
            let misses = prog_info::recursion_misses(fd.as_fd())
                .with_context(|| format!("reading BPF program {name}'s statistics"))?;
            by_program.push((name.to_owned(), misses));
        }
        for (name, fd) in self.multi.iter().flat_map(MultiPrograms::named) {
            let misses = prog_info::recursion_misses(fd)
                .with_context(|| format!("reading BPF program {name}'s statistics"))?;
            by_program.push((name.to_owned(), misses));
        }
        by_program.retain(|(_, misses)| *misses > 0);
        Ok(SkippedRuns { by_program })
    }

    /// Frees the kernel's slots of threads for which `gone` holds, whose exit the kernel skipped;
    /// how many.
    pub fn free_slots_of_gone_threads(&self, gone: impl Fn(u32) -> bool) -> Result<usize> {
        thread_slots::free_slots_of_gone_threads(&self.ebpf, gone)
    }

    /// Whether the kernel saw the process exit: None when it has no figures of it.
    pub fn saw_exit(&self, pid: u32) -> Result<Option<bool>> {
        Ok(tables::STATS.get(&self.ebpf, &pid)?.map(|stats| stats.exited != 0))
    }

    /// Every live allocation the kernel knows, of every traced process.
    pub fn live_allocations(&self) -> Result<Vec<(AllocationKey, Allocation)>> {
        self.live.records()
    }

    /// What each (process, call stack) allocated and still holds.
    pub fn stack_totals(&self) -> Result<Vec<(StackKey, StackTotals)>> {
        tables::STACK_TOTALS.entries(&self.ebpf)
    }

    /// Takes every stack's frames out of the kernel's tables (shallow and deep), which then never
    /// fill: a stack seen again is written again, and found here again.
    pub fn take_stacks(&self) -> Result<Vec<(u64, Stack)>> {
        let shallow = tables::STACKS.take(&self.ebpf, |_, _| true)?.taken;
        let deep = tables::DEEP_STACKS.take(&self.ebpf, |_, _| true)?.taken;
        let shallow = shallow.into_iter().map(|(key, frames)| (key, Stack::new(&frames.frames)));
        Ok(shallow.chain(deep.into_iter().map(|(key, frames)| (key, Stack::new(&frames.frames)))).collect())
    }

    /// Takes out the totals of every (process, stack) with nothing live that `settled` allows: an
    /// allocation from it later starts a new entry, whose figures add to these. The others stay,
    /// and are returned as they were read.
    pub fn take_idle_stack_totals(
        &self,
        settled: impl Fn(&StackKey, &StackTotals) -> bool,
    ) -> Result<Taken<StackKey, StackTotals>> {
        tables::STACK_TOTALS
            .take(&self.ebpf, |key, totals| totals.live_allocations == 0 && settled(key, totals))
    }

    /// Takes the names of the Perl subs the kernel copied whole since the last call.
    pub fn take_perl_subs(&self) -> Result<Vec<(InterpreterCodeKey, PerlSub)>> {
        Ok(tables::PERL_SUBS.take(&self.ebpf, |_, sub| sub.complete != 0)?.taken)
    }

    /// Takes the names of the Python code objects the kernel copied whole since the last call.
    pub fn take_python_codes(&self) -> Result<Vec<(InterpreterCodeKey, PythonCode)>> {
        Ok(tables::PYTHON_CODES.take(&self.ebpf, |_, code| code.complete != 0)?.taken)
    }

    /// A stack's frames, from whichever of the kernel's tables holds it.
    pub fn stack(&self, stack: u64) -> Result<Option<Stack>> {
        if let Some(frames) = tables::STACKS.get(&self.ebpf, &stack)? {
            return Ok(Some(Stack::new(&frames.frames)));
        }
        Ok(tables::DEEP_STACKS.get(&self.ebpf, &stack)?.map(|frames| Stack::new(&frames.frames)))
    }
}

/// How a run links probe sites: as the kernel's features allow, unless MEMTRACE_LINKS says.
pub fn link_kind_for(features: &KernelFeatures) -> Result<LinkKind> {
    Ok(match std::env::var(LINK_KIND_VARIABLE).as_deref() {
        Ok("perf") => LinkKind::PerfEvent,
        Ok("multi") => LinkKind::Multi,
        Ok(other) => bail!("{LINK_KIND_VARIABLE}={other:?}: use `multi`, `perf`, or leave it unset"),
        Err(_) => features.link_kind(),
    })
}

/// What the programs' globals are set to at load.
struct Globals<'a> {
    config: &'a ProbeConfig,
    layout: &'a KernelLayout,
    self_tgid: u32,
    filter_comms: bool,
    filter_cgroups: bool,
}

/// Creates the object's maps, sized as the run asks, and sets its globals; the programs are
/// loaded after (`load_programs`, `load_multi`).
fn load_object(globals: &Globals<'_>, live_size: &TableSize) -> Result<Ebpf> {
    let config = globals.config;
    let mut loader = EbpfLoader::new();
    live_size.configure(&mut loader);
    let ebpf = loader
        .map_max_entries(tables::STACKS.name, config.max_stacks)
        .map_max_entries(tables::DEEP_STACKS.name, config.max_stacks)
        .map_max_entries(tables::STACK_TOTALS.name, config.max_stacks)
        .override_global("CAPTURE_STACKS", &u8::from(config.capture_stacks), true)
        .override_global("SAMPLE_MEAN", &config.sample_mean, true)
        .override_global("WINDOWED", &u8::from(config.windowed), true)
        .override_global("REACH", &config.reach.kernel_value(), true)
        .override_global("KERNEL_LAYOUT", globals.layout, true)
        .override_global("SELF_TGID", &globals.self_tgid, true)
        .override_global("FILTER_COMMS", &u8::from(globals.filter_comms), true)
        .override_global("FILTER_CGROUPS", &u8::from(globals.filter_cgroups), true)
        .override_global("AYA_LOG_LEVEL", &crate::kernel::log::kernel_level(config.debug_bpf), true)
        .load(BPF_OBJECT)
        .with_context(|| loading_failed(live_size))?;
    Ok(ebpf)
}

/// Loads the programs aya loads: the raw tracepoints, and the uprobes unless they were loaded for
/// uprobe_multi links (`multi`).
fn load_programs(ebpf: &mut Ebpf) -> Result<()> {
    for (name, program) in ebpf.programs_mut() {
        match program {
            // Loaded when first attached (`uprobe`, `MultiPrograms::program`).
            Program::UProbe(_) => Ok(()),
            Program::RawTracePoint(program) => program.load(),
            // Loaded with the kernel's BTF where it attaches (attach_exit_reader).
            Program::FEntry(_) => Ok(()),
            _ => bail!("BPF program {name} is of a kind memtrace does not load"),
        }
        .with_context(|| format!("verifying BPF program {name}"))?;
    }
    Ok(())
}

impl Probes {
    /// Lets the processes of cgroups `--container` and `--cgroup` name be traced (ids as
    /// `bpf_get_current_cgroup_id` gives them; the kernel checks their ancestors too).
    pub fn allow_cgroups(&mut self, ids: impl IntoIterator<Item = u64>) -> Result<()> {
        let mut allowed = tables::ALLOWED_CGROUPS.writable(&mut self.ebpf)?;
        for id in ids {
            allowed.insert(id, 1, 0).with_context(|| format!("more than {MAX_CGROUPS} cgroups to trace"))?;
        }
        Ok(())
    }
}

/// Writes the pids `--exclude-pid` leaves out and the command names `--comm` allows.
fn write_filter(ebpf: &mut Ebpf, excluded_pids: &[u32], only_comms: &[[u8; 16]]) -> Result<()> {
    let mut excluded = tables::EXCLUDED_PIDS.writable(ebpf)?;
    for pid in excluded_pids {
        excluded.insert(pid, 1, 0).context("too many --exclude-pid")?;
    }
    let mut comms = tables::ALLOWED_COMMS.writable(ebpf)?;
    for comm in only_comms {
        comms.insert(comm, 1, 0).with_context(|| format!("more than {MAX_COMMS} --comm names"))?;
    }
    Ok(())
}

/// Prepares the uprobe programs for uprobe_multi links where the kernel has them; None where it
/// has not (before 6.6), or when MEMTRACE_LINKS=perf asks for per-site links.
fn load_multi(ebpf: &Ebpf, link_kind: LinkKind) -> Result<Option<MultiPrograms>> {
    match link_kind {
        LinkKind::Multi => MultiPrograms::prepare(BPF_OBJECT, ebpf).map(Some),
        LinkKind::PerfEvent => Ok(None),
    }
}

/// The uprobe program `name` as aya loads it for per-site links, verified on first use.
fn uprobe<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a aya::programs::UProbe> {
    let program: &mut aya::programs::UProbe = ebpf
        .program_mut(name)
        .with_context(|| format!("the BPF object has no program {name}"))?
        .try_into()?;
    if program.fd().is_err() {
        program.load().with_context(|| format!("verifying BPF program {name}"))?;
    }
    Ok(program)
}

/// What to say when the kernel refuses the BPF object: a large live-allocation table is the usual
/// reason (its slots are allocated up front).
fn loading_failed(live_size: &TableSize) -> String {
    if live_size.records() <= DEFAULT_MAX_LIVE_ALLOCATIONS {
        return "loading the BPF programs into the kernel".to_owned();
    }
    format!(
        "loading the BPF programs into the kernel, with a live-allocation table of --max-allocations \
         {} entries (about {} MB of kernel memory; lower it if the kernel cannot allocate that)",
        live_size.records(),
        live_size.kernel_bytes() / 1_000_000
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
