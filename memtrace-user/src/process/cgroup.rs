//! Which cgroup a process is in, and which container and pod that cgroup path names: the layouts
//! of Docker, containerd (CRI and plain), CRI-O, Podman and the kubelet's cgroupfs and systemd
//! drivers, on cgroup v1 and v2. Read from `/proc/PID/cgroup` while a process lives, and from the
//! cgroup id the kernel recorded at its first event (`CgroupNames`) when it is gone.

use std::{collections::HashMap, os::unix::fs::MetadataExt, path::Path};

use anyhow::{bail, Result};

use serde::{Deserialize, Serialize};

/// Where the cgroup v2 hierarchy is mounted: the whole of /sys/fs/cgroup on a v2 host, its
/// `unified` directory on a hybrid v1 host (systemd's hybrid layout). None on a v1-only host.
pub fn v2_root() -> Option<&'static Path> {
    ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"].into_iter().map(Path::new).find(|root| is_cgroup2(root))
}

fn is_cgroup2(path: &Path) -> bool {
    // CGROUP2_SUPER_MAGIC
    nix::sys::statfs::statfs(path).is_ok_and(|fs| fs.filesystem_type().0 as u64 == 0x6367_7270)
}

/// The cgroup path of a running process: its v2 path (`0::`), else the v1 path of the hierarchy
/// that container runtimes always place it in (pids, memory, or systemd's named one).
pub fn of_pid(pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    from_proc_cgroup(&text)
}

/// The path out of a `/proc/PID/cgroup` text (`hierarchy-ID:controllers:path` per line).
pub fn from_proc_cgroup(text: &str) -> Option<String> {
    let entries: Vec<(&str, &str)> = text
        .lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            Some((controllers, path))
        })
        .collect();
    let v2 = entries.iter().find(|(controllers, _)| controllers.is_empty()).map(|(_, path)| *path);
    // A hybrid host whose runtime left the process in the v2 root: the v1 path names it.
    let v1 = ["pids", "memory", "name=systemd"].iter().find_map(|wanted| {
        entries.iter().find(|(controllers, _)| controllers.split(',').any(|c| c == *wanted)).map(|(_, p)| *p)
    });
    match (v2, v1) {
        (Some(v2), _) if v2 != "/" => Some(v2.to_owned()),
        (_, Some(v1)) => Some(v1.to_owned()),
        (v2, None) => v2.map(str::to_owned),
    }
}

/// A container, as its cgroup path names it and, where the runtime said, Kubernetes' labels.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Container {
    /// 64 hex digits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    pub cgroup: String,
    /// `io.kubernetes.pod.name`, `io.kubernetes.pod.namespace`, `io.kubernetes.container.name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Container {
    /// The id as `docker ps` shows it: its first 12 hex digits.
    pub fn short_id(&self) -> Option<&str> {
        self.id.as_deref().map(|id| &id[..id.len().min(12)])
    }
}

/// The container and pod a cgroup path names, if it names either.
pub fn container_of(path: &str) -> Option<Container> {
    let mut id = None;
    let mut pod_uid = None;
    for component in path.split('/').filter(|c| !c.is_empty()) {
        if let Some(uid) = pod_uid_in(component) {
            pod_uid = Some(uid);
        } else if let Some(found) = container_id_in(component) {
            id = Some(found);
        }
    }
    if id.is_none() && pod_uid.is_none() {
        return None;
    }
    Some(Container { id, pod_uid, cgroup: path.to_owned(), ..Container::default() })
}

/// A container's id in one path component: 64 hex digits, alone (cgroupfs drivers: `/docker/ID`,
/// `/kubepods/besteffort/podUID/ID`) or after a runtime's prefix in a systemd scope
/// (`docker-ID.scope`, `cri-containerd-ID.scope`, `crio-ID.scope`, `libpod-ID.scope`). A
/// runtime's monitor (`crio-conmon-ID`, `libpod-conmon-ID`) is not the container.
fn container_id_in(component: &str) -> Option<String> {
    let name = component.strip_suffix(".scope").unwrap_or(component);
    if name.contains("conmon") {
        return None;
    }
    let id = name.rsplit('-').next()?;
    (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| id.to_ascii_lowercase())
}

