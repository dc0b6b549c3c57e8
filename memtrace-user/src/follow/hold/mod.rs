//! Holding execs until their program is probed, in one room: the launched command's own exec,
//! held on a pipe until every probe is in place (`command`); and the execs of followed processes
//! (a tree, or every process under `--all`), which the BPF side stops at exec when their program
//! is new to memtrace, so that a static program or one with a private allocator is exact from its
//! first instruction. This file keeps the books of those stops: which processes are stopped and
//! since when, and it continues each exactly once (SIGCONT): when the main loop has probed its
//! program ([`HeldExecs::probed`]), at the hold's bound, or when the hold is released.
//!
//! How a stop happens (memtrace-ebpf's processes.rs): sched_process_exec fires once the new
//! program is loaded and before it runs; where the switch (HOLD_EXECS) is on and the program's file
//! (device and inode, as the kernel names it) is not in KNOWN_IMAGES, the tracepoint sends the
//! process SIGSTOP (bpf_send_signal), which it takes on its way back to user mode, and announces
//! the exec on the ring buffer it already had, marked stopped. A program memtrace has probed once
//! is known from then on: its later execs are not stopped at all (probes belong to files, and the
//! BPF side filters processes). No fanotify permission event: nothing taints the kernel.
//!
//! What a stop shows: it is a real job-control stop. A parent that waits with WUNTRACED (an
//! interactive shell with job control, a debugger) sees the child stop and continue; a process
//! under ptrace reports the SIGSTOP to its tracer. A pid namespace's init (a container's first
//! process) ignores SIGSTOP from the kernel: it is not held, and memtrace cannot tell (its probes
//! are attached as soon as the exec is read, as without a hold).
//!
//! Stopping memtrace (SIGTSTP): the caller releases the hold first (the switch goes off, every
//! stopped process is continued), and resumes it when continued. If memtrace is killed while a
//! process is stopped, nothing continues that process: SIGCONT it by hand.

pub mod command;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{kill, Signal},
    unistd::Pid,
};

use crate::kernel::ArrayCell;

/// The bound: a stopped exec is continued after this long, probed or not. A stopped process
/// holds up nothing else (unlike an exec held inside the kernel), so the bound only has to
/// outlast a slow attach: on Debian 12's 6.1 in the matrix's VM, a static program's per-site perf
/// links took longer than the 500 ms the fanotify hold allowed.
pub const DEFAULT_BOUND: Duration = Duration::from_secs(5);

/// What is missed when execs cannot be held.
pub const MISSED_WITHOUT_HOLD: &str =
    "execs of static programs and of programs with a private allocator are \
     probed after their first instructions (their first allocations are missed)";

/// What the hold did so far, so that misses can be reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HoldStats {
    /// Execs stopped until their program was probed.
    pub held: u64,
    /// Of those, continued once the program was probed.
    pub served: u64,
    /// Of those, continued before: at the bound, at release, or because the program could not be
    /// resolved. Their programs are probed after their first instructions, if at all.
    pub missed: u64,
    /// Execs the kernel refused to stop (bpf_send_signal failed): they ran unheld.
    pub refused_by_kernel: u64,
}

/// The exec hold's books, shared by the exec watcher (which hears of stops) and the main loop
/// (which probes the programs and releases the hold). Cloning shares them.
#[derive(Clone)]
pub struct HeldExecs {
    shared: Arc<Shared>,
}

struct Shared {
    switch: ArrayCell,
    bound: Duration,
    books: Mutex<Books>,
}

#[derive(Default)]
struct Books {
    holding: bool,
    /// Each stopped process, and when to continue it at the latest.
    stopped: HashMap<u32, Instant>,
    stats: HoldStats,
}

impl HeldExecs {
    /// Starts holding: turns the exec tracepoint's stops on.
    pub fn start(switch: ArrayCell, bound: Duration) -> std::io::Result<Self> {
        let shared = Shared { switch, bound, books: Mutex::new(Books::default()) };
        let this = Self { shared: Arc::new(shared) };
        this.resume()?;
        Ok(this)
    }

    fn books(&self) -> MutexGuard<'_, Books> {
        // A panic elsewhere leaves the books usable: every field is valid on its own.
        self.shared.books.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Holds execs again (after `release`).
    pub fn resume(&self) -> std::io::Result<()> {
        self.books().holding = true;
        self.shared.switch.set(1)
    }

    /// Stops holding and continues every stopped process (counted as missed): before memtrace
    /// stops or ends. Idempotent.
    pub fn release(&self) {
        // Off first: no stop begins after the books are emptied.
        let _ = self.shared.switch.set(0);
        let mut books = self.books();
        books.holding = false;
        let stopped: Vec<u32> = books.stopped.drain().map(|(pid, _)| pid).collect();
        books.stats.missed += stopped.len() as u64;
        stopped.into_iter().for_each(continue_process);
    }

    /// The exec watcher read that `pid` was stopped at exec. Continued at once when the hold was
    /// released meanwhile.
    pub fn stopped(&self, pid: u32) {
        let mut books = self.books();
        books.stats.held += 1;
        if books.holding {
            let deadline = Instant::now() + self.shared.bound;
            books.stopped.insert(pid, deadline);
        } else {
            books.stats.missed += 1;
            continue_process(pid);
        }
    }

    /// The kernel refused to stop an exec.
    pub fn refused(&self) {
        self.books().stats.refused_by_kernel += 1;
    }

    /// `pid`'s program is probed: it goes on.
    pub fn probed(&self, pid: u32) {
        self.continue_once(pid, true);
    }

    /// `pid`'s program cannot be probed (it could not be resolved): it goes on unprobed.
    pub fn let_go(&self, pid: u32) {
        self.continue_once(pid, false);
    }

    fn continue_once(&self, pid: u32, served: bool) {
        let mut books = self.books();
        if books.stopped.remove(&pid).is_none() {
            return; // continued already, at the bound or at release
        }
        match served {
            true => books.stats.served += 1,
            false => books.stats.missed += 1,
        }
        continue_process(pid);
    }

    /// Continues every process stopped past its bound (counted as missed); returns when the next
    /// one's bound passes.
    pub fn expire(&self, now: Instant) -> Option<Instant> {
        let mut books = self.books();
        let overdue: Vec<u32> =
            books.stopped.iter().filter(|(_, deadline)| **deadline <= now).map(|(pid, _)| *pid).collect();
        for pid in overdue {
            books.stopped.remove(&pid);
            books.stats.missed += 1;
            continue_process(pid);
        }
        books.stopped.values().min().copied()
    }

    /// What the hold did so far.
    pub fn stats(&self) -> HoldStats {
        self.books().stats
    }
}

/// SIGCONT: a process that was stopped goes on (one killed meanwhile is gone: ESRCH).
fn continue_process(pid: u32) {
    let _ = kill(Pid::from_raw(pid as i32), Signal::SIGCONT);
}
