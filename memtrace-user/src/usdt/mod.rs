//! USDT: statically defined probes in the traced programs (<sys/sdt.h>, include/memtrace.h).
//!
//! memtrace finds the probe sites in the `.note.stapsdt` notes of every object a target maps (or, for
//! a command not started yet, its executable and the libraries it needs), attaches its one USDT
//! handler at each site it wants, with a BPF cookie that indexes the site's spec in `USDT_SPECS`, and
//! reads the handler's maps at every sample:
//! - every `memtrace:report_total` / `memtrace:report_delta` site, for subsystem counters;
//! - the sites of each `--usdt [PATH:]PROVIDER:NAME[=argN]`, for hit counts or an argument's value.
//!
//! System-wide (`--all`), each object file is attached once, for every process: at start every
//! file a running process maps and every file `--usdt PATH:...` names, then the files of each
//! program as it is exec'd. Uprobes (and the semaphores the kernel keeps for them) belong to the
//! file, so one attachment serves every process that maps it, now or later; the BPF side keys the
//! figures by the process a probe fires in and filters processes as it does allocator events.

pub mod args;
#[cfg(test)]
mod fuzz_tests;
pub mod list;
pub mod notes;

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use aya::maps::{Array, HashMap, MapData, MapError};
use memtrace_common::{
    usdt_action, SubsystemKey, UsdtCounterKey, UsdtCounterValue, UsdtSpec, MAX_USDT_SPECS, MAX_USES_PER_SITE,
    USDT_LOST_SLOT,
};

use self::{
    args::SiteContext,
    notes::{ElfProbes, ProbeSite},
};
use crate::{
    model::{Model, UsdtProbeCounter},
    probes::{Direction, Probes, Scope, Site, USDT_SITE},
    process::{file_identity, FileId, ObjectFile, ProcessImage, SparseImage},
};

/// The provider include/memtrace.h emits.
pub const MEMTRACE_PROVIDER: &str = "memtrace";
const REPORT_TOTAL: &str = "report_total";
const REPORT_DELTA: &str = "report_delta";

/// One `--usdt [PATH:]PROVIDER:NAME[=argN]` option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsdtRequest {
    /// The option as written; names the counter in the trace and the summary.
    pub label: String,
    /// Only sites in this object: a path (with a `/`) or a file name.
    pub path: Option<PathBuf>,
    pub provider: String,
    pub name: String,
    /// Track this argument (0-based, as in `arg0`) instead of only counting hits.
    pub argument: Option<usize>,
}

impl UsdtRequest {
    /// Parses the option's value; the error says what a valid one looks like.
    pub fn parse(text: &str) -> Result<Self, String> {
        let usage = "write [PATH:]PROVIDER:NAME or [PATH:]PROVIDER:NAME=argN, e.g. \
                     --usdt myapp:request_done or --usdt ./libfoo.so:foo:alloc=arg1";
        let (probe, argument) = match text.rsplit_once('=') {
            Some((probe, arg)) => {
                let index = arg
                    .strip_prefix("arg")
                    .and_then(|n| n.parse::<usize>().ok())
                    .filter(|&n| n < 12)
                    .ok_or_else(|| {
                        format!(
                            "`{arg}` in `{text}` is not an argument: write arg0 ... arg11 \
                             (arg0 is the first argument)"
                        )
                    })?;
                (probe, Some(index))
            }
            None => (text, None),
        };
        let mut parts = probe.rsplitn(3, ':');
        let name = parts.next().unwrap_or_default();
        let provider = parts.next().unwrap_or_default();
        let path = parts.next();
        let valid = |part: &str| {
            !part.is_empty()
                && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-')
        };
        if !valid(provider) || !valid(name) {
            return Err(format!("`{text}` is not a USDT probe; {usage}"));
        }
        if path.is_some_and(str::is_empty) {
            return Err(format!("`{text}` has an empty PATH; {usage}"));
        }
        Ok(Self {
            label: text.to_owned(),
            path: path.map(PathBuf::from),
            provider: provider.to_owned(),
            name: name.to_owned(),
            argument,
        })
    }

