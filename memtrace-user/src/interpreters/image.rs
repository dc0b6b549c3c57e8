//! Which interpreter a file is, and what the kernel reads of it in a process that maps it: each
//! interpreter's own image.rs, listed.

use memtrace_common::{interpreter, PerlProcess, PythonProcess};

use super::{perl::image::PerlImage, python::image::PythonImage};
use crate::process::elf::ElfObject;

/// An interpreter's file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Interpreter {
    Python(PythonImage),
    Perl(PerlImage),
}

/// What the kernel reads of a process's interpreter (its entry in the interpreter's table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InterpreterProcess {
    Python(PythonProcess),
    Perl(PerlProcess),
}

impl Interpreter {
    /// The interpreter `elf` is, if one.
    pub fn of(elf: &ElfObject<'_>) -> Option<Self> {
        PythonImage::of(elf).map(Self::Python).or_else(|| PerlImage::of(elf).map(Self::Perl))
    }

    /// What the kernel reads in a process that maps this file at `start` from `file_offset`;
    /// None for a version memtrace cannot read.
    pub fn in_process(&self, start: u64, file_offset: u64) -> Option<InterpreterProcess> {
        match self {
            Self::Python(image) => image.in_process(start, file_offset).map(InterpreterProcess::Python),
            Self::Perl(image) => image.in_process(start, file_offset).map(InterpreterProcess::Perl),
        }
    }
}

impl InterpreterProcess {
    /// `UnwindMappings::interpreter` for it.
    pub fn kind(&self) -> u32 {
        match self {
            Self::Python(_) => interpreter::PYTHON,
            Self::Perl(_) => interpreter::PERL,
        }
    }
}
