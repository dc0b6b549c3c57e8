//! `--window ON/EVERY`: malloc and its kin probed only inside windows, free and realloc always.
//! fixtures/windowed.c allocates in the first window, then (told once the window has closed)
//! allocates unseen, frees half of what the window recorded and reallocs a recorded block: the
//! figures, divided by the weight the summary gives, are the recorded ones derived in its header.

use std::fs;

use memtrace_tests::{fixture, leak_stack, leak_through, poll, Memtrace};
use serde_json::Value;

/// The BPF links memtrace holds: a window's close detaches its own.
fn links_held_by(pid: u32) -> usize {
    let fdinfo = fs::read_dir(format!("/proc/{pid}/fdinfo")).expect("reading fdinfo");
    fdinfo
        .filter_map(|entry| fs::read_to_string(entry.ok()?.path()).ok())
        .filter(|info| info.lines().any(|line| line.starts_with("link_type:")))
        .count()
}

/// A figure as recorded: the estimate divided by the weight, to the nearest whole number.
fn recorded(process: &Value, figure: &Value) -> i64 {
    let weight = process["window_weight"].as_f64().unwrap_or_else(|| panic!("no window_weight: {process:#}"));
    (figure.as_f64().expect("a number") / weight).round() as i64
}

/// Whether any leak of `process` has `frame` in its stack.
fn leaks_through(process: &Value, frame: &str) -> bool {
    process["leaks"].as_array().unwrap().iter().any(|leak| leak_stack(leak).contains(&frame))
}

/// The fixture traced with its first window open 3 s, told to go on once memtrace's links show
/// the window closed; `links` is MEMTRACE_LINKS, where a test names it.
fn traced_through_a_window(links: Option<&str>) -> memtrace_tests::Outcome {
    let mut memtrace = Memtrace::new();
    if let Some(links) = links {
        memtrace = memtrace.env("MEMTRACE_LINKS", links);
    }
    let mut run = memtrace.args(["--window", "3s/1h"]).command(&fixture("windowed")).spawn();
    run.wait_for_stdout("ready ");
    let pid = run.pid();
    let open = links_held_by(pid);
    poll("the window to close", || (links_held_by(pid) < open).then_some(()));
    run.send(b"g");
    run.finish()
}

fn assert_followed_out_of_the_window(outcome: &memtrace_tests::Outcome) {
    outcome.assert_exit_code(0);
    let summary = outcome.summary();
    let windows = &summary["windows"];
    assert_eq!(windows["on_s"], 3.0, "{summary:#}");
    assert!(windows["weight"].as_f64().unwrap() > 1.0, "the run outlasted its window: {windows:#}");
    let process = outcome.process();
    assert_eq!(recorded(process, &process["allocations"]), 202, "{process:#}");
    assert_eq!(recorded(process, &process["allocated_bytes"]), 154_160, "{process:#}");
    // Frees are estimated as allocations less live blocks, each rounded after scaling: within one.
    assert!((recorded(process, &process["frees"]) - 151).abs() <= 1, "{process:#}");
    assert_eq!(recorded(process, &process["live_bytes"]), 54_096, "{process:#}");
    assert_eq!(recorded(process, &process["live_allocations"]), 51);
    assert_eq!(process["untracked_frees"], 0, "frees of blocks no window saw are not untracked");
    assert_eq!(process["lost_events"], 0);
    let kept = leak_through(process, "make_kept");
    assert_eq!(recorded(process, &kept["bytes"]), 50_000, "{kept:#}");
    let grown = leak_through(process, "grow_block");
    assert_eq!(recorded(process, &grown["bytes"]), 4096, "the record moved with realloc: {grown:#}");
    assert!(!leaks_through(process, "make_unseen"), "no window saw make_unseen: {process:#}");
    assert!(!leaks_through(process, "make_growing"), "its block was realloc'd: {process:#}");
    outcome.assert_stderr_mentions(&["allocations probed in windows of 3s every 3600s"]);
}

#[test]
fn what_a_window_recorded_is_followed_after_it_closes() {
    assert_followed_out_of_the_window(&traced_through_a_window(None));
}

/// The same through per-site perf links, as on kernels before 6.6.
#[test]
fn windows_work_through_per_site_links_too() {
    assert_followed_out_of_the_window(&traced_through_a_window(Some("perf")));
}

/// window_churn's four threads, traced with windows of 50 ms every 100 ms until `closes` windows
/// have closed (memtrace's links counted as they come and go), then stopped.
fn churned(window: Option<&str>, closes: usize) -> memtrace_tests::Outcome {
    let args = window.map_or(vec![], |window| vec!["--window", window]);
    let mut run = Memtrace::new().args(args).command(&fixture("window_churn")).spawn();
    run.wait_for_stdout("ready ");
    let pid = run.pid();
    let mut seen = 0;
    let mut last = links_held_by(pid);
    poll("windows to close", || {
        let now = links_held_by(pid);
        seen += usize::from(now < last);
        last = now;
        (seen >= closes).then_some(())
    });
    run.send(b"g");
    run.finish()
}

/// Threads inside malloc as a window's probes go never return through them: their calls are
/// forgotten, not left pending (which would skip every later free of the thread). Every block the
/// program allocated it freed: what stays live is only the threads' TLS blocks (glibc keeps them
/// with the threads' cached stacks; some of their stacks are cut short at the start, as without
/// windows: the process's mapping table is not written yet, and bpf_find_vma's trylock loses to
/// the threads' own mmaps).
#[test]
fn threads_caught_inside_malloc_as_windows_close_lose_no_free() {
    let windowed = churned(Some("50ms/100ms"), 10);
    windowed.assert_exit_code(0);
    let process = windowed.process();
    assert_eq!(process["untracked_frees"], 0, "{process:#}");
    assert_eq!(process["lost_events"], 0, "{process:#}");
    assert!(!leaks_through(process, "churn"), "a block the program freed is live: {process:#}");
    // What stays live is a part of what stays live without windows: the threads' TLS blocks that
    // a window saw made (a slow machine starts the threads after the first window).
    let exact = churned(None, 0);
    exact.assert_exit_code(0);
    let live = recorded(process, &process["live_bytes"]);
    let exact_live = exact.process()["live_bytes"].as_i64().unwrap();
    assert!(live <= exact_live, "live at exit, windowed {process:#} and exact {:#}", exact.process());
}

/// Under `--all` each file is probed through a descriptor (its path may be in another mount
/// namespace): every window attaches through one memtrace keeps open, and windows open again and
/// again.
#[test]
fn windows_open_again_under_all() {
    let mut run = Memtrace::new().args(["--all", "--comm", "windowed", "--window", "100ms/300ms"]).spawn();
    run.wait_for_stderr("memtrace: tracing");
    let pid = run.pid();
    let (mut last, mut rises) = (links_held_by(pid), 0);
    poll("windows to open again", || {
        let now = links_held_by(pid);
        rises += usize::from(now > last);
        last = now;
        (rises >= 3).then_some(())
    });
    run.interrupt();
    let outcome = run.finish();
    assert!(!outcome.stderr.contains("no longer probed in windows"), "{}", outcome.stderr);
}

#[test]
fn a_window_that_never_closes_is_refused() {
    let outcome = Memtrace::new().args(["--window", "2s/1s"]).command(&fixture("windowed")).run();
    assert_ne!(outcome.status.code(), Some(0));
    outcome.assert_stderr_mentions(&["never closes; make EVERY longer than ON"]);
}
