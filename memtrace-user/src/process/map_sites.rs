//! The C library's mapping calls (mmap, munmap, mremap) in one ELF file, as file offsets: read
//! once per file by the file cache; which file a process maps through is the map_calls module's.

use anyhow::{Context, Result};
use memtrace_common::MapFunction;

use crate::process::elf::ElfObject;

/// A mapping call located in its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapSite {
    pub function: MapFunction,
    /// File offset of the function's first instruction: where both probes sit.
    pub offset: u64,
}

/// Locates every mapping call an ELF file defines (as functions: a file that only imports them
/// has none).
pub fn resolve_map_sites(elf: &ElfObject<'_>) -> Result<Vec<MapSite>> {
    let defined =
        elf.defined_functions(|name| MapFunction::ALL.iter().any(|(_, symbol)| symbol.as_bytes() == name));
    let mut sites = Vec::new();
    for (function, symbol) in MapFunction::ALL {
        let Some(&(_, address)) = defined.iter().find(|(name, _)| name == symbol) else { continue };
        let offset = elf
            .code_file_offset(address)
            .with_context(|| format!("{symbol} at {address:#x} lies in no executable segment"))?;
        sites.push(MapSite { function, offset });
    }
    Ok(sites)
}
