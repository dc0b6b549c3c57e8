//! `memtrace top` driven in a real terminal (tmux, a server of its own per test): it says when
//! every probe is attached, shows the fixture's exact live heap, its call stacks on Enter, and q
//! ends the run with every requested output written. And the progress line of a plain run: on a
//! terminal only, cleared before the final report.
//!
//! fixtures/leaks.c with "linger": says `ready`, waits for a byte on stdin, leaks 5768 bytes in 8
//! blocks (5000 from leak_textures, 768 from leak_cache), says `leaked`, and stays alive until
//! stdin reaches end of file; then exits 0.

use std::{fs, path::Path, process::Command};

use memtrace_tests::{
    fixture,
    tmux::{path, Fifo, InTerminal, Streams},
    Memtrace, Spawned, INTERVAL,
};
use serde_json::Value;

/// The process row of the list: its pid, command and exact live heap on one line.
fn shows_live_heap(screen: &str, pid: &str, live: &str) -> bool {
    screen
        .lines()
        .any(|line| line.trim_start().starts_with(pid) && line.contains(" leaks ") && line.contains(live))
}

fn summary_process(dir: &Path) -> Value {
    let text = fs::read_to_string(dir.join("summary.json")).expect("memtrace wrote the summary");
    let summary: Value = serde_json::from_str(&text).expect("the summary is whole JSON");
    let processes = summary["processes"].as_array().expect("processes").clone();
    assert_eq!(processes.len(), 1, "{summary:#}");
    processes[0].clone()
}

fn assert_leaks_figures(process: &Value) {
    assert_eq!(process["comm"], "leaks");
    assert_eq!(process["live_bytes"], 5768, "{process:#}");
    assert_eq!(process["live_allocations"], 8, "{process:#}");
    assert_eq!(process["allocations"], 28, "{process:#}");
    let leaks = process["leaks"].to_string();
    assert!(leaks.contains("leak_textures") && leaks.contains("leak_cache"), "{process:#}");
}

/// `memtrace top -- leaks linger`: the status line, the exact live heap, the stacks on Enter; the
/// command ends, the view keeps the final figures, q leaves with the command's status (0) and
/// the summary written.
#[test]
fn top_shows_a_command_live_and_its_stacks_on_enter() {
    let memtrace = Memtrace::new();
    let dir = memtrace.dir().to_owned();
    let mut fifo = Fifo::create(dir.join("stdin"));
    let (summary, leaks) = (dir.join("summary.json"), fixture("leaks"));
    let args = ["top", "-i", INTERVAL, "--summary", path(&summary), "--", path(&leaks), "linger"];
    let streams = Streams { stdin: Some(&fifo), stdout_to_file: true, stderr_to_file: true };
    let run = InTerminal::start(&dir, &args, streams);
    let tmux = &run.tmux;
    tmux.wait_for("every probe attached");
    fifo.send(b"g");
    let screen = tmux.wait_until("the live heap of leaks", |screen| shows_live_heap(screen, "", "5768 B"));
    assert!(screen.contains("LIVE HEAP") && screen.contains("q quit"), "{screen}");
    tmux.send("Enter");
    let screen = tmux.wait_for("leak_textures");
    assert!(screen.contains("5000 B") && screen.contains("leak_cache"), "{screen}");
    assert!(screen.contains("live heap 5768 B in 8 blocks"), "{screen}");
    tmux.send("Escape");
    tmux.wait_for("PID");
    // The help line names the keys, and marks the sort in use.
    tmux.send("d");
    tmux.wait_for("d dark memory*");
    tmux.send("h");
    tmux.wait_for("h live heap*");
    fifo.close();
    tmux.wait_for("tracing ended");
    tmux.send("q");
    let (status, stderr) = (run.status(), run.stderr());
    assert_eq!(status, 0, "stderr:\n{stderr}");
    // What memtrace and the command wrote while the view ran is written out once it has gone.
    assert!(stderr.contains("memtrace: tracing pid") && stderr.contains("summary written"), "{stderr}");
    assert_eq!(run.stdout(), "ready\nleaked\n", "the command's output");
    assert_leaks_figures(&summary_process(&dir));
}

