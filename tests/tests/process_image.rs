//! A process's image, read safely: paths the target gives are resolved inside its own root (an
//! absolute symlink planted there never reaches the host's file), and files that are not regular
//! files are refused at once, by name, instead of being read without end.

use std::{fs, process::Command};

use memtrace_tests::{assert_figures, fixture, Memtrace, Spawned, LEAKS};

/// The target's mount namespace has a tmpfs over a directory H that the host has too. Inside, H/
/// holds a copy of libc (bind-mounted over the system's libc, so it is the one the target maps)
/// and `link.so`, an absolute symlink to H/alloc.so. On the host, H/alloc.so is a text file.
/// `--lib H/link.so` must lead to the target's copy: resolved on the host, the symlink would reach
/// the host's text file and memtrace would fail (or, were it a library, probe a file the target
/// never maps).
#[test]
fn lib_symlink_in_the_target_root_resolves_inside_it() {
    let run = Memtrace::new();
    let shared = run.dir().join("h");
    fs::create_dir_all(&shared).unwrap();
    fs::write(shared.join("alloc.so"), b"the host's file, not the target's\n").unwrap();
    let libc = "/usr/lib/x86_64-linux-gnu/libc.so.6";
    let script = format!(
        "set -e; mount -t tmpfs none {h}; cp {libc} {h}/alloc.so; ln -s {h}/alloc.so {h}/link.so; \
         mount --bind {h}/alloc.so {libc}; exec {fixture} hold",
        h = shared.display(),
        fixture = fixture("leaks").display()
    );
    let mut command = Command::new("unshare");
    command.args(["--mount", "--propagation", "private", "sh", "-c", &script]);
    let mut target = Spawned::spawn(command);
    target.wait_for_stdout("ready");
    assert!(!shared.join("link.so").exists(), "the symlink exists only in the target's namespace");
    let lib = shared.join("link.so");
    let mut memtrace = run.args(["--pid", &target.pid().to_string(), "--lib"]).arg(&lib).spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    target.send(b"g");
    assert!(target.wait().success());
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    assert_figures(&outcome, LEAKS);
    assert_eq!(outcome.process()["allocator"], lib.to_str().unwrap());
}

#[test]
fn lib_or_usdt_path_that_is_not_a_regular_file_is_refused_by_name() {
    let outcome = Memtrace::new().args(["--lib", "/dev/zero"]).command(&fixture("leaks")).run();
    outcome.assert_exit_code(1);
    outcome.assert_stderr_mentions(&[
        "--lib /dev/zero",
        "/dev/zero is not a regular file",
        "character device",
    ]);
    assert!(!outcome.stderr.contains("memtrace: tracing"), "{}", outcome.stderr);
}

#[test]
fn usdt_listing_of_a_device_is_refused_by_name() {
    let outcome = Memtrace::new().without_default_outputs().args(["usdt", "/dev/zero"]).run();
    outcome.assert_exit_code(1);
    outcome.assert_stderr_mentions(&["/dev/zero is not a regular file", "character device"]);

    let fifo = Memtrace::new();
    let path = fifo.dir().join("fifo");
    assert!(Command::new("mkfifo").arg(&path).status().unwrap().success());
    let outcome = fifo.without_default_outputs().arg("usdt").arg(&path).run();
    outcome.assert_exit_code(1);
    outcome.assert_stderr_mentions(&["is not a regular file (a FIFO)"]);
}
