//! Exits the kernel did not show memtrace: on a preemptible kernel a task can exit while another
//! task's exit is under way in process_exit on the same CPU, and the kernel then skips the program
//! for it (its recursion guard). Whenever the count of such skipped runs grows, what process_exit
//! would have done is done from /proc: the slots of threads that are gone are freed, and a traced
//! process that has ended without the kernel marking it exited is marked so here. Its figures are
//! whole (every allocator call was seen); its memory levels at exit were not recorded, so each
//! such process counts as one lost event.

use std::collections::HashSet;

use anyhow::Result;

use crate::{kernel::Probes, model::Model, process::procfs};

#[derive(Default)]
pub struct SkippedExits {
    /// Skipped runs of process_exit seen so far.
    seen: u64,
    /// Traced processes whose exit the kernel skipped.
    recovered: HashSet<u32>,
}

impl SkippedExits {
    /// Does what the exits skipped since the last call left undone; `skipped` is how many runs of
    /// process_exit the kernel has skipped so far.
    pub fn recover(&mut self, probes: &Probes, skipped: u64, model: &mut Model) -> Result<()> {
        if skipped == self.seen {
            return Ok(());
        }
        self.seen = skipped;
        probes.free_slots_of_gone_threads(procfs::has_ended)?;
        // A launched command or --pid target may be marked exited already (its pidfd said so);
        // its levels at exit went unrecorded all the same.
        for process in model.processes.values_mut().filter(|p| !p.released) {
            // /proc first: process_exit runs before a process becomes a zombie, so one that has
            // ended by now and whose exit the kernel has not marked was skipped.
            if !self.recovered.contains(&process.identity.pid)
                && procfs::has_ended(process.identity.pid)
                && probes.saw_exit(process.identity.pid)? == Some(false)
            {
                process.exited = true;
                self.recovered.insert(process.identity.pid);
            }
        }
        Ok(())
    }

    /// Traced processes whose exit the kernel skipped: an event lost each.
    pub fn lost(&self) -> u64 {
        self.recovered.len() as u64
    }
}
