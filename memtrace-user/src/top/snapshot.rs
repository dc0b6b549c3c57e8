//! What the live view shows of the model at one sample: a row per traced process and, for the
//! process the user opened, its heaviest call stacks and its subsystems. Built on the tracing
//! thread from the model, handed to the view's thread, which only draws it.

use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use memtrace_common::ProcessStats;

use crate::model::{levels::MemoryLevels, FunctionTotals, Model, Process, StackProfile};

/// How many stacks and functions the detail of a process lists.
pub const DETAIL_ENTRIES: usize = 20;

/// The model as the view shows it, at one sample.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Time since tracing began.
    pub elapsed: Duration,
    pub rows: Vec<Row>,
    pub lost_events: u64,
    /// The opened process, when the user opened one.
    pub detail: Option<Detail>,
    /// `--sample`: live figures are estimates.
    pub sampled: bool,
}

/// One traced process.
#[derive(Debug, Clone)]
pub struct Row {
    pub pid: u32,
    /// Its command, and the container it runs in (`ProcessIdentity::display_name`).
    pub name: String,
    pub allocator_kind: String,
    pub stats: ProcessStats,
    pub memory: MemoryLevels,
    /// Live heap change since the previous sample.
    pub growth_bytes: i64,
    pub exited: bool,
}

/// The opened process's call stacks and subsystems.
#[derive(Debug, Clone)]
pub struct Detail {
    pub pid: u32,
    /// Whether `stacks` were read from the kernel for this sample (they are read only while a
    /// process is open, and when a process exits).
    pub stacks_read: bool,
    /// The stacks holding the most live bytes (then the most allocated), most first.
    pub stacks: Vec<StackProfile>,
    /// Functions by live bytes, inclusive.
    pub functions: Vec<FunctionTotals>,
    /// USDT subsystems, as the process last reported them.
    pub subsystems: BTreeMap<String, i64>,
}

/// The previous sample's live heap of every process's figures.
#[derive(Debug, Default)]
pub struct Growth {
    previous: HashMap<FiguresOf, i64>,
}

/// Whose figures: a process since its last exec (a pid used again, or an exec, starts afresh).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct FiguresOf {
    pid: u32,
    started_ns: u64,
}

impl Growth {
    /// Each process's live heap change since the previous call; the live heap itself the first
    /// time a process is seen.
    fn of(&mut self, model: &Model) -> HashMap<u32, i64> {
        let now: HashMap<FiguresOf, i64> = model
            .processes
            .values()
            .map(|p| (FiguresOf { pid: p.identity.pid, started_ns: p.stats.started_ns }, p.stats.live_bytes))
            .collect();
        let growth = now
            .iter()
            .map(|(figures, &live)| (figures.pid, live - self.previous.get(figures).copied().unwrap_or(0)))
            .collect();
        self.previous = now;
        growth
    }
}

impl Snapshot {
    /// What the view shows of `model`; `opened` is the process the user opened, and
    /// `stacks_read` whether its stacks were read for this sample.
    pub fn of(
        model: &Model,
        elapsed: Duration,
        growth: &mut Growth,
        opened: Option<u32>,
        stacks_read: bool,
    ) -> Self {
        let growth = growth.of(model);
        let rows = model
            .processes
            .values()
            .map(|process| Row::of(process, growth.get(&process.identity.pid).copied().unwrap_or(0)))
            .collect();
        let detail = opened.and_then(|pid| model.processes.get(&pid)).map(|process| Detail {
            pid: process.identity.pid,
            stacks_read: stacks_read || process.released,
            stacks: heaviest_stacks(process),
            functions: process.function_totals().into_iter().take(DETAIL_ENTRIES).collect(),
            subsystems: process.usdt.subsystems.clone(),
        });
        Self { elapsed, rows, lost_events: model.lost_events(), detail, sampled: model.estimators().any() }
    }
}

impl Row {
    fn of(process: &Process, growth_bytes: i64) -> Self {
        Self {
            pid: process.identity.pid,
            name: process.identity.display_name(),
            allocator_kind: process.allocator_kind.clone(),
            stats: process.stats,
            memory: process.memory,
            growth_bytes,
            exited: process.exited,
        }
    }
}

fn heaviest_stacks(process: &Process) -> Vec<StackProfile> {
    let mut stacks: Vec<&StackProfile> = process.stacks.iter().collect();
    stacks.sort_by(|a, b| {
        (b.totals.live_bytes, b.totals.allocated_bytes).cmp(&(a.totals.live_bytes, a.totals.allocated_bytes))
    });
    stacks.into_iter().take(DETAIL_ENTRIES).cloned().collect()
}

