//! What the running kernel can do for memtrace, learnt once at start-up with real syscalls, in the
//! spirit of `bpftool feature probe`: tiny programs loaded from raw instructions, maps created,
//! links tried and syscalls' errnos read; never a version check. [`FEATURES`] says, once, what each
//! feature is, the oldest mainline kernel that has it and what memtrace does without it: take a
//! fallback that keeps figures exact, or refuse to start with one error naming the feature.
//! Everything else reads the typed [`KernelFeatures`] (`has`, `link_kind`, `check`).

use std::{fmt, io, os::fd::AsFd, path::Path};

use anyhow::{bail, Result};
use aya_obj::generated::{bpf_attach_type::BPF_TRACE_UPROBE_MULTI, bpf_prog_type::BPF_PROG_TYPE_KPROBE};

use crate::kernel::sys::{bpf, load_raw_program, prog_info, uprobe_multi_link, UprobeMulti};

pub use crate::kernel::kernel_btf::VMLINUX_BTF;
/// The uprobe PMU's perf event type: per-site uprobe perf events exist where this file does.
pub const UPROBE_PMU_TYPE: &str = "/sys/bus/event_source/devices/uprobe/type";
/// Where the uprobe PMU says it takes a semaphore's offset (ref_ctr_offset) in attr.config.
pub const UPROBE_PMU_REF_CTR_OFFSET: &str = "/sys/bus/event_source/devices/uprobe/format/ref_ctr_offset";

/// How probe sites are linked: chosen once, by what the kernel has (and MEMTRACE_LINKS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkKind {
    /// One uprobe_multi link per file and program.
    Multi,
    /// One perf event and one perf link per site (kernels before 6.6).
    PerfEvent,
}

/// A kernel feature memtrace uses or would use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feature {
    Btf,
    UprobeMulti,
    UprobePerfEvents,
    RefCtrOffset,
    Cookies,
    BpfLoop,
    RingBuf,
    MmapableArrays,
    OptimizedUprobes,
    UretprobeSyscall,
    SendSignal,
    RecursionMisses,
    BpfStats,
    ExactRssCounters,
}

