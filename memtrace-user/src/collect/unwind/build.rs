//! Building a file's indexed unwind table: its CFI rows (rows.rs) under the page index (index.rs).

use std::{fs::File, path::Path};

use anyhow::{Context, Result};

use super::{
    index::UnwindTable,
    rows::{self, BuildStats},
    rules::Arch,
};

/// Builds the indexed unwind table of an ELF file held in memory (the tests' files and fuzzed copies).
#[cfg(test)]
pub fn build_table(data: &[u8]) -> Result<(UnwindTable, BuildStats)> {
    let (rows, stats) = rows::build_rows(data, None)?;
    Ok((UnwindTable::new(rows), stats))
}

/// Builds the indexed unwind table of an ELF file on disk, reading only its headers and its CFI
/// sections (a 100 MB binary is not read whole for its .eh_frame). Only a file of the architecture
/// memtrace runs on has one: the BPF side steps that architecture's rules.
pub fn table_of_file(path: &Path) -> Result<(UnwindTable, BuildStats)> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let cache = object::ReadCache::new(file);
    let (rows, stats) = rows::build_rows(&cache, Arch::native())
        .with_context(|| format!("no unwind table for {}", path.display()))?;
    Ok((UnwindTable::new(rows), stats))
}
