//! Finds the object that provides a process's allocator as the dynamic linker resolves `malloc`
//! (the executable itself, an LD_PRELOADed or linked jemalloc, tcmalloc or mimalloc, or the C
//! library), and the file offsets of its entry points.

use std::{
    collections::{HashSet, VecDeque},
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use iced_x86::{Decoder, DecoderOptions, Mnemonic, OpKind};
use memtrace_common::AllocatorFunction;

use crate::{elf::ElfObject, procfs};

/// An allocator entry point and the symbol that names it, without any prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryPoint {
    pub function: AllocatorFunction,
    pub symbol: &'static str,
}

const fn entry(function: AllocatorFunction, symbol: &'static str) -> EntryPoint {
    EntryPoint { function, symbol }
}

/// Every entry point memtrace probes. Where symbols alias (glibc's aligned_alloc is memalign), the
/// first one listed is attached and the others are skipped, so that a call is counted once.
/// jemalloc's non-standard API maps onto the same accounting: mallocx allocates like malloc,
/// rallocx moves like realloc, sdallocx and dallocx free.
pub const ENTRY_POINTS: [EntryPoint; 14] = [
    entry(AllocatorFunction::Malloc, "malloc"),
    entry(AllocatorFunction::Calloc, "calloc"),
    entry(AllocatorFunction::Realloc, "realloc"),
    entry(AllocatorFunction::Reallocarray, "reallocarray"),
    entry(AllocatorFunction::PosixMemalign, "posix_memalign"),
    entry(AllocatorFunction::Memalign, "memalign"),
    entry(AllocatorFunction::AlignedAlloc, "aligned_alloc"),
    entry(AllocatorFunction::Valloc, "valloc"),
    entry(AllocatorFunction::Pvalloc, "pvalloc"),
    entry(AllocatorFunction::Free, "free"),
    entry(AllocatorFunction::Malloc, "mallocx"),
    entry(AllocatorFunction::Realloc, "rallocx"),
    entry(AllocatorFunction::Free, "sdallocx"),
    entry(AllocatorFunction::Free, "dallocx"),
];

/// Symbol prefixes of allocators built to live beside the system one, and their names.
const KNOWN_PREFIXES: [(&str, &str); 4] =
    [("je_", "jemalloc"), ("tc_", "tcmalloc"), ("mi_", "mimalloc"), ("_rjem_", "jemalloc (Rust)")];

/// What the user said about the allocator: `--lib PATH` and `--allocator NAME|PREFIX`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// The object to probe, as the target sees its path.
    pub lib: Option<PathBuf>,
    /// The symbol prefix of its entry points ("" for plain malloc).
    pub prefix: Option<String>,
}

impl Overrides {
    /// `--allocator`: a known allocator's name or a literal symbol prefix.
    pub fn prefix_for(name: &str) -> String {
        match name {
            // Allocators that replace the system one export plain malloc.
            "glibc" | "libc" | "system" | "jemalloc" | "tcmalloc" | "mimalloc" => "",
            "je" => "je_",
            "tc" => "tc_",
            "mi" => "mi_",
            "rust-jemalloc" | "rjem" => "_rjem_",
            prefix => prefix,
        }
        .to_owned()
    }
}

/// An entry point located in the allocator's file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedEntryPoint {
    pub entry: EntryPoint,
    /// File offset of the function's first instruction: where a return probe must sit.
    pub offset: u64,
    /// File offset for the entry probe: past a leading instruction the kernel would single-step.
    pub probe_offset: u64,
}

/// The object a process's allocator lives in, with its entry points.
#[derive(Debug, Clone)]
pub struct Allocator {
    /// "glibc", "jemalloc", ... or "malloc in <file>" for an executable's own.
    pub kind: String,
    /// The path as the target sees it, for reports.
    pub path: PathBuf,
    /// The path to open from memtrace's mount namespace.
    pub host_path: PathBuf,
    pub entry_points: Vec<ResolvedEntryPoint>,
}

/// An object file a process maps or will map, in the dynamic linker's search order.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ObjectFile {
    path: PathBuf,
    host_path: PathBuf,
}

impl Allocator {
    /// The allocator of a running process, read through /proc/PID/root (containers see other files).
    pub fn of_process(pid: u32, overrides: &Overrides) -> Result<Self> {
        let objects = link_order_of_process(pid)?;
        let lib = overrides
            .lib
            .as_ref()
            .map(|lib| ObjectFile { path: lib.clone(), host_path: procfs::in_root_of(pid, lib) });
        choose(&objects, lib, overrides.prefix.as_deref())
            .with_context(|| format!("finding the allocator of pid {pid}"))
    }

