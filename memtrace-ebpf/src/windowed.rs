//! `--window ON/EVERY`: the allocation-only entry points (malloc, calloc, the memalign family)
//! are probed for ON of every EVERY, while free, realloc and reallocarray stay probed, so that a
//! block a window recorded is followed until it is freed. Userspace counts windows in
//! `WINDOW_GENERATION`: made odd before a window's probes are attached, and even before they are
//! detached, so that no probe of a closed window counts while it is being taken away.
//!
//! A thread inside malloc when the window closes never sees its return probe (detached under
//! it), so its call would stay pending and every later free of the thread would read as one
//! inside the allocator. Each outermost call keeps the generation it was entered in
//! (`ThreadState::window`); a call kept from an earlier generation is abandoned at the thread's
//! next allocator event, which is then outermost itself, and a windowed call returning in a later
//! generation than it entered is dropped (its block is one no window recorded). An entry of a
//! windowed function while the generation is even (its probe not yet detached) is ignored.

use aya_ebpf::{macros::map, maps::Array};
use memtrace_common::{AllocatorFunction, ThreadState, WINDOW_SLOT};

use crate::helpers::loaded;

/// Set by the loader: 1 when allocations are probed in windows.
#[no_mangle]
static WINDOWED: u8 = 0;

#[map]
static WINDOW_GENERATION: Array<u32> = Array::with_max_entries(1, 0);

/// Whether allocations are probed in windows.
pub(crate) fn enabled() -> bool {
    loaded(&WINDOWED) != 0
}

/// The current window generation; 0 (and never changing) without windows.
pub(crate) fn generation() -> u64 {
    if !enabled() {
        return 0;
    }
    // SAFETY: a map value, read whole: userspace writes it with one update.
    WINDOW_GENERATION.get_ptr(WINDOW_SLOT).map_or(0, |generation| u64::from(unsafe { *generation }))
}

/// Whether an entry of `function` is ignored: a windowed function entered between windows, through
/// a probe on its way out.
pub(crate) fn ignores_entry(function: AllocatorFunction, generation: u64) -> bool {
    enabled() && function.windowed() && generation & 1 == 0
}

/// Forgets a call the thread entered in an earlier generation, whose return probe may be gone: the
/// event now is the thread's outermost. (A realloc entered before a window opened or closed and
/// calling malloc or free after it is the one case that is not, and that inner call then accounts
/// for the block itself, as the realloc's return, at depth 0, is ignored.)
pub(crate) fn forget_abandoned_call(thread: &mut ThreadState, generation: u64) {
    if thread.depth != 0 && thread.window != generation {
        thread.depth = 0;
    }
}

/// Whether a call the thread entered counts as an allocation of a window: without windows, always.
pub(crate) fn entered_in_window(thread: &ThreadState) -> bool {
    !enabled() || thread.window & 1 == 1
}

/// Whether a returning call of `function` was abandoned: entered in an earlier generation, with
/// a return probe detached since (realloc's stays).
pub(crate) fn abandoned_return(thread: &ThreadState, function: AllocatorFunction, generation: u64) -> bool {
    function.windowed() && thread.window != generation
}
