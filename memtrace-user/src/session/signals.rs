//! The signals that end a run, read from a descriptor rather than delivered, so that the poll loop
//! decides what each one does (forward it to a launched command, stop tracing, let go of held
//! execs before memtrace stops).

use anyhow::{Context, Result};
use nix::sys::{
    signal::{SigSet, Signal},
    signalfd::{SfdFlags, SignalFd},
};

/// SIGINT and SIGTERM end the run cleanly: they are read from a descriptor, never delivered.
pub fn block_termination_signals() -> Result<SignalFd> {
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGINT);
    mask.add(Signal::SIGTERM);
    // Read too, so that memtrace lets go of held execs before it stops.
    mask.add(Signal::SIGTSTP);
    mask.thread_block().context("blocking SIGINT and SIGTERM")?;
    SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK).context("creating a signalfd")
}

/// The signal waiting on `signals`, if any.
pub fn read(signals: &SignalFd) -> Result<Option<Signal>> {
    Ok(signals.read_signal()?.and_then(|info| Signal::try_from(info.ssi_signo as i32).ok()))
}
