//! Outputs fail safe: what cannot work is refused before tracing, every I/O error names its file,
//! no summary is left half-written, a write error during the run stops tracing without orphaning
//! the command, a second interrupt says what still runs, and losses show while they happen.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use memtrace_tests::{fixture, Memtrace, Outcome, Trace};

/// Files in `dir` whose name says they are memtrace's partial outputs, or that are empty.
fn leftovers(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .unwrap_or_else(|err| panic!("listing {}: {err}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            let partial = path.to_string_lossy().contains("memtrace-partial");
            partial || fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == 0)
        })
        .collect()
}

fn assert_usage_error(outcome: &Outcome, needles: &[&str]) {
    outcome.assert_exit_code(2);
    outcome.assert_stderr_mentions(needles);
    assert!(!outcome.stderr.contains("memtrace: tracing"), "it traced:\n{}", outcome.stderr);
}

#[test]
fn one_file_for_two_outputs_is_refused_before_tracing() {
    let memtrace = Memtrace::new().without_default_outputs();
    let dir = memtrace.dir().to_owned();
    fs::create_dir(dir.join("sub")).unwrap();
    let outcome = memtrace
        .arg("-o")
        .arg(dir.join("run.json"))
        .arg("--summary")
        .arg(dir.join("sub/../run.json"))
        .command(&fixture("leaks"))
        .run();
    assert_usage_error(&outcome, &["-o/--output", "--summary", "same file"]);
    assert!(!dir.join("run.json").exists(), "a refused run wrote its output");

    // An existing file, named once directly and once through a symbolic link.
    let memtrace = Memtrace::new().without_default_outputs();
    let dir = memtrace.dir().to_owned();
    fs::write(dir.join("old.json"), "kept").unwrap();
    std::os::unix::fs::symlink(dir.join("old.json"), dir.join("link.json")).unwrap();
    let outcome = memtrace
        .arg("--summary")
        .arg(dir.join("old.json"))
        .arg("--flamegraph")
        .arg(dir.join("link.json"))
        .command(&fixture("leaks"))
        .run();
    assert_usage_error(&outcome, &["--summary", "--flamegraph", "same file"]);
    assert_eq!(fs::read_to_string(dir.join("old.json")).unwrap(), "kept");
}

#[test]
fn a_table_larger_than_the_kernel_allows_is_a_usage_error() {
    // memtrace's bound: 2^27 records, a table of 2^28 slots (12 GiB of kernel memory).
    for size in ["4294967295", "134217729"] {
        let outcome = Memtrace::new().args(["--max-allocations", size]).command(&fixture("leaks")).run();
        assert_usage_error(&outcome, &["--max-allocations", "134217728"]);
    }
}

#[test]
fn a_trace_that_cannot_be_written_is_named_and_leaves_no_summary() {
    let memtrace = Memtrace::new().without_default_outputs();
    let dir = memtrace.dir().to_owned();
    let outcome = memtrace
        .args(["-o", "/dev/full", "--summary"])
        .arg(dir.join("summary.json"))
        .command(&fixture("leaks"))
        .run();
    outcome.assert_exit_code(1);
    assert!(outcome.error_line().contains("/dev/full"), "{}", outcome.stderr);
    assert!(!dir.join("summary.json").exists(), "a summary was left behind");
    assert_eq!(leftovers(&dir), Vec::<PathBuf>::new());
}

#[test]
fn a_summary_that_cannot_be_written_is_named_and_the_trace_still_written() {
    let memtrace = Memtrace::new().without_default_outputs();
    let trace = memtrace.dir().join("trace.json");
    let outcome = memtrace
        .args(["-i", "100ms", "--summary", "/dev/full", "-o"])
        .arg(&trace)
        .command(&fixture("leaks"))
        .run();
    outcome.assert_exit_code(1);
    let error = outcome.error_line();
    assert!(error.contains("/dev/full") && error.contains("--summary"), "{}", outcome.stderr);
    assert!(outcome.trace().closed, "the trace was not finished:\n{}", outcome.stderr);
}

#[test]
fn a_run_that_fails_before_tracing_leaves_no_output() {
    let memtrace = Memtrace::new();
    let dir = memtrace.dir().to_owned();
    let outcome = memtrace
        .arg("--pprof")
        .arg(dir.join("heap.pb.gz"))
        .arg("--flamegraph")
        .arg(dir.join("flame.svg"))
        .args(["--", "memtrace-test-no-such-command"])
        .run();
    outcome.assert_exit_code(1);
    for name in ["trace.json", "summary.json", "heap.pb.gz", "flame.svg"] {
        assert!(!dir.join(name).exists(), "{name} was left behind by a failed run");
    }
    assert_eq!(leftovers(&dir), Vec::<PathBuf>::new());
}

/// A tmpfs of 64 KiB, filled but for 8 KiB: a disk that fills up during the run.
struct SmallDisk {
    path: PathBuf,
}

impl SmallDisk {
    fn mount(path: PathBuf) -> Self {
        fs::create_dir(&path).unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=64k", "memtrace-test", &path.to_string_lossy()])
            .status()
            .expect("running mount");
        assert!(status.success(), "mounting a tmpfs on {}", path.display());
        fs::write(path.join("filler"), vec![0u8; 56 * 1024]).expect("filling the tmpfs");
        Self { path }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.path).status();
    }
}

