//! One tracing run, as its plan says: set up targets and probes, sample at every interval until
//! the targets exit, the duration ends or a signal arrives (`poll`, `sample`), then hand the
//! results to every exporter and wait for a launched command that outlives the trace (`command`).

mod command;
mod oom;
mod outputs;
mod poll;
mod sample;
mod signals;
mod targets;
mod window_cpu;
mod windows;

use std::{process::ExitCode, time::Instant};

use anyhow::Result;

use self::{
    command::RunningCommand,
    poll::{Ending, Run, FIRST_REFRESH},
    targets::{processes_to_attach, Targets},
    windows::WindowClock,
};
use crate::{
    attach::usdt::{OwnSites, UsdtProbes},
    collect::unwind::KernelTables,
    collect::{oom::OomWatch, Collector},
    follow::Following,
    kernel::features::{Feature, Needs},
    kernel::{ProbeConfig, Probes, Reach},
    model::{
        estimate::{Sampling, Windows},
        AppSampled, KernelMaps, Model,
    },
    plan::{self, Kernel, Mode, Plan, ProbePlan},
    privileges,
};

/// Traces as the plan says; with `Mode::Serve`, as the agent of `memtrace serve`: no trace file
/// unless -o names one, no report at the end, and tracing goes on until a signal ends it.
pub fn run(plan: Plan) -> Result<ExitCode> {
    let Plan { mode, targets: wanted, probes: probe_plan, timing, outputs, retention, kernel, runtimes } =
        plan;
    let reach = wanted.reach();
    let pids = refuse_what_cannot_work(&wanted, &reach, &kernel)?;
    let signals = signals::block_termination_signals()?;
    // Outputs are opened first: an unwritable path is reported before anything is traced.
    let exporters = outputs::open(&outputs, &mode, probe_plan.stacks)?;
    let mut probes = load_probes(&probe_plan, &reach, &kernel)?;
    let mut collector = Collector::new(kernel.features.has(Feature::ExactRssCounters));
    let mut model = empty_model(&mode, &probe_plan);
    let own_sites = OwnSites { app_sampled: probe_plan.app_sampled };
    let nop5_optimized = kernel.features.has(Feature::OptimizedUprobes);
    let usdt = UsdtProbes::new(own_sites, probe_plan.usdt.clone(), nop5_optimized);
    let oom = OomWatch::start(&mut probes);
    let mut following =
        Following::start(&mut probes, probe_plan.allocator, reach, &kernel.features, usdt, &runtimes)?;
    let Targets { watched: targets, held, preload } =
        Targets::attach(&wanted, &pids, &mut following, &mut probes, &mut collector, &mut model)?;
    let what = describe_reach(&wanted, &following, &probes, &model);
    // Unwind tables of the targets known now (--pid, a command's files); others follow at each
    // interval, and a command's mappings within milliseconds of its start (see `poll`).
    let mut unwind =
        KernelTables::new(probe_plan.stacks, probe_plan.unwind_in_background, probe_plan.interpreter_frames);
    unwind.preload(&mut probes, &preload)?;
    unwind.update(&mut probes, &model)?;
    let early_refresh = held.is_some().then_some(FIRST_REFRESH);
    following.usdt().check_requests_found(wanted.follows_children())?;
    let writing = outputs.trace.map(|path| format!("; writing {}", path.display())).unwrap_or_default();
    eprintln!("memtrace: tracing {what}{writing}");
    if let Some(held) = held {
        held.release()?;
    }
    let started = Instant::now();
    let mut run = Run {
        windows: probe_plan.window.map(|window| WindowClock::new(window, started, &model)),
        probes,
        collector,
        model,
        unwind,
        exporters,
        targets,
        following,
        oom,
        signals,
        started,
        samples: 0,
        lost_reported: 0,
        forwarded_signal: false,
        failed_outputs: 0,
        early_refresh,
        refreshes: early_refresh.is_some(),
        refresh_after_exec: false,
        timing,
        retention,
        tables: probe_plan.tables,
        stacks: probe_plan.stacks,
        older: outputs.older,
    };
    let ending = run.trace()?;
    conclude(run, &ending)
}

