//! Safe wrappers for the unsafe operations every program repeats, each with its SAFETY note once:
//! a global the loader set, the clock, a map value as a reference.

use aya_ebpf::helpers::bpf_ktime_get_ns;

/// A global as the loader set it before loading (`EbpfLoader::override_global`), not as compiled.
pub(crate) fn loaded<T: Copy>(global: &T) -> T {
    // SAFETY: a reference is valid to read; volatile, so that the compiler does not fold in the
    // value the object was built with.
    unsafe { core::ptr::read_volatile(global) }
}

/// CLOCK_MONOTONIC, in nanoseconds.
pub(crate) fn now_ns() -> u64 {
    // SAFETY: the helper has no preconditions.
    unsafe { bpf_ktime_get_ns() }
}

/// A map value found by a lookup, as a shared reference; its fields that threads share are changed
/// only with atomics (counters.rs).
pub(crate) fn map_value<T>(value: *const T) -> &'static T {
    // SAFETY: a lookup's pointer is a map value, valid while the program runs, which is all the
    // reference is used for.
    unsafe { &*value }
}
