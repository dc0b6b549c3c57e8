//! `--window`: the allocation-only probes of every allocator (malloc, calloc, the memalign family)
//! in links of their own, attached while a window is open and detached when it closes; free,
//! realloc and reallocarray stay in the run's other links. What the kernel side makes of it is
//! memtrace-ebpf/src/windowed.rs's to say; the order here is what it relies on: the generation
//! turns odd before a window's probes are attached, and even before they are detached.

use std::path::PathBuf;

use anyhow::Result;
use memtrace_common::WINDOW_SLOT;

use super::{links::Links, map_ops::ArrayCell, tables, CallPrograms, Calls, Scope, Site};

/// One allocator file's windowed sites, kept to be attached again at every window.
pub(super) struct WindowedCalls {
    pub programs: CallPrograms,
    pub path: PathBuf,
    pub entries: Vec<Site>,
    pub returns: Vec<Site>,
    pub scope: Scope,
}

impl WindowedCalls {
    pub fn borrowed(&self) -> Calls<'_> {
        Calls { programs: self.programs, path: &self.path, entries: &self.entries, returns: &self.returns }
    }

    /// Whether the one process these calls were for has gone (its probes cannot be attached again).
    pub fn process_gone(&self) -> bool {
        match self.scope {
            Scope::Process(pid) => !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            Scope::AllProcesses => false,
        }
    }
}

pub(super) struct Windows {
    generation: ArrayCell,
    count: u32,
    /// The windowed probes while a window is open; empty between windows.
    pub links: Links,
    pub calls: Vec<WindowedCalls>,
}

impl Windows {
    /// The first window is open from the start: the allocators attached as the run begins get
    /// their windowed probes at once.
    pub fn open_first(ebpf: &aya::Ebpf) -> Result<Self> {
        let generation = tables::WINDOW_GENERATION.cell(ebpf, WINDOW_SLOT)?;
        let mut windows = Self { generation, count: 0, links: Links::default(), calls: Vec::new() };
        windows.advance()?;
        Ok(windows)
    }

    pub fn is_open(&self) -> bool {
        self.count % 2 == 1
    }

    /// The next generation: a window opens (odd) or has closed (even).
    pub fn advance(&mut self) -> Result<()> {
        self.count = self.count.wrapping_add(1);
        self.generation.set(self.count)?;
        Ok(())
    }
}
