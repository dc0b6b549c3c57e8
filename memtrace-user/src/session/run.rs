//! A run in its parts, and its loop: the kernel side (`KernelSide`), the processes it follows
//! (`Traced`), the model they fill, the outputs it hands the model to (`Exporters`) and its clock
//! (`Clock`). It sleeps until a signal, a target's exit, an exec to probe, the next refresh of a
//! launched command's unwind tables or the next sample; samples; and decides when tracing ends.
//! At each sample and at its end the kernel's figures are read into the model, the call stacks
//! read for whoever wants them, the model handed to every output, and exited processes released
//! from the kernel's tables and folded, so that a long run stays bounded.

use std::{collections::HashSet, os::fd::AsFd, process::ExitCode, time::Duration, time::Instant};

use anyhow::{Context, Result};
use nix::{
    poll::{poll, PollFd, PollFlags, PollTimeout},
    sys::{signal::Signal, signalfd::SignalFd},
};

use super::{
    clock::Clock,
    command::{Ending, RunningCommand},
    kernel_side::KernelSide,
    outputs::Exporters,
    signals,
    targets::Traced,
};
use crate::{
    export::exporter::StacksWanted,
    model::{KernelMaps, Model, RunEnd},
    plan::Retention,
};

/// A run, made in one place (`session::run`) from its parts, each of which keeps its own fields.
pub struct Run {
    pub(super) kernel: KernelSide,
    pub(super) traced: Traced,
    pub(super) model: Model,
    pub(super) outputs: Exporters,
    pub(super) clock: Clock,
    pub(super) retention: Retention,
    pub(super) signals: SignalFd,
}

impl Run {
    pub fn trace(&mut self) -> Result<Ending> {
        loop {
            let (signal, sample_now) = self.wait_until(self.clock.wake())?;
            if signal == Some(Signal::SIGTSTP) {
                self.traced.stop_until_continued();
            } else if let Some(signal) = signal {
                if !self.traced.forward(signal) {
                    return Ok(Ending::Signal(signal));
                }
            }
            let now = Instant::now();
            self.clock.tick_window(self.kernel.probes_mut(), &self.model, now)?;
            if self.clock.refresh_due(now) {
                self.refresh_unwind_tables(now)?;
            }
            if sample_now || self.clock.sample_due(now) {
                self.sample()?;
                if self.outputs.failed() {
                    return Ok(Ending::OutputFailed);
                }
                self.clock.sampled(now);
            }
            if self.clock.ends_with_targets() && self.traced.all_exited() {
                return Ok(Ending::TargetsExited);
            }
            if self.clock.past_deadline(now) {
                return Ok(Ending::DurationReached);
            }
        }
    }

    /// Waits for a signal, a target's exit, an OOM kill or `wake`; marks exited targets. The
    /// second value asks for a sample now: a target exited, or the OOM killer ended a process.
    fn wait_until(&mut self, wake: Instant) -> Result<(Option<Signal>, bool)> {
        let timeout = wake.saturating_duration_since(Instant::now());
        let timeout_ms = i32::try_from(timeout.as_millis() + 1).unwrap_or(i32::MAX);
        let running = self.traced.running();
        let mut fds = vec![
            PollFd::new(self.signals.as_fd(), PollFlags::POLLIN),
            PollFd::new(self.traced.execs_fd(), PollFlags::POLLIN),
        ];
        let oom_at = fds.len();
        if let Some(fd) = self.kernel.oom_fd() {
            fds.push(PollFd::new(fd, PollFlags::POLLIN));
        }
        let first_target = fds.len();
        fds.extend(running.iter().map(|&(_, fd)| PollFd::new(fd, PollFlags::POLLIN)));
        match poll(&mut fds, PollTimeout::try_from(timeout_ms).unwrap_or(PollTimeout::MAX)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(err) => return Err(err).context("waiting for the traced processes"),
        }
        let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
        let signal_ready = ready(&fds[0]);
        let execs_ready = ready(&fds[1]);
        let oom_ready = fds[oom_at..first_target].iter().any(ready);
        let exited: Vec<usize> = running
            .iter()
            .zip(&fds[first_target..])
            .filter(|(_, fd)| ready(fd))
            .map(|(&(i, _), _)| i)
            .collect();
        drop(fds);
        drop(running);
        let signal = if signal_ready { signals::read(&self.signals)? } else { None };
        if execs_ready && self.traced.handle_execs(&mut self.kernel)? {
            self.clock.exec_seen();
        }
        for &i in &exited {
            self.traced.exited(i, &mut self.model);
        }
        Ok((signal, !exited.is_empty() || oom_ready))
    }

