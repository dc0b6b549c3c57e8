//! OTLP profiles, read by the OpenTelemetry project's own definitions (PyPI's opentelemetry-proto,
//! installed into a venv under target/ when missing, by tests/otlp_decode.py): `--otlp PATH` of a
//! run of fixtures/leaks.c holds its exact figures, one Profile per sample type under one
//! resource with the process's attributes (and so does `memtrace report RUN.json --otlp`); `memtrace serve --otlp-endpoint` POSTs the same to a
//! loopback receiver at URL/v1development/profiles with the headers OTLP/HTTP and the Collector
//! want; bad paths and URLs are said clearly.

use std::{net::TcpListener, process::Command, time::Instant};

use memtrace_tests::{
    fixture, memtrace_bin,
    otlp::decode,
    receiver::{header, receive},
    Memtrace, Spawned, DEADLINE, INTERVAL,
};
use serde_json::Value;

/// fixtures/leaks.c, by the function that called the allocator, as
/// (function, alloc_objects, alloc_space, inuse_objects, inuse_space):
/// leak_textures 5 x malloc(1000) never freed; leak_cache 3 x calloc(4, 64) = 3 x 256 never
/// freed; scratch 20 x malloc(333) = 6660 bytes, each freed.
const LEAKS: [(&str, i64, i64, i64, i64); 3] =
    [("leak_textures", 5, 5000, 5, 5000), ("leak_cache", 3, 768, 3, 768), ("scratch", 20, 6660, 0, 0)];

/// The sample types, in the order memtrace writes the profiles (and of the tuples above).
const SAMPLE_TYPES: [(&str, &str); 4] = [
    ("alloc_objects", "count"),
    ("alloc_space", "bytes"),
    ("inuse_objects", "count"),
    ("inuse_space", "bytes"),
];

