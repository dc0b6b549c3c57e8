//! `--debug-bpf`: the kernel side's own diagnostics, as aya-log records that memtrace prints on
//! stderr (memtrace-user/src/kernel/log.rs). Without the flag the loader leaves aya-log's level at 0,
//! a constant of the frozen .rodata: each function below returns at once, and the probes pay a
//! call on the rare paths that make one.
//!
//! Each says what could not be recorded, or why a stack is short, once per cause where it can: a
//! short stack when it is first seen (a stack that repeats is not explained again).
//!
//! They are global functions (`extern "C"`, exported): the verifier checks each once, on its own,
//! and goes on in the caller with one state after the call. Inlined, each way through a record's
//! formatting would be a state of the whole probe from there on, past the verifier's budget.

use aya_log_ebpf::debug;
use memtrace_common::unwind_stop;

/// A stack seen for the first time ended short of the outermost frame: after `depth` frames, for
/// `stop` (`unwind_stop`); `first` and `last` are the return addresses of its first and last frame.
#[inline(never)]
#[no_mangle]
pub extern "C" fn memtrace_short_stack(tgid: u32, depth: u64, stop: u64, first: u64, last: u64) -> i64 {
    if !enabled() || stop == unwind_stop::WHOLE as u64 {
        return 0;
    }
    if stop == unwind_stop::NO_MAPPINGS as u64 {
        debug!(
            &(),
            "pid {}: a new stack ends after {} frames: no_mappings (no mapping table yet: taken by frame pointers from {:x})",
            tgid,
            depth,
            first
        );
    } else {
        debug!(
            &(),
            "pid {}: a new stack ends after {} frames: {} (last frame at {:x})",
            tgid,
            depth,
            stop_name(stop),
            last
        );
    }
    0
}

/// The live-allocation table had no room for a block.
#[inline(never)]
#[no_mangle]
pub extern "C" fn memtrace_allocation_lost(tgid: u32, size: u64, address: u64) -> i64 {
    if enabled() {
        debug!(
            &(),
            "pid {}: the live-allocation table is full: a block of {} bytes at {:x} is lost",
            tgid,
            size,
            address
        );
    }
    0
}

/// The stack totals table had no room for a stack.
#[inline(never)]
#[no_mangle]
pub extern "C" fn memtrace_stack_totals_lost(tgid: u32, stack: u64) -> i64 {
    if enabled() {
        debug!(&(), "pid {}: the stack totals table is full: stack {:x} is not counted", tgid, stack);
    }
    0
}

/// Whether the loader asked for diagnostics: aya-log's level, a load-time constant. (Its test is
/// the one the macros make, from aya-log-ebpf's support module.)
fn enabled() -> bool {
    use aya_log_ebpf::macro_support::{level_enabled, Level};
    level_enabled(Level::Debug)
}

/// `unwind_stop::NAMES[stop]`, as literals: a table of &str holds pointers, which BPF data cannot
/// (the verifier reads them as plain numbers).
fn stop_name(stop: u64) -> &'static str {
    match stop as usize {
        unwind_stop::NO_MAPPING => "no_mapping",
        unwind_stop::NO_TABLE => "no_table",
        unwind_stop::NO_ROW => "no_row",
        unwind_stop::UNSUPPORTED => "unsupported",
        unwind_stop::READ_FAULT => "read_fault",
        _ => "depth_limit",
    }
}
