//! An allocator's entry points in one ELF file: which functions memtrace probes (malloc, free and
//! the rest, under a symbol prefix such as jemalloc's `je_`) and the file offsets their probes sit
//! at. Read once per file by the file cache; choosing the file a process allocates through is the
//! allocator module's.

use std::collections::HashSet;

use anyhow::{bail, Result};
use iced_x86::{Decoder, DecoderOptions, Mnemonic, OpKind};
use memtrace_common::AllocatorFunction;

use crate::process::elf::ElfObject;

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

/// An entry point located in the allocator's file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedEntryPoint {
    pub entry: EntryPoint,
    /// File offset of the function's first instruction: where a return probe must sit.
    pub offset: u64,
    /// File offset for the entry probe: past a leading instruction the kernel would single-step.
    pub probe_offset: u64,
    /// How far the executable segment reaches before and after the entry probe (bytes): a return
    /// address in that stretch is a call from the allocator's own code.
    pub code_around_probe: (u64, u64),
}

/// Locates every entry point `prefix` + symbol that an ELF file defines, once per address.
pub fn resolve_entry_points(elf: &ElfObject<'_>, prefix: &str) -> Result<Vec<ResolvedEntryPoint>> {
    let mut seen = HashSet::new();
    let mut resolved = Vec::new();
    // One pass over the symbols finds every entry point.
    let defined = elf.defined_functions(|name| {
        name.strip_prefix(prefix.as_bytes())
            .is_some_and(|name| ENTRY_POINTS.iter().any(|entry| entry.symbol.as_bytes() == name))
    });
    for entry in ENTRY_POINTS {
        let name = format!("{prefix}{}", entry.symbol);
        let Some(&(_, address)) = defined.iter().find(|(defined, _)| *defined == name) else {
            continue;
        };
        if !seen.insert(address) {
            continue;
        }
        let Some(offset) = elf.code_file_offset(address) else {
            bail!("{prefix}{} at {address:#x} lies in no executable segment", entry.symbol);
        };
        // The longest x86 instruction is 15 bytes.
        let code = elf.code_bytes(offset, 15);
        let skipped = single_stepped_prologue_len(&code, address);
        let code_around_probe = elf.code_around(address + skipped).unwrap_or_default();
        resolved.push(ResolvedEntryPoint {
            entry,
            offset,
            probe_offset: offset + skipped,
            code_around_probe,
        });
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
}
