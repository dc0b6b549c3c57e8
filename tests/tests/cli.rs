//! The command line's contract: exit statuses and error messages.

use std::{
    fs,
    process::{Command, Stdio},
    sync::Mutex,
};

use memtrace_tests::{
    assert_figures, assert_figures_of, fixture, fixture_variant, unused_pid, workspace_root, Memtrace,
    Spawned, LEAKS,
};

#[test]
fn exit_status_of_the_command_is_passed_on() {
    // fixtures/exit_status.c returns 3 from main.
    let outcome = Memtrace::new().command(&fixture("exit_status")).run();
    outcome.assert_exit_code(3);
    assert!(outcome.trace().closed, "the trace is not finished");
}

#[test]
fn unknown_pid_is_an_error_naming_it() {
    let pid = unused_pid().to_string();
    let outcome = Memtrace::new().args(["--pid", &pid]).run();
    outcome.assert_exit_code(1);
    assert!(outcome.error_line().contains(&pid), "{}", outcome.stderr);
}

#[test]
fn unwritable_output_is_an_error_naming_it() {
    let outcome =
        Memtrace::new().without_default_outputs().args(["-o", "/nonexistent/x.json", "--", "true"]).run();
    outcome.assert_exit_code(1);
    assert!(outcome.error_line().contains("/nonexistent/x.json"), "{}", outcome.stderr);
}

#[test]
fn missing_command_is_an_error() {
    let outcome = Memtrace::new().args(["--", "memtrace-test-no-such-command"]).run();
    outcome.assert_exit_code(1);
    assert!(outcome.error_line().contains("command not found"), "{}", outcome.stderr);
}

#[test]
fn malformed_duration_is_a_usage_error() {
    let outcome = Memtrace::new().args(["-d", "soon", "--", "true"]).run();
    outcome.assert_exit_code(2);
    outcome.assert_stderr_mentions(&["soon"]);
}

#[test]
fn no_target_is_a_usage_error() {
    let outcome = Memtrace::new().run();
    outcome.assert_exit_code(2);
    outcome.assert_stderr_mentions(&["Usage"]);
}

#[test]
fn unprivileged_run_says_what_it_needs() {
    let memtrace = Memtrace::unprivileged();
    let outcome = memtrace.args(["--", "true"]).run();
    outcome.assert_exit_code(1);
    let error = outcome.error_line();
    assert!(error.contains("root") && error.contains("CAP_BPF"), "{}", outcome.stderr);
}

/// The capabilities the guide's "Privileges" table (docs/src/usage.md) lists, as setpriv spells
/// them (`+bpf,...`).
fn documented_capabilities() -> String {
    let usage =
        fs::read_to_string(workspace_root().join("docs/src/usage.md")).expect("reading docs/src/usage.md");
    let section =
        usage.split("\n## Privileges\n").nth(1).expect("docs/src/usage.md has a Privileges section");
    let names: Vec<String> = section
        .lines()
        .skip_while(|line| !line.starts_with("| capability"))
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .filter_map(|line| line.split('`').nth(1))
        .map(|name| format!("+{}", name.trim_start_matches("CAP_").to_lowercase()))
        .collect();
    assert!(!names.is_empty(), "no capability in the Privileges table of docs/src/usage.md");
    names.join(",")
}

/// memtrace as uid 65534 with exactly `capabilities` (setpriv's spelling), and nothing else.
fn with_capabilities(capabilities: &str) -> Memtrace {
    Memtrace::as_nobody([
        format!("--inh-caps=-all,{capabilities}"),
        format!("--ambient-caps=-all,{capabilities}"),
    ])
}

/// The fixture `name` where memtrace as nobody can run it.
fn fixture_for(memtrace: &Memtrace, name: &str) -> std::path::PathBuf {
    memtrace.reachable(&fixture(name))
}

#[test]
fn the_documented_capabilities_are_enough() {
    let capabilities = documented_capabilities();
    let memtrace = with_capabilities(&capabilities);
    let leaks = fixture_for(&memtrace, "leaks");
    let outcome = memtrace.command(&leaks).run();
    outcome.assert_exit_code(0);
    assert_figures(&outcome, LEAKS);
    // Holding the tree's execs needs no capability of its own (a stop from BPF, and a SIGCONT to
    // memtrace's own session), so nothing is said to be missed.
    assert!(!outcome.stderr.contains("cannot hold execs"), "{}", outcome.stderr);
}

