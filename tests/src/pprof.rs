//! `go tool pprof` (Debian's golang-go), the reader the profiles memtrace writes and serves are
//! checked with.

use std::{ffi::OsStr, path::Path, process::Command};

/// `go tool pprof ARGS`, which must succeed: its report. Its caches and its copies of fetched
/// profiles (`$PPROF_TMPDIR`) go under `home`.
pub fn go_pprof<I, S>(args: I, home: &Path) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let output = Command::new("go")
        .args(["tool", "pprof"])
        .args(args)
        .env("PPROF_TMPDIR", home)
        .env("HOME", home)
        .env("GOCACHE", home.join("go-cache"))
        .output()
        .expect("running go tool pprof (Debian's golang-go)");
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "go tool pprof failed:\n{text}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    text
}
