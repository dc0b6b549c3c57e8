//! What the kernel keeps and tells about each traced process: its totals (`ProcessStats`) and the
//! kernel's own counters at its exit (`ExitMemory`), where the running kernel keeps the fields the
//! programs read (`KernelLayout`), execs and forks (`ExecEvent`, `ImageKey`), OOM kills
//! (`OomEvent`), and which processes are traced (`reach`, and the sizes of the filters).

use crate::unwind::{interpreter_stop, unwind_stop};

/// Maximum number of processes with kernel-side statistics at once.
pub const MAX_PROCESSES: u32 = 16_384;

/// Index of the one slot of the `LOST_EVENTS` array: losses that cannot be charged to a process.
pub const GLOBAL_LOST_SLOT: u32 = 0;

/// Per-process totals, updated atomically in the kernel on every allocator call. Under `user`, the
/// totals a summary reports are serialised as its per-process figures; the kernel's bookkeeping is
/// not (a summary read back has it zero).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize, serde::Deserialize), serde(default))]
pub struct ProcessStats {
    pub allocations: u64,
    pub frees: u64,
    pub allocated_bytes: u64,
    pub freed_bytes: u64,
    pub live_allocations: i64,
    pub live_bytes: i64,
    pub peak_live_bytes: i64,
    /// Frees of blocks that were allocated before tracing began (or whose allocation was lost).
    pub untracked_frees: u64,
    /// Allocation calls that returned NULL (or a non-zero error for posix_memalign).
    pub failed_allocations: u64,
    /// Events of this process that could not be recorded, e.g. because the allocation map was full.
    pub lost_events: u64,
    /// Non-zero once the process has exited: the figures are final (system-wide tracing).
    #[cfg_attr(feature = "user", serde(skip))]
    pub exited: u64,
    /// CLOCK_MONOTONIC nanoseconds when these figures began: the program image they belong to.
    /// Live allocations and stack totals from before (an earlier image of the same pid, replaced
    /// by exec) are stale.
    #[cfg_attr(feature = "user", serde(skip))]
    pub started_ns: u64,
    /// Which allocator probes saw the process first: `ProbeCookie::allocator`, 0 unknown.
    #[cfg_attr(feature = "user", serde(skip))]
    pub allocator: u64,
    /// The process's command name when it first allocated, and when it exited.
    #[cfg_attr(feature = "user", serde(skip))]
    pub comm: [u8; 16],
    /// Stacks taken, by why the unwinder ended them (`unwind_stop`).
    #[cfg_attr(feature = "user", serde(skip))]
    pub unwind_stops: [u64; unwind_stop::COUNT],
    /// Stacks whose interpreter frames ended short, by why (`interpreter_stop`).
    #[cfg_attr(feature = "user", serde(skip))]
    pub interpreter_stops: [u64; interpreter_stop::COUNT],
    /// Allocations freed before the thread that made them allocated anything else (heaptrack's
    /// temporary allocations).
    pub temporary_allocations: u64,
    pub temporary_bytes: u64,
    /// Frees the allocator's own library made of blocks it did not hand out through a probed call
    /// (glibc's flush of a thread's tcache at thread exit frees chunks the program freed already):
    /// its internal recycling, kept out of `untracked_frees`.
    pub allocator_internal_frees: u64,
    /// Private anonymous memory mapped (mmap, mremap) inside allocator calls, still mapped.
    #[cfg_attr(feature = "user", serde(skip))]
    pub allocator_mapped_bytes: i64,
    /// Private anonymous memory the program mapped outside allocator calls, still mapped (thread
    /// stacks, MAP_STACK, are left to dark memory).
    #[cfg_attr(feature = "user", serde(skip))]
    pub program_mapped_bytes: i64,
    /// What the kernel's own counters said as the process exited; zero before.
    #[cfg_attr(feature = "user", serde(skip))]
    pub exit_memory: ExitMemory,
    /// The cgroup (v2) the process was in at its first event: the cgroup directory's inode number,
    /// as `bpf_get_current_cgroup_id` gives it, so that a process that lived 30 ms is still named.
    #[cfg_attr(feature = "user", serde(skip))]
    pub cgroup_id: u64,
}

/// A process's memory as the kernel counted it when the process exited (sched_process_exit runs
/// before the memory is released): what /proc/PID/status would have said then.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExitMemory {
    /// Pages per `mm_counter` (MM_FILEPAGES, MM_ANONPAGES, MM_SWAPENTS, MM_SHMEMPAGES).
    pub pages: [u64; MM_COUNTERS],
    /// The brk heap: program break less its start.
    pub heap_break_bytes: u64,
    /// Non-zero once read.
    pub read: u64,
}

/// The per-CPU deltas of at most this many CPUs are summed (the kernel's largest NR_CPUS).
pub const MAX_PER_CPU_COUNTERS: u32 = 8192;

