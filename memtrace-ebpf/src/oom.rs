//! The kernel's OOM killer chose a victim (oom:mark_victim, for a global OOM and a memory cgroup's
//! alike): userspace hears of it at once, with the victim's memory counters read here, before its
//! exit or the OOM reaper frees them. The victim's live blocks and stacks need nothing here: the
//! SIGKILL is sent before this tracepoint fires, so the victim runs no more allocator calls and its
//! entries in the live table stay as they were at the kill until userspace reads them.

use aya_ebpf::{macros::map, macros::raw_tracepoint, maps::RingBuf, programs::RawTracePointContext};
use memtrace_common::{ExitMemory, OomEvent, OOM_EVENTS_BYTES};

use crate::{
    helpers::now_ns,
    kernel::{current_task, layout, memcg_id, read_at, task_memory},
    processes::{caller, count_global_loss, Caller},
};

#[map]
pub(crate) static OOM_EVENTS: RingBuf = RingBuf::with_byte_size(OOM_EVENTS_BYTES, 0);

/// oom:mark_victim. 6.8 and later: TP_PROTO(struct task_struct *task, uid_t uid); 6.1:
/// TP_PROTO(int pid), where the victim's task is known only when it is the task that ran out of
/// memory (the common case in a memory cgroup of one process).
#[raw_tracepoint(tracepoint = "mark_victim")]
pub fn oom_victim(ctx: RawTracePointContext) -> u32 {
    let layout = layout();
    let mut event = OomEvent { at_ns: now_ns(), ..OomEvent::default() };
    let task = if layout.oom_victim_is_task != 0 {
        let task: u64 = ctx.arg(0);
        event.tgid = read_at::<u32>(task, layout.task_tgid).unwrap_or(0);
        event.pid = event.tgid;
        Some(task)
    } else {
        let pid: u64 = ctx.arg(0);
        event.pid = pid as u32;
        let Caller { tgid, tid } = caller();
        (tid == event.pid).then(|| {
            event.tgid = tgid;
            current_task()
        })
    };
    event.memory = task.and_then(task_memory).unwrap_or(ExitMemory::default());
    // Read here: once the victim is exiting, /proc shows cgroup v1 paths as `/`.
    event.memcg_id = task.and_then(memcg_id).unwrap_or(0);
    if OOM_EVENTS.output::<OomEvent>(event, 0).is_err() {
        count_global_loss();
    }
    0
}
