//! Which processes are traced (and the calling thread's slot when its process is), their per-process
//! totals, and what happens when they exec (a new program may be stopped until it is probed) or exit.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, generated, generated::bpf_get_attach_cookie},
    macros::{fentry, map, raw_tracepoint, uretprobe},
    maps::{Array, HashMap, LruHashMap, RingBuf},
    programs::{FEntryContext, RawTracePointContext, RetProbeContext},
    EbpfContext,
};
use memtrace_common::{
    announced, exec_hold, reach, ExecEvent, ImageKey, ProbeCookie, ProcessStats, ThreadState,
    EXEC_EVENTS_BYTES, GLOBAL_LOST_SLOT, MAX_CGROUPS, MAX_CGROUP_DEPTH, MAX_COMMS, MAX_EXCLUDED_PIDS,
    MAX_KNOWN_IMAGES, MAX_PENDING_FORKS, MAX_PROCESSES,
};

use crate::{
    counters::{add, compare_exchange},
    helpers::{loaded, map_value, now_ns},
    kernel::{layout, read_at},
};

#[map]
pub(crate) static STATS: HashMap<u32, ProcessStats> = HashMap::with_max_entries(MAX_PROCESSES, 0);

#[map]
pub(crate) static LOST_EVENTS: Array<u64> = Array::with_max_entries(1, 0);

/// Which processes count (`memtrace_common::reach`), set by the loader.
#[no_mangle]
pub(crate) static REACH: u8 = reach::TARGETS;
/// memtrace's own pid, never traced where probes fire in every process.
#[no_mangle]
pub(crate) static SELF_TGID: u32 = 0;
/// Set when `--comm` names commands: only processes whose command name is in ALLOWED_COMMS count.
#[no_mangle]
pub(crate) static FILTER_COMMS: u8 = 0;

/// Set when `--container` or `--cgroup` names cgroups: only processes in one of ALLOWED_CGROUPS,
/// or below one, count.
#[no_mangle]
pub(crate) static FILTER_CGROUPS: u8 = 0;

/// The cgroup (v2) ids `--container` and `--cgroup` name, with the descendants userspace found.
#[map]
pub(crate) static ALLOWED_CGROUPS: HashMap<u64, u8> = HashMap::with_max_entries(MAX_CGROUPS, 0);

/// The command names of `--comm`, NUL-padded to 16 bytes as bpf_get_current_comm returns them.
#[map]
pub(crate) static ALLOWED_COMMS: HashMap<[u8; 16], u8> = HashMap::with_max_entries(MAX_COMMS, 0);

/// The traced processes under `reach::TARGETS` and `reach::TREE`: the named ones, and with a tree
/// every descendant, added at fork and removed at exit.
#[map]
pub(crate) static TARGETS: HashMap<u32, u8> = HashMap::with_max_entries(MAX_PROCESSES, 0);

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
        add(map_value(lost), 1);
    }
}

/// Zeroed totals, never written: a new process's entry is inserted from here and filled through
/// the map's pointer (a `ProcessStats` built on the BPF stack would take 264 of its 512 bytes).
#[map]
static FRESH_STATS: Array<ProcessStats> = Array::with_max_entries(1, 0);

/// The totals of a process, created on its first event. None (and a global loss) when the map is full.
pub(crate) fn stats_of(tgid: u32) -> Option<&'static ProcessStats> {
    if let Some(stats) = STATS.get_ptr(tgid) {
        return Some(map_value(stats));
    }
    let zeroed = FRESH_STATS.get_ptr(0)?;
    let created = STATS.insert(tgid, map_value(zeroed), u64::from(BPF_NOEXIST)).is_ok();
    let Some(stats) = STATS.get_ptr_mut(tgid) else {
        count_global_loss();
        return None;
    };
    if created {
        // The thread that created the entry names it. Another thread of the process may count
        // into it meanwhile; until `started_ns` is set, no record looks older than the image.
        // SAFETY: a map value, valid while the program runs; only its creator writes these fields.
        // The name is written straight into the entry, not through a buffer on the BPF stack.
        unsafe {
            generated::bpf_get_current_comm((&raw mut (*stats).comm).cast(), 16);
            (*stats).started_ns = now_ns();
            (*stats).cgroup_id = generated::bpf_get_current_cgroup_id();
        }
    }
    Some(map_value(stats))
}

