//! Allocator discovery: the object that really provides malloc is probed, whichever it is, and a
//! process in another mount namespace is traced through its own files.

use std::process::Command;

use memtrace_tests::{assert_figures, fixture, fixture_variant, Memtrace, Outcome, Spawned, LEAKS};

fn assert_traced_through(outcome: &Outcome, kind: &str, file_name: &str) {
    let process = outcome.process();
    assert_eq!(process["allocator_kind"], kind, "{process:#}");
    let path = process["allocator"].as_str().unwrap();
    assert!(path.contains(file_name), "traced through {path}, expected {file_name}");
}

/// The functions the summary says are single-stepped, as (file name, function).
fn single_stepped(outcome: &Outcome) -> Vec<(String, String)> {
    let listed = outcome.summary()["single_stepped"].as_array();
    let listed = listed.unwrap_or_else(|| panic!("no single_stepped list: {}", outcome.summary()));
    let name = |path: &serde_json::Value| path.as_str().unwrap().rsplit('/').next().unwrap().to_owned();
    listed
        .iter()
        .map(|entry| (name(&entry["file"]), entry["function"].as_str().unwrap().to_owned()))
        .collect()
}

/// The two leaking call sites of leaks.c, exact: startup code (the dynamic linker handing its
/// allocations to jemalloc, static glibc's own set-up) allocates too, but from other stacks.
fn assert_source_leaks(outcome: &Outcome) {
    let leaks = outcome.process()["leaks"].as_array().unwrap();
    for (function, bytes, blocks) in [("leak_textures", 5000, 5), ("leak_cache", 768, 3)] {
        let leak = leaks
            .iter()
            .find(|leak| leak["stack"][0] == function)
            .unwrap_or_else(|| panic!("no leak from {function}: {leaks:#?}"));
        assert_eq!((leak["bytes"].as_u64(), leak["allocations"].as_u64()), (Some(bytes), Some(blocks)));
    }
}

/// Runs `command` (leaks.c in "hold" mode) to its "ready" line, attaches with --pid, lets it
/// allocate, and returns memtrace's outcome: the figures are then exactly the source's.
fn trace_held(mut command: Command) -> Outcome {
    command.arg("hold");
    let mut target = Spawned::spawn(command);
    target.wait_for_stdout("ready");
    let mut memtrace = Memtrace::new().args(["--pid", &target.pid().to_string()]).spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    target.send(b"g");
    assert!(target.wait().success());
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    outcome
}

#[test]
fn linked_jemalloc_is_found_and_traced_exactly() {
    let program = fixture_variant("leaks", "jemalloc", &["-ljemalloc"]);
    let outcome = Memtrace::new().command(&program).run();
    outcome.assert_exit_code(0);
    assert_traced_through(&outcome, "jemalloc", "libjemalloc.so.2");
    assert_source_leaks(&outcome);
    // Debian's jemalloc has an emulated point in every function (malloc+0x7 `ja`, free+0x30
    // `jne`); glibc's mremap (`sub $0x58,%rsp`, then no branch before its syscall's store) has none.
    let stepped = single_stepped(&outcome);
    assert!(stepped.iter().all(|(file, _)| !file.contains("jemalloc")), "{stepped:?}");
    assert!(stepped.contains(&("libc.so.6".to_owned(), "mremap".to_owned())), "{stepped:?}");

    let outcome = trace_held(Command::new(&program));
    assert_figures(&outcome, LEAKS);
    assert_traced_through(&outcome, "jemalloc", "libjemalloc.so.2");
}

#[test]
fn linked_tcmalloc_and_mimalloc_are_found_and_traced_exactly() {
    for (kind, file_name) in [("tcmalloc", "libtcmalloc.so.4"), ("mimalloc", "libmimalloc.so.2")] {
        let program = fixture_variant("leaks", kind, &[&format!("-l{kind}")]);
        let outcome = Memtrace::new().command(&program).run();
        outcome.assert_exit_code(0);
        assert_traced_through(&outcome, kind, file_name);
        assert_source_leaks(&outcome);

        let outcome = trace_held(Command::new(&program));
        assert_figures(&outcome, LEAKS);
        assert_traced_through(&outcome, kind, file_name);
    }
}

#[test]
fn preloaded_jemalloc_wins_over_libc_when_attaching_by_pid() {
    let mut command = Command::new(fixture("leaks"));
    command.env("LD_PRELOAD", "libjemalloc.so.2");
    let outcome = trace_held(command);
    assert_figures(&outcome, LEAKS);
    assert_traced_through(&outcome, "jemalloc", "libjemalloc.so.2");
}

