//! The figures of a process and of its stacks under sampling or windows: the live allocations and
//! bytes its recorded blocks stand for, put where the exact figures are, and each stack's totals as
//! the allocations they stand for.

use std::collections::HashMap;

use anyhow::Result;
use memtrace_common::{ProcessStats, StackTotals};

use crate::{kernel::Probes, model::estimate::Estimator};

/// Estimated live allocations and bytes of one process under sampling or windows.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct LiveEstimate {
    allocations: f64,
    bytes: f64,
}

impl LiveEstimate {
    /// What the kernel counted of the recorded blocks still live, each weighing the same.
    pub(super) fn of_recorded(stats: &ProcessStats, estimator: Estimator) -> Self {
        let weight = estimator.count_weight(1);
        Self { allocations: stats.live_allocations as f64 * weight, bytes: stats.live_bytes as f64 * weight }
    }
}

/// Every process's live figures, each recorded block weighted by its own size. Only blocks of the
/// process's current image count (`image_start`): a record from before its exec is not its own,
/// as the kernel's exact counters have it.
pub(super) fn estimate_live(
    probes: &Probes,
    estimator: Estimator,
    image_start: impl Fn(u32) -> Option<u64>,
) -> Result<HashMap<u32, LiveEstimate>> {
    let mut estimates: HashMap<u32, LiveEstimate> = HashMap::new();
    for (key, allocation) in probes.live_allocations()? {
        if image_start(key.tgid).is_none_or(|start| allocation.timestamp_ns < start) {
            continue;
        }
        let weight = estimator.count_weight(allocation.size);
        let estimate = estimates.entry(key.tgid).or_default();
        estimate.allocations += weight;
        estimate.bytes += weight * allocation.size as f64;
    }
    Ok(estimates)
}

/// Puts the estimates where the exact figures are: frees are what was allocated and is no longer
/// live; untracked frees cannot be told from frees of blocks that were not sampled. Under windows
/// the allocations counted are those recorded, scaled like the rest.
pub(super) fn apply_estimate(
    stats: &mut ProcessStats,
    estimator: Estimator,
    live: LiveEstimate,
    previous_peak: i64,
) {
    if estimator.counts_recorded_only() {
        let (allocations, bytes) = estimator.scale(stats.allocations, stats.allocated_bytes);
        stats.allocations = allocations.round() as u64;
        stats.allocated_bytes = bytes.round() as u64;
    }
    stats.live_allocations = live.allocations.round() as i64;
    stats.live_bytes = live.bytes.round() as i64;
    stats.frees = stats.allocations.saturating_sub(stats.live_allocations as u64);
    stats.freed_bytes = stats.allocated_bytes.saturating_sub(stats.live_bytes as u64);
    stats.peak_live_bytes = previous_peak.max(stats.live_bytes);
    stats.untracked_frees = 0;
}

/// A stack's sampled totals as the allocations they stand for.
pub(super) fn scale_totals(estimator: Estimator, totals: StackTotals) -> StackTotals {
    let (allocations, allocated_bytes) = estimator.scale(totals.allocations, totals.allocated_bytes);
    let live_allocations = u64::try_from(totals.live_allocations).unwrap_or(0);
    let live_bytes = u64::try_from(totals.live_bytes).unwrap_or(0);
    let (live_allocations, live_bytes) = estimator.scale(live_allocations, live_bytes);
    StackTotals {
        allocations: allocations.round() as u64,
        allocated_bytes: allocated_bytes.round() as u64,
        live_allocations: live_allocations.round() as i64,
        live_bytes: live_bytes.round() as i64,
        ..totals
    }
}
