//! What a run does at each sample and at its end: the kernel's figures read into the model, the
//! call stacks read for whoever wants them, the model handed to every exporter (one that fails is
//! dropped and said, and the run ends), loss warnings, and exited processes released from the
//! kernel's tables and folded, so that a long run stays bounded.

use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

use anyhow::Result;

use super::poll::Run;
use crate::{
    export::exporter::StacksWanted,
    model::{KernelMaps, RunEnd, Sample},
};

impl Run {
    pub fn sample(&mut self) -> Result<()> {
        if self.retention.forget_released {
            // Their final figures went to the exporters at the sample that released them.
            self.model.processes.retain(|_, process| !process.released);
            self.model.retired.clear();
        }
        self.following.allow_cgroups(&mut self.probes)?;
        self.following.adopt_new_processes(&self.probes, &mut self.model)?;
        self.following.forget_gone_processes(&mut self.probes);
        self.following.probe_late_forks(&mut self.probes)?;
        // Before the figures are read: a victim's heap at the kill is read with them.
        let victims = self.oom.take(&mut self.model, self.started);
        let ts_us = self.started.elapsed().as_micros() as u64;
        if let Some(clock) = &mut self.windows {
            clock.measure(&mut self.model, self.started, Instant::now());
        }
        self.collector.sample(&self.probes, self.following.usdt(), &mut self.model, ts_us)?;
        for pid in victims {
            if let Some(process) = self.model.processes.get(&pid) {
                super::oom::announce(process);
            }
        }
        self.unwind.update(&mut self.probes, &self.model)?;
        if self.model.single_stepped.len() != self.probes.single_stepped().len() {
            self.model.single_stepped = self.probes.single_stepped().to_vec();
        }
        self.model.library_loads_held = self.following.library_loads_held();
        self.samples += 1;
        let sample = Sample { ts_us, dump_id: self.samples };
        self.model.record_timeline(sample.ts_us);
        self.report_new_losses();
        // Every exporter is asked (no short cut): each learns that its request is being served.
        let stacks = self
            .exporters
            .iter_mut()
            .fold(StacksWanted::None, |wanted, exporter| wanted.and(exporter.wants_stacks()));
        let occupancy = self
            .exporters
            .iter_mut()
            .fold(stacks != StacksWanted::None, |wanted, exporter| exporter.wants_occupancy() | wanted);
        if stacks != StacksWanted::None {
            let wanted =
                self.model.processes.values().filter(|p| !p.released && stacks.includes(p.identity.pid));
            let wanted = wanted.map(|p| p.identity.pid).collect();
            self.read_stacks(&wanted)?;
        }
        if occupancy {
            self.record_occupancy()?;
        }
        let mut index = 0;
        while index < self.exporters.len() {
            match self.exporters[index].sample(&self.model, sample) {
                Ok(()) => index += 1,
                Err(err) => {
                    eprintln!("memtrace: error: {err:#}");
                    // Its file stays as it was: a trace cut short still loads.
                    self.exporters.remove(index);
                    self.failed_outputs += 1;
                }
            }
        }
        self.release_exited()?;
        Ok(())
    }

    /// Says on stderr, once per interval while they grow, that events are being lost.
    fn report_new_losses(&mut self) {
        let lost = self.model.lost_events();
        if lost > self.lost_reported {
            // Which ones the kernel skipped, said by program: no table size helps with those.
            let read = self.probes.skipped_runs().ok();
            let skipped: Vec<(&str, u64)> = read.iter().flat_map(|runs| runs.lossy()).collect();
            for (program, runs) in &skipped {
                eprintln!(
                    "memtrace: warning: the kernel skipped {runs} runs of BPF program {program} in all \
                     (it was running on that CPU already); each is an event lost"
                );
            }
            let cause = match skipped.is_empty() {
                true => "a kernel table is full",
                false => "beyond the runs skipped, a kernel table may be full",
            };
            eprintln!(
                "memtrace: warning: {} events lost in the last interval ({lost} in all); {cause}: live \
                 allocations (--max-allocations {}) or stacks made within one interval (--max-stacks {}; \
                 or sample more often with -i)",
                lost - self.lost_reported,
                self.tables.max_allocations,
                self.tables.max_stacks
            );
            self.lost_reported = lost;
        }
    }

