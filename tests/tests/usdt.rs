//! USDT against the real kernel: fixtures built with <sys/sdt.h>, include/memtrace.h and
//! include/memtrace_usdt.rs report known values, and memtrace must decode exactly those.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    sync::{RwLock, RwLockReadGuard, RwLockWriteGuard},
};

use memtrace_tests::{workspace_root, Memtrace, Outcome, Running, Spawned, Trace};
use serde_json::Value;
use tempfile::TempDir;

/// A system-wide run attaches to every program that starts and raises its semaphores, which would
/// change what the other tests' fixtures see (one waiting for its own memtrace would report too
/// early): system-wide tests run alone, the others together.
static SYSTEM_WIDE: RwLock<()> = RwLock::new(());

/// A directory of its own for a test's builds; it holds the test's shared turn (see SYSTEM_WIDE).
struct BuildDir {
    dir: TempDir,
    _turn: Option<RwLockReadGuard<'static, ()>>,
}

impl BuildDir {
    fn path(&self) -> &Path {
        self.dir.path()
    }
}

fn build_dir() -> BuildDir {
    let turn = SYSTEM_WIDE.read().unwrap_or_else(|poisoned| poisoned.into_inner());
    BuildDir { dir: temp_dir(), _turn: Some(turn) }
}

fn temp_dir() -> TempDir {
    let parent = workspace_root().join("target/memtrace-tests");
    std::fs::create_dir_all(&parent).unwrap();
    tempfile::Builder::new().prefix("usdt-").tempdir_in(&parent).unwrap()
}

fn fixture_source(name: &str) -> PathBuf {
    workspace_root().join("tests/fixtures").join(name)
}

/// Runs `cc` with `args`, failing the test with the compiler's message.
fn cc(args: &[&str], output: &Path) -> PathBuf {
    let include = workspace_root().join("include");
    let result = Command::new("cc")
        .arg("-I")
        .arg(&include)
        .args(["-Wall", "-g"])
        .args(args)
        .arg("-o")
        .arg(output)
        .output()
        .expect("running cc");
    assert!(result.status.success(), "cc {args:?} failed:\n{}", String::from_utf8_lossy(&result.stderr));
    output.to_owned()
}

/// Compiles the Rust fixture `source` with rustc -O.
fn build_rust(dir: &Path, source: &str) -> PathBuf {
    let program = dir.join(source.trim_end_matches(".rs"));
    let result = Command::new("rustc")
        .args(["-O", "--edition", "2021", "-o"])
        .arg(&program)
        .arg(fixture_source(source))
        .output()
        .expect("running rustc");
    assert!(result.status.success(), "rustc failed:\n{}", String::from_utf8_lossy(&result.stderr));
    program
}

fn build_c(dir: &Path, source: &str, optimisation: &str) -> PathBuf {
    let source_path = fixture_source(source);
    let output = dir.join(format!("{}{}", source.trim_end_matches(".c"), optimisation));
    cc(&[optimisation, source_path.to_str().unwrap()], &output)
}

/// `NAME argN VALUE` and `NAME hits N` lines, as the fixtures write them, as (label, hits, value).
fn expectations(text: &str) -> BTreeMap<String, (Option<u64>, Option<i64>)> {
    let mut expected: BTreeMap<String, (Option<u64>, Option<i64>)> = BTreeMap::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            [probe, "hits", n] => expected.entry(probe.to_string()).or_default().0 = Some(n.parse().unwrap()),
            [probe, arg, value] => {
                expected.entry(format!("{probe}={arg}")).or_default().1 = Some(value.parse().unwrap())
            }
            _ => panic!("unexpected fixture line {line:?}"),
        }
    }
    expected
}

fn usdt_options(expected: &BTreeMap<String, (Option<u64>, Option<i64>)>) -> Vec<String> {
    expected.keys().flat_map(|label| ["--usdt".to_owned(), label.clone()]).collect()
}

/// Each tracked argument holds the fixture's value, and each counter its hits (1 unless given).
fn assert_usdt_matches(
    outcome: &Outcome,
    expected: &BTreeMap<String, (Option<u64>, Option<i64>)>,
    hits_of: impl Fn(&str) -> u64,
) {
    let usdt = &outcome.process()["usdt"];
    for (label, (hits, value)) in expected {
        let counter = &usdt[label];
        assert_eq!(
            counter["hits"].as_u64(),
            Some(hits.unwrap_or_else(|| hits_of(label))),
            "{label}: {counter} in {usdt}\n{}",
            outcome.stderr
        );
        if let Some(value) = value {
            assert_eq!(
                counter["value"].as_i64(),
                Some(*value),
                "{label}: {counter} in {usdt}\n{}",
                outcome.stderr
            );
        }
    }
    assert_eq!(outcome.summary()["lost_events"], 0, "{}", outcome.stderr);
}

fn tick_hits(expected: &BTreeMap<String, (Option<u64>, Option<i64>)>) -> impl Fn(&str) -> u64 {
    let ticks = expected["fixture:tick"].0.unwrap();
    move |label: &str| {
        if label.starts_with("fixture:tick") {
            ticks
        } else {
            1
        }
    }
}

