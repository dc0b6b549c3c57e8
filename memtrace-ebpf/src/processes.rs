//! Which processes are traced, their per-process totals, and what happens when they exec or exit.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns, generated::bpf_get_attach_cookie,
    },
    macros::{map, raw_tracepoint},
    maps::{Array, HashMap, RingBuf},
    programs::RawTracePointContext,
    EbpfContext,
};
use memtrace_common::{
    ExecEvent, ProbeCookie, ProcessStats, EXEC_EVENTS_BYTES, GLOBAL_LOST_SLOT, MAX_COMMS, MAX_EXCLUDED_PIDS,
    MAX_PROCESSES,
};

use crate::counters::{add, compare_exchange};

#[map]
pub(crate) static STATS: HashMap<u32, ProcessStats> = HashMap::with_max_entries(MAX_PROCESSES, 0);

#[map]
pub(crate) static LOST_EVENTS: Array<u64> = Array::with_max_entries(1, 0);

/// Set by the loader for system-wide tracing, where probes fire in every process: memtrace's own
/// pid, and whether to consult EXCLUDED_PIDS and ALLOWED_COMMS.
#[no_mangle]
pub(crate) static SELF_TGID: u32 = 0;
#[no_mangle]
pub(crate) static FILTER_PROCESSES: u8 = 0;
/// Set when `--comm` names commands: only processes whose command name is in ALLOWED_COMMS count.
#[no_mangle]
pub(crate) static FILTER_COMMS: u8 = 0;

/// The command names of `--comm`, NUL-padded to 16 bytes as bpf_get_current_comm returns them.
#[map]
pub(crate) static ALLOWED_COMMS: HashMap<[u8; 16], u8> = HashMap::with_max_entries(MAX_COMMS, 0);

#[map]
pub(crate) static EXCLUDED_PIDS: HashMap<u32, u8> = HashMap::with_max_entries(MAX_EXCLUDED_PIDS, 0);

#[map]
pub(crate) static EXEC_EVENTS: RingBuf = RingBuf::with_byte_size(EXEC_EVENTS_BYTES, 0);

pub(crate) struct Caller {
    pub(crate) tgid: u32,
    pub(crate) tid: u32,
}

pub(crate) fn caller() -> Caller {
    let pid_tgid = bpf_get_current_pid_tgid();
    Caller { tgid: (pid_tgid >> 32) as u32, tid: pid_tgid as u32 }
}

pub(crate) fn count_global_loss() {
    if let Some(lost) = LOST_EVENTS.get_ptr_mut(GLOBAL_LOST_SLOT) {
        add(unsafe { &*lost }, 1);
    }
}

/// The totals of a process, created on its first event. None (and a global loss) when the map is full.
pub(crate) fn stats_of(tgid: u32) -> Option<&'static ProcessStats> {
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
pub(crate) fn is_traced(tgid: u32) -> bool {
    if unsafe { core::ptr::read_volatile(&FILTER_PROCESSES) } == 0 {
        return true;
    }
    if tgid == unsafe { core::ptr::read_volatile(&SELF_TGID) } || EXCLUDED_PIDS.get_ptr(tgid).is_some() {
        return false;
    }
    if unsafe { core::ptr::read_volatile(&FILTER_COMMS) } == 0 {
        return true;
    }
    bpf_get_current_comm().is_ok_and(|comm| ALLOWED_COMMS.get_ptr(&comm).is_some())
}

/// The BPF cookie of the attachment that ran the program.
pub(crate) fn attach_cookie(ctx: &impl EbpfContext) -> u64 {
    // SAFETY: the context is the program's own, as the helper expects.
    unsafe { bpf_get_attach_cookie(ctx.as_ptr()) }
}

/// Remembers which allocator's probes saw the process: the attachment's cookie names it.
pub(crate) fn note_allocator(ctx: &impl EbpfContext, stats: &ProcessStats) {
    if stats.allocator == 0 {
        // The first allocator to see the process wins a race between its threads.
        compare_exchange(&stats.allocator, 0, ProbeCookie(attach_cookie(ctx)).allocator());
    }
}

/// Marks a process's figures final when it exits, so that system-wide tracing can report and then
/// release it. Threads other than the leader exit without ending the process. Attached in every
/// mode: each thread's allocator slot is released here.
#[raw_tracepoint(tracepoint = "sched_process_exit")]
pub fn process_exit(_ctx: RawTracePointContext) -> u32 {
    let Caller { tgid, tid } = caller();
    // Every exiting thread gives back its allocator slot.
    let _ = crate::THREADS.remove(tid);
    if tgid != tid {
        return 0;
    }
    if let Some(stats) = STATS.get_ptr_mut(tgid) {
        // SAFETY: a map value, valid while the program runs.
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
    // The old image's mappings are gone; userspace writes the new image's table.
    let _ = crate::stacks::UNWIND_MAPPINGS.remove(tgid);
    if !is_traced(tgid) {
        return 0;
    }
    if EXEC_EVENTS.output::<ExecEvent>(ExecEvent { tgid }, 0).is_err() {
        count_global_loss();
    }
    0
}
