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
    /// VmSize: the address space mapped, reservations included (0 at exit: not read then).
    pub address_space_bytes: u64,
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
            address_space_bytes: 0,
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

/// Who owns a process's resident anonymous pages: every resident (or swapped) anonymous page of
/// /proc/PID/smaps has one owner, found by collect/owners.rs, and is summed here per owner. What no
/// owner claims is dark memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResidentOwners {
    /// The brk heap, glibc's arenas, every mapping an allocator made.
    pub allocator: u64,
    /// Resident pages of the allocator's mappings that hold no live block; None where live blocks
    /// predate the trace (an attach) or are sampled, so which pages hold one is unknown.
    pub allocator_free: Option<u64>,
    /// Anonymous mappings the program made itself, outside allocator calls.
    pub program: u64,
    /// The main stack and thread stacks.
    pub stacks: u64,
    /// Copied-on-write pages of the loaded objects' writable data, and their .bss.
    pub statics: u64,
    /// The accessible address space of the allocator's mappings (reservations not counted).
    pub allocator_accessible: u64,
    /// Every anonymous byte (resident or swapped) of the mappings as they were read: the memory
    /// these owners explain, owned or dark.
    pub anonymous: u64,
}

impl ResidentOwners {
    /// Every owned byte: rss_anon + swap less this is dark memory.
    pub fn owned(&self) -> u64 {
        self.allocator + self.program + self.stacks + self.statics
    }

    /// The owners last read, made to fit in the `anonymous` bytes and the brk heap of
    /// `heap_break_bytes` a process had as it exited. If the anonymous bytes differ by more than a
    /// tenth from what the owners were read against, or the brk heap outgrew the allocator's
    /// mappings then (the heap is always one of them), the process grew or gave memory back after
    /// the last sample (one that exits within its first milliseconds was read before its heap
    /// existed; Python frees its objects at its end): the owners are stale, and None. Otherwise
    /// threads ended before the process did, and their stacks and a page or two of their arenas
    /// went with them: the excess is taken from the stacks, then the allocator.
    pub fn fitted(self, anonymous: u64, heap_break_bytes: u64) -> Option<Self> {
        if self.anonymous.abs_diff(anonymous) * 10 > anonymous || self.allocator_accessible < heap_break_bytes
        {
            return None;
        }
        let excess = self.owned().saturating_sub(anonymous);
        let from_stacks = excess.min(self.stacks);
        let from_allocator = (excess - from_stacks).min(self.allocator);
        Some(Self { stacks: self.stacks - from_stacks, allocator: self.allocator - from_allocator, ..self })
    }
}

/// One process's memory, level by level (the summary's `memory` object and the trace's `memory`
/// counter).
///
/// With the owners of its resident pages read (every sample where the process runs):
/// `dark_bytes = max(0, rss_anon + swap - allocator_resident - mapped_anon_resident - stack -
/// static)`, which adds up by construction; what remains is what no rule explains (JIT code, raw
/// syscalls, allocators memtrace does not know). Before the owners were ever read (a process that
/// lived less than an interval) it is the estimate `max(0, rss_anon + swap - max(allocator_held,
/// heap_live) - mapped_anon)`, as before there were owners.
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
    /// Resident (and swapped) anonymous bytes of the allocator's mappings.
    #[serde(default)]
    pub allocator_resident_bytes: u64,
    /// Of those, resident pages holding no live block: what malloc_trim(0) could give back. Null
    /// where it is unknown (live blocks from before the trace, or sampled).
    #[serde(default)]
    pub allocator_free_resident_bytes: Option<u64>,
    /// Resident (and swapped) anonymous bytes of the mappings the program made itself.
    #[serde(default)]
    pub mapped_anon_resident_bytes: u64,
    #[serde(default)]
    pub stack_bytes: u64,
    #[serde(default)]
    pub static_bytes: u64,
    pub dark_bytes: u64,
    /// What the allocator's size classes add to the live blocks (each block's usable size less
    /// the bytes asked for, model/size_classes.rs): heap_live + this is what the allocator counts
    /// as allocated. Null where its classes are unknown (tcmalloc, mimalloc) or a live block was
    /// not seen (from before the trace, or sampled).
    #[serde(default)]
    pub heap_rounding_bytes: Option<u64>,
}

impl MemoryLevels {
    /// The names of the levels, in the order `named` gives them.
    pub const NAMES: [&'static str; 15] = [
        "rss_anon_bytes",
        "rss_file_bytes",
        "rss_shmem_bytes",
        "swap_bytes",
        "heap_live_bytes",
        "allocator_held_bytes",
        "heap_overhead_bytes",
        "mapped_anon_bytes",
        "allocator_resident_bytes",
        "allocator_free_resident_bytes",
        "mapped_anon_resident_bytes",
        "stack_bytes",
        "static_bytes",
        "dark_bytes",
        "heap_rounding_bytes",
    ];

