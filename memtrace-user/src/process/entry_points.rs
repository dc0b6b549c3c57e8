//! An allocator's entry points in one ELF file: which functions memtrace probes (malloc, free and
//! the rest, under a symbol prefix such as jemalloc's `je_`) and where their probes sit
//! (probe_point). Read once per file by the file cache; choosing the file a process allocates through is the
//! allocator module's.

use std::collections::HashSet;

use anyhow::{bail, Result};
use memtrace_common::AllocatorFunction;

use crate::process::{
    elf::ElfObject,
    probe_point::{self, ProbePoint},
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

/// An entry point located in the allocator's file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedEntryPoint {
    pub entry: EntryPoint,
    /// Its symbol, prefix and all (`je_malloc`).
    pub name: String,
    /// File offset of the function's first instruction.
    pub offset: u64,
    /// Where its probes sit (the entry probe, and the return probe of all but free).
    pub probe: ProbePoint,
    /// How far the executable segment reaches before and after the probe (bytes): a return
    /// address in that stretch is a call from the allocator's own code.
    pub code_around_probe: (u64, u64),
}

impl ResolvedEntryPoint {
    /// File offset of the probes.
    pub fn probe_offset(&self) -> u64 {
        self.offset + self.probe.delta
    }
}

/// Locates every entry point `prefix` + symbol that an ELF file defines, once per address, and
/// places its probes.
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
        let Some(function) = defined.iter().find(|defined| defined.name == name) else {
            continue;
        };
        if !seen.insert(function.address) {
            continue;
        }
        let Some(offset) = elf.code_file_offset(function.address) else {
            bail!("{prefix}{} at {:#x} lies in no executable segment", entry.symbol, function.address);
        };
        let probe =
            probe_point::place(&elf.function_code(function), function.address, entry.function.arguments());
        let code_around_probe = elf.code_around(function.address + probe.delta).unwrap_or_default();
        resolved.push(ResolvedEntryPoint { entry, name, offset, probe, code_around_probe });
    }
    Ok(resolved)
}
