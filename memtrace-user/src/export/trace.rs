//! Chrome trace-event JSON (array format), streamed: every sample is written and flushed at once, so
//! a trace cut short, even by SIGKILL, still loads. Events are separated by a comma at the start of
//! the next write, so the file always ends with a whole event and only `]` is ever missing.
//!
//! The MemoryInfra dumps load in chrome://tracing without import warnings: every allocator dump has
//! a GUID, subsystems sit under one `subsystems` node of their process (their names escaped, so no
//! name can place a dump elsewhere), and a subsystem declared as heap memory (`--heap-subsystem`)
//! owns part of `malloc`, so no total counts its bytes twice.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::File,
    io::Write,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use super::exporter::Exporter;
use crate::model::{oom::OomKill, Model, Process, RunEnd, Sample};

pub struct TraceFile {
    path: PathBuf,
    file: File,
    events_written: usize,
    /// Length of the file up to its last whole event.
    whole_bytes: u64,
    /// Losses not charged to a process have been drawn (under memtrace's own pid).
    losses_shown: bool,
    /// memtrace's own pid has its name (`own_counters`).
    own_track_named: bool,
    /// The run ended cleanly: the file is a whole trace, even without events.
    finished: bool,
    /// The name each process's track was last given: named again when it changes (an exec, a
    /// container's names from its runtime), where the viewers take the last name given.
    named: BTreeMap<u32, String>,
    /// Processes whose final (post-exit) figures are already in the trace.
    closed: BTreeSet<u32>,
    /// Processes whose OOM kill is already in the trace.
    oom_kills_shown: BTreeSet<u32>,
    /// `--heap-subsystem`: subsystems whose memory comes out of malloc.
    heap_subsystems: BTreeSet<String>,
}

impl TraceFile {
    pub fn create(path: &Path) -> Result<Self> {
        let cannot =
            || format!("cannot write the trace to {}; choose another path with -o/--output", path.display());
        let file = File::create(path).with_context(cannot)?;
        let mut trace = Self {
            path: path.to_owned(),
            file,
            events_written: 0,
            whole_bytes: 1,
            losses_shown: false,
            own_track_named: false,
            finished: false,
            named: BTreeMap::new(),
            closed: BTreeSet::new(),
            oom_kills_shown: BTreeSet::new(),
            heap_subsystems: BTreeSet::new(),
        };
        // On failure (a full disk) the file goes again as `trace` drops.
        trace.file.write_all(b"[").with_context(cannot)?;
        Ok(trace)
    }

    /// Subsystems whose memory is heap memory (`--heap-subsystem`): their dumps own part of
    /// `malloc`'s, so the memory view counts those bytes once.
    pub fn with_heap_subsystems(mut self, names: impl IntoIterator<Item = String>) -> Self {
        self.heap_subsystems = names.into_iter().collect();
        self
    }

    fn write_events(&mut self, events: &[Value]) -> Result<()> {
        let mut text = String::new();
        for event in events {
            text.push_str(if self.events_written == 0 { "\n" } else { ",\n" });
            text.push_str(&event.to_string());
            self.events_written += 1;
        }
        if let Err(err) = self.file.write_all(text.as_bytes()) {
            // A partial write (a full disk) would leave half an event: cut back to the last whole
            // one, so the file still loads.
            let _ = self.file.set_len(self.whole_bytes);
            return Err(err).with_context(|| self.write_failed());
        }
        self.whole_bytes += text.len() as u64;
        Ok(())
    }

    /// memtrace's own counters: losses no process can be charged with (a full process table, USDT
    /// reports), from the first one on, and `--window`'s windows closed so far.
    fn own_counters(&mut self, model: &Model, sample: Sample) -> Vec<Value> {
        let lost = model.unattributed_lost_events + model.usdt_lost_events;
        self.losses_shown |= lost > 0;
        if !self.losses_shown && model.windows.is_none() {
            return Vec::new();
        }
        let pid = std::process::id();
        let mut events = Vec::new();
        if !self.own_track_named {
            self.own_track_named = true;
            events.push(process_name(pid, "memtrace"));
        }
        let own_counter = |name: &str, args: Value| json!({"name": name, "ph": "C", "ts": sample.ts_us, "pid": pid, "tid": pid, "args": args});
        if self.losses_shown {
            events.push(own_counter("lost_events", json!({ "lost_events": lost })));
        }
        if let Some(windows) = model.windows {
            events.push(own_counter("windows", json!({ "closed": windows.closed })));
        }
        events
    }

