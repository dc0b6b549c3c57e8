//! memtrace never taints the kernel: Debian's kernels taint themselves (and log `memtrace (PID):
//! Using fanotify permission checks may lead to deadlock; tainting kernel`) when a program uses
//! fanotify permission events, which memtrace no longer does. A run that holds an exec (a traced
//! shell starting a static program, stopped at exec from BPF until it is probed) and `memtrace
//! doctor` leave /proc/sys/kernel/tainted as they found it, and no taint line in the kernel log.
//! On a kernel without Debian's patch (this host's) only the first half can fail; the matrix's
//! Debian kernels check both.

use std::process::Command;

use memtrace_tests::{figures_of, Memtrace};

fn tainted() -> u64 {
    let text = std::fs::read_to_string("/proc/sys/kernel/tainted").expect("reading /proc/sys/kernel/tainted");
    text.trim().parse().unwrap_or_else(|_| panic!("/proc/sys/kernel/tainted reads {text:?}"))
}

/// The kernel log's lines that say the kernel was tainted because of fanotify (printed once a
/// boot, by whichever program first used permission events).
fn fanotify_taint_lines() -> Vec<String> {
    let dmesg = Command::new("dmesg").output().expect("running dmesg");
    assert!(dmesg.status.success(), "dmesg: {}", String::from_utf8_lossy(&dmesg.stderr));
    String::from_utf8_lossy(&dmesg.stdout)
        .lines()
        .filter(|line| line.contains("fanotify") && line.contains("tainting kernel"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn holding_an_exec_and_the_doctor_leave_the_kernel_untainted() {
    let before = tainted();
    let program = memtrace_tests::fixture_variant("leaks", "static", &["-static"]);
    // Probed before it starts: its figures from its first instruction, static glibc's start-up included.
    let alone = Memtrace::new().command(&program).run();
    alone.assert_exit_code(0);
    let script = format!("{}; true", program.display());
    let shell = Memtrace::new().args(["--", "sh", "-c", &script]).run();
    shell.assert_exit_code(0);
    // The exec was held, and the static program exact from its first instruction.
    let held = shell.summary()["processes"].as_array().unwrap().iter().find(|p| p["comm"] == "leaks-static");
    let held = held.unwrap_or_else(|| panic!("no leaks-static in the summary:\n{}", shell.stderr));
    assert_eq!(figures_of(held), figures_of(&alone.summary()["processes"][0]), "{held:#}");
    assert!(!shell.stderr.contains("let go before their program"), "{}", shell.stderr);
    let mut doctor = Memtrace::new().without_default_outputs().arg("doctor").spawn();
    doctor.wait();
    let after = tainted();
    // Only new bits count: this host's kernel may have been tainted before (a WARNING, say).
    assert_eq!(after & !before, 0, "memtrace tainted the kernel: {before:#x} -> {after:#x}");
    assert_eq!(fanotify_taint_lines(), Vec::<String>::new());
}