    /// The allocator a command will use once it runs, found by resolving its dependencies the way
    /// the dynamic linker will.
    pub fn of_command(program: &Path, overrides: &Overrides) -> Result<Self> {
        let objects = link_order_of_command(program, Path::new("/"), &[])?;
        let lib = overrides.lib.as_ref().map(|lib| ObjectFile { path: lib.clone(), host_path: lib.clone() });
        choose(&objects, lib, overrides.prefix.as_deref())
            .with_context(|| format!("finding the allocator of {}", program.display()))
    }

    /// The allocator of a process that has just exec'd a program, before the dynamic linker has
    /// mapped its libraries: resolved like a command, inside the process's own root.
    pub fn of_exec(pid: u32, overrides: &Overrides) -> Result<Self> {
        let objects = link_order_of_exec(pid)?;
        let lib = overrides
            .lib
            .as_ref()
            .map(|lib| ObjectFile { path: lib.clone(), host_path: procfs::in_root_of(pid, lib) });
        choose(&objects, lib, overrides.prefix.as_deref())
    }

    /// The object files a just-exec'd process will map: (path as it sees it, path to open now).
    pub fn objects_of_exec(pid: u32) -> Vec<(PathBuf, PathBuf)> {
        link_order_of_exec(pid)
            .unwrap_or_default()
            .into_iter()
            .map(|object| (object.path, object.host_path))
            .collect()
    }

    /// The object files a command will map, as they are found on this machine.
    pub fn objects_of_command(program: &Path) -> Vec<PathBuf> {
        link_order_of_command(program, Path::new("/"), &[])
            .unwrap_or_default()
            .into_iter()
            .map(|object| object.host_path)
            .collect()
    }

    /// The allocator a library file provides, if it provides one (plain or with a known prefix).
    pub fn of_file(path: &Path) -> Option<Self> {
        let object = ObjectFile { path: path.to_owned(), host_path: path.to_owned() };
        choose(std::slice::from_ref(&object), None, None).ok()
    }

    fn from_object(object: &ObjectFile, prefix: &str) -> Result<Option<Self>> {
        let data =
            fs::read(&object.host_path).with_context(|| format!("reading {}", object.host_path.display()))?;
        let elf = ElfObject::parse(&data).with_context(|| format!("parsing {}", object.path.display()))?;
        let entry_points = resolve_entry_points(&elf, prefix)
            .with_context(|| format!("reading the symbols of {}", object.path.display()))?;
        let defines_malloc = entry_points.iter().any(|e| e.entry.symbol == "malloc");
        Ok(defines_malloc.then(|| Self {
            kind: kind_of(&object.path, prefix),
            path: object.path.clone(),
            host_path: object.host_path.clone(),
            entry_points,
        }))
    }
}

/// The first object in search order that defines malloc wins, as it does for the dynamic linker.
/// Failing that, an allocator with a known prefix anywhere (e.g. Rust's jemallocator in the
/// executable) is the one the program calls.
fn choose(objects: &[ObjectFile], lib: Option<ObjectFile>, prefix: Option<&str>) -> Result<Allocator> {
    if let Some(lib) = lib {
        let prefixes: Vec<&str> = match prefix {
            Some(prefix) => vec![prefix],
            None => std::iter::once("").chain(KNOWN_PREFIXES.iter().map(|(p, _)| *p)).collect(),
        };
        for prefix in prefixes {
            if let Some(allocator) = Allocator::from_object(&lib, prefix)? {
                return Ok(allocator);
            }
        }
        bail!(
            "{} defines no {}malloc; name the symbol prefix with --allocator (e.g. --allocator je_)",
            lib.path.display(),
            prefix.unwrap_or("")
        );
    }
    let prefixes: Vec<&str> = match prefix {
        Some(prefix) => vec![prefix],
        None => std::iter::once("").chain(KNOWN_PREFIXES.iter().map(|(p, _)| *p)).collect(),
    };
    for prefix in prefixes {
        for object in objects {
            // Objects that are not ELF (or unreadable) cannot be the allocator.
            if let Ok(Some(allocator)) = Allocator::from_object(object, prefix) {
                return Ok(allocator);
            }
        }
    }
    bail!(
        "no loaded object defines {}malloc; name the allocator's file with --lib PATH and its symbol \
         prefix with --allocator",
        prefix.unwrap_or("")
    )
}