#[test]
fn a_missing_capability_is_named_with_what_needs_it() {
    // CAP_BPF and CAP_PERFMON load the programs and make uprobe_multi links; per-site links are
    // uprobe perf events, which the kernel refuses without CAP_SYS_ADMIN.
    let memtrace = with_capabilities("+bpf,+perfmon").env("MEMTRACE_LINKS", "perf");
    let leaks = fixture_for(&memtrace, "leaks");
    let outcome = memtrace.command(&leaks).run();
    outcome.assert_exit_code(1);
    let error = outcome.error_line();
    assert!(error.contains("missing: CAP_SYS_ADMIN (perf_event_open"), "{}", outcome.stderr);

    // Another user's process needs CAP_SYS_PTRACE to be read through /proc.
    let mut target = Spawned::spawn(Command::new(fixture("wait_stdin")));
    target.wait_for_stdout("ready ");
    let pid = target.pid().to_string();
    let outcome = with_capabilities("+bpf,+perfmon,+sys_admin").args(["--pid", &pid]).run();
    outcome.assert_exit_code(1);
    let error = outcome.error_line();
    assert!(error.contains(&pid) && error.contains("missing: CAP_SYS_PTRACE"), "{}", outcome.stderr);
}

#[test]
fn a_kernel_thread_is_not_traced_and_says_why() {
    let name = fs::read_to_string("/proc/2/comm").expect("pid 2 exists");
    assert_eq!(name.trim(), "kthreadd", "pid 2 is the kernel thread daemon");
    let outcome = Memtrace::new().args(["--pid", "2"]).run();
    outcome.assert_exit_code(1);
    assert!(outcome.error_line().contains("pid 2 (kthreadd) is a kernel thread"), "{}", outcome.stderr);
}

#[test]
fn a_zombie_is_not_traced_and_says_why() {
    let mut child = Command::new("true").stdin(Stdio::null()).spawn().expect("starting true");
    let pid = child.id();
    // Wait for it to exit without reaping it: until then it is a zombie.
    // SAFETY: waitid writes only the siginfo it is given.
    let waited = unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        libc::waitid(libc::P_PID, pid, &mut info, libc::WEXITED | libc::WNOWAIT)
    };
    assert_eq!(waited, 0, "waiting for pid {pid}");
    let outcome = Memtrace::new().args(["--pid", &pid.to_string()]).run();
    child.wait().expect("reaping true");
    outcome.assert_exit_code(1);
    let expected = format!("pid {pid} (true) is a zombie");
    assert!(outcome.error_line().contains(&expected), "{}", outcome.stderr);
}

/// `--comm` implies `--all` and may be given more than once; a program of another name is left out.
#[test]
fn comm_names_what_to_trace_system_wide() {
    // One system-wide run at a time in this file.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let programs = ["a", "b", "c"].map(|variant| fixture_variant("leaks", &format!("comm-{variant}"), &[]));
    let mut memtrace = Memtrace::new().args(["--comm", "leaks-comm-a", "--comm", "leaks-comm-b"]).spawn();
    memtrace.wait_for_stderr("memtrace: tracing all processes");
    let pids = programs.map(|program| {
        let mut child = Command::new(program).spawn().expect("starting a fixture");
        assert!(child.wait().unwrap().success());
        child.id()
    });
    memtrace.interrupt();
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    let processes = outcome.summary()["processes"].as_array().unwrap();
    for pid in &pids[..2] {
        let process = processes.iter().find(|p| p["pid"] == *pid);
        assert_figures_of(
            process.unwrap_or_else(|| panic!("pid {pid} not traced:\n{}", outcome.stderr)),
            LEAKS,
        );
    }
    assert!(processes.iter().all(|p| p["pid"] != pids[2]), "leaks-comm-c was traced: {processes:#?}");
    assert!(
        processes.iter().all(|p| p["comm"] == "leaks-comm-a" || p["comm"] == "leaks-comm-b"),
        "a process of another name was traced: {processes:#?}"
    );
}
