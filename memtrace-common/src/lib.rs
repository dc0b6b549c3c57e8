//! Map keys, map values and constants shared by the BPF programs (`memtrace-ebpf`) and the loader
//! (`memtrace-user`). Everything here is `#[repr(C)]` so both sides agree on the layout byte for byte.
#![cfg_attr(not(test), no_std)]

pub mod arguments;
pub mod programs;

pub use arguments::{ArgumentRegisters, ArgumentsRead};

/// Maximum number of processes with kernel-side statistics at once.
pub const MAX_PROCESSES: u32 = 16_384;
/// Default capacity of the live-allocation table in records; the loader sizes the table for it.
pub const DEFAULT_MAX_LIVE_ALLOCATIONS: u32 = 1 << 20;
/// Threads with allocator state at once: a thread gets a slot at its first allocator call and
/// loses it when it exits.
pub const MAX_THREADS: u32 = 65_536;

/// Distinct call stacks remembered at once (per machine).
pub const MAX_STACKS: u32 = 131_072;
/// Raw stacks (return addresses of one process) whose build-ID form is remembered; a cache.
pub const MAX_RAW_STACKS: u32 = 65_536;
/// (process, stack) pairs with totals at once.
pub const MAX_STACK_TOTALS: u32 = 131_072;
/// Frames the unwinder takes per stack, innermost first; deeper stacks are cut at the outer end
/// (`unwind_stop::DEPTH_LIMIT`). As deep as the OpenTelemetry profiler's native walk: a real
/// program's deepest stacks (an interpreter's, a recursive parser's) fit.
pub const STACK_DEPTH: usize = 128;
/// Frames a stack of the common depth is stored with (`StackFrames`, in STACKS); a deeper stack
/// is stored whole in DEEP_STACKS (`DeepStackFrames`), so that most stacks take a quarter of the
/// memory. The frame-pointer fallback (a process with no mapping table) takes at most this many.
pub const SHALLOW_STACK_DEPTH: usize = 32;
/// `Allocation::stack` when no stack was taken (--no-stacks, or the stack could not be recorded).
pub const NO_STACK: u64 = 0;

/// `--window`'s generation counter (the one slot of `WINDOW_GENERATION`), written by userspace: it
/// rises by one as each window opens (odd) and again once it has closed (even), its probes gone.
pub const WINDOW_SLOT: u32 = 0;

/// Index of the one slot of the `LOST_EVENTS` array: losses that cannot be charged to a process.
pub const GLOBAL_LOST_SLOT: u32 = 0;

/// The allocator entry points memtrace probes; the discriminant is the low byte of a probe's cookie.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocatorFunction {
    Malloc = 1,
    Calloc = 2,
    Realloc = 3,
    Reallocarray = 4,
    PosixMemalign = 5,
    AlignedAlloc = 6,
    Memalign = 7,
    Valloc = 8,
    Pvalloc = 9,
    Free = 10,
}

impl AllocatorFunction {
    /// Whether a return probe is attached too: every entry point but free, whose result is nothing.
    pub const fn has_return(self) -> bool {
        !matches!(self, AllocatorFunction::Free)
    }

    /// Whether `--window` probes it only inside windows: every entry point that only allocates.
    /// free, realloc and reallocarray stay probed, so that a block a window recorded is followed
    /// until it is freed, wherever it moves.
    pub const fn windowed(self) -> bool {
        !matches!(
            self,
            AllocatorFunction::Free | AllocatorFunction::Realloc | AllocatorFunction::Reallocarray
        )
    }

    /// The arguments its programs read (memtrace-ebpf's alloc_enter and free_enter).
    pub const fn arguments(self) -> ArgumentsRead {
        use AllocatorFunction::*;
        ArgumentsRead::wide(match self {
            Malloc | Valloc | Pvalloc | Free => 0b001,
            Calloc | Realloc => 0b011,
            Reallocarray => 0b111,
            PosixMemalign => 0b101,
            AlignedAlloc | Memalign => 0b010,
        })
    }

    /// The entry point whose discriminant is `value`. A match, not an index into a table: BPF code
    /// must not carry a bounds-check panic, which the verifier refuses.
    pub const fn from_discriminant(value: u64) -> Option<Self> {
        use AllocatorFunction::*;
        Some(match value {
            1 => Malloc,
            2 => Calloc,
            3 => Realloc,
            4 => Reallocarray,
            5 => PosixMemalign,
            6 => AlignedAlloc,
            7 => Memalign,
            8 => Valloc,
            9 => Pvalloc,
            10 => Free,
            _ => return None,
        })
    }
}

/// The BPF cookie of an allocator probe: which entry point in the low byte, which allocator (its
/// index among those probed, from 1) in bits 8-31, and where the probe finds the function's
/// arguments (`ArgumentRegisters`) in bits 32-51. One program serves every entry point of every
/// allocator, so a whole file's probes are one uprobe_multi link. A mapping call's probe has the
/// same shape, with the `MapFunction` in the low byte and no allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeCookie(pub u64);

impl ProbeCookie {
    const FUNCTION_BITS: u32 = 8;
    const REGISTERS_SHIFT: u32 = 32;

    pub const fn new(allocator: u32, function: AllocatorFunction) -> Self {
        Self(((allocator as u64) << Self::FUNCTION_BITS) | function as u64)
    }

    /// A mapping call's cookie.
    pub const fn map_call(function: MapFunction) -> Self {
        Self(function as u64)
    }

    /// The same cookie, with the arguments found in `registers`.
    pub const fn with_registers(self, registers: ArgumentRegisters) -> Self {
        Self((self.0 & 0xffff_ffff) | (registers.0 as u64) << Self::REGISTERS_SHIFT)
    }

    /// The allocator's index (from 1), as `ProcessStats::allocator` keeps it.
    pub const fn allocator(self) -> u64 {
        (self.0 & 0xffff_ffff) >> Self::FUNCTION_BITS
    }

    /// The low byte: an `AllocatorFunction`'s or a `MapFunction`'s discriminant.
    pub const fn discriminant(self) -> u64 {
        self.0 & 0xff
    }

    /// The entry point, from the low byte.
    pub const fn function(self) -> Option<AllocatorFunction> {
        AllocatorFunction::from_discriminant(self.discriminant())
    }

    /// Where the probe finds the function's arguments.
    pub const fn registers(self) -> ArgumentRegisters {
        ArgumentRegisters((self.0 >> Self::REGISTERS_SHIFT) as u32)
    }
}

