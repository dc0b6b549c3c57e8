//! The kernel's per-process figures (`PROCESS_SLOTS`, memtrace-ebpf/src/processes.rs), read through
//! a shared mapping of the array: every slot at each interval without a system call. The kernel
//! updates the figures while they are read; a read sees each counter whole (aligned u64s), as a
//! map lookup's copy does.

use std::{
    os::fd::{AsFd, AsRawFd},
    ptr::{read_volatile, write_volatile},
    sync::atomic::{fence, Ordering},
};

use anyhow::{bail, Context, Result};
use aya::maps::Map;
use memmap2::{MmapOptions, MmapRaw};
use memtrace_common::{ProcessSlot, ProcessStats, MAX_PROCESSES, PROCESS_SLOT_PROBES};

/// The name the BPF object gives the array.
pub const PROCESS_SLOTS_MAP: &str = "PROCESS_SLOTS";

pub struct ProcessSlots {
    mapping: MmapRaw,
}

impl ProcessSlots {
    /// Maps the kernel's array.
    pub fn new(map: &Map) -> Result<Self> {
        let Map::Array(data) = map else {
            bail!("the BPF map {PROCESS_SLOTS_MAP} is not an array");
        };
        let length = MAX_PROCESSES as usize * size_of::<ProcessSlot>();
        let mapping = MmapOptions::new()
            .len(length)
            .map_raw(data.fd().as_fd().as_raw_fd())
            .with_context(|| format!("mapping the kernel's {PROCESS_SLOTS_MAP} array"))?;
        Ok(Self { mapping })
    }

    fn slot(&self, index: usize) -> *mut ProcessSlot {
        debug_assert!(index < MAX_PROCESSES as usize);
        // The array's values are ProcessSlots back to back (a multiple of 8 bytes each, as the
        // kernel lays out an array's values), from the start of the page-aligned mapping.
        self.mapping.as_mut_ptr().wrapping_add(index * size_of::<ProcessSlot>()).cast()
    }

    fn read(&self, index: usize) -> ProcessSlot {
        // SAFETY: index < MAX_PROCESSES, so the slot lies inside the mapping, which lives as long
        // as self; aligned (a multiple of 8 from a page); every bit pattern is a ProcessSlot.
        unsafe { read_volatile(self.slot(index)) }
    }

    /// Every process with a slot, and its figures.
    pub fn held(&self) -> Vec<(u32, ProcessStats)> {
        (0..MAX_PROCESSES as usize)
            .map(|index| self.read(index))
            .filter(|slot| slot.tgid != 0)
            .map(|slot| (slot.tgid as u32, slot.stats))
            .collect()
    }

    /// The index of the slot `tgid` holds, as the kernel finds it.
    fn index_of(&self, tgid: u32) -> Option<usize> {
        (0..PROCESS_SLOT_PROBES)
            .map(|probe| (tgid.wrapping_add(probe) % MAX_PROCESSES) as usize)
            .find(|&index| self.read(index).tgid == u64::from(tgid))
    }

    /// A process's figures, if it has a slot.
    pub fn stats(&self, tgid: u32) -> Option<ProcessStats> {
        self.index_of(tgid).map(|index| self.read(index).stats)
    }

    /// Frees a process's slot: its figures zeroed, then its tag, so that the kernel's next taker
    /// finds a zeroed slot.
    pub fn release(&self, tgid: u32) {
        let Some(index) = self.index_of(tgid) else { return };
        let slot = self.slot(index);
        // SAFETY: as in `read`; the kernel uses a slot only while its tag names a process, and
        // this one's process has exited.
        unsafe {
            write_volatile(&raw mut (*slot).stats, ProcessStats::default());
            fence(Ordering::Release);
            write_volatile(&raw mut (*slot).tgid, 0);
        }
    }

    /// Slots held.
    pub fn count(&self) -> usize {
        (0..MAX_PROCESSES as usize).filter(|&index| self.read(index).tgid != 0).count()
    }
}
