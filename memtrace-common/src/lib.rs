//! Map keys, map values and constants shared by the BPF programs (`memtrace-ebpf`) and the loader
//! (`memtrace-user`). Everything here is `#[repr(C)]` so both sides agree on the layout byte for byte.
#![no_std]

/// Maximum number of processes with kernel-side statistics at once.
pub const MAX_PROCESSES: u32 = 16_384;
/// Default capacity of the live-allocation map; the loader may resize it before loading.
pub const DEFAULT_MAX_LIVE_ALLOCATIONS: u32 = 1 << 20;
/// Threads that can be inside an allocator call at the same time.
pub const MAX_PENDING_CALLS: u32 = 65_536;

/// Distinct call stacks remembered at once (per machine).
pub const MAX_STACKS: u32 = 16_384;
/// (process, stack) pairs with totals at once.
pub const MAX_STACK_TOTALS: u32 = 65_536;
/// Frames kept per stack, innermost first; deeper stacks are cut at the outer end.
pub const STACK_DEPTH: usize = 32;
/// `Allocation::stack` when no stack was taken (--no-stacks, or the stack could not be recorded).
pub const NO_STACK: u64 = 0;

/// Index of the one slot of the `LOST_EVENTS` array: losses that cannot be charged to a process.
pub const GLOBAL_LOST_SLOT: u32 = 0;

/// The allocator entry points memtrace probes. The discriminant is part of the pending-call key, so
/// a nested call of another function never overwrites the outer call's arguments.
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
    /// Which allocator probes saw the process first: the BPF cookie of the attachment, 0 unknown.
    pub allocator: u64,
    /// The process's command name when it first allocated, and when it exited.
    pub comm: [u8; 16],
}

/// A process that began running a new program (sched_process_exec), for system-wide tracing to
/// look for allocators it has not probed yet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecEvent {
    pub tgid: u32,
}

/// Capacity of the exec event ring buffer in bytes.
pub const EXEC_EVENTS_BYTES: u32 = 64 * 1024;
/// Pids excluded from system-wide tracing at once.
pub const MAX_EXCLUDED_PIDS: u32 = 1024;
/// Command names `--comm` may name at once.
pub const MAX_COMMS: u32 = 64;
/// The most entries the kernel accepts in a hash map (`--max-allocations`): it rounds the entries
/// up to a power of two buckets of 16 bytes whose total must fit in 32 bits (E2BIG beyond).
pub const MAX_LIVE_ALLOCATIONS_LIMIT: u32 = 1 << 27;

/// Key of the live-allocation map: addresses are only unique within one address space.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

/// One user stack frame as the kernel resolves it at capture time (struct bpf_stack_build_id): the
/// file's build ID and offset while the process is alive, so it can be symbolized after it exits.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackFrame {
    /// FRAME_EMPTY, FRAME_BUILD_ID or FRAME_IP.
    pub status: i32,
    pub build_id: [u8; 20],
    /// File offset for FRAME_BUILD_ID, virtual address for FRAME_IP.
    pub offset_or_ip: u64,
}

/// No frame (past the end of the stack).
pub const FRAME_EMPTY: i32 = 0;
/// `build_id` and a file offset are valid.
pub const FRAME_BUILD_ID: i32 = 1;
/// The kernel could not read a build ID; only the address is known.
pub const FRAME_IP: i32 = 2;

/// A user call stack, innermost frame (the allocator's caller) first.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackFrames {
    pub frames: [StackFrame; STACK_DEPTH],
}

/// Key of the per-(process, stack) totals.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StackKey {
    pub tgid: u32,
    pub _pad: u32,
    pub stack: u64,
}

/// What one call stack of one process allocated, and how much of it is still live.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackTotals {
    /// CLOCK_MONOTONIC nanoseconds when the first allocation from this stack was seen.
    pub started_ns: u64,
    pub allocations: u64,
    pub allocated_bytes: u64,
    pub live_allocations: i64,
    pub live_bytes: i64,
}

/// Key of an allocator call in flight between its entry probe and its return probe.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingKey {
    pub tid: u32,
    pub function: u32,
}

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
    unsafe impl aya::Pod for super::AllocationKey {}
    unsafe impl aya::Pod for super::Allocation {}
    unsafe impl aya::Pod for super::PendingKey {}
    unsafe impl aya::Pod for super::PendingCall {}
    // USDT: #[repr(C)] plain integers and byte arrays, padding spelled out as fields.
    unsafe impl aya::Pod for super::UsdtSpec {}
    unsafe impl aya::Pod for super::SubsystemKey {}
    unsafe impl aya::Pod for super::UsdtCounterKey {}
    unsafe impl aya::Pod for super::UsdtCounterValue {}
    unsafe impl aya::Pod for super::StackFrames {}
    unsafe impl aya::Pod for super::StackKey {}
    unsafe impl aya::Pod for super::StackTotals {}
    unsafe impl aya::Pod for super::ExecEvent {}
}

// ---- USDT -------------------------------------------------------------------------------------

/// Capacity of the USDT spec table: one entry per attached probe site; the BPF cookie is the index.
pub const MAX_USDT_SPECS: u32 = 8_192;
/// Subsystem counters kept at once, over all processes.
pub const MAX_SUBSYSTEMS: u32 = 16_384;
/// `--usdt` counters kept at once, over all processes.
pub const MAX_USDT_COUNTERS: u32 = 16_384;
/// Longest subsystem name kept, including its terminating NUL; longer names are cut.
pub const SUBSYSTEM_NAME_LEN: usize = 64;
/// Arguments a spec decodes: the memtrace provider's name and value; `--usdt ...=argN` uses one.
pub const USDT_SPEC_ARGS: usize = 2;
/// Index of the one slot of the `USDT_LOST_EVENTS` array.
pub const USDT_LOST_SLOT: u32 = 0;

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