/// Every argument form gcc emits at -O0 (stack slots) and -O2 (registers, constants), and the
/// hand-written ones (base+index*scale, index only, every register width, a global by symbol),
/// traced from the first instruction.
#[test]
fn argument_forms_decode_to_the_values_passed_at_o0_and_o2() {
    let dir = build_dir();
    for optimisation in ["-O0", "-O2"] {
        let program = build_c(dir.path(), "usdt_args.c", optimisation);
        // A dry run tells which probes and arguments there are.
        let listing = dir.path().join(format!("expected{optimisation}.txt"));
        let status =
            Command::new(&program).arg(&listing).stdin(std::process::Stdio::null()).status().unwrap();
        assert!(status.success());
        let expected = expectations(&std::fs::read_to_string(&listing).unwrap());
        assert!(expected.len() > 20, "{expected:?}");

        let written = dir.path().join(format!("written{optimisation}.txt"));
        let outcome = Memtrace::new()
            .args(usdt_options(&expected))
            .args(["--usdt", "fixture:tick"])
            .command(&program)
            .arg(&written)
            .run();
        outcome.assert_exit_code(0);
        let expected = expectations(&std::fs::read_to_string(&written).unwrap());
        assert_usdt_matches(&outcome, &expected, tick_hits(&expected));
        assert_eq!(outcome.process()["usdt"]["fixture:tick"]["hits"], 25);
        // Counting hits shows as a counter with `hits` and no `value`.
        let last = outcome
            .trace()
            .counters("usdt:fixture:tick")
            .last()
            .unwrap_or_else(|| panic!("no usdt:fixture:tick counter\n{}", outcome.trace_text()))
            .clone();
        assert_eq!(last["args"], serde_json::json!({"hits": 25}));
        let last = outcome.trace().counters("usdt:fixture:tick=arg0").last().unwrap().clone();
        assert_eq!(last["args"]["value"], 24 * 24);
    }
}

/// The same with --pid: the fixture fires only after memtrace said it is tracing.
#[test]
fn argument_forms_decode_in_a_running_process() {
    let dir = build_dir();
    let program = build_c(dir.path(), "usdt_args.c", "-O2");
    let probe_list = dir.path().join("dry.txt");
    Command::new(&program).arg(&probe_list).stdin(std::process::Stdio::null()).status().unwrap();
    let expected = expectations(&std::fs::read_to_string(&probe_list).unwrap());
    let written = dir.path().join("written.txt");
    let (mut fixture, memtrace) = attached(&program, &written, Memtrace::new().args(usdt_options(&expected)));
    fixture.send(b"go\n");
    assert!(fixture.wait().success());
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    let expected = expectations(&std::fs::read_to_string(&written).unwrap());
    assert_usdt_matches(&outcome, &expected, tick_hits(&expected));
}

/// A probe guarded by its semaphore: the fixture waits until the kernel sets the semaphore for
/// memtrace, reports, and sees it drop back to 0 once memtrace has gone.
#[test]
fn semaphore_is_set_while_memtrace_listens_and_cleared_after() {
    let dir = build_dir();
    let program = build_c(dir.path(), "usdt_semaphore.c", "-O2");
    let mut fixture = Spawned::spawn(Command::new(&program));
    fixture.wait_for_stdout("waiting semaphore=0");
    let mut memtrace = Memtrace::new()
        .args(["--usdt", "fixture:ready=arg0", "--usdt", "fixture:ready=arg1"])
        .args(["--usdt", "fixture:ready", "--pid"])
        .arg(fixture.pid().to_string())
        .spawn();
    let reported = fixture.wait_for_stdout("reported");
    assert_eq!(reported, "reported hits=3 arg0=3 arg1=6000");
    memtrace.wait_for_trace("three hits", |trace| {
        trace.counters("usdt:fixture:ready").any(|event| event["args"]["hits"] == 3)
    });
    // SAFETY: kill with a pid of a child this test started.
    unsafe { libc::kill(memtrace.pid() as i32, libc::SIGINT) };
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    fixture.wait_for_stdout("released");
    let usdt = &outcome.process()["usdt"];
    assert_eq!(usdt["fixture:ready"]["hits"], 3, "{usdt}");
    assert_eq!(usdt["fixture:ready=arg0"]["value"], 3, "{usdt}");
    assert_eq!(usdt["fixture:ready=arg1"]["value"], 6000, "{usdt}");
}

/// `subsystem NAME BYTES` lines of a fixture's stdout, for the names it reports.
fn reported_subsystems(fixture: &mut Spawned, names: &[String]) -> BTreeMap<String, i64> {
    names
        .iter()
        .map(|name| {
            let line = fixture.wait_for_stdout(&format!("subsystem {name} "));
            let value = line.rsplit(' ').next().unwrap().parse().unwrap();
            (name.clone(), value)
        })
        .collect()
}

fn subsystem_fixture_names() -> Vec<String> {
    let mut names: Vec<String> = ["pool-0", "pool-1", "pool-2", "cache", "debt"].map(String::from).to_vec();
    names.push("x".repeat(63));
    names
}