/// What memtrace does on a kernel without a feature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Without {
    /// Refuses to start: nothing stands in for it. Says what needs it ("which ... need").
    Refuse(&'static str),
    /// Refuses to follow a process tree, which needs it; other runs do without.
    RefuseForTrees(&'static str),
    /// Refuses to start unless the other feature is there, which serves instead.
    RefuseUnless(Feature, &'static str),
    /// Goes on another way, which this says.
    Fallback(&'static str),
}

/// One row of the feature table.
#[derive(Debug, Clone, Copy)]
pub struct FeatureInfo {
    pub feature: Feature,
    pub name: &'static str,
    /// The oldest mainline kernel that has it (major, minor).
    pub since: (u32, u32),
    pub without: Without,
}

/// Every feature, in the order `memtrace doctor` lists them: the table said once.
#[rustfmt::skip]
pub const FEATURES: [FeatureInfo; 14] = [
    row(Feature::Btf, "BTF (/sys/kernel/btf/vmlinux)", (5, 4), Without::RefuseForTrees(
        "following a process tree needs (where the kernel keeps a task's parent and memory)")),
    row(Feature::UprobeMulti, "uprobe_multi links", (6, 6), Without::Fallback(
        "per-site uprobe perf links (the same figures; each site takes ~100 ms to detach)")),
    row(Feature::UprobePerfEvents, "uprobe perf events", (4, 17), Without::RefuseUnless(
        Feature::UprobeMulti, "attaching probes needs without uprobe_multi links")),
    row(Feature::RefCtrOffset, "uprobe semaphores (ref_ctr_offset)", (4, 20), Without::Fallback(
        "per-site links cannot raise USDT semaphores: apps that test them report nothing")),
    row(Feature::Cookies, "BPF cookies (bpf_get_attach_cookie)", (5, 15), Without::Refuse(
        "memtrace's probes need to tell which function or USDT site fired")),
    row(Feature::BpfLoop, "bpf_loop", (5, 17), Without::Refuse(
        "memtrace's unwinder and live-allocation table need")),
    row(Feature::RingBuf, "BPF ring buffers", (5, 8), Without::Refuse(
        "memtrace's exec announcements need")),
    row(Feature::MmapableArrays, "mmapable BPF arrays (BPF_F_MMAPABLE)", (5, 5), Without::Refuse(
        "memtrace's live-allocation table needs")),
    row(Feature::OptimizedUprobes, "optimized uprobes (uprobe syscall)", (6, 18), Without::Fallback(
        "nothing to do: each probe hit costs a trap (a little slower)")),
    row(Feature::UretprobeSyscall, "uretprobe syscall", (6, 11), Without::Fallback(
        "nothing to do: each return probe costs a trap (a little slower)")),
    row(Feature::SendSignal, "bpf_send_signal (stopping an exec from BPF)", (5, 3), Without::Fallback(
        "execs are not held: a followed static program is probed after its first instructions")),
    row(Feature::RecursionMisses, "bpf_prog_info recursion_misses", (5, 12), Without::Fallback(
        "runs the kernel skips cannot be counted in lost_events")),
    row(Feature::BpfStats, "BPF run-time stats (kernel.bpf_stats_enabled)", (5, 1), Without::Fallback(
        "nothing to do: memtrace does not read them (they time its programs in `bpftool prog`)")),
    row(Feature::ExactRssCounters, "exact RSS counters (no per-thread cache)", (6, 2), Without::Fallback(
        "/proc's RssAnon lags up to 64 page faults a thread: mappings are read every sample")),
];

const fn row(feature: Feature, name: &'static str, since: (u32, u32), without: Without) -> FeatureInfo {
    FeatureInfo { feature, name, since, without }
}

/// What a refusal tells users to do, unless the feature says otherwise.
const NEWER_KERNEL: &str = "run memtrace on a newer kernel (Debian 12's 6.1 is the oldest tested)";
const TREES_WITHOUT_BTF: &str = "trace with --no-children (or --pid without --children), or on a kernel \
                                 built with CONFIG_DEBUG_INFO_BTF";

impl Feature {
    pub fn info(self) -> &'static FeatureInfo {
        FEATURES.iter().find(|info| info.feature == self).expect("every feature has a row")
    }
}

/// Whether the kernel has a feature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Presence {
    Found,
    /// Missing, and how the probe saw it (an errno, a file not there).
    Missing(String),
    /// The probe could not tell (no privilege to try).
    Unknown(String),
}

/// How the kernel preempts: where it does, another thread can run on a CPU in the middle of a
/// uprobe program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Preemption {
    /// PREEMPT_NONE or PREEMPT_VOLUNTARY, built in (no finer word in `uname -v`).
    NotPreemptible,
    /// A mode `/sys/kernel/debug/sched/preempt` or `preempt=` named: none, voluntary, full, lazy.
    Mode(String),
    /// PREEMPT_RT.
    Realtime,
    /// PREEMPT_DYNAMIC with the mode unknown (debugfs not mounted, no preempt= at boot).
    DynamicUnknown,
}

impl fmt::Display for Preemption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotPreemptible => write!(f, "none or voluntary (not preemptible)"),
            Self::Mode(mode) => write!(f, "{mode}"),
            Self::Realtime => write!(f, "PREEMPT_RT (fully preemptible)"),
            Self::DynamicUnknown => {
                write!(f, "dynamic, mode unknown (mount debugfs to read /sys/kernel/debug/sched/preempt)")
            }
        }
    }
}

/// The kernel as `uname` and debugfs describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    pub release: String,
    pub version: String,
    pub preemption: Preemption,
}

/// What the kernel can do, probed once.
#[derive(Debug, Clone)]
pub struct KernelFeatures {
    pub kernel: Kernel,
    found: Vec<(Feature, Presence)>,
}

/// What the run at hand asks of the kernel beyond what every run does.
#[derive(Debug, Clone, Copy, Default)]
pub struct Needs {
    pub follows_tree: bool,
}

