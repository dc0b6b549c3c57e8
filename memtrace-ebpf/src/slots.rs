//! Arrays of tagged slots, in place of hash maps on the hot path: an entry for key K lives in one of
//! `PROBES` slots from `K % capacity`, tagged with K (0 marks a free slot: no thread or process has
//! id 0 in user space). An array lookup is inlined by the verifier, where a hash lookup is a helper
//! call (60-90 ns here); and every slot found is a value of the one map, so the verifier goes on
//! from one state whichever slot it is.

use aya_ebpf::maps::Array;

use crate::counters::compare_exchange;

/// A slot type: `#[repr(C)]`, its holder's key as its first field, a u64.
///
/// # Safety
/// Implement only for such types: `find` reads and swaps the tag through a pointer to the slot.
pub(crate) unsafe trait Tagged {}

/// Slots an entry may take: its own and the next ones.
const PROBES: u32 = 4;

/// How `find` found a slot.
pub(crate) enum Found<T: 'static> {
    /// `key` already held it.
    Held(&'static mut T),
    /// It was free and `key` has just taken it (the rest of the slot is as its last holder left it).
    Taken(&'static mut T),
}

/// The slot that `key` holds in `array` (of `capacity` slots), or else, with `take`, the first free
/// one, taken atomically (threads of other processes may race for it). None for key 0, or when
/// every slot it may take is held by others.
pub(crate) fn find<T: Tagged>(
    array: &'static Array<T>,
    capacity: u32,
    key: u32,
    take: bool,
) -> Option<Found<T>> {
    if let Some(slot) = held(array, capacity, key) {
        return Some(Found::Held(slot));
    }
    if !take || key == 0 {
        return None;
    }
    for probe in 0..PROBES {
        let Some(slot) = array.get_ptr_mut(key.wrapping_add(probe) % capacity) else {
            continue;
        };
        // The tag is the slot's first field (Tagged); a free slot is taken only if still free.
        if compare_exchange(slot as *const u64, 0, u64::from(key)) == 0 {
            // SAFETY: a map value, valid while the program runs; the slot is `key`'s now.
            return Some(Found::Taken(unsafe { &mut *slot }));
        }
    }
    None
}

/// The slot that `key` holds, if any: whichever of its slots it took, the others may have been
/// freed since.
pub(crate) fn held<T: Tagged>(array: &'static Array<T>, capacity: u32, key: u32) -> Option<&'static mut T> {
    if key == 0 {
        return None;
    }
    for probe in 0..PROBES {
        let Some(slot) = array.get_ptr_mut(key.wrapping_add(probe) % capacity) else {
            continue;
        };
        // SAFETY: a map value, valid while the program runs, whose first field is its tag
        // (Tagged); only the holder's programs use the rest.
        if unsafe { core::ptr::read_volatile(slot as *const u64) } == u64::from(key) {
            return Some(unsafe { &mut *slot });
        }
    }
    None
}

/// Frees `slot`: its tag is cleared (the caller has reset the rest for the next holder).
pub(crate) fn free<T: Tagged>(slot: &mut T) {
    // SAFETY: the slot's first field is its tag (Tagged).
    unsafe { core::ptr::write_volatile(slot as *mut T as *mut u64, 0) };
}
