//! The kernel's stack tables, emptied into memtrace at every sample so that they never fill on a
//! long run: each stack's frames (STACKS) are taken out once and kept here, and the totals of each
//! (process, stack) with nothing live (STACK_TOTALS) are taken out as they stand and added to
//! what is kept here. A stack that allocates again starts afresh in the kernel, and its figures
//! add to the kept ones; a stack with live blocks stays in the kernel, where frees find it.
//!
//! An entry is taken only once it has stood idle and unchanged from one sample to the next. A run
//! holds an entry by pointer between its lookup (or its creation, zeroed) and its counts, and on a
//! preemptible kernel it can be preempted there: an entry taken meanwhile is freed to the next
//! insert, for another stack, and the run's counts would land in that stack's totals (a new entry
//! is zero, so idle, until its creator's first count).

use std::collections::{HashMap, HashSet};

use anyhow::Result;
use memtrace_common::{StackKey, StackTotals};

use crate::kernel::{Probes, Stack, Taken};

#[derive(Default)]
pub struct StackTable {
    /// Every stack's frames, by key, once taken out of the kernel.
    frames: HashMap<u64, Stack>,
    /// The totals taken out of the kernel, per (process, stack), of the process's current image.
    kept: HashMap<StackKey, StackTotals>,
    /// The kernel's idle entries as the last drain read them: taken at this one if unchanged.
    idle: HashMap<StackKey, StackTotals>,
}

impl StackTable {
    /// Takes what the kernel's tables can give up. `image_start` says when a process's current
    /// program image started (it exec'd): totals from before are not its own. Returns the totals
    /// left in the kernel (those with live blocks), as they were read.
    pub fn drain(
        &mut self,
        probes: &Probes,
        image_start: impl Fn(u32) -> Option<u64>,
    ) -> Result<Vec<(StackKey, StackTotals)>> {
        for (key, frames) in probes.take_stacks()? {
            self.frames.entry(key).or_insert(frames);
        }
        let settled = |key: &StackKey, totals: &StackTotals| self.idle.get(key) == Some(totals);
        let Taken { taken, left } = probes.take_idle_stack_totals(settled)?;
        let (idle, live): (Vec<_>, Vec<_>) =
            left.into_iter().partition(|(_, totals)| totals.live_allocations == 0);
        self.idle = idle.into_iter().collect();
        for (key, taken) in taken {
            let start = image_start(key.tgid).unwrap_or(0);
            match self.kept.get_mut(&key) {
                Some(kept) if kept.started_ns >= start => add(kept, &taken),
                _ => {
                    self.kept.insert(key, taken);
                }
            }
        }
        Ok(live)
    }

    /// Every (process, stack)'s totals since its current image started: what was taken out, plus
    /// what the kernel holds now. A process `image_start` does not know is left out.
    pub fn totals(
        &self,
        probes: &Probes,
        image_start: impl Fn(u32) -> Option<u64>,
    ) -> Result<HashMap<StackKey, StackTotals>> {
        let current = |key: &StackKey, totals: &StackTotals| {
            image_start(key.tgid).is_some_and(|start| totals.started_ns >= start)
        };
        let mut all: HashMap<StackKey, StackTotals> =
            self.kept.iter().filter(|(key, totals)| current(key, totals)).map(|(k, t)| (*k, *t)).collect();
        for (key, totals) in probes.stack_totals()?.into_iter().filter(|(key, totals)| current(key, totals)) {
            match all.get_mut(&key) {
                Some(sum) => add(sum, &totals),
                None => {
                    all.insert(key, totals);
                }
            }
        }
        Ok(all)
    }

    /// A stack's frames, wherever they are now.
    pub fn frames(&self, probes: &Probes, stack: u64) -> Result<Option<Stack>> {
        match self.frames.get(&stack) {
            Some(frames) => Ok(Some(frames.clone())),
            None => probes.stack(stack),
        }
    }

    /// Forgets the processes `tgids` (reported and released), and the frames no one else's
    /// figures name: memtrace's memory stays bounded over a long run.
    pub fn forget(&mut self, probes: &Probes, tgids: &HashSet<u32>) -> Result<()> {
        self.kept.retain(|key, _| !tgids.contains(&key.tgid));
        let mut named: HashSet<u64> = self.kept.keys().map(|key| key.stack).collect();
        named.extend(probes.stack_totals()?.into_iter().map(|(key, _)| key.stack));
        self.frames.retain(|stack, _| named.contains(stack));
        Ok(())
    }
}

/// Adds the figures of `more` to `sum`, which starts with the earlier of the two: every figure, so
/// that totals taken apart (out of the kernel, or cut short) and put together again add up.
pub(super) fn add(sum: &mut StackTotals, more: &StackTotals) {
    sum.started_ns = sum.started_ns.min(more.started_ns);
    sum.allocations += more.allocations;
    sum.allocated_bytes += more.allocated_bytes;
    sum.live_allocations += more.live_allocations;
    sum.live_bytes += more.live_bytes;
    sum.temporary_allocations += more.temporary_allocations;
    sum.temporary_bytes += more.temporary_bytes;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_taken_out_and_left_in_add_up() {
        let mut sum =
            StackTotals { started_ns: 100, allocations: 5, allocated_bytes: 50, ..StackTotals::default() };
        // The stack allocated again after its entry was taken out: a new kernel entry, from 0.
        let later = StackTotals {
            started_ns: 200,
            allocations: 2,
            allocated_bytes: 20,
            live_allocations: 1,
            live_bytes: 10,
            temporary_allocations: 1,
            temporary_bytes: 4,
        };
        add(&mut sum, &later);
        assert_eq!(
            sum,
            StackTotals {
                started_ns: 100,
                allocations: 7,
                allocated_bytes: 70,
                live_allocations: 1,
                live_bytes: 10,
                temporary_allocations: 1,
                temporary_bytes: 4,
            }
        );
    }
}
