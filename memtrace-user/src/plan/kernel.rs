//! The kernel's facts for a run, found once before anything is loaded: its features (probed by
//! crate::kernel::features), how probe sites are linked, and where its structs keep what the BPF
//! programs read (from BTF).

use std::path::Path;

use anyhow::Result;
use memtrace_common::KernelLayout;

use crate::{
    kernel::features::{KernelFeatures, LinkKind, VMLINUX_BTF},
    kernel::{self, Reach},
};

pub struct Kernel {
    pub features: KernelFeatures,
    /// uprobe_multi links, or a perf event per site (older kernels, or MEMTRACE_LINKS=perf).
    pub link_kind: LinkKind,
    /// The struct offsets, or why BTF could not give them to a run that follows a tree.
    layout: Result<KernelLayout, String>,
}

impl Kernel {
    /// The facts a run with `reach` needs; fails on a MEMTRACE_LINKS the loader does not know.
    pub fn resolve(features: KernelFeatures, reach: &Reach) -> Result<Self> {
        let link_kind = kernel::link_kind_for(&features)?;
        // A forked child's process id and an exiting process's memory are read from the kernel's
        // structs; only following a tree cannot do without.
        let layout = match kernel::kernel_layout(Path::new(VMLINUX_BTF)) {
            Ok(layout) => Ok(kernel::with_per_cpu_sums(layout)),
            Err(err) if matches!(reach, Reach::Tree) => Err(format!("{err:#}")),
            Err(_) => Ok(KernelLayout::default()),
        };
        Ok(Self { features, link_kind, layout })
    }

    /// Where the kernel's structs keep what the BPF programs read; the error is said when the
    /// probes load, after the kernel's features were checked (which name a missing BTF first).
    pub fn layout(&self) -> Result<KernelLayout> {
        self.layout.clone().map_err(anyhow::Error::msg)
    }
}
