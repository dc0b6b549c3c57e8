//! The processes a run follows: the targets, attached (the processes `--pid` names, each once, by
//! its process, or the launched command, held before its exec), each one watched through a pidfd,
//! which turns readable when it exits; and what `Following` hears of execs, new processes and
//! exits. Signals for a launched command are passed on to it here.

use std::{
    ffi::OsString,
    os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd},
    path::Path,
};

use anyhow::{bail, Result};
use nix::{
    sys::{
        signal::{kill, Signal},
        wait::{waitpid, WaitStatus},
    },
    unistd::Pid,
};

use super::kernel_side::KernelSide;
use crate::{
    attach::usdt::UsdtProbes,
    follow::{
        hold::command::{resolve_program, HeldCommand},
        Following,
    },
    kernel::Probes,
    model::{
        identity::{AtExec, ProcessIdentity},
        Model,
    },
    plan,
    process::allocator::Allocator,
    process::procfs,
    process::{ObjectFile, ProcessImage},
};

/// The processes a run follows: its targets, each watched for its exit, and the execs, new
/// processes and exits that `Following` hears of, of the targets or of every process.
pub struct Traced {
    following: Following,
    /// Processes whose exit ends the run.
    watched: Vec<Watched>,
    /// The first SIGINT/SIGTERM went to the command.
    forwarded_signal: bool,
}

/// What is left to do before the targets run: a command waiting to exec until tracing is
/// announced, and the files whose unwind tables are worth loading first (the command's image).
#[derive(Default)]
pub struct Launch {
    pub held: Option<HeldCommand>,
    pub preload: Vec<ObjectFile>,
}

impl Traced {
    /// Attaches to what the plan names (none: every process, `--all`); `pids` are its --pid
    /// processes, as `processes_to_attach` found them.
    pub fn attach(
        wanted: &plan::Targets,
        pids: &[u32],
        mut following: Following,
        kernel: &mut KernelSide,
        model: &mut Model,
    ) -> Result<(Self, Launch)> {
        let (watched, launch) = match wanted {
            plan::Targets::System(_) => (Vec::new(), Launch::default()),
            plan::Targets::Pids { children, .. } => {
                (attach_pids(pids, *children, &mut following, kernel, model)?, Launch::default())
            }
            plan::Targets::Command { argv, .. } => launch_command(argv, &mut following, kernel, model)?,
        };
        Ok((Self { following, watched, forwarded_signal: false }, launch))
    }

    pub fn usdt(&self) -> &UsdtProbes {
        self.following.usdt()
    }

    /// Files whose allocators are probed (system-wide).
    pub fn probed_files(&self) -> usize {
        self.following.probed_files()
    }

    /// Readable when an exec, a new process or an exit is heard of.
    pub fn execs_fd(&self) -> BorrowedFd<'_> {
        self.following.fd()
    }

    /// Probes what the execs heard of bring along; true where a new program was exec'd.
    pub fn handle_execs(&mut self, kernel: &mut KernelSide) -> Result<bool> {
        kernel.handle_execs(&mut self.following)
    }

    /// Catches up before a sample: cgroups to allow, new processes to adopt into `model`, gone
    /// ones to forget, and forks too late for their parent's probes.
    pub fn catch_up(&mut self, probes: &mut Probes, model: &mut Model) -> Result<()> {
        self.following.allow_cgroups(probes)?;
        self.following.adopt_new_processes(probes, model)?;
        self.following.forget_gone_processes(probes);
        self.following.probe_late_forks(probes)
    }

    /// Puts the processes started since the last look in `model`.
    pub fn adopt_new_processes(&mut self, probes: &Probes, model: &mut Model) -> Result<()> {
        self.following.adopt_new_processes(probes, model)
    }

    /// The targets still running: each one's index and the descriptor that turns readable at its exit.
    pub fn running(&self) -> Vec<(usize, BorrowedFd<'_>)> {
        self.watched
            .iter()
            .enumerate()
            .filter(|(_, target)| !target.exited)
            .map(|(i, t)| (i, t.fd()))
            .collect()
    }

    /// Marks the target at `index` exited, in `model` too.
    pub fn exited(&mut self, index: usize, model: &mut Model) {
        let target = &mut self.watched[index];
        target.exited = true;
        if let Some(process) = model.processes.get_mut(&target.pid) {
            process.exited = true;
        }
    }

    pub fn all_exited(&self) -> bool {
        self.watched.iter().all(|target| target.exited)
    }

    /// The launched command, while it runs.
    pub fn running_child(&self) -> Option<u32> {
        self.watched.iter().find(|t| t.is_child && !t.exited).map(|t| t.pid)
    }

    /// The launched command, running or not.
    pub fn child(&self) -> Option<&Watched> {
        self.watched.iter().find(|t| t.is_child)
    }

    /// Passes the first `signal` on to a running command, which decides how to end (its exit
    /// ends the trace); false where it is not passed on, and the trace ends.
    pub fn forward(&mut self, signal: Signal) -> bool {
        match self.running_child() {
            Some(child) if !self.forwarded_signal => {
                let _ = kill(Pid::from_raw(child as i32), signal);
                self.forwarded_signal = true;
                eprintln!(
                    "memtrace: passed {signal} on to the command (pid {child}); tracing goes on \
                     until it exits (interrupt again to stop tracing now)"
                );
                true
            }
            _ => false,
        }
    }

    pub fn forwarded_signal(&self) -> bool {
        self.forwarded_signal
    }

    /// Ctrl-Z: memtrace stops, after letting go of the execs it holds (stopped, it could not
    /// answer them, and every exec on the machine would wait); it holds them again when continued.
    pub fn stop_until_continued(&mut self) {
        self.following.release_held_execs();
        eprintln!("memtrace: stopped (execs are not held while stopped; continue with fg or SIGCONT)");
        let _ = kill(Pid::this(), Signal::SIGSTOP);
        self.following.resume_held_execs();
    }

    /// Lets every held exec go on: the run is ending.
    pub fn release_held_execs(&mut self) {
        self.following.release_held_execs();
    }

    /// Library loads held until the library's unwind table was in.
    pub fn library_loads_held(&self) -> u64 {
        self.following.library_loads_held()
    }

    /// Says, at the end, how many execs were let go before their allocator was probed.
    pub fn warn_missed_execs(&self) {
        let missed = self.following.missed_execs();
        if missed > 0 {
            let execs = if missed == 1 { "exec was" } else { "execs were" };
            eprintln!(
                "memtrace: warning: {missed} {execs} let go before their program's allocator was probed \
                 (stopped past 5 s): those programs' first allocations may be missing"
            );
        }
    }
}

