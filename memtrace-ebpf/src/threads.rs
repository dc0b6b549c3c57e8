//! Each traced thread's allocator state (`ThreadState`), updated in place: made on the thread's
//! first event in a traced process, released when it exits or execs (processes.rs), so a thread
//! that has one is traced. The states live in an array of slots tagged by tid (slots.rs): a
//! malloc/free pair asks three times, and a hash lookup would cost 60-90 ns each. A thread whose
//! slots are all held by other live threads gets none (its events count as lost).

use aya_ebpf::{macros::map, maps::Array};
use memtrace_common::{ThreadState, MAX_THREADS};

use crate::slots::{self, Found, Tagged};

/// A slot: the tid that holds it (0 when free) and its state.
#[repr(C)]
#[derive(Clone, Copy)]
struct ThreadSlot {
    tid: u64,
    state: ThreadState,
}

// SAFETY: #[repr(C)], the tid first, a u64.
unsafe impl Tagged for ThreadSlot {}

#[map]
static THREAD_SLOTS: Array<ThreadSlot> = Array::with_max_entries(MAX_THREADS, 0);

/// The thread's state, if it has one.
pub(crate) fn find(tid: u32) -> Option<&'static mut ThreadState> {
    slots::held(&THREAD_SLOTS, MAX_THREADS, tid).map(|slot| &mut slot.state)
}

/// The thread's state, made fresh (its first sample point drawn) if it has none; None when its
/// slots are all held.
pub(crate) fn find_or_make(tid: u32) -> Option<&'static mut ThreadState> {
    match slots::find(&THREAD_SLOTS, MAX_THREADS, tid, true)? {
        Found::Held(slot) => Some(&mut slot.state),
        Found::Taken(slot) => {
            slot.state =
                ThreadState { until_sample: crate::sampling::next_distance(), ..ThreadState::default() };
            Some(&mut slot.state)
        }
    }
}

/// Forgets the thread's state (it exits, or its process execs).
pub(crate) fn release(tid: u32) {
    if let Some(slot) = slots::held(&THREAD_SLOTS, MAX_THREADS, tid) {
        slots::free(slot);
    }
}
