//! The demo of `cargo xtask demo` (examples/demo.c, a small service, and examples/demo.py, the
//! python3 child it starts), traced the way xtask traces it: every section of the report shows what
//! the sources' header comments say it must (the session leak, the temporary hot spot, the arenas
//! and their free pool, the dumper's subsystem growing, the Python functions), and the HTML report
//! loads in headless Chromium with no error and no request outside it. Its screenshot is the
//! README's, docs/src/images/report.png, made again by every run of this test.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use memtrace_tests::{chromium::Chromium, leak_stack, leak_through, workspace_root, Memtrace, Outcome};
use serde_json::Value;

/// examples/demo.c: remember_session keeps 960 records of 2,048 bytes (every 10th of 9,600
/// requests), and its dumper reports them as the subsystem `sessions`.
const SESSIONS: u64 = 960;
const SESSION_BYTES: u64 = 960 * 2048;
/// examples/demo.c: parse_request's 9,600 scratch buffers of 1,200 bytes, each freed at once.
const PARSES: u64 = 9600;
const SCRATCH_BYTES: u64 = 9600 * 1200;
/// examples/demo.c: build_response's temporary allocations, each batch's last response (freed
/// first by send_responses): one a batch of 24, in 4 workers.
const BATCH_ENDS: u64 = 24 * 4;
/// examples/demo.c: parse_request's 9,600 and build_response's 96.
const TEMPORARIES: u64 = PARSES + BATCH_ENDS;
/// examples/demo.c: the main thread's arena and one per worker thread.
const ARENAS: u64 = 5;
/// examples/demo.py: load_catalog keeps 64 bytearrays of 8,192 bytes (mallocs of 8,193) from its
/// line 19, called from load_service's line 31.
const CATALOG_ITEMS: u64 = 64;
const CATALOG_BYTES: u64 = 64 * 8193;