/// What the process list is sorted by, largest first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SortKey {
    #[default]
    LiveHeap,
    Growth,
    Rss,
    Dark,
}

impl SortKey {
    pub const ALL: [SortKey; 4] = [SortKey::LiveHeap, SortKey::Growth, SortKey::Rss, SortKey::Dark];

    /// The key that chooses it.
    pub fn key(self) -> char {
        match self {
            SortKey::LiveHeap => 'h',
            SortKey::Growth => 'g',
            SortKey::Rss => 'r',
            SortKey::Dark => 'd',
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            SortKey::LiveHeap => "live heap",
            SortKey::Growth => "growth",
            SortKey::Rss => "RSS",
            SortKey::Dark => "dark memory",
        }
    }

    pub fn from_key(key: char) -> Option<Self> {
        Self::ALL.into_iter().find(|sort| sort.key() == key)
    }

    fn value(self, row: &Row) -> i128 {
        match self {
            SortKey::LiveHeap => i128::from(row.stats.live_bytes),
            SortKey::Growth => i128::from(row.growth_bytes),
            SortKey::Rss => i128::from(row.memory.rss_bytes()),
            SortKey::Dark => i128::from(row.memory.dark_bytes),
        }
    }
}

/// Sorts the rows by `key`, largest first; equal rows by pid, so the order holds still.
pub fn sort_rows(rows: &mut [Row], key: SortKey) {
    rows.sort_by(|a, b| key.value(b).cmp(&key.value(a)).then(a.pid.cmp(&b.pid)));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(pid: u32, live: i64, growth: i64, rss_anon: u64, dark: u64) -> Row {
        Row {
            pid,
            name: format!("p{pid}"),
            allocator_kind: "glibc".into(),
            stats: ProcessStats { live_bytes: live, ..ProcessStats::default() },
            memory: MemoryLevels { rss_anon_bytes: rss_anon, dark_bytes: dark, ..MemoryLevels::default() },
            growth_bytes: growth,
            exited: false,
        }
    }

    fn pids(rows: &[Row]) -> Vec<u32> {
        rows.iter().map(|r| r.pid).collect()
    }

    #[test]
    fn every_key_sorts_largest_first_and_ties_by_pid() {
        let mut rows = vec![
            row(3, 100, -50, 900, 0),
            row(1, 300, 10, 100, 7),
            row(2, 100, 200, 500, 9),
            row(4, -5, 0, 0, 0),
        ];
        sort_rows(&mut rows, SortKey::LiveHeap);
        assert_eq!(pids(&rows), [1, 2, 3, 4]);
        sort_rows(&mut rows, SortKey::Growth);
        assert_eq!(pids(&rows), [2, 1, 4, 3], "shrinking processes last");
        sort_rows(&mut rows, SortKey::Rss);
        assert_eq!(pids(&rows), [3, 2, 1, 4]);
        sort_rows(&mut rows, SortKey::Dark);
        assert_eq!(pids(&rows), [2, 1, 3, 4]);
    }

    #[test]
    fn sort_keys_round_trip() {
        for sort in SortKey::ALL {
            assert_eq!(SortKey::from_key(sort.key()), Some(sort));
        }
        assert_eq!(SortKey::from_key('x'), None);
    }

    #[test]
    fn growth_is_the_change_since_the_previous_sample() {
        let mut model = Model::default();
        model.add_process(crate::model::identity::ProcessIdentity::new(7, "a".into()), "/libc".into());
        let mut growth = Growth::default();
        let set = |model: &mut Model, live: i64, started: u64| {
            let process = model.processes.get_mut(&7).unwrap();
            process.stats.live_bytes = live;
            process.stats.started_ns = started;
        };
        set(&mut model, 1000, 1);
        assert_eq!(Snapshot::of(&model, Duration::ZERO, &mut growth, None, false).rows[0].growth_bytes, 1000);
        set(&mut model, 600, 1);
        assert_eq!(Snapshot::of(&model, Duration::ZERO, &mut growth, None, false).rows[0].growth_bytes, -400);
        // An exec starts the figures afresh: growth counts from nothing.
        set(&mut model, 50, 2);
        let snapshot = Snapshot::of(&model, Duration::ZERO, &mut growth, Some(7), true);
        assert_eq!(snapshot.rows[0].growth_bytes, 50);
        let detail = snapshot.detail.expect("the opened process has a detail");
        assert!(detail.stacks_read && detail.stacks.is_empty());
    }
}
