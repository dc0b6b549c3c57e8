//! What names a process, in one place: pid and start, command name, executable, cgroup and
//! container. Built once where a process enters the model (`ProcessIdentity::read`, handed to
//! `Model::add_process`), and read by every output: the summary, the trace's process names,
//! the report, top, serve's metric labels, pprof labels and the folding of exited processes. A new
//! label is a field here and a line in `labels`.

use std::path::PathBuf;

use memtrace_common::ProcessStats;

pub use crate::process::cgroup::Container;
use crate::process::cgroup::{self, CgroupNames};

/// What was seen of a process as it exec'd, to name it by once it is gone (/proc no longer says):
/// the cgroup it ran its new program in (on a v1 host a process gone reads as in the root) and the
/// program's file (a short-lived command has exited by the time its figures are read).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AtExec {
    pub cgroup: Option<String>,
    pub program: Option<PathBuf>,
}

/// Who a process is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessIdentity {
    pub pid: u32,
    /// CLOCK_MONOTONIC nanoseconds when its figures began (its image, as the kernel recorded it);
    /// with the pid, this tells a reused pid from the process that had it. 0 until known.
    pub started_ns: u64,
    /// The command name, as the kernel keeps it (15 bytes at most).
    pub comm: String,
    /// The program file, where /proc said it while the process ran.
    pub executable: Option<PathBuf>,
    /// Its cgroup path (v2, or the pids/memory hierarchy's on a v1 host), where known.
    pub cgroup: Option<String>,
    /// The container and pod its cgroup names, where it names one; its pod, namespace and name
    /// where containerd gave them (`Following::identify`, process/containerd.rs).
    pub container: Option<Container>,
}

impl ProcessIdentity {
    pub fn new(pid: u32, comm: String) -> Self {
        Self { pid, comm, ..Self::default() }
    }

    /// The same process under the program file `executable`, where /proc cannot name it yet (a
    /// launched command held before its exec: /proc names memtrace's own file).
    pub fn with_executable(self, executable: PathBuf) -> Self {
        Self { executable: Some(executable), ..self }
    }

    /// The process's command name is now `comm` (the kernel's, after an exec or a rename): the
    /// one field of an identity that changes while the process lives.
    pub fn rename(&mut self, comm: String) {
        self.comm = comm;
    }

    /// The constructor for a process entering the model: what the kernel recorded at its first
    /// event (`stats`: its start and cgroup id) where it has figures, and what /proc says while
    /// it runs. The kernel's cgroup id names the cgroup of a process already gone; /proc names it
    /// on a host without the v2 hierarchy, where that id is the root's; there, a process that
    /// exited reads as in the root (its exit moved it), and `at_exec`, the cgroup it was seen to
    /// exec in, names it. A process gone has no /proc/PID/exe either: the program it was seen to
    /// exec names it.
    pub fn read(
        pid: u32,
        comm: String,
        stats: Option<&ProcessStats>,
        names: &mut CgroupNames,
        at_exec: AtExec,
    ) -> Self {
        let mut identity = Self::new(pid, comm);
        identity.started_ns = stats.map_or(0, |stats| stats.started_ns);
        identity.executable = std::fs::read_link(format!("/proc/{pid}/exe")).ok().or(at_exec.program);
        let from_kernel = stats.and_then(|stats| names.path_of(stats.cgroup_id)).filter(|path| path != "/");
        let exec_cgroup = at_exec.cgroup;
        let from_proc = || cgroup::of_pid(pid).filter(|path| path != "/" || exec_cgroup.is_none());
        if let Some(path) = from_kernel.or_else(from_proc).or(exec_cgroup) {
            identity.set_cgroup(path);
        }
        identity
    }

    /// How outputs that show one name show the process: its command, and where it runs in a
    /// container, `[namespace/pod/container]` or the container's short id.
    pub fn display_name(&self) -> String {
        match self.container_name() {
            Some(container) => format!("{} [{container}]", self.comm),
            None => self.comm.clone(),
        }
    }