impl KernelFeatures {
    /// Probes every feature of the running kernel.
    pub fn probe() -> Self {
        let found = FEATURES.iter().map(|info| (info.feature, probe(info.feature))).collect();
        Self { kernel: running_kernel(), found }
    }

    /// A description made by hand, for tests: every feature found but those in `missing`.
    #[cfg(test)]
    pub fn with_missing(release: &str, missing: &[Feature]) -> Self {
        let presence = |feature| match missing.contains(&feature) {
            true => Presence::Missing("absent".into()),
            false => Presence::Found,
        };
        let found = FEATURES.iter().map(|info| (info.feature, presence(info.feature))).collect();
        let kernel = Kernel {
            release: release.into(),
            version: String::new(),
            preemption: Preemption::NotPreemptible,
        };
        Self { kernel, found }
    }

    pub fn presence(&self, feature: Feature) -> &Presence {
        let found = self.found.iter().find(|(each, _)| *each == feature);
        &found.expect("every feature is probed").1
    }

    pub fn has(&self, feature: Feature) -> bool {
        *self.presence(feature) == Presence::Found
    }

    /// Whether the kernel is known to lack a feature (not merely unprobed).
    pub fn lacks(&self, feature: Feature) -> bool {
        matches!(self.presence(feature), Presence::Missing(_))
    }

    /// How probe sites are linked on this kernel: one uprobe_multi link per file, or a perf link
    /// per site.
    pub fn link_kind(&self) -> LinkKind {
        match self.has(Feature::UprobeMulti) {
            true => LinkKind::Multi,
            false => LinkKind::PerfEvent,
        }
    }

    /// The features this run cannot do without that the kernel lacks, newest first.
    pub fn missing_requirements(&self, needs: Needs) -> Vec<&'static FeatureInfo> {
        let mut missing: Vec<&FeatureInfo> = FEATURES
            .iter()
            .filter(|info| self.lacks(info.feature))
            .filter(|info| match info.without {
                Without::Refuse(_) => true,
                Without::RefuseForTrees(_) => needs.follows_tree,
                Without::RefuseUnless(other, _) => !self.has(other),
                Without::Fallback(_) => false,
            })
            .collect();
        missing.sort_by_key(|info| std::cmp::Reverse(info.since));
        missing
    }

    /// Fails with one error naming the newest feature the run needs and the kernel lacks, the
    /// oldest kernel that has it and what to do.
    pub fn check(&self, needs: Needs) -> Result<()> {
        match self.refusal(needs) {
            Some(refusal) => bail!("{refusal}"),
            None => Ok(()),
        }
    }

    /// What `check` says, if it refuses.
    pub fn refusal(&self, needs: Needs) -> Option<String> {
        let missing = self.missing_requirements(needs);
        let (first, others) = missing.split_first()?;
        let (needs_it, fix) = match first.without {
            Without::RefuseForTrees(needs_it) => (needs_it, TREES_WITHOUT_BTF),
            Without::Refuse(needs_it) | Without::RefuseUnless(_, needs_it) => (needs_it, NEWER_KERNEL),
            Without::Fallback(what) => (what, NEWER_KERNEL),
        };
        let (major, minor) = first.since;
        let also = match others {
            [] => String::new(),
            _ => format!(
                ", and lacks {} too",
                others.iter().map(|info| info.name).collect::<Vec<_>>().join(", ")
            ),
        };
        Some(format!(
            "this kernel ({}) lacks {}, which {needs_it} (Linux {major}.{minor} or later){also}; {fix}",
            self.kernel.release, first.name
        ))
    }
}