/// Per-process totals, updated atomically in the kernel on every allocator call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
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
    pub exited: u64,
    /// CLOCK_MONOTONIC nanoseconds when these figures began: the program image they belong to.
    /// Live allocations and stack totals from before (an earlier image of the same pid, replaced
    /// by exec) are stale.
    pub started_ns: u64,
    /// Which allocator probes saw the process first: `ProbeCookie::allocator`, 0 unknown.
    pub allocator: u64,
    /// The process's command name when it first allocated, and when it exited.
    pub comm: [u8; 16],
    /// Stacks taken, by why the unwinder ended them (`unwind_stop`).
    pub unwind_stops: [u64; unwind_stop::COUNT],
    /// Stacks whose interpreter frames ended short, by why (`interpreter_stop`).
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
    pub allocator_mapped_bytes: i64,
    /// Private anonymous memory the program mapped outside allocator calls, still mapped (thread
    /// stacks, MAP_STACK, are left to dark memory).
    pub program_mapped_bytes: i64,
    /// What the kernel's own counters said as the process exited; zero before.
    pub exit_memory: ExitMemory,
    /// The cgroup (v2) the process was in at its first event: the cgroup directory's inode number,
    /// as `bpf_get_current_cgroup_id` gives it, so that a process that lived 30 ms is still named.
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
    /// `task_struct.thread` . `thread_struct.fsbase`: a user thread's thread pointer on x86-64
    /// (glibc's `struct pthread`); 0 where unknown.
    pub task_fsbase: u32,
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
/// The most entries the kernel accepts in a hash map (`--max-stacks`): it rounds the entries up to
/// a power of two buckets of 16 bytes whose total must fit in 32 bits (E2BIG beyond). Also the
/// bound of `--max-allocations`, whose table (`live_table_slots`) then takes 12 GiB.
pub const MAX_LIVE_ALLOCATIONS_LIMIT: u32 = 1 << 27;

/// Key of the live-allocation map: addresses are only unique within one address space.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocationKey {
    pub tgid: u32,
    pub _pad: u32,
    pub address: u64,
}

/// What the kernel remembers about one live allocation until it is freed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Allocation {
    pub size: u64,
    /// CLOCK_MONOTONIC nanoseconds (bpf_ktime_get_ns) when the block was handed out.
    pub timestamp_ns: u64,
    /// Key of the allocating call stack in the stack map, or NO_STACK.
    pub stack: u64,
}

/// One slot of the live-allocation table (`ALLOCATIONS`): an open-addressing hash table in a BPF
/// array that userspace maps into its own memory, so a record is a few compares and two atomic
/// operations in the probe (no helper call, no bucket lock) and reading the table is no syscall.
/// A key lives in one of the `LIVE_WINDOW` slots from its home (`LiveTag::home`), in the first
/// slot that was free when it came, so a search stops at the first empty slot; freed slots become
/// tombstones, which the next record in their window reuses.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LiveSlot {
    /// `LiveTag::EMPTY`, `TOMBSTONE`, `BUSY` (claimed, fields being written) or the key's tag: the
    /// word a slot is claimed and released by, with compare-and-exchange.
    pub tag: u64,
    pub key: AllocationKey,
    pub allocation: Allocation,
}

/// Slots a key may take, from its home on (wrapping at the end of the table).
pub const LIVE_WINDOW: u32 = 32;

/// A live-allocation key's tag: a 64-bit mix of (process, address), its top bit set so that it is
/// never one of the slot states. Its low bits choose the key's home slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveTag(pub u64);

impl LiveTag {
    pub const EMPTY: u64 = 0;
    pub const TOMBSTONE: u64 = 1;
    pub const BUSY: u64 = 2;

    /// The tag of `key` (the multiply and shifts of murmur3's finalizer: addresses' low bits are
    /// all zero, and the home slot is taken from the mix's low bits).
    pub fn of(key: &AllocationKey) -> Self {
        let mut mix = key.address ^ (u64::from(key.tgid) << 40 | u64::from(key.tgid) >> 24);
        mix ^= mix >> 33;
        mix = mix.wrapping_mul(0xff51_afd7_ed55_8ccd);
        mix ^= mix >> 33;
        Self(mix | 1 << 63)
    }

    /// Whether a slot's tag word names a record (not empty, a tombstone or being written).
    pub fn is_record(word: u64) -> bool {
        word > Self::BUSY
    }

    /// Whether a slot with this tag word may take a new record (empty, or a tombstone).
    pub fn is_free(word: u64) -> bool {
        word == Self::EMPTY || word == Self::TOMBSTONE
    }

    /// The key's home slot in a table of `slots` (a power of two).
    pub fn home(self, slots: u32) -> u32 {
        (self.0 & u64::from(slots - 1)) as u32
    }
}

/// Slots of a live-allocation table that holds `max_allocations` records: at least twice as many
/// (a load of at most one half keeps windows short), a power of two (the home is a mask), and at
/// least one window.
pub const fn live_table_slots(max_allocations: u32) -> u32 {
    let slots = (max_allocations as u64 * 2).next_power_of_two();
    if slots < LIVE_WINDOW as u64 {
        LIVE_WINDOW
    } else {
        slots as u32
    }
}

/// One user stack frame as the kernel resolves it at capture time (struct bpf_stack_build_id): the
/// file's build ID and offset while the process is alive, so it can be symbolized after it exits.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackFrame {
    /// FRAME_EMPTY, FRAME_BUILD_ID or FRAME_IP.
    pub status: i32,
    pub build_id: [u8; 20],
    /// File offset for FRAME_BUILD_ID, virtual address for FRAME_IP.
    pub offset_or_ip: u64,
}

impl StackFrame {
    /// Past the end of the stack: all zero, as bpf_get_stack leaves unused frames.
    pub const EMPTY: StackFrame = StackFrame { status: FRAME_EMPTY, build_id: [0; 20], offset_or_ip: 0 };
}

/// A Python frame, stored after the native frames of its stack: `build_id[0..8]` the code
/// object's address (little-endian), `build_id[8]` 1 for an entry frame (the first a native call
/// of the eval loop runs; the frames from one entry frame to the next ran in one native frame of
/// `_PyEval_EvalFrameDefault`), `build_id[12..20]` the code object's fingerprint
/// (`InterpreterCodeKey::fingerprint`), `offset_or_ip` the index of its current instruction (in
/// code units) in the code object.
pub const FRAME_PYTHON: i32 = 3;

/// A Perl frame, stored after the native frames of its stack: `build_id[0..8]` its code (the CV
/// of a sub; for another kind, the address of its file's name), `build_id[8]` 1 for the last frame
/// of a stack of contexts (one run of the op loop), `build_id[9]` its `perl_frame` kind,
/// `offset_or_ip` the line it is at.
pub const FRAME_PERL: i32 = 4;

