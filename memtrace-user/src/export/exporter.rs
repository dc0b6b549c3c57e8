//! The interface every exporter implements (each sees every sample and the end), and whose call
//! stacks they want read before a sample.

use anyhow::Result;

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
