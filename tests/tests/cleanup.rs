//! Killed with SIGKILL, memtrace leaves nothing loaded in the kernel and a trace that still loads.

use std::{collections::BTreeSet, fs, time::Instant};

use aya::programs::{loaded_links, loaded_programs};
use memtrace_tests::{fixture, parse_trace, Memtrace, DEADLINE};

/// Ids of the BPF programs a process holds, through program or link descriptors.
fn bpf_programs_held_by(pid: u32) -> BTreeSet<u32> {
    let fdinfo = fs::read_dir(format!("/proc/{pid}/fdinfo")).expect("reading fdinfo");
    fdinfo
        .filter_map(|entry| fs::read_to_string(entry.ok()?.path()).ok())
        .flat_map(|info| {
            info.lines()
                .filter_map(|line| line.strip_prefix("prog_id:")?.trim().parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// (id, name) of the programs among `ids` that are still loaded.
fn still_loaded(ids: &BTreeSet<u32>) -> Vec<(u32, String)> {
    loaded_programs()
        // A program unloaded while the kernel's list is walked is an error: it is gone.
        .filter_map(Result::ok)
        .filter(|program| ids.contains(&program.id()))
        .map(|program| {
            let name = program.name_as_str().unwrap_or("?").to_owned();
            (program.id(), name)
        })
        .collect()
}

/// Ids of the links that still attach one of the programs among `ids`.
fn links_of(ids: &BTreeSet<u32>) -> Vec<u32> {
    loaded_links()
        .filter_map(Result::ok)
        .filter(|link| ids.contains(&link.program_id()))
        .map(|link| link.id())
        .collect()
}

/// The fixture memtrace started, killed when the test ends: memtrace died without reaping it.
struct Orphan {
    pid: libc::pid_t,
}

impl Drop for Orphan {
    fn drop(&mut self) {
        // Only if the pid still names the fixture.
        let comm = fs::read_to_string(format!("/proc/{}/comm", self.pid)).unwrap_or_default();
        if comm.trim_end() == "wait_stdin" {
            // SAFETY: kill takes a pid and a signal and has no memory-safety preconditions.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
        }
    }
}

#[test]
fn sigkill_leaves_no_program_loaded_and_a_trace_that_loads() {
    let mut run = Memtrace::new().command(&fixture("wait_stdin")).spawn();
    run.wait_for_stderr("memtrace: tracing");
    let ready = run.wait_for_stdout("ready ");
    let _fixture = Orphan { pid: ready["ready ".len()..].trim().parse().expect("ready <pid>") };
    // Only this memtrace's programs: other tests may be running memtraces of their own.
    let programs = bpf_programs_held_by(run.pid());
    let loaded = still_loaded(&programs);
    assert!(
        loaded.iter().any(|(_, name)| name.starts_with("alloc_enter")),
        "memtrace holds no alloc_enter program: {loaded:?}"
    );
    assert!(!links_of(&programs).is_empty(), "memtrace's programs have no links");
    run.wait_for_trace("a heap counter", |trace| trace.counters("heap").count() >= 1);

    run.kill();

    // The kernel releases programs asynchronously once their last descriptor is closed.
    let deadline = Instant::now() + DEADLINE;
    loop {
        let left = still_loaded(&programs);
        let links = links_of(&programs);
        if left.is_empty() && links.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "BPF programs {left:?} and links {links:?} still loaded {DEADLINE:?} after SIGKILL"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }

    let text = fs::read_to_string(run.trace_path()).expect("reading the trace");
    let trace =
        parse_trace(&text).unwrap_or_else(|err| panic!("the trace cut short does not load ({err}):\n{text}"));
    assert!(!trace.closed, "a killed memtrace cannot have closed the trace");
    assert!(trace.counters("heap").count() >= 1, "{text}");
}