/// Which processes count, as the loader set it.
pub(crate) fn reach() -> u8 {
    loaded(&REACH)
}

/// Whether events of this process count. Under `reach::TARGETS` the links carry the pids, so
/// every event that fires counts.
pub(crate) fn is_traced(tgid: u32) -> bool {
    match reach() {
        reach::TARGETS => true,
        reach::TREE => TARGETS.get_ptr(&tgid).is_some(),
        _ => is_traced_system_wide(tgid),
    }
}

/// Whether a process is traced, for programs that fire in every process (tracepoints): it is a
/// target, or any traced process under `reach::ALL`.
pub(crate) fn is_traced_process(tgid: u32) -> bool {
    match reach() {
        reach::ALL => is_traced_system_wide(tgid),
        _ => TARGETS.get_ptr(&tgid).is_some(),
    }
}

fn is_traced_system_wide(tgid: u32) -> bool {
    if tgid == loaded(&SELF_TGID) || EXCLUDED_PIDS.get_ptr(tgid).is_some() {
        return false;
    }
    if loaded(&FILTER_CGROUPS) != 0 && !in_allowed_cgroup() {
        return false;
    }
    if loaded(&FILTER_COMMS) == 0 {
        return true;
    }
    bpf_get_current_comm().is_ok_and(|comm| ALLOWED_COMMS.get_ptr(&comm).is_some())
}

/// Whether the current task's cgroup, or one of its ancestors, is one `--container` or `--cgroup`
/// names: a cgroup made after the run began below a named one counts from its first event.
fn in_allowed_cgroup() -> bool {
    for level in 0..MAX_CGROUP_DEPTH {
        // SAFETY: the helper takes a level and reads the current task's cgroup; 0 past its depth.
        let id = unsafe { generated::bpf_get_current_ancestor_cgroup_id(level) };
        if id == 0 {
            return false;
        }
        if ALLOWED_CGROUPS.get_ptr(&id).is_some() {
            return true;
        }
    }
    false
}

/// The calling thread's slot if its process is traced. The common case is one array lookup, with
/// no second one in the process filter (threads.rs).
pub(crate) fn traced_thread(caller: &Caller) -> Option<&'static mut ThreadState> {
    if let Some(thread) = crate::threads::find(caller.tid) {
        return Some(thread);
    }
    if !is_traced(caller.tgid) {
        return None;
    }
    let thread = crate::threads::find_or_make(caller.tid);
    if thread.is_none() {
        if let Some(stats) = stats_of(caller.tgid) {
            add(&stats.lost_events, 1);
        }
    }
    thread
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
    crate::threads::release(tid);
    if tgid != tid {
        return 0;
    }
    let _ = TARGETS.remove(&tgid);
    // A child that never returned through fork (forked otherwise): its pid may be a stranger's next.
    let _ = PENDING_FORKS.remove(&tgid);
    // It takes no more stacks.
    let _ = crate::unwinder::UNWIND_MAPPINGS.remove(&tgid);
    if let Some(stats) = STATS.get_ptr_mut(tgid) {
        // Where the task still has its memory here (6.18 and later); else exit_begins read it.
        keep_exit_memory(stats);
        // SAFETY: a map value, valid while the program runs.
        unsafe {
            (*stats).comm = bpf_get_current_comm().unwrap_or((*stats).comm);
            (*stats).exited = 1;
        }
    }
    0
}

/// Keeps the exiting task's memory counters in its process's figures, where it still has its
/// memory (an earlier reading stays otherwise).
fn keep_exit_memory(stats: *mut ProcessStats) {
    if let Some(exit_memory) = crate::kernel::exit_memory() {
        // SAFETY: a map value, valid while the program runs.
        unsafe { (*stats).exit_memory = exit_memory };
    }
}

