//! Bloomberg's memray (PyPI), the tracer Python users compare memtrace with, installed into a venv
//! under target/ when missing: a script run under it and its allocation sites as `memray stats`
//! reports them.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    sync::Mutex,
};

use serde_json::Value;

use crate::workspace_root;

/// The memray release the tests compare with.
const MEMRAY_VERSION: &str = "1.20.0";

/// The venv's memray command, installed once per test binary.
fn memray() -> PathBuf {
    static READY: Mutex<bool> = Mutex::new(false);
    let venv = workspace_root().join("target").join("memray-venv");
    let memray = venv.join("bin").join("memray");
    let mut ready = READY.lock().unwrap_or_else(|e| e.into_inner());
    if !*ready {
        let python = venv.join("bin").join("python3");
        let check =
            format!("import importlib.metadata as m; assert m.version('memray') == '{MEMRAY_VERSION}'");
        let installed =
            python.exists() && Command::new(&python).args(["-c", &check]).status().is_ok_and(|s| s.success());
        if !installed {
            // The venv's python is Debian's python3: the interpreter memtrace traces.
            run(Command::new("/usr/bin/python3").arg("-m").arg("venv").arg(&venv));
            run(Command::new(venv.join("bin").join("pip"))
                .args(["install", "--quiet"])
                .arg(format!("memray=={MEMRAY_VERSION}")));
        }
        *ready = true;
    }
    memray
}

fn run(command: &mut Command) {
    let status = command.status().unwrap_or_else(|err| panic!("running {command:?}: {err}"));
    assert!(status.success(), "{command:?} failed: {status}");
}

/// Bytes allocated by each allocation site (`function:file:line`, the innermost Python frame) of
/// `script` run under memray, as `memray stats --json` reports its top sites by size.
pub fn allocated_by_site(script: &Path, dir: &Path) -> BTreeMap<String, u64> {
    let capture = dir.join("memray.bin");
    let stats = dir.join("memray-stats.json");
    run(Command::new(memray()).args(["run", "--quiet", "--force", "-o"]).arg(&capture).arg(script));
    run(Command::new(memray()).args(["stats", "--json", "--force", "-o"]).arg(&stats).arg(&capture));
    let stats: Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).expect("memray's JSON");
    let sites = stats["top_allocations_by_size"].as_array().expect("memray's top_allocations_by_size");
    sites
        .iter()
        .map(|site| (site["location"].as_str().unwrap().to_owned(), site["size"].as_u64().unwrap()))
        .collect()
}
