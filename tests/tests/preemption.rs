//! Preemption stress: fixtures/preemption.c's 8 threads allocate with stacks (built with and without
//! frame pointers) while an untraced multi-threaded copy of it allocates beside them. On a
//! preemptible kernel (PREEMPT(lazy), PREEMPT_RT) a uprobe program can be interrupted by another
//! thread's on the same CPU; the figures must stay exact, the leak stacks whole and nothing lost.
//! The kernel matrix (`cargo xtask matrix`) runs this on every kernel with 2 vCPUs.

use std::process::Command;

use memtrace_tests::{assert_figures, fixture, fixture_variant, Figures, Memtrace, Outcome, Spawned};
use serde_json::Value;

/// fixtures/preemption.c's constants.
const THREADS: u64 = 8;
const ITERATIONS: u64 = 5000;
const LEAKS: u64 = 10;

/// Thread t's malloc/free pairs: 32 + 8t + 16 * (i % 4) bytes for i in 0..ITERATIONS.
fn churn_bytes(t: u64) -> u64 {
    ITERATIONS * (32 + 8 * t) + ITERATIONS / 4 * (16 + 32 + 48)
}

/// Thread t's leaks: LEAKS blocks of 1000 + 8t bytes.
fn leak_bytes(t: u64) -> u64 {
    LEAKS * (1000 + 8 * t)
}

/// glibc's own calls, as accounting.rs's THREAD_FIGURES explains them: pthread_create callocs each
/// thread's 272-byte DTV (live at the end: the barrier keeps any thread from reusing a cached
/// stack, and the fixture's 256 KiB stacks keep all 8 within glibc's stack cache, which would
/// otherwise free the DTVs of the stacks beyond its 40 MiB), and a thread's exit frees from inside
/// libc, without memtrace having seen them allocated, the blocks its tcache still holds (one a
/// size class: the 4 sizes a thread churns fall in 4 classes) and the tcache itself: the
/// allocator's internal frees, not untracked ones.
const DTV_BYTES: u64 = 17 * 16;
const TCACHE_FREES_A_THREAD: u64 = 4 + 1;

fn expected() -> Figures {
    let churned: u64 = (0..THREADS).map(churn_bytes).sum();
    let leaked: u64 = (0..THREADS).map(leak_bytes).sum();
    Figures {
        allocations: THREADS * (ITERATIONS + LEAKS) + THREADS,
        frees: THREADS * ITERATIONS,
        allocated_bytes: churned + leaked + THREADS * DTV_BYTES,
        freed_bytes: churned,
        live_allocations: (THREADS * LEAKS + THREADS) as i64,
        live_bytes: (leaked + THREADS * DTV_BYTES) as i64,
        // Depends on how the threads interleave.
        peak_live_bytes: None,
        untracked_frees: 0,
        failed_allocations: 0,
    }
}

/// Traces `program` to its end while an untraced copy of it (`program busy`) allocates on 4
/// threads of its own; the neighbour is up before memtrace starts and stopped after it ends.
fn trace_beside_a_busy_neighbour(program: &std::path::Path) -> Outcome {
    let mut neighbour = Spawned::spawn({
        let mut command = Command::new(program);
        command.arg("busy");
        command
    });
    neighbour.wait_for_stdout("busy");
    let outcome = Memtrace::new().command(program).run();
    neighbour.close_stdin();
    assert!(neighbour.wait().success(), "the untraced neighbour failed: {}", neighbour.stderr_text());
    outcome
}

fn stack_names(leak: &Value) -> Vec<&str> {
    leak["stack"].as_array().unwrap().iter().map(|frame| frame.as_str().unwrap()).collect()
}

/// Every thread's leaks are one group whose stack runs leak_one -> leak_blocks -> worker, with the
/// exact blocks and bytes; the only other group is glibc's DTVs.
fn assert_whole_leak_stacks(process: &Value) {
    let leaks = process["leaks"].as_array().unwrap_or_else(|| panic!("no leaks: {process:#}"));
    let from_fixture: Vec<&Value> = leaks.iter().filter(|leak| leak["stack"][0] == "leak_one").collect();
    assert_eq!(from_fixture.len(), 1, "one leak group from leak_one: {leaks:#?}");
    let leak = from_fixture[0];
    assert_eq!(leak["allocations"], THREADS * LEAKS, "every leak in one group: {leaks:#?}");
    assert_eq!(
        leak["bytes"],
        (0..THREADS).map(leak_bytes).sum::<u64>(),
        "every leak in one group: {leaks:#?}"
    );
    let names = stack_names(leak);
    assert!(names.starts_with(&["leak_one", "leak_blocks", "worker"]), "a stack cut short: {names:?}");
    assert!(names.iter().all(|name| !name.contains("[unknown]")), "a frame outside every mapping: {names:?}");
    assert_eq!(leaks.len(), 2, "the fixture's leaks and glibc's DTVs only: {leaks:#?}");
}

fn assert_exact_under_preemption(program: &std::path::Path) {
    let outcome = trace_beside_a_busy_neighbour(program);
    outcome.assert_exit_code(0);
    assert_figures(&outcome, expected());
    assert_eq!(outcome.process()["allocator_internal_frees"], THREADS * TCACHE_FREES_A_THREAD);
    assert_whole_leak_stacks(outcome.process());
}

#[test]
fn threads_with_frame_pointers_beside_a_busy_neighbour_are_exact_with_whole_stacks() {
    assert_exact_under_preemption(&fixture("preemption"));
}

#[test]
fn threads_without_frame_pointers_beside_a_busy_neighbour_are_exact_with_whole_stacks() {
    assert_exact_under_preemption(&fixture_variant("preemption", "nofp", &["-O2", "-fomit-frame-pointer"]));
}
