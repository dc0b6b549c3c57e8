//! `--app-sampled`: the allocator samples inside itself and says so through OpenTelemetry's
//! memory-profiling probes, `otel_memory:alloc(ptr, size, weighted_bytes)` and
//! `otel_memory:free(ptr)` (USDT). memtrace attaches here instead of on malloc and free, so only
//! the allocator's samples enter the kernel. A sample is recorded as a block of `weighted_bytes`
//! (the bytes it stands for, at least `size`): every byte figure of such a process is the
//! allocator's unbiased estimate, and its block counts are the samples.
//!
//! Not sleepable (unlike usdt_site): the arguments are read from registers or the stack, which
//! the allocator has just touched, and the stack walk runs in a claimed slot as alloc_exit's does.

use aya_ebpf::{macros::uprobe, programs::ProbeContext, programs::RetProbeContext, EbpfContext};
use memtrace_common::{usdt_action, ProcessStats, UsdtSpec};

use crate::{
    counters::add,
    kernel_stack, processes,
    stacks::capture_stack,
    usdt::{read_arg, USDT_SPECS},
};

/// One program at both probes: the site's cookie indexes its one spec in `USDT_SPECS`.
#[uprobe]
pub fn sampled_site(ctx: ProbeContext) -> u32 {
    kernel_stack::stay_on_kernel_stack(&ctx);
    let caller = processes::caller();
    if !processes::is_traced(caller.tgid) {
        return 0;
    }
    let Some(spec) = USDT_SPECS.get(processes::attach_cookie(&ctx) as u32) else {
        return 0;
    };
    let Some(stats) = processes::stats_of(caller.tgid) else {
        return 0;
    };
    match spec.action {
        // The stack first, from this program's own small frame: the walk's chain of calls needs
        // the 512 bytes (6.1's verifier counts each frame rounded up to 32 bytes), and the
        // arguments are read after it, in a frame of their own.
        usdt_action::SAMPLED_ALLOC => {
            let stack = capture_stack(&RetProbeContext::new(ctx.as_ptr()), caller.tgid, stats);
            sampled_alloc(&ctx, caller.tgid, stats, spec, stack)
        }
        usdt_action::SAMPLED_FREE => sampled_free(&ctx, caller.tgid, stats, spec),
        _ => {}
    }
    0
}

/// A sample: recorded as a block of its weighted bytes, with the stack the walk found where the
/// allocator fired the probe (its own frames head it).
#[inline(never)]
fn sampled_alloc(ctx: &ProbeContext, tgid: u32, stats: &ProcessStats, spec: &UsdtSpec, stack: u64) {
    let (Some(address), Some(size), Some(weighted)) = (
        read_arg::<false>(ctx, &spec.args[0]),
        read_arg::<false>(ctx, &spec.args[1]),
        read_arg::<false>(ctx, &spec.args[2]),
    ) else {
        add(&stats.lost_events, 1);
        return;
    };
    crate::record_allocation(tgid, stats, weighted.max(size) as u64, address as u64, stack);
}

#[inline(never)]
fn sampled_free(ctx: &ProbeContext, tgid: u32, stats: &ProcessStats, spec: &UsdtSpec) {
    let Some(address) = read_arg::<false>(ctx, &spec.args[0]) else {
        add(&stats.lost_events, 1);
        return;
    };
    // The allocator fires this only for blocks it sampled: one with no record was sampled before
    // memtrace came.
    if !crate::record_free(tgid, stats, address as u64, false) {
        add(&stats.untracked_frees, 1);
    }
}
