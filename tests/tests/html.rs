//! `--html PATH`: the report is one self-contained file that headless Chromium loads with no
//! console error and no network request, shows the run's figures, zooms its flamegraph on click,
//! and stays quick with tens of thousands of stacks. Each test keeps a screenshot under
//! target/html-report-*.png for a person to look at.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use memtrace_tests::{chromium::Chromium, fixture, memtrace_bin, workspace_root, Memtrace};
use serde_json::{json, Value};

/// Opens the report, fails on any console error or request outside the file, and returns what
/// the page says it drew (`window.memtraceReport`) once it is ready, within `bound`.
fn load(chromium: &mut Chromium, page: &Path, bound: Duration) -> Value {
    let started = Instant::now();
    chromium.open(page);
    let report = chromium.evaluate("window.memtraceReport");
    let took = started.elapsed();
    eprintln!("{} loaded and drawn in {took:?} (script: {} ms)", page.display(), report["ms"]);
    assert_eq!(
        report["ready"],
        true,
        "the report did not finish drawing: {report}\n{:#?}",
        chromium.errors()
    );
    assert!(took < bound, "loading {} took {took:?}, more than {bound:?}", page.display());
    assert_eq!(chromium.errors(), Vec::<String>::new(), "the page logged errors");
    let page_url = format!("file://{}", page.canonicalize().unwrap().display());
    let outside: Vec<String> = chromium.requests().into_iter().filter(|url| *url != page_url).collect();
    assert_eq!(outside, Vec::<String>::new(), "the page made requests beyond itself");
    report
}

fn screenshot(chromium: &mut Chromium, name: &str) -> PathBuf {
    let path = workspace_root().join("target").join(format!("html-report-{name}.png"));
    chromium.screenshot(&path);
    eprintln!("screenshot: {}", path.display());
    path
}

/// Clicks the flamegraph canvas at (x, y) CSS pixels from its corner.
fn click_flamegraph(chromium: &mut Chromium, x: u32, y: u32) {
    chromium.evaluate(&format!(
        "(() => {{ const c = document.getElementById('flamegraph'); const r = c.getBoundingClientRect(); \
         c.dispatchEvent(new MouseEvent('click', {{clientX: r.left + {x}, clientY: r.top + {y}, bubbles: true}})); }})()"
    ));
}

/// fixtures/leaks.c: leak_textures leaks 5 x 1000 B, leak_cache 3 x 256 B, scratch frees all
/// 20 x 333 B it allocates.
#[test]
fn the_report_shows_a_run_offline() {
    let memtrace = Memtrace::new();
    let page = memtrace.dir().join("report.html");
    let outcome = memtrace.arg("--html").arg(&page).command(&fixture("leaks")).run();
    outcome.assert_exit_code(0);
    outcome.assert_stderr_mentions(&["HTML report written to"]);
    let html = fs::read_to_string(&page).unwrap();
    for outside in ["<script src", "<link", "http://", "https://"] {
        assert!(!html.contains(outside), "the page refers to something outside it: {outside}");
    }

    let mut chromium = Chromium::start();
    let report = load(&mut chromium, &page, Duration::from_secs(30));
    assert_eq!(report["processes"], 1);
    let text = chromium.evaluate("document.body.innerText").as_str().unwrap().to_owned();
    for shown in [
        "Memory by level",
        "Timeline",
        "Flamegraph",
        "Heap peak",
        "Temporary allocations",
        "leak_textures",
        "leak_cache",
        "4.88 KiB", // 5000 B leaked by leak_textures
        "768 B",    // leaked by leak_cache
        "5.63 KiB", // 5768 B live in all
        "dark memory",
    ] {
        assert!(text.contains(shown), "the page does not show {shown:?}:\n{text}");
    }
    for canvas in ["treemap", "timeline", "flamegraph"] {
        let drawn = chromium.evaluate(&format!("document.getElementById('{canvas}').height"));
        assert!(drawn.as_u64().unwrap_or(0) > 1, "the {canvas} was not drawn");
    }
    assert!(report["flameFrames"].as_u64().unwrap() > 2, "{report}");
    assert!(report["flameZoom"].as_str().unwrap().ends_with("all stacks"), "{report}");
    screenshot(&mut chromium, "leaks");

    // A click on the second row zooms on the widest outermost frame; on the top bar, back out.
    click_flamegraph(&mut chromium, 3, 17 + 8);
    let zoomed = chromium.evaluate("window.memtraceReport.flameZoom");
    assert!(!zoomed.as_str().unwrap().ends_with("all stacks"), "the click did not zoom: {zoomed}");
    click_flamegraph(&mut chromium, 3, 8);
    let back = chromium.evaluate("window.memtraceReport.flameZoom");
    assert!(back.as_str().unwrap().ends_with("all stacks"), "the top bar did not zoom out: {back}");
    chromium.evaluate("document.querySelectorAll('#flamegraph-metrics button')[1].click()");
    assert_eq!(chromium.evaluate("window.memtraceReport.flameMetric"), "allocated_bytes");
    assert_eq!(chromium.errors(), Vec::<String>::new(), "the page logged errors while used");
}

