//! `--window`: the allocation-only probes of every allocator (malloc, calloc, the memalign family)
//! in links of their own, attached while a window is open and detached when it closes; free,
//! realloc and reallocarray stay in the run's other links. What the kernel side makes of it is
//! memtrace-ebpf/src/windowed.rs's to say; the order here is what it relies on: the generation
//! turns odd before a window's probes are attached, and even before they are detached.

use std::{fs::File, os::fd::AsRawFd, path::PathBuf};

use anyhow::{Context, Result};
use memtrace_common::WINDOW_SLOT;

use super::{
    links::{CallPrograms, Calls, Links, Scope, Site},
    map_ops::ArrayCell,
    tables,
};

/// One allocator file's windowed sites, kept to be attached again at every window.
pub(super) struct WindowedCalls {
    pub sites: WindowedSites,
    /// The file, held open: the path it was probed by may be a descriptor of the moment
    /// (/proc/self/fd/N for a file in a container), and a window attaches by `probe_path`, this
    /// descriptor's.
    _file: File,
    probe_path: PathBuf,
    /// The file as the process names it, for messages.
    pub path: PathBuf,
}

/// The windowed entry and return sites of one file, the programs they run, and for whom.
pub(super) struct WindowedSites {
    pub programs: CallPrograms,
    pub entries: Vec<Site>,
    pub returns: Vec<Site>,
    pub scope: Scope,
}

impl WindowedCalls {
    /// The sites of the file memtrace reaches at `host_path` (the process names it `path`).
    pub fn new(sites: WindowedSites, host_path: &std::path::Path, path: PathBuf) -> Result<Self> {
        let file = File::open(host_path).with_context(|| format!("opening {}", path.display()))?;
        let probe_path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        Ok(Self { sites, _file: file, probe_path, path })
    }

    pub fn borrowed(&self) -> Calls<'_> {
        let WindowedSites { programs, entries, returns, .. } = &self.sites;
        Calls { programs: *programs, path: &self.probe_path, entries, returns }
    }

    /// Whether the one process these calls were for has gone (its probes cannot be attached again).
    pub fn process_gone(&self) -> bool {
        match self.sites.scope {
            Scope::Process(pid) => !crate::process::procfs::is_running(pid),
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
