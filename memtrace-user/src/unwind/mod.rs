//! Unwind tables for stacks without frame pointers: each object file's .eh_frame and .debug_frame
//! become compact rows (`memtrace_common::UnwindRow`, 8 bytes) under a two-level index
//! (`memtrace_common::UnwindTableInfo`) that the BPF unwinder searches in a few bounded steps.
//! `reference` is the same unwinder in userspace, which the tests run on stopped processes.

mod index;
mod reference;
mod rows;
#[cfg(test)]
mod tests;

#[allow(unused_imports)]
pub use index::{lookup, UnwindTable};
#[allow(unused_imports)]
pub use reference::{step, Memory, ProcessMemory, ProcessTables, Registers, StepSource, StopReason, Walk};
#[allow(unused_imports)]
pub use rows::{BuildStats, MAX_ROWS};

/// Builds the indexed unwind table of an ELF file held in memory.
#[allow(dead_code)]
pub fn build_table(data: &[u8]) -> anyhow::Result<(UnwindTable, BuildStats)> {
    let (rows, stats) = rows::build_rows(data)?;
    Ok((UnwindTable::new(rows), stats))
}
