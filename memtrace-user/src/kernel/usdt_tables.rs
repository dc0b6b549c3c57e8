//! The kernel's USDT tables (memtrace-ebpf/src/usdt.rs): the site specs written before a site is
//! attached, and the figures read back at every sample, one typed operation each, so that no code
//! outside kernel/ reads or writes a map by its name.

use std::path::Path;

use anyhow::{Context, Result};
use aya::Ebpf;
use memtrace_common::{
    DumpRound, SubsystemKey, SubsystemValue, UsdtCounterKey, UsdtCounterValue, UsdtSpec, USDT_LOST_SLOT,
};

use super::{
    links::{Direction, Scope, Site},
    tables::{DUMP_ROUNDS, SUBSYSTEMS, USDT_COUNTERS, USDT_LOST_EVENTS, USDT_SPECS},
    Probes, SAMPLED_SITE, USDT_SITE,
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

    /// Attaches the USDT handler at `sites` of one file, each site's cookie indexing its uses in
    /// `USDT_SPECS`.
    pub fn attach_usdt_sites(&mut self, path: &Path, sites: &[Site], scope: Scope) -> Result<()> {
        if sites.is_empty() {
            return Ok(());
        }
        self.attach_sites(USDT_SITE, path, sites, scope, Direction::Entry)?;
        self.usdt_sites += sites.len();
        Ok(())
    }

    /// Attaches the handler of the allocator's sampled probes at `sites` of one file (each
    /// site's cookie indexes its spec in `USDT_SPECS`).
    pub fn attach_sampled_sites(&mut self, path: &Path, sites: &[Site], scope: Scope) -> Result<()> {
        if sites.is_empty() {
            return Ok(());
        }
        self.attach_sites(SAMPLED_SITE, path, sites, scope, Direction::Entry)?;
        self.sampled_sites += sites.len();
        Ok(())
    }

    /// How many of the allocator's sampled probe sites are attached (`--app-sampled`).
    pub fn sampled_sites(&self) -> usize {
        self.sampled_sites
    }

    /// How many USDT probe sites are attached (one probe per site, whatever it is used for).
    pub fn usdt_sites(&self) -> usize {
        self.usdt_sites
    }

    /// Whether the USDT maps may hold anything: only the programs on attached sites write them. An
    /// empty map's read still walks its 16,384 buckets, at every refresh and sample.
    pub(super) fn usdt_written(&self) -> bool {
        self.usdt_sites > 0
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
