//! USDT: statically defined probes in the traced programs (<sys/sdt.h>, include/memtrace.h).
//!
//! memtrace finds the probe sites in the `.note.stapsdt` notes of every object a target maps (or, for
//! a command not started yet, its executable and the libraries it needs), attaches its one USDT
//! handler at each site it wants, with a BPF cookie that indexes the site's spec in `USDT_SPECS`, and
//! reads the handler's maps at every sample:
//! - every `memtrace:report_total` / `memtrace:report_delta` site, for subsystem counters, and every
//!   `memtrace:dump_begin` / `memtrace:dump_end` site, which frame a round of registered dumpers
//!   (a sample shows a process's subsystems as of its last complete round: `rounds`);
//! - the sites of each `--usdt [PATH:]PROVIDER:NAME[=argN]`, for hit counts or an argument's value.
//!
//! System-wide (`--all`), each object file is attached once, for every process: at start every
//! file a running process maps and every file `--usdt PATH:...` names, then the files of each
//! program as it is exec'd. Uprobes (and the semaphores the kernel keeps for them) belong to the
//! file, so one attachment serves every process that maps it, now or later; the BPF side keys the
//! figures by the process a probe fires in and filters processes as it does allocator events.
//!
//! One job per file: `request` (what `--usdt` asks for), this module (which files to scan and
//! attaching their sites), `plan` (each site's uses and their specs), `read` (the handler's maps),
//! `rounds` (which value of a subsystem a sample shows);
//! `notes` and `args` parse what the files say. Attaching goes through `probes` (the kernel side,
//! which never calls back): [`UsdtProbes`] is held beside the `Probes`, by what follows processes.

pub mod args;
mod arm64_args;
#[cfg(test)]
mod fuzz_tests;
pub mod list;
pub mod notes;
mod operand;
mod plan;
mod read;
mod request;
mod rounds;

use std::{collections::HashSet, path::Path};

use anyhow::{bail, Context, Result};
use memtrace_common::usdt_action;

use self::{
    notes::{ElfProbes, ProbeSite},
    plan::{is_sampled, spec_of, uses_of, write_specs},
};
pub use self::{plan::OwnSites, read::reporting_processes, request::UsdtRequest};
use crate::{
    kernel::{Probes, Scope, Site},
    model::Model,
    process::{file_identity, probe_point, FileId, ObjectFile, ProcessImage, SparseImage},
};

/// The USDT side of the probes: what `--usdt` asks for, what was found, and what reading the
/// handler's maps needs. The sites themselves are attached through (and counted by) `Probes`.
#[derive(Default)]
pub struct UsdtProbes {
    /// The probes attached whatever `--usdt` asks.
    own: OwnSites,
    requests: Vec<UsdtRequest>,
    /// Whether each request found at least one site.
    found: Vec<bool>,
    /// The next free index of `USDT_SPECS`.
    next_spec: u32,
    /// Set with `--all`: sites fire in every process, and a request not found yet may still be.
    system_wide: bool,
    /// (device, inode) of every object file scanned for probe sites, with the scope its sites
    /// were attached for, so that each is attached once per scope, whatever path names it.
    scanned: HashSet<(FileId, Scope)>,
    /// System-wide: the identities of the files `--usdt PATH:...` names by path.
    named: Vec<FileId>,
    /// Whether the kernel optimizes uprobes on 5-byte nops (memtrace.h's sites): its
    /// `Feature::OptimizedUprobes`.
    nop5_optimized: bool,
}

impl UsdtProbes {
    pub fn new(own: OwnSites, requests: Vec<UsdtRequest>, nop5_optimized: bool) -> Self {
        Self { own, found: vec![false; requests.len()], requests, nop5_optimized, ..Self::default() }
    }

    /// Whether allocations come from the allocators' sampled probes alone (`--app-sampled`):
    /// then no allocator is probed.
    pub fn app_sampled(&self) -> bool {
        self.own.app_sampled
    }

    /// Reads every subsystem and `--usdt` counter of every process into the model.
    pub fn collect(&self, probes: &Probes, model: &mut Model) -> Result<()> {
        read::collect(probes, &self.requests, self.system_wide, model)
    }

    /// Forgets the files scanned for `scope` (a process gone): a new process with its pid is
    /// scanned afresh.
    pub fn forget_scope(&mut self, scope: Scope) {
        self.scanned.retain(|(_, of)| *of != scope);
    }

    /// The objects not scanned yet, each once, now marked scanned. Objects whose file cannot be
    /// found are left out (and not marked).
    fn take_unscanned(&mut self, objects: Vec<ObjectFile>, scope: Scope) -> Vec<ObjectFile> {
        objects
            .into_iter()
            .filter(|object| {
                file_identity(&object.host_path).is_some_and(|id| self.scanned.insert((id, scope)))
            })
            .collect()
    }

