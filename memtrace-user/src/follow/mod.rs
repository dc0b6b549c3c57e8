//! Following processes as they come and go: the targets of a run (`--pid`, a launched command and,
//! unless `--no-children`, every process they fork), or every process (`--all`). The exec watcher
//! names each exec'd program's files while the process exists, and its execs are held (`hold`)
//! until that program is probed; processes are found as they first allocate (or report through
//! USDT) and seen when they exit. What is attached for each is crate::attach's: uprobes belong to
//! a file, so one attachment serves every process that maps it, in any mount namespace.

pub mod hold;

use std::{
    collections::HashSet,
    io::Read,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
    path::{Path, PathBuf},
    sync::{
        mpsc::{self, Receiver},
        Arc,
    },
};

use anyhow::{Context, Result};
use aya::maps::{MapData, RingBuf};
use memtrace_common::{ExecEvent, ProcessStats};
use nix::{
    fcntl::OFlag,
    poll::{poll, PollFd, PollFlags, PollTimeout},
    unistd::pipe2,
};

use self::hold::{fanotify::MISSED_WITHOUT_HOLD, HeldExecs, Holding, ProbeRequest};
use crate::{
    attach::usdt::UsdtProbes,
    attach::Attachments,
    kernel::features::{Feature, KernelFeatures},
    kernel::{Probes, Reach, Scope},
    model::{identity::ProcessIdentity, Model},
    process::allocator::{Allocator, Overrides},
    process::{cgroup::CgroupNames, procfs},
    process::{FileCache, ObjectFile, ProcessImage},
};

pub struct Following {
    /// Which processes count, and so how probes are attached: per target, or for every process.
    reach: Reach,
    /// What is attached, and what each file is.
    attach: Attachments,
    /// The images of programs just exec'd, resolved by the watcher thread while the process
    /// existed, with their files open: a short-lived program is gone, and its /proc/PID/exe with
    /// it, by the time the main loop scans them for USDT probes.
    execs: Receiver<ProcessImage>,
    /// Readable when the watcher has seen execs, or a held exec waits for its probes.
    wakeup: std::fs::File,
    /// Execs of followed processes, held until their program's allocator is probed; None where
    /// no tree is followed, or without CAP_SYS_ADMIN.
    held: Option<HeldExecs>,
    /// Processes seen to exec during the run: their images ran under the probes from the start.
    execed: HashSet<u32>,
    /// The paths of the cgroups processes were in, by the id the kernel recorded.
    cgroups: CgroupNames,
    /// The cgroups `--container` and `--cgroup` let the kernel trace, so far.
    allowed_cgroups: HashSet<u64>,
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
    ) -> Result<Self> {
        let exec_events = probes.follow_processes()?;
        crate::process::raise_open_file_limit();
        let cache = FileCache::default();
        let (sender, execs) = mpsc::channel();
        let (wakeup, wake) = pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK).context("creating a pipe")?;
        let hold_wake = wake.try_clone().context("duplicating a pipe")?;
        // A thread of its own reads exec events at once: a short-lived process is gone by the next
        // sample, and with it the /proc entries that name its files.
        let watcher_cache = cache.clone();
        std::thread::Builder::new()
            .name("exec-watcher".into())
            .spawn(move || watch_execs(exec_events, &watcher_cache, |exec| sender.send(exec).is_ok(), wake))
            .context("starting the exec watcher")?;
        let attach = Attachments::new(overrides, cache, usdt);
        let held = match features.lacks(Feature::FanotifyExecPerm) {
            true => cannot_hold_execs(&reach),
            false => hold_execs(probes, &reach, &attach, hold_wake)?,
        };
        let mut this = Self {
            reach,
            attach,
            execs,
            wakeup: wakeup.into(),
            held,
            execed: HashSet::new(),
            cgroups: CgroupNames::default(),
            allowed_cgroups: HashSet::new(),
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
        self.attach.target(probes, pid, image, self.reach.scope_for(pid))
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

    /// Probes the allocators and USDT sites that newly exec'd programs bring along; returns the
    /// object files they map (still open), for symbolization.
    pub fn handle_execs(&mut self, probes: &mut Probes) -> Result<Vec<ObjectFile>> {
        let mut drained = [0u8; 256];
        while matches!(self.wakeup.read(&mut drained), Ok(n) if n > 0) {}
        // Held execs first: their processes wait inside execve(2).
        let requests: Vec<ProbeRequest> = self.held.iter().flat_map(HeldExecs::requests).collect();
        for request in requests {
            let probed = self.attach.allocator(probes, &request.allocator, Scope::AllProcesses);
            request.done();
            probed?;
        }
        let mut objects = Vec::new();
        while let Ok(image) = self.execs.try_recv() {
            self.execed.extend(image.pid);
            let scope = self.reach.scope_for(image.pid.unwrap_or_default());
            self.attach.exec(probes, &image, scope)?;
            objects.extend(image.objects);
        }
        Ok(objects)
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

    /// Who process `pid` is, as it enters the model (`ProcessIdentity::read`), with what the
    /// kernel recorded at its first event where it has figures.
    pub fn identify(&mut self, pid: u32, comm: String, stats: Option<&ProcessStats>) -> ProcessIdentity {
        ProcessIdentity::read(pid, comm, stats, &mut self.cgroups)
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
            if !process.exited && !Path::new(&format!("/proc/{}", process.identity.pid)).exists() {
                process.exited = true;
            }
        }
        Ok(())
    }

    /// Lets go of held execs (memtrace is about to stop, or to end).
    pub fn release_held_execs(&mut self) {
        if let Some(held) = &mut self.held {
            held.release();
        }
    }

    /// Holds execs again, after memtrace was continued.
    pub fn resume_held_execs(&mut self) {
        if let Some(Err(err)) = self.held.as_mut().map(HeldExecs::resume) {
            eprintln!("memtrace: warning: cannot hold execs again: {err}");
        }
    }

    /// Execs let go before their program's allocator was probed (held past the bound).
    pub fn missed_execs(&self) -> u64 {
        self.held.as_ref().map_or(0, |held| held.stats().missed)
    }
}

