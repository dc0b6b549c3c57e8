//! `memtrace diff BASE.json NEW.json`: fixtures/grown_leak.c run leaking 10 sessions and then 13,
//! whose figures are known from its source: remember_session's stack grows by 3 blocks of 256
//! bytes, allocated and leaked, and steady_work's (50 x 100 bytes, all freed) does not change.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use memtrace_tests::{chromium::Chromium, memtrace_bin, pprof::go_pprof, saved_run};
use serde_json::Value;

/// A traced run of `grown_leak SESSIONS`, its summary written to `dir`.
fn summary_of(sessions: u32, dir: &Path) -> PathBuf {
    saved_run("grown_leak", &[&sessions.to_string()], &dir.join(format!("run-{sessions}.json")))
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

/// `go tool pprof -top`'s row of `function` (flat, flat%, sum%, cum, cum%, name).
fn top_row(report: &str, function: &str) -> Vec<String> {
    let name = format!("{function} (grown_leak)");
    report
        .lines()
        .find(|line| line.trim_end().ends_with(&name))
        .unwrap_or_else(|| panic!("no row of {name}:\n{report}"))
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_pprof_and_html_forms_show_the_same_growth_to_go_tool_pprof_and_to_a_browser() {
    let dir = tempfile::tempdir().unwrap();
    let (base, new) = (summary_of(10, dir.path()), summary_of(13, dir.path()));
    let (pprof, html) = (dir.path().join("diff.pb.gz"), dir.path().join("diff.html"));
    let output = Command::new(memtrace_bin())
        .arg("diff")
        .args([&base, &new])
        .arg("--pprof")
        .arg(&pprof)
        .arg("--html")
        .arg(&html)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));

    // pprof: the base's samples negated (labelled pprof::base), so a function's flat figure is
    // its change: remember_session +768 bytes leaked and allocated, steady_work nothing.
    let top = |index: &str| go_pprof(["-top", "-sample_index", index, pprof.to_str().unwrap()], dir.path());
    let leaked = top("leaked_space");
    assert_eq!(top_row(&leaked, "remember_session")[0], "768B", "{leaked}");
    let allocated = top("alloc_space");
    assert_eq!(top_row(&allocated, "remember_session")[0], "768B", "{allocated}");
    assert!(!allocated.contains("steady_work"), "an unchanged stack has no flat change: {allocated}");
    let objects = top("alloc_objects");
    assert_eq!(top_row(&objects, "remember_session")[0], "3", "{objects}");
    // The same change from pprof's own -diff_base over each run's profile (`memtrace report
    // --pprof`), whose frames are named by function alone.
    let profile = |summary: &Path, name: &str| {
        let path = dir.path().join(name);
        let report =
            Command::new(memtrace_bin()).arg("report").arg(summary).arg("--pprof").arg(&path).output();
        assert!(report.unwrap().status.success());
        path
    };
    let (base_profile, new_profile) = (profile(&base, "base.pb.gz"), profile(&new, "new.pb.gz"));
    let args = ["-top", "-sample_index", "alloc_space", "-diff_base", base_profile.to_str().unwrap()];
    let own = go_pprof(args.iter().copied().chain([new_profile.to_str().unwrap()]), dir.path());
    let row = own.lines().find(|line| line.trim_end().ends_with(" remember_session")).unwrap_or_default();
    assert_eq!(row.split_whitespace().next(), Some("768B"), "{own}");

    // HTML: two differential flamegraphs; remember_session's frame grew (red), steady_work's
    // did not (near white).
    let mut browser = Chromium::start();
    browser.open(&html);
    let fills = browser.evaluate(
        "(() => { const svg = document.querySelectorAll('iframe')[1].contentDocument; \
         const fill = name => [...svg.querySelectorAll('g')].find(g => g.querySelector('title')?.textContent \
         .startsWith(name))?.querySelector('rect')?.getAttribute('fill'); \
         return [document.querySelectorAll('iframe').length, fill('remember_session'), fill('steady_work')]; })()",
    );
    assert_eq!(
        fills,
        serde_json::json!([2, "rgb(255,100,100)", "rgb(250,250,250)"]),
        "{:?}",
        browser.errors()
    );
    assert!(browser.errors().is_empty(), "{:?}", browser.errors());
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
