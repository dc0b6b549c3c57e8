//! Call stacks: the leak report, bytes per function, pprof and the flamegraph, against
//! fixtures/leaks.c built with frame pointers.

use std::{io::Read, process::Command};

use memtrace_tests::{fixture, Memtrace, Outcome, Spawned};
use serde_json::Value;

const TEXTURES_BYTES: u64 = 5 * 1000;
const TEXTURES_BLOCKS: u64 = 5;
const CACHE_BYTES: u64 = 3 * 4 * 64;
const CACHE_BLOCKS: u64 = 3;

fn leak_from<'a>(process: &'a Value, function: &str) -> Option<&'a Value> {
    process["leaks"].as_array()?.iter().find(|leak| leak["stack"][0] == function)
}

fn stack_names(leak: &Value) -> Vec<&str> {
    leak["stack"].as_array().unwrap().iter().map(|f| f.as_str().unwrap()).collect()
}

fn assert_leak(process: &Value, function: &str, bytes: u64, blocks: u64) {
    let leak = leak_from(process, function)
        .unwrap_or_else(|| panic!("no leak from {function} in {:#}", process["leaks"]));
    assert_eq!(leak["bytes"], bytes, "{leak:#}");
    assert_eq!(leak["allocations"], blocks, "{leak:#}");
    assert!(stack_names(leak).contains(&"main"), "the stack does not reach main: {leak:#}");
}

fn assert_both_leaks_and_no_temporary(outcome: &Outcome) {
    let process = outcome.process();
    assert_leak(process, "leak_textures", TEXTURES_BYTES, TEXTURES_BLOCKS);
    assert_leak(process, "leak_cache", CACHE_BYTES, CACHE_BLOCKS);
    let leaks = process["leaks"].as_array().unwrap();
    assert_eq!(leaks.len(), 2, "only the two leaking call sites: {leaks:#?}");
    assert!(leaks.iter().all(|leak| !stack_names(leak).contains(&"scratch")));
    assert_eq!(outcome.summary()["lost_events"], 0, "lost events; memtrace's stderr:\n{}", outcome.stderr);
}

fn function<'a>(process: &'a Value, name: &str) -> &'a Value {
    process["functions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == name)
        .unwrap_or_else(|| panic!("no function {name} in {:#}", process["functions"]))
}

#[test]
fn leaks_are_named_by_call_site_with_exact_bytes_and_counts() {
    let run = Memtrace::new();
    let pprof = run.dir().join("profile.pb.gz");
    let flamegraph = run.dir().join("live.svg");
    let outcome =
        run.arg("--pprof").arg(&pprof).arg("--flamegraph").arg(&flamegraph).command(&fixture("leaks")).run();
    outcome.assert_exit_code(0);
    assert_both_leaks_and_no_temporary(&outcome);

    let process = outcome.process();
    let textures = function(process, "leak_textures");
    assert_eq!(textures["live_exclusive_bytes"], TEXTURES_BYTES);
    assert_eq!(textures["live_inclusive_bytes"], TEXTURES_BYTES);
    let main = function(process, "main");
    assert_eq!(main["live_inclusive_bytes"], TEXTURES_BYTES + CACHE_BYTES);
    assert_eq!(main["live_exclusive_bytes"], 0);
    assert_eq!(main["allocated_inclusive_bytes"], TEXTURES_BYTES + CACHE_BYTES + 20 * 333);
    let scratch = function(process, "scratch");
    assert_eq!(scratch["allocated_exclusive_bytes"], 20 * 333);
    assert_eq!(scratch["live_inclusive_bytes"], 0);
    let innermost = &leak_from(process, "leak_textures").unwrap()["frames"][0];
    assert_eq!(innermost["file"], "leaks.c", "debug info gives file:line: {innermost:#}");
    assert!(innermost["line"].as_u64().is_some_and(|line| line > 0), "{innermost:#}");
    let report = &outcome.stderr;
    assert!(report.contains("leak: 5000 B in 5 blocks"), "{report}");

    let profile = pprof::Profile::read(&pprof);
    assert_eq!(profile.sample_types(), ["alloc_objects", "alloc_space", "inuse_objects", "inuse_space"]);
    assert_eq!(profile.total(3), (TEXTURES_BYTES + CACHE_BYTES) as i64, "inuse_space");
    assert_eq!(profile.total(2), (TEXTURES_BLOCKS + CACHE_BLOCKS) as i64, "inuse_objects");
    assert_eq!(profile.total(0), (TEXTURES_BLOCKS + CACHE_BLOCKS + 20) as i64, "alloc_objects");
    assert!(profile.strings.iter().any(|s| s == "leak_textures"));

    let svg = std::fs::read_to_string(&flamegraph).unwrap();
    assert!(svg.starts_with("<?xml") || svg.starts_with("<svg"), "not an SVG");
    assert!(svg.contains("leak_textures") && svg.contains("leak_cache"));
    assert!(!svg.contains("scratch"), "freed temporaries hold no live bytes");
}