    /// Processes that exited have had their final sample; keep what the report needs and free
    /// their kernel state, so the tables stay bounded over a long run.
    fn release_exited(&mut self) -> Result<()> {
        let maps = self.model.kernel_maps.get_or_insert_with(KernelMaps::default);
        let tracked = self.model.processes.values().filter(|p| !p.released).count();
        maps.peak_processes = maps.peak_processes.max(tracked);
        let exited: HashSet<u32> = self
            .model
            .processes
            .values()
            .filter(|p| p.exited && !p.released)
            .map(|p| p.identity.pid)
            .collect();
        if exited.is_empty() {
            return Ok(());
        }
        // Kept for the reports at the end; the agent has none.
        if !self.retention.forget_released {
            self.read_stacks(&exited)?;
        }
        self.probes.release(&exited)?;
        self.collector.forget(&self.probes, &exited)?;
        let mut exited: Vec<u32> = exited.into_iter().collect();
        // In pid order: those released at one sample fold in an order that does not vary.
        exited.sort_unstable();
        for pid in &exited {
            self.model.note_released(*pid);
            if let Some(process) = self.model.processes.get_mut(pid) {
                process.released = true;
                // Over a long system-wide run, thousands of processes come and go: each keeps
                // what its report shows, so memtrace's memory stays bounded.
                if let Some(top) = self.retention.trim_released {
                    process.keep_only_reported(top);
                }
            }
        }
        if let Some(maps) = &mut self.model.kernel_maps {
            maps.released_processes += exited.len();
        }
        self.model.fold_exited(self.retention.keep_exited);
        Ok(())
    }

    /// Reads the call stacks of `pids` from the kernel, in place of any read before.
    fn read_stacks(&mut self, pids: &HashSet<u32>) -> Result<()> {
        if !self.stacks {
            return Ok(());
        }
        for pid in pids {
            if let Some(process) = self.model.processes.get_mut(pid) {
                process.stacks.clear();
            }
        }
        self.collector.collect_stacks(&self.probes, &mut self.model, self.older, |pid| pids.contains(&pid))
    }

    /// How full the kernel's tables are now, where the model keeps that (system-wide, and serving).
    fn record_occupancy(&mut self) -> Result<()> {
        if let Some(maps) = &mut self.model.kernel_maps {
            let occupancy = self.probes.occupancy()?;
            maps.processes = occupancy.processes;
            maps.live_allocations = occupancy.live_allocations;
            maps.stack_totals = occupancy.stack_totals;
            maps.usdt_entries = occupancy.usdt_entries;
            (maps.unwind_files, maps.unwind_rows) = self.unwind.occupancy();
        }
        Ok(())
    }

    pub fn finish(&mut self, duration: Duration) -> Result<()> {
        // Probes stop firing first: the final figures hold still, and the machine is let go at
        // once, before the reports are worked out.
        self.following.release_held_execs();
        self.probes.detach();
        self.collector.last_sample_next();
        self.sample()?;
        // The agent has nothing left to show them to.
        if !self.retention.forget_released {
            let unreleased =
                self.model.processes.values().filter(|p| !p.released).map(|p| p.identity.pid).collect();
            self.read_stacks(&unreleased)?;
            self.record_occupancy()?;
        }
        // Every output that can still be written is: one failure does not stop the others.
        for exporter in &mut self.exporters {
            match exporter.finish(&self.model, RunEnd { duration }) {
                Ok(()) => {
                    if let Some(written) = exporter.written() {
                        eprintln!("memtrace: {written}");
                    }
                }
                Err(err) => {
                    eprintln!("memtrace: error: {err:#}");
                    self.failed_outputs += 1;
                }
            }
        }
        let missed = self.following.missed_execs();
        if missed > 0 {
            let execs = if missed == 1 { "exec was" } else { "execs were" };
            eprintln!(
                "memtrace: warning: {missed} {execs} let go before their program's allocator was probed \
                 (stopped past 5 s): those programs' first allocations may be missing"
            );
        }
        Ok(())
    }
}