/// The kernel's `enum mm_counter_type`, as the exit probe reads `mm_struct.rss_stat`.
pub const MM_COUNTERS: usize = 4;
pub mod mm_counter {
    pub const FILE_PAGES: usize = 0;
    pub const ANON_PAGES: usize = 1;
    pub const SWAP_ENTRIES: usize = 2;
    pub const SHMEM_PAGES: usize = 3;
}

/// Where the running kernel keeps the fields the BPF programs read (aya-ebpf has no CO-RE): byte
/// offsets from its BTF, set by the loader as the global `KERNEL_LAYOUT`. A zero `task_mm` means
/// unknown (no BTF): exit memory is then not read.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelLayout {
    /// `task_struct.tgid`, to follow a tree from fork.
    pub task_tgid: u32,
    /// `task_struct.mm`.
    pub task_mm: u32,
    /// `mm_struct.rss_stat`: an array of `struct percpu_counter` (6.2 and later), or a struct
    /// mm_rss_stat of atomic_long_t counts (6.1).
    pub mm_rss_stat: u32,
    pub mm_start_brk: u32,
    pub mm_brk: u32,
    /// `percpu_counter.count`: the total /proc reads (per-CPU deltas not yet folded in are left out,
    /// as /proc leaves them out); 0 on 6.1, where each counter is its count.
    pub percpu_counter_count: u32,
    /// sizeof(struct percpu_counter); 8 (an atomic_long_t) on 6.1.
    pub percpu_counter_size: u32,
    /// `percpu_counter.counters`: each CPU's delta not yet folded into `count` (an `s32 __percpu *`);
    /// 0 on 6.1, which has none.
    pub percpu_counter_counters: u32,
    /// The address of the kernel's `__per_cpu_offset` array (/proc/kallsyms), each CPU's offset
    /// of its per-CPU data; 0 where unknown: the deltas are then left out.
    pub per_cpu_offset: u64,
    /// How many CPUs the kernel may have (/sys/devices/system/cpu/possible): the per-CPU deltas
    /// summed.
    pub possible_cpus: u32,
    /// `linux_binprm.file`, `file.f_inode`, `inode.i_ino`, `inode.i_sb` and `super_block.s_dev`:
    /// the exec'd program's file as the kernel names it ([`ImageKey`]).
    pub binprm_file: u32,
    pub file_inode: u32,
    pub inode_ino: u32,
    pub inode_sb: u32,
    pub sb_dev: u32,
    /// Non-zero where oom:mark_victim passes the victim's `struct task_struct *` (6.8 and later:
    /// `TP_PROTO(struct task_struct *task, uid_t uid)`); zero where it passes its pid
    /// (`TP_PROTO(int pid)`, 6.1).
    pub oom_victim_is_task: u32,
    /// The way from a task to the id of its memory cgroup, for an OOM victim (its kernfs node id,
    /// the inode number of the cgroup's directory): `task_struct.cgroups` (a css_set),
    /// `css_set.subsys` (an array of css pointers), `memory_cgrp_id + 1` (0 where the kernel has
    /// no memory controller), `cgroup_subsys_state.cgroup`, `cgroup.kn`, `kernfs_node.id`.
    pub task_cgroups: u32,
    pub css_set_subsys: u32,
    pub memory_subsys_slot: u32,
    pub css_cgroup: u32,
    pub cgroup_kn: u32,
    pub kernfs_node_id: u32,
    /// `vm_area_struct.vm_start`, `.vm_end`, `.vm_pgoff` and `.vm_file`: the unwinder's way from a
    /// mapping the kernel finds (bpf_find_vma) to the file it maps.
    pub vma_start: u32,
    pub vma_end: u32,
    pub vma_pgoff: u32,
    pub vma_file: u32,
    /// Where an overlay's mapping names the file it was opened as (a backing file, 6.6 and later:
    /// its mapping holds the file of the layer below): `backing_file.user_path` (0 where the
    /// kernel has no backing files), `path.dentry`, `dentry.d_inode`. (The struct has no padding:
    /// its bytes are copied into the BPF object whole.)
    pub backing_user_path: u32,
    pub path_dentry: u32,
    pub dentry_inode: u32,
    /// Where a task keeps its user thread pointer: `task_struct.thread` . `thread_struct.fsbase`
    /// on x86-64 (the FS base), `.thread` . `.uw.tp_value` on arm64 (`TPIDR_EL0`); 0 where
    /// unknown.
    pub task_thread_pointer: u32,
    pub _pad: u32,
}

/// A program file as the kernel names it at exec: its file system's device (the kernel's own
/// `dev_t`, `s_dev`, not stat's encoding) and its inode number. Zero where the loader found no
/// layout (no BTF).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ImageKey {
    pub dev: u32,
    pub _pad: u32,
    pub ino: u64,
}

