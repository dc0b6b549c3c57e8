//! Map keys, map values and constants shared by the BPF programs (`memtrace-ebpf`) and the loader
//! (`memtrace-user`). Everything here is `#[repr(C)]` so both sides agree on the layout byte for byte.
#![no_std]

/// Maximum number of processes with kernel-side statistics at once.
pub const MAX_PROCESSES: u32 = 16_384;
/// Default capacity of the live-allocation map; the loader may resize it before loading.
pub const DEFAULT_MAX_LIVE_ALLOCATIONS: u32 = 1 << 20;
/// Threads that can be inside an allocator call at the same time.
pub const MAX_PENDING_CALLS: u32 = 65_536;

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
}

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
}
