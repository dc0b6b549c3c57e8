//! Everything memtrace writes, behind one interface: each exporter sees every sample and the end.

pub mod flamegraph;
pub mod html;
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

use crate::model::{Model, RunEnd, Sample};

/// The exporters of the reports `outputs` names (pprof, flamegraph, Perfetto, HTML), each with its
/// file opened now, so that an unwritable path is said before anything is traced or read.
pub fn reports(outputs: &crate::plan::ReportFiles, top: usize) -> Result<Vec<Box<dyn Exporter>>> {
    let mut exporters: Vec<Box<dyn Exporter>> = Vec::new();
    if let Some(path) = &outputs.pprof {
        exporters.push(Box::new(pprof::PprofFile::create(path)?));
    }
    if let Some(path) = &outputs.flamegraph {
        exporters.push(Box::new(flamegraph::FlamegraphFile::create(path)?));
    }
    if let Some(path) = &outputs.perfetto {
        exporters.push(Box::new(perfetto::PerfettoFile::create(path)?));
    }
    if let Some(path) = &outputs.html {
        exporters.push(Box::new(html::HtmlFile::create(path, top)?));
    }
    Ok(exporters)
}

/// Whose call stacks an exporter wants read before a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StacksWanted {
    None,
    /// Every process not yet released.
    All,
    /// One process (the one `memtrace top` shows opened).
    Process(u32),
}

impl StacksWanted {
    /// What two exporters want, together.
    pub fn and(self, other: Self) -> Self {
        match (self, other) {
            (Self::None, wanted) | (wanted, Self::None) => wanted,
            (Self::Process(a), Self::Process(b)) if a == b => Self::Process(a),
            _ => Self::All,
        }
    }

    pub fn includes(self, pid: u32) -> bool {
        match self {
            Self::None => false,
            Self::All => true,
            Self::Process(wanted) => wanted == pid,
        }
    }
}

pub trait Exporter {
    /// Called after every sample with the model as of that moment.
    fn sample(&mut self, _model: &Model, _sample: Sample) -> Result<()> {
        Ok(())
    }

    /// Asked before each sample: whose call stacks should be read again for it (they are
    /// otherwise filled in at the end of the run, or when a process exits system-wide). `memtrace
    /// serve` asks for all when a heap profile has been requested since the last sample; `memtrace
    /// top` for the process it shows opened.
    fn wants_stacks(&mut self) -> StacksWanted {
        StacksWanted::None
    }

    /// Asked before each sample: whether the occupancy of the kernel's tables should be read for
    /// it (it takes a pass over every table; reading the stacks reads it too).
    fn wants_occupancy(&mut self) -> bool {
        false
    }

    /// Called once when the run ends, after the last sample.
    fn finish(&mut self, model: &Model, end: RunEnd) -> Result<()>;

    /// What to say on stderr once `finish` has written the output: "summary written to PATH".
    fn written(&self) -> Option<String> {
        None
    }
}