/// A run in windows says so atop the page, with the weight its heap figures were scaled by (the
/// run ends inside its first window: 1.00).
#[test]
fn a_windowed_run_says_its_figures_are_scaled() {
    let memtrace = Memtrace::new();
    let page = memtrace.dir().join("report.html");
    let outcome = memtrace.args(["--window", "1m/1h", "--html"]).arg(&page).command(&fixture("leaks")).run();
    outcome.assert_exit_code(0);
    let mut chromium = Chromium::start();
    load(&mut chromium, &page, Duration::from_secs(30));
    let text = chromium.evaluate("document.body.innerText").as_str().unwrap().to_owned();
    let said = "Allocations probed in windows of 60.000 s every 3600.000 s";
    assert!(text.contains(said), "the page does not say {said:?}:\n{text}");
    assert!(text.contains("scaled by 1.00"), "{text}");
    assert!(text.contains("leak_textures"), "{text}");
}

/// fixtures/many_stacks.c: 65,536 distinct stacks 17 frames deep, each allocating 64 bytes once.
#[test]
fn a_report_of_many_stacks_loads_in_bounded_time() {
    let memtrace = Memtrace::new();
    let page = memtrace.dir().join("report.html");
    let outcome = memtrace.arg("--html").arg(&page).command(&fixture("many_stacks")).run();
    outcome.assert_exit_code(0);
    let stacks = outcome.summary()["processes"][0]["stacks"].as_array().map_or(0, Vec::len);
    assert!(stacks > 65_000, "the summary has {stacks} stacks");

    let mut chromium = Chromium::start();
    load(&mut chromium, &page, Duration::from_secs(30));
    chromium.evaluate("document.querySelectorAll('#flamegraph-metrics button')[1].click()");
    let report = chromium.evaluate("window.memtraceReport");
    assert_eq!(report["flameMetric"], "allocated_bytes");
    // The page is at most 1400 pixels wide and the stacks 20 frames deep: frames narrower than a
    // pixel are not drawn, so far fewer than the 65,536 x 17 of the tree.
    let drawn = report["flameFrames"].as_u64().unwrap();
    assert!((100..=1400 * 24).contains(&drawn), "{drawn} frames drawn");
    screenshot(&mut chromium, "many-stacks");
    assert_eq!(chromium.errors(), Vec::<String>::new());
}

/// A saved run of 100,000 distinct stacks (written here, as `--summary` writes them), made into
/// a report by `memtrace report`, loads without freezing the page.
#[test]
fn a_flamegraph_of_100000_stacks_stays_quick() {
    let dir = tempfile::Builder::new()
        .prefix("memtrace-html-")
        .tempdir_in(workspace_root().join("target"))
        .unwrap();
    let summary = dir.path().join("run.json");
    let started = Instant::now();
    fs::write(&summary, synthetic_run(100_000).to_string()).unwrap();
    eprintln!("wrote the run in {:?}", started.elapsed());
    let page = dir.path().join("report.html");
    let started = Instant::now();
    let output =
        Command::new(memtrace_bin()).arg("report").arg(&summary).arg("--html").arg(&page).output().unwrap();
    assert!(output.status.success(), "memtrace report failed:\n{}", String::from_utf8_lossy(&output.stderr));
    eprintln!("memtrace report made the page in {:?}", started.elapsed());

    let mut chromium = Chromium::start();
    let report = load(&mut chromium, &page, Duration::from_secs(30));
    assert_eq!(report["processes"], 51);
    let drawn = report["flameFrames"].as_u64().unwrap();
    assert!((100..=1400 * 24).contains(&drawn), "{drawn} frames drawn");
    let text = chromium.evaluate("document.body.innerText").as_str().unwrap().to_owned();
    for shown in ["The live heap was highest at", "subsystem cache", "100,000 stacks hold"] {
        assert!(text.contains(shown), "the page does not show {shown:?}");
    }
    screenshot(&mut chromium, "100000-stacks");
}

