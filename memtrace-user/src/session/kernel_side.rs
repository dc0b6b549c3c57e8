//! The kernel side of a run: the probes and their tables, the collector that reads them into the
//! model, the unwind tables of the traced files, and the OOM killer's announcements. Loaded in one
//! piece as the plan configures it; the rest of the run asks it for figures, stacks and how full
//! its tables are, and it says on stderr when events are lost.

use std::{collections::HashSet, os::fd::BorrowedFd, time::Duration, time::Instant};

use anyhow::Result;

use crate::{
    attach::usdt::UsdtProbes,
    collect::unwind::KernelTables,
    collect::{oom::OomWatch, Collector},
    follow::{Following, Ready},
    kernel::features::Feature,
    kernel::{ProbeConfig, Probes, Reach},
    model::Model,
    plan::{Kernel, ProbePlan, Tables},
    process::ObjectFile,
};

pub struct KernelSide {
    probes: Probes,
    collector: Collector,
    unwind: KernelTables,
    /// The OOM killer's victims, as the kernel announces them.
    oom: OomWatch,
    /// What the loss warning names.
    tables: Tables,
    /// Call stacks are recorded (not with --no-stacks).
    stacks: bool,
    /// `--older`: only live blocks at least this old at the end count as leaked.
    older: Duration,
    /// Lost events already said on stderr.
    lost_reported: u64,
}

impl KernelSide {
    /// Loads the probes as the plan configures them, with the kernel's layout and link kind, and
    /// starts listening for OOM kills; `older` is `--older`.
    pub fn load(plan: &ProbePlan, reach: &Reach, kernel: &Kernel, older: Duration) -> Result<Self> {
        let config = ProbeConfig {
            max_allocations: plan.tables.max_allocations,
            max_stacks: plan.tables.max_stacks,
            capture_stacks: plan.stacks,
            empty_probes: plan.empty_probes,
            sample_mean: plan.sample.unwrap_or(0),
            windowed: plan.window.is_some(),
            reach: reach.clone(),
            debug_bpf: plan.debug_bpf,
        };
        let mut probes = Probes::load(&config, &kernel.layout()?, kernel.link_kind)?;
        let collector = Collector::new(kernel.features.has(Feature::ExactRssCounters));
        let oom = OomWatch::start(&mut probes);
        let unwind = KernelTables::new(plan.stacks, plan.unwind_in_background, plan.interpreter_frames);
        Ok(Self {
            probes,
            collector,
            unwind,
            oom,
            tables: plan.tables,
            stacks: plan.stacks,
            older,
            lost_reported: 0,
        })
    }

    pub fn probes(&self) -> &Probes {
        &self.probes
    }

    /// The probes, for whoever attaches or detaches some (following processes, windows).
    pub fn probes_mut(&mut self) -> &mut Probes {
        &mut self.probes
    }

    /// Knows `object`'s symbols from now on.
    pub fn index_object(&mut self, object: &ObjectFile) {
        self.collector.index_object(object);
    }

    /// Reads every traced process's figures into `model`, as of `ts_us`.
    pub fn read_figures(&mut self, usdt: &UsdtProbes, model: &mut Model, ts_us: u64) -> Result<()> {
        self.collector.sample(&self.probes, usdt, model, ts_us)
    }

    /// Loads the unwind tables of `preload` (a command's files) and of `model`'s processes.
    pub fn load_unwind_tables(&mut self, preload: &[ObjectFile], model: &Model) -> Result<()> {
        self.unwind.preload(&mut self.probes, preload)?;
        self.unwind.update(&mut self.probes, model)
    }

    /// Loads the unwind tables of `model`'s processes that have none yet.
    pub fn update_unwind_tables(&mut self, model: &Model) -> Result<()> {
        self.unwind.update(&mut self.probes, model)
    }

    /// Reads the mappings of `model`'s processes and loads the tables they need; true while a
    /// process is starting up (its mappings still change).
    pub fn refresh_mappings(&mut self, model: &mut Model) -> Result<bool> {
        let young = self.collector.read_mappings(model);
        self.unwind.update(&mut self.probes, model)?;
        Ok(young)
    }

    /// Probes what the execs `following` heard of bring along, with the unwind tables a held
    /// process needs before it goes on; true where a new program was exec'd.
    pub fn handle_execs(&mut self, following: &mut Following) -> Result<bool> {
        let (unwind, collector) = (&mut self.unwind, &mut self.collector);
        let prepare = |probes: &mut Probes, ready: Ready<'_>| match ready {
            Ready::Files(objects) => unwind.preload(probes, objects),
            Ready::Mappings(pid) => {
                for object in unwind.load_process_now(probes, pid)? {
                    collector.index_object(&object);
                }
                Ok(())
            }
        };
        let execed = following.handle_execs(&mut self.probes, prepare)?;
        for object in &execed {
            self.collector.index_object(object);
        }
        Ok(!execed.is_empty())
    }

    /// Readable when the OOM killer has ended a process.
    pub fn oom_fd(&self) -> Option<BorrowedFd<'_>> {
        self.oom.fd()
    }

    /// The processes the OOM killer ended since the last call, their kills put in `model`.
    pub fn take_oom_victims(&mut self, model: &mut Model, started: Instant) -> Vec<u32> {
        self.oom.take(model, started)
    }

    /// Puts the probes the kernel single-steps in `model`, where their number changed.
    pub fn note_single_stepped(&self, model: &mut Model) {
        if model.single_stepped.len() != self.probes.single_stepped().len() {
            model.single_stepped = self.probes.single_stepped().to_vec();
        }
    }

    /// Says on stderr, once per interval while they grow, that events are being lost.
    pub fn report_new_losses(&mut self, model: &Model) {
        let lost = model.lost_events();
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

    /// Reads the call stacks of `pids` from the kernel into `model`, in place of any read before.
    pub fn read_stacks(&mut self, model: &mut Model, pids: &HashSet<u32>) -> Result<()> {
        if !self.stacks {
            return Ok(());
        }
        for pid in pids {
            if let Some(process) = model.processes.get_mut(pid) {
                process.stacks.clear();
            }
        }
        self.collector.collect_stacks(&self.probes, model, self.older, |pid| pids.contains(&pid))
    }

    /// How full the kernel's tables are now, where the model keeps that (system-wide, and serving).
    pub fn record_occupancy(&mut self, model: &mut Model) -> Result<()> {
        if let Some(maps) = &mut model.kernel_maps {
            let occupancy = self.probes.occupancy()?;
            maps.processes = occupancy.processes;
            maps.live_allocations = occupancy.live_allocations;
            maps.stack_totals = occupancy.stack_totals;
            maps.usdt_entries = occupancy.usdt_entries;
            (maps.unwind_files, maps.unwind_rows) = self.unwind.occupancy();
        }
        Ok(())
    }

    /// Frees the kernel state of the `exited` processes, which have had their final sample.
    pub fn release(&mut self, exited: &HashSet<u32>) -> Result<()> {
        self.probes.release(exited)?;
        self.collector.forget(&self.probes, exited)
    }

    /// The probes stop firing, and the next sample is the last.
    pub fn detach(&mut self) {
        self.probes.detach();
        self.collector.last_sample_next();
    }
}
