//! Counters in map values, updated with BPF atomics: threads of one process update the same value
//! from different CPUs. (The prebuilt `core` for bpfel has no atomic read-modify-write types.)

use core::arch::asm;

/// Atomically adds `n` to a counter in a map value and returns the counter's previous value. Atomic
/// because threads of one process update the same value from different CPUs.
pub(crate) fn fetch_add(counter: *const u64, n: u64) -> u64 {
    let mut value = n;
    // SAFETY: `counter` points into a map value, which stays valid while the program runs.
    unsafe {
        asm!(
            "{value} = atomic_fetch_add((u64 *)({counter} + 0), {value})",
            counter = in(reg) counter,
            value = inout(reg) value,
        );
    }
    value
}

/// Atomically replaces `*target` with `new` if it still holds `expected`; returns what it held.
pub(crate) fn compare_exchange(target: *const u64, expected: u64, new: u64) -> u64 {
    let mut seen = expected;
    // SAFETY: as for fetch_add.
    unsafe {
        asm!(
            "r0 = cmpxchg_64({target} + 0, r0, {new})",
            target = in(reg) target,
            new = in(reg) new,
            inout("r0") seen,
        );
    }
    seen
}

pub(crate) fn add(counter: &u64, n: u64) {
    fetch_add(counter, n);
}

/// Adds a signed change and returns the new value.
pub(crate) fn add_signed(counter: &i64, n: i64) -> i64 {
    fetch_add(counter as *const i64 as *const u64, n as u64) as i64 + n
}
