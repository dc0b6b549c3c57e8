//! `memtrace diff BASE.json NEW.json`: fixtures/grown_leak.c run leaking 10 sessions and then 13,
//! whose figures are known from its source: remember_session's stack grows by 3 blocks of 256
//! bytes, allocated and leaked, and steady_work's (50 x 100 bytes, all freed) does not change.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use memtrace_tests::{fixture, memtrace_bin, Memtrace};
use serde_json::Value;

/// A traced run of `grown_leak SESSIONS`, its summary written to `dir`.
fn summary_of(sessions: u32, dir: &Path) -> PathBuf {
    let outcome = Memtrace::new().command(&fixture("grown_leak")).arg(sessions.to_string()).run();
    outcome.assert_exit_code(0);
    let path = dir.join(format!("run-{sessions}.json"));
    fs::write(&path, outcome.summary().to_string()).expect("writing the summary");
    path
}

/// The first row of `rows` whose innermost frame is `function`'s.
fn row<'a>(rows: &'a Value, function: &str) -> &'a Value {
    let name = format!("{function} (grown_leak)");
    rows.as_array()
        .unwrap()
        .iter()
        .find(|row| row["frames"][0] == name.as_str() || (row["function"] == name.as_str()))
        .unwrap_or_else(|| panic!("no row of {name}: {rows:#}"))
}

#[test]
fn the_stack_whose_leak_grew_comes_first_with_its_exact_growth() {
    let dir = tempfile::tempdir().unwrap();
    let (base, new) = (summary_of(10, dir.path()), summary_of(13, dir.path()));
    let json = dir.path().join("diff.json");
    let output = Command::new(memtrace_bin())
        .arg("diff")
        .args([&base, &new])
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}{stdout}", String::from_utf8_lossy(&output.stderr));
    let diff: Value = serde_json::from_str(&fs::read_to_string(&json).unwrap()).unwrap();

    let grown = &diff["stacks"][0];
    assert_eq!(grown["frames"][0], "remember_session (grown_leak)", "what grew most comes first: {diff:#}");
    assert_eq!(grown["command"], "grown_leak");
    assert_eq!(
        (grown["base"]["leaked_bytes"].as_i64(), grown["new"]["leaked_bytes"].as_i64()),
        (Some(2560), Some(3328))
    );
    let delta = &grown["delta"];
    assert_eq!(
        (delta["leaked_bytes"].as_i64(), delta["allocated_bytes"].as_i64(), delta["allocations"].as_i64()),
        (Some(768), Some(768), Some(3))
    );

    let steady = row(&diff["stacks"], "steady_work");
    assert_eq!(
        (steady["new"]["allocated_bytes"].as_i64(), steady["new"]["allocations"].as_i64()),
        (Some(5000), Some(50))
    );
    assert!(steady["delta"].as_object().unwrap().values().all(|figure| figure == 0), "{steady:#}");

    // By function: remember_session called malloc itself (exclusive), and main is on both stacks.
    let functions = diff["functions"].as_array().unwrap();
    let of = |name: &str, inclusive: bool| {
        functions
            .iter()
            .find(|row| {
                row["function"] == format!("{name} (grown_leak)").as_str() && row["inclusive"] == inclusive
            })
            .unwrap_or_else(|| panic!("no {name} (inclusive {inclusive}): {functions:#?}"))
    };
    assert_eq!(of("remember_session", false)["delta"]["leaked_bytes"], 768);
    assert_eq!(of("main", true)["new"]["allocated_bytes"], 3328 + 5000);

    // The text: the grown stack's row first, with its change.
    let first = stdout.lines().find(|line| line.contains("[grown_leak]")).unwrap_or_default();
    assert!(first.contains("remember_session (grown_leak)") && first.contains("(+768)"), "{stdout}");
}

#[test]
fn a_file_that_is_not_a_summary_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.json");
    let output = Command::new(memtrace_bin()).arg("diff").args([&missing, &missing]).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&*missing.to_string_lossy()) && stderr.contains("--summary"), "{stderr}");
}
