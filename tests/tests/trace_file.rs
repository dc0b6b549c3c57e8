//! The trace file's contract: Chrome trace-event JSON, one event per line, counters Perfetto draws
//! and MemoryInfra dumps chrome://tracing reads.

use std::{
    collections::{BTreeMap, BTreeSet},
    process::Command,
};

use memtrace_tests::{assert_figures, fixture, Figures, Memtrace, Spawned, Trace};
use serde_json::Value;

/// fixtures/wait_stdin.c while it waits on stdin: malloc(1000) and malloc(2000), both live.
const ALIVE_LIVE_BYTES: u64 = 1000 + 2000;
const ALIVE_LIVE_ALLOCATIONS: u64 = 2;

/// fixtures/wait_stdin.c to its end: then it frees the 1000 and exits with the 2000 live.
const WAIT_STDIN: Figures = Figures {
    allocations: 2,
    frees: 1,
    allocated_bytes: 1000 + 2000,
    freed_bytes: 1000,
    live_allocations: 1,
    live_bytes: 2000,
    peak_live_bytes: Some(1000 + 2000),
    untracked_frees: 0,
    failed_allocations: 0,
};

/// The pid a wait_stdin fixture reports in its `ready <pid>` line.
fn ready_pid(line: &str) -> u64 {
    line.strip_prefix("ready ")
        .and_then(|pid| pid.trim().parse().ok())
        .unwrap_or_else(|| panic!("not a `ready <pid>` line: {line:?}"))
}

/// A MemoryInfra size: a hexadecimal string without `0x`.
fn hex_size(value: &Value) -> u64 {
    let text = value.as_str().unwrap_or_else(|| panic!("a MemoryInfra size is a string: {value}"));
    assert!(!text.starts_with("0x"), "sizes have no 0x: {text}");
    u64::from_str_radix(text, 16).unwrap_or_else(|_| panic!("not hexadecimal: {text}"))
}

/// The counter named `name` of process `pid` sampled at `ts`.
fn counter_at<'a>(trace: &'a Trace, name: &str, pid: &Value, ts: &Value) -> &'a Value {
    trace
        .counters(name)
        .find(|event| &event["pid"] == pid && &event["ts"] == ts)
        .unwrap_or_else(|| panic!("no {name} counter of pid {pid} at ts {ts}"))
}

/// What chrome://tracing's importer (catapult's trace_event_importer) warns about, checked
/// directly: every allocator dump has a GUID, no GUID repeats within a dump, every edge joins two
/// dumps of it and a dump owns at most one other; subsystems sit under `subsystems/`.
fn check_allocator_graph(dumps: &Value, dump: &Value) {
    let allocators = dumps["allocators"].as_object().unwrap_or_else(|| panic!("no allocators: {dump}"));
    let mut guids = BTreeSet::new();
    for (name, allocator) in allocators {
        let guid = allocator["guid"].as_str().unwrap_or_else(|| panic!("{name} has no GUID: {dump}"));
        assert!(guids.insert(guid), "GUID {guid} repeats: {dump}");
        assert!(name == "malloc" || name.starts_with("subsystems/"), "{name} outside its node: {dump}");
    }
    let mut owners = BTreeSet::new();
    for edge in dumps["allocators_graph"].as_array().unwrap_or_else(|| panic!("no allocators_graph: {dump}"))
    {
        for end in ["source", "target"] {
            assert!(guids.contains(edge[end].as_str().unwrap()), "edge {end} is no dump: {dump}");
        }
        assert!(owners.insert(edge["source"].as_str().unwrap()), "a dump owns two: {dump}");
    }
}

