//! Reading the USDT handler's maps at every sample: subsystem totals and `--usdt` counters into the
//! model, and releasing what exited processes left there.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use anyhow::Result;
use aya::maps::{Array, MapData};
use memtrace_common::USDT_LOST_SLOT;

use crate::{
    model::{Model, UsdtProbeCounter},
    probes::{
        tables::{Table, SUBSYSTEMS, USDT_COUNTERS},
        Probes,
    },
};

/// Reads every subsystem and `--usdt` counter of every process, in one pass over each map.
pub fn collect(probes: &Probes, model: &mut Model) -> Result<()> {
    let mut subsystems: BTreeMap<u32, BTreeMap<String, i64>> = BTreeMap::new();
    for (key, value) in entries(probes, &SUBSYSTEMS)? {
        subsystems.entry(key.tgid).or_default().insert(subsystem_name(&key.name), value);
    }
    let mut counters: BTreeMap<u32, BTreeMap<String, UsdtProbeCounter>> = BTreeMap::new();
    for (key, value) in entries(probes, &USDT_COUNTERS)? {
        let Some(request) = probes.usdt.requests.get(key.counter as usize) else {
            continue;
        };
        counters.entry(key.tgid).or_default().insert(
            request.label.clone(),
            UsdtProbeCounter { hits: value.hits, value: request.argument.map(|_| value.value) },
        );
    }
    for (pid, process) in &mut model.processes {
        let figures = &mut process.usdt;
        if let Some(subsystems) = subsystems.remove(pid) {
            figures.subsystems = subsystems;
        }
        // Every requested counter shows, at 0 before the first hit; system-wide, only in the
        // processes that hit it.
        for request in probes.usdt.requests.iter().filter(|_| !probes.usdt.system_wide) {
            figures
                .probes
                .entry(request.label.clone())
                .or_insert(UsdtProbeCounter { hits: 0, value: request.argument.map(|_| 0) });
        }
        if let Some(counters) = counters.remove(pid) {
            figures.probes.extend(counters);
        }
    }
    let lost: Array<&MapData, u64> = Array::try_from(probes.map("USDT_LOST_EVENTS")?)?;
    model.usdt_lost_events = lost.get(&USDT_LOST_SLOT, 0)?;
    Ok(())
}

/// The processes the kernel has USDT figures for (subsystems or `--usdt` counters).
pub fn reporting_processes(probes: &Probes) -> Result<BTreeSet<u32>> {
    let mut tgids = BTreeSet::new();
    tgids.extend(entries(probes, &SUBSYSTEMS)?.into_iter().map(|(key, _)| key.tgid));
    tgids.extend(entries(probes, &USDT_COUNTERS)?.into_iter().map(|(key, _)| key.tgid));
    Ok(tgids)
}

/// Forgets the USDT figures of exited processes in the kernel, so the tables stay bounded.
pub fn release(probes: &mut Probes, tgids: &HashSet<u32>) -> Result<()> {
    if !written(probes) {
        return Ok(());
    }
    probes.release_entries(&SUBSYSTEMS, tgids, |key| key.tgid)?;
    probes.release_entries(&USDT_COUNTERS, tgids, |key| key.tgid)
}

/// Entries in the kernel's USDT tables (subsystems and `--usdt` counters).
pub fn occupancy(probes: &Probes) -> Result<usize> {
    Ok(entries(probes, &SUBSYSTEMS)?.len() + entries(probes, &USDT_COUNTERS)?.len())
}

/// Whether the USDT maps may hold anything: only the programs on attached sites write them. An
/// empty map's read still walks its 16,384 buckets, at every refresh and sample.
fn written(probes: &Probes) -> bool {
    probes.usdt.attached_sites() > 0
}

/// Every entry of a USDT map; none without a site ever attached.
fn entries<K: aya::Pod, V: aya::Pod>(probes: &Probes, table: &Table<K, V>) -> Result<Vec<(K, V)>> {
    if !written(probes) {
        return Ok(Vec::new());
    }
    probes.entries(table)
}

/// The name up to its NUL; a name that is not UTF-8 keeps its valid parts.
fn subsystem_name(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subsystem_names_stop_at_nul() {
        assert_eq!(subsystem_name(b"textures\0\0\0"), "textures");
        assert_eq!(subsystem_name(b"full"), "full");
        assert_eq!(subsystem_name(b"\0"), "");
    }
}
