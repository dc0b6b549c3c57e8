//! memtrace's kernel side: uprobes on every allocator entry point.
//!
//! Entry probes remember the arguments per (thread, function); return probes turn the result into an
//! allocation, a free or a failure and update per-process totals. Only the outermost allocator call of a
//! thread counts: glibc's realloc(NULL, n) and memalign call malloc, reallocarray calls realloc, and
//! realloc(p, 0) calls free, and none of those inner calls is a second allocation.
#![no_std]
#![no_main]
// Inline BPF assembly for the atomic counters (counters.rs).
#![feature(asm_experimental_arch)]

mod arguments;
mod counters;
mod debug;
mod frame_memo;
mod helpers;
mod interpreters;
mod kernel;
mod kernel_stack;
mod live;
mod oom;
mod os_memory;
mod processes;
mod registers;
mod sampled;
mod sampling;
mod scratch;
mod stack_read;
mod stacks;
mod threads;
mod unwinder;
mod usdt;
mod user_memory;
mod vma;
mod windowed;

use aya_ebpf::{
    helpers::bpf_probe_read_user,
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use memtrace_common::{
    Allocation, AllocationKey, AllocatorFunction, PendingCall, ProbeCookie, ProcessStats, ThreadState,
    NO_STACK,
};

use arguments::argument;
use counters::{add, add_signed, compare_exchange};
use live::Recorded;
use processes::{attach_cookie, caller, note_allocator, stats_of, traced_thread, Caller};
use stacks::{capture_stack, count_in_stack, StackChange};

fn raise_peak(stats: &ProcessStats, live: i64) {
    let peak = &stats.peak_live_bytes as *const i64 as *const u64;
    // SAFETY: a field of a map value, valid while the program runs.
    let mut seen = unsafe { core::ptr::read_volatile(peak) } as i64;
    // Bounded for the verifier; losing four races in a row only delays the peak to the next allocation.
    for _ in 0..4 {
        if live <= seen {
            return;
        }
        let previous = compare_exchange(peak, seen as u64, live as u64) as i64;
        if previous == seen {
            return;
        }
        seen = previous;
    }
}

/// What a free means to the freeing thread.
enum FreeBy {
    /// A free inside an allocator call (glibc's realloc(p, 0)): the outer call accounts for it.
    Allocator,
    /// The program frees; `temporary` when the block is the thread's latest allocation.
    Program { temporary: bool },
}

/// How the thread that frees `address` stands to it; forgets its latest block if this is it.
fn free_by(thread: &mut ThreadState, address: u64) -> FreeBy {
    if thread.depth != 0 {
        return FreeBy::Allocator;
    }
    let temporary = address != 0 && thread.last_block == address;
    if temporary {
        thread.last_block = 0;
    }
    FreeBy::Program { temporary }
}

fn on_enter(function: AllocatorFunction, size: u64, address: u64) -> u32 {
    let Some(thread) = traced_thread(&caller()) else {
        return 0;
    };
    let generation = windowed::generation();
    windowed::forget_abandoned_call(thread, generation);
    if windowed::ignores_entry(function, generation) {
        return 0;
    }
    thread.depth += 1;
    if thread.depth == 1 {
        thread.function = function as u32;
        thread.call = PendingCall { size, address };
        thread.window = generation;
    }
    0
}

/// The outermost allocator call of the calling thread, returning now: its process, its thread's
/// slot and which entry point it is (as its entry probe recorded it: inner calls of the allocator
/// only count depth, so the return that brings the depth to 0 is the outermost call's).
fn take_pending() -> Option<(u32, &'static mut ThreadState, AllocatorFunction)> {
    let Caller { tgid, tid } = caller();
    let thread = threads::find(tid)?;
    if thread.depth == 0 {
        return None;
    }
    let function = AllocatorFunction::from_discriminant(u64::from(thread.function))?;
    if windowed::abandoned_return(thread, function, windowed::generation()) {
        thread.depth = 0;
        return None;
    }
    thread.depth -= 1;
    if thread.depth != 0 {
        return None;
    }
    function.has_return().then_some((tgid, thread, function))
}

fn record_allocation(tgid: u32, stats: &ProcessStats, size: u64, address: u64, stack: u64) {
    if address == 0 {
        add(&stats.failed_allocations, 1);
        return;
    }
    add(&stats.allocations, 1);
    add(&stats.allocated_bytes, size);
    let key = AllocationKey { tgid, _pad: 0, address };
    let allocation = Allocation { size, timestamp_ns: helpers::now_ns(), stack };
    let mut growth = size as i64;
    match live::record(key, allocation) {
        Recorded::New => {
            sampling::recorded(tgid, address);
            add_signed(&stats.live_allocations, 1);
        }
        // A block handed out again without a free we saw: the old record was stale. Only a record
        // of this program image counted towards its live figures; one from before an exec did not.
        Recorded::Replaced(stale) if stale.timestamp_ns >= stats.started_ns => {
            growth -= stale.size as i64;
            count_in_stack(tgid, stats, stale.stack, StackChange::freed(stale.size));
        }
        Recorded::Replaced(_) => {
            add_signed(&stats.live_allocations, 1);
        }
        Recorded::Full => {
            add(&stats.lost_events, 1);
            debug::memtrace_allocation_lost(tgid, size, address);
            return;
        }
    }
    count_in_stack(tgid, stats, stack, StackChange::allocated(size));
    let live = add_signed(&stats.live_bytes, growth);
    raise_peak(stats, live);
}

/// A block freed; `temporary` when its thread allocated nothing since (heaptrack's temporary
/// allocations). Returns false for a free of a block with no record of this image (untracked),
/// which the caller counts.
fn record_free(tgid: u32, stats: &ProcessStats, address: u64, temporary: bool) -> bool {
    if address == 0 || !sampling::may_be_recorded(tgid, address) {
        return true;
    }
    let key = AllocationKey { tgid, _pad: 0, address };
    // None also when another thread freed the same block first (a double free in the target).
    let Some(allocation) = live::remove(key) else {
        return false;
    };
    let stale = allocation.timestamp_ns < stats.started_ns;
    sampling::released(tgid, address);
    if stale {
        return false;
    }
    add(&stats.frees, 1);
    add(&stats.freed_bytes, allocation.size);
    add_signed(&stats.live_allocations, -1);
    add_signed(&stats.live_bytes, -(allocation.size as i64));
    if temporary {
        add(&stats.temporary_allocations, 1);
        add(&stats.temporary_bytes, allocation.size);
    }
    let change = StackChange { allocations: -1, bytes: -(allocation.size as i64), temporary };
    count_in_stack(tgid, stats, allocation.stack, change);
    true
}

/// A free inside an allocator call (realloc's): an untracked block is an untracked free.
fn record_inner_free(tgid: u32, stats: &ProcessStats, address: u64) {
    if !record_free(tgid, stats, address, false) {
        add(&stats.untracked_frees, 1);
    }
}

fn record_realloc(tgid: u32, stats: &ProcessStats, call: PendingCall, result: u64, stack: u64) {
    match (call.address, result) {
        (0, _) => record_allocation(tgid, stats, call.size, result, stack),
        // glibc's realloc(p, 0) frees p and returns NULL.
        (old, 0) if call.size == 0 => record_inner_free(tgid, stats, old),
        // A failed realloc leaves the old block live.
        (_, 0) => record_allocation(tgid, stats, call.size, 0, stack),
        (old, new) => {
            record_inner_free(tgid, stats, old);
            record_allocation(tgid, stats, call.size, new, stack);
        }
    }
}

/// `--window`: whether a realloc out of a window moves a block a window recorded (the only call
/// out of a window that counts: the record follows the block).
fn moves_recorded_block(tgid: u32, function: AllocatorFunction, call: PendingCall) -> bool {
    let reallocates = matches!(function, AllocatorFunction::Realloc | AllocatorFunction::Reallocarray);
    reallocates
        && call.address != 0
        && sampling::may_be_recorded(tgid, call.address)
        && live::contains(AllocationKey { tgid, _pad: 0, address: call.address })
}

/// n * size as calloc and reallocarray compute it, saturated: an overflowing request fails in glibc,
/// and a wrapped product of 0 would make a failed reallocarray look like a free.
fn array_size(n: u64, size: u64) -> u64 {
    // In 32-bit halves: u64::checked_mul and every overflow test LLVM recognises as one would need a
    // 128-bit multiply, which BPF lacks.
    let (n_high, n_low) = (n >> 32, n & 0xffff_ffff);
    let (size_high, size_low) = (size >> 32, size & 0xffff_ffff);
    if n_high != 0 && size_high != 0 {
        return u64::MAX;
    }
    let cross = n_high * size_low + size_high * n_low;
    if cross >> 32 != 0 {
        return u64::MAX;
    }
    let low = n_low * size_low;
    let product = low.wrapping_add(cross << 32);
    if product < low {
        u64::MAX
    } else {
        product
    }
}

fn on_return(ctx: &RetProbeContext) -> u32 {
    let Some((tgid, thread, function)) = take_pending() else {
        return 0;
    };
    let call = thread.call;
    if !windowed::entered_in_window(thread) && !moves_recorded_block(tgid, function, call) {
        return 0;
    }
    let Some(stats) = stats_of(tgid) else {
        return 0;
    };
    note_allocator(ctx, stats);
    let result: u64 = ctx.ret();
    let allocated = match function {
        AllocatorFunction::PosixMemalign => result as i32 == 0,
        // Nothing is allocated on failure, and realloc(p, 0) only frees.
        _ => result != 0,
    };
    if allocated {
        // Whatever the thread freed from now on is no longer its latest block. (posix_memalign's
        // block is known once read: its result is 0.)
        thread.last_block = result;
    }
    if allocated && !sampling::take(thread, call.size) {
        // Not sampled: exact counts only; the block gets no record, so its free finds none.
        add(&stats.allocations, 1);
        add(&stats.allocated_bytes, call.size);
        if matches!(function, AllocatorFunction::Realloc | AllocatorFunction::Reallocarray) {
            // realloc(p, n) releases p whether or not the new block is sampled.
            record_inner_free(tgid, stats, call.address);
        }
        return 0;
    }
    let stack = if allocated { capture_stack(ctx, tgid, stats) } else { NO_STACK };
    match function {
        AllocatorFunction::Realloc | AllocatorFunction::Reallocarray => {
            record_realloc(tgid, stats, call, result, stack)
        }
        // posix_memalign returns 0 on success and stores the block through its first argument.
        AllocatorFunction::PosixMemalign if result as i32 != 0 => {
            record_allocation(tgid, stats, call.size, 0, stack)
        }
        // SAFETY: the helper checks the user address and fails rather than faults.
        AllocatorFunction::PosixMemalign => {
            match unsafe { bpf_probe_read_user(call.address as *const u64) } {
                Ok(block) => {
                    thread.last_block = block;
                    record_allocation(tgid, stats, call.size, block, stack)
                }
                Err(_) => add(&stats.lost_events, 1),
            }
        }
        _ => record_allocation(tgid, stats, call.size, result, stack),
    }
    0
}

/// Every allocator entry point of every allocator: the cookie says which one fired, so one link
/// carries a whole file's probes.
#[uprobe]
pub fn alloc_enter(ctx: ProbeContext) -> u32 {
    use AllocatorFunction::*;
    kernel_stack::stay_on_kernel_stack(&ctx);
    let cookie = ProbeCookie(attach_cookie(&ctx));
    let Some(function) = cookie.function() else {
        return 0;
    };
    let registers = cookie.registers();
    let arg = |n| argument(&ctx, registers, n);
    let (size, address) = match function {
        Malloc | Valloc | Pvalloc => (arg(0), 0),
        Calloc => (array_size(arg(0), arg(1)), 0),
        Realloc => (arg(1), arg(0)),
        Reallocarray => (array_size(arg(1), arg(2)), arg(0)),
        PosixMemalign => (arg(2), arg(0)),
        AlignedAlloc | Memalign => (arg(1), 0),
        Free => return on_free(&ctx, arg(0)),
    };
    on_enter(function, size, address)
}

/// The return of every allocator entry point but free. Which one returns is the thread's to say
/// (`take_pending`), not the cookie's: one helper call less.
#[uretprobe]
pub fn alloc_exit(ctx: RetProbeContext) -> u32 {
    kernel_stack::stay_on_kernel_stack(&ctx);
    on_return(&ctx)
}

/// free needs no return probe. Its probe may sit past its first instructions (glibc's leading
/// `test %rdi,%rdi`, which the kernel would single-step), where the pointer may have moved: the
/// caller reads it where the cookie says.
fn on_free(ctx: &ProbeContext, address: u64) -> u32 {
    let caller = caller();
    let Some(thread) = traced_thread(&caller) else {
        return 0;
    };
    windowed::forget_abandoned_call(thread, windowed::generation());
    // realloc(p, 0) frees through free(); the realloc return probe accounts for it.
    let FreeBy::Program { temporary } = free_by(thread, address) else {
        return 0;
    };
    let tgid = caller.tgid;
    // Sampling: most blocks have no record, and their frees nothing to account.
    if !sampling::may_be_recorded(tgid, address) {
        return 0;
    }
    let Some(stats) = stats_of(tgid) else {
        return 0;
    };
    note_allocator(ctx, stats);
    if !record_free(tgid, stats, address, temporary) {
        let allocator = ProbeCookie(attach_cookie(ctx)).allocator();
        let untracked = match stacks::called_from_within(ctx, tgid, allocator) {
            true => &stats.allocator_internal_frees,
            false => &stats.untracked_frees,
        };
        add(untracked, 1);
    }
    0
}

/// The floor of exact tracing, for `cargo xtask bench` (`memtrace --empty-probes`): programs that
/// do nothing, attached where alloc_enter and alloc_exit are.
#[uprobe]
pub fn empty_enter(_ctx: ProbeContext) -> u32 {
    0
}

#[uretprobe]
pub fn empty_exit(_ctx: RetProbeContext) -> u32 {
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
