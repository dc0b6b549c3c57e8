//! When things happen in a run: the samples, every `--interval` from the start, and the numbers
//! their dumps bear; the end at `--duration`; `--window`'s openings and closings; and the early
//! refreshes of a launched command's mapping tables, so that its stacks are unwound long before
//! its first sample.

use std::time::{Duration, Instant};

use anyhow::Result;

use super::windows::WindowClock;
use crate::{
    cli::Window,
    kernel::Probes,
    model::{Model, Sample},
    plan::Timing,
};

/// The first refresh of a launched command's mapping tables, and how far apart they get.
const FIRST_REFRESH: Duration = Duration::from_millis(1);
const REFRESH_CEILING: Duration = Duration::from_millis(10);

pub struct Clock {
    started: Instant,
    timing: Timing,
    deadline: Option<Instant>,
    next_sample: Instant,
    /// Samples taken so far: the last one's number.
    samples: u64,
    /// `--window`: when the allocation probes are attached.
    windows: Option<WindowClock>,
    /// A launched command's mapping tables are refreshed after this delay, doubling up to
    /// REFRESH_CEILING, so that its stacks are unwound long before its first sample and a library
    /// it dlopens is unwound soon after (reading /proc/PID/maps takes about 0.1 ms).
    early_refresh: Option<Duration>,
    next_refresh: Option<Instant>,
    /// The run refreshes mapping tables between samples (a launched command's): an exec starts
    /// the refreshes again (`refresh_after_exec`) once they have come to rest.
    refreshes: bool,
    refresh_after_exec: bool,
}

impl Clock {
    /// The clock of a run that starts now, with `model`'s processes traced; `refreshes`: a
    /// launched command's mapping tables are refreshed between samples.
    pub fn start(timing: Timing, window: Option<Window>, model: &Model, refreshes: bool) -> Self {
        let started = Instant::now();
        let early_refresh = refreshes.then_some(FIRST_REFRESH);
        Self {
            started,
            timing,
            deadline: timing.duration.map(|duration| started + duration),
            next_sample: started + timing.interval,
            samples: 0,
            windows: window.map(|window| WindowClock::new(window, started, model)),
            early_refresh,
            next_refresh: early_refresh.map(|delay| started + delay),
            refreshes,
            refresh_after_exec: false,
        }
    }

    pub fn started(&self) -> Instant {
        self.started
    }

    /// When the run is next to wake: a sample, the deadline, a refresh or a window's change.
    pub fn wake(&self) -> Instant {
        let wake = self.deadline.map_or(self.next_sample, |deadline| deadline.min(self.next_sample));
        let wake = self.next_refresh.map_or(wake, |refresh| refresh.min(wake));
        self.windows.as_ref().map_or(wake, |clock| clock.next_change().min(wake))
    }

    /// Opens or closes the window if its time has come.
    pub fn tick_window(&mut self, probes: &mut Probes, model: &Model, now: Instant) -> Result<()> {
        match &mut self.windows {
            Some(clock) => clock.tick(probes, model, now),
            None => Ok(()),
        }
    }

    /// A new program was exec'd: its mappings are read soon (a forked child's are its parent's).
    pub fn exec_seen(&mut self) {
        self.refresh_after_exec |= self.refreshes;
    }

    /// Whether the mapping tables are to be refreshed at `now`: an exec since the last look
    /// starts the refreshes again where they had come to rest.
    pub fn refresh_due(&mut self, now: Instant) -> bool {
        if std::mem::take(&mut self.refresh_after_exec) && self.early_refresh.is_none() {
            self.early_refresh = Some(FIRST_REFRESH);
            self.next_refresh = Some(now + FIRST_REFRESH);
        }
        self.next_refresh.is_some_and(|refresh| now >= refresh)
    }

    /// The mapping tables were refreshed at `now`; `young`: a process is still starting up.
    /// Otherwise the refreshes rest until an exec brings a new program, and they stop where
    /// samples come as often.
    pub fn refreshed(&mut self, now: Instant, young: bool) {
        if !young {
            self.early_refresh = None;
            self.next_refresh = None;
            return;
        }
        let next = self
            .early_refresh
            .map(|delay| (delay * 2).min(REFRESH_CEILING))
            .filter(|delay| *delay < self.timing.interval);
        self.early_refresh = next;
        self.next_refresh = next.map(|delay| now + delay);
    }

    /// Whether a sample is due at `now`.
    pub fn sample_due(&self, now: Instant) -> bool {
        now >= self.next_sample
    }

    /// A sample was taken at `now`: the next is at the next interval after it.
    pub fn sampled(&mut self, now: Instant) {
        while self.next_sample <= now {
            self.next_sample += self.timing.interval;
        }
    }

    /// Microseconds since the start.
    pub fn elapsed_us(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }

    /// Puts the windows as of now in `model`.
    pub fn measure_windows(&mut self, model: &mut Model) {
        if let Some(clock) = &mut self.windows {
            clock.measure(model, self.started, Instant::now());
        }
    }

    /// The next sample, taken at `ts_us`: its dump id is its number.
    pub fn next_sample(&mut self, ts_us: u64) -> Sample {
        self.samples += 1;
        Sample { ts_us, dump_id: self.samples }
    }

    /// The run ends when every target has exited (not system-wide, nor for the agent).
    pub fn ends_with_targets(&self) -> bool {
        self.timing.ends_with_targets
    }

    /// `--duration` has passed at `now`.
    pub fn past_deadline(&self, now: Instant) -> bool {
        self.deadline.is_some_and(|deadline| now >= deadline)
    }
}
