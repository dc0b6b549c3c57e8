//! One tracing run: set up targets and probes, sample at every interval until the targets exit, the
//! duration ends or a signal arrives, then hand the results to every exporter.

use std::{
    collections::HashSet,
    os::fd::AsFd,
    path::{Path, PathBuf},
    process::ExitCode,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{bail, Context, Result};
use nix::{
    poll::{poll, PollFd, PollFlags, PollTimeout},
    sys::{
        signal::{kill, SigSet, Signal},
        signalfd::{SfdFlags, SignalFd},
    },
    unistd::Pid,
};

use crate::{
    allocator::{Allocator, Overrides},
    cli::Cli,
    collector::Collector,
    export::{
        exporter::{Exporter, StacksWanted},
        progress::Progress,
        report::TextReport,
        summary::SummaryFile,
        trace::TraceFile,
    },
    following::Following,
    kernel_features::{KernelFeatures, LinkKind, Needs},
    model::{KernelMaps, Model, RunEnd, Sample, Sampling},
    privileges,
    probes::{ProbeConfig, Probes, ProcessFilter, Reach},
    process::{ObjectFile, ProcessImage},
    procfs,
    serve::{Agent, ServeOptions},
    target::{resolve_program, HeldCommand, Watched},
    unwind::KernelTables,
    usdt::UsdtProbes,
};

/// Traces as the command line says; with `serve`, as the agent of `memtrace serve`: no trace file
/// unless -o names one, no report at the end, and tracing goes on until a signal ends it.
pub fn run(cli: Cli, serve: Option<&ServeOptions>) -> Result<ExitCode> {
    privileges::check(&cli)?;
    let reach = reach_of(&cli);
    // What the kernel cannot do is said before anything is loaded.
    let features = KernelFeatures::probe();
    features.check(Needs { follows_tree: matches!(reach, Reach::Tree) })?;
    let pids = processes_to_attach(&cli.pids)?;
    let signals = block_termination_signals()?;
    // Outputs are opened first: an unwritable path is reported before anything is traced.
    let (exporters, trace_path) = open_outputs(&cli, serve)?;
    let mut probes = load_probes(&cli, &reach, &features)?;
    let overrides =
        Overrides { lib: cli.lib.clone(), prefix: cli.allocator.as_deref().map(Overrides::prefix_for) };
    let mut collector = Collector::default();
    let mut model = Model {
        sampling: cli.sample.map(Sampling::new),
        // The agent shows how full the kernel's tables are while it runs.
        kernel_maps: serve.map(|_| KernelMaps::default()),
        ..Model::default()
    };
    let usdt = UsdtProbes::new(cli.usdt.clone());
    let mut following = Following::start(&mut probes, overrides, reach, &features, usdt)?;
    let Targets { watched: targets, held, preload } = if cli.system_wide() {
        Targets::default()
    } else if cli.command.is_empty() {
        Targets::pids(&pids, cli.children, &mut following, &mut probes, &mut collector, &mut model)?
    } else {
        Targets::command(&cli.command, &mut following, &mut probes, &mut collector, &mut model)?
    };
    let what = describe_reach(&cli, &following, &probes, &model);
    // Unwind tables of the targets known now (--pid, a command's files); others follow at each
    // interval, and a command's mappings within milliseconds of its start (see `trace`).
    let mut unwind = KernelTables::new(!cli.no_stacks, cli.all);
    unwind.preload(&mut probes, preload)?;
    unwind.update(&mut probes, &model)?;
    let early_refresh = held.is_some().then_some(FIRST_REFRESH);
    following.usdt().check_requests_found(cli.follows_children())?;
    let writing = trace_path.map(|path| format!("; writing {}", path.display())).unwrap_or_default();
    eprintln!("memtrace: tracing {what}{writing}");
    if let Some(held) = held {
        held.release()?;
    }

    let mut run = Run {
        cli: &cli,
        probes,
        collector,
        model,
        unwind,
        exporters,
        targets,
        following,
        signals,
        started: Instant::now(),
        samples: 0,
        lost_reported: 0,
        forwarded_signal: false,
        failed_outputs: 0,
        early_refresh,
        serving: serve.is_some() && cli.command.is_empty(),
    };
    let ending = run.trace()?;
    conclude(run, &ending)
}

/// Loads the kernel side as the command line configures it, and checks what its links need.
fn load_probes(cli: &Cli, reach: &Reach, features: &KernelFeatures) -> Result<Probes> {
    let config = ProbeConfig {
        max_allocations: cli.max_allocations,
        max_stacks: cli.max_stacks,
        capture_stacks: !cli.no_stacks,
        empty_probes: cli.empty_probes,
        sample_mean: cli.sample.unwrap_or(0),
        reach: reach.clone(),
        debug_bpf: cli.debug_bpf,
    };
    let probes = Probes::load(&config, features)?;
    // Per-site links are uprobe perf events, which the kernel opens only for CAP_SYS_ADMIN;
    // uprobe_multi links need only what loading needed.
    if probes.link_kind() == LinkKind::PerfEvent {
        privileges::check_uprobe_perf_events()?;
    }
    Ok(probes)
}

/// What "memtrace: tracing ..." names.
fn describe_reach(cli: &Cli, following: &Following, probes: &Probes, model: &Model) -> String {
    if cli.system_wide() {
        format!(
            "all processes through {} allocator files and {} USDT probe sites",
            following.probed_files(),
            probes.usdt_sites()
        )
    } else if cli.follows_children() {
        format!("{} and every process they start", describe(model))
    } else {
        describe(model)
    }
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

type Exporters = Vec<Box<dyn Exporter>>;

/// Every output of the run, opened; and where the trace goes (the agent writes one only with -o).
fn open_outputs(cli: &Cli, serve: Option<&ServeOptions>) -> Result<(Exporters, Option<PathBuf>)> {
    let mut exporters: Exporters = Vec::new();
    let mut trace_path = None;
    // The agent and the live view write a trace only when -o names one.
    let default_trace = serve.is_none() && !cli.live_view;
    if let Some(path) = cli.output.clone().or_else(|| default_trace.then(default_output_path)) {
        let trace = TraceFile::create(&path)?.with_heap_subsystems(cli.heap_subsystems.clone());
        trace_path = Some(trace.path().to_owned());
        exporters.push(Box::new(trace));
    }
    if let Some(path) = &cli.summary {
        exporters.push(Box::new(SummaryFile::create(path, cli.top)?));
    }
    exporters.extend(crate::export::reports(&cli.reports, cli.top)?);
    match serve {
        Some(options) => exporters.push(Box::new(Agent::start(options)?)),
        None => {
            if cli.live_view {
                // After the files, so they are written before the view holds the final figures.
                exporters.push(Box::new(crate::top::TopView::start(cli)?));
            } else if let Some(progress) = Progress::on_terminal() {
                // First, so the line is cleared before any output says it is written.
                exporters.insert(0, Box::new(progress));
            }
            exporters.push(Box::new(TextReport { top: cli.top }));
        }
    }
    Ok((exporters, trace_path))
}

/// Which processes the kernel side counts, from the target options.
fn reach_of(cli: &Cli) -> Reach {
    if cli.system_wide() {
        Reach::AllProcesses(ProcessFilter {
            self_tgid: std::process::id(),
            excluded_pids: cli.exclude_pids.clone(),
            only_comms: cli.comms.clone(),
        })
    } else if cli.follows_children() {
        Reach::Tree
    } else {
        Reach::Targets
    }
}

/// What a run traces, with every probe attached (none: every process, `--all`).
#[derive(Default)]
struct Targets {
    /// Processes whose exit ends the run.
    watched: Vec<Watched>,
    /// A command waiting to exec until tracing is announced.
    held: Option<HeldCommand>,
    /// Files whose unwind tables are worth loading before the targets run (a command's image).
    preload: Vec<ObjectFile>,
}

impl Targets {
    fn pids(
        pids: &[u32],
        children: bool,
        following: &mut Following,
        probes: &mut Probes,
        collector: &mut Collector,
        model: &mut Model,
    ) -> Result<Self> {
        let mut watched = Vec::new();
        for &pid in pids {
            let image = ProcessImage::of_process(pid, following.cache())?;
            let allocator = following.add_target(probes, pid, &image)?;
            watched.push(Watched::new(pid, false)?);
            add_traced(model, pid, procfs::comm(pid).unwrap_or_default(), &allocator);
        }
        // The targets are in the kernel's tree already, so what they fork from now on is followed;
        // what they forked before is found here.
        for pid in procfs::descendants(pids).into_iter().filter(|_| children) {
            let comm = procfs::comm(pid).unwrap_or_default();
            let added = ProcessImage::of_process(pid, following.cache())
                .and_then(|image| following.add_target(probes, pid, &image));
            match added {
                Ok(allocator) => add_traced(model, pid, comm, &allocator),
                // It may have exited meanwhile, or use no allocator memtrace knows.
                Err(err) => eprintln!("memtrace: warning: pid {pid} ({comm}) is not traced: {err:#}"),
            }
        }
        // Read every target's mappings now: a process may exit before the first interval, and its
        // stacks are symbolized through the files it mapped.
        collector.sample(probes, following.usdt(), model, 0)?;
        Ok(Self { watched, held: None, preload: Vec::new() })
    }

    fn command(
        command: &[std::ffi::OsString],
        following: &mut Following,
        probes: &mut Probes,
        collector: &mut Collector,
        model: &mut Model,
    ) -> Result<Self> {
        let program = resolve_program(&command[0])?;
        let image = ProcessImage::of_command(&program, following.cache())?;
        // The command may exit before the first sample: know its files for symbols already.
        for object in &image.objects {
            collector.index_object(object);
        }
        let held = HeldCommand::spawn(&program, command)?;
        let allocator = following.add_target(probes, held.pid, &image)?;
        collector.index_object(&allocator.object);
        let watched = vec![Watched::new(held.pid, true)?];
        add_traced(model, held.pid, command_name(&program), &allocator);
        Ok(Self { watched, held: Some(held), preload: image.objects })
    }
}

/// The processes behind the --pid arguments: each once, by its process id even when given a thread id.
fn processes_to_attach(pids: &[u32]) -> Result<Vec<u32>> {
    let mut processes = Vec::new();
    for &pid in pids {
        if let Some(reason) = procfs::untraceable(pid) {
            bail!("{reason}");
        }
        let Some(tgid) = procfs::tgid(pid) else {
            bail!("no process with pid {pid}; check the pid with `ps -p {pid}`");
        };
        if tgid == std::process::id() {
            bail!("pid {pid} is memtrace itself; give the pid of the process to trace");
        }
        if tgid != pid {
            eprintln!("memtrace: {pid} is a thread of process {tgid}; tracing the whole process");
        }
        if !processes.contains(&tgid) {
            processes.push(tgid);
        }
    }
    Ok(processes)
}

fn add_traced(model: &mut Model, pid: u32, comm: String, allocator: &Allocator) {
    model.add_process(pid, comm, allocator.path.clone());
    if let Some(process) = model.processes.get_mut(&pid) {
        process.allocator_kind = allocator.kind.clone();
    }
}

/// Why tracing stopped.
enum Ending {
    TargetsExited,
    DurationReached,
    Signal(Signal),
    /// An output could not be written (said when it happened).
    OutputFailed,
}

/// A launched command still running when tracing stops: memtrace waits for it, never leaving it
/// orphaned, and says so.
struct RunningCommand {
    pid: u32,
    name: String,
}

impl RunningCommand {
    fn of(pid: u32, model: &Model) -> Self {
        // Its name now: it may have exec'd since it was last sampled.
        let name = procfs::comm(pid)
            .or_else(|| model.processes.get(&pid).map(|p| p.comm.clone()))
            .unwrap_or_default();
        Self { pid, name }
    }

    /// Says at once why tracing stopped and that the command still runs.
    fn announce_wait(&self, ending: &Ending, forwarded: bool) {
        let why = match ending {
            Ending::DurationReached => "--duration reached".to_owned(),
            Ending::Signal(signal) => format!("{signal} again"),
            Ending::OutputFailed => "an output failed".to_owned(),
            Ending::TargetsExited => return,
        };
        let next = if forwarded { "kill it with SIGKILL" } else { "pass the signal on to it" };
        eprintln!(
            "memtrace: {why}: tracing stops, the outputs are written and the probes detached; still \
             waiting for {} (pid {}) to exit; interrupt memtrace again to {next}",
            self.name, self.pid
        );
    }

    /// Waits for the command to exit and returns its status as a shell would. A signal is passed
    /// on to it if none was yet; after that, a signal kills it.
    fn wait(&self, child: &Watched, signals: &SignalFd, mut forwarded: bool) -> Result<i32> {
        loop {
            let mut fds =
                [PollFd::new(signals.as_fd(), PollFlags::POLLIN), PollFd::new(child.fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(err) => return Err(err).context("waiting for the command to exit"),
            }
            let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
            let (signalled, exited) = (ready(&fds[0]), ready(&fds[1]));
            if exited {
                return child.reap();
            }
            let signal = match signalled {
                true => signals.read_signal()?.and_then(|info| Signal::try_from(info.ssi_signo as i32).ok()),
                false => None,
            };
            match signal {
                // Ctrl-Z stops memtrace as it would any program.
                Some(Signal::SIGTSTP) => {
                    let _ = kill(Pid::this(), Signal::SIGSTOP);
                }
                // Sent before it is said: what stderr reports has happened.
                Some(signal) if !forwarded => {
                    let _ = kill(Pid::from_raw(self.pid as i32), signal);
                    forwarded = true;
                    eprintln!(
                        "memtrace: passed {signal} on to {} (pid {}); interrupt again to kill it (SIGKILL)",
                        self.name, self.pid
                    );
                }
                Some(_) => {
                    let _ = kill(Pid::from_raw(self.pid as i32), Signal::SIGKILL);
                    eprintln!("memtrace: killed {} (pid {}) with SIGKILL", self.name, self.pid);
                }
                None => {}
            }
        }
    }
}

struct Run<'a> {
    cli: &'a Cli,
    probes: Probes,
    collector: Collector,
    model: Model,
    unwind: KernelTables,
    exporters: Vec<Box<dyn Exporter>>,
    targets: Vec<Watched>,
    /// Execs, new processes and exits, of the targets or of every process.
    following: Following,
    signals: SignalFd,
    started: Instant,
    samples: u64,
    /// Lost events already said on stderr.
    lost_reported: u64,
    /// The first SIGINT/SIGTERM went to the command.
    forwarded_signal: bool,
    /// Outputs that could not be written (each said when it failed).
    failed_outputs: usize,
    /// A launched command's mapping tables are refreshed after this delay, doubling up to
    /// REFRESH_CEILING, so that its stacks are unwound long before its first sample and a library
    /// it dlopens is unwound soon after (reading /proc/PID/maps takes about 0.1 ms).
    early_refresh: Option<Duration>,
    /// `memtrace serve` without a command: tracing goes on after the targets exit, and processes
    /// released leave the model, so that its memory stays bounded over days. (With a command,
    /// serve is a run with live endpoints: it ends with the command and reports like a run.)
    serving: bool,
}

/// The first refresh of a launched command's mapping tables, and how far apart they get.
const FIRST_REFRESH: Duration = Duration::from_millis(1);
const REFRESH_CEILING: Duration = Duration::from_millis(10);

impl Run<'_> {
    fn trace(&mut self) -> Result<Ending> {
        let deadline = self.cli.duration.map(|duration| self.started + duration);
        let mut next_sample = self.started + self.cli.interval;
        let mut next_refresh = self.early_refresh.map(|delay| self.started + delay);
        loop {
            let wake = deadline.map_or(next_sample, |deadline| deadline.min(next_sample));
            let wake = next_refresh.map_or(wake, |refresh| refresh.min(wake));
            let (signal, exited) = self.wait_until(wake)?;
            if signal == Some(Signal::SIGTSTP) {
                self.stop_until_continued();
            } else if let Some(signal) = signal {
                match self.running_child() {
                    // The command decides how to end; its exit ends the trace.
                    Some(child) if !self.forwarded_signal => {
                        let _ = kill(Pid::from_raw(child as i32), signal);
                        self.forwarded_signal = true;
                        eprintln!(
                            "memtrace: passed {signal} on to the command (pid {child}); tracing goes on \
                             until it exits (interrupt again to stop tracing now)"
                        );
                    }
                    _ => return Ok(Ending::Signal(signal)),
                }
            }
            let now = Instant::now();
            if next_refresh.is_some_and(|refresh| now >= refresh) {
                next_refresh = self.refresh_unwind_tables()?.map(|delay| now + delay);
            }
            if exited || now >= next_sample {
                self.sample()?;
                if self.failed_outputs > 0 {
                    return Ok(Ending::OutputFailed);
                }
                while next_sample <= now {
                    next_sample += self.cli.interval;
                }
            }
            if !self.serving && !self.cli.system_wide() && self.targets.iter().all(|target| target.exited) {
                return Ok(Ending::TargetsExited);
            }
            if deadline.is_some_and(|deadline| now >= deadline) {
                return Ok(Ending::DurationReached);
            }
        }
    }

    /// Waits for a signal, a target's exit or `wake`; marks exited targets.
    fn wait_until(&mut self, wake: Instant) -> Result<(Option<Signal>, bool)> {
        let timeout = wake.saturating_duration_since(Instant::now());
        let timeout_ms = i32::try_from(timeout.as_millis() + 1).unwrap_or(i32::MAX);
        let live: Vec<usize> = (0..self.targets.len()).filter(|&i| !self.targets[i].exited).collect();
        let mut fds = vec![
            PollFd::new(self.signals.as_fd(), PollFlags::POLLIN),
            PollFd::new(self.following.fd(), PollFlags::POLLIN),
        ];
        let first_target = fds.len();
        fds.extend(live.iter().map(|&i| PollFd::new(self.targets[i].fd(), PollFlags::POLLIN)));
        match poll(&mut fds, PollTimeout::try_from(timeout_ms).unwrap_or(PollTimeout::MAX)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(err) => return Err(err).context("waiting for the traced processes"),
        }
        let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
        let signal_ready = ready(&fds[0]);
        let execs_ready = ready(&fds[1]);
        let exited: Vec<usize> =
            live.iter().zip(&fds[first_target..]).filter(|(_, fd)| ready(fd)).map(|(&i, _)| i).collect();
        drop(fds);
        let signal = if signal_ready {
            self.signals.read_signal()?.and_then(|info| Signal::try_from(info.ssi_signo as i32).ok())
        } else {
            None
        };
        if execs_ready {
            for object in self.following.handle_execs(&mut self.probes)? {
                self.collector.index_object(&object);
            }
        }
        for &i in &exited {
            self.targets[i].exited = true;
            if let Some(process) = self.model.processes.get_mut(&self.targets[i].pid) {
                process.exited = true;
            }
        }
        Ok((signal, !exited.is_empty()))
    }

    fn running_child(&self) -> Option<u32> {
        self.targets.iter().find(|t| t.is_child && !t.exited).map(|t| t.pid)
    }

    /// Refreshes the mapping tables of the targets between samples (a library the command
    /// dlopens gets its table within REFRESH_CEILING); returns the next delay, or None where
    /// samples come as often.
    fn refresh_unwind_tables(&mut self) -> Result<Option<Duration>> {
        // A process the command just started gets its table too.
        self.following.adopt_new_processes(&self.probes, &mut self.model)?;
        self.collector.read_mappings(&mut self.model);
        self.unwind.update(&mut self.probes, &self.model)?;
        let next = self
            .early_refresh
            .map(|delay| (delay * 2).min(REFRESH_CEILING))
            .filter(|delay| *delay < self.cli.interval);
        self.early_refresh = next;
        Ok(next)
    }

    fn sample(&mut self) -> Result<()> {
        if self.serving {
            // Their final figures went to the exporters at the sample that released them.
            self.model.processes.retain(|_, process| !process.released);
            self.model.retired.clear();
        }
        self.following.adopt_new_processes(&self.probes, &mut self.model)?;
        let ts_us = self.started.elapsed().as_micros() as u64;
        self.collector.sample(&self.probes, self.following.usdt(), &mut self.model, ts_us)?;
        self.unwind.update(&mut self.probes, &self.model)?;
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
            let wanted = self.model.processes.values().filter(|p| !p.released && stacks.includes(p.pid));
            let wanted = wanted.map(|p| p.pid).collect();
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
            for (program, skipped) in self.probes.skipped_runs_by_program().unwrap_or_default() {
                eprintln!(
                    "memtrace: warning: the kernel skipped {skipped} runs of BPF program {program} in all \
                     (it was running on that CPU already); each is an event lost"
                );
            }
            eprintln!(
                "memtrace: warning: {} events lost in the last interval ({lost} in all); a kernel table \
                 is full: live allocations (--max-allocations {}) or stacks made within one interval \
                 (--max-stacks {}; or sample more often with -i)",
                lost - self.lost_reported,
                self.cli.max_allocations,
                self.cli.max_stacks
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
        let exited: HashSet<u32> =
            self.model.processes.values().filter(|p| p.exited && !p.released).map(|p| p.pid).collect();
        if exited.is_empty() {
            return Ok(());
        }
        // Kept for the reports at the end; the agent has none.
        if !self.serving {
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
                if self.cli.system_wide() {
                    process.keep_only_reported(self.cli.top);
                }
            }
        }
        if let Some(maps) = &mut self.model.kernel_maps {
            maps.released_processes += exited.len();
        }
        self.model.fold_exited(self.cli.keep_exited);
        Ok(())
    }

    /// Reads the call stacks of `pids` from the kernel, in place of any read before.
    fn read_stacks(&mut self, pids: &HashSet<u32>) -> Result<()> {
        if self.cli.no_stacks {
            return Ok(());
        }
        for pid in pids {
            if let Some(process) = self.model.processes.get_mut(pid) {
                process.stacks.clear();
            }
        }
        self.collector
            .collect_stacks(&self.probes, &mut self.model, self.cli.older, |pid| pids.contains(&pid))
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

    /// Ctrl-Z: memtrace stops, after letting go of the execs it holds (stopped, it could not
    /// answer them, and every exec on the machine would wait); it holds them again when continued.
    fn stop_until_continued(&mut self) {
        self.following.release_held_execs();
        eprintln!("memtrace: stopped (execs are not held while stopped; continue with fg or SIGCONT)");
        let _ = kill(Pid::this(), Signal::SIGSTOP);
        self.following.resume_held_execs();
    }

    fn finish(&mut self, duration: Duration) -> Result<()> {
        // Probes stop firing first: the final figures hold still, and the machine is let go at
        // once, before the reports are worked out.
        self.following.release_held_execs();
        self.probes.detach();
        self.sample()?;
        // The agent has nothing left to show them to.
        if !self.serving {
            let unreleased = self.model.processes.values().filter(|p| !p.released).map(|p| p.pid).collect();
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
                 (held past 500 ms): those programs' first allocations may be missing"
            );
        }
        Ok(())
    }
}

/// SIGINT and SIGTERM end the run cleanly: they are read from a descriptor, never delivered.
fn block_termination_signals() -> Result<SignalFd> {
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGINT);
    mask.add(Signal::SIGTERM);
    // Read too, so that memtrace lets go of held execs before it stops.
    mask.add(Signal::SIGTSTP);
    mask.thread_block().context("blocking SIGINT and SIGTERM")?;
    SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK).context("creating a signalfd")
}

