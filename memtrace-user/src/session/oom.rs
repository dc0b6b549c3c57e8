//! The stderr lines that say, at once, that the kernel's OOM killer ended a traced process: who,
//! in which memory cgroup under which limit, and what it held at the kill, by stack.

use crate::{export::format::format_bytes, model::Process};

/// The stacks the lines name.
const STACKS_SAID: usize = 3;
/// The frames of a stack they name, innermost first.
const FRAMES_SAID: usize = 6;

/// Says what the OOM kill of `process` left (its heap read by the collector).
pub fn announce(process: &Process) {
    let Some(kill) = &process.oom_kill else { return };
    let cgroup = match (&kill.cgroup, kill.limit_bytes) {
        (Some(path), Some(limit)) => format!("memory cgroup {path} (limit {})", exact_bytes(limit)),
        (Some(path), None) => format!("memory cgroup {path} (no limit)"),
        (None, _) => "memory cgroup unknown (gone before it was read)".to_owned(),
    };
    let rss = kill.rss_bytes.map_or_else(|| "unknown".to_owned(), exact_bytes);
    eprintln!(
        "memtrace: OOM kill: pid {} ({}) killed by the kernel's OOM killer at {:.3}s, {cgroup}; live heap {} in \
         {} blocks, RSS {rss}",
        process.identity.pid,
        process.identity.display_name(),
        kill.ts_us as f64 / 1e6,
        exact_bytes(kill.live_bytes.max(0) as u64),
        kill.live_allocations,
    );
    for stack in kill.stacks.iter().take(STACKS_SAID) {
        let frames: Vec<String> = stack.frames.iter().take(FRAMES_SAID).map(|frame| frame.name()).collect();
        eprintln!(
            "memtrace:   {} in {} blocks: {}",
            exact_bytes(stack.live_bytes.max(0) as u64),
            stack.live_allocations,
            frames.join(" < ")
        );
    }
}

/// `100663296 bytes (96.0 MiB)`.
fn exact_bytes(bytes: u64) -> String {
    format!("{bytes} bytes ({})", format_bytes(bytes))
}
