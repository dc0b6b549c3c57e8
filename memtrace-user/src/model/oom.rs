//! What memtrace keeps of a process the kernel's OOM killer ended: when, in which memory cgroup
//! under which limit, how much it held, and the heap and stacks it had at the kill (the victim runs
//! no allocator call after the kill, so its live blocks then are those the kernel's table holds
//! until memtrace reads them).

use std::sync::Arc;

use super::frame::Frame;

/// The most stacks an OOM kill keeps, most live bytes first.
pub const OOM_STACKS: usize = 20;

#[derive(Debug, Clone)]
pub struct OomKill {
    /// Microseconds since tracing began.
    pub ts_us: u64,
    /// The victim's memory cgroup (its path in the memory controller's hierarchy, v1 or v2), as
    /// read at the kill; None where the victim had gone before it could be read.
    pub cgroup: Option<String>,
    /// The lowest memory limit on that cgroup or any of its ancestors, in bytes; None where none
    /// is set (a global OOM) or it could not be read.
    pub limit_bytes: Option<u64>,
    /// Resident bytes at the kill: the kernel's own counters at the tracepoint where it could read
    /// the victim's task, else /proc as read at once.
    pub rss_bytes: Option<u64>,
    /// The live heap at the kill (0 until the collector has read it).
    pub live_bytes: i64,
    pub live_allocations: i64,
    /// The stacks that held the most at the kill, most first (empty with --no-stacks).
    pub stacks: Vec<KillStack>,
    /// The collector has read the live heap and the stacks at the kill.
    pub read: bool,
}

/// One stack's share of the heap at the kill.
#[derive(Debug, Clone)]
pub struct KillStack {
    /// Innermost first, as in `StackProfile`.
    pub frames: Vec<Arc<Frame>>,
    pub live_bytes: i64,
    pub live_allocations: i64,
}

impl OomKill {
    /// A kill heard of, its heap yet to be read.
    pub fn heard(
        ts_us: u64,
        cgroup: Option<String>,
        limit_bytes: Option<u64>,
        rss_bytes: Option<u64>,
    ) -> Self {
        Self {
            ts_us,
            cgroup,
            limit_bytes,
            rss_bytes,
            live_bytes: 0,
            live_allocations: 0,
            stacks: Vec::new(),
            read: false,
        }
    }

    /// The innermost frames of the stack that held the most, for one line of text.
    pub fn top_frames(&self) -> Option<&[Arc<Frame>]> {
        self.stacks.first().map(|stack| stack.frames.as_slice())
    }
}