    fn matches(&self, site: &ProbeSite) -> bool {
        site.provider == self.provider && site.name == self.name
    }

    /// Whether this request's PATH (if any) names `object`.
    fn wants_object(&self, object: &ObjectFile, explicit: &[FileId]) -> bool {
        let Some(path) = &self.path else {
            return true;
        };
        if path.to_string_lossy().contains('/') {
            file_identity(&object.host_path).is_some_and(|id| explicit.contains(&id))
        } else {
            object.path.file_name() == Some(path.as_os_str())
        }
    }
}

/// The USDT side of the probes: every attached site, and what reading their maps needs.
#[derive(Default)]
pub struct UsdtProbes {
    requests: Vec<UsdtRequest>,
    /// Whether each request found at least one site.
    found: Vec<bool>,
    /// Probe sites attached so far.
    sites: usize,
    next_spec: u32,
    /// Set with `--all`: sites fire in every process, and a request not found yet may still be.
    system_wide: bool,
    /// System-wide: (device, inode) of every object file scanned for probe sites, so that each is
    /// attached once, whatever path names it.
    scanned: HashSet<FileId>,
    /// System-wide: the identities of the files `--usdt PATH:...` names by path.
    named: Vec<FileId>,
}

impl UsdtProbes {
    pub fn new(requests: Vec<UsdtRequest>) -> Self {
        Self { found: vec![false; requests.len()], requests, ..Self::default() }
    }

    /// How many probe sites are attached (one probe per site, whatever it is used for).
    pub fn attached_sites(&self) -> usize {
        self.sites
    }

    /// The objects not scanned yet, each once, now marked scanned. Objects whose file cannot be
    /// found are left out (and not marked).
    fn take_unscanned(&mut self, objects: Vec<ObjectFile>) -> Vec<ObjectFile> {
        objects
            .into_iter()
            .filter(|object| file_identity(&object.host_path).is_some_and(|id| self.scanned.insert(id)))
            .collect()
    }

    fn missing_requests(&self) -> impl Iterator<Item = (usize, &UsdtRequest)> {
        self.requests.iter().enumerate().filter(|&(index, _)| !self.found[index])
    }
}

/// What one site is attached for.
struct Use {
    action: u32,
    counter: u32,
    argument: Option<usize>,
}

/// Attaches to the probe sites of every object a process maps (its image), and the objects
/// `--usdt` names (an absolute path as the process sees it, resolved in its root).
pub fn attach_process(probes: &mut Probes, image: &ProcessImage) -> Result<()> {
    let mut objects = image.objects.clone();
    let named = add_named_objects(&probes.usdt.requests, &mut objects, |path| {
        if path.is_absolute() {
            image.open(path)
        } else {
            ObjectFile::open_host(path)
        }
    })?;
    let pid = image.pid.context("attaching USDT probes to a process that has not started")?;
    let objects = with_wanted_sites(&probes.usdt.requests, objects, &named);
    attach_objects(probes, &objects, &named, Scope::Process(pid), false)
}

/// System-wide (`--all`): attaches, for every process, to the probe sites of each file `--usdt
/// PATH:...` names and of each object file running processes map (`mapped`, from their images),
/// every file once. A named file that is missing or has no probes is an error; a request that
/// matches nothing yet is only said on stderr, as a program started later may bring its probe.
pub fn attach_system_wide(probes: &mut Probes, mapped: Vec<ObjectFile>) -> Result<()> {
    probes.usdt.system_wide = true;
    let mut named_objects = Vec::new();
    let named = add_named_objects(&probes.usdt.requests, &mut named_objects, ObjectFile::open_host)?;
    probes.usdt.named.clone_from(&named);
    let named_objects = probes.usdt.take_unscanned(named_objects);
    attach_objects(probes, &named_objects, &named, Scope::AllProcesses, false)?;
    let mapped = probes.usdt.take_unscanned(mapped);
    let mapped = with_wanted_sites(&probes.usdt.requests, mapped, &named);
    attach_objects(probes, &mapped, &named, Scope::AllProcesses, true)?;
    for (_, request) in probes.usdt.missing_requests() {
        eprintln!(
            "memtrace: --usdt {}: no USDT probe {}:{} in any running process{} yet; it is attached \
             when a program that has it starts",
            request.label,
            request.provider,
            request.name,
            request.path.as_ref().map(|p| format!(" (in {})", p.display())).unwrap_or_default()
        );
    }
    Ok(())
}