fn kind_of(path: &Path, prefix: &str) -> String {
    if let Some((_, name)) = KNOWN_PREFIXES.iter().find(|(p, _)| *p == prefix) {
        return (*name).to_owned();
    }
    let file = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    for name in ["jemalloc", "tcmalloc", "mimalloc"] {
        if file.contains(name) {
            return name.to_owned();
        }
    }
    if is_libc(path) {
        "glibc".to_owned()
    } else {
        format!("malloc in {file}")
    }
}

fn is_libc(path: &Path) -> bool {
    path.file_name().and_then(|name| name.to_str()).is_some_and(|name| {
        name.starts_with("libc.so") || (name.starts_with("libc-") && name.ends_with(".so"))
    })
}

/// The objects of a running process in the dynamic linker's symbol search order: the executable,
/// LD_PRELOAD, then DT_NEEDED breadth-first; objects loaded later (dlopen) last.
fn link_order_of_process(pid: u32) -> Result<Vec<ObjectFile>> {
    let maps = procfs::mappings(pid)
        .with_context(|| format!("reading /proc/{pid}/maps (is pid {pid} still running?)"))?;
    let mut mapped: Vec<PathBuf> = Vec::new();
    for mapping in maps.into_iter().filter(|m| m.executable) {
        if !mapped.contains(&mapping.path) {
            mapped.push(mapping.path);
        }
    }
    let exe =
        fs::read_link(format!("/proc/{pid}/exe")).with_context(|| format!("reading /proc/{pid}/exe"))?;
    let exe = PathBuf::from(exe.to_string_lossy().trim_end_matches(" (deleted)"));
    let object = |path: &Path| ObjectFile { path: path.to_owned(), host_path: procfs::in_root_of(pid, path) };
    // A needed name is a soname; the mapped file may be named otherwise (libtcmalloc.so.4 is
    // libtcmalloc.so.4.5.10), so fall back on the sonames the mapped objects declare.
    let sonames = std::cell::OnceCell::new();
    let soname_of = |path: &PathBuf| -> Option<String> {
        let data = fs::read(procfs::in_root_of(pid, path)).ok()?;
        ElfObject::parse(&data).ok()?.dynamic_info().ok()?.soname
    };
    let find_mapped = |name: &str| -> Option<PathBuf> {
        let by_file_name = mapped
            .iter()
            .find(|path| path.as_os_str() == name || path.file_name().is_some_and(|n| n == name));
        by_file_name.cloned().or_else(|| {
            let sonames: &Vec<(PathBuf, Option<String>)> =
                sonames.get_or_init(|| mapped.iter().map(|path| (path.clone(), soname_of(path))).collect());
            sonames.iter().find(|(_, soname)| soname.as_deref() == Some(name)).map(|(path, _)| path.clone())
        })
    };
    let mut order =
        vec![ObjectFile { path: exe.clone(), host_path: PathBuf::from(format!("/proc/{pid}/exe")) }];
    let environ = fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    for preload in preloads(environ.split(|&b| b == 0).map(|var| String::from_utf8_lossy(var).into_owned())) {
        if let Some(path) = find_mapped(&preload) {
            order.push(object(&path));
        }
    }
    let needed = needed_breadth_first(&order[0].host_path, |name, _| find_mapped(name).map(|p| object(&p)));
    order.extend(needed);
    for path in &mapped {
        order.push(object(path));
    }
    dedup(&mut order);
    Ok(order)
}

fn link_order_of_exec(pid: u32) -> Result<Vec<ObjectFile>> {
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let program = PathBuf::from(format!("/proc/{pid}/exe"));
    // Where the process sees its program: the path that outlives the process.
    let seen_as = fs::read_link(&program).with_context(|| format!("pid {pid} has exited"))?;
    let environ = fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let environ: Vec<String> =
        environ.split(|&b| b == 0).map(|var| String::from_utf8_lossy(var).into_owned()).collect();
    let mut order = link_order_of_command(&program, &root, &environ)?;
    order[0].path = seen_as;
    Ok(order)
}

