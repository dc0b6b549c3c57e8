//! `--window`: each traced process's user CPU time inside windows and in all, read from
//! /proc/PID/stat as each window opens and closes and at every sample. The probes' traps are
//! system time, so user time measures the work a program did whether probed or not: its share
//! inside windows is what a window's recorded allocations are scaled by (model/estimate.rs).

use std::collections::HashMap;

use crate::{
    model::estimate::UserCpu,
    process::procfs::{self, UserTime},
};

/// The accounts of every process seen, by pid.
pub struct WindowCpu {
    accounts: HashMap<u32, Account>,
    ticks_per_second: f64,
}

/// One process's user time in clock ticks, since memtrace first read it.
struct Account {
    /// Which process holds the pid (a pid used again is another process).
    start_ticks: u64,
    /// Its user time at the first reading, and at the latest (after it ends, its last).
    first: u64,
    latest: u64,
    /// The windows closed so far, together.
    inside: u64,
    /// Its user time as the open window opened (or as it was first read in it).
    opened_at: Option<u64>,
}

impl WindowCpu {
    pub fn new() -> Self {
        Self { accounts: HashMap::new(), ticks_per_second: procfs::clock_ticks_per_second() as f64 }
    }

    /// A window has just opened, its probes attached.
    pub fn opened(&mut self, pids: impl IntoIterator<Item = u32>) {
        for pid in pids {
            if let Some(account) = self.read(pid, true) {
                account.opened_at = Some(account.latest);
            }
        }
    }

    /// The window is about to close, its probes about to count no more.
    pub fn closing(&mut self, pids: impl IntoIterator<Item = u32>) {
        for pid in pids {
            self.read(pid, true);
        }
        for account in self.accounts.values_mut() {
            if let Some(opened_at) = account.opened_at.take() {
                account.inside += account.latest.saturating_sub(opened_at);
            }
        }
    }

    /// `pid` as of now (`open`: a window is open), for the model: its user time inside windows
    /// and in all (as last read, once it has ended); None for a pid never read.
    pub fn measured(&mut self, pid: u32, open: bool) -> Option<UserCpu> {
        self.read(pid, open);
        let ticks_per_second = self.ticks_per_second;
        let account = self.accounts.get(&pid)?;
        let open_part = account.opened_at.map_or(0, |opened_at| account.latest.saturating_sub(opened_at));
        Some(UserCpu {
            inside_s: (account.inside + open_part) as f64 / ticks_per_second,
            total_s: account.latest.saturating_sub(account.first) as f64 / ticks_per_second,
        })
    }

    /// Reads `pid`'s user time into its account, opening one for a process not seen before (in
    /// the open window from now, when `open`); None where /proc has it no more.
    fn read(&mut self, pid: u32, open: bool) -> Option<&mut Account> {
        let UserTime { utime_ticks, start_ticks } = procfs::user_time(pid)?;
        let account =
            self.accounts.entry(pid).or_insert_with(|| Account::first(start_ticks, utime_ticks, open));
        if account.start_ticks != start_ticks {
            *account = Account::first(start_ticks, utime_ticks, open);
        }
        account.latest = utime_ticks;
        Some(account)
    }

    /// Forgets the processes memtrace no longer traces.
    pub fn retain(&mut self, traced: impl Fn(u32) -> bool) {
        self.accounts.retain(|&pid, _| traced(pid));
    }
}

impl Account {
    fn first(start_ticks: u64, utime_ticks: u64, open: bool) -> Self {
        Self {
            start_ticks,
            first: utime_ticks,
            latest: utime_ticks,
            inside: 0,
            opened_at: open.then_some(utime_ticks),
        }
    }
}