/// Starts holding the execs of followed processes (a tree, or every process); says so when it
/// cannot, and what that misses.
fn hold_execs(
    probes: &Probes,
    reach: &Reach,
    attach: &Attachments,
    wake: OwnedFd,
) -> Result<Option<HeldExecs>> {
    let holding = match reach {
        Reach::Targets => return Ok(None),
        Reach::Tree => Holding::Tree(Arc::new(probes.tree_lookup()?)),
        Reach::AllProcesses(_) => Holding::Everyone,
    };
    let (probed, cache, overrides) =
        (attach.probed_for_all(), attach.cache().clone(), attach.overrides().clone());
    match HeldExecs::start(holding, probed, cache, overrides, wake) {
        Ok(held) => Ok(Some(held)),
        Err(why) => {
            eprintln!("memtrace: warning: cannot hold execs: {why}");
            Ok(None)
        }
    }
}

/// Where the kernel has no fanotify exec permission events, execs of followed processes go on
/// unheld: says so, and what that misses.
fn cannot_hold_execs(reach: &Reach) -> Option<HeldExecs> {
    if !matches!(reach, Reach::Targets) {
        let info = Feature::FanotifyExecPerm.info();
        eprintln!(
            "memtrace: warning: this kernel lacks {} (Linux {}.{}, CONFIG_FANOTIFY_ACCESS_PERMISSIONS); {}",
            info.name, info.since.0, info.since.1, MISSED_WITHOUT_HOLD
        );
    }
    None
}

/// The exec watcher: names the files of each exec'd process while it still exists, hands them on
/// with `deliver` and wakes the main loop, until the main loop is gone.
fn watch_execs(
    mut events: RingBuf<MapData>,
    cache: &FileCache,
    deliver: impl Fn(ProcessImage) -> bool,
    wake: OwnedFd,
) {
    crate::process::threads::set_urgency(crate::process::threads::Urgency::Racing);
    loop {
        let mut fds = [PollFd::new(events.as_fd(), PollFlags::POLLIN)];
        if poll(&mut fds, PollTimeout::NONE).is_err() {
            continue;
        }
        while let Some(item) = events.next() {
            if item.len() < size_of::<ExecEvent>() {
                continue;
            }
            // SAFETY: the kernel side writes exactly one ExecEvent per record.
            let event: ExecEvent = unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
            // A process that is gone already has no image to resolve.
            let Ok(image) = ProcessImage::of_exec(event.tgid, cache) else { continue };
            if !deliver(image) {
                return;
            }
        }
        // SAFETY: writing one byte from a valid buffer to a pipe we own.
        unsafe { libc::write(wake.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
    }
}
