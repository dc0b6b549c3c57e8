//! Finds the object that provides a process's allocator and the file offsets of its entry points.

use std::{
    collections::HashSet,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use iced_x86::{Decoder, DecoderOptions, Mnemonic, OpKind};
use memtrace_common::AllocatorFunction;
use object::{elf, read::elf::ProgramHeader as _, Endianness, Object, ObjectSymbol};

use crate::procfs;

/// An allocator entry point and the glibc symbol that names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryPoint {
    pub function: AllocatorFunction,
    pub symbol: &'static str,
}

/// Every entry point memtrace probes. Where symbols alias (glibc's aligned_alloc is memalign), the
/// first one listed is attached and the others are skipped, so that a call is counted once.
pub const ENTRY_POINTS: [EntryPoint; 10] = [
    EntryPoint {
        function: AllocatorFunction::Malloc,
        symbol: "malloc",
    },
    EntryPoint {
        function: AllocatorFunction::Calloc,
        symbol: "calloc",
    },
    EntryPoint {
        function: AllocatorFunction::Realloc,
        symbol: "realloc",
    },
    EntryPoint {
        function: AllocatorFunction::Reallocarray,
        symbol: "reallocarray",
    },
    EntryPoint {
        function: AllocatorFunction::PosixMemalign,
        symbol: "posix_memalign",
    },
    EntryPoint {
        function: AllocatorFunction::Memalign,
        symbol: "memalign",
    },
    EntryPoint {
        function: AllocatorFunction::AlignedAlloc,
        symbol: "aligned_alloc",
    },
    EntryPoint {
        function: AllocatorFunction::Valloc,
        symbol: "valloc",
    },
    EntryPoint {
        function: AllocatorFunction::Pvalloc,
        symbol: "pvalloc",
    },
    EntryPoint {
        function: AllocatorFunction::Free,
        symbol: "free",
    },
];

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
    /// The path as the target sees it, for reports.
    pub path: PathBuf,
    /// The path to open from memtrace's mount namespace.
    pub host_path: PathBuf,
    pub entry_points: Vec<ResolvedEntryPoint>,
}

impl Allocator {
    /// The allocator of a running process: the executable when it defines malloc itself (a static or
    /// interposing binary), otherwise the C library it maps.
    pub fn of_process(pid: u32) -> Result<Self> {
        let mappings = procfs::mappings(pid)
            .with_context(|| format!("reading /proc/{pid}/maps (is pid {pid} still running?)"))?;
        let executable = fs::read_link(format!("/proc/{pid}/exe"))
            .with_context(|| format!("reading /proc/{pid}/exe"))?;
        let mut candidates = vec![executable];
        candidates.extend(
            mappings
                .into_iter()
                .map(|m| m.path)
                .filter(|path| is_libc(path)),
        );
        for path in candidates {
            let host_path = procfs::in_root_of(pid, &path);
            if let Some(allocator) = Self::from_file(&path, &host_path)? {
                return Ok(allocator);
            }
        }
        bail!(
            "pid {pid} maps no allocator memtrace knows (no malloc in its executable or C library)"
        )
    }

    /// The allocator a command will use once it runs: its executable when that defines malloc,
    /// otherwise the C library memtrace itself runs on, which the dynamic linker resolves alike.
    pub fn of_command(program: &Path) -> Result<Self> {
        if let Some(allocator) = Self::from_file(program, program)? {
            return Ok(allocator);
        }
        let own_libc = procfs::mappings(std::process::id())?
            .into_iter()
            .map(|m| m.path)
            .find(|path| is_libc(path))
            .context("memtrace's own C library is not mapped; cannot tell which one the command will use")?;
        Self::from_file(&own_libc, &own_libc)?
            .with_context(|| format!("{} defines no malloc", own_libc.display()))
    }

    fn from_file(path: &Path, host_path: &Path) -> Result<Option<Self>> {
        let data =
            fs::read(host_path).with_context(|| format!("reading {}", host_path.display()))?;
        let entry_points = resolve_entry_points(&data)
            .with_context(|| format!("reading the symbols of {}", path.display()))?;
        let defines_malloc = entry_points
            .iter()
            .any(|e| e.entry.function == AllocatorFunction::Malloc);
        Ok(defines_malloc.then(|| Self {
            path: path.to_owned(),
            host_path: host_path.to_owned(),
            entry_points,
        }))
    }
}

fn is_libc(path: &Path) -> bool {
    path.file_name()
        .and_then(|name| name.to_str())
        .is_some_and(|name| {
            name.starts_with("libc.so") || (name.starts_with("libc-") && name.ends_with(".so"))
        })
}

