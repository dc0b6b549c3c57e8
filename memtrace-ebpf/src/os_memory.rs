//! What traced processes take from the OS themselves, beside the heap: private anonymous mappings,
//! told apart by who made them (inside an allocator call: the allocator's; otherwise the program's,
//! thread stacks left to dark memory), and, as a process exits, the kernel's own memory counters.
//!
//! Memory syscalls are seen at sys_enter and sys_exit (raw tracepoints: every syscall on the host
//! fires them, so the first test is the syscall number). A mapping is followed by its start: an
//! unmap of a mapping's head shrinks it, an unmap that starts inside one is not followed.

use aya_ebpf::{
    macros::{map, raw_tracepoint},
    maps::{Array, HashMap},
    programs::RawTracePointContext,
};
use memtrace_common::{
    mm_counter, region_kind, ExitMemory, PendingSyscall, ProcessStats, Region, RegionKey, MAX_REGIONS,
};

use crate::{
    counters::{add, add_signed},
    kernel::{current_task, layout, read_at},
    processes::{caller, is_traced_process, stats_of, Caller},
    threads,
};

#[map]
static REGIONS: HashMap<RegionKey, Region> = HashMap::with_max_entries(MAX_REGIONS, 0);

/// Memory syscalls of traced processes entered and not yet seen to exit, over every thread: while
/// none is, a syscall's exit costs one array read (every syscall on the host comes through it).
#[map]
static IN_FLIGHT: Array<u64> = Array::with_max_entries(1, 0);

fn in_flight() -> Option<&'static u64> {
    // SAFETY: a map value, valid while the program runs.
    IN_FLIGHT.get_ptr(0).map(|count| unsafe { &*count })
}

const SYS_MMAP: u64 = 9;
const SYS_MUNMAP: u64 = 11;
const SYS_MREMAP: u64 = 25;
const MAP_SHARED: u64 = 0x01;
const MAP_ANONYMOUS: u64 = 0x20;
const MAP_STACK: u64 = 0x20000;
const PROT_NONE: u64 = 0;
/// Syscalls return -errno in [-4095, -1].
const MAX_ERRNO: u64 = 4095;

/// x86-64 syscall arguments in `struct pt_regs`: di, si, dx, r10, r8 (its user ABI, fixed).
const ARG_OFFSETS: [u32; 5] = [112, 104, 96, 56, 72];
/// `orig_ax` in `struct pt_regs`: the syscall number, also at its exit.
const NR_OFFSET: u32 = 120;

fn is_memory_syscall(nr: u64) -> bool {
    matches!(nr, SYS_MMAP | SYS_MUNMAP | SYS_MREMAP)
}

#[raw_tracepoint(tracepoint = "sys_enter")]
pub fn memory_syscall_enter(ctx: RawTracePointContext) -> u32 {
    // TP_PROTO(struct pt_regs *regs, long id)
    let nr: u64 = ctx.arg(1);
    if !is_memory_syscall(nr) {
        return 0;
    }
    let Caller { tgid, tid } = caller();
    if !is_traced_process(tgid) {
        return 0;
    }
    let regs: u64 = ctx.arg(0);
    let mut args = [0u64; 5];
    for (arg, offset) in args.iter_mut().zip(ARG_OFFSETS) {
        *arg = read_at(regs, offset).unwrap_or(0);
    }
    let Some(thread) = threads::find_or_make(tid) else {
        return 0;
    };
    let inside_allocator = u64::from(thread.depth != 0);
    if thread.syscall.nr == 0 {
        if let Some(count) = in_flight() {
            add(count, 1);
        }
    }
    thread.syscall = PendingSyscall { nr, args, inside_allocator };
    0
}

#[raw_tracepoint(tracepoint = "sys_exit")]
pub fn memory_syscall_exit(ctx: RawTracePointContext) -> u32 {
    // TP_PROTO(struct pt_regs *regs, long ret). Every syscall on the host comes here.
    let Some(count) = in_flight() else {
        return 0;
    };
    // SAFETY: a map value; a plain read, as a stale one only delays the test below.
    if unsafe { core::ptr::read_volatile(count) } == 0 {
        return 0;
    }
    let Caller { tgid, tid } = caller();
    let Some(thread) = crate::threads::find(tid) else {
        return 0;
    };
    if thread.syscall.nr == 0 {
        return 0;
    }
    let call = thread.syscall;
    thread.syscall.nr = 0;
    add_signed(as_signed(count), -1);
    // The exit of another syscall, where this program was attached while the thread was inside
    // one: what it entered is not known to have returned.
    let regs: u64 = ctx.arg(0);
    if read_at::<u64>(regs, NR_OFFSET) != Some(call.nr) {
        return 0;
    }
    let result: u64 = ctx.arg(1);
    if result > u64::MAX - MAX_ERRNO {
        return 0;
    }
    let Some(stats) = stats_of(tgid) else {
        return 0;
    };
    match call.nr {
        SYS_MMAP => mapped(tgid, stats, &call, result),
        SYS_MUNMAP => unmapped(tgid, stats, call.args[0], call.args[1]),
        _ => remapped(tgid, stats, &call, result),
    }
    0
}

