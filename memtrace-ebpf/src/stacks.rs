//! The user stack of each allocation, and what each (process, stack) allocated and still holds.

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_F_USER_BUILD_ID, BPF_F_USER_STACK, BPF_NOEXIST},
    helpers::{bpf_ktime_get_ns, bpf_probe_read_user, generated::bpf_get_stack},
    macros::map,
    maps::{HashMap, LruHashMap, PerCpuArray},
    programs::RetProbeContext,
    EbpfContext,
};
use memtrace_common::{
    ProcessStats, StackFrame, StackFrames, StackKey, StackTotals, MAX_RAW_STACKS, MAX_STACKS,
    MAX_STACK_TOTALS, NO_STACK, STACK_DEPTH,
};

use crate::counters::{add, add_signed};

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

/// A stack's return addresses, innermost first.
type RawStack = [u64; STACK_DEPTH];

#[map]
static RAW_SCRATCH: PerCpuArray<RawStack> = PerCpuArray::with_max_entries(1, 0);

/// Raw stacks seen, by a hash of (process, program image, return addresses), to their key in STACKS.
#[map]
static RAW_STACKS: LruHashMap<u64, u64> = LruHashMap::with_max_entries(MAX_RAW_STACKS, 0);

/// Set by the loader: 0 when run with --no-stacks.
#[no_mangle]
pub(crate) static CAPTURE_STACKS: u8 = 1;

/// The key of the current user stack in STACKS, or NO_STACK. Taken in a return probe, where the
/// frame-pointer walk starts at the allocator's caller. The raw return addresses are cheap to take
/// and name the stack within one program image; their build-ID form, which outlives the process,
/// is resolved once per distinct raw stack and cached in RAW_STACKS.
pub(crate) fn capture_stack(ctx: &RetProbeContext, tgid: u32, stats: &ProcessStats) -> u64 {
    // SAFETY: a global the loader sets before the programs load.
    if unsafe { core::ptr::read_volatile(&CAPTURE_STACKS) } == 0 {
        return NO_STACK;
    }
    let Some(raw) = RAW_SCRATCH.get_ptr_mut(0) else {
        return NO_STACK;
    };
    // SAFETY: the per-CPU scratch value is ours until the program ends.
    let raw = unsafe { &mut *raw };
    walk_frame_pointers(ctx, raw);
    // The same addresses in another process, or in this one after an exec, are another stack.
    let seed = fnv1a(FNV_OFFSET, u64::from(tgid));
    let raw_key = hash_words(fnv1a(seed, stats.started_ns), raw);
    if let Some(key) = RAW_STACKS.get_ptr(raw_key) {
        // SAFETY: a map value, valid while the program runs.
        return unsafe { *key };
    }
    let key = resolve_build_ids(ctx, stats, raw);
    if key != NO_STACK {
        // A full cache evicts its least recently used entry: nothing is lost, only resolved again.
        let _ = RAW_STACKS.insert(raw_key, key, 0);
    }
    key
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv1a(hash: u64, word: u64) -> u64 {
    (hash ^ word).wrapping_mul(0x0100_0000_01b3)
}

/// FNV-1a over every word (unused frames are zero): 64 bits make collisions between distinct
/// stacks negligible. No early exit, so the verifier walks the program after it once.
fn hash_words<const N: usize>(seed: u64, words: &[u64; N]) -> u64 {
    let mut hash = seed;
    for word in words {
        hash = fnv1a(hash, *word);
    }
    if hash == NO_STACK {
        1
    } else {
        hash
    }
}

/// Return addresses by frame pointers, from a return probe's registers: the allocator's caller
/// first, zeros past the end. A frame must lie above the one it was called from (the stack grows
/// down), which ends the walk at code without frame pointers instead of reading on through its
/// data. Nothing computed here outlives the loop, so the verifier prunes where walks ended.
fn walk_frame_pointers(ctx: &RetProbeContext, raw: &mut RawStack) {
    // SAFETY: the context is the probe's pt_regs; reads at constant offsets.
    let (mut ip, mut frame) = unsafe { ((*ctx.regs).rip, (*ctx.regs).rbp) };
    for slot in raw.iter_mut() {
        *slot = ip;
        ip = 0;
        if frame == 0 {
            continue;
        }
        // [frame] is the caller's frame pointer, [frame + 8] the return address into the caller.
        // SAFETY: the helper checks the user address and fails rather than faults.
        match unsafe { bpf_probe_read_user(frame as *const [u64; 2]) } {
            Ok([next, return_address]) if return_address != 0 => {
                ip = return_address;
                frame = if next > frame { next } else { 0 };
            }
            _ => frame = 0,
        }
    }
}

/// The current stack in build-ID form, cut to the frames the frame-pointer walk found (`raw`),
/// stored in STACKS; its key, or NO_STACK.
fn resolve_build_ids(ctx: &RetProbeContext, stats: &ProcessStats, raw: &RawStack) -> u64 {
    let Some(scratch) = STACK_SCRATCH.get_ptr_mut(0) else {
        return NO_STACK;
    };
    let flags = u64::from(BPF_F_USER_STACK | BPF_F_USER_BUILD_ID);
    let size = core::mem::size_of::<StackFrames>() as u32;
    // bpf_get_stack zeroes what it does not fill, so equal stacks are equal bytes.
    // SAFETY: the helper writes at most `size` bytes into the per-CPU scratch value.
    let copied = unsafe { bpf_get_stack(ctx.as_ptr(), scratch.cast(), size, flags) };
    if copied <= 0 {
        add(&stats.lost_events, 1);
        return NO_STACK;
    }
    // SAFETY: the scratch value is ours until the program ends.
    let frames = unsafe { &mut *scratch };
    for (frame, address) in frames.frames.iter_mut().zip(raw) {
        if *address == 0 {
            *frame = StackFrame::EMPTY;
        }
    }
    // SAFETY: as above; a stack is whole u64 words.
    let words = unsafe { &*(scratch as *const [u64; STACK_DEPTH * 4]) };
    let hash = hash_words(FNV_OFFSET, words);
    // SAFETY: as above.
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
