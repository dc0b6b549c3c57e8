//! What tracing asks of the kernel, and which capability grants each (measured on Linux 6.18 with
//! `setpriv --ambient-caps`, as uid 65534):
//!
//! - bpf(2) to create maps and load the programs: CAP_BPF, and CAP_PERFMON for tracing program
//!   types (uprobe, raw tracepoint). CAP_SYS_ADMIN grants both.
//! - perf_event_open(2) on the uprobe PMU, which is how every allocator probe and USDT site is
//!   attached: CAP_SYS_ADMIN. Linux 5.8 let CAP_PERFMON open uprobe events; the kernel now asks for
//!   CAP_SYS_ADMIN again in perf_uprobe_event_init (a uprobe placed inside an instruction corrupts
//!   the traced program), and with only CAP_BPF + CAP_PERFMON the call fails with EACCES. A
//!   BPF_LINK_CREATE of a uprobe_multi link needs only CAP_BPF + CAP_PERFMON.
//! - /proc/PID/exe, /proc/PID/root and /proc/PID/maps of a process of another user (or one with
//!   capabilities memtrace lacks): CAP_SYS_PTRACE (ptrace access mode READ_FSCREDS).
//! - kill(2) with SIGCONT, which continues a process stopped at exec (follow::hold), for a process
//!   of another user outside memtrace's session: CAP_KILL.

use std::path::Path;

use anyhow::{bail, Result};

use crate::{kernel::features::LinkKind, plan::Targets};

/// One capability, with the reason memtrace needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Capability {
    bit: u32,
    name: &'static str,
    why: &'static str,
}

const CAP_BPF: Capability =
    Capability { bit: 39, name: "CAP_BPF", why: "bpf(2) creates the maps and loads the programs" };
const CAP_PERFMON: Capability =
    Capability { bit: 38, name: "CAP_PERFMON", why: "bpf(2) loads tracing programs (uprobes, tracepoints)" };
const CAP_SYS_ADMIN: Capability = Capability {
    bit: 21,
    name: "CAP_SYS_ADMIN",
    why: "perf_event_open(2) of a uprobe, which attaches each allocator probe and USDT site",
};
const CAP_SYS_PTRACE: Capability = Capability {
    bit: 19,
    name: "CAP_SYS_PTRACE",
    why: "reading /proc/PID/exe, root and maps of processes of other users",
};

const CAP_KILL: Capability = Capability {
    bit: 5,
    name: "CAP_KILL",
    why: "continuing (SIGCONT) the processes of other users that --all stops at exec",
};

/// Whether memtrace may continue any process it stops at exec; says why not, and what that misses.
pub fn can_continue_others() -> Result<(), String> {
    match has(effective(), CAP_KILL) {
        true => Ok(()),
        false => Err(format!("holding execs under --all needs {} ({})", CAP_KILL.name, CAP_KILL.why)),
    }
}

const NEEDS: &str = "memtrace needs root, or the capabilities CAP_BPF, CAP_PERFMON and CAP_SYS_ADMIN \
                     (and CAP_SYS_PTRACE for processes of other users)";

/// Fails, naming every missing capability and what it is for, unless memtrace can load its
/// programs, attach them as `link_kind` links them, and read the processes `targets` names.
pub fn check(targets: &Targets, link_kind: LinkKind) -> Result<()> {
    let effective = effective();
    let missing = missing_for_loading(effective);
    if !missing.is_empty() {
        bail!("{NEEDS}; missing: {}; run it with sudo", describe(&missing));
    }
    // Per-site links are uprobe perf events, which the kernel opens only for CAP_SYS_ADMIN;
    // uprobe_multi links need only what loading needs.
    if link_kind == LinkKind::PerfEvent && !has(effective, CAP_SYS_ADMIN) {
        bail!("{NEEDS}; missing: {}; run it with sudo", describe(&[CAP_SYS_ADMIN]));
    }
    if has(effective, CAP_SYS_PTRACE) {
        return Ok(());
    }
    for &pid in targets.pids() {
        if is_denied(&format!("/proc/{pid}/exe")) {
            bail!(
                "pid {pid} belongs to another user; missing: {}; run memtrace with sudo",
                describe(&[CAP_SYS_PTRACE])
            );
        }
    }
    if targets.system_wide() {
        eprintln!(
            "memtrace: warning: without CAP_SYS_PTRACE, processes of other users are not traced ({})",
            CAP_SYS_PTRACE.why
        );
    }
    Ok(())
}