    /// The levels of a process the OS says holds `os`, from the kernel's figures of it and the
    /// owners of its resident pages, when they were read.
    pub fn of(
        os: OsMemory,
        stats: &ProcessStats,
        brk_heap_bytes: u64,
        owners: Option<ResidentOwners>,
    ) -> Self {
        Self::new(os, stats.live_bytes, TakenMemory::of(stats, brk_heap_bytes), owners)
    }

    /// The levels of an exited process, from what the kernel counted as it exited and the owners
    /// last read while it ran, if they still fit in that (`ResidentOwners::fitted`); None if the kernel's counters
    /// were not read (a kernel without BTF).
    pub fn at_exit(stats: &ProcessStats, page_size: u64, owners: Option<ResidentOwners>) -> Option<Self> {
        let exit = &stats.exit_memory;
        (exit.read != 0).then(|| {
            let os = OsMemory::at_exit(exit, page_size);
            let owners = owners
                .and_then(|owners| owners.fitted(os.rss_anon_bytes + os.swap_bytes, exit.heap_break_bytes));
            Self::new(os, stats.live_bytes, TakenMemory::of(stats, exit.heap_break_bytes), owners)
        })
    }

    pub fn new(
        os: OsMemory,
        heap_live_bytes: i64,
        taken: TakenMemory,
        owners: Option<ResidentOwners>,
    ) -> Self {
        // Sampling estimates can dip below zero for a moment; a level cannot.
        let heap_live_bytes = heap_live_bytes.max(0) as u64;
        let anonymous = os.rss_anon_bytes + os.swap_bytes;
        let (held, explained) = match owners {
            Some(owners) => (owners.allocator_accessible, owners.owned()),
            None => {
                let held = taken.allocator_held_bytes;
                (held, held.max(heap_live_bytes) + taken.mapped_anon_bytes)
            }
        };
        let owners = owners.unwrap_or_default();
        Self {
            rss_anon_bytes: os.rss_anon_bytes,
            rss_file_bytes: os.rss_file_bytes,
            rss_shmem_bytes: os.rss_shmem_bytes,
            swap_bytes: os.swap_bytes,
            heap_live_bytes,
            allocator_held_bytes: held,
            heap_overhead_bytes: held.saturating_sub(heap_live_bytes),
            mapped_anon_bytes: taken.mapped_anon_bytes,
            allocator_resident_bytes: owners.allocator,
            allocator_free_resident_bytes: owners.allocator_free,
            mapped_anon_resident_bytes: owners.program,
            stack_bytes: owners.stacks,
            static_bytes: owners.statics,
            dark_bytes: anonymous.saturating_sub(explained),
            heap_rounding_bytes: None,
        }
    }

    /// The resident set: anonymous, file-backed and shared memory.
    pub fn rss_bytes(&self) -> u64 {
        self.rss_anon_bytes + self.rss_file_bytes + self.rss_shmem_bytes
    }

    /// Every level with its name, in `NAMES` order; None for a level that is unknown.
    pub fn named(&self) -> [(&'static str, Option<u64>); 15] {
        let values = [
            Some(self.rss_anon_bytes),
            Some(self.rss_file_bytes),
            Some(self.rss_shmem_bytes),
            Some(self.swap_bytes),
            Some(self.heap_live_bytes),
            Some(self.allocator_held_bytes),
            Some(self.heap_overhead_bytes),
            Some(self.mapped_anon_bytes),
            Some(self.allocator_resident_bytes),
            self.allocator_free_resident_bytes,
            Some(self.mapped_anon_resident_bytes),
            Some(self.stack_bytes),
            Some(self.static_bytes),
            Some(self.dark_bytes),
            self.heap_rounding_bytes,
        ];
        let mut named = [("", None); 15];
        for (slot, (name, value)) in named.iter_mut().zip(Self::NAMES.into_iter().zip(values)) {
            *slot = (name, value);
        }
        named
    }

    /// The levels that are known, by name: the trace's `memory` counter (a counter has no null).
    pub fn known(&self) -> serde_json::Map<String, serde_json::Value> {
        self.named().into_iter().filter_map(|(name, value)| Some((name.to_owned(), value?.into()))).collect()
    }
}

/// The allocator's free pool: the gaps between live blocks in its mappings, by size class, with
/// how much of each is resident (the summary's `memory.allocator_free_by_size`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreePool {
    /// glibc arenas seen (the main one and each thread arena's heaps' arena) when the process's
    /// mappings were last read, which may be later than `measured_at_us`; 0 for other allocators.
    pub arenas: u32,
    /// When it was measured, in microseconds since tracing began: it is measured within a budget,
    /// so it may be older than the other levels (a process that exited keeps its last).
    pub measured_at_us: u64,
    /// Classes with any gap, smallest first.
    pub classes: Vec<FreeClass>,
}