/// Compiles examples/demo.c as xtask's compile_c does, into `dir`.
fn compile_demo(dir: &Path) -> PathBuf {
    let root = workspace_root();
    let program = dir.join("demo");
    let output = Command::new("cc")
        .args(["-O2", "-g", "-fno-omit-frame-pointer", "-Wall", "-pthread", "-o"])
        .arg(&program)
        .arg(root.join("examples/demo.c"))
        .arg(format!("-I{}", root.join("include").display()))
        .output()
        .expect("running cc");
    assert!(
        output.status.success(),
        "compiling the demo failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // On disk before a probe reads it (see memtrace_tests::fixture_variant).
    fs::File::open(&program).and_then(|file| file.sync_all()).expect("flushing the demo program");
    program
}

/// `memtrace --interval 250ms --output T --summary S --html H -- demo examples/demo.py`, as
/// `cargo xtask demo` runs it; exits 0. Returns the outcome and the report's path.
fn trace_the_demo() -> (Outcome, PathBuf) {
    let memtrace = Memtrace::new().without_default_outputs();
    let dir = memtrace.dir().to_owned();
    let demo = compile_demo(&dir);
    let script = workspace_root().join("examples/demo.py");
    let page = dir.join("report.html");
    let outcome = memtrace
        .args(["--interval", "250ms", "--output"])
        .arg(dir.join("trace.json"))
        .arg("--summary")
        .arg(dir.join("summary.json"))
        .arg("--html")
        .arg(&page)
        .arg("--")
        .arg(&demo)
        .arg(&script)
        .run();
    outcome.assert_exit_code(0);
    assert_eq!(outcome.summary()["lost_events"], 0, "the run lost events:\n{}", outcome.stderr);
    (outcome, page)
}

/// The function names of a summary stack's frames, innermost first.
fn functions<'a>(summary: &'a Value, stack: &'a Value) -> Vec<&'a str> {
    let ids = stack["frame_ids"].as_array().expect("a stack's frame_ids");
    ids.iter()
        .map(|id| {
            let frame = &summary["frame_table"][id.as_u64().expect("a frame id") as usize];
            frame["function"].as_str().unwrap_or("?")
        })
        .collect()
}

/// The sum of `field` over `process`'s stacks that pass through `function`, and how many they are.
fn through(summary: &Value, process: &Value, function: &str, field: &str) -> (u64, usize) {
    let stacks: Vec<&Value> = process["stacks"]
        .as_array()
        .expect("the process's stacks")
        .iter()
        .filter(|stack| functions(summary, stack).contains(&function))
        .collect();
    (stacks.iter().map(|stack| stack[field].as_u64().unwrap_or(0)).sum(), stacks.len())
}

/// The leak (growing, reported by the dumper too) and the temporary hot spot of the service.
fn assert_service_heap(outcome: &Outcome) {
    let summary = outcome.summary();
    let demo = outcome.process_named("demo");
    let leak = leak_through(demo, "remember_session");
    assert_eq!((leak["bytes"].as_u64(), leak["allocations"].as_u64()), (Some(SESSION_BYTES), Some(SESSIONS)));
    let stack = leak_stack(leak);
    assert!(stack.starts_with(&["remember_session", "handle_request", "worker_main"]), "{stack:?}");
    assert_eq!(
        demo["leaks"][0]["bytes"].as_u64(),
        Some(SESSION_BYTES),
        "the biggest leak: {:#}",
        demo["leaks"]
    );

    // The process's temporary allocations are exact: parse_request's, and one a batch of
    // build_response's (each batch's last response, freed first by send_responses).
    assert_eq!(demo["temporary_allocations"].as_u64(), Some(TEMPORARIES), "{demo:#}");
    assert_eq!(through(summary, demo, "parse_request", "allocations"), (PARSES, 1), "one stack");
    assert_eq!(through(summary, demo, "parse_request", "allocated_bytes").0, SCRATCH_BYTES);
    assert_eq!(through(summary, demo, "parse_request", "live_bytes").0, 0);
    // The hot spot: every parse_request allocation a temporary one, its stack the one with the
    // most. (A worker's first batches may be walked before the unwind tables are in, a stack cut
    // short that memtrace folds into the whole one: every figure of it, temporaries too.)
    assert_eq!(through(summary, demo, "parse_request", "temporary_allocations").0, PARSES);
    assert_eq!(through(summary, demo, "build_response", "temporary_allocations").0, BATCH_ENDS);
    let hottest = demo["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .max_by_key(|stack| stack["temporary_allocations"].as_u64().unwrap_or(0))
        .expect("the process's stacks");
    assert_eq!(functions(summary, hottest)[0], "parse_request", "the hot spot: {hottest:#}");
}

/// Five arenas, and a free pool of resident pages in them, its size classes adding up.
fn assert_arenas_and_free_pool(demo: &Value) {
    let memory = &demo["memory"];
    assert_eq!(memory["allocator_arenas"].as_u64(), Some(ARENAS), "{memory:#}");
    let free = memory["allocator_free_resident_bytes"].as_u64().expect("a measured free pool");
    assert!(free > 0, "no resident free pages between the batches' sessions: {memory:#}");
    let classes = memory["allocator_free_by_size"].as_array().expect("the free pool by size class");
    let resident: u64 = classes.iter().map(|class| class["resident_bytes"].as_u64().unwrap()).sum();
    assert_eq!(resident, free, "the size classes add up to the free pool: {memory:#}");
}

/// The dumper's `sessions` ends at the leak's bytes, having grown in steps over the run.
fn assert_subsystem(outcome: &Outcome) {
    let demo = outcome.process_named("demo");
    assert_eq!(demo["subsystems"]["sessions"].as_u64(), Some(SESSION_BYTES), "{:#}", demo["subsystems"]);
    let values: Vec<u64> = outcome
        .trace()
        .counters("subsystem:sessions")
        .map(|counter| counter["args"]["bytes"].as_u64().expect("a subsystem counter's bytes"))
        .collect();
    assert!(values.windows(2).all(|pair| pair[0] <= pair[1]), "the sessions only grow: {values:?}");
    assert_eq!(values.last(), Some(&SESSION_BYTES), "{values:?}");
    let mut steps = values.clone();
    steps.dedup();
    assert!(steps.len() >= 3, "the trace shows the sessions growing over the run: {values:?}");
}

/// The python3 child's catalog, named by demo.py's functions and lines.
fn assert_python(outcome: &Outcome) {
    let python = outcome.process_named("python3");
    let script = workspace_root().join("examples/demo.py");
    let script = script.display();
    let leak = leak_through(python, &format!("load_catalog ({script}:19)"));
    assert_eq!(
        (leak["bytes"].as_u64(), leak["allocations"].as_u64()),
        (Some(CATALOG_BYTES), Some(CATALOG_ITEMS))
    );
    let stack = leak_stack(leak);
    let at = stack.iter().position(|frame| frame.starts_with("load_catalog (")).unwrap();
    assert_eq!(stack[at + 1], format!("load_service ({script}:31)"), "{stack:?}");
}

/// Opens the report as tests/tests/html.rs does: drawn, no console error, no request beyond the
/// file; returns its text.
fn load(chromium: &mut Chromium, page: &Path) -> String {
    let started = Instant::now();
    chromium.open(page);
    let report = chromium.evaluate("window.memtraceReport");
    assert_eq!(
        report["ready"],
        true,
        "the report did not finish drawing: {report}\n{:#?}",
        chromium.errors()
    );
    assert!(started.elapsed() < Duration::from_secs(30), "the report took {:?}", started.elapsed());
    assert_eq!(report["processes"], 2, "{report}");
    assert_eq!(chromium.errors(), Vec::<String>::new(), "the page logged errors");
    let page_url = format!("file://{}", page.canonicalize().unwrap().display());
    let outside: Vec<String> = chromium.requests().into_iter().filter(|url| *url != page_url).collect();
    assert_eq!(outside, Vec::<String>::new(), "the page made requests beyond itself");
    chromium.evaluate("document.body.innerText").as_str().unwrap().to_owned()
}

#[test]
fn the_demo_gives_every_section_of_the_report_its_true_content() {
    let (outcome, page) = trace_the_demo();
    assert_service_heap(&outcome);
    assert_arenas_and_free_pool(outcome.process_named("demo"));
    assert_subsystem(&outcome);
    assert_python(&outcome);

    let mut chromium = Chromium::start();
    let text = load(&mut chromium, &page);
    for shown in ["remember_session", "parse_request", "sessions", "Temporary allocations", "Heap peak"] {
        assert!(text.contains(shown), "the page does not show {shown:?}:\n{text}");
    }
    let images = workspace_root().join("docs/src/images");
    fs::create_dir_all(&images).unwrap();
    let shot = images.join("report.png");
    chromium.screenshot_top(&shot, 2400.0);
    eprintln!("screenshot: {}", shot.display());
}
