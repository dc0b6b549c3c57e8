//! The kernel's USDT tables (memtrace-ebpf/src/usdt.rs): the site specs written before a site is
//! attached, and the figures read back at every sample, one typed operation each, so that no code
//! outside kernel/ reads or writes a map by its name.

use anyhow::{Context, Result};
use aya::Ebpf;
use memtrace_common::{
    DumpRound, SubsystemKey, SubsystemValue, UsdtCounterKey, UsdtCounterValue, UsdtSpec, USDT_LOST_SLOT,
};

use super::{
    tables::{DUMP_ROUNDS, SUBSYSTEMS, USDT_COUNTERS, USDT_LOST_EVENTS, USDT_SPECS},
    Probes,
};

/// The USDT figures the kernel holds; empty while no site is attached (the maps are then never
/// read).
pub struct UsdtFigures<'a> {
    ebpf: &'a Ebpf,
    written: bool,
}

impl Probes {
    pub fn usdt_figures(&self) -> UsdtFigures<'_> {
        UsdtFigures { ebpf: &self.ebpf, written: self.usdt_written() }
    }

    /// Writes the spec of a use of a USDT site at `index` of `USDT_SPECS`.
    pub fn set_usdt_spec(&mut self, index: u32, spec: &UsdtSpec) -> Result<()> {
        USDT_SPECS.set(&mut self.ebpf, index, spec).context("writing a USDT site's spec")
    }
}

impl UsdtFigures<'_> {
    /// Each process's registered subsystems' figures.
    pub fn subsystems(&self) -> Result<Vec<(SubsystemKey, SubsystemValue)>> {
        self.entries(|ebpf| SUBSYSTEMS.entries(ebpf))
    }

    /// The dump rounds under way or done, by process.
    pub fn dump_rounds(&self) -> Result<Vec<(u64, DumpRound)>> {
        self.entries(|ebpf| DUMP_ROUNDS.entries(ebpf))
    }

    /// The `--usdt` counters, by process and counter.
    pub fn counters(&self) -> Result<Vec<(UsdtCounterKey, UsdtCounterValue)>> {
        self.entries(|ebpf| USDT_COUNTERS.entries(ebpf))
    }

    /// USDT events the kernel could not record.
    pub fn lost_events(&self) -> Result<u64> {
        USDT_LOST_EVENTS.get(self.ebpf, USDT_LOST_SLOT)
    }

    /// Entries in all three maps, for the maps' occupancy.
    pub fn len(&self) -> Result<usize> {
        Ok(self.subsystems()?.len() + self.counters()?.len() + self.dump_rounds()?.len())
    }

    fn entries<K, V>(&self, read: impl FnOnce(&Ebpf) -> Result<Vec<(K, V)>>) -> Result<Vec<(K, V)>> {
        match self.written {
            true => read(self.ebpf),
            false => Ok(Vec::new()),
        }
    }
}