/// A pod's uid in one path component: `podUID` (cgroupfs driver) or
/// `kubepods-QOS-podUID_WITH_UNDERSCORES.slice` (systemd driver).
fn pod_uid_in(component: &str) -> Option<String> {
    let name = component.strip_suffix(".slice").unwrap_or(component);
    // cgroupfs: the uid keeps its dashes; systemd: the slice's name nests with dashes, the uid's
    // own dashes are underscores.
    let uid = match name.strip_prefix("pod") {
        Some(uid) => uid.to_owned(),
        None if name.starts_with("kubepods") => name.rsplit_once("-pod")?.1.replace('_', "-"),
        None => return None,
    };
    let well_formed = uid.len() == 36
        && uid.bytes().enumerate().all(|(i, b)| {
            matches!(i, 8 | 13 | 18 | 23) == (b == b'-') && (b == b'-' || b.is_ascii_hexdigit())
        });
    well_formed.then_some(uid)
}

/// What `--container` (id prefixes, lower case) and `--cgroup` (paths) name.
#[derive(Debug, Clone, Default)]
pub struct CgroupFilter {
    pub containers: Vec<String>,
    pub paths: Vec<String>,
}

impl CgroupFilter {
    pub fn is_empty(&self) -> bool {
        self.containers.is_empty() && self.paths.is_empty()
    }

    /// The v2 cgroups named now, with their descendants: paths by id.
    pub fn matching(&self) -> Result<HashMap<u64, String>> {
        if v2_root().is_none() {
            bail!(
                "--container and --cgroup need the cgroup v2 hierarchy (at /sys/fs/cgroup, or \
                 /sys/fs/cgroup/unified on a hybrid host), which the kernel filters by; mount it with \
                 `mount -t cgroup2 none /sys/fs/cgroup/unified`, or trace with --all and read each \
                 process's `container` in the summary"
            );
        }
        Ok(walk_ids().into_iter().filter(|(_, path)| self.names(path)).collect())
    }

    /// The options that name no cgroup that exists now, with their flag.
    pub fn unmatched(&self) -> Vec<(&'static str, String)> {
        let paths: Vec<String> = walk_ids().into_values().collect();
        let containers = self
            .containers
            .iter()
            .map(|id| ("--container", id, Self { containers: vec![id.clone()], paths: vec![] }));
        let cgroups = self
            .paths
            .iter()
            .map(|path| ("--cgroup", path, Self { containers: vec![], paths: vec![path.clone()] }));
        containers
            .chain(cgroups)
            .filter(|(_, _, one)| !paths.iter().any(|path| one.names(path)))
            .map(|(flag, name, _)| (flag, name.clone()))
            .collect()
    }

    /// Whether the cgroup at `path` is one named, or below one.
    pub fn names(&self, path: &str) -> bool {
        let under = |wanted: &String| {
            wanted == "/"
                || path == wanted
                || path.strip_prefix(wanted.as_str()).is_some_and(|rest| rest.starts_with('/'))
        };
        let of_container = || {
            let id = container_of(path).and_then(|container| container.id);
            id.is_some_and(|id| self.containers.iter().any(|prefix| id.starts_with(prefix.as_str())))
        };
        self.paths.iter().any(under) || of_container()
    }
}

/// cgroup v2 ids (a cgroup directory's inode number, what `bpf_get_current_cgroup_id` returns)
/// to their paths, read by walking the v2 hierarchy when an id is not known yet.
#[derive(Debug, Default)]
pub struct CgroupNames {
    paths: HashMap<u64, String>,
}

impl CgroupNames {
    /// The path of cgroup `id`, walking the hierarchy again when it is new (a cgroup removed
    /// before that walk stays unnamed).
    pub fn path_of(&mut self, id: u64) -> Option<String> {
        if id == 0 {
            return None;
        }
        if !self.paths.contains_key(&id) {
            self.paths = walk_ids();
        }
        self.paths.get(&id).cloned()
    }
}

