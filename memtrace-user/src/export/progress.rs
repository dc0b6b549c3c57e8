//! A run's progress on one line of stderr, rewritten in place at every sample once the run has
//! gone on for a while, and cleared before the final report: only when stderr is a terminal (a
//! pipe or a file gets none of it).

use std::{
    io::{IsTerminal, Write},
    time::Duration,
};

use anyhow::Result;

use super::{exporter::Exporter, format::format_elapsed};
use crate::model::{Model, RunEnd, Sample};

/// How long a run goes on before its progress is shown: a short command's run shows none.
const SHOWN_AFTER: Duration = Duration::from_secs(2);

pub struct Progress {
    shown: bool,
}

impl Progress {
    /// The progress line, when stderr is a terminal.
    pub fn on_terminal() -> Option<Self> {
        std::io::stderr().is_terminal().then_some(Self { shown: false })
    }
}

/// The line: elapsed time, processes, allocator events and losses, cut to `width` characters.
fn line(model: &Model, elapsed: Duration, width: usize) -> String {
    let processes = model.every_process().count();
    let running = model.processes.values().filter(|p| !p.exited).count();
    let events: u64 = model.every_process().map(|p| p.stats.allocations + p.stats.frees).sum();
    let text = format!(
        "memtrace: {} · {processes} process{} ({running} running) · {events} events · {} lost",
        format_elapsed(elapsed),
        if processes == 1 { "" } else { "es" },
        model.lost_events()
    );
    text.chars().take(width).collect()
}

fn terminal_width() -> usize {
    ratatui::crossterm::terminal::size().map_or(80, |(columns, _)| usize::from(columns.max(2)))
}

impl Exporter for Progress {
    fn sample(&mut self, model: &Model, sample: Sample) -> Result<()> {
        let elapsed = Duration::from_micros(sample.ts_us);
        if elapsed >= SHOWN_AFTER {
            // One column short of the width, so the line never wraps; the cursor goes back to its
            // start, so that any other message overwrites it rather than follow it.
            let text = line(model, elapsed, terminal_width() - 1);
            let mut stderr = std::io::stderr().lock();
            let _ = write!(stderr, "\r\x1b[2K{text}\r").and_then(|()| stderr.flush());
            self.shown = true;
        }
        Ok(())
    }

    fn finish(&mut self, _model: &Model, _end: RunEnd) -> Result<()> {
        if std::mem::take(&mut self.shown) {
            let _ = write!(std::io::stderr(), "\r\x1b[2K");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_counts_processes_events_and_losses() {
        let mut model = Model::default();
        model.add_process(crate::model::identity::ProcessIdentity::new(7, "a".into()), "/libc".into());
        model.add_process(crate::model::identity::ProcessIdentity::new(8, "b".into()), "/libc".into());
        let process = model.processes.get_mut(&7).unwrap();
        process.stats.allocations = 30;
        process.stats.frees = 12;
        process.stats.lost_events = 2;
        process.exited = true;
        let text = line(&model, Duration::from_secs(75), 200);
        assert_eq!(text, "memtrace: 1m15s · 2 processes (1 running) · 42 events · 2 lost");
        assert_eq!(line(&model, Duration::from_secs(75), 12), "memtrace: 1m");
    }
}
