//! System-wide tracing (--all): short-lived processes that start after memtrace, through glibc or
//! jemalloc, each exact; memtrace itself never traced; kernel state of exited processes released.

use std::{process::Command, sync::Mutex, time::Instant};

use memtrace_tests::{assert_figures_of, fixture, fixture_variant, Memtrace, Outcome, DEADLINE, LEAKS};
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

/// Runs memtrace --all with `args`, runs `work` once it is tracing, then ends it with SIGINT.
/// One system-wide run at a time: each would see the other's fixtures.
fn trace_all_while(args: &[&str], work: impl FnOnce()) -> (Outcome, u32) {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
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