fn attach_pids(
    pids: &[u32],
    children: bool,
    following: &mut Following,
    kernel: &mut KernelSide,
    model: &mut Model,
) -> Result<Vec<Watched>> {
    let mut watched = Vec::new();
    for &pid in pids {
        let image = ProcessImage::of_process(pid, following.cache())?;
        let allocator = following.add_target(kernel.probes_mut(), pid, &image)?;
        watched.push(Watched::new(pid, false)?);
        let identity = following.identify(pid, procfs::comm(pid).unwrap_or_default(), None);
        add_traced(model, identity, &allocator);
    }
    // The targets are in the kernel's tree already, so what they fork from now on is followed;
    // what they forked before is found here.
    for pid in procfs::descendants(pids).into_iter().filter(|_| children) {
        let comm = procfs::comm(pid).unwrap_or_default();
        let added = ProcessImage::of_process(pid, following.cache())
            .and_then(|image| following.add_target(kernel.probes_mut(), pid, &image));
        match added {
            Ok(allocator) => add_traced(model, following.identify(pid, comm, None), &allocator),
            // It may have exited meanwhile, or use no allocator memtrace knows.
            Err(err) => eprintln!("memtrace: warning: pid {pid} ({comm}) is not traced: {err:#}"),
        }
    }
    // Read every target's mappings now: a process may exit before the first interval, and its
    // stacks are symbolized through the files it mapped.
    kernel.read_figures(following.usdt(), model, 0)?;
    Ok(watched)
}

fn launch_command(
    command: &[OsString],
    following: &mut Following,
    kernel: &mut KernelSide,
    model: &mut Model,
) -> Result<(Vec<Watched>, Launch)> {
    let program = resolve_program(&command[0])?;
    let image = ProcessImage::of_command(&program, following.cache())?;
    // The command may exit before the first sample: know its files for symbols already.
    for object in &image.objects {
        kernel.index_object(object);
    }
    let held = HeldCommand::spawn(&program, command)?;
    let allocator = following.add_target(kernel.probes_mut(), held.pid, &image)?;
    kernel.index_object(&allocator.object);
    let watched = vec![Watched::new(held.pid, true)?];
    // Held before its exec: /proc names memtrace's own file yet.
    // Its file as /proc/PID/exe will name it once it runs: symbolic links resolved.
    let executable = std::fs::canonicalize(&program).unwrap_or_else(|_| program.clone());
    let identity =
        following.identify(held.pid, command_name(&program), None).with_executable(executable.clone());
    add_traced(model, identity, &allocator);
    // Named again once its figures show the exec, when it may have exited already.
    following.note_exec(held.pid, AtExec { cgroup: None, program: Some(executable) });
    // Held before its first instruction: every block it makes goes through the probes.
    if let Some(process) = model.processes.get_mut(&held.pid) {
        process.seen_from_start = true;
    }
    Ok((watched, Launch { held: Some(held), preload: image.objects }))
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
    pid: u32,
    pidfd: OwnedFd,
    /// Ours to reap, with an exit status to hand on.
    is_child: bool,
    exited: bool,
}

impl Watched {
    fn new(pid: u32, is_child: bool) -> Result<Self> {
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
