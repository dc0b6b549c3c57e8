//! What to attach to a process: the allocator and the mapping calls to probe for it (each file
//! once per scope, however many processes map it), and its USDT sites (through usdt's `UsdtProbes`, which it holds). Which
//! processes are followed, and when, is crate::follow's.

pub mod usdt;

use std::{
    collections::{HashMap, HashSet},
    fs,
};

use anyhow::Result;

use crate::{
    attach::usdt::UsdtProbes,
    kernel::{Probes, Scope},
    process::allocator::{installed_allocator_libraries, Allocator, Overrides},
    process::{FileCache, FileId, ObjectFile, ProcessImage},
};

/// A file probed, and as what: the C library is both an allocator and where mapping calls are made,
/// probed by separate links.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Probed {
    Allocator(FileId),
    MapCalls(FileId),
}

/// What has been attached so far, and what the next process needs.
pub struct Attachments {
    /// `--allocator` and `--lib`.
    overrides: Overrides,
    /// What each file is, read once however many processes map it.
    cache: FileCache,
    /// Every file probed, as what, for which scope.
    probed: HashSet<(Probed, Scope)>,
    /// The USDT sites wanted and found, attached beside the allocators.
    usdt: UsdtProbes,
}

impl Attachments {
    pub fn new(overrides: Overrides, cache: FileCache, usdt: UsdtProbes) -> Self {
        Self { overrides, cache, probed: HashSet::new(), usdt }
    }

    /// The USDT sites wanted and found.
    pub fn usdt(&self) -> &UsdtProbes {
        &self.usdt
    }

    /// What each file is, as read so far.
    pub fn cache(&self) -> &FileCache {
        &self.cache
    }

    /// Traces `pid`, whose image (running, or a command about to exec) is `image`: probes its
    /// allocator and USDT sites for `scope`; returns the allocator.
    pub fn target(
        &mut self,
        probes: &mut Probes,
        pid: u32,
        image: &ProcessImage,
        scope: Scope,
    ) -> Result<Allocator> {
        let allocator = Allocator::of_image(image, &self.overrides, &self.cache)?;
        probes.add_target(pid)?;
        self.allocator(probes, &allocator, scope)?;
        self.usdt.attach_process(probes, image, scope)?;
        Ok(allocator)
    }

    /// Probes what a newly exec'd program brings along: its allocator, if memtrace knows it (a
    /// program may have none, and then needs no probe), and its USDT sites.
    pub fn exec(&mut self, probes: &mut Probes, image: &ProcessImage, scope: Scope) -> Result<()> {
        if let Ok(allocator) = Allocator::of_image(image, &self.overrides, &self.cache) {
            self.allocator(probes, &allocator, scope)?;
        }
        self.usdt.attach_exec_objects(probes, image.objects.clone(), scope);
        Ok(())
    }

    /// Probes, for every process, the allocators of every running process and of every allocator
    /// library installed, and the USDT sites of every file running processes map.
    pub fn every_process(&mut self, probes: &mut Probes) -> Result<()> {
        // Everything is resolved before anything is attached: once libc is probed, every malloc
        // memtrace itself makes traps into the kernel too (the BPF side only then drops it).
        let (allocators, mapped) = self.resolve_running();
        for allocator in allocators.values() {
            self.allocator(probes, allocator, Scope::AllProcesses)?;
        }
        self.usdt.attach_system_wide(probes, mapped)
    }

    /// The allocators of every running process and every allocator library installed, each file
    /// once; and every object file running processes map, each once, for the USDT scan.
    fn resolve_running(&self) -> (HashMap<FileId, Allocator>, Vec<ObjectFile>) {
        let mut allocators = HashMap::new();
        if self.overrides.lib.is_none() {
            for library in installed_allocator_libraries() {
                let Ok(object) = ObjectFile::open_host(&library) else { continue };
                if let Some(allocator) = Allocator::of_file(&object, &self.cache) {
                    allocators.entry(allocator.object.id).or_insert(allocator);
                }
            }
        }
        let own_pid = std::process::id();
        let mut mapped: HashMap<FileId, ObjectFile> = HashMap::new();
        for pid in running_pids().into_iter().filter(|&pid| pid != own_pid) {
            // Kernel threads and processes that exit meanwhile have no image.
            let Ok(image) = ProcessImage::of_process(pid, &self.cache) else { continue };
            if let Ok(allocator) = Allocator::of_image(&image, &self.overrides, &self.cache) {
                allocators.entry(allocator.object.id).or_insert(allocator);
            }
            for object in image.objects {
                mapped.entry(object.id).or_insert(object);
            }
        }
        let mut mapped: Vec<ObjectFile> = mapped.into_values().collect();
        mapped.sort_by(|a, b| a.path.cmp(&b.path));
        (allocators, mapped)
    }

    /// Forgets, and detaches, what was attached for `pid` alone: it is gone, or its pid is a new
    /// process's.
    pub fn forget_process(&mut self, probes: &mut Probes, pid: u32) {
        let scope = Scope::Process(pid);
        self.probed.retain(|(_, of)| *of != scope);
        self.usdt.forget_scope(scope);
        probes.detach_process(pid);
    }

    /// How many allocator files are probed (the mapping calls' files, libc mostly, not counted).
    pub fn probed_files(&self) -> usize {
        self.probed.iter().filter(|(file, _)| matches!(file, Probed::Allocator(_))).count()
    }

    /// Probes `allocator` and its process's mapping calls, each file once per scope; nothing
    /// with `--app-sampled`, where the allocator's own probes say what it allocates.
    pub fn allocator(&mut self, probes: &mut Probes, allocator: &Allocator, scope: Scope) -> Result<()> {
        if self.usdt.app_sampled() {
            return Ok(());
        }
        self.probe_once(Probed::Allocator(allocator.object.id), scope, || probes.attach(allocator, scope))?;
        if let Some(calls) = &allocator.map_calls {
            self.probe_once(Probed::MapCalls(calls.object.id), scope, || {
                probes.attach_map_calls(calls, scope)
            })?;
        }
        Ok(())
    }

    /// Runs `attach` unless `file` is probed for `scope` already.
    fn probe_once(&mut self, file: Probed, scope: Scope, attach: impl FnOnce() -> Result<()>) -> Result<()> {
        if self.probed.insert((file, scope)) {
            attach()?;
        }
        Ok(())
    }
}

fn running_pids() -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    entries.flatten().filter_map(|entry| entry.file_name().to_str()?.parse().ok()).collect()
}
