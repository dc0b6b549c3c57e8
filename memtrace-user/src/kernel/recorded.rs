//! What the probes recorded, read out of the kernel: live allocations, anonymous regions, the
//! totals and frames of each call stack (the interpreter names the kernel copied:
//! interpreter_tables.rs).

use anyhow::Result;
use memtrace_common::{Allocation, AllocationKey, Region, RegionKey, StackKey, StackTotals};

use super::{tables, Probes, Stack, Taken};

impl Probes {
    /// Every live allocation the kernel knows, of every traced process.
    pub fn live_allocations(&self) -> Result<Vec<(AllocationKey, Allocation)>> {
        self.live.records()
    }

    /// Every anonymous mapping the probes follow, of every process, with who made it.
    pub fn regions(&self) -> Result<Vec<(RegionKey, Region)>> {
        tables::REGIONS.entries(&self.ebpf)
    }

    /// What each (process, call stack) allocated and still holds.
    pub fn stack_totals(&self) -> Result<Vec<(StackKey, StackTotals)>> {
        tables::STACK_TOTALS.entries(&self.ebpf)
    }

    /// Takes every stack's frames out of the kernel's tables (shallow and deep), which then never
    /// fill: a stack seen again is written again, and found here again.
    pub fn take_stacks(&self) -> Result<Vec<(u64, Stack)>> {
        let shallow = tables::STACKS.take(&self.ebpf, |_, _| true)?.taken;
        let deep = tables::DEEP_STACKS.take(&self.ebpf, |_, _| true)?.taken;
        let shallow = shallow.into_iter().map(|(key, frames)| (key, Stack::new(&frames.frames)));
        Ok(shallow.chain(deep.into_iter().map(|(key, frames)| (key, Stack::new(&frames.frames)))).collect())
    }

    /// Takes out the totals of every (process, stack) with nothing live that `settled` allows: an
    /// allocation from it later starts a new entry, whose figures add to these. The others stay,
    /// and are returned as they were read.
    pub fn take_idle_stack_totals(
        &self,
        settled: impl Fn(&StackKey, &StackTotals) -> bool,
    ) -> Result<Taken<StackKey, StackTotals>> {
        tables::STACK_TOTALS
            .take(&self.ebpf, |key, totals| totals.live_allocations == 0 && settled(key, totals))
    }

    /// A stack's frames, from whichever of the kernel's tables holds it.
    pub fn stack(&self, stack: u64) -> Result<Option<Stack>> {
        if let Some(frames) = tables::STACKS.get(&self.ebpf, &stack)? {
            return Ok(Some(Stack::new(&frames.frames)));
        }
        Ok(tables::DEEP_STACKS.get(&self.ebpf, &stack)?.map(|frames| Stack::new(&frames.frames)))
    }
}
