//! How the kernel side is faring: how full its maps are, events it could not charge to a process,
//! the runs of each program the kernel skipped, and the stack each program uses (verifier).

use std::os::fd::AsFd;

use anyhow::{Context, Result};
use memtrace_common::GLOBAL_LOST_SLOT;

use super::{
    embedded::BPF_OBJECT, loader::MultiPrograms, tables, verifier_report, Probes, EXIT_PROGRAM, EXIT_READER,
    FORK_RETURN, LIBRARY_LOADED,
};
use crate::kernel::{features::LinkKind, sys::prog_info};

/// How many entries the kernel's tables hold, to show they stay bounded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MapOccupancy {
    pub processes: usize,
    pub live_allocations: usize,
    pub stack_totals: usize,
    /// USDT subsystem, `--usdt` counter and dump round entries.
    pub usdt_entries: usize,
}

/// The runs of each program the kernel skipped, as read at one moment.
pub struct SkippedRuns {
    /// Programs with runs skipped, and how many.
    by_program: Vec<(String, u64)>,
}

impl SkippedRuns {
    /// The programs whose skipped runs are events lost, and how many: all but process_exit, whose
    /// skipped runs leave undone what is done from /proc instead (collect/skipped_exits.rs), the
    /// exit reader, fork_return, whose misses are counted as processes probed late, and
    /// library_loaded, whose misses cut stacks short for a moment (counted as such).
    pub fn lossy(&self) -> impl Iterator<Item = (&str, u64)> {
        self.by_program
            .iter()
            .filter(|(name, _)| {
                ![EXIT_PROGRAM, EXIT_READER, FORK_RETURN, LIBRARY_LOADED].contains(&name.as_str())
            })
            .map(|(name, runs)| (name.as_str(), *runs))
    }

    /// Events lost to skipped runs.
    pub fn lost(&self) -> u64 {
        self.lossy().map(|(_, runs)| runs).sum()
    }

    /// Runs of process_exit skipped, for every task of the system that exited while another's exit
    /// ran on its CPU (a preemptible kernel): most are of processes not traced.
    pub fn exits(&self) -> u64 {
        self.by_program.iter().filter(|(name, _)| name == EXIT_PROGRAM).map(|(_, runs)| runs).sum()
    }
}

impl Probes {
    pub fn occupancy(&self) -> Result<MapOccupancy> {
        Ok(MapOccupancy {
            processes: tables::STATS.entries(&self.ebpf)?.len(),
            live_allocations: self.live.len(),
            stack_totals: tables::STACK_TOTALS.entries(&self.ebpf)?.len(),
            usdt_entries: self.usdt_figures().len()?,
        })
    }

    /// Events that could not be charged to any process (the statistics map was full).
    pub fn global_lost_events(&self) -> Result<u64> {
        tables::LOST_EVENTS.get(&self.ebpf, GLOBAL_LOST_SLOT)
    }

    /// The stack every program uses, as this kernel's verifier reports it.
    pub fn verifier_report(&self) -> Result<Vec<verifier_report::ProgramStack>> {
        let attach_type = match self.link_kind() {
            LinkKind::Multi => aya_obj::generated::bpf_attach_type::BPF_TRACE_UPROBE_MULTI as u32,
            LinkKind::PerfEvent => 0,
        };
        verifier_report::report(BPF_OBJECT, &self.ebpf, attach_type)
    }

    /// How many runs of each program the kernel has skipped so far (its recursion guard: the
    /// program was already running on that CPU).
    pub fn skipped_runs(&self) -> Result<SkippedRuns> {
        let mut by_program = Vec::new();
        for (name, program) in self.ebpf.programs() {
            // Programs aya did not load (the uprobes, where uprobe_multi links are used) have no fd.
            let Ok(fd) = program.fd() else { continue };
            let misses = prog_info::recursion_misses(fd.as_fd())
                .with_context(|| format!("reading BPF program {name}'s statistics"))?;
            by_program.push((name.to_owned(), misses));
        }
        for (name, fd) in self.multi.iter().flat_map(MultiPrograms::named) {
            let misses = prog_info::recursion_misses(fd)
                .with_context(|| format!("reading BPF program {name}'s statistics"))?;
            by_program.push((name.to_owned(), misses));
        }
        by_program.retain(|(_, misses)| *misses > 0);
        Ok(SkippedRuns { by_program })
    }
}
