//! Perl's own frames in the stacks of Debian's perl (5.36, stripped, threads and multiplicity),
//! read from outside the interpreter: a script whose allocations are known from its source,
//! launched, attached, and with the reading turned off.
//!
//! The figures: assigning a 10,000-character string to a scalar that holds a short one grows its
//! buffer with one realloc to 10,008 bytes (sv.c's sv_grow: the length, its NUL and the byte
//! copy-on-write keeps spare, 10,002, rounded up to the 8 bytes of PERL_STRLEN_ROUNDUP); 20,000
//! characters make 20,008. The scalars are made (map) and the strings folded (`x` of constants)
//! before the subs run, so the subs allocate nothing else.

use std::{path::Path, process::Command};

use memtrace_tests::{function_row, guide::guide_example, leak_stack, leak_through, Memtrace};
use serde_json::Value;

const PERL: &str = "/usr/bin/perl";

/// make_cache (line 5) fills 400 scalars, make_index (line 8) 100; build (line 10) calls both,
/// from line 12 of the main program. With an argument, it waits for a line on stdin first.
const SUBS: &str = "\
use strict;
my @cache = map { \"\" . $_ } 1 .. 400;
my @index = map { \"\" . $_ } 1 .. 100;
sub make_cache {
    $_ = \"x\" x 10000 for @cache;
}
sub make_index {
    $_ = \"y\" x 20000 for @index;
}
sub build { make_cache(); make_index(); }
<STDIN> if @ARGV;
build();
exit 0;
";
const CACHE_BYTES: u64 = 400 * 10_008;
const INDEX_BYTES: u64 = 100 * 20_008;

fn script(dir: &Path) -> String {
    let path = dir.join("subs.pl");
    std::fs::write(&path, SUBS).unwrap();
    path.to_str().unwrap().to_owned()
}

/// The per-function row named `name`: (live inclusive, live exclusive) bytes.
fn function(process: &Value, name: &str) -> (Option<u64>, Option<u64>) {
    let row = function_row(process, name);
    (row["live_inclusive_bytes"].as_u64(), row["live_exclusive_bytes"].as_u64())
}

/// Each sub's leak, its frames in order where they ran, and the per-sub table.
fn assert_subs(process: &Value, path: &str) {
    for (sub, line, bytes, blocks) in
        [("make_cache", 5, CACHE_BYTES, 400), ("make_index", 8, INDEX_BYTES, 100)]
    {
        let frame = format!("main::{sub} ({path}:{line})");
        let leak = leak_through(process, &frame);
        assert_eq!((leak["bytes"].as_u64(), leak["allocations"].as_u64()), (Some(bytes), Some(blocks)));
        let stack = leak_stack(leak);
        let at = stack.iter().position(|name| *name == frame).unwrap();
        assert_eq!(
            stack[at + 1..at + 4],
            [
                format!("main::build ({path}:10)"),
                format!("main::RUNTIME ({path}:12)"),
                "Perl_runops_standard".into()
            ],
            "Perl frames go before the op loop that ran them: {stack:?}"
        );
        let frame =
            leak["frames"].as_array().unwrap().iter().find(|f| f["function"] == format!("main::{sub}"));
        let frame = frame.unwrap_or_else(|| panic!("no frame of {sub}: {leak:#}"));
        assert_eq!((frame["file"].as_str(), frame["line"].as_u64()), (Some(path), Some(line)), "{frame:#}");
        assert_eq!(frame["interpreter"], "perl", "{frame:#}");
        assert_eq!(function(process, &format!("main::{sub} ({path})")), (Some(bytes), Some(bytes)));
    }
    let both = CACHE_BYTES + INDEX_BYTES;
    assert_eq!(function(process, &format!("main::build ({path})")), (Some(both), Some(0)));
    let stops = &process["unwind_stops"];
    assert_eq!(stops["interpreter_unreadable"], 0, "every context was read: {stops:#}");
}

#[test]
fn a_launched_scripts_subs_hold_their_bytes_inclusive_and_exclusive() {
    let dir = tempfile::tempdir().unwrap();
    let path = script(dir.path());
    let outcome = Memtrace::new().args(["--", PERL, &path]).run();
    outcome.assert_exit_code(0);
    assert_subs(outcome.process(), &path);
    // The text report names them the same way, and its table has each sub once.
    let chain =
        format!("main::make_cache ({path}:5) <- main::build ({path}:10) <- main::RUNTIME ({path}:12)");
    assert!(outcome.stderr.contains(&chain), "{}", outcome.stderr);
    let table = outcome.stderr.split("live bytes by Perl sub (inclusive / exclusive):").nth(1);
    let table = table.unwrap_or_else(|| panic!("no table of Perl subs: {}", outcome.stderr));
    for row in [
        format!("5.7 MiB /        0 B  main::build ({path})"),
        format!("3.8 MiB /    3.8 MiB  main::make_cache ({path})"),
        format!("1.9 MiB /    1.9 MiB  main::make_index ({path})"),
    ] {
        assert!(table.contains(&row), "{row} in {table}");
    }
    // The guide's stacks.md shows make_cache's leak and the table of subs as the report prints them.
    let leak =
        outcome.stderr.lines().find(|line| line.trim_start().starts_with("leak: ") && line.contains(&chain));
    guide_example("perl-leak", leak.expect("the leak through make_cache, found above"));
    let heading = "live bytes by Perl sub (inclusive / exclusive):";
    let lines = outcome.stderr.lines().skip_while(|line| !line.contains(heading));
    let rows = lines.take_while(|line| line.contains(heading) || line.ends_with(&format!("({path})")));
    guide_example("perl-subs", &rows.collect::<Vec<_>>().join("\n"));
}

#[test]
fn an_attached_perl_has_its_frames_read_too() {
    let dir = tempfile::tempdir().unwrap();
    let path = script(dir.path());
    let mut command = Command::new(PERL);
    command.args([path.as_str(), "wait"]);
    let outcome = memtrace_tests::attached_until_released(command, b"go\n");
    assert_subs(outcome.process(), &path);
}

/// A perl that a traced shell starts (its exec held until its probes are in): followed, its subs
/// are read as a launched one's are.
#[test]
fn a_followed_perl_has_its_frames_read_too() {
    let dir = tempfile::tempdir().unwrap();
    let path = script(dir.path());
    // The `exit` keeps the shell from exec'ing perl itself: perl is the shell's child.
    let outcome = Memtrace::new().args(["--", "/bin/sh", "-c", &format!("{PERL} {path}; exit $?")]).run();
    outcome.assert_exit_code(0);
    assert_subs(outcome.process_named("perl"), &path);
}

#[test]
fn no_interpreter_frames_leaves_perls_native_frames_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = script(dir.path());
    let outcome = Memtrace::new().args(["--no-interpreter-frames", "--", PERL, &path]).run();
    outcome.assert_exit_code(0);
    let frames = outcome.summary()["frame_table"].as_array().unwrap();
    assert!(frames.iter().all(|f| f.get("interpreter").is_none()), "{frames:#?}");
    // The subs' 500 reallocs are one stack of native frames now.
    let leak = leak_through(outcome.process(), "Perl_pp_sassign");
    assert_eq!(leak["bytes"].as_u64(), Some(CACHE_BYTES + INDEX_BYTES), "{leak:#}");
}

/// descend recurses 40 deep and then fills 100 scalars (line 6): 41 of its frames and the main
/// program's, past the 32 interpreter frames a stack keeps.
const DEEP: &str = "\
use strict;
my @cache = map { \"\" . $_ } 1 .. 100;
sub descend {
    my ($depth) = @_;
    return descend($depth - 1) if $depth;
    $_ = \"x\" x 10000 for @cache;
}
descend(40);
exit 0;
";

/// A recursion deeper than the interpreter frames a stack keeps: the innermost 32 are kept, and
/// each stack cut so is counted in `unwind_stops` (`interpreter_depth_limit`); no context was
/// unreadable.
#[test]
fn perl_frames_past_the_limit_keep_the_innermost_and_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("deep.pl");
    std::fs::write(&path, DEEP).unwrap();
    let path = path.to_str().unwrap();
    let outcome = Memtrace::new().args(["--", PERL, path]).run();
    outcome.assert_exit_code(0);
    let process = outcome.process();
    let leak = leak_through(process, &format!("main::descend ({path}:6)"));
    assert_eq!((leak["bytes"].as_u64(), leak["allocations"].as_u64()), (Some(100 * 10_008), Some(100)));
    let perl: Vec<&Value> =
        leak["frames"].as_array().unwrap().iter().filter(|f| f["interpreter"] == "perl").collect();
    let lines: Vec<u64> = perl.iter().map(|f| f["line"].as_u64().unwrap()).collect();
    let mut expected = vec![6];
    expected.resize(32, 5);
    assert_eq!(lines, expected, "the innermost 32, every one descend's: {leak:#}");
    assert!(perl.iter().all(|f| f["function"] == "main::descend"), "{leak:#}");
    // The scalars, and the pads perl makes for each level of the recursion past the 32nd.
    let stops = &process["unwind_stops"];
    assert!(stops["interpreter_depth_limit"].as_u64().unwrap() >= 100, "{stops:#}");
    assert_eq!(stops["interpreter_unreadable"], 0, "{stops:#}");
}

/// Two threads (`threads`, each running an interpreter of its own, cloned from the main one)
/// fill 100 scalars each, fill_a (line 9) with 30,000 characters (30,008 bytes, as in SUBS),
/// fill_b (line 12) with 50,000 (50,008), through run (line 16); then they wait, and the main
/// thread ends the process with both alive, so that their scalars are live at the end.
const THREADS: &str = "\
use strict;
use threads;
use threads::shared;
use POSIX ();
my $ready :shared = 0;
my @a = map { \"\" . $_ } 1 .. 100;
my @b = map { \"\" . $_ } 1 .. 100;
sub fill_a {
    $_ = \"a\" x 30000 for @a;
}
sub fill_b {
    $_ = \"b\" x 50000 for @b;
}
sub run {
    my ($fill) = @_;
    $fill->();
    lock($ready);
    $ready++;
    cond_broadcast($ready);
    cond_wait($ready) while 1;
}
threads->create(\\&run, \\&fill_a);
threads->create(\\&run, \\&fill_b);
{
    lock($ready);
    cond_wait($ready) until $ready == 2;
}
POSIX::_exit(0);
";

/// Each thread's allocations have its own interpreter's frames, found through the thread key
/// perl keeps it under (glibc's thread-specific data, read from the thread's `struct pthread`).
#[test]
fn each_perl_threads_allocations_have_its_own_subs() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("threads.pl");
    std::fs::write(&path, THREADS).unwrap();
    let path = path.to_str().unwrap();
    let outcome = Memtrace::new().args(["--", PERL, path]).run();
    outcome.assert_exit_code(0);
    let process = outcome.process();
    for (sub, line, bytes) in [("fill_a", 9, 100 * 30_008), ("fill_b", 12, 100 * 50_008)] {
        assert_eq!(function(process, &format!("main::{sub} ({path})")), (Some(bytes), Some(bytes)));
        let frame = format!("main::{sub} ({path}:{line})");
        let leak = leak_through(process, &frame);
        assert_eq!((leak["bytes"].as_u64(), leak["allocations"].as_u64()), (Some(bytes), Some(100)));
        let stack = leak_stack(leak);
        let at = stack.iter().position(|name| *name == frame).unwrap();
        assert_eq!(stack[at + 1], format!("main::run ({path}:16)"), "{stack:?}");
    }
}