fn probe(feature: Feature) -> Presence {
    match feature {
        Feature::Btf => file_exists(VMLINUX_BTF),
        Feature::UprobeMulti => uprobe_multi(),
        Feature::UprobePerfEvents => file_exists(UPROBE_PMU_TYPE),
        Feature::RefCtrOffset => file_exists(UPROBE_PMU_REF_CTR_OFFSET),
        Feature::Cookies => helper(HELPER_GET_ATTACH_COOKIE),
        Feature::BpfLoop => helper(HELPER_LOOP),
        Feature::RingBuf => map_creation(MapAttr::ringbuf()),
        Feature::MmapableArrays => map_creation(MapAttr::mmapable_array()),
        Feature::OptimizedUprobes => syscall_exists(SYS_UPROBE),
        Feature::UretprobeSyscall => syscall_exists(SYS_URETPROBE),
        Feature::SendSignal => helper(HELPER_SEND_SIGNAL),
        Feature::RecursionMisses => recursion_misses(),
        Feature::BpfStats => bpf_stats(),
        Feature::ExactRssCounters => exact_rss_counters(),
    }
}

fn file_exists(path: &str) -> Presence {
    match Path::new(path).exists() {
        true => Presence::Found,
        false => Presence::Missing(format!("no {path}")),
    }
}

/// The kernel's release and preemption model.
fn running_kernel() -> Kernel {
    let uname = nix::sys::utsname::uname().ok();
    let text =
        |field: Option<&std::ffi::OsStr>| field.map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
    let release = text(uname.as_ref().map(|u| u.release()));
    let version = text(uname.as_ref().map(|u| u.version()));
    let debugfs = std::fs::read_to_string("/sys/kernel/debug/sched/preempt").ok();
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let preemption = preemption(&version, debugfs.as_deref(), &cmdline);
    Kernel { release, version, preemption }
}

/// The preemption model from `uname -v`, refined by debugfs (`none voluntary (full) lazy`, the
/// mode in use in parentheses) or the boot's `preempt=` where the model is chosen at boot.
fn preemption(version: &str, debugfs: Option<&str>, cmdline: &str) -> Preemption {
    let chosen = debugfs.and_then(|modes| {
        let mode = modes.split_whitespace().find(|mode| mode.starts_with('('))?;
        Some(mode.trim_matches(|c| c == '(' || c == ')').to_owned())
    });
    if let Some(mode) = chosen {
        return Preemption::Mode(mode);
    }
    let words: Vec<&str> = version.split_whitespace().collect();
    if words.contains(&"PREEMPT_RT") {
        return Preemption::Realtime;
    }
    if let Some(mode) = words.iter().find_map(|word| word.strip_prefix("PREEMPT(")) {
        return Preemption::Mode(mode.trim_end_matches(')').to_owned());
    }
    if words.contains(&"PREEMPT_DYNAMIC") {
        let boot = cmdline.split_whitespace().find_map(|word| word.strip_prefix("preempt="));
        return boot.map_or(Preemption::DynamicUnknown, |mode| Preemption::Mode(mode.to_owned()));
    }
    match words.contains(&"PREEMPT") {
        true => Preemption::Mode("full".into()),
        false => Preemption::NotPreemptible,
    }
}

/// One BPF instruction as the kernel reads it: opcode, registers, offset, immediate.
const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    code as u64 | ((src << 4 | dst) as u64) << 8 | (off as u16 as u64) << 16 | (imm as u32 as u64) << 32
}

/// r0 = 0
const RETURN_ZERO: u64 = insn(0xb7, 0, 0, 0, 0);
const EXIT: u64 = insn(0x95, 0, 0, 0, 0);
/// enum bpf_func_id
const HELPER_GET_ATTACH_COOKIE: i32 = 174;
const HELPER_LOOP: i32 = 181;
const HELPER_SEND_SIGNAL: i32 = 109;

/// How a load failed, as a feature probe reads it: no privilege says nothing of the kernel.
fn refused(error: &io::Error) -> Presence {
    match error.raw_os_error() {
        Some(libc::EPERM | libc::EACCES) => Presence::Unknown(format!("{error}: needs root")),
        _ => Presence::Missing(error.to_string()),
    }
}

