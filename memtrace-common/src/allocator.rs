//! The allocator entry points memtrace probes and what a probe carries from entry to return: the
//! entry points (`AllocatorFunction`) and the cookie that names one to the one program serving them
//! all (`ProbeCookie`), a thread's call in flight (`PendingCall`, in its `ThreadState` and
//! `ThreadSlot`), and where an allocator's own code lies (`AllocatorCode`).

use crate::{
    arguments::{ArgumentRegisters, ArgumentsRead},
    mappings::{MapFunction, PendingMapCall},
};

/// Threads with allocator state at once: a thread gets a slot at its first allocator call and
/// loses it when it exits.
pub const MAX_THREADS: u32 = 65_536;

/// `--window`'s generation counter (the one slot of `WINDOW_GENERATION`), written by userspace: it
/// rises by one as each window opens (odd) and again once it has closed (even), its probes gone.
pub const WINDOW_SLOT: u32 = 0;

/// The allocator entry points memtrace probes; the discriminant is the low byte of a probe's cookie.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocatorFunction {
    Malloc = 1,
    Calloc = 2,
    Realloc = 3,
    Reallocarray = 4,
    PosixMemalign = 5,
    AlignedAlloc = 6,
    Memalign = 7,
    Valloc = 8,
    Pvalloc = 9,
    Free = 10,
}

impl AllocatorFunction {
    /// Whether a return probe is attached too: every entry point but free, whose result is nothing.
    pub const fn has_return(self) -> bool {
        !matches!(self, AllocatorFunction::Free)
    }

    /// Whether `--window` probes it only inside windows: every entry point that only allocates.
    /// free, realloc and reallocarray stay probed, so that a block a window recorded is followed
    /// until it is freed, wherever it moves.
    pub const fn windowed(self) -> bool {
        !matches!(
            self,
            AllocatorFunction::Free | AllocatorFunction::Realloc | AllocatorFunction::Reallocarray
        )
    }

    /// The arguments its programs read (memtrace-ebpf's alloc_enter and free_enter).
    pub const fn arguments(self) -> ArgumentsRead {
        use AllocatorFunction::*;
        ArgumentsRead::wide(match self {
            Malloc | Valloc | Pvalloc | Free => 0b001,
            Calloc | Realloc => 0b011,
            Reallocarray => 0b111,
            PosixMemalign => 0b101,
            AlignedAlloc | Memalign => 0b010,
        })
    }

    /// The entry point whose discriminant is `value`. A match, not an index into a table: BPF code
    /// must not carry a bounds-check panic, which the verifier refuses.
    pub const fn from_discriminant(value: u64) -> Option<Self> {
        use AllocatorFunction::*;
        Some(match value {
            1 => Malloc,
            2 => Calloc,
            3 => Realloc,
            4 => Reallocarray,
            5 => PosixMemalign,
            6 => AlignedAlloc,
            7 => Memalign,
            8 => Valloc,
            9 => Pvalloc,
            10 => Free,
            _ => return None,
        })
    }
}

/// The BPF cookie of an allocator probe: which entry point in the low byte, which allocator (its
/// index among those probed, from 1) in bits 8-31, and where the probe finds the function's
/// arguments (`ArgumentRegisters`) in bits 32-51. One program serves every entry point of every
/// allocator, so a whole file's probes are one uprobe_multi link. A mapping call's probe has the
/// same shape, with the `MapFunction` in the low byte and no allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeCookie(pub u64);

impl ProbeCookie {
    const FUNCTION_BITS: u32 = 8;
    const REGISTERS_SHIFT: u32 = 32;

    pub const fn new(allocator: u32, function: AllocatorFunction) -> Self {
        Self(((allocator as u64) << Self::FUNCTION_BITS) | function as u64)
    }

    /// A mapping call's cookie.
    pub const fn map_call(function: MapFunction) -> Self {
        Self(function as u64)
    }

    /// The same cookie, with the arguments found in `registers`.
    pub const fn with_registers(self, registers: ArgumentRegisters) -> Self {
        Self((self.0 & 0xffff_ffff) | (registers.0 as u64) << Self::REGISTERS_SHIFT)
    }

    /// The allocator's index (from 1), as `ProcessStats::allocator` keeps it.
    pub const fn allocator(self) -> u64 {
        (self.0 & 0xffff_ffff) >> Self::FUNCTION_BITS
    }

    /// The low byte: an `AllocatorFunction`'s or a `MapFunction`'s discriminant.
    pub const fn discriminant(self) -> u64 {
        self.0 & 0xff
    }

    /// The entry point, from the low byte.
    pub const fn function(self) -> Option<AllocatorFunction> {
        AllocatorFunction::from_discriminant(self.discriminant())
    }

    /// Where the probe finds the function's arguments.
    pub const fn registers(self) -> ArgumentRegisters {
        ArgumentRegisters((self.0 >> Self::REGISTERS_SHIFT) as u32)
    }
}

/// Arguments of an allocator call in flight, as far as the return probe needs them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PendingCall {
    /// Requested bytes (n * size for calloc and reallocarray, saturated on overflow).
    pub size: u64,
    /// realloc/reallocarray: the block being resized; posix_memalign: where the result is stored.
    pub address: u64,
}

/// A thread's allocator state, one slot per thread updated in place (no insert and delete per
/// call): how deep in allocator calls it is, and the outermost call in flight. Only the outermost
/// call counts, so a nested call (glibc's realloc calling malloc) never overwrites it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadState {
    /// Allocator calls the thread is inside; 0 between calls.
    pub depth: u32,
    /// The outermost call's `AllocatorFunction`.
    pub function: u32,
    pub call: PendingCall,
    /// `--sample`: bytes this thread allocates before its next sampled allocation.
    pub until_sample: u64,
    /// The block of the thread's latest allocation: freeing it before any other allocation makes
    /// it a temporary allocation. 0 once freed.
    pub last_block: u64,
    /// A C library mapping call in flight (mmap, munmap, mremap), for its return to account.
    pub map_call: PendingMapCall,
    /// `--window`: the window generation (`WINDOW_GENERATION`) when the outermost call was entered.
    pub window: u64,
}

/// A slot of memtrace-ebpf's thread array (threads.rs): the tid that holds it (0 when free: the
/// idle task makes no calls) and its state. Userspace frees the slots of threads whose exit the
/// kernel did not run process_exit for (a run it skipped).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadSlot {
    pub tid: u64,
    pub state: ThreadState,
}

/// Where an allocator's code lies around its free probe, by the allocator's index
/// (`ProbeCookie::allocator`): a return address in [probe - before, probe + after) is a call from
/// the allocator's own executable segment. Zero where unknown.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocatorCode {
    pub before: u64,
    pub after: u64,
}

/// Allocators whose code range is kept (indices past it fall back to the mapping table).
pub const MAX_ALLOCATOR_CODES: u32 = 1024;

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are #[repr(C)] plain integers without padding holes that matter to the kernel.
    unsafe impl aya::Pod for super::ThreadState {}
    unsafe impl aya::Pod for super::ThreadSlot {}
    unsafe impl aya::Pod for super::PendingCall {}
    unsafe impl aya::Pod for super::AllocatorCode {}
}