/// A process that began running a new program (sched_process_exec), for userspace to probe the
/// allocators it brings; a process a followed one forked, as it returns from fork, for userspace
/// to probe its parent's image for it alone (probes of a followed tree are per process); or a
/// traced process that loaded a library, for userspace to write the library's unwind table
/// ([`announced`] says which). `hold` says whether the BPF side stopped it there ([`exec_hold`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecEvent {
    pub tgid: u32,
    pub hold: u32,
    /// The program's file; zero for a fork or a library.
    pub image: ImageKey,
    /// What happened ([`announced`]).
    pub kind: u32,
    pub _pad: u32,
}

/// What an [`ExecEvent`] announces.
pub mod announced {
    /// A new program (exec).
    pub const EXEC: u32 = 0;
    /// A followed tree's new process, running its parent's image (fork).
    pub const FORK: u32 = 1;
    /// A library loaded (the C library's dlopen returned): the process's mappings changed.
    pub const LIBRARY: u32 = 2;
}

/// What the exec tracepoint did with an exec ([`ExecEvent::hold`]).
pub mod exec_hold {
    /// Not stopped: its program is known (probed already), or execs are not held.
    pub const NONE: u32 = 0;
    /// Stopped (SIGSTOP sent before its first instruction): userspace continues it with SIGCONT
    /// once its program is probed.
    pub const STOPPED: u32 = 1;
    /// It should have been stopped, and bpf_send_signal refused.
    pub const REFUSED: u32 = 2;
}

/// Forked children of a followed tree between fork and their return from the C library's fork, at
/// most (the oldest is forgotten first: a child forked otherwise never returns through it).
pub const MAX_PENDING_FORKS: u32 = 4096;

/// Program files whose execs need no stop (their allocators are probed), remembered at most.
pub const MAX_KNOWN_IMAGES: u32 = 4096;

/// The kernel's OOM killer chose a victim (oom:mark_victim, global or a memory cgroup's): sent for
/// every victim, traced or not (they are rare); userspace keeps those it traces.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OomEvent {
    /// The victim's thread id, as the tracepoint names it (its process's leader, but for a process
    /// whose leader has exited).
    pub pid: u32,
    /// The victim's process id where the kernel says it (the task, or the OOM invoker is the
    /// victim); 0 where only `pid` is known.
    pub tgid: u32,
    /// bpf_ktime_get_ns (CLOCK_MONOTONIC) at the kill.
    pub at_ns: u64,
    /// The victim's memory counters at the kill, before the OOM reaper or its exit frees them
    /// (`read` is 0 where the victim's task could not be read: 6.1, killed by another task).
    pub memory: ExitMemory,
    /// The id of the victim's memory cgroup (the inode number of its directory in the memory
    /// controller's hierarchy, v1 or v2), read at the kill; 0 where unread.
    pub memcg_id: u64,
}

/// Capacity of the OOM victim ring buffer in bytes (a page: 56 victims in one burst).
pub const OOM_EVENTS_BYTES: u32 = 4096;

/// Which processes the probes' events count for: the loader sets the BPF global `REACH`.
pub mod reach {
    /// The named processes only: their links carry their pids, and `TARGETS` names them so that
    /// their execs are heard of.
    pub const TARGETS: u8 = 0;
    /// The named processes and all their descendants: links fire in every process that maps a
    /// probed file, and `TARGETS` holds the tree, extended at fork and shrunk at exit.
    pub const TREE: u8 = 1;
    /// Every process but memtrace itself, those excluded and those outside `--comm`.
    pub const ALL: u8 = 2;
}

/// Capacity of the exec event ring buffer in bytes.
pub const EXEC_EVENTS_BYTES: u32 = 64 * 1024;
/// Pids excluded from system-wide tracing at once.
pub const MAX_EXCLUDED_PIDS: u32 = 1024;
/// Command names `--comm` may name at once.
pub const MAX_COMMS: u32 = 64;
/// The most cgroups `--container` and `--cgroup` name, their descendants included.
pub const MAX_CGROUPS: u32 = 4096;
/// How deep in the cgroup tree the filter looks for a wanted ancestor of a process's cgroup.
pub const MAX_CGROUP_DEPTH: i32 = 16;

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are #[repr(C)] plain integers without padding holes that matter to the kernel.
    unsafe impl aya::Pod for super::ProcessStats {}
    unsafe impl aya::Pod for super::OomEvent {}
    unsafe impl aya::Pod for super::ExecEvent {}
    unsafe impl aya::Pod for super::ImageKey {}
    unsafe impl aya::Pod for super::KernelLayout {}
}

const _: () = assert!(core::mem::size_of::<KernelLayout>() == 128);
