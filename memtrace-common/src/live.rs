//! The live-allocation table: what the kernel remembers of each block handed out until it is freed
//! (`AllocationKey`, `Allocation`), and the open-addressing table in a BPF array that holds them
//! (`LiveSlot`, `LiveTag`, `live_table_slots`).

/// Default capacity of the live-allocation table in records; the loader sizes the table for it.
pub const DEFAULT_MAX_LIVE_ALLOCATIONS: u32 = 1 << 20;

/// The most entries the kernel accepts in a hash map (`--max-stacks`): it rounds the entries up to
/// a power of two buckets of 16 bytes whose total must fit in 32 bits (E2BIG beyond). Also the
/// bound of `--max-allocations`, whose table (`live_table_slots`) then takes 12 GiB.
pub const MAX_LIVE_ALLOCATIONS_LIMIT: u32 = 1 << 27;

/// Key of the live-allocation map: addresses are only unique within one address space.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocationKey {
    pub tgid: u32,
    pub _pad: u32,
    pub address: u64,
}

/// What the kernel remembers about one live allocation until it is freed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Allocation {
    pub size: u64,
    /// CLOCK_MONOTONIC nanoseconds (bpf_ktime_get_ns) when the block was handed out.
    pub timestamp_ns: u64,
    /// Key of the allocating call stack in the stack map, or NO_STACK.
    pub stack: u64,
}

/// One slot of the live-allocation table (`ALLOCATIONS`): an open-addressing hash table in a BPF
/// array that userspace maps into its own memory, so a record is a few compares and two atomic
/// operations in the probe (no helper call, no bucket lock) and reading the table is no syscall.
/// A key lives in one of the `LIVE_WINDOW` slots from its home (`LiveTag::home`), in the first
/// slot that was free when it came, so a search stops at the first empty slot; freed slots become
/// tombstones, which the next record in their window reuses.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LiveSlot {
    /// `LiveTag::EMPTY`, `TOMBSTONE`, `BUSY` (claimed, fields being written) or the key's tag: the
    /// word a slot is claimed and released by, with compare-and-exchange.
    pub tag: u64,
    pub key: AllocationKey,
    pub allocation: Allocation,
}

/// Slots a key may take, from its home on (wrapping at the end of the table).
pub const LIVE_WINDOW: u32 = 32;

/// A live-allocation key's tag: a 64-bit mix of (process, address), its top bit set so that it is
/// never one of the slot states. Its low bits choose the key's home slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveTag(pub u64);

impl LiveTag {
    pub const EMPTY: u64 = 0;
    pub const TOMBSTONE: u64 = 1;
    pub const BUSY: u64 = 2;

    /// The tag of `key` (the multiply and shifts of murmur3's finalizer: addresses' low bits are
    /// all zero, and the home slot is taken from the mix's low bits).
    pub fn of(key: &AllocationKey) -> Self {
        let mut mix = key.address ^ (u64::from(key.tgid) << 40 | u64::from(key.tgid) >> 24);
        mix ^= mix >> 33;
        mix = mix.wrapping_mul(0xff51_afd7_ed55_8ccd);
        mix ^= mix >> 33;
        Self(mix | 1 << 63)
    }

    /// Whether a slot's tag word names a record (not empty, a tombstone or being written).
    pub fn is_record(word: u64) -> bool {
        word > Self::BUSY
    }

    /// Whether a slot with this tag word may take a new record (empty, or a tombstone).
    pub fn is_free(word: u64) -> bool {
        word == Self::EMPTY || word == Self::TOMBSTONE
    }

    /// The key's home slot in a table of `slots` (a power of two).
    pub fn home(self, slots: u32) -> u32 {
        (self.0 & u64::from(slots - 1)) as u32
    }
}

/// Slots of a live-allocation table that holds `max_allocations` records: at least twice as many
/// (a load of at most one half keeps windows short), a power of two (the home is a mask), and at
/// least one window.
pub const fn live_table_slots(max_allocations: u32) -> u32 {
    let slots = (max_allocations as u64 * 2).next_power_of_two();
    if slots < LIVE_WINDOW as u64 {
        LIVE_WINDOW
    } else {
        slots as u32
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are #[repr(C)] plain integers without padding holes that matter to the kernel.
    unsafe impl aya::Pod for super::AllocationKey {}
    unsafe impl aya::Pod for super::Allocation {}
    unsafe impl aya::Pod for super::LiveSlot {}
}

const _: () = assert!(core::mem::size_of::<LiveSlot>() == 48);