/// Every cgroup of the v2 hierarchy by id, path relative to its root.
pub fn walk_ids() -> HashMap<u64, String> {
    let mut paths = HashMap::new();
    let Some(root) = v2_root() else { return paths };
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(meta) = std::fs::metadata(&dir) else { continue };
        let relative = dir.strip_prefix(root).map(|p| format!("/{}", p.display())).unwrap_or_default();
        paths.insert(meta.ino(), relative);
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        pending
            .extend(entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()));
    }
    paths
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "4f5e8c3a2b1d0e9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f";
    const UID: &str = "0a1b2c3d-1111-2222-3333-444455556666";

    fn named(path: &str) -> (Option<String>, Option<String>) {
        let container = container_of(path).unwrap_or_else(|| panic!("{path} names no container"));
        assert_eq!(container.cgroup, path);
        (container.id, container.pod_uid)
    }

    #[test]
    fn kubelet_systemd_driver() {
        let uid = UID.replace('-', "_");
        for (qos, runtime) in [("burstable-", "cri-containerd-"), ("besteffort-", "crio-"), ("", "docker-")] {
            let path = format!("/kubepods.slice/kubepods-{qos}pod{uid}.slice/{runtime}{ID}.scope");
            assert_eq!(named(&path), (Some(ID.into()), Some(UID.into())), "{path}");
        }
        let guaranteed = format!("/kubepods.slice/kubepods-pod{uid}.slice/cri-containerd-{ID}.scope");
        assert_eq!(named(&guaranteed), (Some(ID.into()), Some(UID.into())));
        // The pod's own slice, with no container below it: the pod only.
        assert_eq!(
            named(&format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice")),
            (None, Some(UID.into()))
        );
    }

    #[test]
    fn kubelet_cgroupfs_driver() {
        for qos in ["besteffort/", "burstable/", ""] {
            let path = format!("/kubepods/{qos}pod{UID}/{ID}");
            assert_eq!(named(&path), (Some(ID.into()), Some(UID.into())), "{path}");
        }
        // CRI-O under cgroupfs names its scope.
        assert_eq!(
            named(&format!("/kubepods/burstable/pod{UID}/crio-{ID}")),
            (Some(ID.into()), Some(UID.into()))
        );
    }

    #[test]
    fn docker_containerd_podman() {
        for path in [
            format!("/system.slice/docker-{ID}.scope"),
            format!("/docker/{ID}"),
            format!("/machine.slice/libpod-{ID}.scope"),
            format!("/machine.slice/libpod-{ID}.scope/container"),
            format!("/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope"),
            format!("/system.slice/crio-{ID}.scope"),
            format!("/default/{ID}"),
            format!("/system.slice/containerd.service/k8s.io/{ID}"),
        ] {
            assert_eq!(named(&path), (Some(ID.into()), None), "{path}");
        }
        let upper = ID.to_ascii_uppercase();
        assert_eq!(named(&format!("/docker/{upper}")).0.as_deref(), Some(ID), "ids are kept lower case");
    }

    #[test]
    fn paths_that_name_no_container() {
        for path in [
            "/",
            "/user.slice/user-0.slice/session-3.scope",
            "/system.slice/containerd.service",
            &format!("/machine.slice/libpod-conmon-{ID}.scope"),
            &format!("/system.slice/crio-conmon-{ID}.scope"),
            "/docker/abc123",
            "/kubepods/besteffort/podnot-a-uid",
        ] {
            assert!(container_of(path).is_none(), "{path}");
        }
    }

    #[test]
    fn filter_names_cgroups_and_their_descendants() {
        let filter =
            CgroupFilter { containers: vec![ID[..12].to_owned()], paths: vec!["/kubepods/burstable".into()] };
        assert!(filter.names("/kubepods/burstable"));
        assert!(filter.names(&format!("/kubepods/burstable/pod{UID}")));
        assert!(!filter.names("/kubepods/burstable2"), "a sibling whose name starts alike is not below");
        assert!(filter.names(&format!("/system.slice/docker-{ID}.scope")));
        assert!(filter.names(&format!("/machine.slice/libpod-{ID}.scope/container")));
        assert!(!filter.names(&format!("/docker/{}", ID.replace('4', "5"))));
    }

    #[test]
    fn proc_cgroup_v2_hybrid_and_v1() {
        assert_eq!(from_proc_cgroup("0::/system.slice/x.scope\n").as_deref(), Some("/system.slice/x.scope"));
        // Hybrid: the runtime joined the unified hierarchy too.
        let hybrid = format!("9:name=systemd:/docker/{ID}\n4:memory:/docker/{ID}\n0::/docker/{ID}\n");
        assert_eq!(from_proc_cgroup(&hybrid), Some(format!("/docker/{ID}")));
        // Hybrid, left in the v2 root: the v1 path names it.
        let left = format!("8:pids:/kubepods/pod{UID}/{ID}\n4:memory:/kubepods/pod{UID}/{ID}\n0::/\n");
        assert_eq!(from_proc_cgroup(&left), Some(format!("/kubepods/pod{UID}/{ID}")));
        // v1 only, controllers joined on one line.
        let v1 = format!("3:cpu,cpuacct:/docker/{ID}\n2:memory:/docker/{ID}\n");
        assert_eq!(from_proc_cgroup(&v1), Some(format!("/docker/{ID}")));
        assert_eq!(from_proc_cgroup("0::/\n").as_deref(), Some("/"));
    }
}
