//! One tracing run, as its plan says: its parts made (the kernel side, the processes it follows,
//! the model, the outputs and the clock), it samples at every interval until the targets exit,
//! the duration ends or a signal arrives (`run`), then hands the results to every output and
//! waits for a launched command that outlives the trace (`command`).

mod clock;
mod command;
mod kernel_side;
mod oom;
mod outputs;
mod run;
mod signals;
mod targets;
mod window_cpu;
mod windows;

use std::process::ExitCode;

use anyhow::Result;

use self::{
    clock::Clock,
    kernel_side::KernelSide,
    outputs::Exporters,
    run::Run,
    targets::{processes_to_attach, Traced},
};
use crate::{
    attach::usdt::{OwnSites, UsdtProbes},
    follow::Following,
    kernel::features::{Feature, Needs},
    kernel::Reach,
    model::{
        estimate::{Sampling, Windows},
        AppSampled, KernelMaps, Model,
    },
    plan::{self, Kernel, Mode, Plan, ProbePlan},
    privileges,
};

/// Traces as the plan says; with `Mode::Serve`, as the agent of `memtrace serve`: no trace file
/// unless -o names one, no report at the end, and tracing goes on until a signal ends it. The
/// run's parts are made here, in this order.
pub fn run(plan: Plan) -> Result<ExitCode> {
    let Plan { mode, targets: wanted, probes: probe_plan, timing, outputs, retention, kernel, runtimes } =
        plan;
    let reach = wanted.reach();
    let pids = refuse_what_cannot_work(&wanted, &reach, &kernel)?;
    let signals = signals::block_termination_signals()?;
    // Outputs are opened first: an unwritable path is reported before anything is traced.
    let exporters = Exporters::open(&outputs, &mode, probe_plan.stacks)?;
    let mut kernel_side = KernelSide::load(&probe_plan, &reach, &kernel, outputs.older)?;
    let mut model = empty_model(&mode, &probe_plan);
    let own_sites = OwnSites { app_sampled: probe_plan.app_sampled };
    let nop5_optimized = kernel.features.has(Feature::OptimizedUprobes);
    let usdt = UsdtProbes::new(own_sites, probe_plan.usdt.clone(), nop5_optimized);
    let following = Following::start(
        kernel_side.probes_mut(),
        probe_plan.allocator,
        reach,
        &kernel.features,
        usdt,
        &runtimes,
    )?;
    let (traced, launch) = Traced::attach(&wanted, &pids, following, &mut kernel_side, &mut model)?;
    let what = describe_reach(&wanted, &traced, &kernel_side, &model);
    // Unwind tables of the targets known now (--pid, a command's files); others follow at each
    // interval, and a command's mappings within milliseconds of its start (see `clock`).
    kernel_side.load_unwind_tables(&launch.preload, &model)?;
    traced.usdt().check_requests_found(wanted.follows_children())?;
    let writing = outputs.trace.map(|path| format!("; writing {}", path.display())).unwrap_or_default();
    eprintln!("memtrace: tracing {what}{writing}");
    let refreshes = launch.held.is_some();
    if let Some(held) = launch.held {
        held.release()?;
    }
    let clock = Clock::start(timing, probe_plan.window, &model, refreshes);
    let mut run = Run { kernel: kernel_side, traced, model, outputs: exporters, clock, retention, signals };
    let ending = run.trace()?;
    run.conclude(&ending)
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

/// What "memtrace: tracing ..." names.
fn describe_reach(wanted: &plan::Targets, traced: &Traced, kernel: &KernelSide, model: &Model) -> String {
    let reach = describe_targets(wanted, traced, kernel, model);
    match (model.app_sampled, kernel.probes().sampled_sites()) {
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

fn describe_targets(wanted: &plan::Targets, traced: &Traced, kernel: &KernelSide, model: &Model) -> String {
    if wanted.system_wide() {
        format!(
            "all processes through {} allocator files and {} USDT probe sites",
            traced.probed_files(),
            kernel.probes().usdt_sites()
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