/// A task begins to exit (fentry on do_exit), its memory still whole: where sched_process_exit
/// runs after exit_mm has released it (Debian's 6.1 and 6.12 kernels: the task has no mm there),
/// the leader's memory counters are read here for the exit levels. Attached where the kernel
/// lets it (BTF and fentry trampolines); process_exit's own reading takes precedence.
#[fentry(function = "do_exit")]
pub fn exit_begins(_ctx: FEntryContext) -> u32 {
    let Caller { tgid, tid } = caller();
    if tgid != tid {
        return 0;
    }
    if let Some(stats) = STATS.get_ptr_mut(tgid) {
        keep_exit_memory(stats);
    }
    0
}

/// A process forked by a traced one joins the tree (`reach::TREE`), before the child runs: its
/// figures start here, so the blocks it inherits are not its own. Attached only to follow a tree.
#[raw_tracepoint(tracepoint = "sched_process_fork")]
pub fn process_fork(ctx: RawTracePointContext) -> u32 {
    // The parent forks: it is the current task.
    let Caller { tgid, .. } = caller();
    if TARGETS.get_ptr(&tgid).is_none() {
        return 0;
    }
    // TP_PROTO(struct task_struct *parent, struct task_struct *child)
    let child: *const u8 = ctx.arg(1);
    let Some(child_tgid) = read_at::<u32>(child as u64, layout().task_tgid) else {
        count_global_loss();
        return 0;
    };
    // A new thread of the same process is no new process.
    if child_tgid == tgid {
        return 0;
    }
    if TARGETS.insert(&child_tgid, &1, 0).is_err() {
        count_global_loss();
    }
    // Its probes are its own (per process): it is announced as it returns from fork, and held
    // there (where forks are held) until they are in.
    if PENDING_FORKS.insert(&child_tgid, &1, 0).is_err() {
        count_global_loss();
    }
    // The child runs its parent's image: its stacks unwind through the parent's mapping table
    // until userspace writes its own (or it execs).
    if let Some(table) = crate::unwinder::UNWIND_MAPPINGS.get_ptr(&tgid) {
        // SAFETY: a map value, valid while the program runs; the kernel copies it.
        let _ =
            crate::unwinder::UNWIND_MAPPINGS.insert(&child_tgid, unsafe { &*table }, u64::from(BPF_NOEXIST));
    }
    0
}

/// A new program image starts its figures afresh (what the process did before exec, say as the
/// shell that forked it, is not the new program's), and userspace hears of it: the program may bring
/// an allocator not probed yet. Where execs are held (HOLD_EXECS) and the program's file is not
/// known to need nothing (KNOWN_IMAGES), the process is stopped here, before its first
/// instruction, until userspace has probed the program and continues it.
#[raw_tracepoint(tracepoint = "sched_process_exec")]
pub fn process_exec(ctx: RawTracePointContext) -> u32 {
    let Caller { tgid, .. } = caller();
    // TP_PROTO(struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm): a thread that
    // execs takes the process id; its slot goes, so that whether the new image is traced (its
    // command name may not be) is asked again on its first event.
    let old_pid: u64 = ctx.arg(1);
    crate::threads::release(old_pid as u32);
    crate::threads::release(tgid);
    let _ = STATS.remove(tgid);
    // A child that execs without returning through fork (vfork, posix_spawn) is announced by its
    // exec instead.
    let _ = PENDING_FORKS.remove(&tgid);
    // The old image's mappings are gone; userspace writes the new image's table.
    let _ = crate::unwinder::UNWIND_MAPPINGS.remove(tgid);
    if !is_traced_process(tgid) {
        return 0;
    }
    // Reserved before any stop: a process stopped unannounced would wait for nobody.
    let Some(mut entry) = EXEC_EVENTS.reserve::<ExecEvent>(0) else {
        count_global_loss();
        return 0;
    };
    let bprm: u64 = ctx.arg(2);
    let image = crate::kernel::exec_image(bprm).unwrap_or_default();
    entry.write(ExecEvent { tgid, hold: hold_exec(&image), image, ..ExecEvent::default() });
    entry.submit(0);
    0
}

