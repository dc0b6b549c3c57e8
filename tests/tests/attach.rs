//! Attaching to a running process (--pid): blocks allocated before tracing began.

use std::process::Command;

use memtrace_tests::{assert_figures, fixture, Figures, Memtrace, Spawned};

/// fixtures/untracked.c: 8 blocks allocated before the attach and freed after it (untracked frees,
/// never a negative live count); then malloc(1000) + free, and malloc(500) left live.
const UNTRACKED: Figures = Figures {
    allocations: 2,
    frees: 1,
    allocated_bytes: 1000 + 500,
    freed_bytes: 1000,
    live_allocations: 1,
    live_bytes: 500,
    peak_live_bytes: Some(1000),
    untracked_frees: 8,
    failed_allocations: 0,
};

#[test]
fn frees_of_blocks_allocated_before_attach_are_untracked() {
    let mut target = Spawned::spawn(Command::new(fixture("untracked")));
    target.wait_for_stdout("ready");
    let mut memtrace = Memtrace::new().arg("--pid").arg(target.pid().to_string()).spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    target.send(b"g");
    let status = target.wait();
    assert!(status.success(), "the fixture failed: {status}");
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    assert_figures(&outcome, UNTRACKED);
}
