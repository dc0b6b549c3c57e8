//! `--window ON/EVERY`'s clock: the first window opens as tracing starts (the probes are loaded
//! with it open), closes ON later, and the next opens EVERY after the last one opened. It keeps
//! how long windows have been open, which the model's estimates are scaled by.

use std::time::{Duration, Instant};

use anyhow::Result;

use crate::{cli::Window, kernel::Probes, model::estimate::Windows};

pub struct WindowClock {
    window: Window,
    /// When the open window opened; None between windows.
    opened: Option<Instant>,
    /// When the last window opened: the next opens `every` after it.
    last_opened: Instant,
    /// The windows closed so far, together.
    probed: Duration,
}

impl WindowClock {
    /// The clock of a run whose first window is open since `started`.
    pub fn new(window: Window, started: Instant) -> Self {
        Self { window, opened: Some(started), last_opened: started, probed: Duration::ZERO }
    }

    /// When the window opens or closes next.
    pub fn next_change(&self) -> Instant {
        match self.opened {
            Some(opened) => opened + self.window.on,
            None => self.last_opened + self.window.every,
        }
    }

    /// Opens or closes the window if its time has come.
    pub fn tick(&mut self, probes: &mut Probes, now: Instant) -> Result<()> {
        if now < self.next_change() {
            return Ok(());
        }
        match self.opened.take() {
            Some(opened) => {
                // The window ends as its generation does, before its probes are detached (~65 ms
                // here for a uprobe_multi link, an SRCU grace period, while they count nothing).
                self.probed += Instant::now().saturating_duration_since(opened);
                probes.close_window()?;
            }
            None => {
                // A late tick opens the window now: windows never overlap, nor run short.
                self.last_opened = now.max(self.last_opened + self.window.every);
                // It begins once its probes are all in place (~10 ms here).
                probes.open_window()?;
                self.opened = Some(Instant::now());
            }
        }
        Ok(())
    }

    /// The model's account of the windows, as of `now` in a run that started at `started`.
    pub fn measured(&self, model: Windows, started: Instant, now: Instant) -> Windows {
        let open = self.opened.map_or(Duration::ZERO, |opened| now.saturating_duration_since(opened));
        let elapsed = now.saturating_duration_since(started);
        model.measured((self.probed + open).as_secs_f64(), elapsed.as_secs_f64())
    }
}

impl Windows {
    /// The model's figures for a run windowed as `window` says, before any was measured.
    pub fn of(window: Window) -> Self {
        Windows::new(window.on.as_secs_f64(), window.every.as_secs_f64())
    }
}