/// What a Perl frame is (`FRAME_PERL`'s `build_id[9]`).
pub mod perl_frame {
    /// A sub's body: its code is its CV.
    pub const SUB: u8 = 0;
    /// The main program's code outside any sub (NYTProf's `main::RUNTIME`).
    pub const MAIN: u8 = 1;
    /// An `eval` (a string or a block).
    pub const EVAL: u8 = 2;
    /// A file's code run by `require` or `use`.
    pub const REQUIRE: u8 = 3;
}

/// No frame (past the end of the stack).
pub const FRAME_EMPTY: i32 = 0;
/// `build_id` and a file offset are valid.
pub const FRAME_BUILD_ID: i32 = 1;
/// The kernel could not read a build ID; only the address is known.
pub const FRAME_IP: i32 = 2;

/// A user call stack of at most `SHALLOW_STACK_DEPTH` frames, innermost frame (the allocator's
/// caller) first, zeroed past its end.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackFrames {
    pub frames: [StackFrame; SHALLOW_STACK_DEPTH],
}

/// A user call stack deeper than `SHALLOW_STACK_DEPTH` frames, innermost first, zeroed past its
/// end. Its first `SHALLOW_STACK_DEPTH` frames have the layout of a `StackFrames`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeepStackFrames {
    pub frames: [StackFrame; STACK_DEPTH],
}

const _: () = assert!(STACK_DEPTH.is_power_of_two() && SHALLOW_STACK_DEPTH.is_power_of_two());
const _: () = assert!(PYTHON_MAX_FRAMES.is_power_of_two());
const _: () = assert!(core::mem::size_of::<PythonLayout>().is_multiple_of(8));
const _: () = assert!(core::mem::size_of::<PerlLayout>().is_multiple_of(8));
const _: () = assert!(SHALLOW_STACK_DEPTH < STACK_DEPTH);

/// Python frames read per stack at most (innermost first); deeper ones are left out.
pub const PYTHON_MAX_FRAMES: usize = 32;
/// The frames the Python walk looks at, at most: the Python ones it keeps, 3.13's shim frames
/// (one a run of the eval loop) between them, and one more, which says whether they were cut.
pub const PYTHON_MAX_STEPS: u32 = 2 * PYTHON_MAX_FRAMES as u32 + 1;
/// Python code objects whose names the kernel keeps at once (all processes).
pub const PYTHON_MAX_CODES: u32 = 16_384;

/// Where a CPython version keeps what the unwinder reads: byte offsets into its structs (for 3.11,
/// from its own headers; for 3.13, from the interpreter's own `_Py_DebugOffsets`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PythonLayout {
    /// 0: the thread is the GIL holder, `_PyRuntime.gilstate.tstate_current` (3.11); 1: the
    /// thread is found in its interpreter's list of threads (3.12 and later keep the current
    /// one in a thread-local).
    pub thread_list: u32,
    /// `_PyRuntime.gilstate.tstate_current`: the thread state holding the GIL (3.11).
    pub runtime_tstate_current: u32,
    /// `_PyRuntime.interpreters.head`, `PyInterpreterState.threads.head`, `PyThreadState.next`
    /// (the list of threads), and `PyThreadState.current_frame` (3.13).
    pub runtime_interpreters_head: u32,
    pub interp_threads_head: u32,
    pub tstate_next: u32,
    pub tstate_current_frame: u32,
    /// `PyThreadState.native_thread_id` (the thread's tid), `.cframe`, `_PyCFrame.current_frame`
    /// (3.11).
    pub tstate_native_thread_id: u32,
    pub tstate_cframe: u32,
    pub cframe_current_frame: u32,
    /// `_PyInterpreterFrame.f_code` (3.13: `f_executable`), `.previous`, `.prev_instr` (3.13:
    /// `instr_ptr`), `.is_entry` (3.11), `.owner` (3.13; a byte), all within 72 bytes of the
    /// first (checked by userspace); the owner of a shim frame its eval loop runs from
    /// (`FRAME_OWNED_BY_CSTACK`, 3.13).
    pub frame_code: u32,
    pub frame_previous: u32,
    pub frame_prev_instr: u32,
    pub frame_is_entry: u32,
    pub frame_owner: u32,
    pub owner_cstack: u32,
    /// `PyCodeObject.co_name`, `.co_filename`, `.co_firstlineno`, `.co_linetable`,
    /// `.co_code_adaptive` (its instructions).
    pub code_name: u32,
    pub code_filename: u32,
    pub code_firstlineno: u32,
    pub code_linetable: u32,
    pub code_instructions: u32,
    /// `PyASCIIObject.state` and the size of a compact ASCII string's header (its characters
    /// follow); the state's bits that say compact and ASCII.
    pub unicode_state: u32,
    pub unicode_ascii_data: u32,
    pub unicode_compact_ascii: u32,
    /// `PyVarObject.ob_size` and `PyBytesObject.ob_sval`.
    pub bytes_size: u32,
    pub bytes_data: u32,
    pub _pad: u32,
}

/// The words of an interpreter frame the unwinder reads at once, from its `frame_code`.
pub const PYTHON_FRAME_WORDS: usize = 9;
/// Thread states looked at to find the allocating thread's (3.13), at most.
pub const PYTHON_MAX_THREADS: u32 = 256;
/// Threads whose thread states the kernel remembers (3.13; all processes).
pub const PYTHON_CACHED_THREADS: u32 = 4096;

/// A process running CPython: where its runtime state is, and the version's layout.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PythonProcess {
    /// The address of `_PyRuntime` in the process.
    pub runtime: u64,
    pub layout: PythonLayout,
}

/// A NUL-terminated string the kernel copied (a name of `PythonCode`, `PerlSub`), without its NUL
/// and what follows it.
pub fn until_nul(bytes: &[u8]) -> &[u8] {
    bytes.split(|&b| b == 0).next().unwrap_or(bytes)
}

/// The interpreters whose frames the unwinder reads (`UnwindMappings::interpreter`).
pub mod interpreter {
    pub const NONE: u32 = 0;
    pub const PYTHON: u32 = 1;
    pub const PERL: u32 = 2;
}

