//! Links that attach a loaded program at probe sites of one file.
//!
//! Where the kernel has uprobe_multi (6.6+), one link carries every site of a file, each with its
//! BPF cookie and, for a USDT site, its semaphore (ref_ctr_offset): the program is in place at a
//! site before the kernel raises the site's semaphore, and the whole link detaches in one grace
//! period. Elsewhere each site is a uprobe perf event that memtrace opens itself (aya cannot pass a
//! semaphore) and links with BPF_LINK_CREATE; there the semaphore rises when the event opens, a
//! moment before the program is linked. Either way the kernel maintains the semaphores (memtrace
//! never writes the target's memory) and every link is a descriptor memtrace owns: however memtrace
//! ends, the kernel detaches the probes and lowers the semaphores.

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::Path,
    sync::OnceLock,
};

use anyhow::{bail, Context, Result};

use crate::{
    kernel::features::{LinkKind, UPROBE_PMU_TYPE},
    kernel::sys::{bpf, uprobe_multi_link, UprobeMulti, BPF_LINK_CREATE},
};

/// attr.config bits 32-63 (/sys/bus/event_source/devices/uprobe/format/ref_ctr_offset).
const REF_CTR_OFFSET_SHIFT: u32 = 32;
/// attr.config bit 0 (/sys/bus/event_source/devices/uprobe/format/retprobe).
const RETPROBE_BIT: u64 = 1;
/// PERF_ATTR_SIZE_VER1: the attribute up to config2, all a uprobe event needs.
const PERF_ATTR_SIZE: u32 = 72;
const BPF_PERF_EVENT: u32 = 41;
/// perf_event_open(2): PERF_FLAG_FD_CLOEXEC.
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;

/// One place a program runs: a file offset, the BPF cookie the program reads there, and the USDT
/// semaphore's file offset when the site has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Site {
    pub offset: u64,
    pub cookie: u64,
    pub semaphore: Option<u64>,
}

/// The programs a file's call probes run: at entry and at return.
#[derive(Clone, Copy)]
pub struct CallPrograms {
    pub entry: &'static str,
    pub exit: &'static str,
}

/// One file's call probes: its sites at entry and at return, and the programs they run.
pub struct Calls<'a> {
    pub programs: CallPrograms,
    pub path: &'a Path,
    pub entries: &'a [Site],
    pub returns: &'a [Site],
}

/// Which processes a probe fires in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    /// One process (and, through exec, what it becomes).
    Process(u32),
    /// Every process that maps the file, now or later (`--all`); the BPF side filters.
    AllProcesses,
}

/// Whether the program runs when the probed function is entered or when it returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Entry,
    Return,
}

/// Attached sites; dropping it detaches them.
#[derive(Default)]
pub struct Links {
    /// Each link (and perf event), with the scope it was attached for.
    descriptors: Vec<(Scope, OwnedFd)>,
    /// Threads closing the links of scopes detached earlier.
    closing: Vec<std::thread::JoinHandle<()>>,
}

impl Links {
    /// Attaches `program` at `sites` of the file at `path`.
    pub fn attach(
        &mut self,
        kind: LinkKind,
        program: BorrowedFd<'_>,
        path: &Path,
        sites: &[Site],
        scope: Scope,
        direction: Direction,
    ) -> Result<()> {
        if sites.is_empty() {
            return Ok(());
        }
        let path_c = CString::new(path.as_os_str().as_bytes())
            .with_context(|| format!("{} contains a NUL byte", path.display()))?;
        match kind {
            LinkKind::Multi => {
                let link = attach_multi(program, &path_c, sites, scope, direction)
                    .with_context(|| describe(path, sites, scope))?;
                self.descriptors.push((scope, link));
            }
            LinkKind::PerfEvent => {
                for site in sites {
                    let event = open_uprobe_event(&path_c, site, scope, direction)
                        .with_context(|| describe(path, std::slice::from_ref(site), scope))?;
                    let link = link_perf_event(program, &event, site.cookie).with_context(|| {
                        format!("linking a program to the uprobe at {}+{:#x}", path.display(), site.offset)
                    })?;
                    self.descriptors.extend([(scope, link), (scope, event)]);
                }
            }
        }
        Ok(())
    }

    /// Detaches everything at once, and waits for the links detached earlier to be gone.
    pub fn detach(&mut self) {
        let descriptors = std::mem::take(&mut self.descriptors).into_iter().map(|(_, fd)| fd).collect();
        detach_all(descriptors);
        for closing in std::mem::take(&mut self.closing) {
            let _ = closing.join();
        }
    }

    /// Detaches the links attached for `scope` alone, on a thread of their own: each close waits
    /// for RCU grace periods (10-30 ms each here), which the main loop, and the processes held
    /// until it answers, must not wait for.
    pub fn detach_scope(&mut self, scope: Scope) {
        let (gone, kept) =
            std::mem::take(&mut self.descriptors).into_iter().partition(|(of, _)| *of == scope);
        self.descriptors = kept;
        let gone: Vec<OwnedFd> = gone.into_iter().map(|(_, fd)| fd).collect();
        if gone.is_empty() {
            return;
        }
        self.closing.retain(|closing| !closing.is_finished());
        // Where no thread can be started, the descriptors went with the closure: closed here.
        if let Ok(closing) =
            std::thread::Builder::new().name("link-closer".into()).spawn(move || detach_all(gone))
        {
            self.closing.push(closing);
        }
    }
}

