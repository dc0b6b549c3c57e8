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