/// What cannot work is said before anything is loaded: a missing privilege, a kernel feature the
/// run needs, a --pid that names no process memtrace may trace. Returns the --pid processes.
fn refuse_what_cannot_work(wanted: &plan::Targets, reach: &Reach, kernel: &Kernel) -> Result<Vec<u32>> {
    privileges::check(wanted, kernel.link_kind)?;
    kernel.features.check(Needs { follows_tree: matches!(reach, Reach::Tree) })?;
    processes_to_attach(wanted.pids())
}

/// The model before the first sample, saying how allocations are recorded where not every one is.
fn empty_model(mode: &Mode, plan: &ProbePlan) -> Model {
    Model {
        sampling: plan.sample.map(Sampling::new),
        app_sampled: plan.app_sampled.then(AppSampled::default),
        windows: plan.window.map(Windows::of),
        // The agent shows how full the kernel's tables are while it runs.
        kernel_maps: matches!(mode, Mode::Serve(_)).then(KernelMaps::default),
        ..Model::default()
    }
}

/// Loads the kernel side as the plan configures it, with the kernel's layout and link kind.
fn load_probes(plan: &ProbePlan, reach: &Reach, kernel: &Kernel) -> Result<Probes> {
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
    Probes::load(&config, &kernel.layout()?, kernel.link_kind)
}

/// What "memtrace: tracing ..." names.
fn describe_reach(wanted: &plan::Targets, following: &Following, probes: &Probes, model: &Model) -> String {
    let reach = describe_targets(wanted, following, probes, model);
    match (model.app_sampled, probes.sampled_sites()) {
        (None, _) => reach,
        (Some(_), 0) if !wanted.system_wide() => {
            eprintln!(
                "memtrace: warning: --app-sampled: no otel_memory:alloc probe in the traced program \
                 or its libraries yet: its heap is not traced (leave --app-sampled out to trace it \
                 through malloc and free)"
            );
            reach
        }
        (Some(_), sites) => format!("{reach}; allocations from {sites} otel_memory probe sites"),
    }
}

fn describe_targets(wanted: &plan::Targets, following: &Following, probes: &Probes, model: &Model) -> String {
    if wanted.system_wide() {
        format!(
            "all processes through {} allocator files and {} USDT probe sites",
            following.probed_files(),
            probes.usdt_sites()
        )
    } else if wanted.follows_children() {
        format!("{} and every process they start", describe(model))
    } else {
        describe(model)
    }
}

fn describe(model: &Model) -> String {
    let processes: Vec<String> = model
        .processes
        .values()
        .map(|p| {
            format!(
                "pid {} ({}) via {} ({})",
                p.identity.pid,
                p.identity.comm,
                p.allocator_kind,
                p.allocator.display()
            )
        })
        .collect();
    processes.join(", ")
}

/// Writes the outputs, detaches, waits for a command that outlives the trace, and works out the
/// exit code.
fn conclude(mut run: Run, ending: &Ending) -> Result<ExitCode> {
    let command = run.running_child().map(|pid| RunningCommand::of(pid, &run.model));
    let duration = run.started.elapsed();
    run.finish(duration)?;
    let Run { probes, targets, signals, forwarded_signal, failed_outputs, .. } = run;
    // Detach before waiting on a command that outlives the trace.
    drop(probes);
    let status = match (command, targets.iter().find(|t| t.is_child)) {
        (Some(command), Some(child)) => {
            command.announce_wait(ending, forwarded_signal);
            Some(command.wait(child, &signals, forwarded_signal)?)
        }
        (None, Some(child)) => Some(child.reap()?),
        (_, None) => None,
    };
    if failed_outputs > 0 {
        // Every failure was said when it happened, naming its file.
        return Ok(ExitCode::from(1));
    }
    Ok(status.map_or(ExitCode::SUCCESS, |status| ExitCode::from(u8::try_from(status).unwrap_or(1))))
}
