//! Following processes as they come and go: the targets of a run (`--pid`, a launched command and,
//! unless `--no-children`, every process they fork), or every process (`--all`). The exec watcher
//! names each exec'd program's files while the process exists, and an exec of a program new to
//! memtrace is held (`hold`: stopped by the BPF side) until that program is probed; processes are found as they first allocate (or report through
//! USDT) and seen when they exit. What is attached for each is crate::attach's: under `--all` one
//! attachment of a file serves every process that maps it, in any mount namespace; a followed
//! tree's are per process (links that carry its pid, so no other process takes a trap), each new
//! process held at its return from fork until its own are in, and closed once it is gone.

pub mod hold;

use std::{
    collections::{HashMap, HashSet},
    io::Read,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
    path::PathBuf,
    sync::mpsc::{self, Receiver},
    time::Instant,
};

use anyhow::{Context, Result};
use aya::maps::{MapData, RingBuf};
use memtrace_common::{announced, exec_hold, ExecEvent, ImageKey, ProcessStats};
use nix::{
    fcntl::OFlag,
    poll::{poll, PollFd, PollFlags, PollTimeout},
    unistd::pipe2,
};

use self::hold::{HeldExecs, DEFAULT_BOUND, MISSED_WITHOUT_HOLD};
use crate::{
    attach::usdt::UsdtProbes,
    attach::Attachments,
    kernel::features::{Feature, KernelFeatures},
    kernel::{Probes, Reach, Scope},
    model::{
        identity::{AtExec, ProcessIdentity},
        Model,
    },
    plan::Runtimes,
    process::allocator::{Allocator, Overrides},
    process::{
        cgroup::CgroupNames,
        containerd::ContainerNames,
        procfs::{self, is_running},
    },
    process::{FileCache, ObjectFile, ProcessImage},
};

pub struct Following {
    /// Which processes count, and so how probes are attached: per target, or for every process.
    reach: Reach,
    /// What is attached, and what each file is.
    attach: Attachments,
    /// The images of programs just exec'd, resolved by the watcher thread while the process
    /// existed, with their files open: a short-lived program is gone, and its /proc/PID/exe with
    /// it, by the time the main loop scans them for USDT probes. And the library loads heard of.
    execs: Receiver<Announcement>,
    /// Readable when the watcher has seen execs.
    wakeup: std::fs::File,
    /// Execs of followed processes stopped until their program is probed; None where no tree is
    /// followed, or the kernel cannot stop them.
    held: Option<HeldExecs>,
    /// Processes seen to exec during the run: their images ran under the probes from the start.
    execed: HashSet<u32>,
    /// The paths of the cgroups processes were in, by the id the kernel recorded.
    cgroups: CgroupNames,
    /// What each exec'd process was seen to run its new program in and as, until the process is
    /// identified: a process gone by the next sample has no /proc to say it.
    at_exec: HashMap<u32, AtExec>,
    /// The cgroups `--container` and `--cgroup` let the kernel trace, so far.
    allowed_cgroups: HashSet<u64>,
    /// The pod, namespace and container names of containers, asked of containerd.
    container_names: ContainerNames,
    /// The processes probed for themselves (at add_target, fork or exec): every one anything is
    /// attached for alone.
    probed_for: HashSet<u32>,
    /// The tree's processes the kernel follows that were not probed at the last look.
    unprobed_last: HashSet<u32>,
    /// Processes of the tree probed only when found at a sample: the kernel skipped the run that
    /// would have held them at their return from fork, and their first allocations are missed.
    late_forks: u64,
    /// Library loads held (`library_loads_held`).
    library_loads_held: u64,
}