/// Where Perl 5.36 keeps what the unwinder reads: byte offsets into its structs, from its own
/// headers (`offsetof`, as Debian's perl is built: threads and multiplicity, x86-64).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerlLayout {
    /// `PerlInterpreter.Icurcop` (the statement running), `.Icurstackinfo`.
    pub interp_curcop: u32,
    pub interp_curstackinfo: u32,
    /// `.Iphase` (an enum, 4 bytes) and `PERL_PHASE_RUN`: the main program runs (not compiled,
    /// constructed or destructed).
    pub interp_phase: u32,
    pub phase_run: u32,
    /// `PERL_SI.si_cxstack`, `.si_prev`, `.si_cxix` (the innermost context's index, I32).
    pub si_cxstack: u32,
    pub si_prev: u32,
    pub si_cxix: u32,
    /// `sizeof(PERL_CONTEXT)`; its `blk_oldcop` (the caller's statement) and `blk_sub.cv`. Its
    /// first word holds the type (`cx_type & CXTYPEMASK`) and, in bytes 2 and 3, `blk_u16`, whose
    /// bits from 7 up are an eval's op type (`CxOLD_OP_TYPE`).
    pub context_size: u32,
    pub context_oldcop: u32,
    pub context_sub_cv: u32,
    /// `CXt_SUB`, `CXt_EVAL`, `CXTYPEMASK`, and `OP_REQUIRE`.
    pub type_sub: u32,
    pub type_eval: u32,
    pub type_mask: u32,
    pub op_require: u32,
    /// `COP.cop_line` (U32) and `.cop_file` (a char pointer, with threads).
    pub cop_line: u32,
    pub cop_file: u32,
    /// `XPVCV.xcv_gv_u` (the sub's GV; its name's HEK for a lexical sub), `.xcv_file`,
    /// `.xcv_flags` (U32), `.xcv_stash`; `CVf_NAMED`.
    pub cv_gv: u32,
    pub cv_file: u32,
    pub cv_flags: u32,
    pub cv_stash: u32,
    pub cv_named: u32,
    /// `XPVGV.xiv_u.xivu_namehek` (the GV's name) and `.xnv_u.xgv_stash` (its package).
    pub gv_name: u32,
    pub gv_stash: u32,
    /// The stash's body: `xpvhv_with_aux.xhv_aux.xhv_name_u` and `.xhv_name_count` (I32).
    pub stash_name: u32,
    pub stash_name_count: u32,
    /// `HEK.hek_key`: a name's characters.
    pub hek_key: u32,
}

/// A process running Perl: the address of its `PL_curinterp` (the main thread's interpreter), of
/// its `PL_thr_key` (the thread-specific key each thread's interpreter is kept under, 0 where it
/// has none or its C library's keys are not known), the C library's thread keys, and the
/// version's layout.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerlProcess {
    pub curinterp: u64,
    pub thr_key: u64,
    pub keys: ThreadKeys,
    pub layout: PerlLayout,
}

/// Where a C library keeps a thread's thread-specific data (what `pthread_getspecific` returns),
/// as glibc describes it to libthread_db (its `_thread_db_*` symbols): the thread's `struct
/// pthread` (at the thread pointer, the FS base on x86-64) holds at `specific` pointers to blocks
/// of `keys_per_block` key records of `record_size` bytes each, whose `data` is the value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadKeys {
    pub specific: u32,
    pub keys_per_block: u32,
    pub record_size: u32,
    pub data: u32,
}

/// What the kernel copies of a Perl frame's code the first time a stack holds it: a sub's package,
/// name and file; another kind's file alone (NUL-terminated, cut to fit).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PerlSub {
    pub package: [u8; 64],
    pub name: [u8; 64],
    pub file: [u8; 192],
    /// 1 once the kernel has written the rest (userspace takes only complete records).
    pub complete: u32,
    pub _pad: u32,
}

/// Perl frames read per stack at most (they share `PYTHON_MAX_FRAMES` slots); the contexts looked
/// at for them, at most.
pub const PERL_MAX_CONTEXTS: u32 = 128;

/// A code object (Python) or sub (Perl) of a process, as the kernel names it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct InterpreterCodeKey {
    pub tgid: u32,
    pub _pad: u32,
    pub code: u64,
    /// What tells the code object from another freed before it at the same address (Python's:
    /// its name's and file's string objects; 0 for Perl).
    pub fingerprint: u64,
}

/// What the kernel copies of a code object the first time a stack holds it, so that it is named
/// after its process is gone: its name and file (NUL-terminated, cut to fit; empty where not
/// compact ASCII), its first line and its location table (cut to fit; lines past it are the
/// last line it gives).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PythonCode {
    pub name: [u8; 64],
    pub filename: [u8; 192],
    pub linetable: [u8; 512],
    /// Bytes of `linetable` copied.
    pub linetable_len: u32,
    pub firstlineno: u32,
    /// 1 once the kernel has written the rest (userspace takes only complete records).
    pub complete: u32,
    pub _pad: u32,
}

/// Key of the per-(process, stack) totals.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StackKey {
    pub tgid: u32,
    pub _pad: u32,
    pub stack: u64,
}

/// What one call stack of one process allocated, and how much of it is still live.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize, serde::Deserialize))]
pub struct StackTotals {
    /// CLOCK_MONOTONIC nanoseconds when the first allocation from this stack was seen (a clock of
    /// the machine that traced: not kept in a summary).
    #[cfg_attr(feature = "user", serde(skip))]
    pub started_ns: u64,
    pub allocations: u64,
    pub allocated_bytes: u64,
    pub live_allocations: i64,
    pub live_bytes: i64,
    /// Allocations freed before the thread that made them allocated anything else (heaptrack's
    /// temporary allocations).
    pub temporary_allocations: u64,
    pub temporary_bytes: u64,
}

/// A thread's allocator state, one slot per thread updated in place (no insert and delete per
/// call): how deep in allocator calls it is, and the outermost call in flight. Only the outermost
/// call counts, so a nested call (glibc's realloc calling malloc) never overwrites it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadState {
    /// Allocator calls the thread is inside; 0 between calls.
    pub depth: u32,
    /// The outermost call's `AllocatorFunction`.
    pub function: u32,
    pub call: PendingCall,
    /// `--sample`: bytes this thread allocates before its next sampled allocation.
    pub until_sample: u64,
    /// The block of the thread's latest allocation: freeing it before any other allocation makes
    /// it a temporary allocation. 0 once freed.
    pub last_block: u64,
    /// A C library mapping call in flight (mmap, munmap, mremap), for its return to account.
    pub map_call: PendingMapCall,
    /// `--window`: the window generation (`WINDOW_GENERATION`) when the outermost call was entered.
    pub window: u64,
}

/// A slot of memtrace-ebpf's thread array (threads.rs): the tid that holds it (0 when free: the
/// idle task makes no calls) and its state. Userspace frees the slots of threads whose exit the
/// kernel did not run process_exit for (a run it skipped).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadSlot {
    pub tid: u64,
    pub state: ThreadState,
}

/// The C library's calls that map and unmap memory, probed to follow anonymous mappings: the BPF
/// cookie of their probes is the discriminant.
#[repr(u64)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MapFunction {
    /// mmap(addr, len, prot, flags, fd, offset)
    Mmap = 1,
    /// munmap(addr, len)
    Munmap = 2,
    /// mremap(old, old_len, new_len, flags, new_addr)
    Mremap = 3,
}

