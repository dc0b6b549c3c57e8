//! `GET /metrics`: the Prometheus text exposition (format 0.0.4) of one snapshot, written by the
//! prometheus-client crate. Per process (labels pid, comm, container_id, pod, namespace, container:
//! the identity's, model/identity.rs; and allocator) for the largest processes by live heap, the
//! rest summed under comm="other"; and memtrace's own figures.

use std::collections::HashSet;

use prometheus_client::{
    encoding::{prometheus_text, EncodeLabelSet},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use super::shared::Snapshot;
use crate::model::{levels::MemoryLevels, KernelMaps, Process};

/// The `Content-Type` of the response.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// Which process a series is of: its identity's labels (`ProcessIdentity::labels`), and its
/// allocator; pid and allocator are empty for comm="other".
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProcessLabels {
    #[prometheus(flatten)]
    identity: Vec<(&'static str, String)>,
    allocator: String,
}

impl ProcessLabels {
    fn of(process: &Process) -> Self {
        Self { identity: process.identity.labels(), allocator: process.allocator_kind.clone() }
    }

    fn other() -> Self {
        let identity = vec![("pid", String::new()), ("comm", "other".to_owned())];
        Self { identity, allocator: String::new() }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SubsystemLabels {
    #[prometheus(flatten)]
    process: ProcessLabels,
    subsystem: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TableLabels {
    table: &'static str,
}

/// The per-process families. Adding a process to labels already used adds to their values,
/// which is how the processes beyond the limit are summed.
#[derive(Default)]
struct ProcessFamilies {
    live_bytes: Family<ProcessLabels, Gauge>,
    live_allocations: Family<ProcessLabels, Gauge>,
    allocations: Family<ProcessLabels, Counter>,
    frees: Family<ProcessLabels, Counter>,
    allocated_bytes: Family<ProcessLabels, Counter>,
    rss_bytes: Family<ProcessLabels, Gauge>,
    /// One per memory level, as `MemoryLevels::NAMES` orders them (heap_live_bytes is
    /// `memtrace_heap_live_bytes` above, and is not repeated).
    levels: [Family<ProcessLabels, Gauge>; MemoryLevels::NAMES.len()],
    subsystem_bytes: Family<SubsystemLabels, Gauge>,
}

impl ProcessFamilies {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "memtrace_heap_live_bytes",
            "Bytes the process holds from its allocator (malloc and friends)",
            self.live_bytes.clone(),
        );
        registry.register(
            "memtrace_heap_live_allocations",
            "Blocks the process holds from its allocator",
            self.live_allocations.clone(),
        );
        // Counters are written with the suffix _total.
        registry.register(
            "memtrace_allocations",
            "Allocations since tracing began",
            self.allocations.clone(),
        );
        registry.register("memtrace_frees", "Frees since tracing began", self.frees.clone());
        registry.register(
            "memtrace_allocated_bytes",
            "Bytes allocated since tracing began",
            self.allocated_bytes.clone(),
        );
        registry.register("memtrace_rss_bytes", "Resident set size of the process", self.rss_bytes.clone());
        for (name, family) in
            MemoryLevels::NAMES.into_iter().zip(&self.levels).filter(|(name, _)| !is_heap_live(name))
        {
            registry.register(
                format!("memtrace_{name}"),
                format!(
                    "The process's memory level {name} (see memtrace's guide, docs/src/memory-levels.md)"
                ),
                family.clone(),
            );
        }
        registry.register(
            "memtrace_subsystem_bytes",
            "Bytes a subsystem of the process reports through the memtrace USDT probes",
            self.subsystem_bytes.clone(),
        );
    }

    fn add(&self, labels: &ProcessLabels, process: &Process) {
        let stats = &process.stats;
        self.live_bytes.get_or_create(labels).inc_by(stats.live_bytes);
        self.live_allocations.get_or_create(labels).inc_by(stats.live_allocations);
        self.allocations.get_or_create(labels).inc_by(stats.allocations);
        self.frees.get_or_create(labels).inc_by(stats.frees);
        self.allocated_bytes.get_or_create(labels).inc_by(stats.allocated_bytes);
        self.rss_bytes.get_or_create(labels).inc_by(gauge_value(process.memory.rss_bytes()));
        for ((name, value), family) in process.memory.named().into_iter().zip(&self.levels) {
            // An unknown level (the free pool of a process attached late) has no sample.
            if let Some(value) = value.filter(|_| !is_heap_live(name)) {
                family.get_or_create(labels).inc_by(gauge_value(value));
            }
        }
        for (subsystem, &bytes) in &process.usdt.subsystems {
            let labels = SubsystemLabels { process: labels.clone(), subsystem: subsystem.clone() };
            self.subsystem_bytes.get_or_create(&labels).inc_by(bytes);
        }
    }
}

/// The live heap has its own gauge, `memtrace_heap_live_bytes`, exact or estimated as sampled.
fn is_heap_live(level: &str) -> bool {
    level == "heap_live_bytes"
}

/// What the exposition needs besides the snapshot.
pub struct Limits {
    /// Processes with series of their own.
    pub max_series: usize,
    /// Capacity of the live-allocation table.
    pub max_allocations: u32,
    /// `--push`: pushes that failed so far.
    pub push_failures: Option<u64>,
}

/// The exposition of `snapshot`. Exited processes in `shown_exits` are left out, and those shown
/// now are added to it.
pub fn exposition(snapshot: &Snapshot, shown_exits: &mut HashSet<u32>, limits: &Limits) -> String {
    let mut registry = Registry::default();
    let families = ProcessFamilies::default();
    families.register(&mut registry);
    let mut processes: Vec<&Process> = snapshot
        .model
        .processes
        .values()
        .filter(|process| !(process.exited && shown_exits.contains(&process.identity.pid)))
        .collect();
    processes.sort_by_key(|process| (std::cmp::Reverse(process.stats.live_bytes), process.identity.pid));
    for (rank, process) in processes.iter().enumerate() {
        let labels =
            if rank < limits.max_series { ProcessLabels::of(process) } else { ProcessLabels::other() };
        families.add(&labels, process);
        if process.exited {
            shown_exits.insert(process.identity.pid);
        }
    }
    let traced = processes.iter().filter(|process| !process.exited).count();
    let summed = processes.len().saturating_sub(limits.max_series);
    register_own(&mut registry, snapshot, traced, summed, limits);
    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_text::encode(&mut text, &registry);
    text
}

/// memtrace's own figures: what it traces, what it lost, its tables and its own footprint.
fn register_own(registry: &mut Registry, snapshot: &Snapshot, traced: usize, summed: usize, limits: &Limits) {
    registry.register(
        "memtrace_lost_events",
        "Allocator events memtrace could not record (a kernel table was full)",
        counter(snapshot.lost_events),
    );
    registry.register(
        "memtrace_oom_kills",
        "Traced processes the kernel's OOM killer ended (their heap at the kill: --oom-dir)",
        counter(snapshot.oom_kills),
    );
    registry.register(
        "memtrace_oom_profiles_unqueued",
        "Heap profiles at OOM kills not queued for a push: 100 waited already (they are in --oom-dir)",
        counter(snapshot.oom_profiles_unqueued),
    );
    registry.register(
        "memtrace_traced_processes",
        "Processes traced now (exited ones not counted)",
        gauge(gauge_value(traced as u64)),
    );
    registry.register(
        "memtrace_other_processes",
        "Processes beyond --max-series-processes, summed under comm=\"other\"",
        gauge(gauge_value(summed as u64)),
    );
    register_tables(registry, snapshot, limits);
    registry.register(
        "process_resident_memory_bytes",
        "Resident memory size of memtrace itself in bytes",
        gauge(gauge_value(snapshot.agent_rss_bytes)),
    );
    if let Some(failures) = limits.push_failures {
        registry.register(
            "memtrace_push_failures",
            "Heap profile pushes (--push, --otlp-endpoint) that failed after their retries",
            counter(failures),
        );
    }
    let cpu: Counter<f64, std::sync::atomic::AtomicU64> = Counter::default();
    cpu.inc_by(snapshot.agent_cpu_seconds);
    registry.register("process_cpu_seconds", "User and system CPU time of memtrace itself in seconds", cpu);
}

/// memtrace's kernel tables: their entries as last read, and the live-allocation table's capacity.
fn register_tables(registry: &mut Registry, snapshot: &Snapshot, limits: &Limits) {
    let tables: Family<TableLabels, Gauge> = Family::default();
    let maps = snapshot.model.kernel_maps.unwrap_or_default();
    for (table, entries) in table_entries(&maps) {
        tables.get_or_create(&TableLabels { table }).set(gauge_value(entries as u64));
    }
    registry.register(
        "memtrace_kernel_table_entries",
        "Entries in memtrace's kernel tables, as last read (at a heap profile request, or every minute)",
        tables,
    );
    let capacity_family: Family<TableLabels, Gauge> = Family::default();
    capacity_family
        .get_or_create(&TableLabels { table: "live_allocations" })
        .set(i64::from(limits.max_allocations));
    registry.register(
        "memtrace_kernel_table_capacity",
        "Capacity of memtrace's kernel tables (--max-allocations)",
        capacity_family,
    );
}

fn gauge(value: i64) -> Gauge {
    let gauge: Gauge = Gauge::default();
    gauge.set(value);
    gauge
}

fn counter(value: u64) -> Counter {
    let counter: Counter = Counter::default();
    counter.inc_by(value);
    counter
}

fn table_entries(maps: &KernelMaps) -> [(&'static str, usize); 6] {
    [
        ("processes", maps.processes),
        ("live_allocations", maps.live_allocations),
        ("stack_totals", maps.stack_totals),
        ("usdt_entries", maps.usdt_entries),
        ("unwind_files", maps.unwind_files),
        ("unwind_rows", maps.unwind_rows),
    ]
}

fn gauge_value(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// User and system CPU time memtrace has used, in seconds.
pub fn own_cpu_seconds() -> f64 {
    // SAFETY: an all-zero rusage is a valid value of a plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes only the rusage it is given.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0.0;
    }
    let seconds = |time: libc::timeval| time.tv_sec as f64 + time.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::model::Model;

    fn snapshot(sizes: &[(u32, &str, i64)]) -> Snapshot {
        let mut model = Model::default();
        for &(pid, comm, live_bytes) in sizes {
            model.add_process(crate::model::identity::ProcessIdentity::new(pid, comm.into()), "/libc".into());
            let process = model.processes.get_mut(&pid).unwrap();
            process.allocator_kind = "glibc".into();
            process.stats.live_bytes = live_bytes;
            process.stats.allocations = 2;
        }
        Snapshot {
            model,
            profile: std::sync::Arc::new(Model::default()),
            traced_for: Duration::ZERO,
            profile_ticket: 0,
            lost_events: 3,
            oom_kills: 1,
            oom_profiles_unqueued: 2,
            agent_rss_bytes: 4096,
            agent_cpu_seconds: 0.5,
        }
    }

    #[test]
    fn the_largest_processes_have_series_and_the_rest_are_summed() {
        let snapshot = snapshot(&[(10, "small", 5), (11, "big", 500), (12, "mid", 50), (13, "tiny", 1)]);
        let limits = Limits { max_series: 2, max_allocations: 1000, push_failures: Some(1) };
        let text = exposition(&snapshot, &mut HashSet::new(), &limits);
        for series in [
            r#"memtrace_heap_live_bytes{pid="11",comm="big",allocator="glibc"} 500"#,
            r#"memtrace_heap_live_bytes{pid="12",comm="mid",allocator="glibc"} 50"#,
            r#"memtrace_heap_live_bytes{pid="",comm="other",allocator=""} 6"#,
            r#"memtrace_allocations_total{pid="",comm="other",allocator=""} 4"#,
        ] {
            assert!(text.contains(&format!("{series}\n")), "{series} in {text}");
        }
        assert!(!text.contains("comm=\"small\""), "{text}");
        for owner in ["allocator_resident", "mapped_anon_resident", "stack", "static", "dark"] {
            assert!(text.contains(&format!("# TYPE memtrace_{owner}_bytes gauge\n")), "{text}");
        }
        // Unknown in every process here (none was measured): no sample, rather than a guess.
        assert!(!text.contains("memtrace_allocator_free_resident_bytes{"), "{text}");
        assert!(!text.contains("memtrace_heap_live_bytes_bytes"), "{text}");
        assert!(text.contains("# TYPE memtrace_allocations_total counter\n"), "{text}");
        assert!(text.contains("memtrace_lost_events_total 3\n"), "{text}");
        assert!(text.contains("memtrace_traced_processes 4\n"), "{text}");
        assert!(
            text.contains("# TYPE memtrace_oom_kills_total counter\nmemtrace_oom_kills_total 1\n"),
            "{text}"
        );
        assert!(text.contains("memtrace_oom_profiles_unqueued_total 2\n"), "{text}");
        assert!(text.contains("memtrace_other_processes 2\n"), "{text}");
        assert!(text.contains("process_resident_memory_bytes 4096\n"), "{text}");
        assert!(text.contains("memtrace_kernel_table_capacity{table=\"live_allocations\"} 1000\n"), "{text}");
        assert!(text.contains("memtrace_push_failures_total 1\n"), "{text}");
    }

    #[test]
    fn an_exited_process_is_shown_once() {
        let mut snapshot = snapshot(&[(10, "done", 5), (11, "alive", 7)]);
        snapshot.model.processes.get_mut(&10).unwrap().exited = true;
        let mut shown = HashSet::new();
        let limits = Limits { max_series: 100, max_allocations: 1, push_failures: None };
        let first = exposition(&snapshot, &mut shown, &limits);
        assert!(first.contains("comm=\"done\""), "{first}");
        assert!(first.contains("memtrace_traced_processes 1\n"), "{first}");
        assert_eq!(shown, HashSet::from([10]));
        let second = exposition(&snapshot, &mut shown, &limits);
        assert!(!second.contains("memtrace_push_failures"), "{second}");
        assert!(!second.contains("comm=\"done\""), "{second}");
        assert!(second.contains("comm=\"alive\""), "{second}");
    }
}
