//! The live-allocation table: every recorded block's size, time and stack until it is freed, in
//! an open-addressing hash table over a BPF array (`LiveSlot`, memtrace-common). An array lookup
//! is inlined by the verifier, so a record or a free is a few compares and two atomic operations
//! where a hash map cost a helper call with a bucket lock each (about 300 ns a malloc/free pair
//! here). Userspace maps the array and reads it, and tombstones the records of processes it
//! releases, with the same compare-and-exchange.
//!
//! A slot's tag word goes EMPTY or TOMBSTONE -> BUSY (claimed by one thread) -> the key's tag
//! (published once the fields are written) -> TOMBSTONE (freed). Records are counted in
//! `LIVE_RECORDS`, which bounds them at `MAX_LIVE_RECORDS` (`--max-allocations`) in a table of at
//! least twice as many slots.

use core::ffi::c_void;

use aya_ebpf::{bindings::BPF_F_MMAPABLE, helpers::generated::bpf_loop, macros::map, maps::Array};
use memtrace_common::{
    live_table_slots, Allocation, AllocationKey, LiveSlot, LiveTag, DEFAULT_MAX_LIVE_ALLOCATIONS, LIVE_WINDOW,
};

use crate::{
    counters::{compare_exchange, fetch_add},
    helpers::loaded,
};

#[map]
static ALLOCATIONS: Array<LiveSlot> =
    Array::with_max_entries(live_table_slots(DEFAULT_MAX_LIVE_ALLOCATIONS), BPF_F_MMAPABLE);

/// The number of records in the table (slot 0), mapped by userspace too.
#[map]
static LIVE_RECORDS: Array<u64> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// Set by the loader with the table's size: its slots - 1 (a power of two - 1) and the most
/// records it takes.
#[no_mangle]
static LIVE_SLOT_MASK: u64 = live_table_slots(DEFAULT_MAX_LIVE_ALLOCATIONS) as u64 - 1;
#[no_mangle]
static MAX_LIVE_RECORDS: u64 = DEFAULT_MAX_LIVE_ALLOCATIONS as u64;

/// What became of a record.
pub(crate) enum Recorded {
    New,
    /// The block had a record already (its free was not seen): this one replaced it.
    Replaced(Allocation),
    /// No room: `MAX_LIVE_RECORDS` reached, or every slot of the key's window held.
    Full,
}

/// The slot `step` places past the key's home.
fn slot(tag: LiveTag, step: u32) -> Option<*mut LiveSlot> {
    let index = (tag.0.wrapping_add(u64::from(step)) & loaded(&LIVE_SLOT_MASK)) as u32;
    ALLOCATIONS.get_ptr_mut(index)
}

fn tag_word(slot: *mut LiveSlot) -> u64 {
    // SAFETY: a map value, valid while the program runs; the tag word changes only atomically.
    unsafe { core::ptr::read_volatile(&(*slot).tag) }
}

fn holds(slot: *mut LiveSlot, tag: LiveTag, key: &AllocationKey) -> bool {
    // SAFETY: as for tag_word; the key is read after its tag, which was published after it.
    tag_word(slot) == tag.0 && unsafe { (*slot).key == *key }
}

/// Moves a slot's tag from `from` to `to`; false when another thread moved it first.
fn move_tag(slot: *mut LiveSlot, from: u64, to: u64) -> bool {
    compare_exchange(slot as *const u64, from, to) == from
}

/// Writes a slot this thread holds BUSY, then publishes it under `tag`.
fn fill(slot: *mut LiveSlot, tag: LiveTag, key: AllocationKey, allocation: Allocation) {
    // Field by field: a whole struct copied between two pointers the compiler cannot tell apart
    // becomes a call of BPF's byte-by-byte `memmove`, some 170 instructions a record.
    let (AllocationKey { tgid, _pad, address }, Allocation { size, timestamp_ns, stack }) = (key, allocation);
    // SAFETY: the slot is BUSY, held by this thread alone until its tag is published.
    unsafe {
        (*slot).key = AllocationKey { tgid, _pad, address };
        let record = &mut (*slot).allocation;
        (record.size, record.timestamp_ns, record.stack) = (size, timestamp_ns, stack);
    }
    move_tag(slot, LiveTag::BUSY, tag.0);
}

fn counter() -> Option<*const u64> {
    LIVE_RECORDS.get_ptr(0).map(|count| count as *const u64)
}

