//! What the container tests share: a made-up pod of the kubelet's cgroupfs driver with one
//! container, and a container's root file system built from local files (busybox-static as
//! /bin/sh, a fixture, the host's /usr bind-mounted by the runtime for glibc).

use std::{
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
};

use crate::fixture;

/// A pod of the kubelet's cgroupfs driver, with one container: their uid and id, made up per test
/// from `seed` (each test its own, so that one left by a killed test is not another's).
pub struct Pod {
    pub uid: String,
    pub container_id: String,
}

impl Pod {
    pub fn new(seed: u8) -> Self {
        Self {
            uid: format!("{seed:02x}0a1b2c-1111-4222-8333-444455556666"),
            container_id: format!("{seed:02x}{}", "c0ffee42".repeat(8))[..64].to_owned(),
        }
    }

    pub fn pod_cgroup(&self) -> String {
        format!("/kubepods/besteffort/pod{}", self.uid)
    }

    pub fn container_cgroup(&self) -> String {
        format!("{}/{}", self.pod_cgroup(), self.container_id)
    }

    /// What memtrace names a process `comm` of this container by where no runtime gave it names
    /// (model/identity.rs's display_name): its pod uid and short container id.
    pub fn process_name(&self, comm: &str) -> String {
        format!("{comm} [pod {}/{}]", self.uid, &self.container_id[..12])
    }
}

/// Makes `root` a container's root file system: busybox (as /bin/sh), /lib and /lib64 pointing
/// into /usr (which the runtime bind-mounts from the host), and the fixture `name` at `/name`.
pub fn root_filesystem(root: &Path, name: &str) {
    for sub in ["bin", "usr", "proc", "dev", "sys", "tmp"] {
        fs::create_dir_all(root.join(sub)).unwrap();
    }
    fs::copy("/bin/busybox", root.join("bin/busybox"))
        .expect("busybox-static is installed (cargo xtask setup)");
    symlink("busybox", root.join("bin/sh")).unwrap();
    symlink("usr/lib", root.join("lib")).unwrap();
    symlink("usr/lib64", root.join("lib64")).unwrap();
    fs::copy(fixture(name), root.join(name)).unwrap();
}

/// The roots of the cgroup hierarchies: /sys/fs/cgroup where it is the v2 hierarchy, else each
/// hierarchy mounted below it (v1's controllers, and a hybrid host's v2 at `unified`); none where
/// it cannot be read (a test's clean-up calls it, and must not panic).
pub fn cgroup_hierarchies() -> Vec<PathBuf> {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.controllers").exists() {
        return vec![root.to_owned()];
    }
    let mounted = |dir: &Path| dir.join("cgroup.procs").exists() || dir.join("tasks").exists();
    let entries = fs::read_dir(root).into_iter().flatten().flatten();
    entries.map(|entry| entry.path()).filter(|dir| mounted(dir)).collect()
}
