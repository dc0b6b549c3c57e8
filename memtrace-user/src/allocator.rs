//! Finds the object that provides a process's allocator as the dynamic linker resolves `malloc`
//! (the executable itself, an LD_PRELOADed or linked jemalloc, tcmalloc or mimalloc, or the C
//! library), and the file offsets of its entry points.

use std::{
    collections::HashSet,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use iced_x86::{Decoder, DecoderOptions, Mnemonic, OpKind};
use memtrace_common::AllocatorFunction;

use crate::{
    elf::ElfObject,
    objects::{link_order_of_command, link_order_of_process, ObjectFile, SYSTEM_LIBRARY_DIRS},
    procfs,
};

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
    /// The `--lib` object, opened at `host_path(lib)`.
    fn lib_object(&self, host_path: impl Fn(&Path) -> PathBuf) -> Option<ObjectFile> {
        self.lib.as_ref().map(|lib| ObjectFile { path: lib.clone(), host_path: host_path(lib) })
    }

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

impl Allocator {
    /// The allocator of a running process, read through /proc/PID/root (containers see other files).
    pub fn of_process(pid: u32, overrides: &Overrides) -> Result<Self> {
        let objects = link_order_of_process(pid)?;
        choose(
            &objects,
            overrides.lib_object(|lib| procfs::in_root_of(pid, lib)),
            overrides.prefix.as_deref(),
        )
        .with_context(|| format!("finding the allocator of pid {pid}"))
    }

    /// The allocator a command will use once it runs, found by resolving its dependencies the way
    /// the dynamic linker will.
    pub fn of_command(program: &Path, overrides: &Overrides) -> Result<Self> {
        let objects = link_order_of_command(program, Path::new("/"), &[])?;
        choose(&objects, overrides.lib_object(Path::to_owned), overrides.prefix.as_deref())
            .with_context(|| format!("finding the allocator of {}", program.display()))
    }

    /// The allocator among the objects of process `pid` in link order, e.g. of a program it has
    /// just exec'd (objects::link_order_of_exec).
    pub fn among(objects: &[ObjectFile], pid: u32, overrides: &Overrides) -> Result<Self> {
        choose(objects, overrides.lib_object(|lib| procfs::in_root_of(pid, lib)), overrides.prefix.as_deref())
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
    fn allocator_names_map_to_prefixes() {
        assert_eq!(Overrides::prefix_for("glibc"), "");
        assert_eq!(Overrides::prefix_for("jemalloc"), "");
        assert_eq!(Overrides::prefix_for("je"), "je_");
        assert_eq!(Overrides::prefix_for("rjem"), "_rjem_");
        assert_eq!(Overrides::prefix_for("my_"), "my_");
    }
}