impl MapFunction {
    /// Every one, with its symbol.
    pub const ALL: [(MapFunction, &'static str); 3] = [
        (MapFunction::Mmap, MapFunction::Mmap.symbol()),
        (MapFunction::Munmap, MapFunction::Munmap.symbol()),
        (MapFunction::Mremap, MapFunction::Mremap.symbol()),
    ];

    /// Its symbol.
    pub const fn symbol(self) -> &'static str {
        match self {
            MapFunction::Mmap => "mmap",
            MapFunction::Munmap => "munmap",
            MapFunction::Mremap => "mremap",
        }
    }

    /// The arguments map_enter keeps that map_exit reads: mmap's len, prot and flags (the last two
    /// `int`s), munmap's addr and len, mremap's old address and new length.
    pub const fn arguments(self) -> ArgumentsRead {
        match self {
            MapFunction::Mmap => ArgumentsRead { read: 0b1110, narrow: 0b1100 },
            MapFunction::Munmap => ArgumentsRead::wide(0b011),
            MapFunction::Mremap => ArgumentsRead::wide(0b101),
        }
    }

    /// The function whose discriminant is `value` (a match, as for `AllocatorFunction`).
    pub const fn from_discriminant(value: u64) -> Option<Self> {
        Some(match value {
            1 => MapFunction::Mmap,
            2 => MapFunction::Munmap,
            3 => MapFunction::Mremap,
            _ => return None,
        })
    }
}

/// The arguments of a mapping call in flight, as its entry probe saw them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PendingMapCall {
    /// The `MapFunction`; 0 when none is in flight.
    pub function: u64,
    pub args: [u64; 5],
    /// Whether the thread was inside an allocator call: what it maps is the allocator's.
    pub inside_allocator: u64,
}

/// An anonymous private mapping of a traced process, by its start.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionKey {
    pub tgid: u32,
    pub _pad: u32,
    pub start: u64,
}

/// How long a mapping is and whose figure it counts in (`region_kind`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Region {
    pub len: u64,
    pub kind: u64,
}

pub mod region_kind {
    /// Mapped inside an allocator call: `allocator_mapped_bytes`.
    pub const ALLOCATOR: u64 = 1;
    /// Mapped by the program itself: `program_mapped_bytes`.
    pub const PROGRAM: u64 = 2;
    /// A thread stack: in no figure (dark memory), followed so its unmap is recognised.
    pub const STACK: u64 = 3;
}

/// The most anonymous mappings followed at once, over every traced process.
pub const MAX_REGIONS: u32 = 262_144;

/// Where an allocator's code lies around its free probe, by the allocator's index
/// (`ProbeCookie::allocator`): a return address in [probe - before, probe + after) is a call from
/// the allocator's own executable segment. Zero where unknown.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocatorCode {
    pub before: u64,
    pub after: u64,
}

/// Allocators whose code range is kept (indices past it fall back to the mapping table).
pub const MAX_ALLOCATOR_CODES: u32 = 1024;

/// Arguments of an allocator call in flight, as far as the return probe needs them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PendingCall {
    /// Requested bytes (n * size for calloc and reallocarray, saturated on overflow).
    pub size: u64,
    /// realloc/reallocarray: the block being resized; posix_memalign: where the result is stored.
    pub address: u64,
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are #[repr(C)] plain integers without padding holes that matter to the kernel.
    unsafe impl aya::Pod for super::ProcessStats {}
    unsafe impl aya::Pod for super::OomEvent {}
    unsafe impl aya::Pod for super::AllocationKey {}
    unsafe impl aya::Pod for super::Allocation {}
    unsafe impl aya::Pod for super::LiveSlot {}
    unsafe impl aya::Pod for super::ThreadState {}
    unsafe impl aya::Pod for super::ThreadSlot {}
    unsafe impl aya::Pod for super::PendingCall {}
    // USDT: #[repr(C)] plain integers and byte arrays, padding spelled out as fields.
    unsafe impl aya::Pod for super::UsdtSpec {}
    unsafe impl aya::Pod for super::SubsystemKey {}
    unsafe impl aya::Pod for super::SubsystemValue {}
    unsafe impl aya::Pod for super::DumpRound {}
    unsafe impl aya::Pod for super::UsdtCounterKey {}
    unsafe impl aya::Pod for super::UsdtCounterValue {}
    unsafe impl aya::Pod for super::StackFrames {}
    unsafe impl aya::Pod for super::DeepStackFrames {}
    unsafe impl aya::Pod for super::PythonProcess {}
    unsafe impl aya::Pod for super::InterpreterCodeKey {}
    unsafe impl aya::Pod for super::PythonCode {}
    unsafe impl aya::Pod for super::PerlProcess {}
    unsafe impl aya::Pod for super::PerlSub {}
    unsafe impl aya::Pod for super::StackKey {}
    unsafe impl aya::Pod for super::StackTotals {}
    unsafe impl aya::Pod for super::ExecEvent {}
    unsafe impl aya::Pod for super::ImageKey {}
    unsafe impl aya::Pod for super::KernelLayout {}
    unsafe impl aya::Pod for super::RegionKey {}
    unsafe impl aya::Pod for super::Region {}
    unsafe impl aya::Pod for super::AllocatorCode {}
}

// ---- USDT -------------------------------------------------------------------------------------

/// Capacity of the USDT spec table: one entry per use of an attached probe site. A site is one
/// probe whose BPF cookie indexes the first of its uses; they follow one another, and the last has
/// `UsdtSpec::last_of_site` set.
pub const MAX_USDT_SPECS: u32 = 8_192;
/// Uses of one probe site at most (the memtrace provider's report plus `--usdt` requests).
pub const MAX_USES_PER_SITE: u32 = 8;
/// Subsystem counters kept at once, over all processes.
pub const MAX_SUBSYSTEMS: u32 = 16_384;
/// `--usdt` counters kept at once, over all processes.
pub const MAX_USDT_COUNTERS: u32 = 16_384;
/// Longest subsystem name kept, including its terminating NUL; longer names are cut.
pub const SUBSYSTEM_NAME_LEN: usize = 64;
/// Arguments a spec decodes: the memtrace provider's name and value; `--usdt ...=argN` uses one;
/// `otel_memory:alloc` takes three (ptr, size, weighted_bytes).
pub const USDT_SPEC_ARGS: usize = 3;
/// Index of the one slot of the `USDT_LOST_EVENTS` array.
pub const USDT_LOST_SLOT: u32 = 0;
/// Threads running dump rounds (include/memtrace.h's registered dumpers) at once, over all
/// processes: one a process that registers dumpers, one more for each object of it that does.
pub const MAX_DUMP_STREAMS: u32 = 4_096;
/// Rounds a subsystem keeps its value of, at `round % ROUND_SLOTS`. Userspace reads the rounds
/// complete, then the subsystems, then the rounds again: the value of the last complete round `C`
/// is intact unless round `C + ROUND_SLOTS` began during that read, which it checks (three whole
/// rounds while one map is read). Four: 2 would need the dumpers' interval to be longer than one
/// read of the subsystem map by a safe margin; 4 leaves three rounds of margin.
pub const ROUND_SLOTS: usize = 4;