/// Every MemoryInfra dump agrees with the counters of its sample, and an id names one sample.
fn check_memory_dumps(trace: &Trace) {
    let mut moments: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    for dump in trace.phase("v") {
        let id = dump["id"].as_str().expect("a dump id is a string");
        assert!(id.starts_with("0x"), "dump ids are 0x-prefixed: {id}");
        let (pid, ts) = (&dump["pid"], &dump["ts"]);
        moments.entry(id.to_owned()).or_default().insert(ts.as_u64().expect("ts is in microseconds"));
        let dumps = &dump["args"]["dumps"];
        let heap = &counter_at(trace, "heap", pid, ts)["args"];
        let heap_allocations = &counter_at(trace, "heap_allocations", pid, ts)["args"];
        let rss = &counter_at(trace, "rss", pid, ts)["args"];
        assert_eq!(
            hex_size(&dumps["process_totals"]["resident_set_bytes"]),
            rss["rss_bytes"].as_u64().unwrap(),
            "{dump}"
        );
        let malloc = &dumps["allocators"]["malloc"]["attrs"];
        assert_eq!(hex_size(&malloc["size"]["value"]), heap["live_bytes"].as_u64().unwrap(), "{dump}");
        assert_eq!(
            hex_size(&malloc["allocated_objects_count"]["value"]),
            heap_allocations["live_allocations"].as_u64().unwrap(),
            "{dump}"
        );
        check_allocator_graph(dumps, dump);
    }
    for (id, stamps) in &moments {
        assert_eq!(stamps.len(), 1, "dump id {id} is used at several moments: {stamps:?}");
    }
}

#[test]
fn trace_file_follows_the_output_contract() {
    let mut run = Memtrace::new().command(&fixture("wait_stdin")).spawn();
    let pid = ready_pid(&run.wait_for_stdout("ready "));
    // A heap counter written after this read may hold figures read from the kernel before it; the
    // second one written after it was sampled wholly after the fixture said ready, and while it waits.
    let seen = run.trace_so_far().map_or(0, |trace| trace.counters("heap").count());
    let alive =
        run.wait_for_trace("two more heap counters", |trace| trace.counters("heap").count() >= seen + 2);
    run.close_stdin();
    let outcome = run.finish();
    outcome.assert_exit_code(0);
    assert_figures(&outcome, WAIT_STDIN);

    let heap = alive.counters("heap").nth(seen + 1).unwrap();
    assert_eq!(heap["args"], serde_json::json!({ "live_bytes": ALIVE_LIVE_BYTES }), "bytes alone: {heap}");
    let count = counter_at(&alive, "heap_allocations", &heap["pid"], &heap["ts"]);
    assert_eq!(count["args"], serde_json::json!({ "live_allocations": ALIVE_LIVE_ALLOCATIONS }), "{count}");
    let rss = counter_at(&alive, "rss", &heap["pid"], &heap["ts"]);
    assert!(rss["args"]["rss_bytes"].as_u64().unwrap() > 0, "{rss}");

    let trace = outcome.trace();
    assert!(trace.closed, "a clean end writes the closing ]");
    let names: Vec<&Value> = trace.phase("M").collect();
    assert_eq!(names.len(), 1, "one process_name event: {names:?}");
    assert_eq!(names[0]["name"], "process_name");
    assert_eq!(names[0]["pid"], pid);
    assert_eq!(names[0]["args"]["name"], "wait_stdin");

    let heaps: Vec<&Value> = trace.counters("heap").collect();
    assert!(heaps.len() >= 3, "several intervals: {heaps:?}");
    for heap in &heaps {
        assert_eq!(heap["pid"], pid, "{heap}");
        assert!(heap["ts"].is_u64(), "{heap}");
        assert!(heap["args"]["live_bytes"].is_u64(), "{heap}");
    }
    let last = heaps.last().unwrap();
    assert_eq!(last["args"]["live_bytes"], WAIT_STDIN.live_bytes, "{last}");
    let counts: Vec<&Value> = trace.counters("heap_allocations").collect();
    assert_eq!(counts.len(), heaps.len(), "a count counter at every sample");
    assert_eq!(counts.last().unwrap()["args"]["live_allocations"], WAIT_STDIN.live_allocations);
    assert_eq!(trace.counters("rss").count(), heaps.len());
    assert!(trace.counters("rss").all(|rss| rss["args"]["rss_bytes"].is_u64()));
    assert_eq!(trace.phase("v").count(), heaps.len(), "one memory dump per sample");
    check_memory_dumps(trace);

    // JSON Array Format, one event per line: `[`, the events, `]`.
    let text = outcome.trace_text();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.first(), Some(&"["));
    assert_eq!(lines.last(), Some(&"]"));
    let event_lines = &lines[1..lines.len() - 1];
    assert_eq!(event_lines.len(), trace.events.len(), "one event per line");
    for line in event_lines {
        let event: Value = serde_json::from_str(line.trim_end_matches(','))
            .unwrap_or_else(|err| panic!("line is not one event ({err}): {line}"));
        assert!(event.is_object(), "{line}");
    }
}

