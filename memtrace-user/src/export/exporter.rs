//! The interface every exporter implements (each sees every sample and the end), and whose call
//! stacks they want read before a sample; and the one shell of the outputs written whole into a
//! file at the end (`WholeFile`: pprof, OTLP, flamegraph, Perfetto).

use std::{fs::File, marker::PhantomData, path::Path};

use anyhow::Result;

use super::output_file::OutputFile;
use crate::model::{Model, RunEnd, Sample};

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

/// An output written whole at the end of a run into the one file an option names.
pub trait WholeFile {
    /// The output as errors name it: "pprof profile".
    const WHAT: &'static str;
    /// The option that names its file: "--pprof".
    const OPTION: &'static str;

    /// What memtrace says once it is written.
    fn written(path: &Path) -> String {
        format!("{} written to {}", Self::WHAT, path.display())
    }

    /// Writes the output of `model`, as the run ended, into `file`.
    fn write(model: &Model, end: RunEnd, file: &mut File) -> Result<()>;
}

/// The exporter of a [`WholeFile`] output: its file opened when the run is planned (an unwritable
/// path is said before anything is traced), written and put in place at the end.
pub struct WholeFileExporter<W> {
    file: OutputFile,
    output: PhantomData<W>,
}

impl<W: WholeFile> WholeFileExporter<W> {
    pub fn create(path: &Path) -> Result<Self> {
        Ok(Self { file: OutputFile::create(path, W::WHAT, W::OPTION)?, output: PhantomData })
    }
}

impl<W: WholeFile> Exporter for WholeFileExporter<W> {
    fn written(&self) -> Option<String> {
        Some(W::written(self.file.path()))
    }

    fn finish(&mut self, model: &Model, end: RunEnd) -> Result<()> {
        self.file.commit(|file| {
            W::write(model, end, file).map_err(|err| std::io::Error::other(err.into_boxed_dyn_error()))
        })
    }
}