/// tcmalloc and mimalloc preloaded into a glibc program: their probes sit past the first
/// instruction (tcmalloc_minimal's malloc at +0xa, mimalloc's at +0x15 with the size moved to
/// rsi), and the figures are still exactly the source's, launched and attached.
#[test]
fn preloaded_tcmalloc_minimal_and_mimalloc_are_traced_exactly() {
    let program = fixture("leaks");
    for (kind, library) in [("tcmalloc", "libtcmalloc_minimal.so.4"), ("mimalloc", "libmimalloc.so.2")] {
        let preload = format!("LD_PRELOAD={library}");
        let outcome = Memtrace::new().args(["--", "env", &preload]).arg(&program).run();
        outcome.assert_exit_code(0);
        assert_traced_through(&outcome, kind, library);
        assert_source_leaks(&outcome);

        let mut command = Command::new(&program);
        command.env("LD_PRELOAD", library);
        let outcome = trace_held(command);
        assert_figures(&outcome, LEAKS);
        assert_traced_through(&outcome, kind, library);
    }
}

/// fixtures/rjem_leaks.rs: a Rust program with jemalloc built in (tikv-jemallocator, `_rjem_`
/// symbols), whose two leaking functions hold leaks.c's bytes; none of its jemalloc's functions
/// is single-stepped.
#[test]
fn rust_program_with_tikv_jemallocator_is_traced_exactly() {
    let program = std::path::Path::new(env!("CARGO_BIN_EXE_rjem_leaks"));
    let assert_leaks = |outcome: &Outcome| {
        assert_traced_through(outcome, "jemalloc (Rust)", "rjem_leaks");
        // The compiler unrolls the loops: each call site is a stack of its own.
        let leaks = outcome.process()["leaks"].as_array().unwrap();
        for (function, bytes, blocks) in
            [("rjem_leaks::leak_textures", 5000, 5), ("rjem_leaks::leak_cache", 768, 3)]
        {
            let through =
                leaks.iter().filter(|leak| leak["stack"].as_array().unwrap().iter().any(|f| f == function));
            let sums = through.fold((0, 0), |(bytes, blocks), leak| {
                (bytes + leak["bytes"].as_u64().unwrap(), blocks + leak["allocations"].as_u64().unwrap())
            });
            assert_eq!(sums, (bytes, blocks), "{function}: {leaks:#?}");
        }
        let stepped = single_stepped(outcome);
        assert!(stepped.iter().all(|(file, _)| file != "rjem_leaks"), "{stepped:?}");
    };
    let outcome = Memtrace::new().command(program).run();
    outcome.assert_exit_code(0);
    assert_leaks(&outcome);
    assert_leaks(&trace_held(Command::new(program)));
}

#[test]
fn static_binary_is_traced_through_its_own_malloc() {
    let program = fixture_variant("leaks", "static", &["-static"]);
    let outcome = Memtrace::new().command(&program).run();
    outcome.assert_exit_code(0);
    assert_traced_through(&outcome, "malloc in leaks-static", "leaks-static");
    assert_source_leaks(&outcome);

    let outcome = trace_held(Command::new(&program));
    assert_figures(&outcome, LEAKS);
}

/// The target runs in a mount namespace of its own where libc.so.6 is a bind-mounted copy: a
/// different file from the host's. Probes on the host's libc would see nothing.
#[test]
fn process_in_another_mount_namespace_is_traced_through_its_own_libc() {
    let run = Memtrace::new();
    let libc_copy = run.dir().join("libc.so.6");
    let libc = "/usr/lib/x86_64-linux-gnu/libc.so.6";
    let script = format!(
        "cp {libc} {copy} && mount --bind {copy} {libc} && exec {fixture} hold",
        copy = libc_copy.display(),
        fixture = fixture("leaks").display()
    );
    let mut command = Command::new("unshare");
    command.args(["--mount", "--propagation", "private", "sh", "-c", &script]);
    let mut target = Spawned::spawn(command);
    target.wait_for_stdout("ready");
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", target.pid())).unwrap();
    assert!(maps.contains(libc), "the fixture maps {libc} in its namespace");
    let mut memtrace = run.args(["--pid", &target.pid().to_string()]).spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    target.send(b"g");
    assert!(target.wait().success());
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    assert_figures(&outcome, LEAKS);
    assert_traced_through(&outcome, "glibc", "libc.so.6");
    assert_eq!(outcome.process()["leaks"][0]["stack"][0], "leak_textures");
}

#[test]
fn lib_and_allocator_overrides_are_checked() {
    let outcome = Memtrace::new()
        .args(["--lib", "/usr/lib/x86_64-linux-gnu/libc.so.6", "--allocator", "je_"])
        .command(&fixture("leaks"))
        .run();
    outcome.assert_exit_code(1);
    outcome.assert_stderr_mentions(&["defines no je_malloc", "--allocator"]);

    let outcome = Memtrace::new()
        .args(["--lib", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"])
        .command(&fixture_variant("leaks", "jemalloc", &["-ljemalloc"]))
        .run();
    outcome.assert_exit_code(0);
    assert_traced_through(&outcome, "jemalloc", "libjemalloc.so.2");
    assert_source_leaks(&outcome);
}
