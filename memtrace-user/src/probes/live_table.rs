//! The kernel's live-allocation table as userspace sees it: the BPF array of `LiveSlot`s and its
//! record count, mapped into memtrace's memory. Reading every record is a pass over memory, not a
//! syscall per entry; releasing an exited process's records moves their tags to TOMBSTONE with
//! the same compare-and-exchange the probes use (memtrace-ebpf/src/live.rs), so a probe that
//! records into the table at that moment is never overwritten.

use std::{
    collections::HashSet,
    os::fd::AsFd,
    sync::atomic::{fence, AtomicU64, Ordering},
};

use anyhow::{bail, Context, Result};
use aya::maps::Map;
use memmap2::{MmapOptions, MmapRaw};
use memtrace_common::{live_table_slots, Allocation, AllocationKey, LiveSlot, LiveTag};

/// The BPF maps, as memtrace-ebpf/src/live.rs names them.
pub const SLOTS_MAP: &str = "ALLOCATIONS";
pub const COUNT_MAP: &str = "LIVE_RECORDS";

pub struct LiveTable {
    slots: MmapRaw,
    slot_count: usize,
    count: MmapRaw,
}

impl LiveTable {
    /// Maps the table the loader sized for `max_allocations` records, and its count.
    pub fn map(slots: &Map, count: &Map, max_allocations: u32) -> Result<Self> {
        let slot_count = live_table_slots(max_allocations) as usize;
        Ok(Self {
            slots: map_array(slots, SLOTS_MAP, slot_count * size_of::<LiveSlot>())?,
            slot_count,
            count: map_array(count, COUNT_MAP, size_of::<u64>())?,
        })
    }

    fn tag(&self, index: usize) -> &AtomicU64 {
        assert!(index < self.slot_count);
        // SAFETY: in bounds (above) of a mapping that lives as long as self; the tag is the slot's
        // first field, 8-byte aligned (the mapping is page aligned, slots are 48 bytes), and the
        // kernel side changes it only atomically.
        unsafe { AtomicU64::from_ptr(self.slots.as_mut_ptr().cast::<LiveSlot>().add(index).cast()) }
    }

    /// A copy of the slot's record, if it holds one that stayed the same while it was read.
    fn record(&self, index: usize) -> Option<(u64, AllocationKey, Allocation)> {
        let tag = self.tag(index).load(Ordering::Acquire);
        if !LiveTag::is_record(tag) {
            return None;
        }
        // SAFETY: in bounds (tag() checked the index); a volatile copy of plain integers, which a
        // probe may be rewriting: the tag read again below says whether the copy is whole.
        let slot = unsafe { self.slots.as_ptr().cast::<LiveSlot>().add(index).read_volatile() };
        fence(Ordering::Acquire);
        (self.tag(index).load(Ordering::Relaxed) == tag).then_some((tag, slot.key, slot.allocation))
    }

    /// Every record in the table.
    pub fn records(&self) -> Vec<(AllocationKey, Allocation)> {
        (0..self.slot_count).filter_map(|index| self.record(index)).map(|(_, key, a)| (key, a)).collect()
    }

    /// Gives up the records of `tgids` (processes that exited); returns how many.
    pub fn release(&self, tgids: &HashSet<u32>) -> usize {
        if tgids.is_empty() {
            return 0;
        }
        let mut released = 0;
        for index in 0..self.slot_count {
            let Some((tag, key, _)) = self.record(index).filter(|(_, key, _)| tgids.contains(&key.tgid))
            else {
                continue;
            };
            let exchanged = self.tag(index).compare_exchange(
                tag,
                LiveTag::TOMBSTONE,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
            if exchanged.is_ok() {
                debug_assert!(tgids.contains(&key.tgid));
                self.count().fetch_sub(1, Ordering::AcqRel);
                released += 1;
            }
        }
        released
    }

    fn count(&self) -> &AtomicU64 {
        // SAFETY: the count map's one u64 value, at the start of its page-aligned mapping.
        unsafe { AtomicU64::from_ptr(self.count.as_mut_ptr().cast()) }
    }

    /// How many records the table holds.
    pub fn len(&self) -> usize {
        self.count().load(Ordering::Relaxed) as usize
    }
}

/// Maps the values of a BPF array made with BPF_F_MMAPABLE, shared with the kernel.
fn map_array(map: &Map, name: &str, bytes: usize) -> Result<MmapRaw> {
    let Map::Array(data) = map else {
        bail!("the BPF map {name} is not an array");
    };
    let fd =
        data.fd().as_fd().try_clone_to_owned().with_context(|| format!("duplicating the fd of {name}"))?;
    MmapOptions::new()
        .len(bytes)
        .map_raw(&fd)
        .with_context(|| format!("mapping the BPF map {name} ({bytes} bytes) into memory"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use memtrace_common::LIVE_WINDOW;

    #[test]
    fn tables_have_twice_the_slots_a_power_of_two_and_a_window_at_least() {
        assert_eq!(live_table_slots(1), 32);
        assert_eq!(live_table_slots(9), 32);
        assert_eq!(live_table_slots(17), 64);
        assert_eq!(live_table_slots(1 << 20), 1 << 21);
        assert_eq!(live_table_slots(memtrace_common::MAX_LIVE_ALLOCATIONS_LIMIT), 1 << 28);
    }

    /// Where the probes would put each key (memtrace-ebpf/src/live.rs: the first free slot of its
    /// window), or None when the window is full.
    fn place(table: &mut [bool], tag: LiveTag) -> Option<usize> {
        let slots = table.len() as u32;
        (0..LIVE_WINDOW)
            .map(|step| (tag.home(slots) + step) as usize % table.len())
            .find(|&index| !table[index])
            .inspect(|&index| table[index] = true)
    }

    /// Heaps hand out 16-byte aligned blocks close together, and many processes the same
    /// addresses: at the highest load the count allows (one half), no window fills.
    #[test]
    fn keys_spread_so_that_a_half_full_table_has_room_in_every_window() {
        let slots = live_table_slots(1 << 16) as usize;
        let mut table = vec![false; slots];
        let keys = (0..8u32).flat_map(|tgid| {
            (0..1u64 << 13).map(move |block| AllocationKey {
                tgid: 1000 + tgid,
                _pad: 0,
                address: 0x5555_0000_0000 + block * 16,
            })
        });
        for key in keys {
            let tag = LiveTag::of(&key);
            assert!(LiveTag::is_record(tag.0), "{key:?}: a tag must never be a slot state");
            assert!(place(&mut table, tag).is_some(), "{key:?}: its window is full");
        }
        assert_eq!(table.iter().filter(|&&taken| taken).count(), slots / 2);
    }
}
