//! Attaching the USDT handler at one probe site, with its semaphore.
//!
//! aya's uprobe attach cannot pass a semaphore (ref_ctr_offset), so memtrace opens the uprobe perf
//! event itself, with the semaphore's file offset in attr.config bits 32-63, and links the loaded
//! program to it with BPF_LINK_CREATE, carrying the BPF cookie. The kernel then raises the semaphore
//! in every traced process while the event exists and lowers it when the event goes: memtrace never
//! writes the target's memory. Both descriptors are owned, so however memtrace ends, the kernel
//! detaches the probe and lowers the semaphore.

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

use anyhow::{Context, Result};

const UPROBE_PMU_TYPE: &str = "/sys/bus/event_source/devices/uprobe/type";
/// attr.config bits 32-63 (/sys/bus/event_source/devices/uprobe/format/ref_ctr_offset).
const REF_CTR_OFFSET_SHIFT: u32 = 32;
/// PERF_ATTR_SIZE_VER1: the attribute up to config2, all a uprobe event needs.
const PERF_ATTR_SIZE: u32 = 72;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PERF_EVENT: u32 = 41;
/// perf_event_open(2): PERF_FLAG_FD_CLOEXEC.
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;

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
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    bpf_cookie: u64,
    /// The rest of the union, zero as the kernel requires.
    _unused: [u64; 10],
}

/// One attached probe site. Dropping it detaches the probe.
pub struct SiteLink {
    _link: OwnedFd,
    _event: OwnedFd,
}

/// Which processes a probe fires in.
#[derive(Debug, Clone, Copy)]
pub enum Scope {
    /// One process (and, through exec, what it becomes).
    Process(u32),
    /// Every process that maps the file, now or later (`--all`); the BPF side filters.
    AllProcesses,
}

fn uprobe_pmu_type() -> Result<u32> {
    static TYPE: OnceLock<Option<u32>> = OnceLock::new();
    TYPE.get_or_init(|| std::fs::read_to_string(UPROBE_PMU_TYPE).ok()?.trim().parse().ok())
        .with_context(|| format!("cannot read {UPROBE_PMU_TYPE}; this kernel has no uprobe perf events"))
}

/// Attaches `program` at `offset` in the file at `path` for `scope`, with `cookie` and, when the
/// site has one, its semaphore at file offset `semaphore_offset`.
pub fn attach_site(
    program: BorrowedFd<'_>,
    path: &Path,
    offset: u64,
    semaphore_offset: Option<u64>,
    scope: Scope,
    cookie: u64,
) -> Result<SiteLink> {
    let path_c = CString::new(path.as_os_str().as_bytes())
        .with_context(|| format!("{} contains a NUL byte", path.display()))?;
    let semaphore = semaphore_offset.unwrap_or(0);
    if semaphore >> (64 - REF_CTR_OFFSET_SHIFT) != 0 {
        anyhow::bail!("semaphore offset {semaphore:#x} does not fit the kernel's 32 bits");
    }
    let attr = PerfEventAttr {
        kind: uprobe_pmu_type()?,
        size: PERF_ATTR_SIZE,
        config: semaphore << REF_CTR_OFFSET_SHIFT,
        config1: path_c.as_ptr() as u64,
        config2: offset,
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
    if fd < 0 {
        let err = io::Error::last_os_error();
        return Err(err).with_context(|| {
            format!(
                "opening a uprobe at {}+{offset:#x} for {}{}",
                path.display(),
                match scope {
                    Scope::Process(pid) => format!("pid {pid}"),
                    Scope::AllProcesses => "every process".to_owned(),
                },
                if semaphore_offset.is_some() {
                    " with its semaphore (another tracer attached with a different semaphore?)"
                } else {
                    ""
                }
            )
        });
    }
    // SAFETY: a new descriptor that nothing else owns.
    let event = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let link_attr = LinkCreateAttr {
        prog_fd: program.as_raw_fd() as u32,
        target_fd: event.as_raw_fd() as u32,
        attach_type: BPF_PERF_EVENT,
        bpf_cookie: cookie,
        ..LinkCreateAttr::default()
    };
    // SAFETY: the attribute outlives the call and its size is passed along.
    let link = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_CREATE,
            &raw const link_attr,
            size_of::<LinkCreateAttr>() as u32,
        )
    };
    if link < 0 {
        return Err(io::Error::last_os_error()).with_context(|| {
            format!(
                "linking the USDT handler to the uprobe at {}+{offset:#x} (BPF_LINK_CREATE)",
                path.display()
            )
        });
    }
    // SAFETY: as above.
    let link = unsafe { OwnedFd::from_raw_fd(link as i32) };
    Ok(SiteLink { _link: link, _event: event })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attribute_layouts_match_the_kernel() {
        assert_eq!(size_of::<PerfEventAttr>(), PERF_ATTR_SIZE as usize);
        assert_eq!(std::mem::offset_of!(PerfEventAttr, config1), 56);
        assert_eq!(std::mem::offset_of!(PerfEventAttr, config2), 64);
        assert_eq!(std::mem::offset_of!(LinkCreateAttr, bpf_cookie), 16);
    }
}