/// The objects a program will load, resolved before it runs, in the file system under `root`
/// (`/`, or /proc/PID/root for a process in another mount namespace). `environ` is the program's
/// environment when it is not memtrace's own.
fn link_order_of_command(program: &Path, root: &Path, environ: &[String]) -> Result<Vec<ObjectFile>> {
    let in_root = |path: &Path| root.join(path.strip_prefix("/").unwrap_or(path));
    let object = |path: &Path| ObjectFile {
        path: path.strip_prefix(root).map_or_else(|_| path.to_owned(), |p| Path::new("/").join(p)),
        host_path: path.to_owned(),
    };
    let mut order = vec![ObjectFile { path: program.to_owned(), host_path: program.to_owned() }];
    let environ: Vec<String> = if environ.is_empty() {
        std::env::vars().map(|(k, v)| format!("{k}={v}")).collect()
    } else {
        environ.to_vec()
    };
    let library_path: Vec<PathBuf> = environ
        .iter()
        .filter_map(|var| var.strip_prefix("LD_LIBRARY_PATH="))
        .flat_map(|paths| std::env::split_paths(paths).map(|p| in_root(&p)).collect::<Vec<_>>())
        .collect();
    let system_dirs: Vec<PathBuf> = SYSTEM_LIBRARY_DIRS.iter().map(|dir| in_root(Path::new(dir))).collect();
    for preload in preloads(environ.iter().cloned()) {
        let preload = match preload.strip_prefix('/') {
            Some(_) => in_root(Path::new(&preload)).to_string_lossy().into_owned(),
            None => preload,
        };
        if let Some(path) = find_library(&preload, &library_path, &[], &system_dirs) {
            order.push(object(&path));
        }
    }
    let needed = needed_breadth_first(program, |name, runpath| {
        find_library(name, &library_path, runpath, &system_dirs).map(|p| object(&p))
    });
    order.extend(needed);
    dedup(&mut order);
    Ok(order)
}

fn preloads(environ: impl Iterator<Item = String>) -> Vec<String> {
    environ
        .filter_map(|var| var.strip_prefix("LD_PRELOAD=").map(str::to_owned))
        .flat_map(|value| {
            value.split([' ', ':']).filter(|s| !s.is_empty()).map(str::to_owned).collect::<Vec<_>>()
        })
        .collect()
}

/// DT_NEEDED of `root`, breadth-first as the dynamic linker loads them. `locate` finds a needed
/// name, given the search paths (DT_RUNPATH/DT_RPATH, $ORIGIN expanded) of the object needing it.
fn needed_breadth_first(
    root: &Path,
    mut locate: impl FnMut(&str, &[PathBuf]) -> Option<ObjectFile>,
) -> Vec<ObjectFile> {
    let mut found = Vec::new();
    let mut seen = HashSet::new();
    let mut queue = VecDeque::from([root.to_owned()]);
    while let Some(host_path) = queue.pop_front() {
        let Ok(data) = fs::read(&host_path) else {
            continue;
        };
        let Ok(info) = ElfObject::parse(&data).and_then(|elf| elf.dynamic_info()) else {
            continue;
        };
        let origin = host_path.parent().unwrap_or(Path::new("/"));
        let runpath: Vec<PathBuf> = info
            .search_paths
            .iter()
            .map(|p| PathBuf::from(p.replace("$ORIGIN", &origin.to_string_lossy())))
            .collect();
        for name in info.needed {
            if !seen.insert(name.clone()) {
                continue;
            }
            if let Some(object) = locate(&name, &runpath) {
                queue.push_back(object.host_path.clone());
                found.push(object);
            }
        }
    }
    found
}

/// The default search directories of Debian's x86-64 dynamic linker, after LD_LIBRARY_PATH and
/// the object's run path.
const SYSTEM_LIBRARY_DIRS: [&str; 6] =
    ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"];

fn find_library(
    name: &str,
    library_path: &[PathBuf],
    runpath: &[PathBuf],
    system_dirs: &[PathBuf],
) -> Option<PathBuf> {
    if name.contains('/') {
        return Path::new(name).is_file().then(|| PathBuf::from(name));
    }
    library_path
        .iter()
        .chain(runpath)
        .chain(system_dirs)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// Allocator libraries installed in the system's library directories, which a program started
/// later may load: probing them up front traces such a program from its first allocation.
pub fn installed_allocator_libraries() -> Vec<PathBuf> {
    let mut found = Vec::new();
    for dir in SYSTEM_LIBRARY_DIRS {
        let Ok(entries) = fs::read_dir(dir) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let allocator = ["libjemalloc.so", "libtcmalloc", "libmimalloc"]
                .iter()
                .any(|prefix| name.starts_with(prefix));
            if (allocator && name.contains(".so")) || name == "libc.so.6" {
                found.push(entry.path());
            }
        }
    }
    found
}

fn dedup(objects: &mut Vec<ObjectFile>) {
    let mut seen = HashSet::new();
    objects.retain(|object| seen.insert(object.path.clone()));
}

