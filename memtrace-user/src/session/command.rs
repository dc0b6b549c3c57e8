//! Why tracing stopped (`Ending`, as the run's loop finds it), and a launched command that
//! outlives the trace: memtrace says why tracing stopped, writes the
//! outputs, detaches, and then waits for the command, never leaving it orphaned: the next signal
//! is passed on to it, and the one after that kills it.

use std::os::fd::AsFd;

use anyhow::{Context, Result};
use nix::{
    poll::{poll, PollFd, PollFlags, PollTimeout},
    sys::{
        signal::{kill, Signal},
        signalfd::SignalFd,
    },
    unistd::Pid,
};

use super::{signals, targets::Watched};
use crate::{model::Model, process::procfs};

/// Why tracing stopped.
pub enum Ending {
    TargetsExited,
    DurationReached,
    Signal(Signal),
    /// An output could not be written (said when it happened).
    OutputFailed,
}

/// A launched command still running when tracing stops: memtrace waits for it, never leaving it
/// orphaned, and says so.
pub struct RunningCommand {
    pid: u32,
    name: String,
}

impl RunningCommand {
    pub fn of(pid: u32, model: &Model) -> Self {
        // Its name now: it may have exec'd since it was last sampled.
        let name = procfs::comm(pid)
            .or_else(|| model.processes.get(&pid).map(|p| p.identity.comm.clone()))
            .unwrap_or_default();
        Self { pid, name }
    }

    /// Says at once why tracing stopped and that the command still runs.
    pub fn announce_wait(&self, ending: &Ending, forwarded: bool) {
        let why = match ending {
            Ending::DurationReached => "--duration reached".to_owned(),
            Ending::Signal(signal) => format!("{signal} again"),
            Ending::OutputFailed => "an output failed".to_owned(),
            Ending::TargetsExited => return,
        };
        let next = if forwarded { "kill it with SIGKILL" } else { "pass the signal on to it" };
        eprintln!(
            "memtrace: {why}: tracing stops, the outputs are written and the probes detached; still \
             waiting for {} (pid {}) to exit; interrupt memtrace again to {next}",
            self.name, self.pid
        );
    }

    /// Waits for the command to exit and returns its status as a shell would. A signal is passed
    /// on to it if none was yet; after that, a signal kills it.
    pub fn wait(&self, child: &Watched, signals: &SignalFd, mut forwarded: bool) -> Result<i32> {
        loop {
            let mut fds =
                [PollFd::new(signals.as_fd(), PollFlags::POLLIN), PollFd::new(child.fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(err) => return Err(err).context("waiting for the command to exit"),
            }
            let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
            let (signalled, exited) = (ready(&fds[0]), ready(&fds[1]));
            if exited {
                return child.reap();
            }
            let signal = if signalled { signals::read(signals)? } else { None };
            match signal {
                // Ctrl-Z stops memtrace as it would any program.
                Some(Signal::SIGTSTP) => {
                    let _ = kill(Pid::this(), Signal::SIGSTOP);
                }
                // Sent before it is said: what stderr reports has happened.
                Some(signal) if !forwarded => {
                    let _ = kill(Pid::from_raw(self.pid as i32), signal);
                    forwarded = true;
                    eprintln!(
                        "memtrace: passed {signal} on to {} (pid {}); interrupt again to kill it (SIGKILL)",
                        self.name, self.pid
                    );
                }
                Some(_) => {
                    let _ = kill(Pid::from_raw(self.pid as i32), Signal::SIGKILL);
                    eprintln!("memtrace: killed {} (pid {}) with SIGKILL", self.name, self.pid);
                }
                None => {}
            }
        }
    }
}