fn default_output_path() -> PathBuf {
    // 2026-11-29T11:09:11Z -> memtrace-20261129-110911.json
    let stamp = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let digits: String = stamp.chars().filter(char::is_ascii_digit).collect();
    let (date, time) = digits.split_at(digits.len().min(8));
    PathBuf::from(format!("memtrace-{date}-{time}.json"))
}

/// The name the kernel will give the command: its file name, cut to 15 bytes.
fn command_name(program: &Path) -> String {
    let name = program.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    name.char_indices().take_while(|&(i, c)| i + c.len_utf8() <= 15).map(|(_, c)| c).collect()
}

fn describe(model: &Model) -> String {
    let processes: Vec<String> = model
        .processes
        .values()
        .map(|p| format!("pid {} ({}) via {} ({})", p.pid, p.comm, p.allocator_kind, p.allocator.display()))
        .collect();
    processes.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_output_is_timestamped() {
        let name = default_output_path().to_string_lossy().into_owned();
        assert!(name.starts_with("memtrace-") && name.ends_with(".json"), "{name}");
        assert_eq!(name.len(), "memtrace-20261129-110911.json".len(), "{name}");
    }

    #[test]
    fn command_names_are_cut_like_the_kernel_does() {
        assert_eq!(command_name(Path::new("/usr/bin/a-very-long-program-name")), "a-very-long-pro");
        assert_eq!(command_name(Path::new("./demo")), "demo");
    }
}
