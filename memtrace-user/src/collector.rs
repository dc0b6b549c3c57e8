//! Reads the kernel's maps and /proc into the model, for every process at one moment.

use anyhow::Result;

use crate::{model::Model, probes::Probes, procfs};

pub fn sample(probes: &Probes, model: &mut Model) -> Result<()> {
    for process in model.processes.values_mut() {
        process.stats = probes.stats(process.pid)?;
        if process.exited {
            continue;
        }
        // The process may exit between the reads; keep what was last seen.
        if let Some(rss) = procfs::rss_bytes(process.pid) {
            process.rss_bytes = rss;
        }
        if let Some(comm) = procfs::comm(process.pid) {
            process.comm = comm;
        }
    }
    model.unattributed_lost_events = probes.unattributed_lost_events()?;
    Ok(())
}
