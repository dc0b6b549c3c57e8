//! Interpreter frames in every output, not only the summary: one run of Debian's python3 on a
//! script whose allocations are known from its source, written as the flamegraph, the HTML report
//! (as Chromium draws it), pprof (as `go tool pprof` reads it), the Perfetto trace (decoded by
//! protoc with Perfetto's protos) and the OTLP request (decoded by the OpenTelemetry project's
//! definitions); `memtrace top` showing a Perl script's subs in a real terminal; and
//! `memtrace serve`'s heap profile naming a Perl script's subs.
//!
//! The figures: `bytearray(10000)` is one malloc of 10,001 bytes (CPython's small-object allocator
//! takes only requests of up to 512 bytes); Perl's `$_ = "x" x 10000` on a short scalar grows its
//! buffer with one realloc to 10,008 bytes (see tests/tests/perl.rs).

use std::{fs, path::Path, process::Command};

use memtrace_tests::{
    chromium::Chromium,
    otlp,
    perfetto::{decode, heap_samples},
    pprof::go_pprof,
    tmux::{Fifo, InTerminal, Streams},
    Memtrace, Spawned, INTERVAL,
};
use serde_json::Value;

/// make_cache keeps 400 blocks of 10,001 bytes, made at line 4 and called from line 7.
const PYTHON_CACHE: &str = "\
import os
def make_cache(keep):
    for i in range(len(keep)):
        keep[i] = bytearray(10000)
keep = [None] * 400
if __name__ == '__main__':
    make_cache(keep)
os._exit(0)
";
const PYTHON_CACHE_BYTES: u64 = 400 * 10_001;

/// make_cache (line 3) fills 400 scalars of 10,008 bytes, called from line 6 once a line comes
/// on stdin; then the script waits for end of file.
const PERL_CACHE: &str = "\
my @cache = map { \"\" . $_ } 1 .. 400;
sub make_cache {
    $_ = \"x\" x 10000 for @cache;
}
print \"ready\\n\"; $| = 1; <STDIN>;
make_cache();
print \"leaked\\n\"; 1 while <STDIN>;
";
const PERL_CACHE_BYTES: u64 = 400 * 10_008;

fn script(dir: &Path, name: &str, source: &str) -> String {
    let path = dir.join(name);
    fs::write(&path, source).unwrap();
    path.to_str().unwrap().to_owned()
}

/// Every file output of one run of the Python script names make_cache and <module> by file and
/// line, with make_cache's live bytes exact where the output carries figures.
#[test]
fn every_file_output_names_the_python_functions() {
    let memtrace = Memtrace::new();
    let dir = memtrace.dir().to_owned();
    let path = script(&dir, "cache.py", PYTHON_CACHE);
    let [svg, page, profile, perfetto, otlp_file] =
        ["live.svg", "report.html", "heap.pb.gz", "trace.pftrace", "heap.otlp.pb"].map(|name| dir.join(name));
    let outcome = memtrace
        .arg("--flamegraph")
        .arg(&svg)
        .arg("--html")
        .arg(&page)
        .arg("--pprof")
        .arg(&profile)
        .arg("--perfetto")
        .arg(&perfetto)
        .arg("--otlp")
        .arg(&otlp_file)
        .args(["--", "/usr/bin/python3", &path])
        .run();
    outcome.assert_exit_code(0);
    let pid = outcome.process()["pid"].as_u64().unwrap();
    let (cache, module) = (format!("make_cache ({path}:4)"), format!("<module> ({path}:7)"));

    let svg = fs::read_to_string(&svg).unwrap();
    for frame in [&cache, &module] {
        assert!(svg.contains(&escaped(frame)), "the flamegraph has no {frame}");
    }

    let raw = go_pprof(["-raw".as_ref(), profile.as_os_str()], &dir);
    for (function, line) in [("make_cache", 4), ("<module>", 7)] {
        let file_line = format!("{path}:{line}");
        assert!(names_line(&raw, function, &file_line), "pprof names {function} at {file_line}:\n{raw}");
    }
    let top = go_pprof(
        ["-sample_index=inuse_space", "-unit=B", "-top", "-cum", "-nodecount=200"]
            .iter()
            .map(|arg| arg.as_ref())
            .chain([profile.as_os_str()]),
        &dir,
    );
    assert_eq!(cum_bytes(&top, "make_cache"), Some(PYTHON_CACHE_BYTES), "{top}");

    let samples = heap_samples(&decode(&perfetto), pid as i64);
    let through_cache = samples.iter().filter(|sample| sample.stack.contains(&cache));
    let live: u64 = through_cache.map(|sample| sample.self_allocated - sample.self_freed).sum();
    assert_eq!(live, PYTHON_CACHE_BYTES, "Perfetto's heap profile through {cache}: {samples:#?}");

    let request = otlp::decode(&fs::read(&otlp_file).unwrap());
    assert_eq!(otlp_inuse_through(&request, "make_cache"), PYTHON_CACHE_BYTES, "{request}");

    let mut chromium = Chromium::start();
    chromium.open(&page);
    let shown = chromium.evaluate("document.body.innerText").as_str().unwrap_or_default().to_owned();
    assert!(shown.contains("make_cache"), "the HTML report names make_cache:\n{shown}");
    assert_eq!(chromium.errors(), Vec::<String>::new(), "the page logged errors");
}

