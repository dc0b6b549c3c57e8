//! `memtrace top`: a run watched live in the terminal. The view is an exporter like any other: at
//! every sample it hands a snapshot of what it shows (not the model) to a thread of its own, which
//! draws and reads the keys; it asks the session for call stacks only while the user has a
//! process open. q ends the run as Ctrl-C ends a run (see `view`); once tracing has ended the
//! view keeps the final figures until q, and then gives the terminal back, before the final
//! report is printed.

mod snapshot;
mod terminal;
mod view;

use std::{
    sync::{
        atomic::{AtomicU32, Ordering},
        mpsc::{self, Sender},
        Arc,
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{Context, Result};

use crate::{
    export::exporter::{Exporter, StacksWanted},
    model::{Model, RunEnd, Sample},
};
use snapshot::{Growth, Snapshot};
use terminal::{Capture, Screen};
use view::{App, Update};

pub struct TopView {
    /// The view until the first sample starts its thread (no thread runs before a launched
    /// command is forked).
    waiting: Option<Waiting>,
    ui: Option<JoinHandle<Screen>>,
    updates: Option<Sender<Update>>,
    /// The process the user opened (0: none), set by the view.
    opened: Arc<AtomicU32>,
    /// Whether the stacks were asked for the sample being taken.
    stacks_asked: bool,
    no_stacks: bool,
    growth: Growth,
    capture: Capture,
}

/// The view before its thread starts: the terminal, and what it shows.
struct Waiting {
    screen: Screen,
    app: App,
}

impl TopView {
    /// Takes the terminal: memtrace's stdout and stderr are held from now on, and shown in the view.
    /// `no_stacks`: the run records no call stacks, so an opened process shows none.
    pub fn start(no_stacks: bool) -> Result<Self> {
        let capture = Capture::start()?;
        let mut screen = Screen::open()?;
        let opened = Arc::new(AtomicU32::new(0));
        let mut app = App::new(Arc::clone(&opened), no_stacks);
        screen.terminal.draw(|frame| app.draw(frame, &[])).context("drawing on the terminal")?;
        Ok(Self {
            waiting: Some(Waiting { screen, app }),
            ui: None,
            updates: None,
            opened,
            stacks_asked: false,
            no_stacks,
            growth: Growth::default(),
            capture,
        })
    }

    fn send(&mut self, update: impl FnOnce(Box<Snapshot>) -> Update, model: &Model, elapsed: Duration) {
        if let Some(Waiting { screen, app }) = self.waiting.take() {
            let (sender, receiver) = mpsc::channel();
            let held = Arc::clone(&self.capture.held);
            let spawned = std::thread::Builder::new()
                .name("memtrace-top".into())
                .spawn(move || view::run(screen, receiver, app, held));
            match spawned {
                Ok(ui) => (self.ui, self.updates) = (Some(ui), Some(sender)),
                Err(err) => eprintln!("memtrace: warning: cannot start the view: {err}"),
            }
            self.capture.drain();
        }
        let opened = Some(self.opened.load(Ordering::Relaxed)).filter(|&pid| pid != 0);
        let snapshot = Snapshot::of(model, elapsed, &mut self.growth, opened, self.stacks_asked);
        if let Some(updates) = &self.updates {
            // The view may have gone (the terminal closed): tracing goes on regardless.
            let _ = updates.send(update(Box::new(snapshot)));
        }
    }

    /// Waits for the view to end, then gives the terminal and the streams back.
    fn close(&mut self) {
        if let Some(ui) = self.ui.take() {
            // A view that panicked has given the terminal back while unwinding.
            drop(ui.join());
        }
        self.updates = None;
        self.waiting = None;
        self.capture.restore();
    }
}

impl Exporter for TopView {
    fn wants_stacks(&mut self) -> StacksWanted {
        let opened = self.opened.load(Ordering::Relaxed);
        self.stacks_asked = !self.no_stacks && opened != 0;
        if self.stacks_asked {
            StacksWanted::Process(opened)
        } else {
            StacksWanted::None
        }
    }

    fn sample(&mut self, model: &Model, sample: Sample) -> Result<()> {
        self.send(Update::Sample, model, Duration::from_micros(sample.ts_us));
        Ok(())
    }

    fn finish(&mut self, model: &Model, end: RunEnd) -> Result<()> {
        // Every stack has been read for the end of the run.
        self.stacks_asked = !self.no_stacks;
        self.send(Update::Ended, model, end.duration);
        self.close();
        Ok(())
    }
}

impl Drop for TopView {
    fn drop(&mut self) {
        // A run that failed: the view goes at once (its channel closes), and the error is said on
        // the terminal given back.
        self.updates = None;
        self.close();
    }
}