/// Locates every entry point `prefix` + symbol that an ELF file defines, once per address.
pub fn resolve_entry_points(elf: &ElfObject<'_>, prefix: &str) -> Result<Vec<ResolvedEntryPoint>> {
    let mut seen = HashSet::new();
    let mut resolved = Vec::new();
    for entry in ENTRY_POINTS {
        let Some(address) = elf.defined_function(&format!("{prefix}{}", entry.symbol)) else {
            continue;
        };
        if !seen.insert(address) {
            continue;
        }
        let Some(offset) = elf.code_file_offset(address) else {
            bail!("{prefix}{} at {address:#x} lies in no executable segment", entry.symbol);
        };
        let code = elf.data().get(offset as usize..).unwrap_or_default();
        let probe_offset = offset + single_stepped_prologue_len(code, address);
        resolved.push(ResolvedEntryPoint { entry, offset, probe_offset });
    }
    Ok(resolved)
}

/// Length of a leading flags-only register test (glibc's free starts with `test %rdi,%rdi`), or 0.
///
/// The kernel cannot emulate such an instruction under a uprobe and single-steps it, which costs
/// about 13 times as much as a probe on the following jump. Skipping it changes nothing a probe sees:
/// it writes only flags, and the argument registers are untouched.
fn single_stepped_prologue_len(code: &[u8], address: u64) -> u64 {
    let mut decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
    if !decoder.can_decode() {
        return 0;
    }
    let instruction = decoder.decode();
    let flags_only = matches!(instruction.mnemonic(), Mnemonic::Test | Mnemonic::Cmp);
    let registers_only = (0..instruction.op_count()).all(|i| instruction.op_kind(i) == OpKind::Register);
    if flags_only && registers_only {
        instruction.len() as u64
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leading_register_test_is_skipped() {
        // test %rdi,%rdi ; je +0x10
        assert_eq!(single_stepped_prologue_len(&[0x48, 0x85, 0xff, 0x74, 0x10], 0x1000), 3);
        // push %rbp
        assert_eq!(single_stepped_prologue_len(&[0x55, 0x48, 0x89, 0xe5], 0x1000), 0);
        // cmpq $0x0,(%rdi): touches memory, keep the probe at entry
        assert_eq!(single_stepped_prologue_len(&[0x48, 0x83, 0x3f, 0x00], 0x1000), 0);
        assert_eq!(single_stepped_prologue_len(&[], 0x1000), 0);
    }

    fn own_libc() -> PathBuf {
        procfs::mappings(std::process::id())
            .unwrap()
            .into_iter()
            .map(|m| m.path)
            .find(|path| is_libc(path))
            .expect("tests run on glibc")
    }

    #[test]
    fn host_libc_provides_every_glibc_entry_point_once() {
        let data = fs::read(own_libc()).unwrap();
        let resolved = resolve_entry_points(&ElfObject::parse(&data).unwrap(), "").unwrap();
        let names: Vec<_> = resolved.iter().map(|r| r.entry.symbol).collect();
        for expected in ["malloc", "calloc", "realloc", "reallocarray", "posix_memalign", "memalign", "free"]
        {
            assert!(names.contains(&expected), "{expected} missing from {names:?}");
        }
        let offsets: HashSet<_> = resolved.iter().map(|r| r.offset).collect();
        assert_eq!(offsets.len(), resolved.len(), "an address is probed twice: {resolved:?}");
    }

    #[test]
    fn own_process_is_traced_through_glibc() {
        let allocator = Allocator::of_process(std::process::id(), &Overrides::default()).unwrap();
        assert_eq!(allocator.kind, "glibc");
        let command =
            Allocator::of_command(&std::env::current_exe().unwrap(), &Overrides::default()).unwrap();
        assert_eq!(command.kind, "glibc");
    }

    #[test]
    fn a_lib_without_the_prefix_is_a_clear_error() {
        let overrides = Overrides { lib: Some(own_libc()), prefix: Some("je_".into()) };
        let err = Allocator::of_process(std::process::id(), &overrides).unwrap_err();
        assert!(format!("{err:#}").contains("defines no je_malloc"), "{err:#}");
    }

    #[test]
    fn preload_lists_split_on_spaces_and_colons() {
        let environ = ["HOME=/root".to_owned(), "LD_PRELOAD=/a/libx.so:liby.so libz.so".to_owned()];
        assert_eq!(preloads(environ.into_iter()), ["/a/libx.so", "liby.so", "libz.so"]);
    }

    #[test]
    fn allocator_names_map_to_prefixes() {
        assert_eq!(Overrides::prefix_for("glibc"), "");
        assert_eq!(Overrides::prefix_for("jemalloc"), "");
        assert_eq!(Overrides::prefix_for("je"), "je_");
        assert_eq!(Overrides::prefix_for("rjem"), "_rjem_");
        assert_eq!(Overrides::prefix_for("my_"), "my_");
    }
}