impl Following {
    /// Starts following execs; under `Reach::AllProcesses`, probes the allocators of every running
    /// process and every allocator library installed. Targets are named with `add_target`.
    pub fn start(
        probes: &mut Probes,
        overrides: Overrides,
        reach: Reach,
        features: &KernelFeatures,
        usdt: UsdtProbes,
        runtimes: &Runtimes,
    ) -> Result<Self> {
        let exec_events = probes.follow_processes()?;
        crate::process::raise_open_file_limit();
        let cache = FileCache::default();
        let (sender, execs) = mpsc::channel();
        let (wakeup, wake) = pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK).context("creating a pipe")?;
        let held = match features.lacks(Feature::SendSignal) || features.lacks(Feature::Btf) {
            true => cannot_hold_execs(&reach),
            false => hold_execs(probes, &reach, usdt.app_sampled())?,
        };
        // A thread of its own reads exec events at once: a short-lived process is gone by the next
        // sample, and with it the /proc entries that name its files; a stopped one waits for it.
        let watcher = Watcher { cache: cache.clone(), held: held.clone(), wake };
        std::thread::Builder::new()
            .name("exec-watcher".into())
            .spawn(move || watcher.run(exec_events, |exec| sender.send(exec).is_ok()))
            .context("starting the exec watcher")?;
        let attach = Attachments::new(overrides, cache, usdt);
        let mut this = Self {
            reach,
            attach,
            execs,
            wakeup: wakeup.into(),
            held,
            execed: HashSet::new(),
            cgroups: CgroupNames::default(),
            at_exec: HashMap::new(),
            allowed_cgroups: HashSet::new(),
            container_names: ContainerNames::new(runtimes.containerd_socket.clone()),
            probed_for: HashSet::new(),
            unprobed_last: HashSet::new(),
            late_forks: 0,
            library_loads_held: 0,
        };
        if let Reach::AllProcesses(filter) = &this.reach {
            for (flag, name) in filter.cgroups.unmatched() {
                eprintln!("memtrace: no cgroup matches {flag} {name} yet; traced once it exists (looked for at each sample)");
            }
            this.allow_cgroups(probes)?;
            this.attach.every_process(probes)?;
        }
        Ok(this)
    }

    /// Traces `pid`, whose image (running, or a command about to exec) is `image`: probes its
    /// allocator and USDT sites; returns the allocator.
    pub fn add_target(&mut self, probes: &mut Probes, pid: u32, image: &ProcessImage) -> Result<Allocator> {
        let allocator = self.attach.target(probes, pid, image, self.reach.scope_for(pid))?;
        self.probed_for.insert(pid);
        // Probed now for every process: a launched command's exec of it needs no stop.
        if let (Some(_), Some(program), true) =
            (&self.held, image.executable(), self.probes_serve_every_process())
        {
            probes.know_image(program.id.kernel_key())?;
        }
        Ok(allocator)
    }

    /// Whether a file's probes, once attached, serve every process that maps it (`--all`), so a
    /// program probed once needs no stop at its later execs; a tree's probes are per process.
    fn probes_serve_every_process(&self) -> bool {
        matches!(self.reach, Reach::AllProcesses(_))
    }

    /// Forgets, and detaches, what was attached for processes that are gone (a followed tree's
    /// probes are per process: each one's links are closed once it is).
    pub fn forget_gone_processes(&mut self, probes: &mut Probes) {
        let gone: Vec<u32> = self.probed_for.iter().copied().filter(|&pid| !is_running(pid)).collect();
        for pid in gone {
            self.attach.forget_process(probes, pid);
            self.probed_for.remove(&pid);
        }
    }

    /// Probes the tree's processes the kernel follows but memtrace never heard of, found at two
    /// looks in a row (at the first, their fork may still be on its way): the kernel skipped the
    /// run of fork_return that would have held them. Says so, and counts them.
    pub fn probe_late_forks(&mut self, probes: &mut Probes) -> Result<()> {
        if !matches!(self.reach, Reach::Tree) {
            return Ok(());
        }
        let unprobed: HashSet<u32> = probes
            .tree_processes()?
            .into_iter()
            .filter(|pid| !self.probed_for.contains(pid) && is_running(*pid))
            .collect();
        let late: Vec<u32> = unprobed.intersection(&self.unprobed_last).copied().collect();
        for &pid in &late {
            if let Ok(image) = ProcessImage::of_process(pid, self.attach.cache()) {
                self.attach.exec(probes, &image, Scope::Process(pid))?;
            }
            self.probed_for.insert(pid);
        }
        if !late.is_empty() {
            self.late_forks += late.len() as u64;
            eprintln!(
                "memtrace: warning: {} processes of the tree probed late ({} in all): the kernel skipped                  the run that holds a new process at its return from fork; their first allocations are missed",
                late.len(),
                self.late_forks
            );
        }
        self.unprobed_last = unprobed.into_iter().filter(|pid| !late.contains(pid)).collect();
        Ok(())
    }

    /// The USDT sites wanted and found.
    pub fn usdt(&self) -> &UsdtProbes {
        self.attach.usdt()
    }

    /// What each file is, as read so far.
    pub fn cache(&self) -> &FileCache {
        self.attach.cache()
    }

    /// How many allocator files are probed (the mapping calls' files, libc mostly, not counted).
    pub fn probed_files(&self) -> usize {
        self.attach.probed_files()
    }

    /// Readable when processes have exec'd new programs.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.wakeup.as_fd()
    }

    /// Probes the allocators and USDT sites that newly exec'd programs bring along, and a followed
    /// tree's new processes for themselves; returns the object files the exec'd programs map
    /// (still open), for symbolization: none where only forks were heard of. `prepare` is given
    /// what a held process needs before it goes on: an exec'd program's files (their unwind
    /// tables, so that its first stacks are whole), or the process that loaded a library (its
    /// mapping table, with the library's).
    pub fn handle_execs(
        &mut self,
        probes: &mut Probes,
        mut prepare: impl FnMut(&mut Probes, Ready<'_>) -> Result<()>,
    ) -> Result<Vec<ObjectFile>> {
        let mut drained = [0u8; 256];
        while matches!(self.wakeup.read(&mut drained), Ok(n) if n > 0) {}
        let mut objects = Vec::new();
        while let Ok(announcement) = self.execs.try_recv() {
            match announcement {
                Announcement::Image(exec) => objects.extend(self.handle_image(probes, exec, &mut prepare)?),
                Announcement::Library { pid, stopped } => {
                    let prepared = prepare(probes, Ready::Mappings(pid));
                    if let (true, Some(held)) = (stopped, &self.held) {
                        self.library_loads_held += 1;
                        held.probed(pid);
                    }
                    // A process gone meanwhile has no mappings to read.
                    unless_gone(pid, prepared)?;
                }
            }
        }
        Ok(objects)
    }

    /// Probes what a new program brings, or a followed tree's new process for itself; returns the
    /// program's files (none for a fork: they are its parent's, indexed already).
    fn handle_image(
        &mut self,
        probes: &mut Probes,
        exec: Exec,
        prepare: &mut impl FnMut(&mut Probes, Ready<'_>) -> Result<()>,
    ) -> Result<Vec<ObjectFile>> {
        let Exec { image, stopped, cgroup, forked } = exec;
        let pid = image.pid.unwrap_or_default();
        if forked {
            // A new process: what was attached for an earlier one with its pid is not its own.
            self.attach.forget_process(probes, pid);
        } else {
            self.execed.insert(pid);
            let program = image.objects.first().map(|program| program.path.clone());
            self.note_exec(pid, AtExec { cgroup, program });
        }
        let probed = self.attach.exec(probes, &image, self.reach.scope_for(pid));
        self.probed_for.insert(pid);
        // A process gone before its probes are in needs none (its links would name no task).
        let probed = unless_gone(pid, probed);
        if let (Some(key), Some(held)) = (stopped, &self.held) {
            // Where probes serve every process, the program's later execs need no stop; this
            // one goes on, probed (or not: the error says).
            let knows = probed.is_ok() && !forked && self.probes_serve_every_process();
            let known = knows.then(|| probes.know_image(key)).transpose();
            let prepared = prepare(probes, Ready::Files(&image.objects));
            held.probed(pid);
            known?;
            prepared?;
        }
        probed?;
        Ok(if forked { Vec::new() } else { image.objects })
    }

    /// Lets the kernel trace the cgroups `--container` and `--cgroup` name that exist now (a new
    /// cgroup below one named is traced by the kernel from its first event; a container made
    /// later is found here, at the next sample).
    pub fn allow_cgroups(&mut self, probes: &mut Probes) -> Result<()> {
        let Reach::AllProcesses(filter) = &self.reach else { return Ok(()) };
        if filter.cgroups.is_empty() {
            return Ok(());
        }
        let mut new = filter.cgroups.matching()?;
        new.retain(|id, _| self.allowed_cgroups.insert(*id));
        for path in new.values() {
            eprintln!("memtrace: following cgroup {path}");
        }
        probes.allow_cgroups(new.into_keys())
    }

    /// Keeps what was seen of `pid`'s exec for its identity (`ProcessIdentity::read`); that of
    /// processes that never allocated goes once many are kept. A launched command is noted here
    /// too, with the program it was started to run.
    pub fn note_exec(&mut self, pid: u32, seen: AtExec) {
        const KEPT: usize = 4096;
        if seen == AtExec::default() {
            return;
        }
        if self.at_exec.len() >= KEPT {
            self.at_exec.retain(|pid, _| is_running(*pid));
        }
        self.at_exec.insert(pid, seen);
    }

    /// Who process `pid` is, as it enters the model (`ProcessIdentity::read`), with what the
    /// kernel recorded at its first event where it has figures, and its container's Kubernetes
    /// names where containerd knows them (asked once per container).
    pub fn identify(&mut self, pid: u32, comm: String, stats: Option<&ProcessStats>) -> ProcessIdentity {
        let at_exec = self.at_exec.remove(&pid).unwrap_or_default();
        let mut identity = ProcessIdentity::read(pid, comm, stats, &mut self.cgroups, at_exec);
        if let Some(container) = identity.container.as_mut() {
            self.container_names.fill(container);
        }
        identity
    }

    /// Adds the processes the kernel has seen allocate or report through USDT since the last
    /// sample to the model.
    pub fn adopt_new_processes(&mut self, probes: &Probes, model: &mut Model) -> Result<()> {
        for (pid, stats) in probes.traced_processes()? {
            let allocator = probes.allocator_named(stats.allocator).cloned().unwrap_or_default();
            // The kernel forgot a released process: figures under its pid are a new process's.
            if model.processes.get(&pid).is_some_and(|process| process.released) {
                model.retire(pid);
            }
            if !model.processes.contains_key(&pid) {
                let comm = crate::model::kernel_comm(&stats).unwrap_or_default();
                model.add_process(self.identify(pid, comm, Some(&stats)), PathBuf::new());
            }
            let Some(process) = model.processes.get_mut(&pid) else { continue };
            // A new image's figures: it may run elsewhere than the program it replaced (runc's
            // init, seen allocating before it joined its container's cgroup, then exec'd the
            // container's program there), so who it is is read again.
            if stats.started_ns != 0 && stats.started_ns != process.identity.started_ns {
                let comm = crate::model::kernel_comm(&stats).unwrap_or_else(|| process.identity.comm.clone());
                process.identity = self.identify(pid, comm, Some(&stats));
            }
            // Its figures restart at exec: from then on, every block went through the probes.
            process.seen_from_start |= self.execed.contains(&pid);
            // A process that exec'd a program allocates through that program's allocator.
            if stats.allocator != 0 {
                process.allocator = allocator.path;
                process.allocator_kind = allocator.kind;
            }
        }
        // The USDT handler gives a reporting process figures in the kernel too; these are the
        // ones it could not (the table of processes was full).
        for pid in crate::attach::usdt::reporting_processes(probes)? {
            if !model.processes.contains_key(&pid) {
                let identity = self.identify(pid, procfs::comm(pid).unwrap_or_default(), None);
                model.add_process(identity, PathBuf::new());
            }
        }
        // The kernel marks a process exited in its figures; a process without any (it has not
        // allocated since its last exec, or the table was full), or whose figures the kernel made
        // again after its exit (a thread that allocated after its leader exited), is seen to be
        // gone here.
        for process in model.processes.values_mut() {
            if !process.exited && !is_running(process.identity.pid) {
                process.exited = true;
            }
        }
        Ok(())
    }

    /// Lets go of held execs (memtrace is about to stop, or to end).
    pub fn release_held_execs(&mut self) {
        if let Some(held) = &self.held {
            held.release();
        }
    }

    /// Holds execs again, after memtrace was continued.
    pub fn resume_held_execs(&mut self) {
        if let Some(Err(err)) = self.held.as_ref().map(HeldExecs::resume) {
            eprintln!("memtrace: warning: cannot hold execs again: {err}");
        }
    }

    /// Library loads of traced processes held until the library's unwind table was in.
    pub fn library_loads_held(&self) -> u64 {
        self.library_loads_held
    }

    /// Execs let go before their program's allocator was probed (held past the bound).
    pub fn missed_execs(&self) -> u64 {
        self.held.as_ref().map_or(0, |held| held.stats().missed)
    }
}

/// `result`, unless it failed because process `pid` is gone: what was being done for it is then
/// not needed.
fn unless_gone(pid: u32, result: Result<()>) -> Result<()> {
    result.or_else(|err| if is_running(pid) { Err(err) } else { Ok(()) })
}

/// Starts holding the execs of followed processes (a tree, or every process); says so when it
/// cannot, and what that misses.
fn hold_execs(probes: &Probes, reach: &Reach, app_sampled: bool) -> Result<Option<HeldExecs>> {
    // With --app-sampled no allocator is probed: there is nothing for an exec to wait for. (The
    // new program's otel_memory sites are attached as its exec is announced.)
    if app_sampled {
        return Ok(None);
    }
    match reach {
        Reach::Targets => return Ok(None),
        // A tree's processes are memtrace's own session's, which SIGCONT reaches without CAP_KILL.
        Reach::Tree => {}
        Reach::AllProcesses(_) => {
            if let Err(why) = crate::privileges::can_continue_others() {
                eprintln!("memtrace: warning: {why}; {MISSED_WITHOUT_HOLD}");
                return Ok(None);
            }
        }
    }
    match HeldExecs::start(probes.hold_switch()?, DEFAULT_BOUND) {
        Ok(held) => Ok(Some(held)),
        Err(why) => {
            eprintln!("memtrace: warning: cannot hold execs: {why}; {MISSED_WITHOUT_HOLD}");
            Ok(None)
        }
    }
}

/// Where the kernel cannot stop a process at exec from BPF (bpf_send_signal), or memtrace cannot
/// name the exec'd file (no BTF), execs of followed processes go on unheld: says so, and what that
/// misses.
fn cannot_hold_execs(reach: &Reach) -> Option<HeldExecs> {
    if !matches!(reach, Reach::Targets) {
        let info = Feature::SendSignal.info();
        eprintln!(
            "memtrace: warning: this kernel lacks {} (Linux {}.{}) or BTF; {}",
            info.name, info.since.0, info.since.1, MISSED_WITHOUT_HOLD
        );
    }
    None
}

/// What a held process needs before it goes on ([`Following::handle_execs`]).
pub enum Ready<'a> {
    /// A new program's files: their unwind tables.
    Files(&'a [ObjectFile]),
    /// A process that loaded a library: its mapping table, with the library's unwind table.
    Mappings(u32),
}

/// What the watcher heard of a process.
enum Announcement {
    /// A new program, or a followed tree's new process.
    Image(Exec),
    /// A traced process loaded a library; `stopped` where the BPF side stopped it until the
    /// library's unwind table is in.
    Library { pid: u32, stopped: bool },
}

/// An exec the watcher read: the new image, the program's file where the BPF side stopped the
/// process until it is probed, and the cgroup it runs in.
struct Exec {
    image: ProcessImage,
    stopped: Option<ImageKey>,
    cgroup: Option<String>,
    /// A followed tree's new process at its return from fork, running its parent's image.
    forked: bool,
}

/// The exec watcher: names the files of each exec'd process while it still exists, hands them on
/// and wakes the main loop, until the main loop is gone; notes stops in the hold's books and
/// continues those stopped past the bound.
struct Watcher {
    cache: FileCache,
    held: Option<HeldExecs>,
    wake: OwnedFd,
}

impl Watcher {
    fn run(self, mut events: RingBuf<MapData>, deliver: impl Fn(Announcement) -> bool) {
        crate::process::threads::set_urgency(crate::process::threads::Urgency::Racing);
        let mut next_bound = None;
        loop {
            let mut fds = [PollFd::new(events.as_fd(), PollFlags::POLLIN)];
            let timeout = next_bound.map_or(PollTimeout::NONE, milliseconds_until);
            if poll(&mut fds, timeout).is_err() {
                continue;
            }
            while let Some(item) = events.next() {
                if item.len() < size_of::<ExecEvent>() {
                    continue;
                }
                // SAFETY: the kernel side writes exactly one ExecEvent per record.
                let event: ExecEvent = unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
                if let Some(exec) = self.read(&event) {
                    if !deliver(exec) {
                        return;
                    }
                }
            }
            next_bound = self.held.as_ref().and_then(|held| held.expire(Instant::now()));
            // SAFETY: writing one byte from a valid buffer to a pipe we own.
            unsafe { libc::write(self.wake.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
        }
    }

    /// What the event announces, noting a stop: an exec's or a fork's image (a process that is
    /// gone already has no image to resolve, and one whose image cannot be resolved goes on at
    /// once), or a library load.
    fn read(&self, event: &ExecEvent) -> Option<Announcement> {
        let stopped = match (&self.held, event.hold) {
            (Some(held), exec_hold::STOPPED) => {
                held.stopped(event.tgid);
                Some(event.image)
            }
            (Some(held), exec_hold::REFUSED) => {
                held.refused();
                None
            }
            _ => None,
        };
        let image = match event.kind {
            announced::LIBRARY => {
                return Some(Announcement::Library { pid: event.tgid, stopped: stopped.is_some() })
            }
            announced::FORK => ProcessImage::of_process(event.tgid, &self.cache),
            _ => ProcessImage::of_exec(event.tgid, &self.cache),
        };
        match image {
            Ok(image) => {
                let cgroup = crate::process::cgroup::of_pid(event.tgid);
                let forked = event.kind == announced::FORK;
                Some(Announcement::Image(Exec { image, stopped, cgroup, forked }))
            }
            Err(_) => {
                if let (Some(held), Some(_)) = (&self.held, stopped) {
                    held.let_go(event.tgid);
                }
                None
            }
        }
    }
}

/// poll's timeout until `deadline`, rounded up to a whole millisecond so poll does not wake early.
fn milliseconds_until(deadline: Instant) -> PollTimeout {
    let left = deadline.saturating_duration_since(Instant::now());
    PollTimeout::try_from(left.as_micros().div_ceil(1000)).unwrap_or(PollTimeout::MAX)
}
