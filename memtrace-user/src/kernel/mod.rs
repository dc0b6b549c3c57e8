//! The BPF side as userspace sees it: load the embedded object, attach its programs to an allocator
//! for one process or for all, and read the kernel's maps, each through its typed accessor
//! (tables.rs). Every attachment is a link owned by a file descriptor of this process, so the
//! kernel removes it when memtrace exits, however it exits. What to attach is decided above this
//! room (following, and usdt for USDT sites), which calls in here and is never called back.
//!
//! `Probes` is loaded here; its operations are split by concern, one file each: attach.rs (the
//! allocators' probes, the C library's mapping calls, fork and dlopen), usdt_tables.rs (USDT and
//! sampled sites, and their figures), windows.rs (`--window`), processes.rs (which processes are
//! traced, the exec hold, announcements, release), recorded.rs (what the probes recorded: live
//! blocks, regions, stacks), unwind_tables.rs (the unwinder's tables) and health.rs (occupancy,
//! losses, skipped runs, the verifier's report).

mod attach;
mod embedded;
pub mod features;
mod health;
pub mod interpreter_tables;
mod kernel_btf;
mod links;
mod live_table;
mod loader;
pub mod log;
mod map_ops;
mod per_cpu;
mod processes;
mod recorded;
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

use std::os::fd::AsFd;

use anyhow::{bail, Context, Result};
use aya::{programs::Program, Ebpf, EbpfLoader};
use memtrace_common::{programs, reach, KernelLayout, DEFAULT_MAX_LIVE_ALLOCATIONS, MAX_COMMS};

use embedded::BPF_OBJECT;
pub use kernel_btf::kernel_layout;
use links::{CallPrograms, Direction, Links};
pub use links::{Scope, Site};
use live_table::{LiveTable, TableSize};
use loader::MultiPrograms;
pub use per_cpu::with_per_cpu_sums;

use crate::{
    kernel::features::{KernelFeatures, LinkKind},
    kernel::log::BpfLog,
    process::{cgroup::CgroupFilter, probe_point::SingleStepped},
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

    /// Detaches every probe at once; what the kernel counted stays readable in the maps.
    pub fn detach(&mut self) {
        self.links.detach();
        if let Some(windows) = &mut self.windows {
            windows.links.detach();
        }
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