/// A helper exists for kprobe-type programs unless the verifier calls it unknown (libbpf's
/// libbpf_probe_bpf_helper): the call's arguments may well be wrong, which is another message.
fn helper(id: i32) -> Presence {
    let program = [insn(0x85, 0, 0, 0, id), RETURN_ZERO, EXIT];
    match load_raw_program(BPF_PROG_TYPE_KPROBE as u32, 0, &program) {
        Ok(_) => Presence::Found,
        Err(refusal) if refusal.log.contains("invalid func ") || refusal.log.contains("unknown func ") => {
            Presence::Missing(
                refusal.log.lines().find(|line| line.contains(" func ")).unwrap_or("").to_owned(),
            )
        }
        // The verifier never ran (no privilege, or an attribute this kernel does not know).
        Err(refusal) if refusal.log.is_empty() => refused(&refusal.error),
        Err(_) => Presence::Found,
    }
}

/// uprobe_multi links, as libbpf probes them: a link on "/" (a directory) fails with EBADF where
/// the kernel knows the link type; with pid -1 it fails with EINVAL where the kernel filters
/// processes rather than threads (kernels before 6.9's fix looked the pid up, failing with ESRCH:
/// memtrace attaches per process, so those take the per-site links).
fn uprobe_multi() -> Presence {
    let program = [RETURN_ZERO, EXIT];
    let loaded = load_raw_program(BPF_PROG_TYPE_KPROBE as u32, BPF_TRACE_UPROBE_MULTI as u32, &program);
    let program = match loaded {
        Ok(program) => program,
        Err(refusal) => return refused(&refusal.error),
    };
    // pid -1 as the kernel reads the field (a pid_t).
    let errno = |pid| {
        let link = UprobeMulti {
            path: c"/",
            offsets: &[0],
            cookies: &[0],
            ref_ctr_offsets: &[],
            pid,
            returns: false,
        };
        uprobe_multi_link(program.as_fd(), &link).err().and_then(|e| e.raw_os_error())
    };
    match (errno(0), errno(u32::MAX)) {
        (Some(libc::EBADF), Some(libc::EINVAL)) => Presence::Found,
        (Some(libc::EBADF), Some(libc::ESRCH)) => {
            Presence::Missing("its pid filter follows threads, not processes (fixed in 6.9)".into())
        }
        (Some(code), _) if code != libc::EBADF => refused(&io::Error::from_raw_os_error(code)),
        (first, second) => {
            Presence::Missing(format!("unexpected answers to a link probe: {first:?}, {second:?}"))
        }
    }
}

/// `union bpf_attr` for BPF_MAP_CREATE, as far as a feature probe needs it.
#[repr(C)]
struct MapAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
}

impl MapAttr {
    fn ringbuf() -> Self {
        const BPF_MAP_TYPE_RINGBUF: u32 = 27;
        // A ring buffer's size is a power of 2 and a multiple of the page size.
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u32;
        Self { map_type: BPF_MAP_TYPE_RINGBUF, key_size: 0, value_size: 0, max_entries: page, map_flags: 0 }
    }

    fn mmapable_array() -> Self {
        const BPF_MAP_TYPE_ARRAY: u32 = 2;
        const BPF_F_MMAPABLE: u32 = 1 << 10;
        Self {
            map_type: BPF_MAP_TYPE_ARRAY,
            key_size: 4,
            value_size: 8,
            max_entries: 1,
            map_flags: BPF_F_MMAPABLE,
        }
    }
}

const BPF_MAP_CREATE: libc::c_long = 0;

fn map_creation(attr: MapAttr) -> Presence {
    // SAFETY: the attribute outlives the call, its size is passed along (the kernel zero-extends
    // it) and the result is a new descriptor or -1.
    let created = unsafe { bpf(BPF_MAP_CREATE, std::ptr::from_ref(&attr).cast(), size_of::<MapAttr>()) };
    created.map_or_else(|error| refused(&error), |_| Presence::Found)
}

