//! Memory at every level (issue: the whole memory picture): the OS view, the live heap, what the
//! allocator holds, what the program mapped itself, dark memory, and temporary allocations, each
//! compared with figures derived from a fixture's source.

use memtrace_tests::{exit_counts_are_whole, fixture, fixture_variant, Memtrace, Running, Trace};
use serde_json::Value;

const MIB: u64 = 1 << 20;

fn level(memory: &Value, name: &str) -> u64 {
    memory[name].as_u64().unwrap_or_else(|| panic!("no level {name} in {memory}"))
}

/// fixtures/levels.c: 8 MiB mapped and touched by the program, 256 x 4096 bytes live through
/// malloc, 6 MiB of static data touched, a thread whose stack is mapped by pthread_create.
fn assert_levels_of_the_fixture(memory: &Value, live_bytes: u64, running: bool) {
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
    // The 6 MiB of .bss are static data now, the thread's stack a stack: what stays dark is what
    // ld.so maps for itself by raw syscalls and the pages the probes' breakpoints copied.
    let statics = level(memory, "static_bytes");
    assert!((6 * MIB..7 * MIB).contains(&statics), "static_bytes {statics} (6 MiB of .bss): {memory}");
    // At exit the kernel's counters (per-CPU, summed without the CPUs' pending deltas on newer
    // kernels) may fall short of the owners last read by a few pages, which the stacks give up.
    if running {
        assert!(level(memory, "stack_bytes") >= 16384, "the thread's 16 KiB and main's: {memory}");
    }
    let resident_mapped = level(memory, "mapped_anon_resident_bytes");
    assert!((8 * MIB..9 * MIB).contains(&resident_mapped), "the program's 8 MiB, touched: {memory}");
    let dark = level(memory, "dark_bytes");
    assert!(dark < MIB, "dark_bytes {dark}: {memory}");
    let anon = level(memory, "rss_anon_bytes");
    // Before 6.2 a thread's resident-page counts reach its process's only every 64 page faults
    // (SPLIT_RSS_COUNTING): up to 64 pages may be missing from them (4 were on Debian's 6.1).
    let unsynced = 64 * 4096;
    assert!(anon >= 15 * MIB - unsynced, "8 + 6 + 1 MiB touched, resident: {memory}");
    assert!(level(memory, "rss_file_bytes") > 0, "{memory}");
}

#[test]
fn every_level_of_a_running_and_of_an_exited_process() {
    let mut run = Memtrace::new().command(&fixture("levels")).spawn();
    run.wait_for_stdout("ready");
    // While it runs, the levels come from /proc and the kernel's mapping figures. The program maps
    // its 8 MiB, mallocs its 256 blocks and touches its static data before it says "ready", and a
    // sample may fall in between (on a slow machine, an emulated kernel of the matrix, one does):
    // the one to check is the last of two or more samples taken after "ready" was seen.
    let seen = run
        .wait_for_trace("a memory counter", |trace| trace.counters("memory").count() > 0)
        .counters("memory")
        .count();
    let trace = run.wait_for_trace("two samples after the program said it was ready", |trace| {
        trace.counters("memory").count() >= seen + 2
    });
    let running = trace.counters("memory").last().unwrap().clone();
    let heap = trace
        .counters("heap")
        .filter(|event| event["ts"] == running["ts"] && event["pid"] == running["pid"])
        .find_map(|event| event["args"]["live_bytes"].as_u64())
        .expect("a heap counter at the same sample");
    assert_levels_of_the_fixture(&running["args"], heap, true);
    run.send(b"x");
    let outcome = run.finish();
    outcome.assert_exit_code(0);
    // At its end, the levels come from the kernel's own counters, read as it exited.
    let process = outcome.process();
    assert_eq!(process["exited"], true);
    assert_levels_of_the_fixture(&process["memory"], process["live_bytes"].as_u64().unwrap(), false);
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
    let program = fixture("leaks");
    let outcome = Memtrace::new().command(&program).run();
    outcome.assert_exit_code(0);
    let process = outcome.process();
    // Named by its program though gone, with its /proc/PID/exe, before its figures were read.
    assert_eq!(process["executable"].as_str(), program.to_str(), "{process}");
    let memory = &process["memory"];
    assert!(process["rss_bytes"].as_u64().unwrap() > 0, "{process}");
    assert!(level(memory, "rss_file_bytes") > 0, "the program and libc are mapped: {memory}");
    assert_eq!(level(memory, "heap_live_bytes"), 5000 + 768, "{memory}");
    assert!(level(memory, "allocator_held_bytes") >= 5768, "{memory}");
    // Its few anonymous pages may all be pending in per-CPU counts, which only a kernel whose
    // kallsyms lists __per_cpu_offset lets memtrace sum.
    if exit_counts_are_whole() {
        assert!(level(memory, "rss_anon_bytes") > 0, "its heap and stack are resident: {memory}");
    }
    assert_eq!(process["temporary_allocations"], 20);
    assert_eq!(process["temporary_bytes"], 20 * 333);
}