/// A summary of one process whose `count` stacks are distinct paths through a tree of 10 levels
/// below main, each holding a different number of live bytes; and of 50 small processes, as a
/// system-wide run has them, the first of which had the big one's pid before it (retired).
fn synthetic_run(count: u32) -> Value {
    let mut frames =
        vec![json!({"function": "main", "file": "app.c", "line": 1, "module": "/app", "offset": 16})];
    for level in 0..10 {
        for branch in 0..4 {
            frames.push(json!({"function": format!("level{level}_branch{branch}"), "file": null,
                               "line": null, "module": "/app", "offset": 32 + level * 4 + branch}));
        }
    }
    let stacks: Vec<Value> = (0..count)
        .map(|i| {
            // Innermost first: 10 levels chosen by the base-4 digits of i, then main.
            let mut ids: Vec<u32> =
                (0..10).rev().map(|level| 1 + level * 4 + (i >> (2 * level)) % 4).collect();
            ids.push(0);
            let bytes = 16 + u64::from(i % 1000);
            json!({"frame_ids": ids, "allocations": 1, "allocated_bytes": bytes, "live_allocations": 1,
                   "live_bytes": bytes, "temporary_allocations": 0, "temporary_bytes": 0,
                   "leaked_bytes": bytes, "leaked_allocations": 1, "oldest_age_s": 1.0})
        })
        .collect();
    let mut processes: Vec<Value> = (0..50u32)
        .map(|n| synthetic_process(if n == 0 { 4242 } else { 5000 + n }, &format!("small{n}"), &stacks[..1]))
        .collect();
    let mut big = synthetic_process(4242, "synthetic", &stacks);
    big["peak"] = json!({"live_bytes": big["live_bytes"], "at_s": 0.5, "stacks": [
        {"live_bytes": 1015, "live_allocations": 1, "stack": ["level9_branch0", "main"], "frame_ids": [37, 0]}]});
    processes.push(big);
    json!({"version": 1, "duration_s": 1.0, "lost_events": 0, "processes": processes, "frame_table": frames})
}

fn synthetic_process(pid: u32, comm: &str, stacks: &[Value]) -> Value {
    let live: u64 = stacks.iter().map(|s| s["live_bytes"].as_u64().unwrap()).sum();
    let levels = json!({"rss_anon_bytes": live * 2, "rss_file_bytes": 1 << 20, "rss_shmem_bytes": 0,
                        "swap_bytes": 0, "heap_live_bytes": live, "allocator_held_bytes": live + 4096,
                        "heap_overhead_bytes": 4096, "mapped_anon_bytes": 0, "dark_bytes": live});
    json!({
        "pid": pid, "comm": comm, "allocator": "/lib/libc.so.6", "allocator_kind": "glibc", "exited": true,
        "allocations": stacks.len(), "frees": 0, "allocated_bytes": live, "freed_bytes": 0,
        "live_allocations": stacks.len(), "live_bytes": live, "peak_live_bytes": live, "untracked_frees": 0,
        "failed_allocations": 0, "lost_events": 0, "rss_bytes": live * 2 + (1 << 20), "memory": levels,
        "temporary_allocations": 0, "temporary_bytes": 0, "unwind_stops": {}, "subsystems": {"cache": 4096},
        "usdt": {}, "leaks": [], "functions": [], "stacks": stacks,
        "timeline": [{"ts_us": 0, "memory": levels, "subsystems": {"cache": 1024}},
                     {"ts_us": 1_000_000, "memory": levels, "subsystems": {"cache": 4096}}],
    })
}