/// System-wide: attaches to the probe sites of the object files a program just exec'd maps, those
/// no earlier scan saw. Never fails: a file or site memtrace cannot use is named on stderr.
pub fn attach_exec_objects(probes: &mut Probes, objects: Vec<ObjectFile>) {
    let objects = probes.usdt.take_unscanned(objects);
    let objects = with_wanted_sites(&probes.usdt.requests, objects, &probes.usdt.named);
    if objects.is_empty() {
        return;
    }
    let missing: Vec<usize> = probes.usdt.missing_requests().map(|(index, _)| index).collect();
    let named = probes.usdt.named.clone();
    for object in &objects {
        let before = probes.usdt.attached_sites();
        if let Err(err) =
            attach_objects(probes, std::slice::from_ref(object), &named, Scope::AllProcesses, true)
        {
            eprintln!("memtrace: warning: {err:#}");
        }
        // Said, as the program may report through a site only once it is attached.
        let added = probes.usdt.attached_sites() - before;
        if added > 0 {
            eprintln!(
                "memtrace: attached {added} USDT probe sites in {} (a program just started)",
                object.path.display()
            );
        }
    }
    for index in missing.into_iter().filter(|&index| probes.usdt.found[index]) {
        eprintln!(
            "memtrace: --usdt {}: found in a program just started; attached",
            probes.usdt.requests[index].label
        );
    }
}

/// Attaches, for the held child `pid`, to the probe sites of the command's executable and of the
/// libraries it needs (its image); the kernel places them as exec maps the files.
pub fn attach_command(probes: &mut Probes, image: &ProcessImage, pid: u32) -> Result<()> {
    let mut objects = image.objects.clone();
    let named = add_named_objects(&probes.usdt.requests, &mut objects, |path| image.open(path))?;
    let objects = with_wanted_sites(&probes.usdt.requests, objects, &named);
    attach_objects(probes, &objects, &named, Scope::Process(pid), false)
}

