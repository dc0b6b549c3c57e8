//! A process's interpreter entry written to, and forgotten from, its interpreter's table in the
//! kernel (kernel/interpreter_tables.rs), each interpreter's by its own tables.rs.

use anyhow::Result;
use memtrace_common::ThreadKeys;

use super::{
    image::InterpreterProcess,
    perl::{self, Perl},
    python::Python,
};
use crate::kernel::unwind_tables::UnwindTables;

impl InterpreterProcess {
    /// Tells the kernel where process `pid` keeps its frames (`thread_keys`: its C library's, where
    /// known); false where the table is full. Written before the mapping table that has the kernel
    /// read it.
    pub fn write(
        &self,
        tables: &mut UnwindTables<'_>,
        pid: u32,
        thread_keys: Option<ThreadKeys>,
    ) -> Result<bool> {
        match self {
            Self::Python(python) => tables.set_interpreter::<Python>(pid, python),
            Self::Perl(perl) => {
                tables.set_interpreter::<Perl>(pid, &perl::with_thread_keys(*perl, thread_keys))
            }
        }
    }

    /// Forgets the entry of process `pid`, which is gone.
    pub fn forget(&self, tables: &mut UnwindTables<'_>, pid: u32) -> Result<()> {
        match self {
            Self::Python(_) => tables.forget_interpreter::<Python>(pid),
            Self::Perl(_) => tables.forget_interpreter::<Perl>(pid),
        }
    }
}