    fn missing_requests(&self) -> impl Iterator<Item = (usize, &UsdtRequest)> {
        self.requests.iter().enumerate().filter(|&(index, _)| !self.found[index])
    }

    /// Attaches to the probe sites of every object a process maps (its image), and the objects
    /// `--usdt` names (an absolute path as the process sees it, resolved in its root).
    pub fn attach_process(&mut self, probes: &mut Probes, image: &ProcessImage, scope: Scope) -> Result<()> {
        let mut objects = image.objects.clone();
        let named = add_named_objects(&self.requests, &mut objects, |path| {
            if path.is_absolute() {
                image.open(path)
            } else {
                ObjectFile::open_host(path)
            }
        })?;
        let objects = self.take_unscanned(objects, scope);
        let objects = with_wanted_sites(self.own, &self.requests, objects, &named);
        self.attach_objects(probes, &objects, &named, scope, false)
    }

    /// System-wide (`--all`): attaches, for every process, to the probe sites of each file `--usdt
    /// PATH:...` names and of each object file running processes map (`mapped`, from their
    /// images), every file once. A named file that is missing or has no probes is an error; a
    /// request that matches nothing yet is only said on stderr, as a program started later may
    /// bring its probe.
    pub fn attach_system_wide(&mut self, probes: &mut Probes, mapped: Vec<ObjectFile>) -> Result<()> {
        self.system_wide = true;
        let mut named_objects = Vec::new();
        let named = add_named_objects(&self.requests, &mut named_objects, ObjectFile::open_host)?;
        self.named.clone_from(&named);
        let named_objects = self.take_unscanned(named_objects, Scope::AllProcesses);
        self.attach_objects(probes, &named_objects, &named, Scope::AllProcesses, false)?;
        let mapped = self.take_unscanned(mapped, Scope::AllProcesses);
        let mapped = with_wanted_sites(self.own, &self.requests, mapped, &named);
        self.attach_objects(probes, &mapped, &named, Scope::AllProcesses, true)?;
        for (_, request) in self.missing_requests() {
            eprintln!(
                "memtrace: --usdt {}: no USDT probe {}:{} in any running process{} yet; it is \
                 attached when a program that has it starts",
                request.label,
                request.provider,
                request.name,
                request.path.as_ref().map(|p| format!(" (in {})", p.display())).unwrap_or_default()
            );
        }
        Ok(())
    }

    /// System-wide: attaches to the probe sites of the object files a program just exec'd maps,
    /// those no earlier scan saw. Never fails: a file or site memtrace cannot use is named on
    /// stderr.
    pub fn attach_exec_objects(&mut self, probes: &mut Probes, objects: Vec<ObjectFile>, scope: Scope) {
        let objects = self.take_unscanned(objects, scope);
        let objects = with_wanted_sites(self.own, &self.requests, objects, &self.named);
        if objects.is_empty() {
            return;
        }
        let missing: Vec<usize> = self.missing_requests().map(|(index, _)| index).collect();
        let named = self.named.clone();
        for object in &objects {
            let before = probes.usdt_sites();
            if let Err(err) = self.attach_objects(probes, std::slice::from_ref(object), &named, scope, true) {
                eprintln!("memtrace: warning: {err:#}");
            }
            // Said, as the program may report through a site only once it is attached.
            let added = probes.usdt_sites() - before;
            if added > 0 {
                eprintln!(
                    "memtrace: attached {added} USDT probe sites in {} (a program just started)",
                    object.path.display()
                );
            }
        }
        for index in missing.into_iter().filter(|&index| self.found[index]) {
            eprintln!(
                "memtrace: --usdt {}: found in a program just started; attached",
                self.requests[index].label
            );
        }
    }

    /// Attaches to the sites of every object. `lenient` (system-wide, files no option names by
    /// path): a file or site that cannot be used is a warning on stderr, not the end of the run.
    fn attach_objects(
        &mut self,
        probes: &mut Probes,
        objects: &[ObjectFile],
        explicit: &[FileId],
        scope: Scope,
        lenient: bool,
    ) -> Result<()> {
        let mut seen = HashSet::new();
        for object in objects {
            // Two paths (a symlink, /proc/PID/root) may name one file; uprobes are per file.
            if let Some(identity) = file_identity(&object.host_path) {
                if !seen.insert(identity) {
                    continue;
                }
            }
            if let Err(err) = self.attach_object(probes, object, explicit, scope, lenient) {
                if !lenient {
                    return Err(err);
                }
                eprintln!("memtrace: warning: {err:#}");
            }
        }
        Ok(())
    }

