//! `--window ON/EVERY`'s clock: the first window opens as tracing starts (the probes are loaded
//! with it open), closes ON later, and the next opens EVERY after the last one opened. It keeps
//! how long windows have been open and how many have closed, and each traced process's user CPU
//! time inside them (window_cpu.rs), which the model's estimates are scaled by.

use std::time::{Duration, Instant};

use anyhow::Result;

use super::window_cpu::WindowCpu;
use crate::{
    cli::Window,
    kernel::Probes,
    model::{estimate::Windows, Model},
};

pub struct WindowClock {
    window: Window,
    /// When the open window opened; None between windows.
    opened: Option<Instant>,
    /// When the last window opened: the next opens `every` after it.
    last_opened: Instant,
    /// The windows closed so far, together, and how many.
    probed: Duration,
    closed: u64,
    cpu: WindowCpu,
}

impl WindowClock {
    /// The clock of a run whose first window is open since `started`, where `model`'s processes
    /// are traced from the start.
    pub fn new(window: Window, started: Instant, model: &Model) -> Self {
        let mut cpu = WindowCpu::new();
        cpu.opened(traced(model));
        Self { window, opened: Some(started), last_opened: started, probed: Duration::ZERO, closed: 0, cpu }
    }

    /// When the window opens or closes next.
    pub fn next_change(&self) -> Instant {
        match self.opened {
            Some(opened) => opened + self.window.on,
            None => self.last_opened + self.window.every,
        }
    }

    /// Opens or closes the window if its time has come; the user time of `model`'s processes is
    /// read at each change.
    pub fn tick(&mut self, probes: &mut Probes, model: &Model, now: Instant) -> Result<()> {
        if now < self.next_change() {
            return Ok(());
        }
        match self.opened.take() {
            Some(opened) => {
                // The window ends as its generation does, before its probes are detached (~65 ms
                // here for a uprobe_multi link, an SRCU grace period, while they count nothing).
                self.cpu.closing(traced(model));
                self.probed += Instant::now().saturating_duration_since(opened);
                probes.close_window()?;
                self.closed += 1;
            }
            None => {
                // A late tick opens the window now: windows never overlap, nor run short.
                self.last_opened = now.max(self.last_opened + self.window.every);
                // It begins once its probes are all in place (~10 ms here).
                probes.open_window()?;
                self.opened = Some(Instant::now());
                self.cpu.opened(traced(model));
            }
        }
        Ok(())
    }

    /// Puts the windows as of `now`, in a run that started at `started`, in the model: the run's
    /// account, and each traced process's user time inside windows and in all.
    pub fn measure(&mut self, model: &mut Model, started: Instant, now: Instant) {
        let Some(windows) = model.windows else { return };
        let open = self.opened.map_or(Duration::ZERO, |opened| now.saturating_duration_since(opened));
        let elapsed = now.saturating_duration_since(started);
        model.windows =
            Some(windows.measured((self.probed + open).as_secs_f64(), elapsed.as_secs_f64(), self.closed));
        let is_open = self.opened.is_some();
        for process in model.processes.values_mut().filter(|process| !process.released) {
            if let Some(cpu) = self.cpu.measured(process.identity.pid, is_open) {
                process.window_cpu = Some(cpu);
            }
        }
        self.cpu.retain(|pid| model.processes.get(&pid).is_some_and(|process| !process.released));
    }
}

/// The processes whose user time is followed: those the kernel still has figures for.
fn traced(model: &Model) -> impl Iterator<Item = u32> + '_ {
    model.processes.values().filter(|process| !process.released).map(|process| process.identity.pid)
}

impl Windows {
    /// The model's figures for a run windowed as `window` says, before any was measured.
    pub fn of(window: Window) -> Self {
        Windows::new(window.on.as_secs_f64(), window.every.as_secs_f64())
    }
}
