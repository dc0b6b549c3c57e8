//! The kernel's live-allocation table as userspace sees it: the BPF array of `LiveSlot`s, mapped
//! into memtrace's memory a chunk at a time (so that its RSS does not carry the whole table), and
//! its record count, mapped for good. Reading every record is a pass over memory, not a syscall
//! per entry; releasing an exited process's records moves their tags to TOMBSTONE with the same
//! compare-and-exchange the probes use (memtrace-ebpf/src/live.rs), so a probe that records into
//! the table at that moment is never overwritten.

use std::{
    collections::HashSet,
    os::fd::{AsFd, OwnedFd},
    sync::atomic::{fence, AtomicU64, Ordering},
};

use anyhow::{Context, Result};
use aya::{maps::Map, EbpfLoader};
use memmap2::{MmapOptions, MmapRaw};
use memtrace_common::{live_table_slots, Allocation, AllocationKey, LiveSlot, LiveTag};

use super::tables::{LIVE_RECORDS, LIVE_SLOTS};

/// Slots mapped at once: 3 MiB, a whole number of pages (48-byte slots, 256 to 3 pages).
const CHUNK_SLOTS: usize = 1 << 16;

/// The table's size, as the loader sets it up: its slots, and the most records it takes.
pub struct TableSize {
    slots: u32,
    slot_mask: u64,
    records: u64,
}

impl TableSize {
    pub fn for_records(max_allocations: u32) -> Self {
        let slots = live_table_slots(max_allocations);
        Self { slots, slot_mask: u64::from(slots) - 1, records: u64::from(max_allocations) }
    }

    /// Sizes the array and sets the globals the probes size it by (memtrace-ebpf/src/live.rs).
    pub fn configure<'a>(&'a self, loader: &mut EbpfLoader<'a>) {
        loader
            .map_max_entries(LIVE_SLOTS.name, self.slots)
            .override_global("LIVE_SLOT_MASK", &self.slot_mask, true)
            .override_global("MAX_LIVE_RECORDS", &self.records, true);
    }

    pub fn records(&self) -> u32 {
        self.records as u32
    }

    /// The kernel memory the table takes.
    pub fn kernel_bytes(&self) -> u64 {
        u64::from(self.slots) * size_of::<LiveSlot>() as u64
    }
}

pub struct LiveTable {
    slots: OwnedFd,
    slot_count: usize,
    count: MmapRaw,
}

impl LiveTable {
    /// Opens the table the loader sized, and maps its count.
    pub fn open(slots: &Map, count: &Map, size: &TableSize) -> Result<Self> {
        Self::of_arrays(
            array_fd::<LiveSlot>(slots, LIVE_SLOTS.name)?,
            array_fd::<u64>(count, LIVE_RECORDS.name)?,
            size,
        )
    }

    fn of_arrays(slots: OwnedFd, count: OwnedFd, size: &TableSize) -> Result<Self> {
        Ok(Self {
            slots,
            slot_count: size.slots as usize,
            count: map_range(&count, LIVE_RECORDS.name, 0, size_of::<u64>())?,
        })
    }

    /// Every record in the table.
    pub fn records(&self) -> Result<Vec<(AllocationKey, Allocation)>> {
        let mut records = Vec::new();
        self.for_each_record(|_, record| records.push((record.key, record.allocation)))?;
        Ok(records)
    }

