//! The BPF stack every program uses, as the running kernel's verifier reports it
//! (`memtrace verifier-report`): each chain of calls within the 512 bytes a chain may use on a
//! kernel without private stacks, even on a kernel that would accept more, and no uprobe program
//! on a private per-CPU stack (memtrace-ebpf/src/kernel_stack.rs), and none costing the verifier
//! more than a quarter of its budget. Both ways of loading the uprobes are checked: for
//! uprobe_multi links and for per-site perf links.

use memtrace_tests::{assert_root, memtrace_bin};
use serde_json::Value;

/// Every program memtrace loads.
const PROGRAMS: [&str; 14] = [
    "alloc_enter",
    "alloc_exit",
    "empty_enter",
    "empty_exit",
    "fork_return",
    "library_loaded",
    "map_enter",
    "map_exit",
    "oom_victim",
    "process_exec",
    "process_exit",
    "process_fork",
    "sampled_site",
    "usdt_site",
];

fn report(links: Option<&str>) -> Vec<Value> {
    assert_root();
    let mut command = std::process::Command::new(memtrace_bin());
    command.arg("verifier-report");
    if let Some(links) = links {
        command.env("MEMTRACE_LINKS", links);
    }
    let output = command.output().expect("running memtrace verifier-report");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "memtrace verifier-report failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout.lines().map(|line| serde_json::from_str(line).expect("a JSON line a program")).collect()
}

fn check(programs: &[Value]) {
    let names: Vec<&str> = programs.iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(names, PROGRAMS, "every program is reported, in name order");
    for program in programs {
        let name = &program["name"];
        let frames: Vec<u64> =
            program["frames"].as_array().unwrap().iter().map(|f| f.as_u64().unwrap()).collect();
        // The chain's sum as the verifier makes it, recomputed here from its figures.
        let chain: u64 = program["deepest_chain"]
            .as_array()
            .unwrap()
            .iter()
            .map(|at| frames[at.as_u64().unwrap() as usize].div_ceil(16) * 16)
            .sum();
        assert_eq!(chain, program["deepest_bytes"].as_u64().unwrap(), "{name}");
        assert!(
            chain <= 512,
            "{name}: its deepest chain of calls takes {chain} bytes of BPF stack: {program}"
        );
        // The verifier walks every path: alloc_exit took 405,903 instructions (1.3 s of the 1.6 s
        // `--all` needed to start on a 2-core VM) while the unwinder's frame steps were verified
        // once for every state a walk called them in, 100,188 once they were global functions
        // (memtrace-ebpf/src/stacks.rs). A quarter of the kernel's 1,000,000 leaves room for
        // what `--window` and the next features add.
        let processed = program["verifier_cost"]["insns_processed"].as_u64().unwrap();
        assert!(
            (1..=250_000).contains(&processed),
            "{name}: the verifier walked {processed} instructions to accept it: {program}"
        );
        let preemptible = program["preemptible"].as_bool().unwrap();
        if preemptible && !program["tail_call"].as_bool().unwrap() {
            let largest = frames.iter().max().copied().unwrap_or(0);
            assert!(
                largest < 64,
                "{name} may get a private stack (a {largest}-byte frame, no tail call): {program}"
            );
        }
    }
    // The ones that do real work on a preemptible path carry the tail call.
    for name in ["alloc_enter", "alloc_exit", "map_enter", "map_exit"] {
        let program = programs.iter().find(|p| p["name"] == name).unwrap();
        assert_eq!(program["tail_call"], true, "{name} holds the tail call that rules out a private stack");
    }
}

#[test]
fn every_chain_fits_512_bytes_and_no_uprobe_gets_a_private_stack() {
    check(&report(None));
}

#[test]
fn the_same_holds_for_per_site_links() {
    check(&report(Some("perf")));
}
