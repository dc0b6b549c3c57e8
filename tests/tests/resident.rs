//! Every resident byte explained (issue: resident memory): the owners of a threaded program's
//! resident anonymous pages, each checked against the allocator's own figures: glibc's mallinfo2
//! and the RSS malloc_trim(0) gives back, jemalloc's stats.resident, and Debian's python3. Dark
//! memory, what no owner claims, must stay under a tenth of RssAnon.

use std::{collections::HashMap, process::Command};

use memtrace_tests::{fixture, fixture_variant, Memtrace, Running, Spawned, Trace};
use serde_json::Value;

/// The kernel's live table is sized to the fixtures (8192 live blocks, 32768 at most), so the
/// free pool, which passes over the whole table within a 1% CPU budget, is measured about once a
/// sample rather than once in several (the default table is 96 MiB).
const TABLE: [&str; 2] = ["--max-allocations", "65536"];

fn level(memory: &Value, name: &str) -> u64 {
    memory[name].as_u64().unwrap_or_else(|| panic!("no level {name} in {memory}"))
}

/// `name=value` pairs of a line the fixture printed.
fn figures(line: &str) -> HashMap<String, u64> {
    let pairs = line.split_whitespace().filter_map(|pair| pair.split_once('='));
    pairs.map(|(name, value)| (name.to_owned(), value.parse().expect("a number"))).collect()
}

fn assert_within(what: &str, seen: u64, expected: u64, share: f64, memory: &Value) {
    let off = (seen as f64 - expected as f64).abs() / expected as f64;
    assert!(off <= share, "{what}: {seen}, expected {expected} within {share}: {memory}");
}

/// Dark memory at most a tenth of RssAnon, and the owners adding up to RssAnon + swap.
fn assert_dark_is_small(memory: &Value) {
    let anonymous = level(memory, "rss_anon_bytes") + level(memory, "swap_bytes");
    let owners = ["allocator_resident_bytes", "mapped_anon_resident_bytes", "stack_bytes", "static_bytes"];
    let owned: u64 = owners.iter().map(|owner| level(memory, owner)).sum();
    let dark = level(memory, "dark_bytes");
    assert_eq!(dark, anonymous.saturating_sub(owned), "{memory}");
    assert!(dark * 10 <= level(memory, "rss_anon_bytes"), "dark {dark} over a tenth: {memory}");
}

/// What fixtures/arenas.c's arenas hold, as mallinfo2 says (within a tenth), and little dark.
fn assert_glibcs_arenas(memory: &Value, glibc: &HashMap<String, u64>) {
    let held = level(memory, "allocator_held_bytes");
    assert_within("allocator_held_bytes", held, glibc["held"], 0.10, memory);
    assert_dark_is_small(memory);
}

/// The levels of a sample taken wholly after the stage the program just said it reached, the
/// first of them that has `wanted` (the free pool is in a sample's counter only when it was
/// measured then). memtrace writes its samples one after another: the first counter written after
/// the line was seen may come from a sample that read the figures before; the next ones cannot.
fn levels_after_stage(run: &mut Running, wanted: &str) -> Value {
    let written = |trace: &Trace| trace.counters("memory").count();
    let before = written(&run.wait_for_trace("a trace that loads", |_| true));
    let fresh = |trace: &Trace| {
        trace
            .counters("memory")
            .skip(before + 1)
            .find(|counter| counter["args"].get(wanted).is_some())
            .cloned()
    };
    let trace =
        run.wait_for_trace(&format!("a sample with {wanted} after the stage"), |t| fresh(t).is_some());
    fresh(&trace).expect("found above")["args"].clone()
}

/// fixtures/arenas.c, launched: 8 thread arenas held as mallinfo2 says, and the resident free
/// pages memtrace measures are what malloc_trim(0) gives back.
#[test]
fn thread_arenas_are_the_allocators_and_their_free_pages_what_malloc_trim_returns() {
    let mut run = Memtrace::new().args(TABLE).command(&fixture("arenas")).spawn();
    let glibc = figures(&run.wait_for_stdout("ready"));
    let memory = levels_after_stage(&mut run, "allocator_free_resident_bytes");
    assert_glibcs_arenas(&memory, &glibc);
    // 32 MiB live of 128 MiB touched: the allocator owns nearly all of RssAnon.
    assert!(
        level(&memory, "allocator_resident_bytes") * 10 >= level(&memory, "rss_anon_bytes") * 9,
        "{memory}"
    );
    run.send(b"x");
    let trimmed = figures(&run.wait_for_stdout("trimmed"));
    let free = level(&memory, "allocator_free_resident_bytes");
    assert_within("allocator_free_resident_bytes", free, trimmed["returned"], 0.20, &memory);
    run.send(b"x");
    let outcome = run.finish();
    outcome.assert_exit_code(0);
    assert_eq!(outcome.process()["lost_events"], 0);
    // glibc gives a 4096-byte request a 4112-byte chunk, 4104 usable: 8 bytes a block.
    assert_rounding(&memory, outcome.process(), 8);
}

