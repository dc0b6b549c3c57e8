//! System-wide tracing (--all): short-lived processes that start after memtrace, through glibc or
//! jemalloc, each exact; memtrace itself never traced; kernel state of exited processes released.

use std::{process::Command, sync::Mutex, time::Instant};

use memtrace_tests::{
    assert_figures_of, figures_of, fixture, fixture_variant, Memtrace, Outcome, DEADLINE, LEAKS,
};
use serde_json::Value;

fn run_to_exit(program: &std::path::Path) -> u32 {
    let mut child = Command::new(program).spawn().expect("starting a fixture");
    let pid = child.id();
    assert!(child.wait().unwrap().success());
    pid
}

fn process(outcome: &Outcome, pid: u32) -> &Value {
    outcome.summary()["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == pid)
        .unwrap_or_else(|| panic!("pid {pid} is not in the summary:\n{}", outcome.stderr))
}

fn leak_bytes(process: &Value, function: &str) -> Option<(u64, u64)> {
    let leak = process["leaks"]
        .as_array()?
        .iter()
        .find(|leak| leak["frames"][0]["function"] == function || leak["stack"][0] == function)?;
    Some((leak["bytes"].as_u64()?, leak["allocations"].as_u64()?))
}

/// One system-wide run at a time: each would see the other's fixtures.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs memtrace --all with `args`, runs `work` once it is tracing, then ends it with SIGINT.
/// One system-wide run at a time: each would see the other's fixtures.
fn trace_all_while(args: &[&str], work: impl FnOnce()) -> (Outcome, u32) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut memtrace = Memtrace::new().arg("--all").args(args).spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    let memtrace_pid = memtrace.pid();
    work();
    memtrace.interrupt();
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    (outcome, memtrace_pid)
}

#[test]
fn short_lived_processes_started_later_are_each_exact() {
    let glibc = fixture("leaks");
    let jemalloc = fixture_variant("leaks", "jemalloc", &["-ljemalloc"]);
    let mut glibc_pids = Vec::new();
    let mut jemalloc_pids = Vec::new();
    let (outcome, memtrace_pid) = trace_all_while(&[], || {
        for _ in 0..3 {
            glibc_pids.push(run_to_exit(&glibc));
            jemalloc_pids.push(run_to_exit(&jemalloc));
        }
    });
    for &pid in &glibc_pids {
        let process = process(&outcome, pid);
        assert_figures_of(process, LEAKS);
        assert_eq!(process["allocator_kind"], "glibc");
        assert_eq!(process["exited"], true);
    }
    for &pid in &jemalloc_pids {
        let process = process(&outcome, pid);
        assert_eq!(process["allocator_kind"], "jemalloc", "{process:#}");
        // libstdc++, which Debian's libjemalloc pulls in, allocates at start-up too; the source's
        // own call sites are exact.
        assert_eq!(leak_bytes(process, "leak_textures"), Some((5000, 5)), "{:#}", process["leaks"]);
        assert_eq!(leak_bytes(process, "leak_cache"), Some((768, 3)), "{:#}", process["leaks"]);
        assert_eq!(process["frees"], 20);
    }
    let processes = outcome.summary()["processes"].as_array().unwrap();
    assert!(processes.iter().all(|p| p["pid"] != memtrace_pid), "memtrace traced itself");
    assert_eq!(outcome.summary()["lost_events"], 0);
}

#[test]
fn kernel_state_of_exited_processes_is_released() {
    const RUNS: usize = 30;
    let program = fixture("leaks");
    let started = Instant::now();
    let (outcome, _) = trace_all_while(&["--comm", "leaks"], || {
        for _ in 0..RUNS {
            run_to_exit(&program);
            assert!(started.elapsed() < DEADLINE);
        }
    });
    let processes = outcome.summary()["processes"].as_array().unwrap();
    assert_eq!(processes.len(), RUNS, "--comm leaks traces only the fixtures");
    for process in processes {
        assert_figures_of(process, LEAKS);
    }
    // Each run leaves 8 live blocks; none of them, nor any process entry, stays in the kernel.
    let maps = &outcome.summary()["kernel_maps"];
    assert_eq!(maps["released_processes"], RUNS as u64, "{maps:#}");
    assert_eq!(maps["processes"], 0, "{maps:#}");
    assert_eq!(maps["live_allocations"], 0, "{maps:#}");
    assert_eq!(maps["stack_totals"], 0, "{maps:#}");
}

/// The number of samples in the trace so far (one heap counter per process per sample, at least
/// one process being traced).
fn heap_counters(memtrace: &mut memtrace_tests::Running) -> usize {
    memtrace
        .wait_for_trace("a heap counter", |trace| trace.counters("heap").count() >= 1)
        .counters("heap")
        .count()
}

/// A pid used again is another process: each is reported once, with its own figures. The reuse is
/// forced: writing a pid to /proc/sys/kernel/ns_last_pid makes the kernel give the next process the
/// pid after it, if it is free.
#[test]
fn a_reused_pid_is_another_process() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut memtrace = Memtrace::new().arg("--all").spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    let first = run_to_exit(&fixture("leaks"));
    // Its final sample, and one more, after which its kernel state is released.
    memtrace.wait_for_trace("the first process's final figures", |trace| {
        trace.counters("heap").any(|event| event["pid"] == first && event["args"]["live_bytes"] == 5768)
    });
    let seen = heap_counters(&mut memtrace);
    memtrace.wait_for_trace("one more sample", |trace| trace.counters("heap").count() > seen);
    // Another process may take the pid first; try again a few times.
    let reused = (0..20).any(|_| {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (first - 1).to_string()).expect("writing ns_last_pid");
        run_to_exit(&fixture("leaks")) == first
    });
    assert!(reused, "pid {first} was never given out again");
    memtrace.interrupt();
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    let twice: Vec<&Value> =
        outcome.summary()["processes"].as_array().unwrap().iter().filter(|p| p["pid"] == first).collect();
    assert_eq!(twice.len(), 2, "{:#}", outcome.summary());
    for process in twice {
        assert_figures_of(process, LEAKS);
    }
}

/// A static program started under --all has its own malloc, probed by no one: memtrace holds its
/// exec (stopped from BPF at exec) until it is, so its figures are those `memtrace -- static-program` gives.
#[test]
fn a_static_program_started_later_is_exact_from_its_first_instruction() {
    let program = fixture_variant("leaks", "static", &["-static"]);
    let alone = Memtrace::new().command(&program).run();
    alone.assert_exit_code(0);
    let mut pid = 0;
    let (outcome, _) = trace_all_while(&[], || pid = run_to_exit(&program));
    assert_eq!(figures_of(process(&outcome, pid)), figures_of(&alone.summary()["processes"][0]));
    assert!(!outcome.stderr.contains("let go before their program"), "{}", outcome.stderr);
}
