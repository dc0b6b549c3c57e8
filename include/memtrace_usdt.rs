//! memtrace's USDT probes from Rust (x86-64 Linux): the same `memtrace:report_total` and
//! `memtrace:report_delta` probes that include/memtrace.h gives C and C++, with no dependency.
//!
//! Copy this file into a crate, or include it as a module:
//!
//! ```ignore
//! #[path = "/path/to/memtrace/include/memtrace_usdt.rs"]
//! mod memtrace_usdt;
//!
//! memtrace_usdt::report_total(c"textures", texture_bytes);
//! memtrace_usdt::report_delta(c"cache", 4096);
//! if memtrace_usdt::enabled() { /* expensive counting */ }
//! static CLOCK: memtrace_usdt::ReportClock = memtrace_usdt::ReportClock::new();
//! if CLOCK.due(500) { memtrace_usdt::report_total(c"cache", cache_bytes()); }
//! ```
//!
//! Each call site writes a `.note.stapsdt` note as <sys/sdt.h> does (so `memtrace usdt PATH`,
//! bpftrace or perf see it) and a nop at the site. The probes share one semaphore, `SEMAPHORE`, in
//! the `.probes` section: the kernel raises it while a tracer is attached, so untraced, a report
//! costs one load and a branch, and its arguments are not passed. The functions are
//! `#[inline(always)]` so that every caller gets a probe site of its own.
//!
//! Names are C strings (`&CStr`) of up to 63 bytes; memtrace reads them when the probe fires.

use core::{
    ffi::CStr,
    sync::atomic::{AtomicI64, AtomicU16, Ordering},
};

/// The probes' semaphore: nonzero while a tracer listens. Only the kernel writes it.
#[link_section = ".probes"]
#[used]
pub static SEMAPHORE: AtomicU16 = AtomicU16::new(0);

/// Is memtrace (or another tracer) listening to this program's memtrace probes?
#[inline(always)]
pub fn enabled() -> bool {
    SEMAPHORE.load(Ordering::Relaxed) != 0
}

/// Writes a probe site with two arguments, `8@<pointer register> -8@<value register>`, as
/// <sys/sdt.h>'s STAP_PROBE2 does. `$name` is the probe's name, a string literal.
macro_rules! memtrace_probe2 {
    ($name:literal, $subsystem:expr, $value:expr) => {
        // SAFETY: a nop at the site, and data in non-allocated note sections; no register or memory
        // changes.
        unsafe {
            core::arch::asm!(
                "990: nop",
                ".pushsection .note.stapsdt, \"\", \"note\"",
                ".balign 4",
                ".4byte 992f-991f, 994f-993f, 3",
                "991: .asciz \"stapsdt\"",
                "992: .balign 4",
                "993: .8byte 990b",
                ".8byte _.stapsdt.base",
                ".8byte {semaphore}",
                ".asciz \"memtrace\"",
                concat!(".asciz \"", $name, "\""),
                ".asciz \"8@{subsystem} -8@{value}\"",
                "994: .balign 4",
                ".popsection",
                ".ifndef _.stapsdt.base",
                ".pushsection .stapsdt.base, \"aG\", \"progbits\", .stapsdt.base, comdat",
                ".weak _.stapsdt.base",
                ".hidden _.stapsdt.base",
                "_.stapsdt.base: .space 1",
                ".size _.stapsdt.base, 1",
                ".popsection",
                ".endif",
                semaphore = sym SEMAPHORE,
                subsystem = in(reg) $subsystem,
                value = in(reg) $value,
                options(att_syntax, nostack, preserves_flags, readonly),
            );
        }
    };
}

/// The subsystem `name` now holds `bytes` bytes.
// `_.stapsdt.base` is defined once per object, guarded by `.ifndef`, like <sys/sdt.h> does.
#[allow(named_asm_labels)]
#[inline(always)]
pub fn report_total(name: &CStr, bytes: i64) {
    if enabled() {
        memtrace_probe2!("report_total", name.as_ptr(), bytes);
    }
}

/// The subsystem `name` grew by `delta` bytes (shrank, if negative).
#[allow(named_asm_labels)]
#[inline(always)]
pub fn report_delta(name: &CStr, delta: i64) {
    if enabled() {
        memtrace_probe2!("report_delta", name.as_ptr(), delta);
    }
}

/// Rate-limits reports: `due(ms)` is true when memtrace listens and this clock has not said so
/// within the last `ms` milliseconds. Thread-safe; one per call site (a `static`) is typical.
pub struct ReportClock {
    last_ns: AtomicI64,
}

impl ReportClock {
    pub const fn new() -> Self {
        Self {
            last_ns: AtomicI64::new(0),
        }
    }

    pub fn due(&self, interval_ms: u32) -> bool {
        if !enabled() {
            return false;
        }
        let now = monotonic_ns();
        let last = self.last_ns.load(Ordering::Relaxed);
        if last != 0 && now - last < i64::from(interval_ms) * 1_000_000 {
            return false;
        }
        self.last_ns
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }
}

impl Default for ReportClock {
    fn default() -> Self {
        Self::new()
    }
}

/// CLOCK_MONOTONIC in nanoseconds, never 0. std::time::Instant hides its value, and this file has no
/// dependency to ask libc with, so it measures from the first call.
fn monotonic_ns() -> i64 {
    use std::{sync::OnceLock, time::Instant};
    static START: OnceLock<Instant> = OnceLock::new();
    let start = *START.get_or_init(Instant::now);
    start.elapsed().as_nanos() as i64 + 1
}
