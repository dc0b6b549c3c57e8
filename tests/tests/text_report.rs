//! The text report a run prints on stderr at its end, for fixtures/leaks.c, whose figures are
//! known from its source: leak_textures leaks 5 x 1000 bytes, leak_cache 3 x 256, and scratch
//! frees all it takes. The guide's usage.md shows this report as the test checked it.

use memtrace_tests::{fixture, guide::guide_example, Memtrace};

#[test]
fn a_runs_text_report_names_each_leak_with_its_bytes_blocks_and_stack() {
    let outcome = Memtrace::new().command(&fixture("leaks")).run();
    outcome.assert_exit_code(0);
    let leak = |function: &str| {
        let line = outcome.stderr.lines().map(str::trim_start).find(|line| {
            line.starts_with("leak: ") && line.split(" from ").nth(1).is_some_and(|s| s.starts_with(function))
        });
        line.unwrap_or_else(|| panic!("no leak from {function} in the report:\n{}", outcome.stderr))
    };
    assert!(leak("leak_textures").starts_with("leak: 5000 B in 5 blocks,"), "{}", outcome.stderr);
    assert!(leak("leak_cache").starts_with("leak: 768 B in 3 blocks,"), "{}", outcome.stderr);
    assert!(leak("leak_textures").contains("<- main <-"), "{}", outcome.stderr);
    // 5 + 3 + 20 blocks of 5000 + 768 + 6660 bytes; scratch's 20 freed.
    let totals = "28 allocations (12.1 KiB), 20 frees (6660 B), 0 untracked frees";
    assert!(outcome.stderr.contains(totals), "no {totals:?} in the report:\n{}", outcome.stderr);
    assert!(
        !outcome
            .stderr
            .lines()
            .any(|line| line.trim_start().starts_with("leak: ") && line.contains("from scratch")),
        "scratch freed all it took:\n{}",
        outcome.stderr
    );
    guide_example("report", &outcome.stderr);
}