/// `heap_rounding_bytes` of arenas.c's 8192 live blocks of 4096 bytes, `per_block` each, and at
/// most 32 bytes or a quarter of its size for each of the other live blocks (pthread_create's):
/// glibc's chunks are 16 bytes apart (a mapped one's pages, from 128 KiB), jemalloc's classes
/// 16 bytes apart to 128 and four to a doubling above.
fn assert_rounding(memory: &Value, process: &Value, per_block: u64) {
    const BLOCKS: u64 = 8192;
    const SIZE: u64 = 4096;
    let rounding = level(memory, "heap_rounding_bytes");
    let others = process["live_allocations"].as_u64().unwrap() - BLOCKS;
    let others_bytes = level(memory, "heap_live_bytes") - BLOCKS * SIZE;
    let least = BLOCKS * per_block;
    let highest = least + others * 32 + others_bytes / 4;
    assert!(
        (least..=highest).contains(&rounding),
        "heap_rounding_bytes {rounding} not in {least}..={highest}: {memory}"
    );
}

/// The same program when its arenas were made before memtrace came: found from its mappings (and
/// the heap headers in its memory); which of its resident pages are free is unknown, and said so.
#[test]
fn arenas_made_before_an_attach_are_found_from_the_mappings() {
    let mut target = Spawned::spawn(Command::new(fixture("arenas")));
    let glibc = figures(&target.wait_for_stdout("ready"));
    let mut run = Memtrace::new().args(["--pid", &target.pid().to_string()]).spawn();
    run.wait_for_stderr("memtrace: tracing");
    let memory = levels_after_stage(&mut run, "dark_bytes");
    assert_glibcs_arenas(&memory, &glibc);
    assert!(memory.get("allocator_free_resident_bytes").is_none(), "unknown, so not drawn: {memory}");
    run.interrupt();
    let outcome = run.finish();
    outcome.assert_exit_code(0);
    let summary_memory = &outcome.process()["memory"];
    assert!(summary_memory["allocator_free_resident_bytes"].is_null(), "{summary_memory}");
    target.send(b"xx");
    assert!(target.wait().success());
}

/// The same under `--all` (by `--comm`): a process running before a system-wide run began is a
/// late attach too, taken in at its first allocation (the poke), its arenas found from its
/// mappings and its free pages unknown.
#[test]
fn arenas_of_a_process_running_before_a_system_wide_run_are_found_too() {
    // A name of its own, so that the fixtures other tests launch meanwhile are not in the run.
    let program = fixture_variant("arenas", "early", &[]);
    let mut command = Command::new(&program);
    command.arg("poke");
    let mut target = Spawned::spawn(command);
    let glibc = figures(&target.wait_for_stdout("ready"));
    let mut run = Memtrace::new().args(["--comm", "arenas-early"]).spawn();
    run.wait_for_stderr("memtrace: tracing");
    target.send(b"p");
    target.wait_for_stdout("poked");
    let memory = levels_after_stage(&mut run, "dark_bytes");
    assert_glibcs_arenas(&memory, &glibc);
    assert!(memory.get("allocator_free_resident_bytes").is_none(), "unknown, so not drawn: {memory}");
    run.interrupt();
    run.finish().assert_exit_code(0);
    target.send(b"xx");
    assert!(target.wait().success());
}