/// The summary's `subsystems`, the last `subsystem:<name>` counters and the last memory dump hold
/// exactly what the process reported.
fn assert_subsystems(outcome: &Outcome, expected: &BTreeMap<String, i64>) {
    let subsystems: BTreeMap<String, i64> = outcome.process()["subsystems"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, value)| (name.clone(), value.as_i64().unwrap()))
        .collect();
    assert_eq!(&subsystems, expected, "{}", outcome.stderr);
    let trace = outcome.trace();
    for (name, bytes) in expected {
        let last = trace
            .counters(&format!("subsystem:{name}"))
            .last()
            .unwrap_or_else(|| panic!("no subsystem:{name} counter"));
        assert_eq!(last["args"]["bytes"].as_i64(), Some(*bytes), "{last}");
    }
    let dump = trace.phase("v").last().expect("a memory dump");
    let allocators = &dump["args"]["dumps"]["allocators"];
    assert!(allocators.get("malloc").is_some(), "{allocators}");
    for (name, bytes) in expected {
        assert_eq!(
            allocators[format!("subsystems/{name}")]["attrs"]["size"]["value"],
            format!("{:x}", (*bytes).max(0)),
            "{name} in {allocators}"
        );
    }
    assert_eq!(outcome.summary()["lost_events"], 0, "{}", outcome.stderr);
}

/// include/memtrace.h from C, -O0, -O2 and with sdt.h's 1-byte nop sites, names built at run time and read from the target,
/// totals and deltas, traced from the first instruction.
#[test]
fn subsystems_from_the_header_match_what_the_program_reported() {
    let dir = build_dir();
    // The header's 5-byte nop sites (optimized uprobes on 6.18) and sdt.h's 1-byte nops report alike.
    for flag in ["-O0", "-O2", "-DMEMTRACE_ONE_BYTE_SITES"] {
        let program = build_c(dir.path(), "usdt_subsystems.c", flag);
        let mut memtrace = Memtrace::new().command(&program).spawn();
        let expected = reported_subsystems(&mut memtrace, &subsystem_fixture_names());
        assert_eq!(memtrace.wait_for_stdout("due"), "due 1");
        let outcome = memtrace.finish();
        outcome.assert_exit_code(0);
        assert_eq!(expected["cache"], 100 * 4096 - 5000);
        assert_subsystems(&outcome, &expected);
        assert_usdt_sites_not_single_stepped(&outcome, flag);
    }
}

/// sdt.h's 1-byte nop is emulated: no USDT site of the program is single-stepped. memtrace.h's
/// 5-byte nop is called into from 6.18 (optimized uprobes) and single-stepped before, where the
/// summary names each site, by provider:name, with its `nop`.
fn assert_usdt_sites_not_single_stepped(outcome: &Outcome, flag: &str) {
    let listed = outcome.summary()["single_stepped"].as_array().expect("the summary's single_stepped");
    let sites: Vec<_> =
        listed.iter().filter(|entry| entry["function"].as_str().unwrap().contains(':')).collect();
    if flag == "-DMEMTRACE_ONE_BYTE_SITES" {
        assert!(sites.is_empty(), "sdt.h's sites single-stepped: {sites:?}");
    }
    for site in sites {
        assert_eq!(site["instruction"], "nop", "{site}");
    }
}

/// The same process traced with --pid: it waits for MEMTRACE_ENABLED() before it reports.
#[test]
fn subsystems_reach_memtrace_from_a_running_process() {
    let dir = build_dir();
    let program = build_c(dir.path(), "usdt_subsystems.c", "-O2");
    let (mut fixture, memtrace) = attached(&program, "hold", Memtrace::new());
    fixture.send(b"g");
    let expected = reported_subsystems(&mut fixture, &subsystem_fixture_names());
    assert!(fixture.wait().success());
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    assert_subsystems(&outcome, &expected);
}

/// `name=N` fields of a fixture's line, e.g. `calls a=3 b=3`.
fn fields(line: &str) -> BTreeMap<String, i64> {
    line.split_whitespace()
        .filter_map(|field| field.split_once('='))
        .map(|(name, value)| (name.to_owned(), value.parse().unwrap_or_else(|_| panic!("{line}"))))
        .collect()
}

/// The bytes of `dumper-a` and `dumper-b` in each memory dump of the trace that shows them: both or
/// neither (before the first round is complete), never one alone.
fn dumper_rounds(trace: &Trace) -> Vec<(i64, i64)> {
    let size = |allocators: &Value, name: &str| {
        allocators
            .get(format!("subsystems/{name}"))
            .map(|dump| i64::from_str_radix(dump["attrs"]["size"]["value"].as_str().unwrap(), 16).unwrap())
    };
    trace
        .phase("v")
        .filter_map(|dump| {
            let allocators = &dump["args"]["dumps"]["allocators"];
            match (size(allocators, "dumper-a"), size(allocators, "dumper-b")) {
                (Some(a), Some(b)) => Some((a, b)),
                (None, None) => None,
                _ => panic!("a dump shows one dumper of a round without the other: {dump}"),
            }
        })
        .collect()
}

