//! Reading the USDT handler's maps at every sample: subsystem totals (as of each process's last
//! complete dump round, `rounds`) and `--usdt` counters into the model (releasing what exited
//! processes left there is the kernel side's, `Probes::release`).

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;
use memtrace_common::{SubsystemKey, SubsystemValue};

use super::{request::UsdtRequest, rounds::Rounds};
use crate::{
    kernel::Probes,
    model::{Model, UsdtProbeCounter},
};

/// Reads of the subsystems a sample makes at most while dump rounds overtake them (see `rounds`);
/// the last is taken as it is.
const SUBSYSTEM_READS: usize = 3;

/// Reads every subsystem and `--usdt` counter (of `requests`, by index) of every process, in one
/// pass over each map. Every requested counter shows in every process, unless `system_wide`.
pub(super) fn collect(
    probes: &Probes,
    requests: &[UsdtRequest],
    system_wide: bool,
    model: &mut Model,
) -> Result<()> {
    let mut subsystems: BTreeMap<u32, BTreeMap<String, i64>> = BTreeMap::new();
    let (entries, rounds) = read_subsystems(probes)?;
    for (key, value) in entries {
        if let Some(bytes) = rounds.value_of(key.tgid, &value) {
            subsystems.entry(key.tgid).or_default().insert(subsystem_name(&key.name), bytes);
        }
    }
    let mut counters: BTreeMap<u32, BTreeMap<String, UsdtProbeCounter>> = BTreeMap::new();
    for (key, value) in probes.usdt_figures().counters()? {
        let Some(request) = requests.get(key.counter as usize) else {
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
        for request in requests.iter().filter(|_| !system_wide) {
            figures
                .probes
                .entry(request.label.clone())
                .or_insert(UsdtProbeCounter { hits: 0, value: request.argument.map(|_| 0) });
        }
        if let Some(counters) = counters.remove(pid) {
            figures.probes.extend(counters);
        }
    }
    model.usdt_lost_events = probes.usdt_figures().lost_events()?;
    Ok(())
}

/// Every subsystem entry, with the dump rounds read around it: read again while rounds overtake
/// the read (`Rounds::steady`). Without rounds there is nothing to check.
fn read_subsystems(probes: &Probes) -> Result<(Vec<(SubsystemKey, SubsystemValue)>, Rounds)> {
    let mut reads = 0;
    loop {
        let figures = probes.usdt_figures();
        let before = figures.dump_rounds()?;
        let entries = figures.subsystems()?;
        if before.is_empty() {
            // A round that began meanwhile is not complete: none of its values shows.
            return Ok((entries, Rounds::default()));
        }
        let rounds = Rounds::new(before, figures.dump_rounds()?);
        reads += 1;
        if rounds.steady() || reads == SUBSYSTEM_READS {
            return Ok((entries, rounds));
        }
    }
}

/// The processes the kernel has USDT figures for (subsystems or `--usdt` counters).
pub fn reporting_processes(probes: &Probes) -> Result<BTreeSet<u32>> {
    let mut tgids = BTreeSet::new();
    let figures = probes.usdt_figures();
    tgids.extend(figures.subsystems()?.into_iter().map(|(key, _)| key.tgid));
    tgids.extend(figures.counters()?.into_iter().map(|(key, _)| key.tgid));
    Ok(tgids)
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