/// struct bpf_prog_info carries recursion_misses (at byte 208) where the kernel fills at least
/// 216 bytes of it.
fn recursion_misses() -> Presence {
    const RECURSION_MISSES_END: u32 = 216;
    let program = match load_raw_program(BPF_PROG_TYPE_KPROBE as u32, 0, &[RETURN_ZERO, EXIT]) {
        Ok(program) => program,
        Err(refusal) => return refused(&refusal.error),
    };
    match prog_info::info_size(program.as_fd()) {
        Err(error) => refused(&error),
        Ok(filled) if filled >= RECURSION_MISSES_END => Presence::Found,
        Ok(filled) => Presence::Missing(format!("bpf_prog_info is {filled} bytes")),
    }
}

/// The sysctl that turns BPF run-time stats on. Only looked at: turning the stats on, even for a
/// moment (BPF_ENABLE_STATS), flips a static key, which rewrites the kernel's text at every
/// program-run site while other programs run there (a 6.12 kernel of the matrix took an int3 Oops
/// in uprobe_prog_run as one memtrace probed and another traced).
fn bpf_stats() -> Presence {
    let sysctl = std::path::Path::new("/proc/sys/kernel/bpf_stats_enabled");
    match sysctl.exists() {
        true => Presence::Found,
        false => Presence::Missing(format!("no {}", sysctl.display())),
    }
}

/// Before 6.2 each thread caches its changes to the process's RSS counters (struct task_rss_stat,
/// SPLIT_RSS_COUNTING) and adds them in every 64 page faults: /proc/PID/status's RssAnon can stay
/// put while the process's pages change, so it cannot say when to read its mappings again.
fn exact_rss_counters() -> Presence {
    match crate::kernel::kernel_btf::has_struct(Path::new(VMLINUX_BTF), "task_rss_stat") {
        Ok(false) => Presence::Found,
        Ok(true) => Presence::Missing("threads cache their RSS counts (struct task_rss_stat)".into()),
        Err(err) => Presence::Unknown(format!("{err:#}")),
    }
}

/// Syscall numbers on x86-64 (arch/x86/entry/syscalls/syscall_64.tbl).
const SYS_URETPROBE: libc::c_long = 335;
const SYS_UPROBE: libc::c_long = 336;
/// A child's exit status: the syscall returned ENOSYS.
const CHILD_ENOSYS: i32 = 3;
/// A child's exit status: the kernel raised SIGILL, as it does when the syscall exists but was not
/// made from a uprobe trampoline.
const CHILD_SIGILL: i32 = 4;

extern "C" fn exit_on_sigill(_: libc::c_int) {
    // SAFETY: _exit is async-signal-safe and ends the probing child.
    unsafe { libc::_exit(CHILD_SIGILL) }
}

/// Whether a uprobe syscall exists: made outside a trampoline, it kills the caller with SIGILL, so
/// a forked child makes it (with a SIGILL handler, so no core is dumped).
fn syscall_exists(number: libc::c_long) -> Presence {
    if cfg!(not(target_arch = "x86_64")) {
        return Presence::Missing("x86-64 only".into());
    }
    // SAFETY: the child calls only async-signal-safe functions (sigaction, syscall, _exit).
    let child = unsafe { libc::fork() };
    if child == 0 {
        // SAFETY: as above; the handler only calls _exit.
        unsafe {
            libc::signal(libc::SIGILL, exit_on_sigill as *const () as libc::sighandler_t);
            let result = libc::syscall(number);
            let enosys = result == -1 && *libc::__errno_location() == libc::ENOSYS;
            libc::_exit(if enosys { CHILD_ENOSYS } else { 0 });
        }
    }
    if child < 0 {
        return Presence::Unknown(format!("fork: {}", io::Error::last_os_error()));
    }
    let status = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(child), None);
    match status {
        Ok(nix::sys::wait::WaitStatus::Exited(_, CHILD_ENOSYS)) => Presence::Missing("ENOSYS".into()),
        Ok(nix::sys::wait::WaitStatus::Exited(_, CHILD_SIGILL | 0)) => Presence::Found,
        other => Presence::Unknown(format!("the probing child ended as {other:?}")),
    }
}

#[cfg(test)]
mod tests;