/// A dumper round's figures, from the dumps or the counters: A's n-th call reports n * 4096 and
/// B's n * 8192, so a round shown whole has B == 2 * A.
fn assert_whole_round((a, b): (i64, i64), what: &str) {
    assert!(a > 0 && a % 4096 == 0, "{what}: dumper-a {a}");
    assert_eq!(b, 2 * a, "{what}: dumper-b {b} is not from dumper-a's round ({} and {})", a / 4096, b / 8192);
}

/// The dumper fixtures: usdt_dumpers.c (include/memtrace.h) and usdt_rust_dumpers.rs
/// (include/memtrace_usdt.rs), which behave alike.
fn dumper_fixtures(dir: &Path) -> [PathBuf; 2] {
    [build_c(dir, "usdt_dumpers.c", "-O2"), build_rust(dir, "usdt_rust_dumpers.rs")]
}

/// Registered dumpers, from C, traced from its first instruction: every memory dump, every
/// sample's counters and the summary show both dumpers of one round, never one round's A with
/// another's B; a deregistered dumper is never called again.
#[test]
fn registered_dumpers_show_one_whole_round_in_every_dump() {
    let dir = build_dir();
    let c = build_c(dir.path(), "usdt_dumpers.c", "-O2");
    let mut memtrace = Memtrace::new().command(&c).arg("traced").spawn();
    memtrace.send(b"start\n");
    memtrace.wait_for_stdout("registered");
    let calls = run_dumper_rounds(&mut memtrace, None);
    assert_dumpers_traced(&c, calls, memtrace.finish());
}

/// The same from Rust (include/memtrace_usdt.rs), attached by pid. Launched by memtrace, this
/// build's semaphore stayed 0 (not a dumper matter: its reports would be lost too; linked with
/// `-z norelro`, one RW segment, it rose). Its file page is also the last page of the RELRO
/// segment before, which the ELF loader maps first, so the kernel's delayed increment lands there,
/// we think, and the loader then zeroes that page's tail past the segment's file size; attached
/// once running, the RELRO copy is read-only and the increment finds .probes.
#[test]
fn registered_dumpers_from_rust_attached_by_pid() {
    let dir = build_dir();
    let rust = build_rust(dir.path(), "usdt_rust_dumpers.rs");
    let (mut fixture, mut memtrace) = attached(&rust, "traced", Memtrace::new());
    fixture.send(b"start\n");
    fixture.wait_for_stdout("registered");
    let calls = run_dumper_rounds(&mut memtrace, Some(&mut fixture));
    assert!(fixture.wait().success());
    assert_dumpers_traced(&rust, calls, memtrace.finish());
}

/// Waits for 20 dumps of the dumpers' rounds, then has the fixture (`fixture`, or the command
/// memtrace runs) deregister dumper C; returns its `calls` line.
fn run_dumper_rounds(memtrace: &mut Running, fixture: Option<&mut Spawned>) -> BTreeMap<String, i64> {
    // Enough dumps that a reader mixing rounds would be caught: one that took each subsystem's
    // latest value mixed 4 of 25 dumps here, with the fixture's B taking 500 us (now 1 ms).
    memtrace.wait_for_trace("20 dumps of the dumpers' rounds", |trace| dumper_rounds(trace).len() >= 20);
    let fixture = match fixture {
        Some(fixture) => fixture,
        None => &mut **memtrace,
    };
    fixture.send(b"go\n");
    fields(&fixture.wait_for_stdout("calls "))
}

fn assert_dumpers_traced(program: &Path, calls: BTreeMap<String, i64>, outcome: Outcome) {
    outcome.assert_exit_code(0);
    let what = program.display();
    assert_eq!(calls["c"], calls["c_at_deregister"], "{what}: dumper-c was called after its deregistration");
    assert!(calls["a"] - calls["b"] <= 1 && calls["a"] >= calls["b"], "{what}: {calls:?}");

    let trace = outcome.trace();
    let rounds = dumper_rounds(trace);
    assert!(rounds.len() >= 20, "{what}: {rounds:?}");
    for (index, &round) in rounds.iter().enumerate() {
        assert_whole_round(round, &format!("{what}: dump {index}"));
    }
    // Rounds went on from dump to dump.
    assert!(rounds.windows(2).all(|pair| pair[0].0 <= pair[1].0), "{what}: {rounds:?}");
    assert!(rounds.last().unwrap().0 > rounds[0].0, "{what}: {rounds:?}");

    // The counters of each sample agree with its dump.
    let by_ts = |name: &str| -> BTreeMap<u64, i64> {
        trace
            .counters(name)
            .map(|event| (event["ts"].as_u64().unwrap(), event["args"]["bytes"].as_i64().unwrap()))
            .collect()
    };
    let (a, b) = (by_ts("subsystem:dumper-a"), by_ts("subsystem:dumper-b"));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "{what}: one dumper alone");
    for (ts, a) in &a {
        assert_whole_round((*a, b[ts]), &format!("{what}: counters at {ts} us"));
    }
    let subsystems = subsystems_of(outcome.process());
    assert_whole_round((subsystems["dumper-a"], subsystems["dumper-b"]), &format!("{what}: summary"));
    assert_eq!(subsystems["dumper-c"], calls["c"] * 100, "{what}: {subsystems:?}");
    assert_eq!(outcome.summary()["lost_events"], 0, "{}", outcome.stderr);
}

