//! `memtrace report RUN.json`: every report made again from a saved run's summary, the same as
//! the run made them; and input that is not a summary refused, naming the file and the fix,
//! with nothing written.

use std::{
    ffi::OsStr,
    fs,
    path::{Path, PathBuf},
    process::{Command, Output},
};

use memtrace_tests::{fixture, memtrace_bin, pprof::go_pprof, Memtrace};

fn report(args: &[&Path]) -> Output {
    Command::new(memtrace_bin()).arg("report").args(args).output().expect("running memtrace report")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// `go tool pprof -raw` of a profile file: its samples, locations and mappings as text, without
/// the lines that name the file or when it was read.
fn pprof_raw(profile: &Path, home: &Path) -> String {
    let text = go_pprof([OsStr::new("-raw"), profile.as_os_str()], home);
    text.lines()
        .filter(|line| !line.starts_with("Duration:") && !line.starts_with("Time:"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// fixtures/leaks.c, traced with --summary and --pprof; then its summary made into pprof again:
/// `go tool pprof` reads the same samples, with the same figures, from both.
#[test]
fn a_saved_run_makes_the_same_pprof_again() {
    let memtrace = Memtrace::new();
    let dir = memtrace.dir().to_owned();
    let outcome = memtrace.arg("--pprof").arg(dir.join("run.pb.gz")).command(&fixture("leaks")).run();
    outcome.assert_exit_code(0);

    let again = dir.join("again.pb.gz");
    let flamegraph = dir.join("again.svg");
    let html = dir.join("again.html");
    let output = report(&[
        &dir.join("summary.json"),
        Path::new("--pprof"),
        &again,
        Path::new("--flamegraph"),
        &flamegraph,
        Path::new("--html"),
        &html,
    ]);
    assert!(output.status.success(), "memtrace report failed:\n{}", stderr(&output));
    assert!(stderr(&output).contains("pprof profile written to"), "{}", stderr(&output));

    let original = pprof_raw(&dir.join("run.pb.gz"), &dir);
    let remade = pprof_raw(&again, &dir);
    assert!(original.contains("leak_textures") && original.contains("5000"), "{original}");
    assert_eq!(remade, original, "the profile made again differs from the run's");
    let svg = fs::read_to_string(&flamegraph).unwrap();
    assert!(svg.contains("leak_textures") && svg.contains("leak_cache"), "the flamegraph lacks the leaks");
    assert!(fs::read_to_string(&html).unwrap().contains("leak_textures"));

    // With no output named, the text report of the run.
    let output = report(&[&dir.join("summary.json")]);
    assert!(output.status.success(), "{}", stderr(&output));
    let text = stderr(&output);
    assert!(text.contains("leak_textures") && text.contains("leak_cache"), "{text}");
}

/// A missing file, a file that is not JSON, a trace file, a summary of another version: each is
/// refused with the file named and what to give instead, exit status 1, and no output left.
#[test]
fn what_is_not_a_summary_is_refused_with_nothing_written() {
    let memtrace = Memtrace::new();
    let dir = memtrace.dir().to_owned();
    let outcome = memtrace.command(&fixture("leaks")).run();
    outcome.assert_exit_code(0);
    let write = |name: &str, text: &str| -> PathBuf {
        let path = dir.join(name);
        fs::write(&path, text).unwrap();
        path
    };
    let not_json = write("notes.txt", "memtrace ran here\n");
    let other_version = write("v99.json", r#"{"version": 99, "processes": []}"#);
    let cut = fs::read_to_string(dir.join("summary.json")).unwrap();
    let cut_short = write("cut.json", &cut[..cut.len() / 2]);
    let cases = [
        (dir.join("no-such-run.json"), "cannot read"),
        (not_json, "not JSON"),
        (dir.join("trace.json"), "trace file"),
        (other_version, "version 99"),
        (cut_short, "not JSON"),
    ];
    let html = dir.join("out.html");
    let pprof = dir.join("out.pb.gz");
    for (input, why) in &cases {
        let output = report(&[input, Path::new("--html"), &html, Path::new("--pprof"), &pprof]);
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{}: {text}", input.display());
        let error = text
            .lines()
            .find(|line| line.starts_with("memtrace: error:"))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(error.contains(&*input.to_string_lossy()) && error.contains(why), "{error}");
        assert!(error.contains("--summary"), "the error does not say what to give: {error}");
        assert!(!html.exists() && !pprof.exists(), "{} left an output behind", input.display());
    }
    let leftovers: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|name| name.contains("memtrace-partial"))
        .collect();
    assert_eq!(leftovers, Vec::<String>::new());

    // An output that is the summary itself is a usage error.
    let summary = dir.join("summary.json");
    let output = report(&[&summary, Path::new("--html"), &summary]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(stderr(&output).contains("same file"), "{}", stderr(&output));
}
