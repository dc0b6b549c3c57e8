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
//!
//! Registered dumpers, as include/memtrace.h has them (its top comment says how memtrace reads a
//! round: as one dump, never half of one):
//!
//! ```ignore
//! memtrace_usdt::set_dump_interval(Duration::from_millis(250)); // default 1 s
//! let guard = memtrace_usdt::register_dumper(Box::new(move || {
//!     memtrace_usdt::report_total(c"textures", textures.bytes());
//!     memtrace_usdt::report_total(c"meshes", meshes.bytes());
//! }));
//! drop(guard); // deregisters: never called again once the drop returns
//! ```
//!
//! The first registration starts a thread (`memtrace-dumper`) that wakes once an interval and, only
//! while a tracer listens ([`enabled`], from the interval after it began to), calls every
//! registered dumper between the probes `memtrace:dump_begin(u64 dump_no)` and
//! `memtrace:dump_end(u64 dump_no)`. A dumper that panics is called again next round. Unlike the C
//! header's thread, this one keeps the signal mask of the thread that registered first (this file
//! has no libc to block signals with).

use core::{
    ffi::CStr,
    sync::atomic::{AtomicI64, AtomicU16, AtomicU32, AtomicU64, Ordering},
};
use std::{
    sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError},
    thread::{self, ThreadId},
    time::Duration,
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

/// Writes a probe site as <sys/sdt.h>'s STAP_PROBEn does: `$name` is the probe's name and `$args`
/// its argument specs (e.g. `8@{subsystem} -8@{value}`), both string literals, whose placeholders
/// the operands that follow fill in (each `name = in(reg) value,`).
macro_rules! memtrace_probe {
    ($name:literal, $args:literal, $($operands:tt)*) => {
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
                concat!(".asciz \"", $args, "\""),
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
                $($operands)*
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
        memtrace_probe!(
            "report_total",
            "8@{subsystem} -8@{value}",
            subsystem = in(reg) name.as_ptr(),
            value = in(reg) bytes,
        );
    }
}

/// The subsystem `name` grew by `delta` bytes (shrank, if negative).
#[allow(named_asm_labels)]
#[inline(always)]
pub fn report_delta(name: &CStr, delta: i64) {
    if enabled() {
        memtrace_probe!(
            "report_delta",
            "8@{subsystem} -8@{value}",
            subsystem = in(reg) name.as_ptr(),
            value = in(reg) delta,
        );
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

// ---- Registered dumpers ----------------------------------------------------------------------

/// A dumper: reports its subsystems' totals ([`report_total`]) when called.
pub type Dumper = Box<dyn Fn() + Send + Sync>;

/// Registers `dumper`, to be called in every round from now on, from the dumper thread (started
/// by the first registration); dropping the guard deregisters it. Any thread may register.
pub fn register_dumper(dumper: Dumper) -> DumperGuard {
    let mut registry = registry();
    registry.last_id += 1;
    let id = registry.last_id;
    let dumper = Arc::from(dumper);
    match registry.slots.iter().position(Option::is_none) {
        Some(free) => registry.slots[free] = Some((id, dumper)),
        None => registry.slots.push(Some((id, dumper))),
    }
    if registry.thread.is_none() {
        let thread = thread::Builder::new()
            .name("memtrace-dumper".into())
            .spawn(dumper_thread);
        registry.thread = Some(
            thread
                .expect("starting memtrace's dumper thread")
                .thread()
                .id(),
        );
    }
    DumperGuard { id }
}

/// Sets the interval between rounds, from the next one on (default 1 s; at least 1 ms).
pub fn set_dump_interval(interval: Duration) {
    let ms = interval.as_millis().clamp(1, u128::from(u32::MAX)) as u32;
    INTERVAL_MS.store(ms, Ordering::Relaxed);
}

/// Deregisters its dumper when dropped. Once the drop returns, the dumper is never called again: a
/// round under way that may still call it is waited for (unless the drop happens in that round, in
/// a dumper: the round calls no dumper deregistered before its turn).
#[must_use = "dropping the guard deregisters the dumper"]
pub struct DumperGuard {
    id: u64,
}

impl Drop for DumperGuard {
    fn drop(&mut self) {
        let mut registry = registry();
        for slot in registry.slots.iter_mut() {
            if slot.as_ref().is_some_and(|(id, _)| *id == self.id) {
                *slot = None;
            }
        }
        if registry.thread == Some(thread::current().id()) {
            return;
        }
        let round = registry.rounds;
        while registry.running && registry.rounds == round {
            registry = ROUND_DONE
                .wait(registry)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// Times the dumper thread woke, rounds or not (for tests).
#[doc(hidden)]
pub fn dumper_thread_ticks() -> u64 {
    TICKS.load(Ordering::Relaxed)
}

type Slot = Option<(u64, Arc<dyn Fn() + Send + Sync>)>;

/// The dumpers in their slots (a free slot is reused), and the dumper thread's state.
struct Registry {
    slots: Vec<Slot>,
    last_id: u64,
    thread: Option<ThreadId>,
    /// A round is under way.
    running: bool,
    /// Rounds run: the last round's dump_no.
    rounds: u64,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    slots: Vec::new(),
    last_id: 0,
    thread: None,
    running: false,
    rounds: 0,
});
/// Notified when a round ends.
static ROUND_DONE: Condvar = Condvar::new();
static INTERVAL_MS: AtomicU32 = AtomicU32::new(1000);
static TICKS: AtomicU64 = AtomicU64::new(0);

/// The registry, locked. A dumper's panic is caught outside the lock, so a poisoned lock's data is
/// whole.
fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Wakes once an interval and runs a round only while memtrace listens, from the second tick it
/// listens on: the semaphore rises with the first probe site attached, and the others may take a
/// moment more (a round half probed would show half).
fn dumper_thread() {
    let mut listened = false;
    loop {
        let ms = INTERVAL_MS.load(Ordering::Relaxed);
        thread::sleep(Duration::from_millis(u64::from(ms)));
        TICKS.fetch_add(1, Ordering::Relaxed);
        let listening = enabled();
        if listening && listened {
            dump_round();
        }
        listened = listening;
    }
}

/// One round: every registered dumper, between `memtrace:dump_begin` and `memtrace:dump_end`. Each
/// slot is read under the lock just before its call; a dumper that panics is left for the next
/// round (the panic is printed as any thread's is).
#[allow(named_asm_labels)]
fn dump_round() {
    let dump_no = {
        let mut registry = registry();
        if registry.slots.iter().all(Option::is_none) {
            return;
        }
        registry.running = true;
        registry.rounds += 1;
        registry.rounds
    };
    memtrace_probe!("dump_begin", "8@{dump_no}", dump_no = in(reg) dump_no,);
    for index in 0.. {
        // Its own statement: the lock is let go before the call (a dumper may deregister one).
        let slot = registry().slots.get(index).cloned();
        let Some(slot) = slot else { break };
        if let Some((_, dumper)) = slot {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| dumper()));
        }
    }
    memtrace_probe!("dump_end", "8@{dump_no}", dump_no = in(reg) dump_no,);
    registry().running = false;
    ROUND_DONE.notify_all();
}
