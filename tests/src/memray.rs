//! Bloomberg's memray (PyPI), the tracer Python users compare memtrace with (venv.rs installs it):
//! a script run under it and its allocation sites as `memray stats` reports them.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::Value;

use crate::venv::{self, run};

/// The memray release the tests compare with.
const MEMRAY_VERSION: &str = "1.20.0";

/// The venv's memray command (the venv's python is Debian's python3: the interpreter memtrace
/// traces).
fn memray() -> PathBuf {
    venv::with_package("memray-venv", "memray", MEMRAY_VERSION).join("bin").join("memray")
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