/// The resource of the process `pid` in a decoded request.
fn resource_of(decoded: &Value, pid: u32) -> &Value {
    decoded["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|resource| resource["attributes"]["process.pid"] == pid)
        .unwrap_or_else(|| panic!("no resource with process.pid {pid} in {decoded}"))
}

/// A profile's values summed by the function that called the allocator (the leaf frame).
fn by_leaf(profile: &Value, function: &str) -> i64 {
    profile["samples"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|sample| sample["stack"][0] == function)
        .map(|sample| sample["values"][0].as_i64().unwrap())
        .sum()
}

/// The four profiles of the fixture's resource hold its figures exactly.
fn assert_leaks_figures(resource: &Value) {
    let profiles = resource["profiles"].as_array().unwrap();
    let types: Vec<(&str, &str)> = profiles
        .iter()
        .map(|p| (p["sample_type"][0].as_str().unwrap(), p["sample_type"][1].as_str().unwrap()))
        .collect();
    assert_eq!(types, SAMPLE_TYPES, "{resource}");
    for (kind, profile) in profiles.iter().enumerate() {
        for (function, alloc_objects, alloc_space, inuse_objects, inuse_space) in LEAKS {
            let expected = [alloc_objects, alloc_space, inuse_objects, inuse_space][kind];
            assert_eq!(
                by_leaf(profile, function),
                expected,
                "{function} in {}: {profile}",
                SAMPLE_TYPES[kind].0
            );
        }
        let total: i64 =
            profile["samples"].as_array().unwrap().iter().map(|s| s["values"][0].as_i64().unwrap()).sum();
        // 5 + 3 + 20 allocations, 5000 + 768 + 6660 bytes; 8 blocks, 5768 bytes live.
        assert_eq!(total, [28, 12428, 8, 5768][kind], "{}: {profile}", SAMPLE_TYPES[kind].0);
        assert!(profile["samples"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["stack"].as_array().unwrap().contains(&"main".into())));
        assert_eq!(profile["scope"], "memtrace");
        // Every allocation recorded: a period of 1 allocated byte.
        assert_eq!((&profile["period_type"][0], &profile["period"]), (&"allocated_bytes".into(), &1.into()));
    }
    let attributes = &resource["attributes"];
    assert_eq!(attributes["process.executable.name"], "leaks", "{attributes}");
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert_eq!(attributes["host.name"], host.trim(), "{attributes}");
}

#[test]
fn a_run_writes_the_fixture_heap_profile_as_an_otlp_request() {
    let memtrace = Memtrace::new();
    let path = memtrace.dir().join("heap.otlp.pb");
    let started = std::time::SystemTime::now();
    let outcome = memtrace.arg("--otlp").arg(&path).command(&fixture("leaks")).run();
    outcome.assert_exit_code(0);
    outcome.assert_stderr_mentions(&["OTLP profiles written to"]);
    let pid = outcome.process()["pid"].as_u64().unwrap() as u32;
    let decoded = decode(&std::fs::read(&path).expect("the --otlp file"));
    assert_eq!(decoded["resources"].as_array().unwrap().len(), 1, "one resource per process: {decoded}");
    let resource = resource_of(&decoded, pid);
    assert_leaks_figures(resource);
    // The profile covers the run: from the start of tracing, not before memtrace started.
    let profile = &resource["profiles"][0];
    let start = started.duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let time = profile["time_unix_nano"].as_u64().unwrap();
    assert!(time >= start && profile["duration_nano"].as_u64().unwrap() > 0, "{profile}");
    // `memtrace report` makes the same request again from the run's summary.
    let again = outcome.dir().join("again.otlp.pb");
    let report = Command::new(memtrace_bin())
        .arg("report")
        .arg(outcome.dir().join("summary.json"))
        .arg("--otlp")
        .arg(&again)
        .output()
        .expect("running memtrace report");
    assert!(report.status.success(), "{}", String::from_utf8_lossy(&report.stderr));
    assert_leaks_figures(resource_of(
        &decode(&std::fs::read(&again).expect("the report's --otlp file")),
        pid,
    ));
}

#[test]
fn a_sampled_run_states_its_sampling() {
    let memtrace = Memtrace::new();
    let path = memtrace.dir().join("heap.otlp.pb");
    let outcome = memtrace.args(["--sample", "4096", "--otlp"]).arg(&path).command(&fixture("leaks")).run();
    outcome.assert_exit_code(0);
    let decoded = decode(&std::fs::read(&path).expect("the --otlp file"));
    let pid = outcome.process()["pid"].as_u64().unwrap() as u32;
    for profile in resource_of(&decoded, pid)["profiles"].as_array().unwrap() {
        assert_eq!(
            (&profile["period_type"][0], &profile["period"]),
            (&"allocated_bytes".into(), &4096.into())
        );
        let note = profile["attributes"]["memtrace.sampling"].as_str().unwrap_or_default();
        assert!(note.contains("estimates") && note.contains("4096"), "{profile}");
    }
}

#[test]
fn serve_posts_otlp_profiles_to_an_endpoint() {
    let receiver = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/otel", receiver.local_addr().unwrap());
    let mut target = Spawned::spawn({
        let mut command = Command::new(fixture("leaks"));
        command.arg("linger");
        command
    });
    target.wait_for_stdout("ready");
    let pid = target.pid();
    let mut memtrace = Memtrace::new()
        .without_default_outputs()
        .args(["serve", "--listen", "127.0.0.1:0", "-i", INTERVAL, "--pid", &pid.to_string()])
        .args(["--otlp-endpoint", &url, "--push-interval", "1s"])
        .spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    target.send(b"g");
    target.wait_for_stdout("leaked");
    // The first pushes may come before the fixture's leaks; a later one has them all.
    let deadline = Instant::now() + DEADLINE;
    let decoded = loop {
        let pushed = receive(&receiver, "200 OK");
        let head = pushed.head.to_ascii_lowercase();
        assert!(head.starts_with("post /otel/v1development/profiles http/1.1\r\n"), "{}", pushed.head);
        assert_eq!(header(&head, "content-type"), Some("application/x-protobuf"), "{}", pushed.head);
        assert_eq!(header(&head, "otlp-profiles-development-version"), Some("1"), "{}", pushed.head);
        let decoded = decode(&pushed.body);
        let inuse = &resource_of(&decoded, pid)["profiles"][3];
        if by_leaf(inuse, "leak_cache") == 768 {
            break decoded;
        }
        assert!(Instant::now() < deadline, "no push had the fixture's leaks: {decoded}");
    };
    assert_leaks_figures(resource_of(&decoded, pid));
    target.close_stdin();
    memtrace.interrupt();
    memtrace.finish().assert_exit_code(0);
}

#[test]
fn bad_otlp_outputs_are_said_clearly() {
    let memtrace = Memtrace::new();
    let outcome = memtrace.args(["--otlp", "/nonexistent-dir/heap.pb"]).command(&fixture("leaks")).run();
    outcome.assert_exit_code(1);
    let error = outcome.error_line();
    assert!(error.contains("/nonexistent-dir/heap.pb") && error.contains("--otlp"), "{}", outcome.stderr);
    for url in ["ftp://127.0.0.1:4318", "127.0.0.1:4318", "https://collector:4318"] {
        let outcome =
            Memtrace::new().without_default_outputs().args(["serve", "--all", "--otlp-endpoint", url]).run();
        outcome.assert_exit_code(2);
        assert!(outcome.stderr.contains(url) && outcome.stderr.contains("http://"), "{}", outcome.stderr);
    }
}