#[test]
fn memory_dumps_of_one_interval_share_an_id() {
    let mut targets = [0, 1].map(|_| Spawned::spawn(Command::new(fixture("wait_stdin"))));
    let mut run = Memtrace::new();
    for target in &mut targets {
        target.wait_for_stdout("ready ");
        run = run.args(["--pid", &target.pid().to_string()]);
    }
    let mut run = run.spawn();
    run.wait_for_stderr("memtrace: tracing");
    let ids = |trace: &Trace| -> BTreeMap<String, Vec<u64>> {
        let mut ids: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for dump in trace.phase("v") {
            ids.entry(dump["id"].as_str().unwrap().to_owned())
                .or_default()
                .push(dump["pid"].as_u64().unwrap());
        }
        ids
    };
    let alive = run.wait_for_trace("three memory dump ids", |trace| ids(trace).len() >= 3);
    for target in &mut targets {
        target.close_stdin();
        assert!(target.wait().success());
    }
    let outcome = run.finish();
    outcome.assert_exit_code(0);

    // While both lived, each sample's dumps carry one id, for both processes. (The newest id of the
    // snapshot is left out: its sample may have been half written when the file was read.)
    let mut expected: Vec<u64> = targets.iter().map(|t| u64::from(t.pid())).collect();
    expected.sort_unstable();
    let in_order: Vec<(u64, Vec<u64>)> = {
        let mut all: Vec<(u64, Vec<u64>)> = ids(&alive)
            .into_iter()
            .map(|(id, mut pids)| {
                pids.sort_unstable();
                let number = u64::from_str_radix(id.trim_start_matches("0x"), 16).unwrap();
                (number, pids)
            })
            .collect();
        all.sort_unstable();
        all
    };
    for (id, pids) in &in_order[..in_order.len() - 1] {
        assert_eq!(pids, &expected, "dump id {id:#x}");
    }
    // To the end: an id names one moment, and a process at most once.
    for (id, pids) in ids(outcome.trace()) {
        let unique: BTreeSet<&u64> = pids.iter().collect();
        assert_eq!(unique.len(), pids.len(), "dump id {id} repeats a process");
    }
    // The viewer keys allocator dumps by GUID across every process of one id: none repeats.
    let mut guids: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for dump in outcome.trace().phase("v") {
        let of_id = guids.entry(dump["id"].as_str().unwrap().to_owned()).or_default();
        for allocator in dump["args"]["dumps"]["allocators"].as_object().unwrap().values() {
            let guid = allocator["guid"].as_str().unwrap().to_owned();
            assert!(of_id.insert(guid.clone()), "GUID {guid} repeats in dump id {}", dump["id"]);
        }
    }
    check_memory_dumps(outcome.trace());
}

/// `--heap-subsystem NAME`: that subsystem, and only it, owns part of `malloc` in every memory dump
/// where it is reported, so chrome://tracing counts its bytes once.
#[test]
fn a_heap_subsystem_owns_part_of_malloc() {
    let include = format!("-I{}", memtrace_tests::workspace_root().join("include").display());
    let program = memtrace_tests::fixture_variant("usdt_subsystems", "trace-file", &[&include]);
    let outcome = Memtrace::new().args(["--heap-subsystem", "cache"]).command(&program).run();
    outcome.assert_exit_code(0);
    let trace = outcome.trace();
    check_memory_dumps(trace);
    let last = trace.phase("v").last().expect("a memory dump");
    let dumps = &last["args"]["dumps"];
    let allocators = &dumps["allocators"];
    assert_eq!(hex_size(&allocators["subsystems/cache"]["attrs"]["size"]["value"]), 100 * 4096 - 5000);
    let edges = dumps["allocators_graph"].as_array().unwrap();
    assert_eq!(edges.len(), 1, "only the declared subsystem: {edges:?}");
    assert_eq!(edges[0]["source"], allocators["subsystems/cache"]["guid"]);
    assert_eq!(edges[0]["target"], allocators["malloc"]["guid"]);
    assert_eq!(edges[0]["type"], "ownership");
}
