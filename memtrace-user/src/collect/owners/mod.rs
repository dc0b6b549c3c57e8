//! The owners of every process's resident anonymous pages (classify.rs) and its allocator's free
//! pool (free_pool.rs), read so that their cost stays bounded:
//!
//! - /proc/PID/smaps is read again only when the process's RssAnon, VmSwap or VmSize moved since
//!   the last read (a quiet process costs one read of /proc/PID/status a sample, as before); on
//!   kernels before 6.2, whose threads cache their RSS counts, RssAnon can stay put while pages
//!   change, and smaps is read every sample;
//! - the free pool takes every live block of the kernel's table and the pagemap of the
//!   allocator's mappings: it is measured again only after memtrace has spent 199 times as long
//!   elsewhere as the last measurement took (at most 0.5% of a core on average), and always at
//!   the end of a run. Between measurements a process keeps the last figure.

pub mod classify;
pub mod free_pool;

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use self::{
    classify::{classify, Classified, SeenMapping},
    free_pool::LiveBlock,
};
use crate::{
    model::levels::{FreePool, OsMemory, ResidentOwners},
    process::{pagemap::Pagemap, remote::RemoteMemory, smaps},
};

/// The free pool may take this share of memtrace's time: 1 / BUDGET_DIVISOR of a core.
const BUDGET_DIVISOR: u32 = 200;

#[derive(Default)]
pub struct OwnersReader {
    /// Whether /proc/PID/status's RssAnon moves with every page (kernel 6.2 and later).
    rss_is_exact: bool,
    processes: HashMap<u32, Known>,
    /// When the free pool may be measured again.
    free_pool_due: Option<Instant>,
}

/// What was last read of one process.
#[derive(Default)]
struct Known {
    /// RssAnon, VmSwap and VmSize when smaps was last read.
    read_at: (u64, u64, u64),
    classified: Classified,
    /// The resident free bytes and the pool, when last measured.
    free: Option<(u64, FreePool)>,
}

impl OwnersReader {
    /// `rss_is_exact`: the kernel counts a process's pages as they change (not a per-thread cache
    /// added in every 64 page faults), so smaps need not be read while RssAnon stays put.
    pub fn new(rss_is_exact: bool) -> Self {
        Self { rss_is_exact, ..Self::default() }
    }

    /// The owners of `pid`'s pages, read again if its memory moved since the last read (`os` is
    /// what /proc/PID/status says now; `seen` the mappings the probes saw it make). None when the
    /// process has gone. The free figure is the last measured, if `whole` (every live block of
    /// the process is in the kernel's table).
    pub fn read(
        &mut self,
        pid: u32,
        os: OsMemory,
        whole: bool,
        seen: impl FnOnce() -> Vec<SeenMapping>,
    ) -> Option<ResidentOwners> {
        let key = (os.rss_anon_bytes, os.swap_bytes, os.address_space_bytes);
        let moved = |known: &Known| !self.rss_is_exact || known.read_at != key;
        if self.processes.get(&pid).is_none_or(moved) {
            let vmas = smaps::read(pid)?;
            let pagemap = Pagemap::open(pid, crate::process::procfs::page_size());
            let classified = classify(&vmas, &seen(), &RemoteMemory::of(pid), pagemap.as_ref());
            // A process that began to exit during the reads had its pages zapped under them
            // (smaps then shows its mappings with none resident): once its memory is released,
            // /proc/PID/status has no memory lines, and the reading is not kept.
            if crate::process::procfs::os_memory(pid).is_none() {
                return self.last(pid, whole);
            }
            let known = self.processes.entry(pid).or_default();
            known.read_at = key;
            known.classified = classified;
            // Its arenas are the process's as last read, not as when its pool was last measured
            // (the budget can leave that at the first sample, before its threads made theirs).
            if let Some((_, pool)) = &mut known.free {
                pool.arenas = known.classified.arenas;
            }
        }
        self.last(pid, whole)
    }

    /// What was last read of `pid` (an exited process keeps it).
    pub fn last(&self, pid: u32, whole: bool) -> Option<ResidentOwners> {
        let known = self.processes.get(&pid)?;
        let free = known.free.as_ref().filter(|_| whole).map(|(bytes, _)| *bytes);
        Some(ResidentOwners { allocator_free: free, ..known.classified.owners })
    }

    /// The free pool of `pid` as last measured.
    pub fn free_pool(&self, pid: u32) -> Option<&FreePool> {
        Some(&self.processes.get(&pid)?.free.as_ref()?.1)
    }

    /// Whether the free pool is due (the budget allows it, or `now_anyway`).
    pub fn free_pool_due(&self, now_anyway: bool) -> bool {
        now_anyway || self.free_pool_due.is_none_or(|due| Instant::now() >= due)
    }

    /// Measures the free pools of `processes` (pid, its live blocks sorted by address, the
    /// header each block takes before it), then waits out the budget: the CPU time spent since
    /// `started` (which took the blocks from the kernel's table), 199 times over.
    pub fn measure_free_pools(
        &mut self,
        processes: Vec<(u32, Vec<LiveBlock>, u64)>,
        started: CpuTime,
        ts_us: u64,
    ) {
        let page_size = crate::process::procfs::page_size();
        for (pid, blocks, header) in processes {
            let Some(known) = self.processes.get_mut(&pid) else { continue };
            let Some(pagemap) = Pagemap::open(pid, page_size) else { continue };
            let (resident, classes) =
                free_pool::measure(&known.classified.allocator_ranges, &blocks, header, &pagemap);
            // As for smaps (`read`): a pool measured while the process's memory went is not kept.
            if crate::process::procfs::os_memory(pid).is_none() {
                continue;
            }
            let pool = FreePool { arenas: known.classified.arenas, measured_at_us: ts_us, classes };
            known.free = Some((resident, pool));
        }
        let spent = started.elapsed().max(Duration::from_micros(100));
        self.free_pool_due = Some(Instant::now() + spent * (BUDGET_DIVISOR - 1));
    }

    pub fn forget(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }
}

/// The CPU time this thread has used: what the budget counts (wall time would count the time the
/// traced programs took the CPUs from memtrace).
#[derive(Debug, Clone, Copy)]
pub struct CpuTime(Duration);

impl CpuTime {
    pub fn now() -> Self {
        let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes only the timespec it is given.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
        Self(Duration::new(now.tv_sec as u64, now.tv_nsec as u32))
    }

    pub fn elapsed(&self) -> Duration {
        Self::now().0.saturating_sub(self.0)
    }
}