    /// Gives up the records of `tgids` (processes that exited); returns how many.
    pub fn release(&self, tgids: &HashSet<u32>) -> Result<usize> {
        if tgids.is_empty() {
            return Ok(0);
        }
        let mut released = 0;
        self.for_each_record(|tag, record| {
            if tgids.contains(&record.key.tgid)
                && tag
                    .compare_exchange(record.tag, LiveTag::TOMBSTONE, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            {
                self.count().fetch_sub(1, Ordering::AcqRel);
                released += 1;
            }
        })?;
        Ok(released)
    }

    /// How many records the table holds.
    pub fn len(&self) -> usize {
        self.count().load(Ordering::Relaxed) as usize
    }

    fn count(&self) -> &AtomicU64 {
        // SAFETY: the count map's one u64 value, at the start of its page-aligned mapping, which
        // lives as long as self; the probes change it only atomically.
        unsafe { AtomicU64::from_ptr(self.count.as_mut_ptr().cast()) }
    }

    /// Calls `visit` with each slot's tag word and its record, chunk by chunk.
    fn for_each_record(&self, mut visit: impl FnMut(&AtomicU64, LiveSlot)) -> Result<()> {
        for first in (0..self.slot_count).step_by(CHUNK_SLOTS) {
            let len = CHUNK_SLOTS.min(self.slot_count - first);
            let size = size_of::<LiveSlot>();
            let chunk = map_range(&self.slots, LIVE_SLOTS.name, first * size, len * size)?;
            let slots = chunk.as_mut_ptr().cast::<LiveSlot>();
            for index in 0..len {
                // SAFETY: slot `index` of the `len` slots `chunk` maps, which outlives the tag
                // reference (it is dropped at the end of this chunk).
                let (slot, tag) = unsafe { (slots.add(index), tag_of(slots.add(index))) };
                // SAFETY: as above.
                if let Some(record) = unsafe { read(slot, tag) } {
                    visit(tag, record);
                }
            }
        }
        Ok(())
    }
}

/// The tag word of a mapped slot.
///
/// # Safety
/// `slot` points to a slot of a live mapping of the table, which outlives the reference.
unsafe fn tag_of<'a>(slot: *mut LiveSlot) -> &'a AtomicU64 {
    // SAFETY: the tag is the slot's first field, 8-byte aligned (mappings are page aligned and
    // slots 48 bytes), and the probes change it only atomically.
    unsafe { AtomicU64::from_ptr(slot.cast()) }
}

/// A copy of the slot, if it holds a record that stayed the same while it was read.
///
/// # Safety
/// As for `tag_of`.
unsafe fn read(slot: *mut LiveSlot, tag: &AtomicU64) -> Option<LiveSlot> {
    let word = tag.load(Ordering::Acquire);
    if !LiveTag::is_record(word) {
        return None;
    }
    // SAFETY: a volatile copy of plain integers, which a probe may be rewriting: the tag read
    // again below says whether the copy is whole.
    let copy = unsafe { slot.read_volatile() };
    fence(Ordering::Acquire);
    (tag.load(Ordering::Relaxed) == word).then_some(LiveSlot { tag: word, ..copy })
}

/// The file descriptor of a BPF array of `V`s made with BPF_F_MMAPABLE, duplicated.
fn array_fd<V: aya::Pod>(map: &Map, name: &str) -> Result<OwnedFd> {
    let data = super::map_ops::array_of::<V>(map, name)?;
    data.fd().as_fd().try_clone_to_owned().with_context(|| format!("duplicating the fd of {name}"))
}

/// Maps `bytes` of an mmapable BPF array's values from `offset` (a multiple of the page size),
/// shared with the kernel.
fn map_range(fd: &OwnedFd, name: &str, offset: usize, bytes: usize) -> Result<MmapRaw> {
    MmapOptions::new()
        .offset(offset as u64)
        .len(bytes)
        .map_raw(fd)
        .with_context(|| format!("mapping {bytes} bytes of the BPF map {name} at {offset} into memory"))
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

    /// An mmapable BPF array, made directly (BPF_MAP_CREATE), as the loader makes the table's.
    fn mmapable_array(value_size: u32, entries: u32) -> OwnedFd {
        #[repr(C)]
        struct CreateAttr {
            map_type: u32,
            key_size: u32,
            value_size: u32,
            max_entries: u32,
            map_flags: u32,
        }
        const BPF_MAP_CREATE: libc::c_long = 0;
        const BPF_MAP_TYPE_ARRAY: u32 = 2;
        const BPF_F_MMAPABLE: u32 = 1 << 10;
        let attr = CreateAttr {
            map_type: BPF_MAP_TYPE_ARRAY,
            key_size: 4,
            value_size,
            max_entries: entries,
            map_flags: BPF_F_MMAPABLE,
        };
        // SAFETY: a bpf_attr prefix for BPF_MAP_CREATE, live for the call; the kernel zero-extends it.
        let fd =
            unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_CREATE, &raw const attr, size_of::<CreateAttr>()) };
        assert!(fd >= 0, "BPF_MAP_CREATE: {} (the unit tests run as root)", std::io::Error::last_os_error());
        // SAFETY: a new descriptor, owned by nothing else.
        unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) }
    }

    /// Writes slots as the probes would, through a mapping of its own.
    fn write_slot(fd: &OwnedFd, index: usize, slot: LiveSlot) {
        let page = 4096;
        let offset = index * size_of::<LiveSlot>();
        let map = map_range(fd, LIVE_SLOTS.name, offset / page * page, offset % page + size_of::<LiveSlot>())
            .unwrap();
        // SAFETY: the slot lies inside the mapping just made, at its offset from the page.
        unsafe { map.as_mut_ptr().add(offset % page).cast::<LiveSlot>().write_volatile(slot) };
    }

    /// Records in both chunks of a two-chunk table, a slot being written and a tombstone: the
    /// reader sees the records only, and a release gives up one process's and counts them off.
    #[test]
    fn records_are_read_and_released_through_the_mapping() {
        let size = TableSize::for_records(CHUNK_SLOTS as u32);
        assert_eq!(size.slots as usize, 2 * CHUNK_SLOTS);
        let (slots, count) = (mmapable_array(48, size.slots), mmapable_array(8, 1));
        let key = |tgid, address| AllocationKey { tgid, _pad: 0, address };
        let record = |key: AllocationKey, size| LiveSlot {
            tag: LiveTag::of(&key).0,
            key,
            allocation: Allocation { size, timestamp_ns: 1, stack: 2 },
        };
        let written = [
            (3, record(key(7, 0x1000), 16)),
            (CHUNK_SLOTS + 5, record(key(7, 0x2000), 32)),
            (CHUNK_SLOTS * 2 - 1, record(key(8, 0x1000), 64)),
            (10, LiveSlot { tag: LiveTag::BUSY, ..record(key(9, 0x3000), 1) }),
            (11, LiveSlot { tag: LiveTag::TOMBSTONE, ..record(key(9, 0x4000), 1) }),
        ];
        for (index, slot) in written {
            write_slot(&slots, index, slot);
        }
        let table = LiveTable::of_arrays(slots, count, &size).unwrap();
        table.count().store(3, Ordering::Relaxed);
        let mut sizes: Vec<(u32, u64)> =
            table.records().unwrap().iter().map(|(k, a)| (k.tgid, a.size)).collect();
        sizes.sort_unstable();
        assert_eq!(sizes, [(7, 16), (7, 32), (8, 64)]);
        assert_eq!(table.release(&HashSet::from([7])).unwrap(), 2);
        assert_eq!(table.len(), 1);
        let left: Vec<u32> = table.records().unwrap().iter().map(|(k, _)| k.tgid).collect();
        assert_eq!(left, [8]);
    }
}
