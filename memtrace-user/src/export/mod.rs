//! Everything memtrace writes, behind one interface (`exporter`): each exporter sees every sample
//! and the end. `reports` opens the report files the command line names.

pub mod exporter;
pub mod flamegraph;
pub mod format;
pub mod heap_profile;
pub mod html;
pub mod otlp;
pub mod output_file;
pub mod perfetto;
mod perfetto_proto;
pub mod pprof;
pub mod progress;
pub mod report;
pub mod saved;
pub mod summary;
pub mod trace;

use anyhow::Result;

use exporter::{Exporter, WholeFileExporter};

/// The exporters of the reports `outputs` names (pprof, flamegraph, Perfetto, HTML, OTLP), each with its
/// file opened now, so that an unwritable path is said before anything is traced or read.
pub fn reports(outputs: &crate::plan::ReportFiles, top: usize) -> Result<Vec<Box<dyn Exporter>>> {
    let mut exporters: Vec<Box<dyn Exporter>> = Vec::new();
    if let Some(path) = &outputs.pprof {
        exporters.push(Box::new(WholeFileExporter::<pprof::Pprof>::create(path)?));
    }
    if let Some(path) = &outputs.flamegraph {
        exporters.push(Box::new(WholeFileExporter::<flamegraph::Flamegraph>::create(path)?));
    }
    if let Some(path) = &outputs.perfetto {
        exporters.push(Box::new(WholeFileExporter::<perfetto::Perfetto>::create(path)?));
    }
    if let Some(path) = &outputs.html {
        exporters.push(Box::new(html::HtmlFile::create(path, top)?));
    }
    if let Some(path) = &outputs.otlp {
        exporters.push(Box::new(WholeFileExporter::<otlp::Otlp>::create(path)?));
    }
    Ok(exporters)
}
