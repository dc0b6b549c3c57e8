//! Probes on the allocators of traced processes: each allocator's entry points and returns, the C
//! library's mapping calls, and the calls that follow a tree (fork) or hold a process while a
//! library's unwind table loads (dlopen); `--window`'s probes, attached as each window opens and
//! detached as it closes; the probes the kernel single-steps, noted as they are placed.

use anyhow::{bail, Context, Result};
use memtrace_common::{AllocatorCode, AllocatorFunction, ProbeCookie, MAX_ALLOCATOR_CODES};

use super::{
    links::{CallPrograms, Calls, Direction, Scope, Site},
    tables, windows, Attach, AttachedAllocator, LinkSet, Probes, FORK_RETURN, LIBRARY_LOADED, MAP_ENTRY,
    MAP_RETURN,
};
use crate::process::{
    allocator::Allocator,
    entry_points::ResolvedEntryPoint,
    map_calls::MapCalls,
    probe_point::{ProbePoint, SingleStepped},
};

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

impl Probes {
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

    /// Attaches one file's calls, entries and returns, each a link. Returns first: a call entered
    /// before its return probe existed never returns through it, so an entry seen without its
    /// return would leave the thread inside a call for good. A return whose entry was not seen is
    /// ignored.
    pub(super) fn attach_calls(&mut self, calls: Calls<'_>, scope: Scope, set: LinkSet) -> Result<()> {
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
}
