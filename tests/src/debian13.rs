//! Debian 13's python3.13 (CPython 3.13), unpacked from Debian's archive into a root of its own,
//! target/debian13-python, by tests/fixtures/debian13-python.sh (this machine's Debian 12 libc is
//! older than it needs), and run there through chroot as a container would run it.

use std::{path::PathBuf, sync::Mutex};

use crate::{venv::run, workspace_root};

/// The interpreter, as the root sees it.
pub const PYTHON: &str = "/usr/bin/python3.13";

/// The root holding Debian 13's python3.13, made when missing (once per test binary). The kernel
/// matrix makes it before it boots a VM, which has no network.
pub fn root() -> PathBuf {
    static READY: Mutex<bool> = Mutex::new(false);
    let root = workspace_root().join("target/debian13-python");
    let mut ready = READY.lock().unwrap_or_else(|e| e.into_inner());
    if !*ready {
        run(std::process::Command::new("sh")
            .arg(workspace_root().join("tests/fixtures/debian13-python.sh"))
            .arg(&root));
        *ready = true;
    }
    root
}