#[test]
fn older_keeps_only_blocks_older_than_the_threshold() {
    let outcome = Memtrace::new().args(["--older", "1s", "--"]).arg(fixture("leaks")).arg("aged").run();
    outcome.assert_exit_code(0);
    let process = outcome.process();
    assert_leak(process, "leak_textures", TEXTURES_BYTES, TEXTURES_BLOCKS);
    assert!(
        leak_from(process, "leak_cache").is_none(),
        "leak_cache is 1.5 s younger: {:#}",
        process["leaks"]
    );
    let age = leak_from(process, "leak_textures").unwrap()["oldest_age_s"].as_f64().unwrap();
    assert!(age >= 1.5, "oldest leak_textures block is {age} s old");
}

#[test]
fn process_that_exits_before_memtrace_is_still_symbolized() {
    let mut early = Spawned::spawn({
        let mut command = Command::new(fixture("leaks"));
        command.arg("hold");
        command
    });
    early.wait_for_stdout("ready");
    let mut late = Spawned::spawn(Command::new(fixture("wait_stdin")));
    late.wait_for_stdout("ready");
    let mut memtrace =
        Memtrace::new().args(["--pid", &early.pid().to_string(), "--pid", &late.pid().to_string()]).spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    early.send(b"g");
    assert!(early.wait().success());
    let early_pid = early.pid();
    memtrace.wait_for_trace("the early process's final sample", |trace| {
        trace.counters("heap").any(|event| {
            event["pid"] == early_pid && event["args"]["live_bytes"] == TEXTURES_BYTES + CACHE_BYTES
        })
    });
    late.close_stdin();
    assert!(late.wait().success());
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    let processes = outcome.summary()["processes"].as_array().unwrap();
    let process = processes.iter().find(|p| p["pid"] == early_pid).unwrap();
    assert_leak(process, "leak_textures", TEXTURES_BYTES, TEXTURES_BLOCKS);
    assert_leak(process, "leak_cache", CACHE_BYTES, CACHE_BLOCKS);
}

#[test]
fn no_stacks_still_counts_exactly_but_names_no_leaks() {
    let outcome = Memtrace::new().arg("--no-stacks").command(&fixture("leaks")).run();
    outcome.assert_exit_code(0);
    let process = outcome.process();
    assert_eq!(process["live_bytes"], TEXTURES_BYTES + CACHE_BYTES);
    assert_eq!(process["allocations"], TEXTURES_BLOCKS + CACHE_BLOCKS + 20);
    assert_eq!(process["leaks"].as_array().unwrap().len(), 0);
}

/// An independent reader of profile.proto (field numbers from the upstream .proto), so the test
/// does not share memtrace's own encoder definitions.
mod pprof {
    use super::*;

    pub struct Profile {
        pub strings: Vec<String>,
        sample_types: Vec<i64>,
        samples: Vec<Vec<i64>>,
    }

    impl Profile {
        pub fn read(path: &std::path::Path) -> Self {
            let gzipped = std::fs::read(path).unwrap();
            let mut bytes = Vec::new();
            flate2::read::GzDecoder::new(&*gzipped).read_to_end(&mut bytes).expect("gzip");
            let mut profile = Profile { strings: Vec::new(), sample_types: Vec::new(), samples: Vec::new() };
            for (field, value) in fields(&bytes) {
                match (field, value) {
                    (1, Field::Bytes(value_type)) => {
                        let kind = fields(value_type).find(|(f, _)| *f == 1).map_or(0, |(_, v)| v.int());
                        profile.sample_types.push(kind);
                    }
                    (2, Field::Bytes(sample)) => profile.samples.push(sample_values(sample)),
                    (6, Field::Bytes(text)) => {
                        profile.strings.push(String::from_utf8(text.to_vec()).unwrap())
                    }
                    _ => {}
                }
            }
            profile
        }

        pub fn sample_types(&self) -> Vec<&str> {
            self.sample_types.iter().map(|&i| self.strings[i as usize].as_str()).collect()
        }

        pub fn total(&self, index: usize) -> i64 {
            self.samples.iter().map(|values| values[index]).sum()
        }
    }

    fn sample_values(sample: &[u8]) -> Vec<i64> {
        let mut values = Vec::new();
        for (field, value) in fields(sample) {
            match (field, value) {
                (2, Field::Bytes(packed)) => {
                    let mut rest = packed;
                    while !rest.is_empty() {
                        values.push(varint(&mut rest) as i64);
                    }
                }
                (2, Field::Int(v)) => values.push(v as i64),
                _ => {}
            }
        }
        values
    }

    #[derive(Clone, Copy)]
    pub enum Field<'a> {
        Int(u64),
        Bytes(&'a [u8]),
    }