/// fixtures/arenas.c kept untrimmed: the treemap's outermost box is the process's resident
/// anonymous memory and swap, its owners inside (the allocator holding the live heap by stack and
/// its free resident pages by size class, dark memory its own box), the page says in words what
/// malloc_trim(0) would return, and `memtrace report` draws the same from the saved summary.
#[test]
fn the_treemap_holds_every_resident_byte_by_owner() {
    let memtrace = Memtrace::new().args(["--max-allocations", "65536"]);
    let page = memtrace.dir().join("report.html");
    let mut run = memtrace.arg("--html").arg(&page).command(&fixture("arenas")).arg("keep").spawn();
    run.wait_for_stdout("ready");
    let fresh = |trace: &memtrace_tests::Trace| {
        trace.counters("memory").any(|counter| counter["args"].get("allocator_free_resident_bytes").is_some())
    };
    // The free pool, measured after the program said it was ready (its blocks are all made then).
    let before = run.wait_for_trace("a trace", |_| true).counters("memory").count();
    run.wait_for_trace("a measured free pool after ready", |trace| {
        trace
            .counters("memory")
            .skip(before + 1)
            .any(|c| c["args"].get("allocator_free_resident_bytes").is_some())
            && fresh(trace)
    });
    run.send(b"x");
    let outcome = run.finish();
    outcome.assert_exit_code(0);
    let memory = &outcome.process()["memory"];
    let anonymous = memory["rss_anon_bytes"].as_u64().unwrap() + memory["swap_bytes"].as_u64().unwrap();

    let mut chromium = Chromium::start();
    let report = load(&mut chromium, &page, Duration::from_secs(30));
    let root = &report["treemap"][0];
    assert_eq!(root["value"], anonymous, "the outermost box is rss_anon + swap: {root}");
    let names: Vec<&str> =
        root["children"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    // At its exit: its threads and their stacks went before the process's memory was counted.
    assert!(names.contains(&"allocator") && names.contains(&"static data"), "{root}");
    let allocator = root["children"].as_array().unwrap().iter().find(|c| c["name"] == "allocator").unwrap();
    let inside: Vec<&str> =
        allocator["children"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert!(inside.starts_with(&["heap live", "free (resident)"]), "{allocator}");
    // The free pool's boxes are its size classes, as the summary has them: each thread freed 3 of
    // every 4 blocks of 4096 bytes, gaps of 8 KiB and more.
    let pool = &allocator["children"][1];
    assert_eq!(pool["value"], memory["allocator_free_resident_bytes"], "{pool}");
    let classes: Vec<&str> =
        pool["children"].as_array().unwrap().iter().map(|c| c.as_str().unwrap()).collect();
    let resident =
        memory["allocator_free_by_size"].as_array().unwrap().iter().filter(|c| c["resident_bytes"] != 0);
    assert_eq!(classes.len(), resident.count(), "a box per resident size class: {pool}");
    assert!(classes.contains(&"gaps of 8.00 KiB+"), "{pool}");
    let sum: f64 = root["children"].as_array().unwrap().iter().map(|c| c["value"].as_f64().unwrap()).sum();
    assert_eq!(sum as u64, anonymous, "the owners add up to the box: {root}");
    let text = chromium.evaluate("document.body.innerText").as_str().unwrap().to_owned();
    assert!(text.contains("(malloc_trim(0) would return them);"), "{text}");
    screenshot(&mut chromium, "arenas");

    let summary = outcome.dir().join("summary.json");
    let again = outcome.dir().join("again.html");
    let output =
        Command::new(memtrace_bin()).arg("report").arg(&summary).arg("--html").arg(&again).output().unwrap();
    assert!(output.status.success(), "memtrace report failed:\n{}", String::from_utf8_lossy(&output.stderr));
    let redrawn = load(&mut Chromium::start(), &again, Duration::from_secs(30));
    assert_eq!(redrawn["treemap"], report["treemap"], "memtrace report draws the saved run the same");
}
