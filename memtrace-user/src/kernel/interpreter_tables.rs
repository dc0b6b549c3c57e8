//! The kernel's two tables of each interpreter whose frames it reads (memtrace-ebpf/src/
//! interpreters/): a process's entry, which says where its interpreter keeps its frames and is
//! written beside its mapping table, and the names of code the kernel copies the first time a
//! stack holds it. An interpreter names its two maps (declared in tables.rs) by implementing
//! [`InterpreterTables`] in its own folder (memtrace-user/src/interpreters/); the operations here
//! are the same for every one.

use anyhow::Result;
use aya::Pod;
use memtrace_common::InterpreterCodeKey;

use super::{tables::Table, unwind_tables::UnwindTables, Probes};

/// One interpreter's tables in the kernel, and their value types.
pub trait InterpreterTables {
    /// What the kernel reads of a process (`PythonProcess`, `PerlProcess`).
    type Process: Pod;
    /// What the kernel copies of a frame's code (`PythonCode`, `PerlSub`).
    type Code: Pod;
    /// The processes' entries, by tgid.
    const PROCESSES: Table<u32, Self::Process>;
    /// The code names copied, by process and code.
    const CODES: Table<InterpreterCodeKey, Self::Code>;
    /// Whether the kernel has written all of `code` (it sets a `complete` word last).
    fn complete(code: &Self::Code) -> bool;
}

impl UnwindTables<'_> {
    /// Tells the kernel where `pid`'s interpreter keeps its frames; false where the map is full.
    /// Written before the mapping table that has the kernel read it.
    pub fn set_interpreter<I: InterpreterTables>(&mut self, pid: u32, process: &I::Process) -> Result<bool> {
        Ok(I::PROCESSES.writable(self.ebpf)?.insert(pid, process, 0).is_ok())
    }

    /// Forgets the interpreter entry of `pid`, which is gone (an entry already gone is no error).
    pub fn forget_interpreter<I: InterpreterTables>(&mut self, pid: u32) -> Result<()> {
        let _ = I::PROCESSES.writable(self.ebpf)?.remove(&pid);
        Ok(())
    }
}

impl Probes {
    /// Takes the code names of interpreter `I` the kernel copied whole since the last call.
    pub fn take_codes<I: InterpreterTables>(&self) -> Result<Vec<(InterpreterCodeKey, I::Code)>> {
        Ok(I::CODES.take(&self.ebpf, |_, code| I::complete(code))?.taken)
    }
}
