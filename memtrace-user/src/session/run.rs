//! The poll loop of a run: it sleeps until a signal, a target's exit, an exec to probe, the next
//! refresh of a launched command's unwind tables or the next sample, and decides when tracing
//! ends. What a sample does is in `sample`.

use std::{
    os::fd::AsFd,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use nix::{
    poll::{poll, PollFd, PollFlags, PollTimeout},
    sys::{
        signal::{kill, Signal},
        signalfd::SignalFd,
    },
    unistd::Pid,
};

use super::{outputs::Exporters, signals, targets::Watched, windows::WindowClock};
use crate::{
    collect::unwind::KernelTables,
    collect::{oom::OomWatch, Collector},
    follow::{Following, Ready},
    kernel::Probes,
    model::Model,
    plan::{Retention, Tables, Timing},
};

/// Why tracing stopped.
pub enum Ending {
    TargetsExited,
    DurationReached,
    Signal(Signal),
    /// An output could not be written (said when it happened).
    OutputFailed,
}

pub struct Run {
    pub probes: Probes,
    pub collector: Collector,
    pub model: Model,
    pub unwind: KernelTables,
    pub exporters: Exporters,
    pub targets: Vec<Watched>,
    /// Execs, new processes and exits, of the targets or of every process.
    pub following: Following,
    /// The OOM killer's victims, as the kernel announces them.
    pub oom: OomWatch,
    pub signals: SignalFd,
    pub started: Instant,
    pub samples: u64,
    /// Lost events already said on stderr.
    pub lost_reported: u64,
    /// The first SIGINT/SIGTERM went to the command.
    pub forwarded_signal: bool,
    /// Outputs that could not be written (each said when it failed).
    pub failed_outputs: usize,
    /// A launched command's mapping tables are refreshed after this delay, doubling up to
    /// REFRESH_CEILING, so that its stacks are unwound long before its first sample and a library
    /// it dlopens is unwound soon after (reading /proc/PID/maps takes about 0.1 ms).
    pub early_refresh: Option<Duration>,
    /// The run refreshes mapping tables between samples (a launched command's): an exec starts
    /// the refreshes again (`refresh_after_exec`) once they have come to rest.
    pub refreshes: bool,
    pub refresh_after_exec: bool,
    pub timing: Timing,
    pub retention: Retention,
    /// What the loss warning names.
    pub tables: Tables,
    /// Call stacks are recorded (not with --no-stacks).
    pub stacks: bool,
    /// `--older`: only live blocks at least this old at the end count as leaked.
    pub older: Duration,
    /// `--window`: when the allocation probes are attached.
    pub windows: Option<WindowClock>,
}

/// The first refresh of a launched command's mapping tables, and how far apart they get.
pub const FIRST_REFRESH: Duration = Duration::from_millis(1);
const REFRESH_CEILING: Duration = Duration::from_millis(10);

impl Run {
    pub fn trace(&mut self) -> Result<Ending> {
        let deadline = self.timing.duration.map(|duration| self.started + duration);
        let mut next_sample = self.started + self.timing.interval;
        let mut next_refresh = self.early_refresh.map(|delay| self.started + delay);
        loop {
            let wake = deadline.map_or(next_sample, |deadline| deadline.min(next_sample));
            let wake = next_refresh.map_or(wake, |refresh| refresh.min(wake));
            let wake = self.windows.as_ref().map_or(wake, |clock| clock.next_change().min(wake));
            let (signal, sample_now) = self.wait_until(wake)?;
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
            if let Some(clock) = &mut self.windows {
                clock.tick(&mut self.probes, &self.model, now)?;
            }
            if std::mem::take(&mut self.refresh_after_exec) && self.early_refresh.is_none() {
                self.early_refresh = Some(FIRST_REFRESH);
                next_refresh = Some(now + FIRST_REFRESH);
            }
            if next_refresh.is_some_and(|refresh| now >= refresh) {
                next_refresh = self.refresh_unwind_tables()?.map(|delay| now + delay);
            }
            if sample_now || now >= next_sample {
                self.sample()?;
                if self.failed_outputs > 0 {
                    return Ok(Ending::OutputFailed);
                }
                while next_sample <= now {
                    next_sample += self.timing.interval;
                }
            }
            if self.timing.ends_with_targets && self.targets.iter().all(|target| target.exited) {
                return Ok(Ending::TargetsExited);
            }
            if deadline.is_some_and(|deadline| now >= deadline) {
                return Ok(Ending::DurationReached);
            }
        }
    }

    /// Waits for a signal, a target's exit, an OOM kill or `wake`; marks exited targets. The
    /// second value asks for a sample now: a target exited, or the OOM killer ended a process.
    fn wait_until(&mut self, wake: Instant) -> Result<(Option<Signal>, bool)> {
        let timeout = wake.saturating_duration_since(Instant::now());
        let timeout_ms = i32::try_from(timeout.as_millis() + 1).unwrap_or(i32::MAX);
        let live: Vec<usize> = (0..self.targets.len()).filter(|&i| !self.targets[i].exited).collect();
        let mut fds = vec![
            PollFd::new(self.signals.as_fd(), PollFlags::POLLIN),
            PollFd::new(self.following.fd(), PollFlags::POLLIN),
        ];
        let oom_at = fds.len();
        if let Some(fd) = self.oom.fd() {
            fds.push(PollFd::new(fd, PollFlags::POLLIN));
        }
        let first_target = fds.len();
        fds.extend(live.iter().map(|&i| PollFd::new(self.targets[i].fd(), PollFlags::POLLIN)));
        match poll(&mut fds, PollTimeout::try_from(timeout_ms).unwrap_or(PollTimeout::MAX)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(err) => return Err(err).context("waiting for the traced processes"),
        }
        let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
        let signal_ready = ready(&fds[0]);
        let execs_ready = ready(&fds[1]);
        let oom_ready = fds[oom_at..first_target].iter().any(ready);
        let exited: Vec<usize> =
            live.iter().zip(&fds[first_target..]).filter(|(_, fd)| ready(fd)).map(|(&i, _)| i).collect();
        drop(fds);
        let signal = if signal_ready { signals::read(&self.signals)? } else { None };
        if execs_ready {
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
            let execed = self.following.handle_execs(&mut self.probes, prepare)?;
            // A new program's mappings are read soon; a forked child's are its parent's.
            self.refresh_after_exec |= self.refreshes && !execed.is_empty();
            for object in execed {
                self.collector.index_object(&object);
            }
        }
        for &i in &exited {
            self.targets[i].exited = true;
            if let Some(process) = self.model.processes.get_mut(&self.targets[i].pid) {
                process.exited = true;
            }
        }
        Ok((signal, !exited.is_empty() || oom_ready))
    }

    pub fn running_child(&self) -> Option<u32> {
        self.targets.iter().find(|t| t.is_child && !t.exited).map(|t| t.pid)
    }

    /// Refreshes the mapping tables of the targets between samples (a library the command
    /// dlopens gets its table within REFRESH_CEILING); returns the next delay, or None where
    /// samples come as often.
    fn refresh_unwind_tables(&mut self) -> Result<Option<Duration>> {
        // A process the command just started gets its table too.
        self.following.adopt_new_processes(&self.probes, &mut self.model)?;
        let young = self.collector.read_mappings(&mut self.model);
        self.unwind.update(&mut self.probes, &self.model)?;
        // Nothing is starting up: the refreshes rest until an exec brings a new program.
        if !young {
            self.early_refresh = None;
            return Ok(None);
        }
        let next = self
            .early_refresh
            .map(|delay| (delay * 2).min(REFRESH_CEILING))
            .filter(|delay| *delay < self.timing.interval);
        self.early_refresh = next;
        Ok(next)
    }

    /// Ctrl-Z: memtrace stops, after letting go of the execs it holds (stopped, it could not
    /// answer them, and every exec on the machine would wait); it holds them again when continued.
    fn stop_until_continued(&mut self) {
        self.following.release_held_execs();
        eprintln!("memtrace: stopped (execs are not held while stopped; continue with fg or SIGCONT)");
        let _ = kill(Pid::this(), Signal::SIGSTOP);
        self.following.resume_held_execs();
    }
}