/// fixtures/wait_stdin.c allocates 1000 and 2000 bytes, says `ready`, and frees the 1000 only at
/// end of file on stdin. The trace fills the disk while it waits: memtrace says so naming the file,
/// stops tracing, writes the summary (the figures as tracing stopped: nothing freed yet), waits for
/// the command, and exits 1.
#[test]
fn a_full_disk_during_the_run_stops_tracing_but_not_the_command() {
    let memtrace = Memtrace::new().without_default_outputs();
    let dir = memtrace.dir().to_owned();
    let disk = SmallDisk::mount(dir.join("small"));
    let trace = disk.path.join("trace.json");
    let mut running = memtrace
        .arg("-o")
        .arg(&trace)
        .arg("--summary")
        .arg(dir.join("summary.json"))
        .args(["-i", "5ms"])
        .command(&fixture("wait_stdin"))
        .spawn();
    let ready = running.wait_for_stdout("ready ");
    let pid = ready.trim_start_matches("ready ").trim().to_owned();
    let error = running.wait_for_stderr("memtrace: error:");
    assert!(error.contains(&*trace.to_string_lossy()) && error.contains("No space left"), "{error}");
    running.wait_for_stderr_containing(&format!("still waiting for wait_stdin (pid {pid})"));
    running.close_stdin();
    let outcome = running.finish();
    outcome.assert_exit_code(1);
    assert!(!Path::new(&format!("/proc/{pid}")).exists(), "the command outlived memtrace");
    let process = outcome.process();
    assert_eq!(process["allocations"], 2);
    assert_eq!(process["frees"], 0, "tracing went on after the error");
    assert_eq!(process["live_bytes"], 3000);
    // What the trace holds still loads: it ends with a whole event.
    let text = fs::read_to_string(&trace).unwrap();
    let parsed = memtrace_tests::parse_trace(&text).expect("the trace cut short loads");
    assert!(!parsed.closed && parsed.counters("heap").count() > 0);
    drop(disk);
}

/// The first interrupt goes to the command (which ignores it here); the second stops tracing and
/// says that the command still runs; the third kills it. memtrace never leaves it behind.
#[test]
fn a_second_interrupt_says_what_still_runs() {
    let wait_stdin = fixture("wait_stdin");
    let mut running =
        Memtrace::new().args(["--", "/bin/sh", "-c", "trap '' INT; exec \"$0\""]).arg(&wait_stdin).spawn();
    let ready = running.wait_for_stdout("ready ");
    let pid = ready.trim_start_matches("ready ").trim().to_owned();
    running.interrupt();
    running.wait_for_stderr_containing("passed SIGINT on to the command");
    running.interrupt();
    let said = running.wait_for_stderr_containing("still waiting for");
    assert!(said.contains(&format!("(pid {pid})")) && said.contains("SIGKILL"), "{said}");
    running.interrupt();
    // Before stdin closes (which would end the command by itself).
    running.wait_for_stderr_containing(&format!("killed wait_stdin (pid {pid}) with SIGKILL"));
    let outcome = running.finish();
    outcome.assert_exit_code(128 + 9);
    assert!(!Path::new(&format!("/proc/{pid}")).exists(), "the command outlived memtrace");
    assert!(outcome.trace().closed, "the trace was not finished");
    assert!(outcome.summary()["processes"].as_array().is_some_and(|p| p.len() == 1));
}

/// fixtures/many_blocks.c holds 40 live blocks; a table of 16 loses 24 of them. The loss is said on
/// stderr and shows in the trace while the program still runs, not only at the end.
#[test]
fn losses_show_while_they_happen() {
    let mut running =
        Memtrace::new().args(["--max-allocations", "16"]).command(&fixture("many_blocks")).spawn();
    running.wait_for_stdout("ready ");
    // While the program still holds its blocks: in the trace, and on stderr from the same sample.
    let lost = |trace: &Trace| trace.counters("lost_events").any(|c| c["args"]["lost_events"] == 24);
    running.wait_for_trace("a lost_events counter of 24", lost);
    let said = running.wait_for_stderr_containing("(24 in all)");
    assert!(
        said.contains("events lost in the last interval") && said.contains("--max-allocations 16"),
        "{said}"
    );
    running.close_stdin();
    let outcome = running.finish();
    outcome.assert_exit_code(0);
    let process = outcome.process();
    assert_eq!(process["allocations"], 40);
    assert_eq!(process["lost_events"], 24);
    assert_eq!(process["untracked_frees"], 24);
    assert_eq!(process["frees"], 16);
    // Said once per interval in which the count grew, never again without growth.
    let totals: Vec<u64> = outcome
        .stderr
        .lines()
        .filter(|line| line.contains("events lost in the last interval"))
        .filter_map(|line| line.split('(').nth(1)?.split(' ').next()?.parse().ok())
        .collect();
    assert!(totals.windows(2).all(|pair| pair[0] < pair[1]), "said without growth:\n{}", outcome.stderr);
    assert_eq!(totals.last(), Some(&24), "{}", outcome.stderr);
}
