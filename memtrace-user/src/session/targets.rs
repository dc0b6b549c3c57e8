//! The targets of a run, attached: the processes `--pid` names (each once, by its process), or
//! the launched command, held before its exec; and each one watched through a pidfd, which turns
//! readable when it exits.

use std::{
    ffi::OsString,
    os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd},
    path::Path,
};

use anyhow::{bail, Result};
use nix::{
    sys::wait::{waitpid, WaitStatus},
    unistd::Pid,
};

use crate::{
    collect::Collector,
    follow::{
        hold::command::{resolve_program, HeldCommand},
        Following,
    },
    kernel::Probes,
    model::{identity::ProcessIdentity, Model},
    plan,
    process::allocator::Allocator,
    process::procfs,
    process::{ObjectFile, ProcessImage},
};

/// What a run traces, with every probe attached (none: every process, `--all`).
#[derive(Default)]
pub struct Targets {
    /// Processes whose exit ends the run.
    pub watched: Vec<Watched>,
    /// A command waiting to exec until tracing is announced.
    pub held: Option<HeldCommand>,
    /// Files whose unwind tables are worth loading before the targets run (a command's image).
    pub preload: Vec<ObjectFile>,
}

impl Targets {
    /// Attaches to what the plan names; `pids` are its --pid processes, as `processes_to_attach`
    /// found them.
    pub fn attach(
        wanted: &plan::Targets,
        pids: &[u32],
        following: &mut Following,
        probes: &mut Probes,
        collector: &mut Collector,
        model: &mut Model,
    ) -> Result<Self> {
        match wanted {
            plan::Targets::System(_) => Ok(Self::default()),
            plan::Targets::Pids { children, .. } => {
                Self::pids(pids, *children, following, probes, collector, model)
            }
            plan::Targets::Command { argv, .. } => Self::command(argv, following, probes, collector, model),
        }
    }

    fn pids(
        pids: &[u32],
        children: bool,
        following: &mut Following,
        probes: &mut Probes,
        collector: &mut Collector,
        model: &mut Model,
    ) -> Result<Self> {
        let mut watched = Vec::new();
        for &pid in pids {
            let image = ProcessImage::of_process(pid, following.cache())?;
            let allocator = following.add_target(probes, pid, &image)?;
            watched.push(Watched::new(pid, false)?);
            let identity = following.identify(pid, procfs::comm(pid).unwrap_or_default(), None);
            add_traced(model, identity, &allocator);
        }
        // The targets are in the kernel's tree already, so what they fork from now on is followed;
        // what they forked before is found here.
        for pid in procfs::descendants(pids).into_iter().filter(|_| children) {
            let comm = procfs::comm(pid).unwrap_or_default();
            let added = ProcessImage::of_process(pid, following.cache())
                .and_then(|image| following.add_target(probes, pid, &image));
            match added {
                Ok(allocator) => add_traced(model, following.identify(pid, comm, None), &allocator),
                // It may have exited meanwhile, or use no allocator memtrace knows.
                Err(err) => eprintln!("memtrace: warning: pid {pid} ({comm}) is not traced: {err:#}"),
            }
        }
        // Read every target's mappings now: a process may exit before the first interval, and its
        // stacks are symbolized through the files it mapped.
        collector.sample(probes, following.usdt(), model, 0)?;
        Ok(Self { watched, held: None, preload: Vec::new() })
    }

    fn command(
        command: &[OsString],
        following: &mut Following,
        probes: &mut Probes,
        collector: &mut Collector,
        model: &mut Model,
    ) -> Result<Self> {
        let program = resolve_program(&command[0])?;
        let image = ProcessImage::of_command(&program, following.cache())?;
        // The command may exit before the first sample: know its files for symbols already.
        for object in &image.objects {
            collector.index_object(object);
        }
        let held = HeldCommand::spawn(&program, command)?;
        let allocator = following.add_target(probes, held.pid, &image)?;
        collector.index_object(&allocator.object);
        let watched = vec![Watched::new(held.pid, true)?];
        // Held before its exec: /proc names memtrace's own file yet.
        let identity =
            following.identify(held.pid, command_name(&program), None).with_executable(program.clone());
        add_traced(model, identity, &allocator);
        // Held before its first instruction: every block it makes goes through the probes.
        if let Some(process) = model.processes.get_mut(&held.pid) {
            process.seen_from_start = true;
        }
        Ok(Self { watched, held: Some(held), preload: image.objects })
    }
}

/// The processes behind the --pid arguments: each once, by its process id even when given a thread id.
pub fn processes_to_attach(pids: &[u32]) -> Result<Vec<u32>> {
    let mut processes = Vec::new();
    for &pid in pids {
        if let Some(reason) = procfs::untraceable(pid) {
            bail!("{reason}");
        }
        let Some(tgid) = procfs::tgid(pid) else {
            bail!("no process with pid {pid}; check the pid with `ps -p {pid}`");
        };
        if tgid == std::process::id() {
            bail!("pid {pid} is memtrace itself; give the pid of the process to trace");
        }
        if tgid != pid {
            eprintln!("memtrace: {pid} is a thread of process {tgid}; tracing the whole process");
        }
        if !processes.contains(&tgid) {
            processes.push(tgid);
        }
    }
    Ok(processes)
}

fn add_traced(model: &mut Model, identity: ProcessIdentity, allocator: &Allocator) {
    let pid = identity.pid;
    model.add_process(identity, allocator.path.clone());
    if let Some(process) = model.processes.get_mut(&pid) {
        process.allocator_kind = allocator.kind.clone();
    }
}

/// A traced process that memtrace waits for: a pidfd turns readable when the process has exited.
pub struct Watched {
    pub pid: u32,
    pidfd: OwnedFd,
    /// Ours to reap, with an exit status to hand on.
    pub is_child: bool,
    pub exited: bool,
}

impl Watched {
    pub fn new(pid: u32, is_child: bool) -> Result<Self> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if fd < 0 {
            bail!(
                "no process with pid {pid} ({}); check it with `ps -p {pid}`",
                std::io::Error::last_os_error()
            );
        }
        // SAFETY: the descriptor was just returned to us and is owned by nothing else.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Ok(Self { pid, pidfd, is_child, exited: false })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.pidfd.as_fd()
    }

    /// Reaps an exited child and returns its status as a shell would: the exit code, or 128 + signal.
    pub fn reap(&self) -> Result<i32> {
        match waitpid(Pid::from_raw(self.pid as i32), None)? {
            WaitStatus::Exited(_, code) => Ok(code),
            WaitStatus::Signaled(_, signal, _) => Ok(128 + signal as i32),
            other => bail!("unexpected wait status of the command: {other:?}"),
        }
    }
}

/// The name the kernel will give the command: its file name, cut to 15 bytes.
fn command_name(program: &Path) -> String {
    let name = program.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    name.char_indices().take_while(|&(i, c)| i + c.len_utf8() <= 15).map(|(_, c)| c).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_names_are_cut_like_the_kernel_does() {
        assert_eq!(command_name(Path::new("/usr/bin/a-very-long-program-name")), "a-very-long-pro");
        assert_eq!(command_name(Path::new("./demo")), "demo");
    }
}