/// Untraced, the dumper thread wakes at every interval but calls no dumper: nobody listens.
#[test]
fn dumpers_are_not_called_while_nobody_listens() {
    // The build directory holds this test's turn: no system-wide run raises the semaphore meanwhile.
    let dir = build_dir();
    for program in dumper_fixtures(dir.path()) {
        let output =
            Command::new(&program).arg("untraced").stdin(std::process::Stdio::null()).output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let what = program.display();
        assert!(output.status.success(), "{what}: {}: {stdout}", output.status);
        let calls = fields(stdout.lines().next().unwrap_or_default());
        assert!(calls["ticks"] >= 10, "{what}: {stdout}");
        assert_eq!((calls["a"], calls["b"], calls["c"]), (0, 0, 0), "{what}: {stdout}");
        assert!(stdout.ends_with("deregistered\n"), "{what}: {stdout}");
    }
}

/// Builds libusdtfixture.so and a program that needs it (RUNPATH $ORIGIN).
fn build_library_pair(dir: &Path) -> (PathBuf, PathBuf) {
    let library = dir.join("libusdtfixture.so");
    cc(&["-O2", "-fPIC", "-shared", fixture_source("usdt_lib.c").to_str().unwrap()], &library);
    let program = dir.join("usdt_lib_main");
    cc(
        &[
            "-O2",
            fixture_source("usdt_lib_main.c").to_str().unwrap(),
            "-L",
            dir.to_str().unwrap(),
            "-lusdtfixture",
            "-Wl,-rpath,$ORIGIN",
        ],
        &program,
    );
    (library, program)
}

fn assert_library_figures(outcome: &Outcome, label: &str) {
    outcome.assert_exit_code(0);
    let process = outcome.process();
    assert_eq!(process["subsystems"]["from-library"], 777777, "{process}");
    assert_eq!(process["usdt"][label]["hits"], 7, "{process}");
    assert_eq!(process["usdt"][label]["value"], 77, "{process}");
}

/// Probes in a shared library: found through DT_NEEDED before the command runs, and through the
/// process's mappings with --pid; PATH given as a file name or as a path.
#[test]
fn probes_in_a_shared_library() {
    let dir = build_dir();
    let (library, program) = build_library_pair(dir.path());

    let by_name = "libusdtfixture.so:libfixture:called=arg0";
    let mut memtrace = Memtrace::new().args(["--usdt", by_name]).command(&program).spawn();
    // The command shares memtrace's stdin; it reports after a line.
    memtrace.send(b"go\n");
    memtrace.wait_for_stdout("libfixture:called hits 7 last 77");
    assert_library_figures(&memtrace.finish(), by_name);

    let by_path = format!("{}:libfixture:called=arg0", library.display());
    let mut fixture = Spawned::spawn(Command::new(&program));
    let mut memtrace =
        Memtrace::new().args(["--usdt", &by_path, "--pid"]).arg(fixture.pid().to_string()).spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    fixture.send(b"go\n");
    assert!(fixture.wait().success());
    assert_library_figures(&memtrace.finish(), &by_path);
}

/// The documented example program, built as its comment says, reports what it prints.
#[test]
fn header_example_reports_what_it_prints() {
    let dir = build_dir();
    let example = workspace_root().join("examples/memtrace_subsystems.c");
    let program = cc(&["-O2", example.to_str().unwrap()], &dir.path().join("memtrace_subsystems"));
    let mut memtrace = Memtrace::new().command(&program).spawn();
    let mut expected = BTreeMap::new();
    for name in ["textures", "cache", "requests"] {
        let line = memtrace.wait_for_stdout(&format!("reported {name} "));
        expected.insert(name.to_owned(), line.rsplit(' ').next().unwrap().parse::<i64>().unwrap());
    }
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    assert_subsystems(&outcome, &expected);
    // Untraced, the example knows nobody listened.
    let untraced = Command::new(&program).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&untraced.stdout), "memtrace was not listening\n");
}

/// include/memtrace_usdt.rs: the same probes from Rust, with the semaphore.
#[test]
fn rust_emitter_reports_subsystems() {
    let dir = build_dir();
    let program = build_rust(dir.path(), "usdt_rust.rs");
    let listing = Command::new(memtrace_tests::memtrace_bin()).arg("usdt").arg(&program).output().unwrap();
    let listing = String::from_utf8_lossy(&listing.stdout).into_owned();
    assert!(listing.contains("memtrace:report_total") && !listing.contains("semaphore=none"), "{listing}");
    let mut memtrace = Memtrace::new().command(&program).spawn();
    assert_eq!(memtrace.wait_for_stdout("due"), "due true false");
    let expected =
        reported_subsystems(&mut memtrace, &["rust-textures".to_owned(), "rust-pool-7".to_owned()]);
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    assert_subsystems(&outcome, &expected);
}