    fn attach_object(
        &mut self,
        probes: &mut Probes,
        object: &ObjectFile,
        explicit: &[FileId],
        scope: Scope,
        lenient: bool,
    ) -> Result<()> {
        let named = self.requests.iter().any(|r| r.path.is_some() && r.wants_object(object, explicit));
        let Some(elf) = read_probes(object, named)? else {
            return Ok(());
        };
        let planned = self.plan_sites(probes, object, &elf, explicit, lenient)?;
        let attach = |probes: &mut Probes| -> Result<()> {
            probes.attach_usdt_sites(&object.host_path, &planned.sites, scope)?;
            probes.attach_sampled_sites(&object.host_path, &planned.sampled, scope)
        };
        attach(probes)
            .with_context(|| format!("attaching to the USDT probes of {}", object.path.display()))?;
        for counter in planned.counters {
            self.found[counter as usize] = true;
        }
        Ok(())
    }

    /// The sites of one object to attach, their specs written, and the `--usdt` counters they
    /// serve.
    fn plan_sites(
        &mut self,
        probes: &mut Probes,
        object: &ObjectFile,
        elf: &ElfProbes,
        explicit: &[FileId],
        lenient: bool,
    ) -> Result<PlannedSites> {
        let mut planned = PlannedSites::default();
        // Each site's instruction, to count those the kernel single-steps: the file opened once.
        let code = std::fs::File::open(&object.host_path).ok();
        for site in &elf.sites {
            let uses = uses_of(self.own, &self.requests, site, object, explicit);
            let mut specs = Vec::with_capacity(uses.len());
            for site_use in &uses {
                match spec_of(&self.requests, object, elf, site, site_use) {
                    Ok(Some(spec)) => specs.push(spec),
                    Ok(None) => {}
                    Err(err) if lenient => eprintln!("memtrace: warning: {err:#}"),
                    Err(err) => return Err(err),
                }
            }
            if let (false, Some(code)) = (specs.is_empty(), &code) {
                note_if_single_stepped(probes, object, code, site, self.nop5_optimized);
            }
            planned.counters.extend(
                specs
                    .iter()
                    .filter(|spec| {
                        matches!(spec.action, usdt_action::COUNT_HITS | usdt_action::TRACK_ARGUMENT)
                    })
                    .map(|s| s.counter),
            );
            // The allocator's sampled probes have a program of their own; a site may serve both.
            let (mut sampled, mut others): (Vec<_>, Vec<_>) =
                specs.into_iter().partition(|spec| is_sampled(spec.action));
            let to_site = |cookie| Site { offset: site.offset, cookie, semaphore: site.semaphore_offset };
            if let Some(cookie) = write_specs(probes, &mut self.next_spec, &mut others)? {
                planned.sites.push(to_site(cookie));
            }
            if let Some(cookie) = write_specs(probes, &mut self.next_spec, &mut sampled)? {
                planned.sampled.push(to_site(cookie));
            }
        }
        Ok(planned)
    }

    /// Fails, naming the probe and the fix, when a `--usdt` option matched no site in any target;
    /// where programs the targets start later are traced too (`later_programs`), says so instead.
    pub fn check_requests_found(&self, later_programs: bool) -> Result<()> {
        if self.system_wide {
            // attach_system_wide has said which are missing; a program started later may bring them.
            return Ok(());
        }
        let mut missing = self.missing_requests().map(|(_, request)| request);
        if later_programs {
            for request in missing {
                eprintln!(
                    "memtrace: --usdt {}: no USDT probe {}:{} in the traced program yet; it is attached \
                     when a program it starts has it",
                    request.label, request.provider, request.name
                );
            }
            return Ok(());
        }
        if let Some(missing) = missing.next() {
            bail!(
                "--usdt {}: no USDT probe {}:{} in the traced program or the libraries it maps{}; \
                 list the probes with `memtrace usdt --pid PID` or `memtrace usdt PATH`",
                missing.label,
                missing.provider,
                missing.name,
                missing.path.as_ref().map(|p| format!(" (in {})", p.display())).unwrap_or_default()
            );
        }
        Ok(())
    }
}

/// One object's sites to attach: for usdt_site, for sampled_site, and the `--usdt` counters
/// they serve.
#[derive(Default)]
struct PlannedSites {
    sites: Vec<Site>,
    sampled: Vec<Site>,
    counters: Vec<u32>,
}

