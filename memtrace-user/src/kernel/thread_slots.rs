//! The kernel's per-thread allocator slots (memtrace-ebpf threads.rs) as userspace tidies them.
//! process_exit gives a thread's slot back as it exits; a run of it that the kernel skipped (its
//! recursion guard: on a preemptible kernel, another task's exit was under way in it on the same
//! CPU) leaves the slot held by a thread that is gone. Such slots are found here and freed, so that
//! they serve live threads again and a later thread given the same tid starts afresh.
//!
//! A slot is freed only while its tid names no live thread: a thread that took the tid since
//! reads it as its own (threads.rs matches by tid) and keeps it.

use anyhow::Result;
use aya::Ebpf;
use memtrace_common::{ThreadSlot, MAX_THREADS};

use super::tables::THREAD_SLOTS;

/// Frees every slot held by a tid for which `gone` holds; returns how many it freed. Reads the
/// whole array (a syscall a slot): called only when the kernel skipped exits.
pub fn free_slots_of_gone_threads(ebpf: &Ebpf, gone: impl Fn(u32) -> bool) -> Result<usize> {
    let mut freed = 0;
    for index in 0..MAX_THREADS {
        let slot = THREAD_SLOTS.get(ebpf, index)?;
        // Tids are 32-bit; the slot keeps a whole word for its compare-and-exchange.
        if slot.tid != 0 && gone(slot.tid as u32) {
            THREAD_SLOTS.set_many(ebpf, index, &[ThreadSlot::default()])?;
            freed += 1;
        }
    }
    Ok(freed)
}
