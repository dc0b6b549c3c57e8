//! `--perfetto PATH`: the native Perfetto trace, decoded whole with protoc against Perfetto's own
//! .proto files (the perfetto_protos crate ships them), and held to a fixture's known figures: the
//! counter tracks carry every memory level at every sample, and the heap profile's call stacks
//! carry exactly what each call site allocated and freed.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
    process::Command,
};

use memtrace_tests::{
    fixture,
    perfetto::{decode, heap_profile, interned_strings, Message},
    workspace_root, Memtrace, Outcome,
};
use serde_json::Value;

/// The nine memory levels, as the summary's `memory` object and the trace's `memory` counter name
/// them.
const LEVELS: [&str; 9] = [
    "rss_anon_bytes",
    "rss_file_bytes",
    "rss_shmem_bytes",
    "swap_bytes",
    "heap_live_bytes",
    "allocator_held_bytes",
    "heap_overhead_bytes",
    "mapped_anon_bytes",
    "dark_bytes",
];

/// fixtures/leaks.c, per call site: (function, blocks allocated, bytes allocated, blocks freed,
/// bytes freed).
const LEAKS_SITES: [(&str, u64, u64, u64, u64); 3] =
    [("leak_textures", 5, 5000, 0, 0), ("leak_cache", 3, 768, 0, 0), ("scratch", 20, 6660, 20, 6660)];
/// What fixtures/leaks.c has live at its end.
const LEAKS_LIVE_BYTES: i64 = 5000 + 768;

/// How many packets the file holds, read from its bytes: each is field 1, length-delimited.
fn raw_packet_count(bytes: &[u8]) -> usize {
    let varint = |at: &mut usize| {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = bytes[*at];
            *at += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                break;
            }
        }
        value
    };
    let (mut at, mut count) = (0, 0);
    while at < bytes.len() {
        assert_eq!(varint(&mut at), (1 << 3) | 2, "every top-level field is a packet");
        at += varint(&mut at) as usize;
        count += 1;
    }
    assert_eq!(at, bytes.len(), "the last packet is whole");
    count
}

/// The decoded trace, with its tracks by uuid and the counter values on each.
struct Decoded {
    trace: Message,
    /// Counter tracks: uuid -> (parent uuid, name).
    tracks: BTreeMap<i64, (i64, String)>,
    /// Process tracks: uuid -> (pid, name).
    processes: BTreeMap<i64, (i64, String)>,
    /// Counter values: track uuid -> (timestamp ns, value), in file order.
    values: BTreeMap<i64, Vec<(i64, i64)>>,
}

