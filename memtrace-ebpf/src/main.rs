//! memtrace's kernel side: uprobes on every glibc allocator entry point.
//!
//! Entry probes remember the arguments per (thread, function); return probes turn the result into an
//! allocation, a free or a failure and update per-process totals. Only the outermost allocator call of a
//! thread counts: glibc's realloc(NULL, n) and memalign call malloc, reallocarray calls realloc, and
//! realloc(p, 0) calls free, and none of those inner calls is a second allocation.
#![no_std]
#![no_main]
// The prebuilt `core` for bpfel has no atomic read-modify-write types; the counters use BPF atomics directly.
#![feature(asm_experimental_arch)]

mod usdt;

use core::arch::asm;

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_F_USER_BUILD_ID, BPF_F_USER_STACK, BPF_NOEXIST},
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user,
        generated::{bpf_get_attach_cookie, bpf_get_stack},
    },
    macros::{map, raw_tracepoint, uprobe, uretprobe},
    maps::{Array, HashMap, PerCpuArray, RingBuf},
    programs::{ProbeContext, RawTracePointContext, RetProbeContext},
    EbpfContext,
};
use memtrace_common::{
    Allocation, AllocationKey, AllocatorFunction, ExecEvent, PendingCall, PendingKey, ProcessStats,
    StackFrames, StackKey, StackTotals, DEFAULT_MAX_LIVE_ALLOCATIONS, EXEC_EVENTS_BYTES, GLOBAL_LOST_SLOT,
    MAX_EXCLUDED_PIDS, MAX_PENDING_CALLS, MAX_PROCESSES, MAX_STACKS, MAX_STACK_TOTALS, NO_STACK, STACK_DEPTH,
};

#[map]
static STATS: HashMap<u32, ProcessStats> = HashMap::with_max_entries(MAX_PROCESSES, 0);

#[map]
static ALLOCATIONS: HashMap<AllocationKey, Allocation> =
    HashMap::with_max_entries(DEFAULT_MAX_LIVE_ALLOCATIONS, 0);

#[map]
static PENDING: HashMap<PendingKey, PendingCall> = HashMap::with_max_entries(MAX_PENDING_CALLS, 0);

/// Allocator calls in progress per thread; present only while a thread is inside one.
#[map]
static DEPTH: HashMap<u32, u32> = HashMap::with_max_entries(MAX_PENDING_CALLS, 0);

#[map]
static LOST_EVENTS: Array<u64> = Array::with_max_entries(1, 0);

/// Call stacks by a 64-bit hash of their frames; allocated on demand, as few stacks are distinct.
#[map]
static STACKS: HashMap<u64, StackFrames> = HashMap::with_max_entries(MAX_STACKS, BPF_F_NO_PREALLOC);

#[map]
static STACK_TOTALS: HashMap<StackKey, StackTotals> = HashMap::with_max_entries(MAX_STACK_TOTALS, 0);

/// A stack is 1 KiB, more than the BPF stack holds: it is captured here first.
#[map]
static STACK_SCRATCH: PerCpuArray<StackFrames> = PerCpuArray::with_max_entries(1, 0);

/// Set by the loader: 0 when run with --no-stacks.
#[no_mangle]
static CAPTURE_STACKS: u8 = 1;

/// Set by the loader for system-wide tracing, where probes fire in every process: memtrace's own
/// pid, and whether to consult EXCLUDED_PIDS and ONLY_COMM.
#[no_mangle]
static SELF_TGID: u32 = 0;
#[no_mangle]
static FILTER_PROCESSES: u8 = 0;
/// Trace only processes with this command name (all when empty).
#[no_mangle]
static ONLY_COMM: [u8; 16] = [0; 16];

#[map]
static EXCLUDED_PIDS: HashMap<u32, u8> = HashMap::with_max_entries(MAX_EXCLUDED_PIDS, 0);

#[map]
static EXEC_EVENTS: RingBuf = RingBuf::with_byte_size(EXEC_EVENTS_BYTES, 0);

const EEXIST: i32 = 17;

struct Caller {
    tgid: u32,
    tid: u32,
}

fn caller() -> Caller {
    let pid_tgid = bpf_get_current_pid_tgid();
    Caller { tgid: (pid_tgid >> 32) as u32, tid: pid_tgid as u32 }
}