/// The objects that may have a probe site memtrace would attach: a memtrace report site, or one a
/// `--usdt` option asks for, or any in a file an option names by path. Only the notes are read
/// (crate::process::SparseImage), so a 200 MB library whose notes are someone else's (libLLVM's
/// libstdcxx:throw) is never read whole. A file whose notes cannot be read is kept, for the
/// attachment to judge and report.
fn with_wanted_sites(
    requests: &[UsdtRequest],
    objects: Vec<ObjectFile>,
    named: &[FileId],
) -> Vec<ObjectFile> {
    let wanted = |provider: &str, name: &str| {
        (provider == MEMTRACE_PROVIDER && (name == REPORT_TOTAL || name == REPORT_DELTA))
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

/// Attaches to the sites of every object. `lenient` (system-wide, files no option names by path):
/// a file or site that cannot be used is a warning on stderr, not the end of the run.
fn attach_objects(
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
        if let Err(err) = attach_object(probes, object, explicit, scope, lenient) {
            if !lenient {
                return Err(err);
            }
            eprintln!("memtrace: warning: {err:#}");
        }
    }
    Ok(())
}

fn attach_object(
    probes: &mut Probes,
    object: &ObjectFile,
    explicit: &[FileId],
    scope: Scope,
    lenient: bool,
) -> Result<()> {
    let named = probes.usdt.requests.iter().any(|r| r.path.is_some() && r.wants_object(object, explicit));
    // Most files have no notes: look at the section headers before reading a whole file.
    if !named && !notes::may_have_probes(&object.host_path) {
        return Ok(());
    }
    let Ok(data) = fs::read(&object.host_path) else {
        if named {
            bail!("cannot read {}", object.path.display());
        }
        return Ok(());
    };
    let elf = match notes::parse_elf(&data) {
        Ok(elf) => elf,
        // Not ours to judge unless a --usdt option names it.
        Err(err) if !named => {
            let _ = err;
            return Ok(());
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
    let mut sites = Vec::new();
    let mut counters = Vec::new();
    for site in &elf.sites {
        let uses = uses_of(&probes.usdt.requests, site, object, explicit);
        let mut specs = Vec::with_capacity(uses.len());
        for site_use in &uses {
            match spec_of(probes, object, &elf, site, site_use) {
                Ok(Some(spec)) => specs.push(spec),
                Ok(None) => {}
                Err(err) if lenient => eprintln!("memtrace: warning: {err:#}"),
                Err(err) => return Err(err),
            }
        }
        if let Some(cookie) = write_specs(probes, &mut specs)? {
            sites.push(Site { offset: site.offset, cookie, semaphore: site.semaphore_offset });
            counters.extend(
                specs.iter().filter(|spec| spec.action >= usdt_action::COUNT_HITS).map(|s| s.counter),
            );
        }
    }
    probes
        .attach_sites(USDT_SITE, &object.host_path, &sites, scope, Direction::Entry)
        .with_context(|| format!("attaching to the USDT probes of {}", object.path.display()))?;
    probes.usdt.sites += sites.len();
    for counter in counters {
        probes.usdt.found[counter as usize] = true;
    }
    Ok(())
}

/// Writes the uses of one site one after another in `USDT_SPECS`, the last marked; returns the
/// index of the first, the site's cookie, or None when the site has no use.
fn write_specs(probes: &mut Probes, specs: &mut [UsdtSpec]) -> Result<Option<u64>> {
    let Some(last) = specs.last_mut() else {
        return Ok(None);
    };
    last.last_of_site = 1;
    if specs.len() > MAX_USES_PER_SITE as usize {
        bail!("a USDT probe site is wanted by more than {MAX_USES_PER_SITE} --usdt options; name fewer");
    }
    let first = probes.usdt.next_spec;
    if first as usize + specs.len() > MAX_USDT_SPECS as usize {
        bail!("more than {MAX_USDT_SPECS} uses of USDT probe sites to attach; name fewer with --usdt");
    }
    let mut table: Array<&mut MapData, UsdtSpec> = Array::try_from(probes.map_mut("USDT_SPECS")?)?;
    for (index, spec) in (first..).zip(specs.iter()) {
        table.set(index, spec, 0).context("writing a USDT site's spec")?;
    }
    probes.usdt.next_spec += specs.len() as u32;
    Ok(Some(u64::from(first)))
}

fn uses_of(requests: &[UsdtRequest], site: &ProbeSite, object: &ObjectFile, explicit: &[FileId]) -> Vec<Use> {
    let mut uses = Vec::new();
    if site.provider == MEMTRACE_PROVIDER {
        let action = match site.name.as_str() {
            REPORT_TOTAL => Some(usdt_action::REPORT_TOTAL),
            REPORT_DELTA => Some(usdt_action::REPORT_DELTA),
            _ => None,
        };
        if let Some(action) = action {
            uses.push(Use { action, counter: 0, argument: None });
        }
    }
    for (index, request) in requests.iter().enumerate() {
        if request.matches(site) && request.wants_object(object, explicit) {
            uses.push(Use {
                action: if request.argument.is_some() {
                    usdt_action::TRACK_ARGUMENT
                } else {
                    usdt_action::COUNT_HITS
                },
                counter: index as u32,
                argument: request.argument,
            });
        }
    }
    uses
}

/// The spec of one use of a site; None (after a warning) when the site cannot serve it.
fn spec_of(
    probes: &Probes,
    object: &ObjectFile,
    elf: &ElfProbes,
    site: &ProbeSite,
    site_use: &Use,
) -> Result<Option<UsdtSpec>> {
    let where_ =
        || format!("probe {} in {} at offset {:#x}", site.full_name(), object.path.display(), site.offset);
    let specs = match args::parse_all(&site.arguments) {
        Ok(specs) => specs,
        Err(err) if site_use.action == usdt_action::COUNT_HITS => {
            // Counting hits needs no argument.
            let _ = err;
            Vec::new()
        }
        Err(err) => return Err(err).with_context(where_),
    };
    let symbol_address = |name: &str| elf.symbol_address(name);
    let context = SiteContext { address: site.address, symbol_address: &symbol_address };
    let mut spec = UsdtSpec { action: site_use.action, counter: site_use.counter, ..UsdtSpec::default() };
    match site_use.action {
        usdt_action::REPORT_TOTAL | usdt_action::REPORT_DELTA => {
            if specs.len() != 2 {
                eprintln!(
                    "memtrace: warning: skipping {}: it has {} arguments, not (subsystem, bytes)",
                    where_(),
                    specs.len()
                );
                return Ok(None);
            }
            for (slot, arg) in spec.args.iter_mut().zip(&specs) {
                *slot = arg.to_bpf(&context).with_context(where_)?;
            }
        }
        usdt_action::TRACK_ARGUMENT => {
            let index = site_use.argument.unwrap_or(0);
            let Some(arg) = specs.get(index) else {
                bail!(
                    "--usdt {}: {} has {} argument{}, so there is no arg{index} (arguments \
                     count from arg0)",
                    probes.usdt.requests[site_use.counter as usize].label,
                    where_(),
                    specs.len(),
                    if specs.len() == 1 { "" } else { "s" }
                );
            };
            spec.args[0] = arg.to_bpf(&context).with_context(where_)?;
        }
        _ => {}
    }
    Ok(Some(spec))
}

/// Fails, naming the probe and the fix, when a `--usdt` option matched no site in any target.
pub fn check_requests_found(probes: &Probes) -> Result<()> {
    let usdt = &probes.usdt;
    if usdt.system_wide {
        // attach_system_wide has said which are missing; a program started later may bring them.
        return Ok(());
    }
    if let Some(missing) =
        usdt.requests.iter().zip(&usdt.found).find(|(_, found)| !**found).map(|(request, _)| request)
    {
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

/// Reads every subsystem and `--usdt` counter of every process, in one pass over each map.
pub fn collect(probes: &Probes, model: &mut Model) -> Result<()> {
    let mut subsystems: BTreeMap<u32, BTreeMap<String, i64>> = BTreeMap::new();
    let table: HashMap<&MapData, SubsystemKey, i64> = HashMap::try_from(probes.map("SUBSYSTEMS")?)?;
    // An entry removed between two steps of the walk is no error.
    for entry in table.iter().filter(|e| !matches!(e, Err(MapError::KeyNotFound))) {
        let (key, value) = entry.context("reading the USDT subsystem map")?;
        subsystems.entry(key.tgid).or_default().insert(subsystem_name(&key.name), value);
    }
    let mut counters: BTreeMap<u32, BTreeMap<String, UsdtProbeCounter>> = BTreeMap::new();
    let table: HashMap<&MapData, UsdtCounterKey, UsdtCounterValue> =
        HashMap::try_from(probes.map("USDT_COUNTERS")?)?;
    for entry in table.iter().filter(|e| !matches!(e, Err(MapError::KeyNotFound))) {
        let (key, value) = entry.context("reading the USDT counter map")?;
        let Some(request) = probes.usdt.requests.get(key.counter as usize) else {
            continue;
        };
        counters.entry(key.tgid).or_default().insert(
            request.label.clone(),
            UsdtProbeCounter { hits: value.hits, value: request.argument.map(|_| value.value) },
        );
    }
    for (pid, process) in &mut model.processes {
        let figures = &mut process.usdt;
        if let Some(subsystems) = subsystems.remove(pid) {
            figures.subsystems = subsystems;
        }
        // Every requested counter shows, at 0 before the first hit; system-wide, only in the
        // processes that hit it.
        for request in probes.usdt.requests.iter().filter(|_| !probes.usdt.system_wide) {
            figures
                .probes
                .entry(request.label.clone())
                .or_insert(UsdtProbeCounter { hits: 0, value: request.argument.map(|_| 0) });
        }
        if let Some(counters) = counters.remove(pid) {
            figures.probes.extend(counters);
        }
    }
    let lost: Array<&MapData, u64> = Array::try_from(probes.map("USDT_LOST_EVENTS")?)?;
    model.usdt_lost_events = lost.get(&USDT_LOST_SLOT, 0)?;
    Ok(())
}

/// The processes the kernel has USDT figures for (subsystems or `--usdt` counters).
pub fn reporting_processes(probes: &Probes) -> Result<BTreeSet<u32>> {
    let mut tgids = BTreeSet::new();
    let subsystems: HashMap<&MapData, SubsystemKey, i64> = HashMap::try_from(probes.map("SUBSYSTEMS")?)?;
    tgids.extend(subsystems.keys().filter_map(Result::ok).map(|key| key.tgid));
    let counters: HashMap<&MapData, UsdtCounterKey, UsdtCounterValue> =
        HashMap::try_from(probes.map("USDT_COUNTERS")?)?;
    tgids.extend(counters.keys().filter_map(Result::ok).map(|key| key.tgid));
    Ok(tgids)
}

/// Forgets the USDT figures of exited processes in the kernel, so the tables stay bounded.
pub fn release(probes: &mut Probes, tgids: &HashSet<u32>) -> Result<()> {
    let mut subsystems: HashMap<&mut MapData, SubsystemKey, i64> =
        HashMap::try_from(probes.map_mut("SUBSYSTEMS")?)?;
    let doomed: Vec<SubsystemKey> =
        subsystems.keys().filter_map(Result::ok).filter(|key| tgids.contains(&key.tgid)).collect();
    for key in &doomed {
        let _ = subsystems.remove(key);
    }
    let mut counters: HashMap<&mut MapData, UsdtCounterKey, UsdtCounterValue> =
        HashMap::try_from(probes.map_mut("USDT_COUNTERS")?)?;
    let doomed: Vec<UsdtCounterKey> =
        counters.keys().filter_map(Result::ok).filter(|key| tgids.contains(&key.tgid)).collect();
    for key in &doomed {
        let _ = counters.remove(key);
    }
    Ok(())
}

/// Entries in the kernel's USDT tables (subsystems and `--usdt` counters).
pub fn occupancy(probes: &Probes) -> Result<usize> {
    let subsystems: HashMap<&MapData, SubsystemKey, i64> = HashMap::try_from(probes.map("SUBSYSTEMS")?)?;
    let counters: HashMap<&MapData, UsdtCounterKey, UsdtCounterValue> =
        HashMap::try_from(probes.map("USDT_COUNTERS")?)?;
    Ok(subsystems.keys().count() + counters.keys().count())
}

/// The name up to its NUL; a name that is not UTF-8 keeps its valid parts.
fn subsystem_name(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usdt_options() {
        let request = UsdtRequest::parse("myapp:tick").unwrap();
        assert_eq!(
            (request.path, request.provider.as_str(), request.name.as_str(), request.argument),
            (None, "myapp", "tick", None)
        );
        let request = UsdtRequest::parse("./lib/libfoo.so:foo:alloc=arg1").unwrap();
        assert_eq!(request.path, Some(PathBuf::from("./lib/libfoo.so")));
        assert_eq!((request.provider.as_str(), request.name.as_str()), ("foo", "alloc"));
        assert_eq!(request.argument, Some(1));
        assert_eq!(request.label, "./lib/libfoo.so:foo:alloc=arg1");
        let request = UsdtRequest::parse("/a:b/c:p:n").unwrap();
        assert_eq!(request.path, Some(PathBuf::from("/a:b/c")));
        for bad in
            ["", "tick", ":tick", "p:", "p:n=1", "p:n=arg", "p:n=arg99", "p:n=argx", ":p:n", "p:n/x", "p q:n"]
        {
            let err = UsdtRequest::parse(bad).unwrap_err();
            assert!(err.contains("write"), "{bad}: {err}");
        }
    }

    #[test]
    fn subsystem_names_stop_at_nul() {
        assert_eq!(subsystem_name(b"textures\0\0\0"), "textures");
        assert_eq!(subsystem_name(b"full"), "full");
        assert_eq!(subsystem_name(b"\0"), "");
    }
}
