//! System-wide tracing (`--all`): probes on every allocator any process uses, or may load later,
//! firing in every process; processes are found as they first allocate (or report through USDT)
//! and released when they exit. USDT probe sites are attached the same way, file by file, for every
//! process (crate::usdt).

use std::{
    collections::HashSet,
    fs,
    io::Read,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
        unix::fs::MetadataExt,
    },
    path::{Path, PathBuf},
    sync::mpsc::{self, Receiver},
};

use anyhow::{Context, Result};
use aya::maps::{MapData, RingBuf};
use memtrace_common::ExecEvent;
use nix::{
    fcntl::OFlag,
    poll::{poll, PollFd, PollFlags, PollTimeout},
    unistd::pipe2,
};

use crate::{
    allocator::{installed_allocator_libraries, Allocator, Overrides},
    model::Model,
    objects::{self, ObjectFile},
    probes::{Probes, Scope},
    procfs,
};

/// A program a process has just exec'd, as the watcher thread saw it.
struct Exec {
    pid: u32,
    /// The object files it will map, in link order.
    objects: Vec<ObjectFile>,
    /// The same files, opened while the process existed: a short-lived program is gone, and its
    /// /proc/PID/exe with it, by the time the main loop scans them for USDT probes.
    opened: Vec<(PathBuf, fs::File)>,
}

pub struct SystemWide {
    overrides: Overrides,
    /// (device, inode) of every allocator file probed: uprobes belong to the file, so one
    /// attachment serves every process that maps it, in any mount namespace.
    probed: HashSet<(u64, u64)>,
    execs: Receiver<Exec>,
    /// Readable when the watcher has seen execs.
    wakeup: std::fs::File,
}

impl SystemWide {
    /// Probes the allocators of every running process and every allocator library installed.
    pub fn start(probes: &mut Probes, overrides: Overrides) -> Result<Self> {
        let exec_events = probes.follow_processes()?;
        let (sender, execs) = mpsc::channel();
        let (wakeup, wake) = pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK).context("creating a pipe")?;
        // A thread of its own reads exec events at once: a short-lived process is gone by the next
        // sample, and with it the /proc entries that name its files.
        std::thread::Builder::new()
            .name("exec-watcher".into())
            .spawn(move || watch_execs(exec_events, |exec| sender.send(exec).is_ok(), wake))
            .context("starting the exec watcher")?;
        let mut this = Self { overrides, probed: HashSet::new(), execs, wakeup: wakeup.into() };
        if this.overrides.lib.is_none() {
            for library in installed_allocator_libraries() {
                if let Some(allocator) = Allocator::of_file(&library) {
                    this.probe(probes, &allocator)?;
                }
            }
        }
        let own_pid = std::process::id();
        let pids: Vec<u32> = running_pids().into_iter().filter(|&pid| pid != own_pid).collect();
        for &pid in &pids {
            // Kernel threads and processes that exit meanwhile have no allocator to find.
            if let Ok(allocator) = Allocator::of_process(pid, &this.overrides) {
                this.probe(probes, &allocator)?;
            }
        }
        crate::usdt::attach_system_wide(probes, &pids)?;
        Ok(this)
    }

    pub fn probed_files(&self) -> usize {
        self.probed.len()
    }

    /// Readable when processes have exec'd new programs.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.wakeup.as_fd()
    }

    /// Probes the allocators and USDT sites that newly exec'd programs bring along; returns the
    /// object files they map, (as the process sees the path, where to read it now), for
    /// symbolization.
    pub fn handle_execs(&mut self, probes: &mut Probes) -> Result<Vec<(PathBuf, PathBuf)>> {
        let mut drained = [0u8; 256];
        while matches!(self.wakeup.read(&mut drained), Ok(n) if n > 0) {}
        let mut objects = Vec::new();
        while let Ok(exec) = self.execs.try_recv() {
            // Opened files are read through this process's descriptors, which outlive the program.
            let opened: Vec<ObjectFile> = exec
                .opened
                .iter()
                .map(|(path, file)| ObjectFile {
                    path: path.clone(),
                    host_path: PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd())),
                })
                .collect();
            // A program may have no allocator memtrace knows; it then needs no probe.
            if let Ok(allocator) = Allocator::among(&opened, exec.pid, &self.overrides) {
                self.probe(probes, &allocator)?;
            }
            crate::usdt::attach_exec_objects(probes, opened);
            drop(exec.opened);
            objects.extend(exec.objects.into_iter().map(|object| (object.path, object.host_path)));
        }
        Ok(objects)
    }

    /// Adds the processes the kernel has seen allocate or report through USDT since the last
    /// sample to the model.
    pub fn adopt_new_processes(&self, probes: &Probes, model: &mut Model) -> Result<()> {
        for (pid, stats) in probes.traced_processes()? {
            if model.processes.contains_key(&pid) {
                continue;
            }
            let comm = String::from_utf8_lossy(stats.comm.split(|&b| b == 0).next().unwrap_or_default());
            let (kind, path) = probes.allocator_named(stats.allocator).cloned().unwrap_or_default();
            model.add_process(pid, comm.into_owned(), path);
            if let Some(process) = model.processes.get_mut(&pid) {
                process.allocator_kind = kind;
            }
        }
        // The USDT handler gives a reporting process figures in the kernel too; these are the
        // ones it could not (the table of processes was full).
        for pid in crate::usdt::reporting_processes(probes)? {
            if !model.processes.contains_key(&pid) {
                model.add_process(pid, procfs::comm(pid).unwrap_or_default(), PathBuf::new());
            }
        }
        // The kernel marks a process exited in its figures; a process without any (it has not
        // allocated since its last exec, or the table was full) is seen to be gone here.
        for process in model.processes.values_mut() {
            if !process.exited
                && process.stats.started_ns == 0
                && !Path::new(&format!("/proc/{}", process.pid)).exists()
            {
                process.exited = true;
            }
        }
        Ok(())
    }

    fn probe(&mut self, probes: &mut Probes, allocator: &Allocator) -> Result<()> {
        let Ok(metadata) = fs::metadata(&allocator.host_path) else { return Ok(()) };
        if self.probed.insert((metadata.dev(), metadata.ino())) {
            probes.attach(allocator, Scope::AllProcesses)?;
        }
        Ok(())
    }
}

/// The exec watcher: names the files of each exec'd process while it still exists, hands them on
/// with `deliver` and wakes the main loop, until the main loop is gone.
fn watch_execs(mut events: RingBuf<MapData>, deliver: impl Fn(Exec) -> bool, wake: OwnedFd) {
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
            let objects = objects::link_order_of_exec(event.tgid).unwrap_or_default();
            let opened = objects
                .iter()
                .filter_map(|object| Some((object.path.clone(), fs::File::open(&object.host_path).ok()?)))
                .collect();
            if !deliver(Exec { pid: event.tgid, objects, opened }) {
                return;
            }
        }
        // SAFETY: writing one byte from a valid buffer to a pipe we own.
        unsafe { libc::write(wake.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
    }
}

fn running_pids() -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    entries.flatten().filter_map(|entry| entry.file_name().to_str()?.parse().ok()).collect()
}