/// Atomically adds `n` to a counter in a map value and returns the counter's previous value. Atomic
/// because threads of one process update the same value from different CPUs.
fn fetch_add(counter: *const u64, n: u64) -> u64 {
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
fn compare_exchange(target: *const u64, expected: u64, new: u64) -> u64 {
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

fn add(counter: &u64, n: u64) {
    fetch_add(counter, n);
}

/// Adds a signed change and returns the new value.
fn add_signed(counter: &i64, n: i64) -> i64 {
    fetch_add(counter as *const i64 as *const u64, n as u64) as i64 + n
}

fn count_global_loss() {
    if let Some(lost) = LOST_EVENTS.get_ptr_mut(GLOBAL_LOST_SLOT) {
        add(unsafe { &*lost }, 1);
    }
}

/// The totals of a process, created on its first event. None (and a global loss) when the map is full.
fn stats_of(tgid: u32) -> Option<&'static ProcessStats> {
    if let Some(stats) = STATS.get_ptr(tgid) {
        return Some(unsafe { &*stats });
    }
    let fresh = ProcessStats {
        comm: bpf_get_current_comm().unwrap_or_default(),
        started_ns: unsafe { bpf_ktime_get_ns() },
        ..ProcessStats::default()
    };
    let _ = STATS.insert(tgid, fresh, u64::from(BPF_NOEXIST));
    match STATS.get_ptr(tgid) {
        Some(stats) => Some(unsafe { &*stats }),
        None => {
            count_global_loss();
            None
        }
    }
}

/// Whether events of this process count; only system-wide tracing ever says no.
fn is_traced(tgid: u32) -> bool {
    if unsafe { core::ptr::read_volatile(&FILTER_PROCESSES) } == 0 {
        return true;
    }
    if tgid == unsafe { core::ptr::read_volatile(&SELF_TGID) } || EXCLUDED_PIDS.get_ptr(tgid).is_some() {
        return false;
    }
    let only = unsafe { core::ptr::read_volatile(&ONLY_COMM) };
    only[0] == 0 || bpf_get_current_comm().is_ok_and(|comm| comm == only)
}

fn raise_peak(stats: &ProcessStats, live: i64) {
    let peak = &stats.peak_live_bytes as *const i64 as *const u64;
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

/// Marks the thread as inside one more allocator call; true when this call is the outermost one.
fn enter_call(tid: u32) -> bool {
    if let Some(depth) = DEPTH.get_ptr_mut(tid) {
        unsafe { *depth += 1 };
        return false;
    }
    DEPTH.insert(tid, 1, 0).is_ok()
}

/// Leaves an allocator call; true when it was the outermost one.
fn leave_call(tid: u32) -> bool {
    let Some(depth) = DEPTH.get_ptr_mut(tid) else {
        return false;
    };
    unsafe {
        if *depth > 1 {
            *depth -= 1;
            return false;
        }
    }
    let _ = DEPTH.remove(tid);
    true
}

fn inside_allocator(tid: u32) -> bool {
    DEPTH.get_ptr(tid).is_some()
}

fn on_enter(function: AllocatorFunction, size: u64, address: u64) -> u32 {
    let Caller { tgid, tid } = caller();
    if !is_traced(tgid) || !enter_call(tid) {
        return 0;
    }
    let key = PendingKey { tid, function: function as u32 };
    if PENDING.insert(key, PendingCall { size, address }, 0).is_err() {
        if let Some(stats) = stats_of(tgid) {
            add(&stats.lost_events, 1);
        }
    }
    0
}

/// The pending call of an outermost allocator call that is returning now.
fn take_pending(function: AllocatorFunction) -> Option<(u32, PendingCall)> {
    let Caller { tgid, tid } = caller();
    if !leave_call(tid) {
        return None;
    }
    let key = PendingKey { tid, function: function as u32 };
    let call = unsafe { *PENDING.get_ptr(key)? };
    let _ = PENDING.remove(key);
    Some((tgid, call))
}

/// The key of the current user stack in STACKS, or NO_STACK. Taken in a return probe, where the
/// frame-pointer walk starts at the allocator's caller.
fn capture_stack(ctx: &RetProbeContext, stats: &ProcessStats) -> u64 {
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
fn count_in_stack(tgid: u32, stats: &ProcessStats, stack: u64, live_allocations: i64, live_bytes: i64) {
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

fn record_allocation(tgid: u32, size: u64, address: u64, stack: u64) {
    let Some(stats) = stats_of(tgid) else { return };
    if address == 0 {
        add(&stats.failed_allocations, 1);
        return;
    }
    add(&stats.allocations, 1);
    add(&stats.allocated_bytes, size);
    let key = AllocationKey { tgid, _pad: 0, address };
    let allocation = Allocation { size, timestamp_ns: unsafe { bpf_ktime_get_ns() }, stack };
    let mut growth = size as i64;
    match ALLOCATIONS.insert(key, allocation, u64::from(BPF_NOEXIST)) {
        Ok(()) => {
            add_signed(&stats.live_allocations, 1);
        }
        Err(err) if err == -EEXIST => {
            // A block handed out again without a free we saw: the old record is stale, replace it.
            // Only a record of this program image counted towards its live figures; one from
            // before an exec did not.
            if let Some(stale) = ALLOCATIONS.get_ptr(key) {
                let stale = unsafe { *stale };
                if stale.timestamp_ns >= stats.started_ns {
                    growth -= stale.size as i64;
                    count_in_stack(tgid, stats, stale.stack, -1, -(stale.size as i64));
                } else {
                    add_signed(&stats.live_allocations, 1);
                }
            }
            if ALLOCATIONS.insert(key, allocation, 0).is_err() {
                add(&stats.lost_events, 1);
                return;
            }
        }
        Err(_) => {
            add(&stats.lost_events, 1);
            return;
        }
    }
    count_in_stack(tgid, stats, stack, 1, size as i64);
    let live = add_signed(&stats.live_bytes, growth);
    raise_peak(stats, live);
}

fn record_free(tgid: u32, address: u64) {
    if address == 0 {
        return;
    }
    let Some(stats) = stats_of(tgid) else { return };
    let key = AllocationKey { tgid, _pad: 0, address };
    let Some(allocation) = ALLOCATIONS.get_ptr(key) else {
        add(&stats.untracked_frees, 1);
        return;
    };
    let allocation = unsafe { *allocation };
    let stale = allocation.timestamp_ns < stats.started_ns;
    if ALLOCATIONS.remove(key).is_err() || stale {
        // Another thread freed the same block first (a double free in the target).
        add(&stats.untracked_frees, 1);
        return;
    }
    add(&stats.frees, 1);
    add(&stats.freed_bytes, allocation.size);
    add_signed(&stats.live_allocations, -1);
    add_signed(&stats.live_bytes, -(allocation.size as i64));
    count_in_stack(tgid, stats, allocation.stack, -1, -(allocation.size as i64));
}

fn record_realloc(tgid: u32, call: PendingCall, result: u64, stack: u64) {
    match (call.address, result) {
        (0, _) => record_allocation(tgid, call.size, result, stack),
        // glibc's realloc(p, 0) frees p and returns NULL.
        (old, 0) if call.size == 0 => record_free(tgid, old),
        // A failed realloc leaves the old block live.
        (_, 0) => record_allocation(tgid, call.size, 0, stack),
        (old, new) => {
            record_free(tgid, old);
            record_allocation(tgid, call.size, new, stack);
        }
    }
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

fn arg(ctx: &ProbeContext, n: usize) -> u64 {
    ctx.arg::<u64>(n).unwrap_or(0)
}

/// Remembers which allocator's probes saw the process: the attachment's cookie names it.
fn note_allocator(ctx: &impl EbpfContext, tgid: u32) {
    if let Some(stats) = STATS.get_ptr_mut(tgid) {
        unsafe {
            if (*stats).allocator == 0 {
                (*stats).allocator = bpf_get_attach_cookie(ctx.as_ptr());
            }
        }
    }
}

fn on_return(ctx: &RetProbeContext, function: AllocatorFunction) -> u32 {
    let Some((tgid, call)) = take_pending(function) else {
        return 0;
    };
    let result: u64 = ctx.ret();
    let stack = match (function, result) {
        // Nothing is allocated on failure, and realloc(p, 0) only frees.
        (AllocatorFunction::PosixMemalign, 0) => stack_of(ctx, tgid),
        (AllocatorFunction::PosixMemalign, _) | (_, 0) => NO_STACK,
        _ => stack_of(ctx, tgid),
    };
    match function {
        AllocatorFunction::Realloc | AllocatorFunction::Reallocarray => {
            record_realloc(tgid, call, result, stack)
        }
        AllocatorFunction::PosixMemalign => {
            // posix_memalign returns 0 on success and stores the block through its first argument.
            if result as i32 != 0 {
                record_allocation(tgid, call.size, 0, stack);
            } else {
                match unsafe { bpf_probe_read_user(call.address as *const u64) } {
                    Ok(block) => record_allocation(tgid, call.size, block, stack),
                    Err(_) => {
                        if let Some(stats) = stats_of(tgid) {
                            add(&stats.lost_events, 1);
                        }
                    }
                }
            }
        }
        _ => record_allocation(tgid, call.size, result, stack),
    }
    note_allocator(ctx, tgid);
    0
}

fn stack_of(ctx: &RetProbeContext, tgid: u32) -> u64 {
    match stats_of(tgid) {
        Some(stats) => capture_stack(ctx, stats),
        None => NO_STACK,
    }
}

#[uprobe]
pub fn malloc_enter(ctx: ProbeContext) -> u32 {
    on_enter(AllocatorFunction::Malloc, arg(&ctx, 0), 0)
}

#[uprobe]
pub fn calloc_enter(ctx: ProbeContext) -> u32 {
    on_enter(AllocatorFunction::Calloc, array_size(arg(&ctx, 0), arg(&ctx, 1)), 0)
}

#[uprobe]
pub fn realloc_enter(ctx: ProbeContext) -> u32 {
    on_enter(AllocatorFunction::Realloc, arg(&ctx, 1), arg(&ctx, 0))
}

#[uprobe]
pub fn reallocarray_enter(ctx: ProbeContext) -> u32 {
    let size = array_size(arg(&ctx, 1), arg(&ctx, 2));
    on_enter(AllocatorFunction::Reallocarray, size, arg(&ctx, 0))
}

#[uprobe]
pub fn posix_memalign_enter(ctx: ProbeContext) -> u32 {
    on_enter(AllocatorFunction::PosixMemalign, arg(&ctx, 2), arg(&ctx, 0))
}

#[uprobe]
pub fn aligned_alloc_enter(ctx: ProbeContext) -> u32 {
    on_enter(AllocatorFunction::AlignedAlloc, arg(&ctx, 1), 0)
}

#[uprobe]
pub fn memalign_enter(ctx: ProbeContext) -> u32 {
    on_enter(AllocatorFunction::Memalign, arg(&ctx, 1), 0)
}

#[uprobe]
pub fn valloc_enter(ctx: ProbeContext) -> u32 {
    on_enter(AllocatorFunction::Valloc, arg(&ctx, 0), 0)
}

#[uprobe]
pub fn pvalloc_enter(ctx: ProbeContext) -> u32 {
    on_enter(AllocatorFunction::Pvalloc, arg(&ctx, 0), 0)
}

#[uretprobe]
pub fn malloc_exit(ctx: RetProbeContext) -> u32 {
    on_return(&ctx, AllocatorFunction::Malloc)
}

#[uretprobe]
pub fn calloc_exit(ctx: RetProbeContext) -> u32 {
    on_return(&ctx, AllocatorFunction::Calloc)
}

#[uretprobe]
pub fn realloc_exit(ctx: RetProbeContext) -> u32 {
    on_return(&ctx, AllocatorFunction::Realloc)
}

#[uretprobe]
pub fn reallocarray_exit(ctx: RetProbeContext) -> u32 {
    on_return(&ctx, AllocatorFunction::Reallocarray)
}

#[uretprobe]
pub fn posix_memalign_exit(ctx: RetProbeContext) -> u32 {
    on_return(&ctx, AllocatorFunction::PosixMemalign)
}

#[uretprobe]
pub fn aligned_alloc_exit(ctx: RetProbeContext) -> u32 {
    on_return(&ctx, AllocatorFunction::AlignedAlloc)
}

#[uretprobe]
pub fn memalign_exit(ctx: RetProbeContext) -> u32 {
    on_return(&ctx, AllocatorFunction::Memalign)
}

#[uretprobe]
pub fn valloc_exit(ctx: RetProbeContext) -> u32 {
    on_return(&ctx, AllocatorFunction::Valloc)
}

#[uretprobe]
pub fn pvalloc_exit(ctx: RetProbeContext) -> u32 {
    on_return(&ctx, AllocatorFunction::Pvalloc)
}

/// free needs no return probe. It may be attached past a leading `test %rdi,%rdi` (which the kernel
/// would single-step); the pointer is still in the first argument register there.
#[uprobe]
pub fn free_enter(ctx: ProbeContext) -> u32 {
    let Caller { tgid, tid } = caller();
    // realloc(p, 0) frees through free(); the realloc return probe accounts for it.
    if !is_traced(tgid) || inside_allocator(tid) {
        return 0;
    }
    record_free(tgid, arg(&ctx, 0));
    note_allocator(&ctx, tgid);
    0
}

/// Marks a process's figures final when it exits, so that system-wide tracing can report and then
/// release it. Threads other than the leader exit without ending the process.
#[raw_tracepoint(tracepoint = "sched_process_exit")]
pub fn process_exit(_ctx: RawTracePointContext) -> u32 {
    let Caller { tgid, tid } = caller();
    if tgid != tid {
        return 0;
    }
    if let Some(stats) = STATS.get_ptr_mut(tgid) {
        unsafe {
            (*stats).comm = bpf_get_current_comm().unwrap_or((*stats).comm);
            (*stats).exited = 1;
        }
    }
    0
}

/// A new program image starts its figures afresh (what the process did before exec, say as the
/// shell that forked it, is not the new program's), and userspace hears of it: the program may bring
/// an allocator not probed yet.
#[raw_tracepoint(tracepoint = "sched_process_exec")]
pub fn process_exec(_ctx: RawTracePointContext) -> u32 {
    let Caller { tgid, .. } = caller();
    let _ = STATS.remove(tgid);
    if !is_traced(tgid) {
        return 0;
    }
    if EXEC_EVENTS.output::<ExecEvent>(ExecEvent { tgid }, 0).is_err() {
        count_global_loss();
    }
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