/// Kept untrimmed to its end: the summary has the free pool by size class, which adds up to the
/// free figure, and the report says in words what could be given back, over how many arenas.
#[test]
fn the_free_pool_by_size_class_and_in_words() {
    let mut run = Memtrace::new().args(TABLE).command(&fixture("arenas")).arg("keep").spawn();
    run.wait_for_stdout("ready");
    let measured = levels_after_stage(&mut run, "allocator_free_resident_bytes");
    run.send(b"x");
    let outcome = run.finish();
    outcome.assert_exit_code(0);
    let memory = &outcome.process()["memory"];
    let free = level(memory, "allocator_free_resident_bytes");
    assert_eq!(free, level(&measured, "allocator_free_resident_bytes"), "the last measured: {memory}");
    let classes = memory["allocator_free_by_size"].as_array().expect("the free pool by size");
    let resident: u64 = classes.iter().map(|class| level(class, "resident_bytes")).sum();
    assert_eq!(resident, free, "the classes add up to the free figure: {memory}");
    // Each thread freed 3 blocks of 4096 bytes in every 4: gaps of 3 chunks, 12 KiB and more.
    let gaps = |class: &Value| level(class, "gaps");
    let big = classes.iter().find(|class| level(class, "min_bytes") == 8192).expect("an 8 KiB class");
    assert!(gaps(big) >= 8 * 1024 - 8, "a gap per 4 blocks of every thread: {memory}");
    assert!(level(memory, "allocator_arenas") >= 8, "{memory}");
    assert!(memory["allocator_free_measured_at_s"].as_f64().is_some_and(|at| at > 0.0), "{memory}");
    outcome.assert_stderr_mentions(&[
        "of resident free pages (malloc_trim(0) would return them);",
        "arenas",
        "free pool by gap size (resident / all), measured at ",
        " s: 8192 B+ ",
    ]);
}

/// jemalloc's extents are mapped inside allocator calls: its resident memory is what its own
/// stats.resident says (which counts its metadata too), or the more the kernel backs them with;
/// its free resident pages hold what purging every arena gives back.
#[test]
fn jemalloc_resident_memory_is_the_allocators_as_its_stats_say() {
    let program = fixture_variant("arenas", "jemalloc", &["-DJEMALLOC", "-ljemalloc"]);
    let mut run = Memtrace::new().args(TABLE).command(&program).spawn();
    let jemalloc = figures(&run.wait_for_stdout("ready"));
    let memory = levels_after_stage(&mut run, "allocator_free_resident_bytes");
    let resident = level(&memory, "allocator_resident_bytes");
    // stats.resident counts the pages jemalloc dirtied; the kernel may back its extents with more
    // (on Debian unstable's 7.2 in the matrix: RssAnon 162 MB against stats.resident 144 MB, all
    // of it in jemalloc's mappings), and those are the allocator's too: at least what jemalloc
    // says, and within a tenth of it or of what the kernel said as the program was ready.
    let (said, kernel) = (jemalloc["resident"], jemalloc["rss_anon"].max(jemalloc["resident"]));
    assert!(resident * 10 >= said * 9, "allocator_resident_bytes {resident} < 90% of {said}: {memory}");
    assert!(resident * 10 <= kernel * 11, "allocator_resident_bytes {resident} > 110% of {kernel}: {memory}");
    assert_dark_is_small(&memory);
    // Its free pool holds what a purge of every arena gives back: on this host within 6% (106.3 MB
    // against 100.2 MB); in the matrix's VMs, whose kernels back anonymous memory with huge pages
    // (THP "always", where this host says "madvise"), RssAnon is 160 MB and the free pool 125 MB
    // against the purge's 100 MB: free pages inside huge pages that a purge leaves resident. So:
    // at least what the purge returned, less a fifth.
    run.send(b"x");
    let purged = figures(&run.wait_for_stdout("trimmed"))["returned"];
    let free = level(&memory, "allocator_free_resident_bytes");
    assert!(
        free * 10 >= purged * 8,
        "allocator_free_resident_bytes {free} < 80% of the purge's {purged}: {memory}"
    );
    run.send(b"x");
    let outcome = run.finish();
    outcome.assert_exit_code(0);
    // 4096 bytes is one of jemalloc's classes: nothing lost on the blocks.
    assert_rounding(&memory, outcome.process(), 0);
}

/// Debian's python3 with four threads keeping 90,000,000 bytes: its thread arenas were all of
/// memtrace's dark memory before owners.
#[test]
fn python_threads_keep_their_memory_in_arenas_memtrace_owns() {
    let script = memtrace_tests::workspace_root().join("tests/fixtures/threads_keep.py");
    let mut run = Memtrace::new().command(std::path::Path::new("/usr/bin/python3")).arg(&script).spawn();
    run.wait_for_stdout("ready 90000000");
    let memory = levels_after_stage(&mut run, "dark_bytes");
    assert!(level(&memory, "heap_live_bytes") >= 90_000_000, "{memory}");
    assert!(level(&memory, "allocator_resident_bytes") >= 90_000_000, "{memory}");
    assert_dark_is_small(&memory);
    run.send(b"\n");
    run.finish().assert_exit_code(0);
}