    fn write_failed(&self) -> String {
        format!("writing the trace to {} (-o/--output)", self.path.display())
    }
}

/// A run that failed before its first sample leaves no trace behind: the file holds nothing but `[`.
/// Only the regular file memtrace created is removed, never a device or a pipe named by -o.
impl Drop for TraceFile {
    fn drop(&mut self) {
        if self.events_written > 0 || self.finished {
            return;
        }
        let ours = self.file.metadata().ok();
        let there = std::fs::metadata(&self.path).ok();
        if let (Some(ours), Some(there)) = (ours, there) {
            use std::os::unix::fs::MetadataExt;
            if ours.is_file() && (ours.dev(), ours.ino()) == (there.dev(), there.ino()) {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

impl Exporter for TraceFile {
    fn sample(&mut self, model: &Model, sample: Sample) -> Result<()> {
        let mut events = Vec::new();
        for process in model.every_process() {
            if self.closed.contains(&process.identity.pid) {
                continue;
            }
            let name = process.identity.display_name();
            if self.named.get(&process.identity.pid) != Some(&name) {
                events.push(process_name(process.identity.pid, &name));
                self.named.insert(process.identity.pid, name);
            }
            events.extend(process_events(process, sample, &self.heap_subsystems));
            if let Some(kill) = process.oom_kill.as_ref().filter(|kill| kill.read) {
                if self.oom_kills_shown.insert(process.identity.pid) {
                    events.push(oom_kill_event(process, kill));
                }
            }
            if process.exited {
                self.closed.insert(process.identity.pid);
            }
        }
        events.extend(self.own_counters(model, sample));
        self.write_events(&events)
    }

    fn written(&self) -> Option<String> {
        Some(format!("trace written to {} (open it in Perfetto UI or chrome://tracing)", self.path.display()))
    }

    fn finish(&mut self, _model: &Model, _end: RunEnd) -> Result<()> {
        self.finished = true;
        self.file.write_all(b"\n]\n").with_context(|| self.write_failed())?;
        self.file.sync_data().with_context(|| self.write_failed())
    }
}

fn process_name(pid: u32, name: &str) -> Value {
    json!({"name": "process_name", "ph": "M", "pid": pid, "tid": pid, "args": {"name": name}})
}

/// An instant event at the OOM kill, on the process's track: what it held then, and the stack
/// that held the most.
fn oom_kill_event(process: &Process, kill: &OomKill) -> Value {
    let stack: Vec<String> = kill.top_frames().unwrap_or_default().iter().map(|frame| frame.name()).collect();
    json!({"name": "oom_kill", "ph": "i", "s": "p", "ts": kill.ts_us, "pid": process.identity.pid, "tid": process.identity.pid,
           "args": {"cgroup": kill.cgroup, "limit_bytes": kill.limit_bytes, "live_bytes": kill.live_bytes,
                    "live_allocations": kill.live_allocations, "rss_bytes": kill.rss_bytes,
                    "top_stack": stack}})
}

fn counter(process: &Process, ts_us: u64, name: &str, args: Value) -> Value {
    json!({"name": name, "ph": "C", "ts": ts_us, "pid": process.identity.pid, "tid": process.identity.pid, "args": args})
}

/// The known levels; the allocator's free pool only at a sample that measured it (it is measured
/// within a budget, collect/owners): a counter holds its value until the next one.
fn memory_args(process: &Process, ts_us: u64) -> Value {
    let mut args = process.memory.known();
    if process.free_pool.as_ref().is_none_or(|pool| pool.measured_at_us != ts_us) {
        args.remove("allocator_free_resident_bytes");
    }
    args.into()
}

fn process_events(process: &Process, sample: Sample, heap_subsystems: &BTreeSet<String>) -> Vec<Value> {
    let stats = &process.stats;
    let live_bytes = stats.live_bytes.max(0) as u64;
    let live_allocations = stats.live_allocations.max(0) as u64;
    let mut events = vec![
        // Bytes and counts on separate counters: a count on a bytes axis is an invisible sliver.
        counter(process, sample.ts_us, "heap", json!({ "live_bytes": live_bytes })),
        counter(process, sample.ts_us, "heap_allocations", json!({ "live_allocations": live_allocations })),
        counter(process, sample.ts_us, "rss", json!({"rss_bytes": process.memory.rss_bytes()})),
        // Losses show on the timeline when they happen.
        counter(process, sample.ts_us, "lost_events", json!({"lost_events": stats.lost_events})),
        counter(process, sample.ts_us, "memory", memory_args(process, sample.ts_us)),
    ];
    events.extend(usdt_counters(process, sample));
    events.push(memory_dump(process, sample, live_bytes, live_allocations, heap_subsystems));
    events
}

/// One counter per subsystem the process reported (`subsystem:<name>`, arg `bytes`) and one per
/// `--usdt` option (`usdt:<option>`, args `hits` and, for `=argN`, `value`).
fn usdt_counters(process: &Process, sample: Sample) -> Vec<Value> {
    let subsystems = process.usdt.subsystems.iter().map(|(name, bytes)| {
        counter(process, sample.ts_us, &format!("subsystem:{name}"), json!({ "bytes": bytes }))
    });
    let probes = process.usdt.probes.iter().map(|(label, figures)| {
        let args = match figures.value {
            Some(value) => json!({"hits": figures.hits, "value": value}),
            None => json!({"hits": figures.hits}),
        };
        counter(process, sample.ts_us, &format!("usdt:{label}"), args)
    });
    subsystems.chain(probes).collect()
}

/// A MemoryInfra process dump, for chrome://tracing's memory view.
fn memory_dump(
    process: &Process,
    sample: Sample,
    live_bytes: u64,
    live_allocations: u64,
    heap_subsystems: &BTreeSet<String>,
) -> Value {
    let (allocators, edges) = allocators(process, live_bytes, live_allocations, heap_subsystems);
    json!({
        "name": "periodic_interval", "cat": "disabled-by-default-memory-infra", "ph": "v",
        "ts": sample.ts_us, "pid": process.identity.pid, "tid": process.identity.pid, "id": format!("0x{:x}", sample.dump_id),
        "args": {"dumps": {
            "level_of_detail": "detailed",
            "process_totals": {"resident_set_bytes": hex(process.memory.rss_bytes())},
            "allocators": allocators,
            "allocators_graph": edges,
        }},
    })
}

/// The node every subsystem's dump sits under.
pub const SUBSYSTEMS_NODE: &str = "subsystems";

/// "malloc" and one dump per USDT subsystem under `subsystems/`, all from the same sample, each with
/// a GUID; and the ownership edges from heap subsystems to `malloc`.
fn allocators(
    process: &Process,
    live_bytes: u64,
    live_allocations: u64,
    heap_subsystems: &BTreeSet<String>,
) -> (Value, Vec<Value>) {
    let malloc_guid = dump_guid(process.identity.pid, "malloc");
    let mut allocators = serde_json::Map::new();
    allocators.insert(
        "malloc".into(),
        json!({"guid": malloc_guid, "attrs": {
            "size": scalar(live_bytes, "bytes"),
            "allocated_objects_size": scalar(live_bytes, "bytes"),
            "allocated_objects_count": scalar(live_allocations, "objects"),
        }}),
    );
    let mut edges = Vec::new();
    for (name, &bytes) in &process.usdt.subsystems {
        let path = subsystem_dump_path(name);
        let guid = dump_guid(process.identity.pid, &path);
        // MemoryInfra sizes are unsigned; a subsystem reported below zero shows as empty.
        let size = scalar(bytes.max(0) as u64, "bytes");
        allocators.insert(path, json!({"guid": guid, "attrs": {"size": size}}));
        // The viewer takes an owner larger than what it owns for a broken dump (an import warning):
        // a heap subsystem that reports more than malloc holds cannot be all heap memory then, and
        // stands on its own in that dump.
        if heap_subsystems.contains(name) && bytes.max(0) as u64 <= live_bytes {
            edges.push(json!({"source": guid, "target": malloc_guid, "type": "ownership", "importance": 0}));
        }
    }
    (Value::Object(allocators), edges)
}

/// Where a subsystem's dump goes: `subsystems/<name>`, with `%` and `/` percent-escaped so that the
/// name is one path segment (MemoryInfra nests dumps at every `/`): no name can reach another node.
pub fn subsystem_dump_path(name: &str) -> String {
    let mut path = format!("{SUBSYSTEMS_NODE}/");
    for c in name.chars() {
        match c {
            '%' => path.push_str("%25"),
            '/' => path.push_str("%2F"),
            c => path.push(c),
        }
    }
    path
}

/// A dump's GUID: unique among every process's dumps of one sample (the viewer keys them across
/// processes), the same from sample to sample. FNV-1a of the pid and the dump's path, as hex.
fn dump_guid(pid: u32, path: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in pid.to_le_bytes().iter().chain(path.as_bytes()) {
        hash = (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{hash:x}")
}

fn scalar(value: u64, units: &str) -> Value {
    json!({"type": "scalar", "units": units, "value": hex(value)})
}

/// MemoryInfra writes sizes as hexadecimal strings without `0x`.
fn hex(value: u64) -> String {
    format!("{value:x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{collections::BTreeMap, time::Duration};

    fn model() -> Model {
        let mut model = Model::default();
        model.add_process(
            crate::model::identity::ProcessIdentity::new(42, "demo".into()),
            "/lib/libc.so.6".into(),
        );
        let process = model.processes.get_mut(&42).unwrap();
        process.stats.live_bytes = 4096;
        process.stats.live_allocations = 2;
        process.memory.rss_anon_bytes = 0x10000;
        model
    }

    /// A directory of the test's own, made, and the trace file's path in it.
    fn trace_path(test: &str) -> (PathBuf, PathBuf) {
        let dir = std::env::temp_dir().join(format!("memtrace-trace-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.json");
        (dir, path)
    }

    fn read_lines(path: &Path) -> Vec<String> {
        std::fs::read_to_string(path).unwrap().lines().map(str::to_owned).collect()
    }

    #[test]
    fn trace_is_valid_json_when_finished_and_when_cut_short() {
        let (dir, path) = trace_path("test");
        let mut trace = TraceFile::create(&path).unwrap();
        let mut model = model();
        trace.sample(&model, Sample { ts_us: 1000, dump_id: 1 }).unwrap();

        // Cut short: only the closing bracket is missing.
        let cut = std::fs::read_to_string(&path).unwrap() + "]";
        let events: Vec<Value> = serde_json::from_str(&cut).unwrap();
        assert_eq!(events.len(), 7);

        model.processes.get_mut(&42).unwrap().exited = true;
        trace.sample(&model, Sample { ts_us: 2000, dump_id: 2 }).unwrap();
        trace.sample(&model, Sample { ts_us: 3000, dump_id: 3 }).unwrap();
        trace.finish(&model, RunEnd { duration: Duration::from_secs(3) }).unwrap();

        let events: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(events.len(), 13, "an exited process gets one final sample, then no more");
        assert_eq!(events[0]["ph"], "M");
        assert_eq!(events[0]["args"]["name"], "demo");
        let heap = &events[1];
        assert_eq!(
            (heap["name"].as_str(), heap["ph"].as_str(), heap["ts"].as_u64()),
            (Some("heap"), Some("C"), Some(1000))
        );
        assert_eq!(heap["args"], json!({"live_bytes": 4096}), "bytes alone on the heap counter");
        assert_eq!(events[2]["name"], "heap_allocations");
        assert_eq!(events[2]["args"], json!({"live_allocations": 2}), "counts on a counter of their own");
        assert_eq!(events[3]["args"]["rss_bytes"], 0x10000);
        assert_eq!((events[4]["name"].as_str(), events[4]["ph"].as_str()), (Some("lost_events"), Some("C")));
        assert_eq!(events[4]["args"]["lost_events"], 0);
        assert_eq!(events[5]["name"], "memory");
        assert_eq!(events[5]["args"]["rss_anon_bytes"], 0x10000);
        let dump = &events[6];
        assert_eq!(dump["ph"], "v");
        assert_eq!(dump["id"], "0x1");
        assert_eq!(dump["args"]["dumps"]["process_totals"]["resident_set_bytes"], "10000");
        assert_eq!(dump["args"]["dumps"]["allocators"]["malloc"]["attrs"]["size"]["value"], "1000");

        let lines = read_lines(&path);
        assert_eq!(lines.first().map(String::as_str), Some("["));
        assert_eq!(lines.last().map(String::as_str), Some("]"));
        assert_eq!(lines.len(), 15, "one event per line");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn losses_of_no_process_are_a_counter_of_memtraces_own() {
        let (dir, path) = trace_path("losses");
        let mut trace = TraceFile::create(&path).unwrap();
        let mut model = model();
        trace.sample(&model, Sample { ts_us: 1000, dump_id: 1 }).unwrap();
        model.unattributed_lost_events = 3;
        trace.sample(&model, Sample { ts_us: 2000, dump_id: 2 }).unwrap();
        trace.finish(&model, RunEnd { duration: Duration::from_secs(2) }).unwrap();
        let events: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let own = Value::from(std::process::id());
        let losses: Vec<&Value> = events.iter().filter(|e| e["pid"] == own).collect();
        assert_eq!(losses.len(), 2, "a name and one counter, from the first loss on: {losses:?}");
        assert_eq!(losses[0]["ph"], "M");
        assert_eq!(
            (losses[1]["name"].as_str(), losses[1]["ts"].as_u64(), losses[1]["args"]["lost_events"].as_u64()),
            (Some("lost_events"), Some(2000), Some(3))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn windows_closed_is_a_counter_of_memtraces_own() {
        let (dir, path) = trace_path("windows");
        let mut trace = TraceFile::create(&path).unwrap();
        let mut model = model();
        let windows = crate::model::estimate::Windows::new(0.05, 0.1);
        for (closed, ts_us) in [(0, 1000), (3, 2000)] {
            model.windows = Some(windows.measured(0.05, 0.1, closed));
            trace.sample(&model, Sample { ts_us, dump_id: closed }).unwrap();
        }
        trace.finish(&model, RunEnd { duration: Duration::from_secs(2) }).unwrap();
        let events: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let own = Value::from(std::process::id());
        let own: Vec<&Value> = events.iter().filter(|e| e["pid"] == own).collect();
        assert_eq!(own.len(), 3, "a name and a counter at each sample: {own:?}");
        assert_eq!((own[0]["ph"].as_str(), own[0]["args"]["name"].as_str()), (Some("M"), Some("memtrace")));
        let closed: Vec<_> =
            own[1..].iter().map(|e| (e["name"].as_str(), e["args"]["closed"].as_u64())).collect();
        assert_eq!(closed, [(Some("windows"), Some(0)), (Some("windows"), Some(3))]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_trace_without_events_is_not_left_behind() {
        let (dir, path) = trace_path("empty");
        drop(TraceFile::create(&path).unwrap());
        assert!(!path.exists(), "an empty trace was left behind");
        let mut finished = TraceFile::create(&path).unwrap();
        finished.finish(&Model::default(), RunEnd { duration: Duration::from_secs(1) }).unwrap();
        drop(finished);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "[\n]\n", "a finished trace stays");
        drop(TraceFile::create(Path::new("/dev/null")).unwrap());
        assert!(Path::new("/dev/null").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The memory dump of pid 42 in a trace of `model`, written with `heap_subsystems` declared.
    fn dump_of(model: &Model, heap_subsystems: &[&str]) -> Value {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.json");
        let mut trace = TraceFile::create(&path)
            .unwrap()
            .with_heap_subsystems(heap_subsystems.iter().map(|s| s.to_string()));
        trace.sample(model, Sample { ts_us: 1000, dump_id: 7 }).unwrap();
        trace.finish(model, RunEnd { duration: Duration::from_secs(1) }).unwrap();
        let events: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        events.into_iter().find(|e| e["ph"] == "v" && e["pid"] == 42).expect("a memory dump of pid 42")
    }

    fn with_subsystems(names: &[(&str, i64)]) -> Model {
        let mut model = model();
        model.add_process(
            crate::model::identity::ProcessIdentity::new(43, "other".into()),
            "/lib/libc.so.6".into(),
        );
        for pid in [42, 43] {
            let process = model.processes.get_mut(&pid).unwrap();
            process.usdt.subsystems = names.iter().map(|&(n, b)| (n.to_owned(), b)).collect();
        }
        model
    }

    /// What chrome://tracing's importer checks (catapult's trace_event_importer): every allocator
    /// dump has a GUID, unique across every process's dumps of one id; every edge joins two of them,
    /// and a dump owns at most one other.
    #[test]
    fn every_allocator_dump_has_a_guid_unique_across_processes() {
        let model = with_subsystems(&[("textures", 5000), ("cache", 768)]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.json");
        let mut trace = TraceFile::create(&path).unwrap().with_heap_subsystems(["cache".to_string()]);
        trace.sample(&model, Sample { ts_us: 1000, dump_id: 1 }).unwrap();
        trace.sample(&model, Sample { ts_us: 2000, dump_id: 2 }).unwrap();
        trace.finish(&model, RunEnd { duration: Duration::from_secs(2) }).unwrap();
        let events: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut by_id: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for dump in events.iter().filter(|e| e["ph"] == "v") {
            let guids = by_id.entry(dump["id"].as_str().unwrap().to_owned()).or_default();
            let allocators = dump["args"]["dumps"]["allocators"].as_object().unwrap();
            assert_eq!(allocators.len(), 3, "{allocators:?}");
            for (name, allocator) in allocators {
                let guid = allocator["guid"].as_str().unwrap_or_else(|| panic!("{name} has no GUID"));
                assert!(
                    guids.insert(guid.to_owned()),
                    "GUID {guid} of {name} repeats in dump {}",
                    dump["id"]
                );
            }
            let mut owners = BTreeSet::new();
            for edge in dump["args"]["dumps"]["allocators_graph"].as_array().unwrap() {
                let source = edge["source"].as_str().unwrap();
                assert!(allocators.values().any(|a| a["guid"] == source), "{edge}");
                assert_eq!(edge["target"], allocators["malloc"]["guid"], "{edge}");
                assert_eq!(edge["type"], "ownership");
                assert!(owners.insert(source.to_owned()), "a dump owns two others: {edge}");
            }
        }
        assert_eq!(by_id.len(), 2);
        assert!(by_id.values().all(|guids| guids.len() == 6), "3 dumps x 2 processes: {by_id:?}");
        assert_eq!(by_id["0x1"], by_id["0x2"], "a dump keeps its GUID from sample to sample");
    }

    #[test]
    fn only_heap_subsystems_own_part_of_malloc() {
        let model = with_subsystems(&[("textures", 5000), ("cache", 768)]);
        let dump = dump_of(&model, &[]);
        assert_eq!(dump["args"]["dumps"]["allocators_graph"], json!([]), "off by default");
        let dump = dump_of(&model, &["cache", "not-reported"]);
        let dumps = &dump["args"]["dumps"];
        let edges = dumps["allocators_graph"].as_array().unwrap();
        assert_eq!(edges.len(), 1, "{edges:?}");
        assert_eq!(edges[0]["source"], dumps["allocators"]["subsystems/cache"]["guid"]);
        assert_eq!(edges[0]["target"], dumps["allocators"]["malloc"]["guid"]);
        assert_eq!(dumps["allocators"]["subsystems/cache"]["attrs"]["size"]["value"], "300");
        assert_eq!(dumps["allocators"]["subsystems/textures"]["attrs"]["size"]["value"], "1388");
    }

    #[test]
    fn a_heap_subsystem_larger_than_malloc_owns_none_of_it() {
        // malloc holds 4096 B in model().
        let model = with_subsystems(&[("cache", 4096), ("arena", 4097)]);
        let dump = dump_of(&model, &["cache", "arena"]);
        let dumps = &dump["args"]["dumps"];
        let edges = dumps["allocators_graph"].as_array().unwrap();
        assert_eq!(edges.len(), 1, "{edges:?}");
        assert_eq!(edges[0]["source"], dumps["allocators"]["subsystems/cache"]["guid"]);
    }

    /// MemoryInfra nests dumps at every `/` (and treats a leading `global/` as shared between
    /// processes): a subsystem's name is one segment under its process's `subsystems` node.
    #[test]
    fn subsystem_names_cannot_escape_their_node() {
        let names = ["a/../b", "../../malloc", "/", "global/x", "malloc", "%2F", "plain"];
        let model = with_subsystems(&names.map(|n| (n, 1)));
        let dump = dump_of(&model, &names);
        let allocators = dump["args"]["dumps"]["allocators"].as_object().unwrap();
        assert_eq!(allocators.len(), names.len() + 1, "each name its own dump: {allocators:?}");
        for path in allocators.keys().filter(|p| *p != "malloc") {
            let segment = path.strip_prefix("subsystems/").unwrap_or_else(|| panic!("{path} escaped"));
            assert!(!segment.contains('/') && !segment.is_empty(), "{path} is not one segment");
        }
        assert_eq!(subsystem_dump_path("a/../b"), "subsystems/a%2F..%2Fb");
        assert_eq!(subsystem_dump_path("%2F"), "subsystems/%252F", "escaping is one-to-one");
        assert_eq!(allocators["malloc"]["attrs"]["size"]["value"], "1000", "malloc is not overwritten");
        assert_eq!(dump["args"]["dumps"]["allocators_graph"].as_array().unwrap().len(), names.len());
    }

    #[test]
    fn unwritable_path_names_the_fix() {
        let err = TraceFile::create(Path::new("/nonexistent-dir/trace.json")).err().unwrap();
        assert!(format!("{err:#}").contains("-o/--output"));
    }
}
