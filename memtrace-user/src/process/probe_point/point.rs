//! A probe point, as both walks (x86-64's in probe_point.rs, arm64's in arm64.rs) give it.

use memtrace_common::ArgumentRegisters;

/// How far from the entry the walk looks: past the longest prologue seen before a branch
/// (jemalloc's free, whose first `jne` is at +0x30).
pub const WALK_BYTES: usize = 96;

/// Where a function's probes sit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbePoint {
    /// Bytes past the function's first instruction.
    pub delta: u64,
    /// Where the function's arguments are there.
    pub registers: ArgumentRegisters,
    /// Whether the kernel emulates the instruction there; if not, it single-steps it.
    pub emulated: bool,
    /// The instruction there: its mnemonic (`ja`, `push`, `cmp`).
    pub instruction: String,
}