/// Takes room for one more record; false at `MAX_LIVE_RECORDS`.
fn reserve() -> bool {
    let Some(count) = counter() else {
        return false;
    };
    if fetch_add(count, 1) < loaded(&MAX_LIVE_RECORDS) {
        return true;
    }
    fetch_add(count, u64::MAX);
    false
}

fn unreserve() {
    if let Some(count) = counter() {
        fetch_add(count, u64::MAX);
    }
}

/// Records a block handed out.
pub(crate) fn record(key: AllocationKey, allocation: Allocation) -> Recorded {
    let tag = LiveTag::of(&key);
    // The first free slot of the window, and what its tag was.
    let mut free: Option<(*mut LiveSlot, u64)> = None;
    for step in 0..LIVE_WINDOW {
        let Some(slot) = slot(tag, step) else {
            break;
        };
        if holds(slot, tag, &key) && move_tag(slot, tag.0, LiveTag::BUSY) {
            // SAFETY: the slot is BUSY, this thread's.
            let stale = unsafe { (*slot).allocation };
            fill(slot, tag, key, allocation);
            return Recorded::Replaced(stale);
        }
        let word = tag_word(slot);
        if free.is_none() && LiveTag::is_free(word) {
            free = Some((slot, word));
        }
        // The key is in no slot past an empty one: it took the first free slot when it came.
        if word == LiveTag::EMPTY {
            break;
        }
    }
    let Some((slot, word)) = free else {
        return Recorded::Full;
    };
    if !reserve() {
        return Recorded::Full;
    }
    if move_tag(slot, word, LiveTag::BUSY) {
        fill(slot, tag, key, allocation);
        return Recorded::New;
    }
    // Another thread took the slot since: the first free one now.
    claim(tag, key, allocation)
}

/// Takes the first free slot of the key's window for a new record (room reserved).
fn claim(tag: LiveTag, key: AllocationKey, allocation: Allocation) -> Recorded {
    let mut claim = Claim { tag: tag.0, key, allocation, claimed: 0 };
    // The step is verified once, as the callback: a second loop over the window after the search
    // made the verifier walk every way through both.
    // SAFETY: the callback is a function of this program, and its context is `claim`, on this
    // program's stack for the whole call, as bpf_loop requires.
    unsafe { bpf_loop(LIVE_WINDOW, claim_step as *mut c_void, (&raw mut claim).cast(), 0) };
    if claim.claimed != 0 {
        return Recorded::New;
    }
    unreserve();
    Recorded::Full
}

/// What `claim_step` works on, on the caller's stack.
#[repr(C)]
struct Claim {
    tag: u64,
    key: AllocationKey,
    allocation: Allocation,
    /// Set once a slot is taken and filled.
    claimed: u64,
}

/// bpf_loop's callback: tries slot `index` of the window; 1 ends the loop.
extern "C" fn claim_step(index: u64, claim: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the `Claim` that `claim` passed, alive for the whole loop.
    let claim = unsafe { &mut *(claim as *mut Claim) };
    let tag = LiveTag(claim.tag);
    let Some(slot) = slot(tag, index as u32) else {
        return 1;
    };
    let word = tag_word(slot);
    if LiveTag::is_free(word) && move_tag(slot, word, LiveTag::BUSY) {
        fill(slot, tag, claim.key, claim.allocation);
        claim.claimed = 1;
        return 1;
    }
    0
}

/// The published slot that holds `key`'s record, if any: a record sits in no slot past an empty
/// one of its window.
#[inline(always)]
fn find(tag: LiveTag, key: &AllocationKey) -> Option<*mut LiveSlot> {
    for step in 0..LIVE_WINDOW {
        let slot = slot(tag, step)?;
        if holds(slot, tag, key) {
            return Some(slot);
        }
        if tag_word(slot) == LiveTag::EMPTY {
            return None;
        }
    }
    None
}

/// Removes a block's record and returns it; None when the block has none (or another thread
/// removed it first: a double free).
pub(crate) fn remove(key: AllocationKey) -> Option<Allocation> {
    let tag = LiveTag::of(&key);
    let slot = find(tag, &key)?;
    // SAFETY: a published record; read before it is given up.
    let allocation = unsafe { (*slot).allocation };
    if !move_tag(slot, tag.0, LiveTag::TOMBSTONE) {
        return None;
    }
    unreserve();
    Some(allocation)
}

/// Whether a block has a record (`--window`: whether a realloc out of a window moves one).
pub(crate) fn contains(key: AllocationKey) -> bool {
    find(LiveTag::of(&key), &key).is_some()
}
