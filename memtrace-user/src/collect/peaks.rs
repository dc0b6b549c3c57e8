//! Each process's heap peak at interval resolution (heaptrack's "peak memory consumers"): at
//! every sample where a process's live heap is higher than at any sample before, the stacks that
//! hold it are noted, by key; they are symbolized with the process's other stacks.
//!
//! Samples are an interval apart, so the true peak (`peak_live_bytes`, exact) may fall between
//! two of them: this is the highest heap a sample saw, and who held it then.

use std::collections::HashMap;

use memtrace_common::{StackKey, StackTotals};

use crate::model::Model;

/// The stacks kept per peak, most live bytes first.
const PEAK_STACKS: usize = 50;

/// A peak as the kernel's tables showed it, before symbolization.
#[derive(Debug, Clone)]
pub struct RawPeak {
    pub ts_us: u64,
    pub heap_live_bytes: i64,
    /// When the program image the peak belongs to started (an exec starts another).
    pub image_started_ns: u64,
    /// Stack keys and their totals at the peak, most live bytes first.
    pub stacks: Vec<(u64, StackTotals)>,
}

#[derive(Debug, Default)]
pub struct PeakTracker {
    peaks: HashMap<u32, RawPeak>,
}

impl PeakTracker {
    /// Notes a new peak for every process whose live heap is higher now than at any sample
    /// before; `live` is every (process, stack) with live blocks, as just read.
    pub fn record(&mut self, model: &Model, live: &[(StackKey, StackTotals)], ts_us: u64) {
        let mut higher: HashMap<u32, RawPeak> = HashMap::new();
        for process in model.processes.values().filter(|p| !p.released && p.stats.live_bytes > 0) {
            let stats = &process.stats;
            let previous = self
                .peaks
                .get(&process.identity.pid)
                .filter(|peak| peak.image_started_ns == stats.started_ns);
            if previous.is_some_and(|peak| peak.heap_live_bytes >= stats.live_bytes) {
                continue;
            }
            let peak = RawPeak {
                ts_us,
                heap_live_bytes: stats.live_bytes,
                image_started_ns: stats.started_ns,
                stacks: Vec::new(),
            };
            higher.insert(process.identity.pid, peak);
        }
        for (key, totals) in live {
            match higher.get_mut(&key.tgid) {
                Some(peak) if totals.live_bytes > 0 && totals.started_ns >= peak.image_started_ns => {
                    peak.stacks.push((key.stack, *totals))
                }
                _ => {}
            }
        }
        for (pid, mut peak) in higher {
            peak.stacks.sort_by_key(|(_, totals)| std::cmp::Reverse(totals.live_bytes));
            peak.stacks.truncate(PEAK_STACKS);
            self.peaks.insert(pid, peak);
        }
    }

    /// The peak of a process's current program image, if a sample saw its heap.
    pub fn peak_of(&self, pid: u32, image_started_ns: u64) -> Option<&RawPeak> {
        self.peaks.get(&pid).filter(|peak| peak.image_started_ns == image_started_ns)
    }

    /// Forgets a process reported and released.
    pub fn forget(&mut self, pid: u32) {
        self.peaks.remove(&pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(tgid: u32, stack: u64, bytes: i64) -> (StackKey, StackTotals) {
        let totals =
            StackTotals { live_bytes: bytes, live_allocations: 1, started_ns: 10, ..StackTotals::default() };
        (StackKey { tgid, _pad: 0, stack }, totals)
    }

    #[test]
    fn a_peak_is_kept_until_a_sample_sees_a_higher_heap() {
        let mut model = Model::default();
        model.add_process(crate::model::identity::ProcessIdentity::new(7, "p".into()), "/libc".into());
        let process = model.processes.get_mut(&7).unwrap();
        process.stats.started_ns = 5;
        process.stats.live_bytes = 300;
        let mut tracker = PeakTracker::default();
        tracker.record(&model, &[live(7, 1, 100), live(7, 2, 200), live(8, 3, 999)], 1000);
        let peak = tracker.peak_of(7, 5).unwrap();
        assert_eq!((peak.ts_us, peak.heap_live_bytes), (1000, 300));
        assert_eq!(peak.stacks.iter().map(|(stack, _)| *stack).collect::<Vec<_>>(), [2, 1]);
        // Lower, then equal: the first peak stays.
        model.processes.get_mut(&7).unwrap().stats.live_bytes = 100;
        tracker.record(&model, &[live(7, 1, 100)], 2000);
        model.processes.get_mut(&7).unwrap().stats.live_bytes = 300;
        tracker.record(&model, &[live(7, 1, 300)], 3000);
        assert_eq!(tracker.peak_of(7, 5).unwrap().ts_us, 1000);
        // Higher: a new peak.
        model.processes.get_mut(&7).unwrap().stats.live_bytes = 301;
        tracker.record(&model, &[live(7, 1, 301)], 4000);
        assert_eq!(tracker.peak_of(7, 5).unwrap().ts_us, 4000);
        // Another program image (an exec) has peaks of its own.
        assert!(tracker.peak_of(7, 6).is_none());
        tracker.forget(7);
        assert!(tracker.peak_of(7, 5).is_none());
    }
}
