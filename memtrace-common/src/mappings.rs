//! The C library's mapping calls (mmap, munmap, mremap), probed to follow anonymous memory: the
//! calls (`MapFunction`), one in flight (`PendingMapCall`), and the mappings followed (`RegionKey`,
//! `Region`, `region_kind`).

use crate::arguments::ArgumentsRead;

/// The C library's calls that map and unmap memory, probed to follow anonymous mappings: the BPF
/// cookie of their probes is the discriminant.
#[repr(u64)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MapFunction {
    /// mmap(addr, len, prot, flags, fd, offset)
    Mmap = 1,
    /// munmap(addr, len)
    Munmap = 2,
    /// mremap(old, old_len, new_len, flags, new_addr)
    Mremap = 3,
}

impl MapFunction {
    /// Every one, with its symbol.
    pub const ALL: [(MapFunction, &'static str); 3] = [
        (MapFunction::Mmap, MapFunction::Mmap.symbol()),
        (MapFunction::Munmap, MapFunction::Munmap.symbol()),
        (MapFunction::Mremap, MapFunction::Mremap.symbol()),
    ];

    /// Its symbol.
    pub const fn symbol(self) -> &'static str {
        match self {
            MapFunction::Mmap => "mmap",
            MapFunction::Munmap => "munmap",
            MapFunction::Mremap => "mremap",
        }
    }

    /// The arguments map_enter keeps that map_exit reads: mmap's len, prot and flags (the last two
    /// `int`s), munmap's addr and len, mremap's old address and new length.
    pub const fn arguments(self) -> ArgumentsRead {
        match self {
            MapFunction::Mmap => ArgumentsRead { read: 0b1110, narrow: 0b1100 },
            MapFunction::Munmap => ArgumentsRead::wide(0b011),
            MapFunction::Mremap => ArgumentsRead::wide(0b101),
        }
    }

    /// The function whose discriminant is `value` (a match, as for `AllocatorFunction`).
    pub const fn from_discriminant(value: u64) -> Option<Self> {
        Some(match value {
            1 => MapFunction::Mmap,
            2 => MapFunction::Munmap,
            3 => MapFunction::Mremap,
            _ => return None,
        })
    }
}

/// The arguments of a mapping call in flight, as its entry probe saw them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PendingMapCall {
    /// The `MapFunction`; 0 when none is in flight.
    pub function: u64,
    pub args: [u64; 5],
    /// Whether the thread was inside an allocator call: what it maps is the allocator's.
    pub inside_allocator: u64,
}

/// An anonymous private mapping of a traced process, by its start.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionKey {
    pub tgid: u32,
    pub _pad: u32,
    pub start: u64,
}

/// How long a mapping is and whose figure it counts in (`region_kind`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Region {
    pub len: u64,
    pub kind: u64,
}

pub mod region_kind {
    /// Mapped inside an allocator call: `allocator_mapped_bytes`.
    pub const ALLOCATOR: u64 = 1;
    /// Mapped by the program itself: `program_mapped_bytes`.
    pub const PROGRAM: u64 = 2;
    /// A thread stack: in no figure (dark memory), followed so its unmap is recognised.
    pub const STACK: u64 = 3;
}

/// The most anonymous mappings followed at once, over every traced process.
pub const MAX_REGIONS: u32 = 262_144;

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are #[repr(C)] plain integers without padding holes that matter to the kernel.
    unsafe impl aya::Pod for super::RegionKey {}
    unsafe impl aya::Pod for super::Region {}
}
