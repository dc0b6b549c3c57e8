//! Unwind tables for stacks without frame pointers: each object file's .eh_frame and .debug_frame
//! become compact rows (`memtrace_common::UnwindRow`, 8 bytes) under a two-level index
//! (`memtrace_common::UnwindTableInfo`) that the BPF unwinder searches in a few bounded steps.
//! `reference` is the same unwinder in userspace, which the tests run on stopped processes.

mod index;
mod kernel;
mod reference;
mod rows;
#[cfg(test)]
mod tests;

#[allow(unused_imports)] // the BPF loader and unwinder will use these
pub use index::{lookup, UnwindTable};
pub use kernel::KernelTables;
#[allow(unused_imports)] // the BPF loader and unwinder will use these
pub use reference::{step, Memory, ProcessMemory, ProcessTables, Registers, StepSource, StopReason, Walk};
#[allow(unused_imports)] // the BPF loader and unwinder will use these
pub use rows::{BuildStats, MAX_ROWS};

use std::{fs::File, path::Path};

use anyhow::{Context, Result};

/// Builds the indexed unwind table of an ELF file held in memory.
pub fn build_table(data: &[u8]) -> Result<(UnwindTable, BuildStats)> {
    let (rows, stats) = rows::build_rows(data)?;
    Ok((UnwindTable::new(rows), stats))
}

/// Builds the indexed unwind table of an ELF file on disk, reading only its headers and its CFI
/// sections (a 100 MB binary is not read whole for its .eh_frame).
pub fn table_of_file(path: &Path) -> Result<(UnwindTable, BuildStats)> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let cache = object::ReadCache::new(file);
    let (rows, stats) =
        rows::build_rows(&cache).with_context(|| format!("no unwind table for {}", path.display()))?;
    Ok((UnwindTable::new(rows), stats))
}
