//! The levels at which a process holds memory, from what the OS says it holds down to what the
//! program has live through its allocator, and the resident memory that no level explains
//! ("dark memory"). One type, worked out in one place, for every output.

use memtrace_common::{mm_counter, ExitMemory, ProcessStats};
use serde::{Deserialize, Serialize};

/// What the OS says a process holds: /proc/PID/status while it runs, the kernel's own counters
/// when it exits (read by the exit probe before its memory is released).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OsMemory {
    pub rss_anon_bytes: u64,
    pub rss_file_bytes: u64,
    pub rss_shmem_bytes: u64,
    pub swap_bytes: u64,
}

impl OsMemory {
    /// What the kernel counted as the process exited, in pages of `page_size` bytes.
    pub fn at_exit(exit: &ExitMemory, page_size: u64) -> Self {
        let bytes = |counter: usize| exit.pages[counter] * page_size;
        Self {
            rss_anon_bytes: bytes(mm_counter::ANON_PAGES),
            rss_file_bytes: bytes(mm_counter::FILE_PAGES),
            rss_shmem_bytes: bytes(mm_counter::SHMEM_PAGES),
            swap_bytes: bytes(mm_counter::SWAP_ENTRIES),
        }
    }
}

/// What the allocator and the program took from the OS themselves, besides the live heap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TakenMemory {
    /// brk heap and anonymous mappings made inside allocator calls, still mapped.
    pub allocator_held_bytes: u64,
    /// Anonymous mappings the program made outside allocator calls, still mapped.
    pub mapped_anon_bytes: u64,
}

impl TakenMemory {
    /// From the kernel's figures of a process and the size of its brk heap (which only the
    /// allocator moves, in practice).
    pub fn of(stats: &ProcessStats, brk_heap_bytes: u64) -> Self {
        Self {
            allocator_held_bytes: brk_heap_bytes + stats.allocator_mapped_bytes.max(0) as u64,
            mapped_anon_bytes: stats.program_mapped_bytes.max(0) as u64,
        }
    }
}

/// One process's memory, level by level (the summary's `memory` object and the trace's `memory`
/// counter).
///
/// `dark_bytes` is an estimate: resident and swapped anonymous memory less what the allocator
/// holds (at least the live heap) and less what the program mapped itself,
/// `max(0, rss_anon + swap - max(allocator_held, heap_live) - mapped_anon)`. It is static data,
/// thread stacks, memory of allocators memtrace does not trace, and the like. Held and mapped
/// memory that is not resident makes it an underestimate, never a negative figure.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryLevels {
    pub rss_anon_bytes: u64,
    pub rss_file_bytes: u64,
    pub rss_shmem_bytes: u64,
    pub swap_bytes: u64,
    pub heap_live_bytes: u64,
    pub allocator_held_bytes: u64,
    /// allocator_held - heap_live (0 when the allocator's holdings are not known): fragmentation
    /// and caching.
    pub heap_overhead_bytes: u64,
    pub mapped_anon_bytes: u64,
    pub dark_bytes: u64,
}

impl MemoryLevels {
    /// The names of the levels, in the order `named` gives them.
    pub const NAMES: [&'static str; 9] = [
        "rss_anon_bytes",
        "rss_file_bytes",
        "rss_shmem_bytes",
        "swap_bytes",
        "heap_live_bytes",
        "allocator_held_bytes",
        "heap_overhead_bytes",
        "mapped_anon_bytes",
        "dark_bytes",
    ];

    /// The levels of a process the OS says holds `os`, from the kernel's figures of it.
    pub fn of(os: OsMemory, stats: &ProcessStats, brk_heap_bytes: u64) -> Self {
        Self::new(os, stats.live_bytes, TakenMemory::of(stats, brk_heap_bytes))
    }

    /// The levels of an exited process, from what the kernel counted as it exited; None if that
    /// was not read (a kernel without BTF).
    pub fn at_exit(stats: &ProcessStats, page_size: u64) -> Option<Self> {
        let exit = &stats.exit_memory;
        (exit.read != 0).then(|| {
            Self::new(
                OsMemory::at_exit(exit, page_size),
                stats.live_bytes,
                TakenMemory::of(stats, exit.heap_break_bytes),
            )
        })
    }

    pub fn new(os: OsMemory, heap_live_bytes: i64, taken: TakenMemory) -> Self {
        // Sampling estimates can dip below zero for a moment; a level cannot.
        let heap_live_bytes = heap_live_bytes.max(0) as u64;
        let held = taken.allocator_held_bytes;
        let explained = held.max(heap_live_bytes) + taken.mapped_anon_bytes;
        Self {
            rss_anon_bytes: os.rss_anon_bytes,
            rss_file_bytes: os.rss_file_bytes,
            rss_shmem_bytes: os.rss_shmem_bytes,
            swap_bytes: os.swap_bytes,
            heap_live_bytes,
            allocator_held_bytes: held,
            heap_overhead_bytes: held.saturating_sub(heap_live_bytes),
            mapped_anon_bytes: taken.mapped_anon_bytes,
            dark_bytes: (os.rss_anon_bytes + os.swap_bytes).saturating_sub(explained),
        }
    }

    /// The resident set: anonymous, file-backed and shared memory.
    pub fn rss_bytes(&self) -> u64 {
        self.rss_anon_bytes + self.rss_file_bytes + self.rss_shmem_bytes
    }

    /// Every level with its name, in `NAMES` order.
    pub fn named(&self) -> [(&'static str, u64); 9] {
        let values = [
            self.rss_anon_bytes,
            self.rss_file_bytes,
            self.rss_shmem_bytes,
            self.swap_bytes,
            self.heap_live_bytes,
            self.allocator_held_bytes,
            self.heap_overhead_bytes,
            self.mapped_anon_bytes,
            self.dark_bytes,
        ];
        let mut named = [("", 0); 9];
        for (slot, (name, value)) in named.iter_mut().zip(Self::NAMES.into_iter().zip(values)) {
            *slot = (name, value);
        }
        named
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn dark_memory_is_what_no_level_explains() {
        // 16 MiB resident anonymous: 8 MiB mapped by the program, 1 MiB live in a 2 MiB heap.
        let os = OsMemory { rss_anon_bytes: 16 * MIB, rss_file_bytes: 3 * MIB, ..OsMemory::default() };
        let taken = TakenMemory { allocator_held_bytes: 2 * MIB, mapped_anon_bytes: 8 * MIB };
        let levels = MemoryLevels::new(os, MIB as i64, taken);
        assert_eq!(levels.dark_bytes, 6 * MIB);
        assert_eq!(levels.heap_overhead_bytes, MIB);
        assert_eq!(levels.rss_bytes(), 19 * MIB);
        assert_eq!(levels.named()[8], ("dark_bytes", 6 * MIB));
    }

    #[test]
    fn dark_memory_is_never_negative_and_the_live_heap_counts_when_holdings_are_unknown() {
        let os = OsMemory { rss_anon_bytes: MIB, ..OsMemory::default() };
        let levels = MemoryLevels::new(os, 4 * MIB as i64, TakenMemory::default());
        assert_eq!(levels.dark_bytes, 0);
        assert_eq!(levels.heap_overhead_bytes, 0);
        let levels = MemoryLevels::new(os, -5, TakenMemory::default());
        assert_eq!(levels.heap_live_bytes, 0);
        assert_eq!(levels.dark_bytes, MIB);
    }
}