/// fixtures/brief.c touches 4 MiB of one malloc'd block and exits within milliseconds: its exit
/// levels are the kernel's counters at its exit, its CPUs' pending per-CPU counts included (on
/// 6.2 and later a page fault counts on its CPU first; Debian's 6.12 showed rss_anon 0 without).
#[test]
fn a_brief_process_that_touched_4_mib_has_them_resident_at_exit() {
    let outcome = Memtrace::new().command(&fixture("brief")).run();
    outcome.assert_exit_code(0);
    let process = outcome.process();
    let memory = &process["memory"];
    assert_eq!(process["exited"], true, "{process}");
    assert_eq!(level(memory, "heap_live_bytes"), 4 * MIB, "{memory}");
    assert!(level(memory, "allocator_held_bytes") >= 4 * MIB, "the block's mapping: {memory}");
    // Its 1024 pages, less what a thread's RSS cache may hold back before 6.2 (64 pages).
    let anon = level(memory, "rss_anon_bytes");
    assert!(anon >= 4 * MIB - 64 * 4096, "rss_anon_bytes {anon}: the 4 MiB touched: {memory}");
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

/// The levels (the trace's `memory` counter) of the traced program at one stage of
/// fixtures/mapped_by_allocator.c: waits for the program to say `stage`, then for a sample taken
/// wholly after that. The program waits at each stage for a byte on stdin, so the figures are the
/// stage's. memtrace takes and writes its samples one after another: the first `memory` counter
/// written after the line was seen may come from a sample that read the kernel's figures before
/// the stage; the second read them after.
fn levels_at_stage(run: &mut Running, stage: &str) -> Value {
    run.wait_for_stdout(stage);
    let written = |trace: &Trace| trace.counters("memory").count();
    let before = written(&run.wait_for_trace("a trace that loads", |_| true));
    let trace =
        run.wait_for_trace(&format!("two samples after {stage:?}"), |trace| written(trace) >= before + 2);
    let levels = trace.counters("memory").last().unwrap()["args"].clone();
    run.send(b"x");
    levels
}

/// fixtures/mapped_by_allocator.c's levels at each of its stages, and at its exit (the summary).
struct Stages {
    started: Value,
    malloced: Value,
    realloced: Value,
    freed: Value,
    unmapped: Value,
    at_exit: Value,
}

fn run_through_the_stages(program: &std::path::Path) -> Stages {
    let mut run = Memtrace::new().command(program).spawn();
    let started = levels_at_stage(&mut run, "started");
    let malloced = levels_at_stage(&mut run, "malloced");
    let realloced = levels_at_stage(&mut run, "realloced");
    let freed = levels_at_stage(&mut run, "freed");
    let unmapped = levels_at_stage(&mut run, "unmapped");
    let outcome = run.finish();
    outcome.assert_exit_code(0);
    let process = outcome.process();
    assert_eq!(process["exited"], true, "{process}");
    assert_eq!(process["lost_events"], 0, "{process}");
    let at_exit = process["memory"].clone();
    Stages { started, malloced, realloced, freed, unmapped, at_exit }
}

/// The program's own mapping of 16 MiB, its first 8 MiB unmapped (a mapping is followed by its
/// start: unmapping its head shrinks it): 8 MiB more mapped_anon_bytes than at the start, and
/// nothing of it held by the allocator. Whatever the allocator, while it runs and at its exit.
fn assert_the_programs_own_mapping(stages: &Stages) {
    let Stages { started, unmapped, at_exit, freed, .. } = stages;
    let mapped = level(started, "mapped_anon_bytes") + 8 * MIB;
    assert_eq!(level(unmapped, "mapped_anon_bytes"), mapped, "at {unmapped}, started {started}");
    assert_eq!(level(at_exit, "mapped_anon_bytes"), mapped, "at exit {at_exit}, started {started}");
    let held = level(freed, "allocator_held_bytes");
    assert_eq!(level(unmapped, "allocator_held_bytes"), held, "at {unmapped}, freed {freed}");
}

/// glibc maps a 16 MiB block by itself (above its mmap threshold) inside malloc, grows it to 32 MiB
/// with mremap inside realloc and unmaps it inside free: allocator_held_bytes follows it page for
/// page (16 MiB + 4096, then 16 MiB more, then back), and mapped_anon_bytes never moves. The brk
/// heap (set up by the fixture's first malloc, before "started") stays as it is throughout.
#[test]
fn a_large_block_glibc_maps_is_held_by_the_allocator_through_realloc_and_free() {
    let stages = run_through_the_stages(&fixture("mapped_by_allocator"));
    let Stages { started, malloced, realloced, freed, unmapped, at_exit } = &stages;
    let held = |levels: &Value| level(levels, "allocator_held_bytes");
    let mapped = |levels: &Value| level(levels, "mapped_anon_bytes");
    let live = |levels: &Value| level(levels, "heap_live_bytes");

    // The brk heap (glibc's first 132 KiB) holds the 64 live bytes; libc maps little or nothing
    // for itself.
    assert_eq!(live(started), 64, "{started}");
    assert!((64..MIB).contains(&held(started)), "allocator_held_bytes {}: {started}", held(started));
    assert!(mapped(started) < MIB, "mapped_anon_bytes {}: {started}", mapped(started));

    assert_eq!(live(malloced), 64 + 16 * MIB, "{malloced}");
    assert_eq!(held(malloced), held(started) + 16 * MIB + 4096, "malloced {malloced}, started {started}");
    assert_eq!(mapped(malloced), mapped(started), "malloced {malloced}, started {started}");

    assert_eq!(live(realloced), 64 + 32 * MIB, "{realloced}");
    assert_eq!(held(realloced), held(malloced) + 16 * MIB, "realloced {realloced}, malloced {malloced}");
    assert_eq!(mapped(realloced), mapped(started), "realloced {realloced}, started {started}");

    assert_eq!(live(freed), 64, "{freed}");
    assert_eq!(held(freed), held(started), "freed {freed}, started {started}");
    assert_eq!(mapped(freed), mapped(started), "freed {freed}, started {started}");

    // At its exit, from the kernel's counters: the brk heap as it was, no allocator mapping left.
    assert_eq!(live(unmapped), 64, "{unmapped}");
    assert_eq!(held(at_exit), held(started), "at exit {at_exit}, started {started}");
    assert_eq!(level(at_exit, "heap_overhead_bytes"), held(at_exit) - 64, "{at_exit}");
}

#[test]
fn the_programs_own_mapping_is_followed_by_its_start() {
    assert_the_programs_own_mapping(&run_through_the_stages(&fixture("mapped_by_allocator")));
}

/// Linked with jemalloc, which maps its memory through the C library's mmap inside the call (and
/// keeps it: retained, not unmapped, so its held figure need not drop after free): everything
/// live is in what it holds, the 16 MiB block and then the 32 MiB one included, and none of it is
/// the program's mapped_anon_bytes. The program's own mapping counts as with glibc.
#[test]
fn a_large_block_jemalloc_maps_through_libc_is_held_by_the_allocator() {
    let program = fixture_variant("mapped_by_allocator", "jemalloc", &["-ljemalloc"]);
    let stages = run_through_the_stages(&program);
    let Stages { started, malloced, realloced, freed, .. } = &stages;
    let held = |levels: &Value| level(levels, "allocator_held_bytes");
    let mapped = |levels: &Value| level(levels, "mapped_anon_bytes");
    let live = |levels: &Value| level(levels, "heap_live_bytes");

    // The dynamic linker's and libc's own allocations go to jemalloc too, besides the 64 bytes.
    let startup = live(started);
    assert!((64..MIB).contains(&startup), "heap_live_bytes {startup}: {started}");
    assert!(held(started) >= startup, "{started}");
    assert!(mapped(started) < MIB, "mapped_anon_bytes {}: {started}", mapped(started));

    // What jemalloc held at the start (8 MiB, jemalloc 5.3) cannot hold the block: only the
    // mapping it made for it can.
    assert!(held(started) < 16 * MIB, "the block must outgrow jemalloc's start: {started}");
    assert_eq!(live(malloced), startup + 16 * MIB, "{malloced}");
    assert!(held(malloced) >= live(malloced), "jemalloc holds the 16 MiB block: {malloced}");
    assert_eq!(mapped(malloced), mapped(started), "malloced {malloced}, started {started}");

    assert_eq!(live(realloced), startup + 32 * MIB, "{realloced}");
    assert!(held(realloced) >= live(realloced), "jemalloc holds the 32 MiB block: {realloced}");
    assert_eq!(mapped(realloced), mapped(started), "realloced {realloced}, started {started}");

    assert_eq!(live(freed), startup, "{freed}");
    assert_eq!(mapped(freed), mapped(started), "freed {freed}, started {started}");

    assert_the_programs_own_mapping(&stages);
}

/// Per-site perf links (kernels before 6.6; MEMTRACE_LINKS=perf here) probe the C library's
/// mapping calls as uprobe_multi links do: the same levels at the fixture's exit, stage by stage
/// run through without pauses (its stdin closed).
#[test]
fn per_site_perf_links_follow_mappings_as_multi_links_do() {
    let program = fixture("mapped_by_allocator");
    let at_exit = |links: &str| {
        let outcome = Memtrace::new().env("MEMTRACE_LINKS", links).command(&program).run();
        outcome.assert_exit_code(0);
        let process = outcome.process();
        assert_eq!(process["lost_events"], 0, "{process}");
        let memory = process["memory"].clone();
        ["allocator_held_bytes", "mapped_anon_bytes", "heap_live_bytes"].map(|name| level(&memory, name))
    };
    let multi = at_exit("multi");
    // The program's own 8 MiB (its 16 MiB mapping less the head it unmapped) is followed.
    assert_eq!(multi[1], 8 * MIB, "{multi:?}");
    assert_eq!(at_exit("perf"), multi);
}