fn read_trace(path: &Path) -> Decoded {
    let trace = decode(path);
    let packets: Vec<&Message> = trace.messages("packet").into_iter().collect();
    assert_eq!(packets.len(), raw_packet_count(&fs::read(path).unwrap()), "protoc decoded every packet");
    let (mut tracks, mut processes, mut values) = (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
    for packet in &packets {
        if let Some(descriptor) = packet.message("track_descriptor") {
            let uuid = descriptor.number("uuid").expect("a track has a uuid");
            if let Some(process) = descriptor.message("process") {
                processes.insert(
                    uuid,
                    (process.number("pid").unwrap(), process.string("process_name").unwrap().into()),
                );
            } else {
                assert_eq!(descriptor.message("counter").unwrap().scalar("unit"), Some("UNIT_SIZE_BYTES"));
                let name = descriptor.string("name").unwrap().to_owned();
                tracks.insert(uuid, (descriptor.number("parent_uuid").unwrap(), name));
            }
        }
        if let Some(event) = packet.message("track_event") {
            assert_eq!(event.scalar("type"), Some("TYPE_COUNTER"));
            let value = (packet.number("timestamp").unwrap(), event.number("counter_value").unwrap());
            values.entry(event.number("track_uuid").unwrap()).or_insert_with(Vec::new).push(value);
        }
    }
    Decoded { trace, tracks, processes, values }
}

impl Decoded {
    /// The values of process `pid`'s counter track `name`.
    fn counter(&self, pid: i64, name: &str) -> &[(i64, i64)] {
        let process = self.processes.iter().find(|(_, (p, _))| *p == pid).map(|(uuid, _)| *uuid);
        let process =
            process.unwrap_or_else(|| panic!("no process track for pid {pid}: {:?}", self.processes));
        let track = self.tracks.iter().find(|(_, (parent, n))| *parent == process && n == name);
        let (uuid, _) = track.unwrap_or_else(|| panic!("no {name} track of pid {pid}: {:?}", self.tracks));
        self.values.get(uuid).map_or(&[], Vec::as_slice)
    }
}

/// Runs `memtrace --perfetto` on `program` and decodes what it wrote.
fn run_with_perfetto(memtrace: Memtrace, program: &Path) -> (Outcome, Decoded) {
    let path = memtrace.dir().join("trace.pftrace");
    let outcome = memtrace.arg("--perfetto").arg(&path).command(program).run();
    outcome.assert_exit_code(0);
    outcome.assert_stderr_mentions(&["Perfetto trace written to"]);
    let decoded = read_trace(&path);
    (outcome, decoded)
}

#[test]
fn counter_tracks_hold_every_level_at_every_sample() {
    // leaks.c "linger": allocates on a byte from stdin, says "leaked", and lives on until stdin
    // ends, so that samples see its leaks while it runs.
    let memtrace = Memtrace::new();
    let path = memtrace.dir().join("trace.pftrace");
    let mut run = memtrace.arg("--perfetto").arg(&path).command(&fixture("leaks")).arg("linger").spawn();
    run.wait_for_stdout("ready");
    run.send(b"g");
    run.wait_for_stdout("leaked");
    let live_heap = |event: &Value| event["args"]["heap_live_bytes"] == LEAKS_LIVE_BYTES;
    run.wait_for_trace("a sample of the leaks", |trace| trace.counters("memory").any(live_heap));
    let outcome = run.finish();
    outcome.assert_exit_code(0);
    let decoded = read_trace(&path);
    let process = outcome.process();
    assert_eq!(process["live_bytes"], LEAKS_LIVE_BYTES, "{}", outcome.stderr);
    let pid = process["pid"].as_i64().unwrap();
    assert_eq!(decoded.processes.values().collect::<Vec<_>>(), [&(pid, "leaks".to_string())]);

    // The same samples as the JSON trace's `memory` counter, with the same figures.
    let json: BTreeMap<i64, &Value> = outcome
        .trace()
        .counters("memory")
        .filter(|event| event["pid"] == pid)
        .map(|event| (event["ts"].as_i64().unwrap() * 1000, &event["args"]))
        .collect();
    assert!(json.len() >= 2, "several samples: {json:?}");
    for level in LEVELS {
        let values = decoded.counter(pid, level);
        let stamps: BTreeSet<i64> = values.iter().map(|(ts, _)| *ts).collect();
        assert_eq!(stamps, json.keys().copied().collect(), "{level}: a value at every sample");
        for (ts, value) in values {
            assert_eq!(json[ts][level].as_i64(), Some(*value), "{level} at {ts} ns");
        }
    }
    // While the process ran with its leaks: the live heap exactly, and what the OS says it holds.
    let heap = decoded.counter(pid, "heap_live_bytes");
    let (at, _) = *heap
        .iter()
        .find(|(_, bytes)| *bytes == LEAKS_LIVE_BYTES)
        .unwrap_or_else(|| panic!("no sample with the fixture's {LEAKS_LIVE_BYTES} live bytes: {heap:?}"));
    assert!(heap.iter().all(|(_, bytes)| *bytes <= LEAKS_LIVE_BYTES), "{heap:?}");
    let rss = decoded.counter(pid, "rss_anon_bytes");
    assert!(
        rss.iter().any(|&(ts, bytes)| ts == at && bytes > 0),
        "resident anonymous memory at {at}: {rss:?}"
    );
}

#[test]
fn heap_profile_callstacks_carry_what_each_call_site_allocated() {
    let (outcome, decoded) = run_with_perfetto(Memtrace::new(), &fixture("leaks"));
    let pid = outcome.process()["pid"].as_i64().unwrap();
    assert_leaks_heap_profile(&decoded, pid);
}

/// Record once, report later: `memtrace report RUN.json --perfetto PATH` makes the same Perfetto
/// trace again from the summary: the same heap profile, the same levels at the same samples.
#[test]
fn the_perfetto_trace_is_made_again_from_the_summary() {
    let (outcome, recorded) = run_with_perfetto(Memtrace::new(), &fixture("leaks"));
    let pid = outcome.process()["pid"].as_i64().unwrap();
    let again = outcome.dir().join("again.pftrace");
    let report = Command::new(memtrace_tests::memtrace_bin())
        .arg("report")
        .arg(outcome.dir().join("summary.json"))
        .arg("--perfetto")
        .arg(&again)
        .output()
        .unwrap();
    assert!(report.status.success(), "{}", String::from_utf8_lossy(&report.stderr));
    let remade = read_trace(&again);
    assert_leaks_heap_profile(&remade, pid);
    for level in LEVELS {
        assert_eq!(remade.counter(pid, level), recorded.counter(pid, level), "{level}");
    }
}

fn assert_leaks_heap_profile(decoded: &Decoded, pid: i64) {
    let packet = heap_profile(&decoded.trace);
    let interned = packet.message("interned_data").expect("the profile's interned data");
    let function_names = interned_strings(interned, "function_names");
    let mapping_paths = interned_strings(interned, "mapping_paths");
    let mappings: BTreeMap<i64, &Message> =
        interned.messages("mappings").into_iter().map(|m| (m.number("iid").unwrap(), m)).collect();
    // Frame iid -> (function, mapping path).
    let frames: BTreeMap<i64, (String, String)> = interned
        .messages("frames")
        .into_iter()
        .map(|frame| {
            let function = function_names[&frame.number("function_name_id").unwrap()].clone();
            let mapping = mappings[&frame.number("mapping_id").unwrap()];
            let path: Vec<&str> =
                mapping.numbers("path_string_ids").iter().map(|id| mapping_paths[id].as_str()).collect();
            (frame.number("iid").unwrap(), (function, path.join("/")))
        })
        .collect();
    let callstacks: BTreeMap<i64, Vec<&(String, String)>> = interned
        .messages("callstacks")
        .into_iter()
        .map(|stack| {
            (stack.number("iid").unwrap(), stack.numbers("frame_ids").iter().map(|id| &frames[id]).collect())
        })
        .collect();

    let dumps: Vec<&Message> =
        packet.message("profile_packet").unwrap().messages("process_dumps").into_iter().collect();
    assert_eq!(dumps.len(), 1);
    assert_eq!(dumps[0].number("pid"), Some(pid));
    assert_eq!(dumps[0].string("heap_name"), Some("malloc"));
    for (function, allocations, allocated, frees, freed) in LEAKS_SITES {
        // The call site's samples: call stacks whose innermost frame (the last) is the function.
        let samples: Vec<&Message> = dumps[0]
            .messages("samples")
            .into_iter()
            .filter(|sample| {
                let stack = &callstacks[&sample.number("callstack_id").unwrap()];
                stack.last().is_some_and(|(name, _)| name == function)
            })
            .collect();
        assert_eq!(samples.len(), 1, "{function}: one call stack, {samples:?}");
        let sample = samples[0];
        let figure = |name: &str| sample.number(name).unwrap_or(0) as u64;
        assert_eq!(
            (figure("alloc_count"), figure("self_allocated"), figure("free_count"), figure("self_freed")),
            (allocations, allocated, frees, freed),
            "{function}"
        );
        let stack = &callstacks[&sample.number("callstack_id").unwrap()];
        let main = stack.iter().position(|(name, _)| name == "main").expect("main is on the stack");
        assert!(main < stack.len() - 1, "outermost frames first: {stack:?}");
        assert!(stack.last().unwrap().1.ends_with("leaks"), "the frame's mapping is the fixture: {stack:?}");
    }
}

#[test]
fn the_perfetto_trace_is_an_output_like_the_others() {
    let memtrace = Memtrace::new().without_default_outputs();
    let path = memtrace.dir().join("out");
    let outcome = memtrace.arg("-o").arg(&path).arg("--perfetto").arg(&path).command(&fixture("leaks")).run();
    outcome.assert_exit_code(2);
    outcome.assert_stderr_mentions(&["-o/--output", "--perfetto", "same file"]);
}

/// fixtures/usdt_subsystems.c's final totals (what it prints as `subsystem NAME BYTES`).
fn usdt_subsystems_totals() -> BTreeMap<String, i64> {
    let mut totals: BTreeMap<String, i64> = [
        ("pool-0", 5000),
        ("pool-1", 10000),
        ("pool-2", 15000),
        ("cache", 100 * 4096 - 5000),
        ("debt", -12345),
    ]
    .into_iter()
    .map(|(name, bytes)| (name.to_owned(), bytes))
    .collect();
    totals.insert("x".repeat(63), 64);
    totals
}

#[test]
fn every_subsystem_has_a_counter_track() {
    let include = format!("-I{}", workspace_root().join("include").display());
    let program = memtrace_tests::fixture_variant("usdt_subsystems", "perfetto", &[&include]);
    let (outcome, decoded) = run_with_perfetto(Memtrace::new(), &program);
    let pid = outcome.process()["pid"].as_i64().unwrap();
    for (name, bytes) in usdt_subsystems_totals() {
        let values = decoded.counter(pid, &format!("subsystem:{name}"));
        assert_eq!(values.last().map(|(_, value)| *value), Some(bytes), "subsystem:{name}: {values:?}");
        let json = outcome.trace().counters(&format!("subsystem:{name}")).count();
        assert_eq!(values.len(), json, "subsystem:{name}: a value wherever the JSON trace has one");
    }
    let subsystem_tracks = decoded.tracks.values().filter(|(_, name)| name.starts_with("subsystem:")).count();
    assert_eq!(subsystem_tracks, usdt_subsystems_totals().len());
}