/// The objects that may have a probe site memtrace would attach: one of memtrace's own, or one a
/// `--usdt` option asks for, or any in a file an option names by path. Only the notes are read
/// (crate::process::SparseImage), so a 200 MB library whose notes are someone else's (libLLVM's
/// libstdcxx:throw) is never read whole. A file whose notes cannot be read is kept, for the
/// attachment to judge and report.
fn with_wanted_sites(
    own: OwnSites,
    requests: &[UsdtRequest],
    objects: Vec<ObjectFile>,
    named: &[FileId],
) -> Vec<ObjectFile> {
    let wanted = |provider: &str, name: &str| {
        own.action(provider, name).is_some()
            || requests.iter().any(|request| request.provider == provider && request.name == name)
    };
    let has_wanted_site = |object: &ObjectFile| -> bool {
        let notes = SparseImage::of(object, crate::process::NOTES).and_then(|image| {
            image.with_elf(|elf| {
                Ok(elf.section_data(".note.stapsdt").map(notes::parse_notes).unwrap_or_default())
            })
        });
        match notes {
            Ok(notes) => notes.iter().any(|note| wanted(&note.provider, &note.name)),
            Err(_) => true,
        }
    };
    objects.into_iter().filter(|object| named.contains(&object.id) || has_wanted_site(object)).collect()
}

/// Adds each file a `--usdt PATH:...` names by path, mapped yet or not: a uprobe on a file fires in
/// the traced process whenever it maps that file, even later (dlopen). `open` opens a path where
/// the process would. Returns the identities of the files named by path.
fn add_named_objects(
    requests: &[UsdtRequest],
    objects: &mut Vec<ObjectFile>,
    open: impl Fn(&Path) -> Result<ObjectFile>,
) -> Result<Vec<FileId>> {
    let mut named = Vec::new();
    for request in requests {
        let Some(path) = &request.path else { continue };
        if !path.to_string_lossy().contains('/') {
            continue;
        }
        let object = match open(path) {
            Ok(object) => object,
            Err(err)
                if err
                    .root_cause()
                    .downcast_ref::<std::io::Error>()
                    .is_some_and(|err| err.kind() == std::io::ErrorKind::NotFound) =>
            {
                bail!(
                    "--usdt {}: {} does not exist; give the path of the executable or library that \
                     has the probe",
                    request.label,
                    path.display()
                )
            }
            Err(err) => return Err(err).with_context(|| format!("--usdt {}", request.label)),
        };
        named.push(object.id);
        if !objects.iter().any(|o| o.id == object.id) {
            objects.push(object);
        }
    }
    Ok(named)
}

/// Counts a site whose instruction (read from `code`, its object's file) the kernel single-steps:
/// sdt.h's 1-byte nop is emulated; memtrace.h's 5-byte nop is optimized where `nop5_optimized`
/// (6.18) and single-stepped before; another tool's macro may put something else there.
fn note_if_single_stepped(
    probes: &mut Probes,
    object: &ObjectFile,
    code: &std::fs::File,
    site: &ProbeSite,
    nop5_optimized: bool,
) {
    let mut bytes = [0u8; 16];
    let Ok(read) = std::os::unix::fs::FileExt::read_at(code, &mut bytes, site.offset) else { return };
    let point = probe_point::fixed(&bytes[..read], nop5_optimized);
    if !point.emulated {
        probes.note_single_stepped(
            (object.id, &object.path),
            &format!("{}:{}", site.provider, site.name),
            &point,
        );
    }
}

/// The probe sites of an object, reading only its notes and symbol tables (semaphores are found
/// by symbol), never the whole file; None where it has none memtrace would look at. A file a
/// `--usdt` option names by path (`named`) must be readable and have probes.
fn read_probes(object: &ObjectFile, named: bool) -> Result<Option<ElfProbes>> {
    // Most files have no notes: look at the section headers before reading anything more.
    if !named && !notes::may_have_probes(&object.host_path) {
        return Ok(None);
    }
    let sections = [crate::process::NOTES, crate::process::SYMBOLS].concat();
    let image = match SparseImage::of(object, &sections) {
        Ok(image) => image,
        Err(err) if named => {
            return Err(err).with_context(|| format!("cannot read {}", object.path.display()))
        }
        Err(_) => return Ok(None),
    };
    let elf = match notes::parse_elf(image.data()) {
        Ok(elf) => elf,
        // Not ours to judge unless a --usdt option names it.
        Err(err) if !named => {
            let _ = err;
            return Ok(None);
        }
        Err(err) => return Err(err).with_context(|| format!("reading {}", object.path.display())),
    };
    if named && elf.sites.is_empty() {
        bail!(
            "{} has no USDT probes (no .note.stapsdt section); build it with <sys/sdt.h> \
             probes, or list what a process has with `memtrace usdt --pid PID`",
            object.path.display()
        );
    }
    Ok(Some(elf))
}
