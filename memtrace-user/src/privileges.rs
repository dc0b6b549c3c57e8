//! Tracing needs to load BPF programs and open uprobe perf events.

use anyhow::{bail, Result};

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

pub fn check() -> Result<()> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let effective = effective_capabilities(&status).unwrap_or(0);
    if has_tracing_capabilities(effective) {
        return Ok(());
    }
    bail!(
        "memtrace needs root, or the capabilities CAP_BPF and CAP_PERFMON, to load BPF programs and \
         attach uprobes; run it with sudo"
    )
}

fn effective_capabilities(status: &str) -> Option<u64> {
    let hex = status.lines().find_map(|line| line.strip_prefix("CapEff:"))?;
    u64::from_str_radix(hex.trim(), 16).ok()
}

fn has_tracing_capabilities(effective: u64) -> bool {
    let has = |cap: u32| effective & (1 << cap) != 0;
    has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_from_proc_status() {
        let root = "Name:\tx\nCapEff:\t000001ffffffffff\n";
        assert!(has_tracing_capabilities(effective_capabilities(root).unwrap()));
        let bpf_perfmon = (1u64 << CAP_BPF) | (1 << CAP_PERFMON);
        assert!(has_tracing_capabilities(bpf_perfmon));
        assert!(!has_tracing_capabilities(1 << CAP_BPF));
        assert_eq!(effective_capabilities("CapEff:\t0000000000000000\n"), Some(0));
        assert_eq!(effective_capabilities("nothing"), None);
    }
}
