//! Opening a run's outputs, as its plan names them: the files first (an unwritable path is said
//! before anything is traced), then the live output of its mode (the agent, the live view, or a
//! progress line and the text report).

use anyhow::Result;

use crate::{
    export::{
        exporter::Exporter, progress::Progress, report::TextReport, summary::SummaryFile, trace::TraceFile,
    },
    plan::{Mode, Outputs},
    serve::Agent,
    top::TopView,
};

pub type Exporters = Vec<Box<dyn Exporter>>;

/// Every output of the run, opened; `stacks`: the run records call stacks.
pub fn open(outputs: &Outputs, mode: &Mode, stacks: bool) -> Result<Exporters> {
    let mut exporters: Exporters = Vec::new();
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
    Ok(exporters)
}