/// A capability memtrace uses, whether this process holds it, and what it is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub name: &'static str,
    pub why: &'static str,
    pub held: bool,
}

/// Every capability memtrace uses, held or not by this process.
pub fn held() -> Vec<Held> {
    let effective = effective();
    [CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN, CAP_SYS_PTRACE]
        .into_iter()
        .map(|cap| Held { name: cap.name, why: cap.why, held: has(effective, cap) })
        .collect()
}

/// The capabilities a run here lacks to load its programs and attach them (per-site perf links
/// also need CAP_SYS_ADMIN), by name.
pub fn missing_for_a_run(per_site_links: bool) -> Vec<&'static str> {
    let effective = effective();
    let mut missing = missing_for_loading(effective);
    if per_site_links && !has(effective, CAP_SYS_ADMIN) {
        missing.push(CAP_SYS_ADMIN);
    }
    missing.iter().map(|cap| cap.name).collect()
}

fn effective() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    effective_capabilities(&status).unwrap_or(0)
}

fn has(effective: u64, capability: Capability) -> bool {
    effective & (1 << capability.bit) != 0
}

/// The capabilities missing for creating the maps and loading the programs.
fn missing_for_loading(effective: u64) -> Vec<Capability> {
    // CAP_SYS_ADMIN also grants what CAP_BPF and CAP_PERFMON do.
    if has(effective, CAP_SYS_ADMIN) {
        return Vec::new();
    }
    [CAP_BPF, CAP_PERFMON].into_iter().filter(|&cap| !has(effective, cap)).collect()
}

fn describe(missing: &[Capability]) -> String {
    let each: Vec<String> = missing.iter().map(|cap| format!("{} ({})", cap.name, cap.why)).collect();
    each.join(", ")
}

fn is_denied(path: &str) -> bool {
    std::fs::read_link(Path::new(path)).is_err_and(|err| err.kind() == std::io::ErrorKind::PermissionDenied)
}

fn effective_capabilities(status: &str) -> Option<u64> {
    let hex = status.lines().find_map(|line| line.strip_prefix("CapEff:"))?;
    u64::from_str_radix(hex.trim(), 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(caps: &[Capability]) -> u64 {
        caps.iter().map(|cap| 1u64 << cap.bit).sum()
    }

    #[test]
    fn capabilities_from_proc_status() {
        let root = "Name:\tx\nCapEff:\t000001ffffffffff\n";
        assert!(missing_for_loading(effective_capabilities(root).unwrap()).is_empty());
        assert_eq!(effective_capabilities("CapEff:\t0000000000000000\n"), Some(0));
        assert_eq!(effective_capabilities("nothing"), None);
    }

    #[test]
    fn loading_needs_bpf_and_perfmon_or_sys_admin() {
        assert!(missing_for_loading(set(&[CAP_BPF, CAP_PERFMON])).is_empty());
        assert!(missing_for_loading(set(&[CAP_SYS_ADMIN])).is_empty());
        assert_eq!(missing_for_loading(set(&[CAP_BPF])), [CAP_PERFMON]);
        assert_eq!(missing_for_loading(0), [CAP_BPF, CAP_PERFMON]);
        let text = describe(&[CAP_SYS_ADMIN]);
        assert!(text.starts_with("CAP_SYS_ADMIN (perf_event_open"), "{text}");
    }
}