/// What the USDT handler does when a probe site fires (`UsdtSpec::action`).
pub mod usdt_action {
    /// `memtrace:report_total(name, bytes)`: the subsystem's value becomes `bytes`.
    pub const REPORT_TOTAL: u32 = 1;
    /// `memtrace:report_delta(name, delta)`: `delta` is added to the subsystem's value.
    pub const REPORT_DELTA: u32 = 2;
    /// `--usdt PROVIDER:NAME`: count hits.
    pub const COUNT_HITS: u32 = 3;
    /// `--usdt PROVIDER:NAME=argN`: count hits and keep the last value of one argument.
    pub const TRACK_ARGUMENT: u32 = 4;
    /// `memtrace:dump_begin(dump_no)`: the thread's reports until its `dump_end` are one round.
    pub const DUMP_BEGIN: u32 = 5;
    /// `memtrace:dump_end(dump_no)`: the thread's round `dump_no` is complete.
    pub const DUMP_END: u32 = 6;
    /// `otel_memory:alloc(ptr, size, weighted_bytes)` with `--app-sampled`: an allocation the
    /// allocator sampled, standing for `weighted_bytes` bytes. Handled by `sampled_site`.
    pub const SAMPLED_ALLOC: u32 = 7;
    /// `otel_memory:free(ptr)` with `--app-sampled`: a sampled block freed.
    pub const SAMPLED_FREE: u32 = 8;
}

/// How an argument's value is found (`UsdtArg::location`).
pub mod usdt_location {
    /// The argument is not decoded.
    pub const NONE: u8 = 0;
    /// `8@$5`: the value is `UsdtArg::value`.
    pub const CONSTANT: u8 = 1;
    /// `-4@%eax`: the value is in a register.
    pub const REGISTER: u8 = 2;
    /// `-4@-12(%rbp)`, `8@16(%rax,%rbx,8)`: the value is in the target's memory.
    pub const MEMORY: u8 = 3;
}

/// One decoded x86-64 argument spec of a probe site, in the form the BPF handler evaluates.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsdtArg {
    /// CONSTANT: the value; MEMORY: the displacement added to the address.
    pub value: i64,
    /// Byte offset in `struct pt_regs` of the value register (REGISTER) or base register (MEMORY).
    pub register_offset: u16,
    /// Byte offset in `struct pt_regs` of the index register (MEMORY with `scale` != 0).
    pub index_offset: u16,
    /// One of `usdt_location`.
    pub location: u8,
    /// Size of the value in bytes: 1, 2, 4 or 8.
    pub size: u8,
    /// 1 when the value is sign-extended from `size` bytes (`-4@`), 0 when zero-extended (`4@`).
    pub signed: u8,
    /// Index multiplier (1, 2, 4, 8); 0 when there is no index register.
    pub scale: u8,
    /// 1 when MEMORY has a base register (`(,%rbx,8)` has none).
    pub has_base: u8,
    /// Right shift of the register value: 8 for %ah, %bh, %ch, %dh, else 0.
    pub register_shift: u8,
    pub _pad: [u8; 6],
}

/// What the handler knows about one attached probe site; indexed by the link's BPF cookie.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsdtSpec {
    /// One of `usdt_action`.
    pub action: u32,
    /// COUNT_HITS, TRACK_ARGUMENT: which `--usdt` counter the site feeds.
    pub counter: u32,
    /// REPORT_*: [subsystem name pointer, value]; TRACK_ARGUMENT: [tracked argument, unused].
    pub args: [UsdtArg; USDT_SPEC_ARGS],
    /// 1 on the last use of its probe site, 0 when the next spec serves the same site.
    pub last_of_site: u32,
    pub _pad: u32,
}

/// Key of the subsystem map: a subsystem name is only unique within one process.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubsystemKey {
    pub tgid: u32,
    pub _pad: u32,
    /// The name as the target passed it, NUL-terminated and NUL-padded.
    pub name: [u8; SUBSYSTEM_NAME_LEN],
}

/// A subsystem of one process: its latest value, and its value in each of the last rounds of
/// registered dumpers that reported it (include/memtrace.h), so that userspace can show every
/// subsystem of a process as of one round (`DumpRound::complete`), never half of one.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SubsystemValue {
    /// The latest value, reported in a round or not.
    pub value: i64,
    /// The round of the latest report; 0 when that report came outside any round.
    pub latest_round: u64,
    /// The thread whose rounds `rounds` counts (its `DUMP_ROUNDS` key is tgid << 32 | this).
    pub round_tid: u32,
    pub _pad: u32,
    /// At `r % ROUND_SLOTS`: the latest round r reported in (0: none) ...
    pub rounds: [u64; ROUND_SLOTS],
    /// ... and the value at the end of that round.
    pub round_values: [i64; ROUND_SLOTS],
}

/// The dump rounds of one thread (include/memtrace.h's dumper thread), keyed by its pid_tgid
/// (tgid << 32 | tid). A round is open while `begun > complete`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DumpRound {
    /// The `dump_no` of the latest `dump_begin`.
    pub begun: u64,
    /// The `dump_no` of the latest round whose `dump_end` came after its `dump_begin`.
    pub complete: u64,
}

/// Key of the `--usdt` counter map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsdtCounterKey {
    pub tgid: u32,
    /// Index of the `--usdt` option, in command-line order.
    pub counter: u32,
}

/// A `--usdt` counter of one process.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsdtCounterValue {
    pub hits: u64,
    /// The tracked argument at the latest hit (TRACK_ARGUMENT only).
    pub value: i64,
}

// ---- Unwind tables ------------------------------------------------------------------------------
//
// Userspace turns an object file's .eh_frame (and .debug_frame) into `UnwindRow`s indexed by page
// (memtrace-user/src/collect/unwind/); the BPF unwinder looks rows up by file offset and steps one frame
// with each. Addresses here are FILE OFFSETS: for an ELF virtual address `v` inside an executable
// PT_LOAD, `v - p_vaddr + p_offset`; for a runtime address `a` inside a file mapping, `a - start +
// offset` (the mapping's start and file offset as /proc/PID/maps shows them). Both agree because
// the loader maps each PT_LOAD at a page-aligned `p_offset`.

