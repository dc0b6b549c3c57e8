//! A process's memory cgroup and the limit it lives under: its path from /proc/PID/cgroup (the
//! memory controller's line on cgroup v1, the unified line on v2), and the lowest `memory.max`
//! (v2) or `memory.limit_in_bytes` (v1) on that cgroup and its ancestors, read where
//! /proc/self/mountinfo says the hierarchy is mounted. Or from the cgroup's id, as the kernel read it
//! at an OOM kill (`memory_cgroup_by_id`): once a task is exiting, /proc/PID/cgroup shows its v1
//! cgroups as `/`.

use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryCgroup {
    /// Its path in the memory controller's hierarchy, e.g. `/system.slice/app.service`.
    pub path: String,
    /// The lowest memory limit on it or an ancestor, in bytes; None where none is set.
    pub limit_bytes: Option<u64>,
}

/// Which hierarchy holds the memory controller for a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hierarchy {
    V1,
    V2,
}

/// The memory cgroup of `pid` and its limit; None where /proc/PID/cgroup cannot be read (the
/// process has been reaped).
pub fn memory_cgroup(pid: u32) -> Option<MemoryCgroup> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let (path, hierarchy) = memory_line(&text)?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let limit_bytes = mount_point(&mountinfo, hierarchy).and_then(|(mount, root)| {
        // Inside a cgroup namespace the mount's root is the namespace's: paths are relative to it.
        let relative = path.strip_prefix(root.as_str()).unwrap_or(&path);
        lowest_limit(&mount, relative, hierarchy)
    });
    Some(MemoryCgroup { path, limit_bytes })
}

/// The memory cgroup whose id (the kernel's kernfs node id: the inode number of its directory) is
/// `id`, found in the hierarchy that holds the memory controller (v1's where it is on v1, else
/// v2's); None where no directory has it (the cgroup was removed).
pub fn memory_cgroup_by_id(id: u64) -> Option<MemoryCgroup> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let (mount, hierarchy) = match mount_point(&mountinfo, Hierarchy::V1) {
        Some((mount, _)) => (mount, Hierarchy::V1),
        None => (mount_point(&mountinfo, Hierarchy::V2)?.0, Hierarchy::V2),
    };
    let dir = find_inode(&mount, id, 0)?;
    let relative = dir.strip_prefix(&mount).ok()?;
    let path = format!("/{}", relative.display());
    let limit_bytes = lowest_limit(&mount, &path, hierarchy);
    Some(MemoryCgroup { path, limit_bytes })
}

/// The directory at or below `dir` whose inode number is `inode` (cgroup trees are shallow).
fn find_inode(dir: &Path, inode: u64, depth: u32) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    if std::fs::metadata(dir).ok()?.ino() == inode {
        return Some(dir.to_owned());
    }
    if depth >= 32 {
        return None;
    }
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|entry| entry.file_type().is_ok_and(|kind| kind.is_dir()))
        .find_map(|entry| find_inode(&entry.path(), inode, depth + 1))
}

/// The memory cgroup's path in /proc/PID/cgroup: v1's `N:...memory...:/path` line where the memory
/// controller is on v1 (a hybrid host), else v2's `0::/path`.
fn memory_line(text: &str) -> Option<(String, Hierarchy)> {
    let mut unified = None;
    for line in text.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        if controllers.split(',').any(|controller| controller == "memory") {
            return Some((path.to_owned(), Hierarchy::V1));
        }
        if id == "0" && controllers.is_empty() {
            unified = Some((path.to_owned(), Hierarchy::V2));
        }
    }
    unified
}

/// Where the hierarchy is mounted, and the root of the mount, from /proc/self/mountinfo
/// (`ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS... - TYPE SOURCE SUPER_OPTIONS`).
fn mount_point(mountinfo: &str, hierarchy: Hierarchy) -> Option<(PathBuf, String)> {
    mountinfo.lines().find_map(|line| {
        let (mount, filesystem) = line.split_once(" - ")?;
        let mount: Vec<&str> = mount.split(' ').collect();
        let filesystem: Vec<&str> = filesystem.split(' ').collect();
        let wanted = match hierarchy {
            Hierarchy::V2 => filesystem.first() == Some(&"cgroup2"),
            Hierarchy::V1 => {
                filesystem.first() == Some(&"cgroup")
                    && filesystem.get(2).is_some_and(|options| options.split(',').any(|o| o == "memory"))
            }
        };
        (wanted && mount.len() > 4).then(|| (PathBuf::from(mount[4]), mount[3].to_owned()))
    })
}

/// The lowest limit on the cgroup at `path` under `mount` and on its ancestors.
fn lowest_limit(mount: &Path, path: &str, hierarchy: Hierarchy) -> Option<u64> {
    let file = match hierarchy {
        Hierarchy::V1 => "memory.limit_in_bytes",
        Hierarchy::V2 => "memory.max",
    };
    let mut lowest: Option<u64> = None;
    let mut cgroup = Some(Path::new(path));
    while let Some(dir) = cgroup {
        let relative = dir.strip_prefix("/").unwrap_or(dir);
        if let Ok(text) = std::fs::read_to_string(mount.join(relative).join(file)) {
            if let Some(limit) = parse_limit(&text) {
                lowest = Some(lowest.map_or(limit, |lowest| lowest.min(limit)));
            }
        }
        cgroup = dir.parent();
    }
    lowest
}

/// A limit as the file says it: `max` (v2) or v1's "no limit" (PAGE_COUNTER_MAX pages, about
/// 2^63 bytes) are none.
fn parse_limit(text: &str) -> Option<u64> {
    let value: u64 = text.trim().parse().ok()?;
    (value < 1 << 62).then_some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_line_of_v1_wins_on_a_hybrid_host() {
        let hybrid = "12:pids:/a\n4:memory:/memtrace-oom\n1:name=systemd:/user.slice\n0::/user.slice\n";
        assert_eq!(memory_line(hybrid), Some(("/memtrace-oom".to_owned(), Hierarchy::V1)));
        let unified = "0::/kubepods/pod1/c1\n";
        assert_eq!(memory_line(unified), Some(("/kubepods/pod1/c1".to_owned(), Hierarchy::V2)));
        assert_eq!(memory_line("3:cpu,cpuacct:/x\n"), None);
    }

    #[test]
    fn mounts_are_found_by_type_and_controller() {
        let mountinfo = "30 25 0:26 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory\n\
                         31 25 0:27 / /sys/fs/cgroup/cpu rw,relatime shared:10 - cgroup cgroup rw,cpu\n\
                         32 25 0:28 /ns /sys/fs/cgroup/unified rw,relatime shared:11 - cgroup2 cgroup2 rw\n";
        assert_eq!(
            mount_point(mountinfo, Hierarchy::V1),
            Some((PathBuf::from("/sys/fs/cgroup/memory"), "/".to_owned()))
        );
        assert_eq!(
            mount_point(mountinfo, Hierarchy::V2),
            Some((PathBuf::from("/sys/fs/cgroup/unified"), "/ns".to_owned()))
        );
    }

    #[test]
    fn unlimited_is_no_limit() {
        assert_eq!(parse_limit("100663296\n"), Some(100_663_296));
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit("9223372036854771712\n"), None);
    }
}
