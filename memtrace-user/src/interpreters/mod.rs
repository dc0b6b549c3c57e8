//! The interpreters whose frames memtrace reads beside the native ones, one folder each (python/:
//! CPython; perl/: Perl), each with its kernel side in memtrace-ebpf/src/interpreters/ and its
//! shared types in memtrace-common's interpreters/. The files beside them list them: a new
//! interpreter adds its folder and its line to each list (`LANGUAGES` and `InterpreterNames` here,
//! the two enums of image.rs, the matches of entries.rs).
//!
//! An interpreter's folder says which files are its interpreter and where a process keeps its
//! frames (its image.rs, which the process's facts ask through image.rs here), names its tables in
//! the kernel (its tables.rs, for kernel/interpreter_tables.rs), and names its frames from what the
//! kernel copied (its names.rs); frames.rs puts those frames among the native ones.

mod entries;
mod frames;
pub mod image;
mod language;
pub mod perl;
pub mod python;

use std::{collections::HashSet, sync::Arc};

use anyhow::Result;
use memtrace_common::{StackFrame, FRAME_PERL, FRAME_PYTHON};

pub use self::language::Language;
use self::{
    frames::{place, stored_frame},
    perl::PerlNames,
    python::PythonNames,
};
use crate::{kernel::Probes, model::frame::Frame};

/// Every interpreter memtrace reads.
pub const LANGUAGES: [Language; 2] = [python::LANGUAGE, perl::LANGUAGE];

/// The names of every traced process's interpreter frames.
#[derive(Default)]
pub struct InterpreterNames {
    python: PythonNames,
    perl: PerlNames,
}

impl InterpreterNames {
    /// Takes what the kernel copied since the last sample.
    pub fn drain(&mut self, probes: &Probes) -> Result<()> {
        self.python.drain(probes)?;
        self.perl.drain(probes)
    }

    /// Forgets the names of processes gone.
    pub fn forget(&mut self, tgids: &HashSet<u32>) {
        self.python.forget(tgids);
        self.perl.forget(tgids);
    }

    /// `native` (the stack's native frames, resolved) with the stack's interpreter frames where
    /// they ran.
    pub fn interleave(&self, tgid: u32, stack: &[StackFrame], native: Vec<Arc<Frame>>) -> Vec<Arc<Frame>> {
        let mut language = python::LANGUAGE;
        let interpreted: Vec<(Arc<Frame>, bool)> = stack
            .iter()
            .filter_map(|stored| {
                let (code, entry, kind, fingerprint, at) = stored_frame(stored);
                let frame = match stored.status {
                    FRAME_PYTHON => self.python.frame(tgid, code, fingerprint, at),
                    FRAME_PERL => {
                        language = perl::LANGUAGE;
                        self.perl.frame(tgid, code, fingerprint, kind, at)
                    }
                    _ => return None,
                };
                Some((Arc::new(frame), entry))
            })
            .collect();
        place(native, interpreted, language.loop_functions)
    }
}
