//! System-wide tracing (`--all`): probes on every allocator any process uses, or may load later,
//! firing in every process; processes are found as they first allocate and released when they exit.

use std::{
    collections::HashSet,
    fs,
    os::{
        fd::{AsFd, BorrowedFd},
        unix::fs::MetadataExt,
    },
    path::PathBuf,
};

use anyhow::Result;
use aya::maps::{MapData, RingBuf};
use memtrace_common::ExecEvent;

use crate::{
    allocator::{installed_allocator_libraries, Allocator, Overrides},
    model::Model,
    probes::{Probes, Scope},
};

pub struct SystemWide {
    exec_events: RingBuf<MapData>,
    overrides: Overrides,
    /// (device, inode) of every allocator file probed: uprobes belong to the file, so one
    /// attachment serves every process that maps it, in any mount namespace.
    probed: HashSet<(u64, u64)>,
}

impl SystemWide {
    /// Probes the allocators of every running process and every allocator library installed.
    pub fn start(probes: &mut Probes, overrides: Overrides) -> Result<Self> {
        let exec_events = probes.follow_processes()?;
        let mut this = Self { exec_events, overrides, probed: HashSet::new() };
        if this.overrides.lib.is_none() {
            for library in installed_allocator_libraries() {
                if let Some(allocator) = Allocator::of_file(&library) {
                    this.probe(probes, &allocator)?;
                }
            }
        }
        let own_pid = std::process::id();
        for pid in running_pids().into_iter().filter(|&pid| pid != own_pid) {
            // Kernel threads and processes that exit meanwhile have no allocator to find.
            if let Ok(allocator) = Allocator::of_process(pid, &this.overrides) {
                this.probe(probes, &allocator)?;
            }
        }
        Ok(this)
    }

    pub fn probed_files(&self) -> usize {
        self.probed.len()
    }

    /// Readable when processes have exec'd new programs.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.exec_events.as_fd()
    }

    /// Probes the allocators that newly exec'd programs bring along; returns the object files they
    /// will map, (as the process sees the path, where to read it now), for symbolization.
    pub fn handle_execs(&mut self, probes: &mut Probes) -> Result<Vec<(PathBuf, PathBuf)>> {
        let mut pids = Vec::new();
        while let Some(item) = self.exec_events.next() {
            if item.len() >= size_of::<ExecEvent>() {
                // SAFETY: the kernel side writes exactly one ExecEvent per record.
                let event: ExecEvent = unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
                pids.push(event.tgid);
            }
        }
        let mut objects = Vec::new();
        for pid in pids {
            // A process may be gone already; it then needs no probe.
            if let Ok(allocator) = Allocator::of_exec(pid, &self.overrides) {
                self.probe(probes, &allocator)?;
                objects.extend(Allocator::objects_of_exec(pid));
            }
        }
        Ok(objects)
    }

    /// Adds the processes the kernel has seen allocate since the last sample to the model.
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

fn running_pids() -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    entries.flatten().filter_map(|entry| entry.file_name().to_str()?.parse().ok()).collect()
}