/// mmap(addr, len, prot, flags, fd): a private anonymous mapping joins its maker's figure.
/// Reservations (PROT_NONE) hold no memory and are not followed.
fn mapped(tgid: u32, stats: &ProcessStats, call: &PendingSyscall, start: u64) {
    let [_, len, prot, flags, _] = call.args;
    if flags & MAP_ANONYMOUS == 0 || flags & MAP_SHARED != 0 || prot == PROT_NONE {
        return;
    }
    let kind = if call.inside_allocator != 0 {
        region_kind::ALLOCATOR
    } else if flags & MAP_STACK != 0 {
        region_kind::STACK
    } else {
        region_kind::PROGRAM
    };
    follow(tgid, stats, start, Region { len: page_aligned(len), kind });
}

/// munmap(addr, len) of a followed mapping, whole or its head.
fn unmapped(tgid: u32, stats: &ProcessStats, start: u64, len: u64) {
    let key = RegionKey { tgid, _pad: 0, start };
    let Some(region) = REGIONS.get_ptr(&key) else {
        return;
    };
    // SAFETY: a map value, valid while the program runs.
    let region = unsafe { *region };
    let _ = REGIONS.remove(&key);
    let len = page_aligned(len).min(region.len);
    count(stats, region.kind, -(len as i64));
    if len < region.len {
        let rest = Region { len: region.len - len, kind: region.kind };
        follow_again(tgid, stats, start + len, rest);
    }
}

/// mremap(old, old_len, new_len, flags, new_addr): a followed mapping moves and takes its new size.
fn remapped(tgid: u32, stats: &ProcessStats, call: &PendingSyscall, start: u64) {
    let key = RegionKey { tgid, _pad: 0, start: call.args[0] };
    let Some(region) = REGIONS.get_ptr(&key) else {
        return;
    };
    // SAFETY: as in unmapped.
    let region = unsafe { *region };
    let _ = REGIONS.remove(&key);
    count(stats, region.kind, -(region.len as i64));
    follow(tgid, stats, start, Region { len: page_aligned(call.args[2]), kind: region.kind });
}

fn follow(tgid: u32, stats: &ProcessStats, start: u64, region: Region) {
    count(stats, region.kind, region.len as i64);
    follow_again(tgid, stats, start, region);
}

/// Records a mapping whose bytes are counted already; a full table loses it (counted).
fn follow_again(tgid: u32, stats: &ProcessStats, start: u64, region: Region) {
    if REGIONS.insert(&RegionKey { tgid, _pad: 0, start }, &region, 0).is_err() {
        count(stats, region.kind, -(region.len as i64));
        add(&stats.lost_events, 1);
    }
}

fn count(stats: &ProcessStats, kind: u64, bytes: i64) {
    match kind {
        region_kind::ALLOCATOR => {
            add_signed(&stats.allocator_mapped_bytes, bytes);
        }
        region_kind::PROGRAM => {
            add_signed(&stats.program_mapped_bytes, bytes);
        }
        _ => {}
    }
}

fn as_signed(count: &u64) -> &i64 {
    // SAFETY: the same eight bytes, read as a two's complement count.
    unsafe { &*(count as *const u64 as *const i64) }
}

fn page_aligned(len: u64) -> u64 {
    len.saturating_add(4095) & !4095
}

/// The kernel's memory counters of the exiting process, read before its memory is released: its
/// resident and swapped pages as /proc/PID/status shows them, and the size of its brk heap.
pub(crate) fn exit_memory() -> Option<ExitMemory> {
    let layout = layout();
    if layout.task_mm == 0 {
        return None;
    }
    let mm: u64 = read_at(current_task(), layout.task_mm)?;
    let mut memory = ExitMemory { read: 1, ..ExitMemory::default() };
    for counter in
        [mm_counter::FILE_PAGES, mm_counter::ANON_PAGES, mm_counter::SWAP_ENTRIES, mm_counter::SHMEM_PAGES]
    {
        let at =
            layout.mm_rss_stat + counter as u32 * layout.percpu_counter_size + layout.percpu_counter_count;
        let pages: i64 = read_at(mm, at)?;
        // As /proc reads it: per-CPU deltas can leave the shared count below zero for a moment.
        if let Some(slot) = memory.pages.get_mut(counter) {
            *slot = pages.max(0) as u64;
        }
    }
    let start: u64 = read_at(mm, layout.mm_start_brk)?;
    let end: u64 = read_at(mm, layout.mm_brk)?;
    memory.heap_break_bytes = end.saturating_sub(start);
    Some(memory)
}
