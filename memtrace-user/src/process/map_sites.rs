//! The C library's mapping calls (mmap, munmap, mremap), and the calls that load a library
//! (dlopen, dlmopen), in one ELF file, as file offsets with their probe points (probe_point): read
//! once per file by the file cache; which file a process maps through is the map_calls module's.

use anyhow::{Context, Result};
use memtrace_common::{ArgumentsRead, MapFunction};

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

/// The C library's calls that load a library and return its handle: a traced process is held at
/// their return until the library's unwind table is in.
pub const LIBRARY_LOADS: [&str; 2] = ["dlopen", "dlmopen"];

/// A call that loads a library (`LIBRARY_LOADS`), located in its file: only its return is probed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadSite {
    pub function: &'static str,
    /// File offset of the function's first instruction.
    pub offset: u64,
    /// Where its return probe sits (the return address still at the top of the stack).
    pub probe: ProbePoint,
}

impl LoadSite {
    /// File offset of the probe.
    pub fn probe_offset(&self) -> u64 {
        self.offset + self.probe.delta
    }
}

/// Locates the calls of `LIBRARY_LOADS` an ELF file defines (glibc 2.34 and later define them in
/// libc itself; older ones in libdl).
pub fn resolve_library_loads(elf: &ElfObject<'_>) -> Result<Vec<LoadSite>> {
    let defined = elf.defined_functions(|name| LIBRARY_LOADS.iter().any(|symbol| symbol.as_bytes() == name));
    let mut sites = Vec::new();
    for function in LIBRARY_LOADS {
        let Some(defined) = defined.iter().find(|defined| defined.name == function) else { continue };
        let address = defined.address;
        let offset = elf
            .code_file_offset(address)
            .with_context(|| format!("{function} at {address:#x} lies in no executable segment"))?;
        // A return probe reads no argument: it only needs the return address where it sits.
        let probe = probe_point::place(&elf.function_code(defined), address, ArgumentsRead::wide(0));
        sites.push(LoadSite { function, offset, probe });
    }
    Ok(sites)
}