/// Most rows a page's run may hold (`pages[p + 1] - pages[p] + 1`): the run is searched with at most
/// `UNWIND_SEARCH_STEPS` halvings. Tables are built so that no run is longer: each file gets the
/// largest page size whose runs fit (libc: 256-byte pages, runs up to 46 rows; python3.11: 512).
pub const UNWIND_MAX_RUN: u32 = 1 << UNWIND_SEARCH_STEPS;
/// Halvings of the binary search within one page's run (log2 of `UNWIND_MAX_RUN`).
pub const UNWIND_SEARCH_STEPS: u32 = 6;
/// Largest `UnwindTableInfo::page_shift` the builder chooses (4 KiB pages).
pub const UNWIND_MAX_PAGE_SHIFT: u8 = 12;
/// Smallest `UnwindTableInfo::page_shift` the builder chooses (16-byte pages).
pub const UNWIND_MIN_PAGE_SHIFT: u8 = 4;
/// `UnwindRow::rbp` when the caller's rbp cannot be recovered from this frame: an rbp-based CFA in
/// the caller's frame ends the stack.
pub const UNWIND_RBP_LOST: i8 = i8::MIN;

/// How the CFA (the caller's rsp after the return: the address just above the return address) is
/// found, in `UnwindRow::kind`.
pub mod unwind_kind {
    /// No unwind information covers this address (a gap between functions, or before the first):
    /// the lookup finds no row. The BPF side may fall back to frame pointers there.
    pub const NONE: u8 = 0;
    /// CFA = rsp + cfa_offset.
    pub const CFA_RSP: u8 = 1;
    /// CFA = rbp + cfa_offset.
    pub const CFA_RBP: u8 = 2;
    /// The expression of every x86-64 PLT entry (binutils' lazy PLT):
    /// CFA = rsp + cfa_offset + ((rip & 15) >= 11 ? 8 : 0). `rip` is the runtime address; its low 4
    /// bits equal the file offset's, since PT_LOAD segments are mapped page-aligned.
    pub const CFA_PLT: u8 = 3;
    /// The outermost frame (`_start`, thread entry: the return address is DW_CFA_undefined): the
    /// stack is whole and ends here.
    pub const END: u8 = 4;
    /// The function has unwind information that this format cannot express (a CFA in another
    /// register or computed by another expression, a frame over 64 KiB, a return address not at
    /// CFA-8, a signal trampoline): the stack ends here, cut short.
    pub const UNSUPPORTED: u8 = 5;
}

/// One unwind row: from `pc` (a file offset) up to the next row's `pc`, how to step one frame.
/// 8 bytes. With `rsp`, `rbp` and `rip` of a frame, the BPF side and the userspace reference
/// (memtrace-user/src/collect/unwind/reference.rs) step to the caller's frame so:
///
/// 1. `cfa` per `kind` (see `unwind_kind`); NONE, END and UNSUPPORTED do not step. CFA_RBP with an
///    unknown rbp (a previous row said UNWIND_RBP_LOST) ends the stack.
/// 2. return address = *(u64 *)(cfa - 8) (x86-64: the return address column, r16, is always saved
///    at CFA-8; rows where it is not are UNSUPPORTED). A return address of 0 ends the stack.
/// 3. caller's rbp = `rbp == 0` ? rbp (unchanged) : `rbp == UNWIND_RBP_LOST` ? unknown :
///    *(u64 *)(cfa + 8 * rbp).
/// 4. caller's rsp = cfa, caller's rip = return address. For every frame but the innermost, the
///    row is looked up at `rip - 1` (inside the call instruction, which may be the function's last).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct UnwindRow {
    /// File offset of the first instruction this row covers.
    pub pc: u32,
    /// Added to rsp or rbp to get the CFA (CFA_RSP, CFA_RBP, CFA_PLT); 0 otherwise.
    pub cfa_offset: u16,
    /// One of `unwind_kind`.
    pub kind: u8,
    /// Where the caller's rbp was saved, in 8-byte units from the CFA (e.g. -2: at CFA-16); 0 when
    /// rbp still holds the caller's value; `UNWIND_RBP_LOST` when it cannot be recovered.
    pub rbp: i8,
}

/// Where one file's rows and pages are, and how its pages are cut. A table is two arrays:
/// `rows` (`UnwindRow`, sorted by `pc`, starting with a row at `first_page << page_shift` and ending
/// with a NONE row at the end of the last function) and `pages` (`u32` row indices, `page_count +
/// 1` of them), where `pages[i]` is the index of the last row whose `pc <= (first_page + i) <<
/// page_shift`, so the rows that can cover an address in page `i` are `rows[pages[i]..=pages[i +
/// 1]]`: at most `UNWIND_MAX_RUN` of them.
///
/// The lookup of file offset `pc`, exactly as the BPF side implements it (reference:
/// `memtrace_user::unwind::index::lookup`):
///
/// ```text
/// page = pc >> page_shift                       // page_shift & 31 for the verifier
/// if page < first_page: no row
/// i = page - first_page
/// if i >= page_count: no row
/// lo = pages[i]; hi = pages[i + 1] + 1          // rows[lo].pc <= pc < rows[hi].pc (or hi = end)
/// repeat UNWIND_SEARCH_STEPS times:             // hi - lo <= UNWIND_MAX_RUN
///     if hi - lo <= 1: break
///     mid = lo + (hi - lo) / 2
///     if rows[mid].pc <= pc: lo = mid else: hi = mid
/// row = rows[lo]
/// if row.kind == NONE: no row
/// ```
///
/// Indices into `pages` and `rows` are relative to this file's table; the loader adds
/// `pages_start` and `rows_start` when the tables of many files share two large maps.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindTableInfo {
    /// Page number (`pc >> page_shift`) of `pages[0]`.
    pub first_page: u32,
    /// Pages indexed; `pages` holds one more entry than this.
    pub page_count: u32,
    /// Rows in the table.
    pub row_count: u32,
    /// Where this file's `pages[0]` is in a shared page map (set by the loader; 0 when alone).
    pub pages_start: u32,
    /// Where this file's `rows[0]` is in a shared row map (set by the loader; 0 when alone).
    pub rows_start: u32,
    /// log2 of the page size, between UNWIND_MIN_PAGE_SHIFT and UNWIND_MAX_PAGE_SHIFT.
    pub page_shift: u8,
    pub _pad: [u8; 3],
}

#[cfg(feature = "user")]
mod unwind_pod {
    // SAFETY: #[repr(C)] plain integers, padding spelled out as fields.
    unsafe impl aya::Pod for super::UnwindRow {}
    unsafe impl aya::Pod for super::UnwindTableInfo {}
}

const _: () = assert!(core::mem::size_of::<UnwindRow>() == 8);
// Rows have distinct `pc`s, so the smallest page's run (the row covering its start, then at most
// one row per byte) always fits: every table can be indexed.
const _: () = assert!((1u32 << UNWIND_MIN_PAGE_SHIFT) < UNWIND_MAX_RUN);
const _: () = assert!(core::mem::size_of::<UnwindTableInfo>() == 24);

