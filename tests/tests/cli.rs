//! The command line's contract: exit statuses and error messages.

use std::{fs, os::unix::fs::PermissionsExt};

use memtrace_tests::{fixture, unused_pid, Memtrace};

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
    let memtrace = Memtrace::new().wrapped_in([
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--inh-caps=-all",
    ]);
    // The unprivileged memtrace must be able to write its outputs: only privileges stand in its way.
    fs::set_permissions(memtrace.dir(), fs::Permissions::from_mode(0o777)).unwrap();
    let outcome = memtrace.args(["--", "true"]).run();
    outcome.assert_exit_code(1);
    let error = outcome.error_line();
    assert!(error.contains("root") && error.contains("CAP_BPF"), "{}", outcome.stderr);
}
