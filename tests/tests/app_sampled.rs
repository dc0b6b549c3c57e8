//! `--app-sampled`: allocations taken from the allocator's own sampled probes (OpenTelemetry's
//! otel_memory:alloc and otel_memory:free), never from uprobes on malloc and free. fixtures/
//! app_sampled.c samples every 100th allocation deterministically, so its estimates are exact
//! figures derived in its header.

use memtrace_tests::{fixture, Memtrace};
use serde_json::Value;

fn leak_through<'a>(process: &'a Value, function: &str) -> Option<&'a Value> {
    process["leaks"].as_array()?.iter().find(|leak| {
        leak["stack"].as_array().is_some_and(|stack| stack.iter().any(|frame| frame == function))
    })
}

#[test]
fn the_allocators_samples_alone_make_the_heap_figures() {
    let outcome = Memtrace::new().args(["--app-sampled"]).command(&fixture("app_sampled")).run();
    outcome.assert_exit_code(0);
    let summary = outcome.summary();
    assert_eq!(summary["app_sampled"]["probes"], "otel_memory:alloc, otel_memory:free", "{summary:#}");
    let process = outcome.process();
    // 101 + 10 samples; uprobes on malloc would have counted all 11,050 allocations.
    assert_eq!(process["allocations"], 111, "{process:#}");
    assert_eq!(process["allocated_bytes"], 101 * 10_000 + 10 * 100_000);
    assert_eq!(process["frees"], 50 + 10);
    assert_eq!(process["live_allocations"], 51);
    assert_eq!(process["live_bytes"], 510_000);
    assert_eq!(process["untracked_frees"], 0);
    assert_eq!(process["lost_events"], 0, "{process:#}");
    let leak = leak_through(process, "make_cache")
        .unwrap_or_else(|| panic!("no leak through make_cache: {:#}", process["leaks"]));
    assert_eq!(leak["bytes"], 510_000, "{leak:#}");
    assert_eq!(leak["allocations"], 51, "{leak:#}");
    assert!(leak_through(process, "scratch").is_none(), "scratch freed every sample: {process:#}");
    outcome.assert_stderr_mentions(&["allocations from the allocators' own samples (otel_memory:alloc"]);
}

/// Without `--app-sampled` the same program is traced exactly, through malloc and free: its
/// otel_memory probes are not attached.
#[test]
fn without_the_flag_the_same_program_is_traced_exactly() {
    let outcome = Memtrace::new().command(&fixture("app_sampled")).run();
    outcome.assert_exit_code(0);
    assert!(outcome.summary().get("app_sampled").is_none());
    let process = outcome.process();
    assert_eq!(process["allocations"], 11_050, "{process:#}");
    assert_eq!(process["live_bytes"], 505_000);
}
