//! Chrome trace-event JSON (array format), streamed: every sample is written and flushed at once, so
//! a trace cut short, even by SIGKILL, still loads. Events are separated by a comma at the start of
//! the next write, so the file always ends with a whole event and only `]` is ever missing.

use std::{
    collections::BTreeSet,
    fs::File,
    io::Write,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use super::Exporter;
use crate::model::{Model, Process, RunEnd, Sample};

pub struct TraceFile {
    path: PathBuf,
    file: File,
    events_written: usize,
    /// Length of the file up to its last whole event.
    whole_bytes: u64,
    /// Losses not charged to a process have been drawn (under memtrace's own pid).
    losses_shown: bool,
    /// The run ended cleanly: the file is a whole trace, even without events.
    finished: bool,
    named: BTreeSet<u32>,
    /// Processes whose final (post-exit) figures are already in the trace.
    closed: BTreeSet<u32>,
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
            finished: false,
            named: BTreeSet::new(),
            closed: BTreeSet::new(),
        };
        // On failure (a full disk) the file goes again as `trace` drops.
        trace.file.write_all(b"[").with_context(cannot)?;
        Ok(trace)
    }

    pub fn path(&self) -> &Path {
        &self.path
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

    /// Losses no process can be charged with (a full process table, USDT reports), as a counter of
    /// memtrace's own, from the first one on.
    fn unattributed_losses(&mut self, model: &Model, sample: Sample) -> Vec<Value> {
        let lost = model.unattributed_lost_events + model.usdt_lost_events;
        if lost == 0 && !self.losses_shown {
            return Vec::new();
        }
        let pid = std::process::id();
        let mut events = Vec::new();
        if !self.losses_shown {
            self.losses_shown = true;
            events.push(json!({"name": "process_name", "ph": "M", "pid": pid, "tid": pid,
                               "args": {"name": "memtrace (losses of no one process)"}}));
        }
        events.push(json!({"name": "lost_events", "ph": "C", "ts": sample.ts_us, "pid": pid, "tid": pid,
                           "args": {"lost_events": lost}}));
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
            if self.closed.contains(&process.pid) {
                continue;
            }
            if self.named.insert(process.pid) {
                events.push(process_name(process));
            }
            events.extend(process_events(process, sample));
            if process.exited {
                self.closed.insert(process.pid);
            }
        }
        events.extend(self.unattributed_losses(model, sample));
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

fn process_name(process: &Process) -> Value {
    json!({"name": "process_name", "ph": "M", "pid": process.pid, "tid": process.pid,
           "args": {"name": process.comm}})
}

fn counter(process: &Process, ts_us: u64, name: &str, args: Value) -> Value {
    json!({"name": name, "ph": "C", "ts": ts_us, "pid": process.pid, "tid": process.pid, "args": args})
}

fn process_events(process: &Process, sample: Sample) -> Vec<Value> {
    let stats = &process.stats;
    let live_bytes = stats.live_bytes.max(0) as u64;
    let live_allocations = stats.live_allocations.max(0) as u64;
    let mut events = vec![
        counter(
            process,
            sample.ts_us,
            "heap",
            json!({"live_bytes": live_bytes, "live_allocations": live_allocations}),
        ),
        counter(process, sample.ts_us, "rss", json!({"rss_bytes": process.memory.rss_bytes()})),
        // Losses show on the timeline when they happen.
        counter(process, sample.ts_us, "lost_events", json!({"lost_events": stats.lost_events})),
        counter(process, sample.ts_us, "memory", json!(process.memory)),
    ];
    events.extend(usdt_counters(process, sample));
    events.push(memory_dump(process, sample, live_bytes, live_allocations));
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
fn memory_dump(process: &Process, sample: Sample, live_bytes: u64, live_allocations: u64) -> Value {
    json!({
        "name": "periodic_interval", "cat": "disabled-by-default-memory-infra", "ph": "v",
        "ts": sample.ts_us, "pid": process.pid, "tid": process.pid, "id": format!("0x{:x}", sample.dump_id),
        "args": {"dumps": {
            "level_of_detail": "detailed",
            "process_totals": {"resident_set_bytes": hex(process.memory.rss_bytes())},
            "allocators": allocators(process, live_bytes, live_allocations),
        }},
    })
}

/// "malloc" and, next to it, one allocator per USDT subsystem, all from the same sample.
fn allocators(process: &Process, live_bytes: u64, live_allocations: u64) -> Value {
    let mut allocators = serde_json::Map::new();
    allocators.insert(
        "malloc".into(),
        json!({"attrs": {
            "size": scalar(live_bytes, "bytes"),
            "allocated_objects_size": scalar(live_bytes, "bytes"),
            "allocated_objects_count": scalar(live_allocations, "objects"),
        }}),
    );
    for (name, &bytes) in &process.usdt.subsystems {
        // A subsystem may not hide the heap.
        let name = if allocators.contains_key(name) { format!("{name} (subsystem)") } else { name.clone() };
        // MemoryInfra sizes are unsigned; a subsystem reported below zero shows as empty.
        let size = scalar(bytes.max(0) as u64, "bytes");
        allocators.insert(name, json!({"attrs": {"size": size}}));
    }
    Value::Object(allocators)
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
    use std::time::Duration;

    fn model() -> Model {
        let mut model = Model::default();
        model.add_process(42, "demo".into(), "/lib/libc.so.6".into());
        let process = model.processes.get_mut(&42).unwrap();
        process.stats.live_bytes = 4096;
        process.stats.live_allocations = 2;
        process.memory.rss_anon_bytes = 0x10000;
        model
    }

    fn read_lines(path: &Path) -> Vec<String> {
        std::fs::read_to_string(path).unwrap().lines().map(str::to_owned).collect()
    }

    #[test]
    fn trace_is_valid_json_when_finished_and_when_cut_short() {
        let dir = std::env::temp_dir().join(format!("memtrace-trace-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.json");
        let mut trace = TraceFile::create(&path).unwrap();
        let mut model = model();
        trace.sample(&model, Sample { ts_us: 1000, dump_id: 1 }).unwrap();

        // Cut short: only the closing bracket is missing.
        let cut = std::fs::read_to_string(&path).unwrap() + "]";
        let events: Vec<Value> = serde_json::from_str(&cut).unwrap();
        assert_eq!(events.len(), 6);

        model.processes.get_mut(&42).unwrap().exited = true;
        trace.sample(&model, Sample { ts_us: 2000, dump_id: 2 }).unwrap();
        trace.sample(&model, Sample { ts_us: 3000, dump_id: 3 }).unwrap();
        trace.finish(&model, RunEnd { duration: Duration::from_secs(3) }).unwrap();

        let events: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(events.len(), 11, "an exited process gets one final sample, then no more");
        assert_eq!(events[0]["ph"], "M");
        assert_eq!(events[0]["args"]["name"], "demo");
        let heap = &events[1];
        assert_eq!(
            (heap["name"].as_str(), heap["ph"].as_str(), heap["ts"].as_u64()),
            (Some("heap"), Some("C"), Some(1000))
        );
        assert_eq!(heap["args"]["live_bytes"], 4096);
        assert_eq!(heap["args"]["live_allocations"], 2);
        assert_eq!(events[2]["args"]["rss_bytes"], 0x10000);
        assert_eq!((events[3]["name"].as_str(), events[3]["ph"].as_str()), (Some("lost_events"), Some("C")));
        assert_eq!(events[3]["args"]["lost_events"], 0);
        assert_eq!(events[4]["name"], "memory");
        assert_eq!(events[4]["args"]["rss_anon_bytes"], 0x10000);
        let dump = &events[5];
        assert_eq!(dump["ph"], "v");
        assert_eq!(dump["id"], "0x1");
        assert_eq!(dump["args"]["dumps"]["process_totals"]["resident_set_bytes"], "10000");
        assert_eq!(dump["args"]["dumps"]["allocators"]["malloc"]["attrs"]["size"]["value"], "1000");

        let lines = read_lines(&path);
        assert_eq!(lines.first().map(String::as_str), Some("["));
        assert_eq!(lines.last().map(String::as_str), Some("]"));
        assert_eq!(lines.len(), 13, "one event per line");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn losses_of_no_process_are_a_counter_of_memtraces_own() {
        let dir = std::env::temp_dir().join(format!("memtrace-trace-losses-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.json");
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
    fn a_trace_without_events_is_not_left_behind() {
        let dir = std::env::temp_dir().join(format!("memtrace-trace-empty-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.json");
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

    #[test]
    fn unwritable_path_names_the_fix() {
        let err = TraceFile::create(Path::new("/nonexistent-dir/trace.json")).err().unwrap();
        assert!(format!("{err:#}").contains("-o/--output"));
    }
}
