//! Memory at every level (issue: the whole memory picture): the OS view, the live heap, what the
//! allocator holds, what the program mapped itself, dark memory, and temporary allocations, each
//! compared with figures derived from a fixture's source.

use memtrace_tests::{fixture, Memtrace};
use serde_json::Value;

const MIB: u64 = 1 << 20;

fn level(memory: &Value, name: &str) -> u64 {
    memory[name].as_u64().unwrap_or_else(|| panic!("no level {name} in {memory}"))
}

/// fixtures/levels.c: 8 MiB mapped and touched by the program, 256 x 4096 bytes live through
/// malloc, 6 MiB of static data touched, a thread whose stack is mapped by pthread_create.
fn assert_levels_of_the_fixture(memory: &Value, live_bytes: u64) {
    let mapped = level(memory, "mapped_anon_bytes");
    // The program's 8 MiB and the few pages ld.so and libc map for themselves; a thread stack
    // (8 MiB) would double it.
    assert!((8 * MIB..9 * MIB).contains(&mapped), "mapped_anon_bytes {mapped}: {memory}");
    let heap = level(memory, "heap_live_bytes");
    assert_eq!(heap, live_bytes, "heap_live_bytes is the live heap: {memory}");
    // pthread_create allocates its thread's TLS (a few hundred bytes) besides the 256 blocks.
    assert!((MIB..MIB + 8192).contains(&heap), "heap_live_bytes {heap}: {memory}");
    let held = level(memory, "allocator_held_bytes");
    assert!(held >= heap, "the allocator holds at least the live heap: {memory}");
    assert_eq!(level(memory, "heap_overhead_bytes"), held - heap);
    let dark = level(memory, "dark_bytes");
    assert!((5 * MIB..9 * MIB).contains(&dark), "dark_bytes {dark} (6 MiB of static data): {memory}");
    let anon = level(memory, "rss_anon_bytes");
    assert!(anon >= 15 * MIB, "8 + 6 + 1 MiB touched, resident: {memory}");
    assert!(level(memory, "rss_file_bytes") > 0, "{memory}");
}

#[test]
fn every_level_of_a_running_and_of_an_exited_process() {
    let mut run = Memtrace::new().command(&fixture("levels")).spawn();
    run.wait_for_stdout("ready");
    // While it runs, the levels come from /proc and the kernel's mapping figures.
    let trace = run.wait_for_trace("the program's 8 MiB mapping in a memory counter", |trace| {
        trace.counters("memory").any(|event| event["args"]["mapped_anon_bytes"].as_u64() >= Some(8 * MIB))
    });
    let running = trace
        .counters("memory")
        .find(|event| event["args"]["mapped_anon_bytes"].as_u64() >= Some(8 * MIB))
        .unwrap();
    let heap = trace
        .counters("heap")
        .filter(|event| event["ts"] == running["ts"])
        .find_map(|event| event["args"]["live_bytes"].as_u64())
        .expect("a heap counter at the same sample");
    assert_levels_of_the_fixture(&running["args"], heap);
    run.send(b"x");
    let outcome = run.finish();
    outcome.assert_exit_code(0);
    // At its end, the levels come from the kernel's own counters, read as it exited.
    let process = outcome.process();
    assert_eq!(process["exited"], true);
    assert_levels_of_the_fixture(&process["memory"], process["live_bytes"].as_u64().unwrap());
    assert_eq!(
        process["rss_bytes"].as_u64().unwrap(),
        ["rss_anon_bytes", "rss_file_bytes", "rss_shmem_bytes"]
            .iter()
            .map(|l| level(&process["memory"], l))
            .sum::<u64>()
    );
}

/// fixtures/leaks.c runs for a few milliseconds, well within one interval: what it held is still
/// known, from the kernel's counters at its exit. Its 20 scratch blocks of 333 bytes are each
/// freed before anything else is allocated: temporary allocations, and nothing else is.
#[test]
fn a_process_that_exits_at_once_still_has_its_memory_and_its_temporary_allocations() {
    let outcome = Memtrace::new().command(&fixture("leaks")).run();
    outcome.assert_exit_code(0);
    let process = outcome.process();
    let memory = &process["memory"];
    assert!(process["rss_bytes"].as_u64().unwrap() > 0, "{process}");
    assert!(level(memory, "rss_file_bytes") > 0, "the program and libc are mapped: {memory}");
    assert_eq!(level(memory, "heap_live_bytes"), 5000 + 768, "{memory}");
    assert!(level(memory, "allocator_held_bytes") >= 5768, "{memory}");
    assert_eq!(process["temporary_allocations"], 20);
    assert_eq!(process["temporary_bytes"], 20 * 333);
}

/// fixtures/peak.c: 2 MiB live from build_peak at its peak, then 10000 bytes from after_peak at
/// the end. A sample sees the peak (the fixture waits there until the trace shows it), and the
/// report names when and who held it.
#[test]
fn the_heap_peak_and_who_held_it() {
    let mut run = Memtrace::new().command(&fixture("peak")).spawn();
    run.wait_for_stdout("peak");
    run.wait_for_trace("the 2 MiB peak in a heap counter", |trace| {
        trace.counters("heap").any(|event| event["args"]["live_bytes"].as_u64() == Some(2 * MIB))
    });
    run.send(b"x");
    let outcome = run.finish();
    outcome.assert_exit_code(0);
    let process = outcome.process();
    assert_eq!(process["live_bytes"], 10_000);
    assert_eq!(process["peak_live_bytes"], 2 * MIB);
    outcome.assert_stderr_mentions(&[
        "heap peak seen at a sample: 2.0 MiB",
        "most from build_peak (2.0 MiB in 512 blocks)",
    ]);
}