/// Whether execs (and a tree's forks) are held now: userspace clears it while it cannot answer
/// (stopped, ending).
#[map]
pub(crate) static HOLD_EXECS: Array<u32> = Array::with_max_entries(1, 0);

fn holding() -> bool {
    HOLD_EXECS.get(0).is_some_and(|on| *on != 0)
}

/// Children of followed processes (`reach::TREE`), from their fork until they return from the C
/// library's fork (those that never do, forked otherwise, are found by userspace at a sample).
#[map]
static PENDING_FORKS: LruHashMap<u32, u8> = LruHashMap::with_max_entries(MAX_PENDING_FORKS, 0);

/// A followed tree's new process returns from the C library's fork (a return probe there, for
/// every process: few call fork, and the kernel hands the child its parent's pending returns):
/// where fork returned 0, in a child forked from the tree, the child is stopped there and
/// announced, so that userspace attaches its probes (links that carry its pid) before it runs
/// on. Attached only to follow a tree.
#[uretprobe]
pub fn fork_return(ctx: RetProbeContext) -> u32 {
    let forked: u64 = ctx.ret();
    let Caller { tgid, tid } = caller();
    if forked != 0 || tgid != tid || PENDING_FORKS.get_ptr(&tgid).is_none() {
        return 0;
    }
    let _ = PENDING_FORKS.remove(&tgid);
    // Reserved before any stop: a process stopped unannounced would wait for nobody.
    let Some(mut entry) = EXEC_EVENTS.reserve::<ExecEvent>(0) else {
        count_global_loss();
        return 0;
    };
    let hold = if holding() { stop_current() } else { exec_hold::NONE };
    entry.write(ExecEvent { tgid, hold, kind: announced::FORK, ..ExecEvent::default() });
    entry.submit(0);
    0
}

/// A traced process loaded a library: the C library's dlopen (or dlmopen) returned a handle. Where
/// processes are held, it is stopped here and announced, so that userspace writes the library's
/// unwind table before the caller runs the library's code: a Python extension's module init
/// allocates right after the load, and its stacks would stop at the first frame without a table.
/// Attached only where stacks are unwound from tables; a dlopen of a library loaded already is held
/// too (the table is found unchanged).
#[uretprobe]
pub fn library_loaded(ctx: RetProbeContext) -> u32 {
    let handle: u64 = ctx.ret();
    let Caller { tgid, .. } = caller();
    if handle == 0 || !holding() || !is_traced(tgid) {
        return 0;
    }
    // Reserved before any stop: a process stopped unannounced would wait for nobody.
    let Some(mut entry) = EXEC_EVENTS.reserve::<ExecEvent>(0) else {
        count_global_loss();
        return 0;
    };
    entry.write(ExecEvent { tgid, hold: stop_current(), kind: announced::LIBRARY, ..ExecEvent::default() });
    entry.submit(0);
    0
}

/// Program files whose allocators userspace has probed: their execs go on unstopped.
#[map]
pub(crate) static KNOWN_IMAGES: LruHashMap<ImageKey, u8> = LruHashMap::with_max_entries(MAX_KNOWN_IMAGES, 0);

/// Stops the exec'ing process (it is the current task, its only thread after exec) unless its
/// program is known or execs are not held; says which (`exec_hold`). SIGSTOP is taken on the way
/// back to user mode, before the new program's first instruction.
fn hold_exec(image: &ImageKey) -> u32 {
    if !holding() || image.ino == 0 || KNOWN_IMAGES.get_ptr(image).is_some() {
        return exec_hold::NONE;
    }
    stop_current()
}

/// Sends the current process SIGSTOP, taken on its way back to user mode; says whether it went.
fn stop_current() -> u32 {
    // SAFETY: the helper signals the current task; a tracepoint or a uprobe runs with interrupts
    // enabled, so it is sent at once.
    match unsafe { generated::bpf_send_signal(SIGSTOP) } {
        0 => exec_hold::STOPPED,
        _ => exec_hold::REFUSED,
    }
}

/// The signal that stops a process (asm-generic/signal.h).
const SIGSTOP: u32 = 19;
