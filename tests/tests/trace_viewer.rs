//! The trace opens cleanly in the trace viewer behind chrome://tracing (catapult's, built from
//! source: tests/viewer/), driven in headless Chromium: the viewer's importer raises no warning,
//! and the model it builds holds the figures the fixture's source fixes, with a heap subsystem
//! counted once in the memory dumps.

use std::{
    io::{Read, Write},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use base64::Engine;
use flate2::{read::GzDecoder, write::GzEncoder, Compression};
use memtrace_tests::{chromium::Chromium, workspace_root, Memtrace};
use serde_json::Value;

/// Where trace2html put the trace, and what follows it.
const DATA_START: &str = "<script id=\"viewer-data\" type=\"text/plain\">\n";
const DATA_END: &str = "\n</script>";

/// The viewer's page with `trace` in it, as trace2html would have written it.
fn viewer_page(trace: &[u8], page: &Path) {
    let template = workspace_root().join("tests/viewer/trace-viewer.html.gz");
    let mut html = String::new();
    GzDecoder::new(std::fs::File::open(&template).expect("the vendored viewer"))
        .read_to_string(&mut html)
        .expect("the vendored viewer is gzipped text");
    let start = html.find(DATA_START).expect("the viewer has a viewer-data script") + DATA_START.len();
    let end = start + html[start..].find(DATA_END).expect("the viewer-data script ends");
    let mut gzipped = GzEncoder::new(Vec::new(), Compression::fast());
    gzipped.write_all(trace).unwrap();
    let data = base64::engine::general_purpose::STANDARD.encode(gzipped.finish().unwrap());
    html.replace_range(start..end, &data);
    std::fs::write(page, html).unwrap_or_else(|err| panic!("writing {}: {err}", page.display()));
}

/// What the viewer made of the trace, once its import is done: the import warnings; per process,
/// the last value of each counter's series; per process, every allocator dump of the last global
/// memory dump with its size and the effective size the viewer computes from ownership edges.
const MODEL: &str = r#"(() => {
  // A `let` of the page's script: global, but not a property of window.
  const view = typeof g_timelineViewEl === 'undefined' ? undefined : g_timelineViewEl;
  if (!view || !view.model) return null;
  const m = view.model;
  const out = {warnings: m.importWarnings.map(w => w.type + ': ' + w.message), processes: {}};
  for (const p of m.getAllProcesses()) {
    const counters = {};
    for (const c of Object.values(p.counters)) {
      const last = {};
      for (const s of c.series) last[s.name] = s.samples.length ? s.samples[s.samples.length - 1].value : null;
      counters[c.name] = last;
    }
    out.processes[p.pid] = {counters, dumps: {}};
  }
  const dumps = m.globalMemoryDumps;
  if (dumps.length > 0) {
    const last = dumps[dumps.length - 1];
    for (const [pid, pmd] of Object.entries(last.processMemoryDumps)) {
      const flat = {};
      const walk = d => {
        const value = n => (n === undefined ? null : n.value);
        flat[d.fullName] = {size: value(d.numerics.size), effective: value(d.numerics.effective_size)};
        d.children.forEach(walk);
      };
      pmd.memoryAllocatorDumps.forEach(walk);
      if (out.processes[pid]) out.processes[pid].dumps = flat;
    }
  }
  return out;
})()"#;

/// Opens `page` and waits (polling the page, within a bound) for the viewer to finish importing.
fn import(chromium: &mut Chromium, page: &Path) -> Value {
    chromium.open(page);
    let started = Instant::now();
    loop {
        let model = chromium.evaluate(MODEL);
        if !model.is_null() {
            return model;
        }
        let overlay =
            chromium.evaluate("(document.querySelector('tr-ui-b-overlay') || {}).textContent || ''");
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the viewer did not import the trace within a minute: {overlay}\n{:#?}",
            chromium.errors()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn screenshot(chromium: &mut Chromium) -> PathBuf {
    let path = workspace_root().join("target/trace-viewer.png");
    chromium.screenshot(&path);
    eprintln!("screenshot: {}", path.display());
    path
}

/// fixtures/usdt_subsystems.c under `--heap-subsystem cache`: pool-0..2 end at 5000, 10000 and
/// 15000 B; cache at 100 x 4096 - 5000 = 404600 B, declared part of malloc.
#[test]
fn the_trace_imports_into_the_chrome_trace_viewer_without_a_warning() {
    let include = format!("-I{}", workspace_root().join("include").display());
    let program = memtrace_tests::fixture_variant("usdt_subsystems", "viewer", &[&include]);
    let outcome = Memtrace::new().args(["--heap-subsystem", "cache"]).command(&program).run();
    outcome.assert_exit_code(0);
    let page = outcome.dir().join("viewer.html");
    viewer_page(outcome.trace_text().as_bytes(), &page);
    let mut chromium = Chromium::start();
    let model = import(&mut chromium, &page);
    screenshot(&mut chromium);
    assert_eq!(model["warnings"], serde_json::json!([]), "import warnings");
    let summary = outcome.summary();
    let process = &summary["processes"][0];
    let pid = process["pid"].to_string();
    let viewed = &model["processes"][&pid];
    let heap = &viewed["counters"]["heap"];
    assert_eq!(heap["live_bytes"], process["live_bytes"], "the heap counter: {viewed:#}");
    let counters = &viewed["counters"];
    for (name, bytes) in [("pool-0", 5000), ("pool-1", 10000), ("pool-2", 15000), ("cache", 404600)] {
        assert_eq!(counters[format!("subsystem:{name}")]["bytes"], bytes, "{viewed:#}");
    }
    assert_eq!(counters["memory"]["heap_live_bytes"], process["memory"]["heap_live_bytes"], "{viewed:#}");
    let dumps = &viewed["dumps"];
    assert_eq!(dumps["subsystems/cache"]["size"], 404600, "{dumps:#}");
    assert_eq!(dumps["subsystems/pool-2"]["size"], 15000, "{dumps:#}");
    // Owned by cache, malloc's effective size is what cache does not account for: its bytes count
    // once in the viewer's totals.
    let malloc = dumps["malloc"]["size"].as_u64().expect("a malloc dump");
    assert_eq!(malloc, process["live_bytes"].as_u64().unwrap(), "{dumps:#}");
    assert_eq!(dumps["malloc"]["effective"], malloc - 404600, "{dumps:#}");
    assert_eq!(dumps["subsystems/cache"]["effective"], 404600, "{dumps:#}");
}
