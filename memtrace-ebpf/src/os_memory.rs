//! What traced processes take from the OS themselves, beside the heap: private anonymous mappings,
//! told apart by who made them (inside an allocator call: the allocator's; otherwise the program's,
//! thread stacks left to dark memory). What the kernel itself counts of a process as it exits is
//! read in kernel.rs.
//!
//! Mappings are seen where programs and allocators make them: uprobes on the C library's mmap,
//! munmap and mremap (the cookie says which, and where the arguments are), read at
//! return. Not on the syscalls: a syscall
//! tracepoint taxes every syscall on the host, and on this kernel every uretprobe's return too (its
//! trampoline is a syscall). Mappings made by raw syscalls around the C library (the dynamic
//! loader's own) are not seen. A mapping is followed by its start: an unmap of a mapping's head
//! shrinks it, an unmap that starts inside one is not followed.

use aya_ebpf::{
    macros::{map, uprobe, uretprobe},
    maps::HashMap,
    programs::{ProbeContext, RetProbeContext},
};
use memtrace_common::{
    region_kind, MapFunction, PendingMapCall, ProbeCookie, ProcessStats, Region, RegionKey, MAX_REGIONS,
};

use crate::{
    arguments::argument,
    counters::{add, add_signed},
    processes::{attach_cookie, caller, stats_of, traced_thread},
};

#[map]
static REGIONS: HashMap<RegionKey, Region> = HashMap::with_max_entries(MAX_REGIONS, 0);

const MAP_SHARED: u64 = 0x01;
const MAP_ANONYMOUS: u64 = 0x20;
const MAP_STACK: u64 = 0x20000;
const PROT_NONE: u64 = 0;
/// The C library returns MAP_FAILED (-1) or -1 on failure; the raw syscalls -errno in [-4095, -1].
const MAX_ERRNO: u64 = 4095;

/// A mapping call's entry: its arguments, kept in the thread's slot for its return.
#[uprobe]
pub fn map_enter(ctx: ProbeContext) -> u32 {
    crate::kernel_stack::stay_on_kernel_stack(&ctx);
    let cookie = ProbeCookie(attach_cookie(&ctx));
    let Some(function) = MapFunction::from_discriminant(cookie.discriminant()) else {
        return 0;
    };
    let Some(thread) = traced_thread(&caller()) else {
        return 0;
    };
    let mut args = [0u64; 5];
    for (n, arg) in args.iter_mut().enumerate() {
        *arg = argument(&ctx, cookie.registers(), n);
    }
    let inside_allocator = u64::from(thread.depth != 0);
    thread.map_call = PendingMapCall { function: function as u64, args, inside_allocator };
    0
}

/// A mapping call's return: what it mapped, unmapped or moved is accounted.
#[uretprobe]
pub fn map_exit(ctx: RetProbeContext) -> u32 {
    crate::kernel_stack::stay_on_kernel_stack(&ctx);
    let caller = caller();
    let Some(thread) = crate::threads::find(caller.tid) else {
        return 0;
    };
    let call = thread.map_call;
    thread.map_call.function = 0;
    let Some(function) = MapFunction::from_discriminant(call.function) else {
        return 0;
    };
    let result: u64 = ctx.ret();
    if result > u64::MAX - MAX_ERRNO {
        return 0;
    }
    let Some(stats) = stats_of(caller.tgid) else {
        return 0;
    };
    match function {
        MapFunction::Mmap => mapped(caller.tgid, stats, &call, result),
        MapFunction::Munmap => unmapped(caller.tgid, stats, call.args[0], call.args[1]),
        MapFunction::Mremap => remapped(caller.tgid, stats, &call, result),
    }
    0
}

/// mmap(addr, len, prot, flags, fd): a private anonymous mapping joins its maker's figure.
/// Reservations (PROT_NONE) hold no memory and are not followed.
fn mapped(tgid: u32, stats: &ProcessStats, call: &PendingMapCall, start: u64) {
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
fn remapped(tgid: u32, stats: &ProcessStats, call: &PendingMapCall, start: u64) {
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

fn page_aligned(len: u64) -> u64 {
    len.saturating_add(4095) & !4095
}
