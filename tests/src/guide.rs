//! The guide's examples of command output (issue 37, item 6): a test that ran a command and
//! checked what it printed writes that text to docs/src/examples/<name>.txt, and the guide's page
//! shows it with mdBook's `{{#include examples/<name>.txt}}` inside a ```text block, so what a
//! reader sees is what a real run printed and a test checked, never text typed by hand.
//!
//! Call [`guide_example`] after the test's assertions have passed, so that only checked output
//! reaches the guide. The files are committed: the guide builds from a fresh clone without
//! running the tests; a test run that prints something else changes them, and `git diff` shows it.
//!
//! One normalisation only, so that a reader is not misled by this machine's passing details:
//! the paths of a test's temporary directories, different on every run (`/tmp/.tmpXXXXXX`, the
//! tempfile crate's names, and a run's own directory, `<workspace>/target/memtrace-tests/run-XXXXXX`),
//! become `/tmp/memtrace-example`. Nothing else is changed: pids, times and figures are the run's.

use std::{fs, path::PathBuf};

/// The directory of the guide's examples: docs/src/examples/ of the workspace.
pub fn examples_dir() -> PathBuf {
    crate::workspace_root().join("docs").join("src").join("examples")
}

/// Writes `text`, a command's real output that the calling test has checked, to
/// docs/src/examples/`name`.txt with its temporary paths made stable (see the module's doc).
pub fn guide_example(name: &str, text: &str) {
    assert!(
        !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
        "an example's name is a plain file name: {name:?}"
    );
    let dir = examples_dir();
    fs::create_dir_all(&dir).unwrap_or_else(|error| panic!("creating {}: {error}", dir.display()));
    let runs = crate::workspace_root().join("target").join("memtrace-tests").join("run-");
    let mut text = stable_temp_paths(text, "/tmp/.tmp");
    text = stable_temp_paths(&text, runs.to_str().expect("a UTF-8 workspace path"));
    if !text.ends_with('\n') {
        text.push('\n');
    }
    let path = dir.join(format!("{name}.txt"));
    fs::write(&path, text).unwrap_or_else(|error| panic!("writing {}: {error}", path.display()));
}

/// `text` with every `PREFIX` + letters and digits (a temporary directory: `/tmp/.tmpXXXXXX`)
/// replaced by `/tmp/memtrace-example`; `PREFIX` alone is left as it is.
pub fn stable_temp_paths(text: &str, prefix: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(prefix) {
        out.push_str(&rest[..at]);
        let after = &rest[at + prefix.len()..];
        let name_len = after.find(|c: char| !c.is_ascii_alphanumeric()).unwrap_or(after.len());
        if name_len == 0 {
            out.push_str(prefix);
        } else {
            out.push_str("/tmp/memtrace-example");
        }
        rest = &after[name_len..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::stable_temp_paths;

    #[test]
    fn temporary_directories_become_one_stable_path() {
        let text = "trace /tmp/.tmpAb12Cd/trace.json and /tmp/.tmpZZ9/x; /tmp/.tmp alone; /tmp/kept";
        assert_eq!(
            stable_temp_paths(text, "/tmp/.tmp"),
            "trace /tmp/memtrace-example/trace.json and /tmp/memtrace-example/x; /tmp/.tmp alone; /tmp/kept"
        );
        let run = "writing /w/target/memtrace-tests/run-ufABaB/trace.json";
        assert_eq!(
            stable_temp_paths(run, "/w/target/memtrace-tests/run-"),
            "writing /tmp/memtrace-example/trace.json"
        );
    }
}