/// `memtrace top -- perl SCRIPT` in a terminal: Enter on the script's row shows the stack through
/// main::make_cache with its live bytes; q leaves with the command's status, 0.
#[test]
fn top_shows_a_perl_scripts_subs() {
    let memtrace = Memtrace::new();
    let dir = memtrace.dir().to_owned();
    let path = script(&dir, "cache.pl", PERL_CACHE);
    let mut stdin = Fifo::create(dir.join("stdin"));
    let args = ["top", "-i", INTERVAL, "--", "/usr/bin/perl", &path];
    let streams = Streams { stdin: Some(&stdin), stdout_to_file: true, stderr_to_file: true };
    let run = InTerminal::start(&dir, &args, streams);
    let tmux = &run.tmux;
    tmux.wait_for("every probe attached");
    stdin.send(b"\n");
    tmux.wait_for(" perl ");
    tmux.send("Enter");
    // 4,003,200 bytes in 400 blocks, as the view rounds them; the stack's line is cut at the
    // terminal's width, within the script's path.
    let cache_stack = |line: &&str| line.contains("3.8 MiB     400 blocks");
    let screen =
        tmux.wait_until("main::make_cache's stack", |screen| screen.lines().any(|l| cache_stack(&l)));
    let line = screen.lines().find(cache_stack).unwrap();
    assert!(line.contains("Perl_pp_sassign < main::make_cache ("), "{screen}");
    tmux.send("Escape");
    stdin.close();
    tmux.wait_for("tracing ended");
    tmux.send("q");
    let (status, stderr) = (run.status(), run.stderr());
    assert_eq!(status, 0, "stderr:\n{stderr}");
}

/// `memtrace serve --pid` of a running perl: its heap profile, as `go tool pprof` reads it from
/// the endpoint, holds main::make_cache's live bytes exactly.
#[test]
fn serves_heap_profile_names_a_perl_scripts_subs() {
    let scratch = tempfile::tempdir().unwrap();
    let path = script(scratch.path(), "cache.pl", PERL_CACHE);
    let mut perl = Spawned::spawn({
        let mut command = Command::new("/usr/bin/perl");
        command.arg(&path);
        command
    });
    perl.wait_for_stdout("ready");
    let pid = perl.pid().to_string();
    let mut memtrace = Memtrace::new()
        .without_default_outputs()
        .args(["serve", "--listen", "127.0.0.1:0", "-i", INTERVAL, "--pid", &pid])
        .spawn();
    let port = memtrace.serving_port();
    memtrace.wait_for_stderr("memtrace: tracing");
    perl.send(b"\n");
    perl.wait_for_stdout("leaked");
    let url = format!("http://127.0.0.1:{port}/debug/pprof/heap?pid={pid}");
    let top = memtrace_tests::poll("main::make_cache's live bytes in the served profile", || {
        let top = go_pprof(
            ["-sample_index=inuse_space", "-unit=B", "-top", "-cum", "-nodecount=200", &url],
            scratch.path(),
        );
        (cum_bytes(&top, "main::make_cache") == Some(PERL_CACHE_BYTES)).then_some(top)
    });
    let raw = go_pprof(["-raw", &url], scratch.path());
    assert!(names_line(&raw, "main::make_cache", &format!("{path}:3")), "{raw}\n{top}");
    perl.close_stdin();
    assert!(perl.wait().success());
    memtrace.interrupt();
    memtrace.finish().assert_exit_code(0);
}

/// Whether a location of `go tool pprof -raw`'s listing names `function` at `file_line`.
fn names_line(raw: &str, function: &str, file_line: &str) -> bool {
    raw.lines().any(|line| {
        let words: Vec<&str> = line.split_whitespace().collect();
        words.get(3) == Some(&function) && words.get(4).is_some_and(|word| word.starts_with(file_line))
    })
}

/// A frame's name as the SVG writes it.
fn escaped(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The cumulative bytes `go tool pprof -top -cum -unit=B` gives `function`.
fn cum_bytes(top: &str, function: &str) -> Option<u64> {
    top.lines().find_map(|line| {
        let words: Vec<&str> = line.split_whitespace().collect();
        (words.len() >= 6 && words[5] == function).then(|| words[3].trim_end_matches('B').parse().ok())?
    })
}

/// The inuse_space samples of the request's one resource whose stack holds `function`, summed.
fn otlp_inuse_through(request: &Value, function: &str) -> u64 {
    let resources = request["resources"].as_array().unwrap();
    assert_eq!(resources.len(), 1, "{request}");
    let profile = resources[0]["profiles"]
        .as_array()
        .unwrap()
        .iter()
        .find(|profile| profile["sample_type"][0] == "inuse_space")
        .expect("an inuse_space profile");
    let samples = profile["samples"].as_array().unwrap();
    let through = samples.iter().filter(|sample| {
        sample["stack"].as_array().unwrap().iter().any(|frame| frame.as_str() == Some(function))
    });
    through.map(|sample| sample["values"][0].as_u64().unwrap()).sum()
}