    impl Field<'_> {
        fn int(self) -> i64 {
            match self {
                Field::Int(v) => v as i64,
                Field::Bytes(_) => panic!("expected an integer field"),
            }
        }
    }

    fn varint(bytes: &mut &[u8]) -> u64 {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = bytes[0];
            *bytes = &bytes[1..];
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                break;
            }
        }
        value
    }

    fn fields(mut bytes: &[u8]) -> impl Iterator<Item = (u64, Field<'_>)> {
        std::iter::from_fn(move || {
            if bytes.is_empty() {
                return None;
            }
            let key = varint(&mut bytes);
            let value = match key & 7 {
                0 => Field::Int(varint(&mut bytes)),
                2 => {
                    let len = varint(&mut bytes) as usize;
                    let (value, rest) = bytes.split_at(len);
                    bytes = rest;
                    Field::Bytes(value)
                }
                wire => panic!("unexpected wire type {wire} in a profile"),
            };
            Some((key >> 3, value))
        })
    }
}

/// --sample 2KiB on fixtures/sampled_leaks.c: three sites each leak 40,000,000 bytes (400000 x 100,
/// 10000 x 4000, 400 x 100000) and 200000 temporaries of 64 bytes are freed. Allocation counts
/// stay exact; each site's live bytes and blocks are estimates within 5% (thousands of samples
/// per site: one standard error is about 1%), and the summary says which figures are estimates.
#[test]
fn sampled_leaks_are_estimated_within_five_percent() {
    const SITE_BYTES: f64 = 40_000_000.0;
    let outcome = Memtrace::new().args(["--sample", "2KiB"]).command(&fixture("sampled_leaks")).run();
    outcome.assert_exit_code(0);
    let summary = outcome.summary();
    assert_eq!(summary["sampling"]["mean_bytes"], 2048, "{summary:#}");
    let estimated = summary["sampling"]["estimated"].as_array().unwrap();
    assert!(estimated.contains(&Value::from("live_bytes")) && estimated.contains(&Value::from("leaks")));
    let process = outcome.process();
    assert_eq!(process["allocations"], 400_000 + 10_000 + 400 + 200_000, "exact under sampling");
    assert_eq!(process["allocated_bytes"], 3 * 40_000_000 + 200_000 * 64, "exact under sampling");
    assert_eq!(process["lost_events"], 0, "{process:#}");
    for (site, blocks) in [("leak_small", 400_000.0), ("leak_medium", 10_000.0), ("leak_large", 400.0)] {
        let leak = leak_from(process, site).unwrap_or_else(|| panic!("no leak from {site}: {process:#}"));
        let bytes = leak["bytes"].as_f64().unwrap();
        let allocations = leak["allocations"].as_f64().unwrap();
        assert!((bytes / SITE_BYTES - 1.0).abs() < 0.05, "{site}: {bytes} bytes, not 40 MB within 5%");
        assert!((allocations / blocks - 1.0).abs() < 0.05, "{site}: {allocations} blocks, not {blocks}");
    }
    let live = process["live_bytes"].as_f64().unwrap();
    assert!((live / (3.0 * SITE_BYTES) - 1.0).abs() < 0.05, "live {live}");
    assert!(leak_from(process, "scratch").is_none(), "temporaries are not leaks: {process:#}");
}

/// 65,536 distinct stacks, then a leak, with stack tables of 16,384: memtrace empties them at every
/// sample, so they never fill although the run makes four times as many stacks. The fixture makes
/// them in batches of 8,192 and goes on once memtrace has sampled twice since (one whole sample
/// after the batch). Nothing is lost, and the leak has its stack.
#[test]
fn the_stack_table_never_fills() {
    let mut memtrace = Memtrace::new()
        .args(["--max-stacks", "16384", "--", &fixture("many_stacks").to_string_lossy(), "batches"])
        .spawn();
    for _ in 0..8 {
        memtrace.wait_for_stdout("batch");
        let seen = memtrace
            .wait_for_trace("a heap counter", |trace| trace.counters("heap").count() >= 1)
            .counters("heap")
            .count();
        memtrace.wait_for_trace("two more samples", |trace| trace.counters("heap").count() >= seen + 2);
        memtrace.send(b"g");
    }
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    let process = &outcome.summary()["processes"][0];
    assert_eq!(outcome.summary()["lost_events"], 0, "{process:#}");
    assert_eq!(process["allocations"], 65_537);
    assert_eq!(process["frees"], 65_536);
    let leak = &process["leaks"][0];
    assert_eq!((leak["bytes"].as_u64(), leak["allocations"].as_u64()), (Some(4096), Some(1)), "{leak:#}");
    assert_eq!(leak["stack"][0], "leak_after_churn", "{leak:#}");
    assert_eq!(leak["stack"][1], "main", "{leak:#}");
}
