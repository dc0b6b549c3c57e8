//! USDT probe sites: what the handler knows of each (`UsdtSpec`, its arguments decoded as
//! `UsdtArg`) and what it keeps: the subsystem counters of include/memtrace.h with their dump rounds
//! (`SubsystemKey`, `SubsystemValue`, `DumpRound`), and `--usdt` counters (`UsdtCounterKey`,
//! `UsdtCounterValue`).

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

#[cfg(feature = "user")]
mod pod {
    // SAFETY: #[repr(C)] plain integers and byte arrays, padding spelled out as fields.
    unsafe impl aya::Pod for super::UsdtSpec {}
    unsafe impl aya::Pod for super::SubsystemKey {}
    unsafe impl aya::Pod for super::SubsystemValue {}
    unsafe impl aya::Pod for super::DumpRound {}
    unsafe impl aya::Pod for super::UsdtCounterKey {}
    unsafe impl aya::Pod for super::UsdtCounterValue {}
}
