//! The unwinder's tables in the kernel, which memtrace-ebpf/src/stacks.rs reads and
//! collect/unwind keeps current: one typed operation each, so that no code outside kernel/ writes
//! a map by its name. The layout is memtrace-common's (`UnwindFile`, `UnwindMappings`).

use anyhow::{Context, Result};
use aya::Ebpf;
use memtrace_common::{ImageKey, UnwindFile, UnwindMappings, UnwindRow};

use super::{
    tables::{UNWIND_EPOCH, UNWIND_FILES, UNWIND_FILE_SLOTS, UNWIND_MAPPINGS, UNWIND_PAGES, UNWIND_ROWS},
    Probes,
};

/// The unwinder's tables, borrowed from a run's probes.
pub struct UnwindTables<'a> {
    pub(super) ebpf: &'a mut Ebpf,
}

impl Probes {
    pub fn unwind_tables(&mut self) -> UnwindTables<'_> {
        UnwindTables { ebpf: &mut self.ebpf }
    }
}

impl UnwindTables<'_> {
    /// Writes `pid`'s mapping table; false where the map is full (or the process is gone): it
    /// keeps the frame-pointer walk.
    pub fn set_mappings(&mut self, pid: u32, mappings: &UnwindMappings) -> Result<bool> {
        Ok(UNWIND_MAPPINGS.writable(self.ebpf)?.insert(pid, mappings, 0).is_ok())
    }

    /// Forgets the mapping tables of processes that are gone (their interpreters' entries are
    /// forgotten through interpreter_tables.rs).
    pub fn forget(&mut self, gone: impl IntoIterator<Item = u32>) -> Result<()> {
        let mut mappings = UNWIND_MAPPINGS.writable(self.ebpf)?;
        for pid in gone {
            let _ = mappings.remove(&pid);
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