fn memtrace_usdt(args: &[&str]) -> (i32, String, String) {
    let output = Command::new(memtrace_tests::memtrace_bin()).arg("usdt").args(args).output().unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// `memtrace usdt PATH` and `memtrace usdt --pid PID` list every site with its argument specs.
#[test]
fn usdt_subcommand_lists_probes_with_their_arguments() {
    let dir = build_dir();
    let program = build_c(dir.path(), "usdt_args.c", "-O0");
    let (code, listing, stderr) = memtrace_usdt(&[program.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    let line = listing
        .lines()
        .find(|line| line.contains(" fixture:indexed "))
        .unwrap_or_else(|| panic!("{listing}"));
    assert!(
        line.ends_with(
            "semaphore=none args: arg0=-8@16(%rax,%rbx,8) arg1=-8@(,%rcx,1) arg2=8@-8(%rax,%rbx,8)"
        ),
        "{line}"
    );
    assert!(listing.contains(" fixture:mixed offset=0x"), "{listing}");

    let (_, program) = build_library_pair(dir.path());
    let mut fixture = Spawned::spawn(Command::new(&program));
    // Wait until the library is mapped: the program blocks on stdin only after the loader ran.
    let deadline = std::time::Instant::now() + memtrace_tests::DEADLINE;
    let maps = format!("/proc/{}/maps", fixture.pid());
    while !std::fs::read_to_string(&maps).unwrap_or_default().contains("libusdtfixture.so") {
        assert!(std::time::Instant::now() < deadline, "library never mapped");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let (code, listing, stderr) = memtrace_usdt(&["--pid", &fixture.pid().to_string()]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        listing.lines().any(|l| l.contains("libusdtfixture.so memtrace:report_total")
            && l.ends_with("args: arg0=8@%rdi arg1=-8@%rsi")
            && !l.contains("semaphore=none")),
        "{listing}"
    );
    assert!(listing.contains("libusdtfixture.so libfixture:called"), "{listing}");
    fixture.kill();
}

/// Bad input gets a `memtrace: error:` naming the problem and the fix, never a panic.
#[test]
fn bad_usdt_requests_are_clear_errors() {
    let dir = build_dir();
    let program = build_c(dir.path(), "usdt_args.c", "-O2");
    let plain = dir.path().join("plain");
    std::fs::write(dir.path().join("plain.c"), "int main(void) { return 0; }\n").unwrap();
    cc(&[dir.path().join("plain.c").to_str().unwrap()], &plain);
    let written = dir.path().join("out.txt");

    // A malformed option is a usage error.
    let outcome = Memtrace::new().args(["--usdt", "no-colon"]).command(&program).run();
    outcome.assert_exit_code(2);
    outcome.assert_stderr_mentions(&["no-colon", "PROVIDER:NAME"]);
    let outcome = Memtrace::new().args(["--usdt", "fixture:tick=first"]).command(&program).run();
    outcome.assert_exit_code(2);
    outcome.assert_stderr_mentions(&["arg0"]);

    let cases: Vec<(Vec<String>, Vec<&str>)> = vec![
        // Kept to the command, a probe it does not have can never fire.
        (
            vec!["--no-children".into(), "--usdt".into(), "fixture:nonexistent".into()],
            vec!["fixture:nonexistent", "memtrace usdt"],
        ),
        (vec!["--usdt".into(), "fixture:tick=arg5".into()], vec!["no arg5", "1 argument"]),
        (
            vec!["--usdt".into(), format!("{}:app:probe", plain.display())],
            vec!["has no USDT probes", ".note.stapsdt"],
        ),
        (
            vec!["--usdt".into(), "/nonexistent/lib.so:app:probe".into()],
            vec!["/nonexistent/lib.so does not exist"],
        ),
    ];
    for (args, needles) in cases {
        let outcome = Memtrace::new().args(&args).command(&program).arg(&written).run();
        outcome.assert_exit_code(1);
        let error = outcome.error_line().to_owned();
        for needle in needles {
            assert!(error.contains(needle), "{args:?}: {error}");
        }
        assert!(!outcome.stderr.contains("panicked"), "{}", outcome.stderr);
    }

    // Following the command's children, a program it starts may have it: said, not refused.
    let outcome =
        Memtrace::new().args(["--usdt", "fixture:nonexistent"]).command(&program).arg(&written).run();
    outcome.assert_exit_code(0);
    outcome.assert_stderr_mentions(&["fixture:nonexistent", "attached when a program it starts has it"]);

    let (code, _, stderr) = memtrace_usdt(&["/nonexistent/file"]);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.starts_with("memtrace: error: cannot read /nonexistent/file"), "{stderr}");
    let (code, listing, stderr) = memtrace_usdt(&[plain.to_str().unwrap()]);
    assert_eq!((code, listing.as_str()), (0, ""), "{stderr}");
    assert!(stderr.contains("has no USDT probes"), "{stderr}");
}

/// A system-wide run, alone (see SYSTEM_WIDE): memtrace --all with `args`, once it is tracing.
fn trace_all(args: &[String]) -> (RwLockWriteGuard<'static, ()>, Running) {
    let turn = SYSTEM_WIDE.write().unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut memtrace = Memtrace::new().arg("--all").args(args).spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    (turn, memtrace)
}

/// Runs `program` to its end and returns its pid and stdout.
fn run_to_exit(program: &Path) -> (u32, String) {
    let child = Command::new(program)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("starting a fixture");
    let pid = child.id();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "{} failed", program.display());
    (pid, String::from_utf8(output.stdout).unwrap())
}

/// Runs a fixture in "hold" mode, lets it report once memtrace says it attached to its file (the
/// semaphore rises a moment before), and returns its pid and what it printed.
fn run_once_attached(memtrace: &mut Running, program: &Path) -> (u32, String) {
    let mut fixture = Spawned::spawn({
        let mut command = Command::new(program);
        command.arg("hold");
        command
    });
    let attached = memtrace.wait_for_stderr_containing(&format!("USDT probe sites in {}", program.display()));
    assert!(attached.contains("a program just started"), "{attached}");
    fixture.send(b"g");
    assert!(fixture.wait().success(), "{} failed", program.display());
    (fixture.pid(), fixture.stdout_text())
}

fn summary_of(outcome: &Outcome, pid: u32) -> Option<&Value> {
    outcome.summary()["processes"].as_array().unwrap().iter().find(|p| p["pid"] == pid)
}

fn subsystems_of(process: &Value) -> BTreeMap<String, i64> {
    process["subsystems"]
        .as_object()
        .unwrap_or_else(|| panic!("no subsystems in {process:#}"))
        .iter()
        .map(|(name, value)| (name.clone(), value.as_i64().unwrap()))
        .collect()
}

/// `subsystem NAME BYTES` lines of a fixture's output.
fn printed_subsystems(stdout: &str) -> BTreeMap<String, i64> {
    stdout
        .lines()
        .filter_map(|line| line.strip_prefix("subsystem "))
        .map(|rest| {
            let (name, bytes) = rest.rsplit_once(' ').unwrap();
            (name.to_owned(), bytes.parse().unwrap())
        })
        .collect()
}

/// --all: programs started after memtrace are attached as they exec, their semaphore is raised
/// and their reports land exactly under their own pid, also for a process that never allocates;
/// --comm leaves out a reporting process of another name; every entry is released at its exit.
#[test]
fn system_wide_subsystems_of_programs_started_later() {
    let dir = temp_dir();
    // Two programs under one command name, for --comm; the first again under another name (a
    // symlink: the same file, so its semaphore is raised too), which --comm leaves out. (The
    // files of programs --comm leaves out are not scanned: another file would never be attached.)
    for sub in ["a", "b", "c"] {
        std::fs::create_dir(dir.path().join(sub)).unwrap();
    }
    let subsystems =
        cc(&["-O2", fixture_source("usdt_subsystems.c").to_str().unwrap()], &dir.path().join("a/usdt_all"));
    let report_only =
        cc(&["-O2", fixture_source("usdt_report_only.c").to_str().unwrap()], &dir.path().join("b/usdt_all"));
    let other = dir.path().join("c/usdt_other");
    std::os::unix::fs::symlink(&subsystems, &other).unwrap();

    let (_turn, mut memtrace) = trace_all(&["--comm".into(), "usdt_all".into()]);
    let (subsystems_pid, subsystems_out) = run_once_attached(&mut memtrace, &subsystems);
    let (report_only_pid, report_only_out) = run_once_attached(&mut memtrace, &report_only);
    let (other_pid, other_out) = run_to_exit(&other);
    memtrace.interrupt();
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);

    let expected = printed_subsystems(&subsystems_out);
    assert_eq!(expected.len(), 6, "{subsystems_out}");
    assert_eq!(expected["cache"], 100 * 4096 - 5000);
    assert!(subsystems_out.contains("due 1"), "{subsystems_out}");
    let process = summary_of(&outcome, subsystems_pid)
        .unwrap_or_else(|| panic!("pid {subsystems_pid} is not in the summary\n{}", outcome.stderr));
    assert_eq!(subsystems_of(process), expected, "{}", outcome.stderr);
    assert_eq!(process["comm"], "usdt_all");

    // Never allocates: known through its reports alone.
    let expected = printed_subsystems(&report_only_out);
    assert_eq!(expected, BTreeMap::from([("only-usdt".to_owned(), 5096)]));
    let process = summary_of(&outcome, report_only_pid)
        .unwrap_or_else(|| panic!("pid {report_only_pid} is not in the summary\n{}", outcome.stderr));
    assert_eq!(subsystems_of(process), expected, "{process:#}");
    assert_eq!(process["comm"], "usdt_all", "{process:#}");
    assert_eq!(process["allocations"], 0, "{process:#}");
    assert_eq!(process["exited"], true, "{process:#}");
    let last = outcome
        .trace()
        .counters("subsystem:only-usdt")
        .filter(|event| event["pid"] == report_only_pid)
        .last()
        .unwrap_or_else(|| panic!("no subsystem:only-usdt counter"))
        .clone();
    assert_eq!(last["args"]["bytes"], 5096, "{last}");

    // The semaphore is the file's: the same program under another name reported too, but --comm
    // leaves it out.
    assert_eq!(printed_subsystems(&other_out).len(), 6, "{other_out}");
    assert!(summary_of(&outcome, other_pid).is_none(), "--comm usdt_all traced pid {other_pid}");

    let maps = &outcome.summary()["kernel_maps"];
    assert_eq!(maps["released_processes"], 2, "{maps:#}");
    assert_eq!(maps["processes"], 0, "{maps:#}");
    assert_eq!(maps["usdt_entries"], 0, "{maps:#}");
    assert_eq!(outcome.summary()["lost_events"], 0, "{}", outcome.stderr);
}

/// --all with --usdt: a request naming a file by path is attached before the program starts (its
/// semaphore is set from its first instruction); one without a path is attached to a program as it
/// execs, which then sees its semaphore set; one that matches nothing yet is said, not an error.
#[test]
fn system_wide_usdt_requests_and_semaphores() {
    let dir = temp_dir();
    for sub in ["named", "scanned"] {
        std::fs::create_dir(dir.path().join(sub)).unwrap();
    }
    let source = fixture_source("usdt_semaphore.c");
    let named = cc(&["-O2", source.to_str().unwrap()], &dir.path().join("named/usdt_semaphore"));
    let scanned = cc(&["-O2", source.to_str().unwrap()], &dir.path().join("scanned/usdt_semaphore"));
    let by_path = format!("{}:fixture:ready=arg0", named.display());
    let anywhere = "fixture:ready=arg1";

    // A request by path: attached at start, so the program sees its semaphore set at once; the
    // same program elsewhere (another file) is not traced.
    let args: Vec<String> = ["--usdt", &by_path, "--usdt", "fixture:not_there"].map(String::from).to_vec();
    let (named_pid, other_pid, outcome) = run_semaphore_fixtures(&args, &named, &scanned);
    outcome.assert_stderr_mentions(&["fixture:not_there", "no USDT probe"]);
    let usdt = usdt_of(&outcome, named_pid);
    assert_eq!(usdt[&by_path], serde_json::json!({"hits": 3, "value": 3}), "{usdt:#}");
    assert!(summary_of(&outcome, other_pid).is_none_or(|p| p["usdt"].get(&by_path).is_none()));
    assert_eq!(outcome.summary()["lost_events"], 0, "{}", outcome.stderr);

    // A request without a path: attached to a program that has the probe as it execs, which memtrace
    // says on stderr; the program then sees its semaphore set.
    let args: Vec<String> = ["--usdt", anywhere].map(String::from).to_vec();
    let (_turn, mut memtrace) = trace_all(&args);
    let mut fixture = Spawned::spawn({
        let mut command = Command::new(&scanned);
        command.arg("hold");
        command
    });
    memtrace.wait_for_stderr(&format!("memtrace: --usdt {anywhere}: found in a program just started"));
    fixture.send(b"g");
    assert_eq!(fixture.wait_for_stdout("reported"), "reported hits=3 arg0=3 arg1=6000");
    memtrace.interrupt();
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    fixture.wait_for_stdout("released");
    assert!(fixture.wait().success());
    let usdt = usdt_of(&outcome, fixture.pid());
    assert_eq!(usdt[anywhere], serde_json::json!({"hits": 3, "value": 6000}), "{usdt:#}");
    assert_eq!(outcome.summary()["lost_events"], 0, "{}", outcome.stderr);
}

/// Runs memtrace --all with `args` while `first` and `second` (usdt_semaphore.c builds) run: the
/// first must see its semaphore set from its start and report; the second is left waiting and
/// killed. Returns their pids and memtrace's outcome.
fn run_semaphore_fixtures(args: &[String], first: &Path, second: &Path) -> (u32, u32, Outcome) {
    let (_turn, mut memtrace) = trace_all(args);
    let mut first_fixture = Spawned::spawn(Command::new(first));
    assert_eq!(first_fixture.wait_for_stdout("waiting"), "waiting semaphore=1");
    assert_eq!(first_fixture.wait_for_stdout("reported"), "reported hits=3 arg0=3 arg1=6000");
    let mut second_fixture = Spawned::spawn(Command::new(second));
    assert_eq!(second_fixture.wait_for_stdout("waiting"), "waiting semaphore=0");
    memtrace.interrupt();
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    first_fixture.wait_for_stdout("released");
    assert!(first_fixture.wait().success());
    second_fixture.kill();
    (first_fixture.pid(), second_fixture.pid(), outcome)
}

fn usdt_of(outcome: &Outcome, pid: u32) -> Value {
    summary_of(outcome, pid).unwrap_or_else(|| panic!("pid {pid} is not in the summary\n{}", outcome.stderr))
        ["usdt"]
        .clone()
}

/// `program arg` started, and `memtrace` attached to it with --pid, once it says it traces.
fn attached(program: &Path, arg: impl AsRef<std::ffi::OsStr>, memtrace: Memtrace) -> (Spawned, Running) {
    let fixture = Spawned::spawn({
        let mut command = Command::new(program);
        command.arg(arg);
        command
    });
    let mut memtrace = memtrace.arg("--pid").arg(fixture.pid().to_string()).spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    (fixture, memtrace)
}
