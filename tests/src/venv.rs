//! Python packages from PyPI the tests run (the OpenTelemetry project's decoder, memray), each
//! pinned, installed into a venv of Debian's python3 under target/ when missing.

use std::{path::PathBuf, process::Command, sync::Mutex};

use crate::workspace_root;

/// The venv `target/NAME`, with `package==version` installed (checked once per test binary).
pub fn with_package(name: &str, package: &str, version: &str) -> PathBuf {
    static READY: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let venv = workspace_root().join("target").join(name);
    let mut ready = READY.lock().unwrap_or_else(|e| e.into_inner());
    if !ready.iter().any(|known| known == name) {
        let python = venv.join("bin").join("python3");
        let check = format!("import importlib.metadata as m; assert m.version('{package}') == '{version}'");
        let installed =
            python.exists() && Command::new(&python).args(["-c", &check]).status().is_ok_and(|s| s.success());
        if !installed {
            run(Command::new("/usr/bin/python3").arg("-m").arg("venv").arg(&venv));
            run(Command::new(venv.join("bin").join("pip"))
                .args(["install", "--quiet"])
                .arg(format!("{package}=={version}")));
        }
        ready.push(name.to_owned());
    }
    venv
}

/// Runs `command`, which must succeed.
pub fn run(command: &mut Command) {
    let status = command.status().unwrap_or_else(|err| panic!("running {command:?}: {err}"));
    assert!(status.success(), "{command:?} failed: {status}");
}
