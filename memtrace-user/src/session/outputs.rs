//! A run's outputs: opened as its plan names them, the files first (an unwritable path is said
//! before anything is traced), then the live output of its mode (the agent, the live view, or a
//! progress line and the text report); each handed the model at every sample and at the end. One
//! that fails is said, dropped, and counted: the run ends and its exit code says so.

use anyhow::Result;

use crate::{
    export::{
        exporter::{Exporter, StacksWanted},
        progress::Progress,
        report::TextReport,
        summary::SummaryFile,
        trace::TraceFile,
    },
    model::{Model, RunEnd, Sample},
    plan::{Mode, Outputs},
    serve::Agent,
    top::TopView,
};

pub struct Exporters {
    exporters: Vec<Box<dyn Exporter>>,
    /// Outputs that could not be written (each said when it failed).
    failed: usize,
}

impl Exporters {
    /// Every output of the run, opened; `stacks`: the run records call stacks.
    pub fn open(outputs: &Outputs, mode: &Mode, stacks: bool) -> Result<Self> {
        let mut exporters: Vec<Box<dyn Exporter>> = Vec::new();
        if let Some(path) = &outputs.trace {
            let trace = TraceFile::create(path)?.with_heap_subsystems(outputs.heap_subsystems.clone());
            exporters.push(Box::new(trace));
        }
        if let Some(path) = &outputs.summary {
            exporters.push(Box::new(SummaryFile::create(path, outputs.top)?));
        }
        exporters.extend(crate::export::reports(&outputs.reports, outputs.top)?);
        match mode {
            Mode::Serve(options) => exporters.push(Box::new(Agent::start(options)?)),
            // After the files, so they are written before the view holds the final figures.
            Mode::Top => exporters.push(Box::new(TopView::start(!stacks)?)),
            Mode::Trace => {
                if let Some(progress) = Progress::on_terminal() {
                    // First, so the line is cleared before any output says it is written.
                    exporters.insert(0, Box::new(progress));
                }
            }
        }
        if !matches!(mode, Mode::Serve(_)) {
            exporters.push(Box::new(TextReport { top: outputs.top }));
        }
        Ok(Self { exporters, failed: 0 })
    }

    /// Whose call stacks the outputs want read before this sample, and whether they want how full
    /// the kernel's tables are (always, where they want stacks). Every exporter is asked (no short
    /// cut): each learns that its request is being served.
    pub fn wanted(&mut self) -> (StacksWanted, bool) {
        let stacks = self
            .exporters
            .iter_mut()
            .fold(StacksWanted::None, |wanted, exporter| wanted.and(exporter.wants_stacks()));
        let occupancy = self
            .exporters
            .iter_mut()
            .fold(stacks != StacksWanted::None, |wanted, exporter| exporter.wants_occupancy() | wanted);
        (stacks, occupancy)
    }

    /// Hands `model` to every output; one that fails is said and dropped.
    pub fn sample(&mut self, model: &Model, sample: Sample) {
        let mut index = 0;
        while index < self.exporters.len() {
            match self.exporters[index].sample(model, sample) {
                Ok(()) => index += 1,
                Err(err) => {
                    eprintln!("memtrace: error: {err:#}");
                    // Its file stays as it was: a trace cut short still loads.
                    self.exporters.remove(index);
                    self.failed += 1;
                }
            }
        }
    }

    /// Writes every output that can still be written: one failure does not stop the others.
    pub fn finish(&mut self, model: &Model, end: RunEnd) {
        for exporter in &mut self.exporters {
            match exporter.finish(model, end) {
                Ok(()) => {
                    if let Some(written) = exporter.written() {
                        eprintln!("memtrace: {written}");
                    }
                }
                Err(err) => {
                    eprintln!("memtrace: error: {err:#}");
                    self.failed += 1;
                }
            }
        }
    }

    /// Whether an output could not be written (every failure was said when it happened).
    pub fn failed(&self) -> bool {
        self.failed > 0
    }
}
