//! The C library's mapping calls (mmap, munmap, mremap) in one ELF file, as file offsets with
//! their probe points (probe_point): read
//! once per file by the file cache; which file a process maps through is the map_calls module's.

use anyhow::{Context, Result};
use memtrace_common::MapFunction;

use crate::process::{
    elf::ElfObject,
    probe_point::{self, ProbePoint},
};

/// A mapping call located in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapSite {
    pub function: MapFunction,
    /// File offset of the function's first instruction.
    pub offset: u64,
    /// Where both its probes sit.
    pub probe: ProbePoint,
}

impl MapSite {
    /// File offset of the probes.
    pub fn probe_offset(&self) -> u64 {
        self.offset + self.probe.delta
    }
}

/// Locates every mapping call an ELF file defines (as functions: a file that only imports them
/// has none).
pub fn resolve_map_sites(elf: &ElfObject<'_>) -> Result<Vec<MapSite>> {
    let defined =
        elf.defined_functions(|name| MapFunction::ALL.iter().any(|(_, symbol)| symbol.as_bytes() == name));
    let mut sites = Vec::new();
    for (function, symbol) in MapFunction::ALL {
        let Some(defined) = defined.iter().find(|defined| defined.name == symbol) else { continue };
        let address = defined.address;
        let offset = elf
            .code_file_offset(address)
            .with_context(|| format!("{symbol} at {address:#x} lies in no executable segment"))?;
        let probe = probe_point::place(&elf.function_code(defined), address, function.arguments());
        sites.push(MapSite { function, offset, probe });
    }
    Ok(sites)
}
