//! Each traced thread's allocator state (`ThreadState`), updated in place: made on the thread's
//! first event in a traced process, released when it exits or execs (processes.rs), so a thread
//! that has one is traced.
//!
//! The states live in an array, tagged with their thread's tid, at one of `PROBES` slots from
//! `tid % MAX_THREADS`: an array lookup is inlined by the verifier (no helper call), where a hash
//! lookup costs 60-90 ns here and a malloc/free pair asks three times. Every slot a thread finds
//! is a value of the one map, so the verifier goes on from one state, not one per home. A thread
//! whose slots are all held by other live threads gets none (its events count as lost). A slot
//! whose release the kernel skipped (process_exit's recursion guard, on a preemptible kernel) is
//! freed by userspace once its thread is gone (memtrace-user/src/kernel/thread_slots.rs).

use aya_ebpf::{macros::map, maps::Array};
use memtrace_common::{ThreadSlot, ThreadState, MAX_THREADS};

use crate::counters::compare_exchange;

#[map]
static THREAD_SLOTS: Array<ThreadSlot> = Array::with_max_entries(MAX_THREADS, 0);

/// Slots a thread may hold: `tid % MAX_THREADS` and the next ones.
const PROBES: u32 = 4;

/// The slot that `tid` holds, or else (with `claim`) the first free one it can take.
fn slot_of(tid: u32, claim: bool) -> Option<&'static mut ThreadSlot> {
    if tid == 0 {
        return None;
    }
    for probe in 0..PROBES {
        let Some(slot) = THREAD_SLOTS.get_ptr_mut(tid.wrapping_add(probe) % MAX_THREADS) else {
            continue;
        };
        // SAFETY: a map value, valid while the program runs; only the tagged thread's programs
        // touch its state, and they never run at once.
        let held = unsafe { (*slot).tid };
        if held == u64::from(tid) {
            return Some(unsafe { &mut *slot });
        }
        // Taken atomically: threads of other processes may race for a free slot.
        if claim && held == 0 && compare_exchange(slot as *const u64, 0, u64::from(tid)) == 0 {
            // SAFETY: as above; the slot is this thread's now.
            let slot = unsafe { &mut *slot };
            slot.state = fresh();
            return Some(slot);
        }
    }
    None
}

/// A new thread's state: its first sample point drawn.
fn fresh() -> ThreadState {
    ThreadState { until_sample: crate::sampling::next_distance(), ..ThreadState::default() }
}

/// The thread's state, if it has one.
pub(crate) fn find(tid: u32) -> Option<&'static mut ThreadState> {
    slot_of(tid, false).map(|slot| &mut slot.state)
}

/// The thread's state, made fresh if it has none; None when its slots are all held.
pub(crate) fn find_or_make(tid: u32) -> Option<&'static mut ThreadState> {
    find(tid).or_else(|| slot_of(tid, true).map(|slot| &mut slot.state))
}

/// Forgets the thread's state (it exits, or its process execs).
pub(crate) fn release(tid: u32) {
    if let Some(slot) = slot_of(tid, false) {
        slot.tid = 0;
    }
}