// ---- Unwind tables in the kernel ----------------------------------------------------------------
//
// Userspace loads each object file's table once (by file identity) into two shared arrays
// (`UNWIND_ROWS`, `UNWIND_PAGES`) and describes the file in `UNWIND_FILES` at a slot of its own;
// each traced process gets a sorted table of its executable file mappings (`UNWIND_MAPPINGS`, by
// tgid) naming those slots. The BPF unwinder (memtrace-ebpf/src/stacks.rs) finds a frame's mapping
// by binary search, turns its address into a file offset, looks the row up in the file's table
// (the lookup on `UnwindTableInfo`) and steps per `UnwindRow`; where the file has no unwind
// information at all it follows frame pointers.

/// Executable file mappings per process the unwinder knows; a process with more keeps the first.
pub const UNWIND_MAX_MAPPINGS: usize = 256;
/// Halvings of the binary search over a process's mappings (log2 of `UNWIND_MAX_MAPPINGS`).
pub const UNWIND_MAPPING_STEPS: u32 = 8;
/// Processes with a mapping table at once.
pub const UNWIND_MAX_PROCESSES: u32 = 8_192;
/// Object files with a slot in `UNWIND_FILES`.
pub const UNWIND_MAX_FILES: u32 = 8_192;
/// Rows of every loaded table together (8 bytes each: 32 MiB); a file that no longer fits stays
/// without a table (its stacks end with `unwind_stop::NO_TABLE`).
pub const UNWIND_MAX_ROWS: u32 = 1 << 22;
/// Page index entries of every loaded table together (4 bytes each).
pub const UNWIND_MAX_PAGES: u32 = 1 << 21;
/// `UnwindMapping::file` and `FrameLocation::file` when no file slot applies.
pub const UNWIND_NO_FILE: u32 = u32::MAX;

/// What the unwinder can do in one file, in `UnwindFile::state`.
pub mod unwind_file_state {
    /// The table is being built or does not fit: stacks end here (`unwind_stop::NO_TABLE`).
    pub const PENDING: u8 = 0;
    /// `UnwindFile::table` is loaded.
    pub const LOADED: u8 = 1;
    /// The file has no unwind information: frame pointers are followed through it.
    pub const FRAME_POINTERS: u8 = 2;
}

/// One object file the unwinder knows, at its slot in `UNWIND_FILES`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindFile {
    /// Where its rows and pages are in the shared arrays (valid when LOADED).
    pub table: UnwindTableInfo,
    /// One of `unwind_file_state`.
    pub state: u8,
    /// 1 when `build_id` is valid.
    pub has_build_id: u8,
    pub _pad: [u8; 2],
    /// The file's GNU build ID, zero-padded to 20 bytes (as `StackFrame::build_id`).
    pub build_id: [u8; 20],
}

/// One executable file mapping of a process: runtime addresses [start, end) map the file from
/// `file_offset`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindMapping {
    pub start: u64,
    pub end: u64,
    pub file_offset: u64,
    /// The file's slot in `UNWIND_FILES`.
    pub file: u32,
    pub _pad: u32,
}

/// A process's executable file mappings, sorted by `start`, not overlapping; `count` are valid.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnwindMappings {
    pub count: u32,
    /// The interpreter whose frames the unwinder reads in the process (`interpreter::PYTHON`,
    /// its `PythonProcess` by tgid; `interpreter::PERL`, its `PerlProcess`), or `interpreter::NONE`.
    pub interpreter: u32,
    pub mappings: [UnwindMapping; UNWIND_MAX_MAPPINGS],
}

/// Why the unwinder ended a stack: the index of its counter in `ProcessStats::unwind_stops`.
pub mod unwind_stop {
    /// The outermost frame (an END row) or a return address of 0: the stack is whole.
    pub const WHOLE: usize = 0;
    /// The process has no mapping table yet: its stack was taken by frame pointers alone, cut at
    /// the first frame outside a file the kernel can name.
    pub const NO_MAPPINGS: usize = 1;
    /// The next return address is in no executable file mapping the unwinder knows (a library
    /// loaded since its table was last written, JIT code): the frame is left out.
    pub const NO_MAPPING: usize = 2;
    /// The frame's file has no table loaded yet.
    pub const NO_TABLE: usize = 3;
    /// No row covers the address and there is no frame pointer to follow.
    pub const NO_ROW: usize = 4;
    /// The row is UNSUPPORTED, or needs an rbp an earlier frame lost.
    pub const UNSUPPORTED: usize = 5;
    /// The stack could not be read where the row points.
    pub const READ_FAULT: usize = 6;
    /// `STACK_DEPTH` frames were taken: deeper callers are cut.
    pub const DEPTH_LIMIT: usize = 7;
    /// Counters.
    pub const COUNT: usize = 8;
    /// Their names, by index, as the summary shows them.
    pub const NAMES: [&str; COUNT] = [
        "whole",
        "no_mappings",
        "no_mapping",
        "no_table",
        "no_row",
        "unsupported",
        "read_fault",
        "depth_limit",
    ];
}

/// Why a stack's interpreter frames (Python's, Perl's) ended before the interpreter's outermost
/// frame: the index of its counter in `ProcessStats::interpreter_stops`. A stack whose interpreter
/// part is whole, or that has none, counts nothing here.
pub mod interpreter_stop {
    /// A frame (or the list of frames, a context) could not be read: the part ends before it.
    pub const UNREADABLE: usize = 0;
    /// `PYTHON_MAX_FRAMES` interpreter frames were taken, or the stack's `STACK_DEPTH` frames
    /// were full with native ones: the outer ones are cut.
    pub const DEPTH_LIMIT: usize = 1;
    /// Counters.
    pub const COUNT: usize = 2;
    /// Their names, by index, as the summary shows them among its `unwind_stops`.
    pub const NAMES: [&str; COUNT] = ["interpreter_unreadable", "interpreter_depth_limit"];
}

#[cfg(feature = "user")]
mod unwind_kernel_pod {
    // SAFETY: #[repr(C)] plain integers and byte arrays, padding spelled out as fields.
    unsafe impl aya::Pod for super::UnwindFile {}
    unsafe impl aya::Pod for super::UnwindMapping {}
    unsafe impl aya::Pod for super::UnwindMappings {}
}

const _: () = assert!(1 << UNWIND_MAPPING_STEPS == UNWIND_MAX_MAPPINGS);
const _: () = assert!(interpreter_stop::COUNT.is_power_of_two() && unwind_stop::COUNT.is_power_of_two());
const _: () = assert!(core::mem::size_of::<UnwindFile>() == 48);
const _: () = assert!(core::mem::size_of::<KernelLayout>() == 128);
const _: () = assert!(core::mem::size_of::<LiveSlot>() == 48);
