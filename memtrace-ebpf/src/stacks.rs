//! The user stack of each allocation, and what each (process, stack) allocated and still holds.

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_F_USER_BUILD_ID, BPF_F_USER_STACK, BPF_NOEXIST},
    helpers::{bpf_ktime_get_ns, generated::bpf_get_stack},
    macros::map,
    maps::{HashMap, PerCpuArray},
    programs::RetProbeContext,
    EbpfContext,
};
use memtrace_common::{
    ProcessStats, StackFrames, StackKey, StackTotals, MAX_STACKS, MAX_STACK_TOTALS, NO_STACK, STACK_DEPTH,
};

use crate::{
    counters::{add, add_signed},
    processes::stats_of,
};

/// Call stacks by a 64-bit hash of their frames; allocated on demand, as few stacks are distinct.
#[map]
pub(crate) static STACKS: HashMap<u64, StackFrames> =
    HashMap::with_max_entries(MAX_STACKS, BPF_F_NO_PREALLOC);

#[map]
pub(crate) static STACK_TOTALS: HashMap<StackKey, StackTotals> =
    HashMap::with_max_entries(MAX_STACK_TOTALS, 0);

/// A stack is 1 KiB, more than the BPF stack holds: it is captured here first.
#[map]
pub(crate) static STACK_SCRATCH: PerCpuArray<StackFrames> = PerCpuArray::with_max_entries(1, 0);

/// Set by the loader: 0 when run with --no-stacks.
#[no_mangle]
pub(crate) static CAPTURE_STACKS: u8 = 1;

/// The key of the current user stack in STACKS, or NO_STACK. Taken in a return probe, where the
/// frame-pointer walk starts at the allocator's caller.
pub(crate) fn capture_stack(ctx: &RetProbeContext, stats: &ProcessStats) -> u64 {
    if unsafe { core::ptr::read_volatile(&CAPTURE_STACKS) } == 0 {
        return NO_STACK;
    }
    let Some(scratch) = STACK_SCRATCH.get_ptr_mut(0) else {
        return NO_STACK;
    };
    let flags = u64::from(BPF_F_USER_STACK | BPF_F_USER_BUILD_ID);
    let size = core::mem::size_of::<StackFrames>() as u32;
    // bpf_get_stack zeroes what it does not fill, so equal stacks are equal bytes.
    let copied = unsafe { bpf_get_stack(ctx.as_ptr(), scratch.cast(), size, flags) };
    if copied <= 0 {
        add(&stats.lost_events, 1);
        return NO_STACK;
    }
    let words = scratch as *const u64;
    let used_words = copied as usize / 8;
    // FNV-1a over the frames: 64 bits make collisions between distinct stacks negligible.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for i in 0..STACK_DEPTH * 4 {
        if i >= used_words {
            break;
        }
        hash ^= unsafe { *words.add(i) };
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    if hash == NO_STACK {
        hash = 1;
    }
    if STACKS.get_ptr(hash).is_none() && STACKS.insert(hash, unsafe { &*scratch }, 0).is_err() {
        add(&stats.lost_events, 1);
        return NO_STACK;
    }
    hash
}

/// Adds an allocation (or, with a negative count, a free) to its stack's totals.
pub(crate) fn count_in_stack(
    tgid: u32,
    stats: &ProcessStats,
    stack: u64,
    live_allocations: i64,
    live_bytes: i64,
) {
    if stack == NO_STACK {
        return;
    }
    let key = StackKey { tgid, _pad: 0, stack };
    let totals = match STACK_TOTALS.get_ptr(key) {
        Some(totals) => totals,
        None => {
            let fresh = StackTotals { started_ns: unsafe { bpf_ktime_get_ns() }, ..StackTotals::default() };
            let _ = STACK_TOTALS.insert(key, fresh, u64::from(BPF_NOEXIST));
            match STACK_TOTALS.get_ptr(key) {
                Some(totals) => totals,
                None => {
                    add(&stats.lost_events, 1);
                    return;
                }
            }
        }
    };
    let totals = unsafe { &*totals };
    if live_allocations > 0 {
        add(&totals.allocations, 1);
        add(&totals.allocated_bytes, live_bytes as u64);
    }
    add_signed(&totals.live_allocations, live_allocations);
    add_signed(&totals.live_bytes, live_bytes);
}

pub(crate) fn stack_of(ctx: &RetProbeContext, tgid: u32) -> u64 {
    match stats_of(tgid) {
        Some(stats) => capture_stack(ctx, stats),
        None => NO_STACK,
    }
}