    /// The container part of `display_name`.
    pub fn container_name(&self) -> Option<String> {
        let container = self.container.as_ref()?;
        let pod = match (&container.namespace, &container.pod) {
            (Some(namespace), Some(pod)) => Some(format!("{namespace}/{pod}")),
            (None, Some(pod)) => Some(pod.clone()),
            _ => container.pod_uid.as_ref().map(|uid| format!("pod {uid}")),
        };
        let name = container.name.clone().or_else(|| container.short_id().map(str::to_owned));
        match (pod, name) {
            (Some(pod), Some(name)) => Some(format!("{pod}/{name}")),
            (pod, name) => pod.or(name),
        }
    }

    /// The labels a series or a sample of this process carries (serve's metrics, pprof): pid and
    /// comm always, the container's where known (an empty label is no label to Prometheus, so a
    /// process outside containers keeps the series it had). The container id is cut to 12 hex
    /// digits and the pod uid left out, to keep what varies per series small.
    pub fn labels(&self) -> Vec<(&'static str, String)> {
        let mut labels = vec![("pid", self.pid.to_string()), ("comm", self.comm.clone())];
        if let Some(container) = &self.container {
            let known = [
                ("container_id", container.short_id().map(str::to_owned)),
                ("pod", container.pod.clone()),
                ("namespace", container.namespace.clone()),
                ("container", container.name.clone()),
            ];
            labels.extend(known.into_iter().filter_map(|(name, value)| Some((name, value?))));
        }
        labels
    }

    /// Takes the cgroup path (and the container it names), unless one is known already.
    pub fn set_cgroup(&mut self, path: String) {
        if self.cgroup.is_some() {
            return;
        }
        self.container = cgroup::container_of(&path);
        self.cgroup = Some(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "4f5e8c3a2b1d0e9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f";

    #[test]
    fn a_process_gone_is_placed_where_it_was_seen_to_exec() {
        // No such process: /proc names no cgroup, and the kernel's id 0 none either.
        let path = format!("/kubepods/besteffort/pod0a1b2c3d-1111-2222-3333-444455556666/{ID}");
        let identity = ProcessIdentity::read(
            u32::MAX,
            "app".into(),
            None,
            &mut CgroupNames::default(),
            AtExec { cgroup: Some(path.clone()), program: Some("/usr/bin/app".into()) },
        );
        assert_eq!(identity.cgroup.as_deref(), Some(path.as_str()));
        assert_eq!(identity.executable, Some(PathBuf::from("/usr/bin/app")));
        assert_eq!(identity.container.and_then(|container| container.id).as_deref(), Some(ID));
    }

    #[test]
    fn names_and_labels() {
        let mut identity = ProcessIdentity::new(7, "server".into());
        assert_eq!(identity.display_name(), "server");
        identity.set_cgroup(format!("/kubepods/besteffort/pod0a1b2c3d-1111-2222-3333-444455556666/{ID}"));
        assert_eq!(identity.display_name(), "server [pod 0a1b2c3d-1111-2222-3333-444455556666/4f5e8c3a2b1d]");
        let container = identity.container.as_mut().unwrap();
        (container.pod, container.namespace, container.name) =
            (Some("web-0".into()), Some("shop".into()), Some("app".into()));
        assert_eq!(identity.display_name(), "server [shop/web-0/app]");
        let labels = identity.labels();
        assert_eq!(labels[2], ("container_id", "4f5e8c3a2b1d".to_owned()));
        assert_eq!(labels[5], ("container", "app".to_owned()));
        assert_eq!(ProcessIdentity::new(8, "host".into()).labels().len(), 2, "none outside containers");
        // The first path seen stays.
        identity.set_cgroup("/other".into());
        assert_eq!(identity.cgroup.as_deref().map(|c| c.starts_with("/kubepods")), Some(true));
    }
}