/// Locates every entry point defined in an ELF file, once per address.
pub fn resolve_entry_points(data: &[u8]) -> Result<Vec<ResolvedEntryPoint>> {
    let file = object::File::parse(data)?;
    let segments = executable_segments(&file, data)?;
    let mut seen = HashSet::new();
    let mut resolved = Vec::new();
    for entry in ENTRY_POINTS {
        let Some(address) = defined_function_address(&file, entry.symbol) else {
            continue;
        };
        if !seen.insert(address) {
            continue;
        }
        let Some(offset) = file_offset(&segments, address) else {
            bail!(
                "{} at {address:#x} lies in no executable segment",
                entry.symbol
            );
        };
        let code = data.get(offset as usize..).unwrap_or_default();
        let probe_offset = offset + single_stepped_prologue_len(code, address);
        resolved.push(ResolvedEntryPoint {
            entry,
            offset,
            probe_offset,
        });
    }
    Ok(resolved)
}

fn defined_function_address(file: &object::File<'_>, name: &str) -> Option<u64> {
    file.dynamic_symbols()
        .chain(file.symbols())
        .find(|symbol| {
            symbol.is_definition()
                && symbol.kind() == object::SymbolKind::Text
                && symbol.name_bytes().is_ok_and(|n| n == name.as_bytes())
        })
        .map(|symbol| symbol.address())
}

/// (virtual address, size, file offset) of each executable PT_LOAD.
fn executable_segments(file: &object::File<'_>, data: &[u8]) -> Result<Vec<(u64, u64, u64)>> {
    let object::File::Elf64(elf_file) = file else {
        bail!("only 64-bit ELF files are supported");
    };
    let endian: Endianness = elf_file.endian();
    Ok(elf_file
        .elf_program_headers()
        .iter()
        .filter(|ph| ph.p_type(endian) == elf::PT_LOAD && ph.p_flags(endian) & elf::PF_X != 0)
        .map(|ph| (ph.p_vaddr(endian), ph.p_memsz(endian), ph.p_offset(endian)))
        .filter(|&(_, _, offset)| offset <= data.len() as u64)
        .collect())
}

fn file_offset(segments: &[(u64, u64, u64)], address: u64) -> Option<u64> {
    segments
        .iter()
        .find(|&&(vaddr, size, _)| (vaddr..vaddr + size).contains(&address))
        .map(|&(vaddr, _, offset)| address - vaddr + offset)
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
    let registers_only =
        (0..instruction.op_count()).all(|i| instruction.op_kind(i) == OpKind::Register);
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
        assert_eq!(
            single_stepped_prologue_len(&[0x48, 0x85, 0xff, 0x74, 0x10], 0x1000),
            3
        );
        // push %rbp
        assert_eq!(
            single_stepped_prologue_len(&[0x55, 0x48, 0x89, 0xe5], 0x1000),
            0
        );
        // cmpq $0x0,(%rdi): touches memory, keep the probe at entry
        assert_eq!(
            single_stepped_prologue_len(&[0x48, 0x83, 0x3f, 0x00], 0x1000),
            0
        );
        assert_eq!(single_stepped_prologue_len(&[], 0x1000), 0);
    }

    #[test]
    fn host_libc_provides_every_glibc_entry_point_once() {
        let libc = procfs::mappings(std::process::id())
            .unwrap()
            .into_iter()
            .map(|m| m.path)
            .find(|path| is_libc(path))
            .expect("tests run on glibc");
        let resolved = resolve_entry_points(&fs::read(&libc).unwrap()).unwrap();
        let names: Vec<_> = resolved.iter().map(|r| r.entry.symbol).collect();
        for expected in [
            "malloc",
            "calloc",
            "realloc",
            "reallocarray",
            "posix_memalign",
            "memalign",
            "free",
        ] {
            assert!(
                names.contains(&expected),
                "{expected} missing from {names:?}"
            );
        }
        let offsets: HashSet<_> = resolved.iter().map(|r| r.offset).collect();
        assert_eq!(
            offsets.len(),
            resolved.len(),
            "an address is probed twice: {resolved:?}"
        );
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(resolve_entry_points(b"definitely not ELF").is_err());
        assert!(resolve_entry_points(&[0x7f, b'E', b'L', b'F', 2, 1, 1]).is_err());
    }

    #[test]
    fn libc_names() {
        assert!(is_libc(Path::new("/usr/lib/x86_64-linux-gnu/libc.so.6")));
        assert!(is_libc(Path::new("/lib/libc-2.31.so")));
        assert!(!is_libc(Path::new("/usr/lib/libcrypto.so.3")));
    }
}