/// `memtrace top --pid`: q ends the run as SIGINT does, with every output written, exit 0.
#[test]
fn q_ends_the_run_with_the_outputs_written() {
    let memtrace = Memtrace::new();
    let dir = memtrace.dir().to_owned();
    let mut leaks = Spawned::spawn({
        let mut command = Command::new(fixture("leaks"));
        command.arg("linger");
        command
    });
    leaks.wait_for_stdout("ready");
    let pid = leaks.pid().to_string();
    let summary = dir.join("summary.json");
    let args = ["top", "-i", INTERVAL, "--summary", path(&summary), "--pid", &pid];
    let run = InTerminal::start(&dir, &args, Streams { stderr_to_file: true, ..Streams::default() });
    let tmux = &run.tmux;
    tmux.wait_for("every probe attached");
    leaks.send(b"g");
    leaks.wait_for_stdout("leaked");
    tmux.wait_until("the live heap of leaks", |screen| shows_live_heap(screen, &pid, "5768 B"));
    tmux.send("q");
    let (status, stderr) = (run.status(), run.stderr());
    assert_eq!(status, 0, "stderr:\n{stderr}");
    assert!(leaks.try_wait().is_none(), "q ended the traced process, not only the run");
    let process = summary_process(&dir);
    assert_leaks_figures(&process);
    assert_eq!(process["pid"].to_string(), pid);
}

/// A plain run on a terminal shows its progress on one line once it has gone on for 2 s, and
/// clears it before the final report.
#[test]
fn a_long_run_on_a_terminal_shows_its_progress() {
    let memtrace = Memtrace::new();
    let dir = memtrace.dir().to_owned();
    let mut fifo = Fifo::create(dir.join("stdin"));
    let (trace, leaks) = (dir.join("trace.json"), fixture("leaks"));
    let args = ["-i", INTERVAL, "-o", path(&trace), "--", path(&leaks), "linger"];
    let run = InTerminal::start(&dir, &args, Streams { stdin: Some(&fifo), ..Streams::default() });
    let tmux = &run.tmux;
    tmux.wait_for("memtrace: tracing");
    fifo.send(b"g");
    let progress =
        |screen: &str| screen.lines().any(|l| l.starts_with("memtrace: ") && l.contains("(1 running)"));
    let screen =
        tmux.wait_until("the progress line", |screen| progress(screen) && screen.contains(" 48 events"));
    assert!(
        screen.contains("1 process (1 running)")
            && screen.contains(" 48 events ")
            && screen.contains(" 0 lost"),
        "{screen}"
    );
    fifo.close();
    assert_eq!(run.status(), 0);
    let screen = tmux.screen().expect("the pane stays once its command has ended");
    assert!(screen.contains("memtrace: traced 1 process"), "{screen}");
    assert!(!progress(&screen), "the progress line was not cleared:\n{screen}");
}

/// Where stderr is not a terminal (a pipe here, as in CI) no progress line is written, however
/// long the run: stderr holds whole lines only.
#[test]
fn no_progress_line_when_stderr_is_not_a_terminal() {
    let mut running = Memtrace::new().args(["-d", "2500ms"]).command(&fixture("wait_stdin")).spawn();
    running.wait_for_stdout("ready ");
    running.wait_for_stderr_containing("still waiting for wait_stdin");
    running.close_stdin();
    let outcome = running.finish();
    outcome.assert_exit_code(0);
    assert!(!outcome.stderr.contains('\r') && !outcome.stderr.contains('\x1b'), "{:?}", outcome.stderr);
    assert!(!outcome.stderr.contains("running)"), "{}", outcome.stderr);
}

/// Without a terminal (a new session has none), `memtrace top` says so and exits 1 before
/// anything is traced; the command is never run.
#[test]
fn top_without_a_terminal_says_so() {
    let outcome = Memtrace::new()
        .without_default_outputs()
        .wrapped_in(["setsid", "--wait"])
        .args(["top", "--"])
        .arg(fixture("wait_stdin"))
        .run();
    outcome.assert_exit_code(1);
    let error = outcome.error_line();
    assert!(error.contains("draws on a terminal") && error.contains("/dev/tty"), "{error}");
    assert!(!outcome.stderr.contains("memtrace: tracing"), "{}", outcome.stderr);
}