    /// Refreshes the mapping tables of the targets between samples (a library the command
    /// dlopens gets its table within REFRESH_CEILING).
    fn refresh_unwind_tables(&mut self, now: Instant) -> Result<()> {
        // A process the command just started gets its table too.
        self.traced.adopt_new_processes(self.kernel.probes(), &mut self.model)?;
        let young = self.kernel.refresh_mappings(&mut self.model)?;
        self.clock.refreshed(now, young);
        Ok(())
    }

    fn sample(&mut self) -> Result<()> {
        if self.retention.forget_released {
            // Their final figures went to the exporters at the sample that released them.
            self.model.processes.retain(|_, process| !process.released);
            self.model.retired.clear();
        }
        self.traced.catch_up(self.kernel.probes_mut(), &mut self.model)?;
        // Before the figures are read: a victim's heap at the kill is read with them.
        let victims = self.kernel.take_oom_victims(&mut self.model, self.clock.started());
        let ts_us = self.clock.elapsed_us();
        self.clock.measure_windows(&mut self.model);
        self.kernel.read_figures(self.traced.usdt(), &mut self.model, ts_us)?;
        for pid in victims {
            if let Some(process) = self.model.processes.get(&pid) {
                super::oom::announce(process);
            }
        }
        self.kernel.update_unwind_tables(&self.model)?;
        self.kernel.note_single_stepped(&mut self.model);
        self.model.library_loads_held = self.traced.library_loads_held();
        let sample = self.clock.next_sample(ts_us);
        self.model.record_timeline(sample.ts_us);
        self.kernel.report_new_losses(&self.model);
        let (stacks, occupancy) = self.outputs.wanted();
        if stacks != StacksWanted::None {
            let wanted =
                self.model.processes.values().filter(|p| !p.released && stacks.includes(p.identity.pid));
            let wanted = wanted.map(|p| p.identity.pid).collect();
            self.kernel.read_stacks(&mut self.model, &wanted)?;
        }
        if occupancy {
            self.kernel.record_occupancy(&mut self.model)?;
        }
        self.outputs.sample(&self.model, sample);
        self.release_exited()
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
            self.kernel.read_stacks(&mut self.model, &exited)?;
        }
        self.kernel.release(&exited)?;
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

    /// Writes the outputs, detaches, waits for a command that outlives the trace, and works out
    /// the exit code.
    pub fn conclude(mut self, ending: &Ending) -> Result<ExitCode> {
        let command = self.traced.running_child().map(|pid| RunningCommand::of(pid, &self.model));
        let duration = self.clock.started().elapsed();
        self.finish(duration)?;
        let Run { kernel, traced, outputs, signals, .. } = self;
        // Detach before waiting on a command that outlives the trace.
        drop(kernel);
        let forwarded = traced.forwarded_signal();
        let status = match (command, traced.child()) {
            (Some(command), Some(child)) => {
                command.announce_wait(ending, forwarded);
                Some(command.wait(child, &signals, forwarded)?)
            }
            (None, Some(child)) => Some(child.reap()?),
            (_, None) => None,
        };
        if outputs.failed() {
            // Every failure was said when it happened, naming its file.
            return Ok(ExitCode::from(1));
        }
        Ok(status.map_or(ExitCode::SUCCESS, |status| ExitCode::from(u8::try_from(status).unwrap_or(1))))
    }

    fn finish(&mut self, duration: Duration) -> Result<()> {
        // Probes stop firing first: the final figures hold still, and the machine is let go at
        // once, before the reports are worked out.
        self.traced.release_held_execs();
        self.kernel.detach();
        self.sample()?;
        // The agent has nothing left to show them to.
        if !self.retention.forget_released {
            let unreleased =
                self.model.processes.values().filter(|p| !p.released).map(|p| p.identity.pid).collect();
            self.kernel.read_stacks(&mut self.model, &unreleased)?;
            self.kernel.record_occupancy(&mut self.model)?;
        }
        self.outputs.finish(&self.model, RunEnd { duration });
        self.traced.warn_missed_execs();
        Ok(())
    }
}