/// Closes `descriptors`, each on a thread of its own (at most `CLOSERS` at once): each close
/// waits for RCU grace periods, and closes made together share them.
fn detach_all(descriptors: Vec<OwnedFd>) {
    const CLOSERS: usize = 64;
    if descriptors.len() <= 1 {
        return drop(descriptors);
    }
    let per_thread = descriptors.len().div_ceil(CLOSERS);
    let mut descriptors = descriptors.into_iter();
    std::thread::scope(|scope| loop {
        let chunk: Vec<OwnedFd> = descriptors.by_ref().take(per_thread).collect();
        if chunk.is_empty() {
            break;
        }
        scope.spawn(move || drop(chunk));
    });
}

impl Drop for Links {
    fn drop(&mut self) {
        self.detach();
    }
}

fn describe(path: &Path, sites: &[Site], scope: Scope) -> String {
    let whom = match scope {
        Scope::Process(pid) => format!("pid {pid}"),
        Scope::AllProcesses => "every process".to_owned(),
    };
    let semaphore = if sites.iter().any(|site| site.semaphore.is_some()) {
        " with semaphores (another tracer attached with a different semaphore?)"
    } else {
        ""
    };
    match sites {
        [site] => {
            format!("attaching a uprobe at {}+{:#x} for {whom}{semaphore}", path.display(), site.offset)
        }
        _ => format!("attaching {} uprobes in {} for {whom}{semaphore}", sites.len(), path.display()),
    }
}

fn attach_multi(
    program: BorrowedFd<'_>,
    path: &CString,
    sites: &[Site],
    scope: Scope,
    direction: Direction,
) -> io::Result<OwnedFd> {
    let offsets: Vec<u64> = sites.iter().map(|site| site.offset).collect();
    let cookies: Vec<u64> = sites.iter().map(|site| site.cookie).collect();
    let semaphores: Vec<u64> = sites.iter().map(|site| site.semaphore.unwrap_or(0)).collect();
    let has_semaphores = semaphores.iter().any(|&offset| offset != 0);
    let link = UprobeMulti {
        path,
        offsets: &offsets,
        cookies: &cookies,
        ref_ctr_offsets: if has_semaphores { &semaphores } else { &[] },
        pid: match scope {
            Scope::Process(pid) => pid,
            Scope::AllProcesses => 0,
        },
        returns: direction == Direction::Return,
    };
    uprobe_multi_link(program, &link)
}

/// The leading fields of `struct perf_event_attr`, in kernel layout.
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    /// uprobe_path: a pointer to the file's path.
    config1: u64,
    /// probe_offset: the file offset of the probe.
    config2: u64,
}

/// `union bpf_attr` for BPF_LINK_CREATE with a perf event target.
#[repr(C)]
#[derive(Default)]
struct PerfLinkAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    bpf_cookie: u64,
    /// The rest of the union, zero as the kernel requires.
    _unused: [u64; 10],
}

fn uprobe_pmu_type() -> Result<u32> {
    static TYPE: OnceLock<Option<u32>> = OnceLock::new();
    TYPE.get_or_init(|| std::fs::read_to_string(UPROBE_PMU_TYPE).ok()?.trim().parse().ok())
        .with_context(|| format!("cannot read {UPROBE_PMU_TYPE}; this kernel has no uprobe perf events"))
}

fn open_uprobe_event(path: &CString, site: &Site, scope: Scope, direction: Direction) -> Result<OwnedFd> {
    let semaphore = site.semaphore.unwrap_or(0);
    if semaphore >> (64 - REF_CTR_OFFSET_SHIFT) != 0 {
        bail!("semaphore offset {semaphore:#x} does not fit the kernel's 32 bits");
    }
    let retprobe = if direction == Direction::Return { RETPROBE_BIT } else { 0 };
    let attr = PerfEventAttr {
        kind: uprobe_pmu_type()?,
        size: PERF_ATTR_SIZE,
        config: semaphore << REF_CTR_OFFSET_SHIFT | retprobe,
        config1: path.as_ptr() as u64,
        config2: site.offset,
        ..PerfEventAttr::default()
    };
    // A uprobe event for every process is opened on one CPU (as aya does): the kernel runs the
    // program wherever the probe is hit.
    let (pid, cpu) = match scope {
        Scope::Process(pid) => (pid as libc::pid_t, -1),
        Scope::AllProcesses => (-1, 0),
    };
    // SAFETY: the attribute and the path it points to outlive the call; the result is a new fd.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &raw const attr,
            pid,
            cpu as libc::c_int,
            -1 as libc::c_int,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    owned(fd)
}

fn link_perf_event(program: BorrowedFd<'_>, event: &OwnedFd, cookie: u64) -> Result<OwnedFd> {
    let attr = PerfLinkAttr {
        prog_fd: program.as_raw_fd() as u32,
        target_fd: event.as_raw_fd() as u32,
        attach_type: BPF_PERF_EVENT,
        bpf_cookie: cookie,
        ..PerfLinkAttr::default()
    };
    // SAFETY: the attribute outlives the call and its size is passed along.
    Ok(unsafe { bpf(BPF_LINK_CREATE, std::ptr::from_ref(&attr).cast(), size_of::<PerfLinkAttr>()) }?)
}

/// A syscall's new descriptor, or its error.
fn owned(fd: libc::c_long) -> Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::last_os_error().into());
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attribute_layouts_match_the_kernel() {
        assert_eq!(size_of::<PerfEventAttr>(), PERF_ATTR_SIZE as usize);
        assert_eq!(std::mem::offset_of!(PerfEventAttr, config1), 56);
        assert_eq!(std::mem::offset_of!(PerfEventAttr, config2), 64);
        assert_eq!(std::mem::offset_of!(PerfLinkAttr, bpf_cookie), 16);
    }
}
