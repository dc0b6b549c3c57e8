//! The unwinder's tables in the kernel, which memtrace-ebpf/src/stacks.rs reads and
//! collect/unwind keeps current: one typed operation each, so that no code outside kernel/ writes
//! a map by its name. The layout is memtrace-common's (`UnwindFile`, `UnwindMappings`).

use anyhow::{Context, Result};
use aya::Ebpf;
use memtrace_common::{
    interpreter, ImageKey, PerlProcess, PythonProcess, UnwindFile, UnwindMappings, UnwindRow,
};

use super::{
    tables::{
        PERL_PROCESSES, PYTHON_PROCESSES, UNWIND_EPOCH, UNWIND_FILES, UNWIND_FILE_SLOTS, UNWIND_MAPPINGS,
        UNWIND_PAGES, UNWIND_ROWS,
    },
    Probes,
};

/// The unwinder's tables, borrowed from a run's probes.
pub struct UnwindTables<'a> {
    ebpf: &'a mut Ebpf,
}

impl Probes {
    pub fn unwind_tables(&mut self) -> UnwindTables<'_> {
        UnwindTables { ebpf: &mut self.ebpf }
    }
}

/// A process's interpreter, whose frames the kernel reads beside the native ones.
#[derive(Debug, Clone, Copy)]
pub enum InterpreterTable {
    Python(PythonProcess),
    Perl(PerlProcess),
}

impl UnwindTables<'_> {
    /// Writes `pid`'s mapping table; false where the map is full (or the process is gone): it
    /// keeps the frame-pointer walk.
    pub fn set_mappings(&mut self, pid: u32, mappings: &UnwindMappings) -> Result<bool> {
        Ok(UNWIND_MAPPINGS.writable(self.ebpf)?.insert(pid, mappings, 0).is_ok())
    }

    /// Tells the kernel where `pid`'s interpreter keeps its frames; false where the map is full.
    /// Written before the mapping table that has the kernel read it.
    pub fn set_interpreter(&mut self, pid: u32, interpreter: InterpreterTable) -> Result<bool> {
        Ok(match interpreter {
            InterpreterTable::Python(python) => PYTHON_PROCESSES.writable(self.ebpf)?.insert(pid, python, 0),
            InterpreterTable::Perl(perl) => PERL_PROCESSES.writable(self.ebpf)?.insert(pid, perl, 0),
        }
        .is_ok())
    }

    /// Forgets the tables of processes that are gone, each `(pid, interpreter)`: its mapping
    /// table, and its interpreter's entry where it had one (`interpreter::PYTHON`, `PERL`).
    pub fn forget(&mut self, gone: &[(u32, u32)]) -> Result<()> {
        for &(pid, kind) in gone {
            let _ = match kind {
                interpreter::PYTHON => PYTHON_PROCESSES.writable(self.ebpf)?.remove(&pid),
                interpreter::PERL => PERL_PROCESSES.writable(self.ebpf)?.remove(&pid),
                _ => continue,
            };
        }
        let mut mappings = UNWIND_MAPPINGS.writable(self.ebpf)?;
        for (pid, _) in gone {
            let _ = mappings.remove(pid);
        }
        Ok(())
    }

    /// Sets the tables' epoch, after they changed: the kernel's memos of past walks hold only
    /// within one.
    pub fn set_epoch(&mut self, epoch: u64) -> Result<()> {
        UNWIND_EPOCH.set(self.ebpf, 0, &epoch).context("bumping the unwind tables' epoch")
    }

    /// A file slot as the kernel has it.
    pub fn file(&self, slot: u32) -> Result<UnwindFile> {
        UNWIND_FILES.get(self.ebpf, slot).context("reading an unwind file slot")
    }

    pub fn set_file(&mut self, slot: u32, file: &UnwindFile) -> Result<()> {
        UNWIND_FILES.set(self.ebpf, slot, file).context("writing an unwind file slot")
    }

    /// The kernel's way from a mapping of a file (its `keys`) to its slot, for processes that
    /// have no mapping table yet. A full map leaves the file to the mapping tables.
    pub fn set_file_keys(&mut self, keys: &[ImageKey], slot: u32) -> Result<()> {
        let mut file_slots = UNWIND_FILE_SLOTS.writable(self.ebpf)?;
        for key in keys {
            let _ = file_slots.insert(key, slot, 0);
        }
        Ok(())
    }

    /// Writes a file's rows and pages into the shared arrays, from `first_row` and `first_page`.
    pub fn set_table(
        &mut self,
        (first_row, rows): (u32, &[UnwindRow]),
        (first_page, pages): (u32, &[u32]),
    ) -> Result<()> {
        UNWIND_ROWS.set_many(self.ebpf, first_row, rows)?;
        UNWIND_PAGES.set_many(self.ebpf, first_page, pages)
    }
}
