//! The OOM killer's victims as the kernel announces them (memtrace-ebpf/src/oom.rs). Each traced
//! victim gets its `OomKill` in the model at once, with its memory cgroup and limit read while it
//! dies (a killed process stays readable in /proc until its parent reaps it); the collector then
//! reads its live heap and stacks at the kill (`Collector::read_oom_kills`), at the sample the
//! announcement brings forward.

use std::{
    os::fd::{AsFd, BorrowedFd},
    time::Instant,
};

use aya::maps::{MapData, RingBuf};
use memtrace_common::{mm_counter, OomEvent};

use crate::{
    kernel::Probes,
    model::{oom::OomKill, Model},
    process::{memcg, procfs},
};

/// The kernel's announcements of OOM victims, where the kernel has the tracepoint.
pub struct OomWatch {
    ring: Option<RingBuf<MapData>>,
}

impl OomWatch {
    /// Attaches to oom:mark_victim; where that fails, says so once and records no kills.
    pub fn start(probes: &mut Probes) -> Self {
        match probes.watch_oom_kills() {
            Ok(ring) => Self { ring: Some(ring) },
            Err(err) => {
                eprintln!("memtrace: warning: OOM kills will not be recorded: {err:#}");
                Self { ring: None }
            }
        }
    }

    /// Readable when a victim has been announced.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.ring.as_ref().map(|ring| ring.as_fd())
    }

    /// Takes every victim announced; each traced one gets its `OomKill` (its heap yet to be read).
    /// Returns their pids. `run_started` is when tracing began, as sample times count.
    pub fn take(&mut self, model: &mut Model, run_started: Instant) -> Vec<u32> {
        let Some(ring) = &mut self.ring else { return Vec::new() };
        let mut events = Vec::new();
        while let Some(item) = ring.next() {
            if item.len() >= size_of::<OomEvent>() {
                // SAFETY: the record is an OomEvent written by the BPF program; read unaligned.
                events.push(unsafe { item.as_ptr().cast::<OomEvent>().read_unaligned() });
            }
        }
        let mut victims = Vec::new();
        for event in events {
            let tgid = match event.tgid {
                0 => procfs::tgid(event.pid).unwrap_or(event.pid),
                tgid => tgid,
            };
            let Some(process) = model.processes.get_mut(&tgid) else { continue };
            if process.released || process.oom_kill.is_some() {
                continue;
            }
            // The kernel's reading at the kill, else /proc now (on v1 that says `/` once the
            // victim is exiting).
            let by_id = (event.memcg_id != 0).then(|| memcg::memory_cgroup_by_id(event.memcg_id));
            let cgroup = by_id.flatten().or_else(|| memcg::memory_cgroup(tgid));
            process.oom_kill = Some(OomKill::heard(
                ts_us(event.at_ns, run_started),
                cgroup.as_ref().map(|cgroup| cgroup.path.clone()),
                cgroup.and_then(|cgroup| cgroup.limit_bytes),
                rss_at_kill(&event, tgid),
            ));
            victims.push(tgid);
        }
        victims
    }
}

/// The victim's resident bytes at the kill: the kernel's counters read at the tracepoint, else
/// /proc now (the victim's pages may be leaving).
fn rss_at_kill(event: &OomEvent, tgid: u32) -> Option<u64> {
    if event.memory.read == 0 {
        return procfs::rss_bytes(tgid);
    }
    let pages = &event.memory.pages;
    let resident =
        pages[mm_counter::FILE_PAGES] + pages[mm_counter::ANON_PAGES] + pages[mm_counter::SHMEM_PAGES];
    Some(resident * procfs::page_size())
}

/// The kill's time in microseconds since tracing began, from its CLOCK_MONOTONIC time.
fn ts_us(at_ns: u64, run_started: Instant) -> u64 {
    let ago_us = super::monotonic_now_ns().saturating_sub(at_ns) / 1000;
    (run_started.elapsed().as_micros() as u64).saturating_sub(ago_us)
}