/// The gaps of one power-of-two size class: each at least `min_bytes` and less than twice it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreeClass {
    pub min_bytes: u64,
    pub gaps: u64,
    pub bytes: u64,
    /// Whole resident pages inside the gaps: the class's part of allocator_free_resident_bytes.
    pub resident_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const KIB: u64 = 1 << 10;

    #[test]
    fn dark_memory_is_what_no_level_explains() {
        // 16 MiB resident anonymous: 8 MiB mapped by the program, 1 MiB live in a 2 MiB heap.
        let os = OsMemory { rss_anon_bytes: 16 * MIB, rss_file_bytes: 3 * MIB, ..OsMemory::default() };
        let taken = TakenMemory { allocator_held_bytes: 2 * MIB, mapped_anon_bytes: 8 * MIB };
        let levels = MemoryLevels::new(os, MIB as i64, taken, None);
        assert_eq!(levels.dark_bytes, 6 * MIB);
        assert_eq!(levels.heap_overhead_bytes, MIB);
        assert_eq!(levels.rss_bytes(), 19 * MIB);
        assert_eq!(levels.named()[13], ("dark_bytes", Some(6 * MIB)));
        assert_eq!(levels.named()[9], ("allocator_free_resident_bytes", None));
        assert!(!levels.known().contains_key("allocator_free_resident_bytes"));
    }

    #[test]
    fn dark_memory_is_never_negative_and_the_live_heap_counts_when_holdings_are_unknown() {
        let os = OsMemory { rss_anon_bytes: MIB, ..OsMemory::default() };
        let levels = MemoryLevels::new(os, 4 * MIB as i64, TakenMemory::default(), None);
        assert_eq!(levels.dark_bytes, 0);
        assert_eq!(levels.heap_overhead_bytes, 0);
        let levels = MemoryLevels::new(os, -5, TakenMemory::default(), None);
        assert_eq!(levels.heap_live_bytes, 0);
        assert_eq!(levels.dark_bytes, MIB);
    }

    #[test]
    fn at_exit_the_last_owners_are_fitted_or_dropped() {
        let owners = ResidentOwners {
            allocator: 90 * MIB,
            stacks: MIB,
            statics: MIB,
            allocator_accessible: 96 * MIB,
            anonymous: 92 * MIB,
            ..ResidentOwners::default()
        };
        // The threads' stacks and 1 MiB of their arenas went before the exit was counted.
        let fitted = owners.fitted(90 * MIB, 8 * MIB).unwrap();
        assert_eq!((fitted.stacks, fitted.allocator, fitted.statics), (0, 89 * MIB, MIB));
        assert_eq!(owners.fitted(92 * MIB, 8 * MIB), Some(owners));
        assert_eq!(owners.fitted(5 * MIB, 8 * MIB), None, "the process gave back what the owners held");
        // Read just after its exec (no heap yet), 112 KiB when it exited milliseconds later (6.1's
        // matrix run of fixtures/leaks.c): none of its heap would have an owner.
        let young = ResidentOwners {
            statics: 8 * KIB,
            stacks: 12 * KIB,
            anonymous: 20 * KIB,
            ..ResidentOwners::default()
        };
        assert_eq!(young.fitted(112 * KIB, 132 * KIB), None, "the process grew after the owners were read");
        // Read before its first malloc, with its anonymous pages all but those it had at exit
        // (6.12-rt's matrix run of fixtures/leaks.c): its 132 KiB brk heap came after the read.
        let before_malloc = ResidentOwners { anonymous: 120 * KIB, ..young };
        assert_eq!(
            before_malloc.fitted(124 * KIB, 132 * KIB),
            None,
            "its heap came after the owners were read"
        );
        assert!(before_malloc.fitted(124 * KIB, 0).is_some(), "nothing grew");
    }

    #[test]
    fn with_owners_dark_memory_is_what_no_owner_claims() {
        // 30 MiB resident + 2 MiB swapped: 20 allocator (4 of it free), 3 program, 1 stacks, 6 static.
        let os = OsMemory { rss_anon_bytes: 30 * MIB, swap_bytes: 2 * MIB, ..OsMemory::default() };
        let owners = ResidentOwners {
            allocator: 20 * MIB,
            allocator_free: Some(4 * MIB),
            program: 3 * MIB,
            stacks: MIB,
            statics: 6 * MIB,
            allocator_accessible: 64 * MIB,
            anonymous: 32 * MIB,
        };
        let levels = MemoryLevels::new(os, 16 * MIB as i64, TakenMemory::default(), Some(owners));
        assert_eq!(levels.dark_bytes, 2 * MIB);
        assert_eq!(levels.allocator_held_bytes, 64 * MIB);
        assert_eq!(levels.heap_overhead_bytes, 48 * MIB);
        assert_eq!(levels.known()["allocator_free_resident_bytes"], 4 * MIB);
        let owned = levels.allocator_resident_bytes
            + levels.mapped_anon_resident_bytes
            + levels.stack_bytes
            + levels.static_bytes
            + levels.dark_bytes;
        assert_eq!(owned, levels.rss_anon_bytes + levels.swap_bytes, "the owners add up");
    }
}
