//! `--debug-bpf`: the kernel side's own diagnostics (memtrace-ebpf/src/debug.rs), read from
//! aya-log's ring buffer on a thread of their own and printed on stderr as they come, each line
//! starting `memtrace: bpf:`.

use std::{
    os::fd::AsFd,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
};

use anyhow::{Context, Result};
use aya::Ebpf;
use aya_log::EbpfLogger;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

/// aya-log's level for the kernel side: every record (`debug!` included) with the flag, none
/// without. The kernel side's calls read it as a load-time constant.
pub fn kernel_level(enabled: bool) -> u8 {
    if enabled {
        aya_log::Level::Trace as u8
    } else {
        0
    }
}

/// The thread that prints the kernel side's records; dropped, it prints what is left and ends.
pub struct BpfLog {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// How long the thread waits for records before it looks whether to stop.
const POLL_MS: u16 = 100;

impl BpfLog {
    /// Starts printing the kernel side's records. Takes aya-log's map out of `ebpf`: call it once
    /// every program is loaded.
    pub fn start(ebpf: &mut Ebpf) -> Result<Self> {
        let mut logger = EbpfLogger::init_with_logger(ebpf, Stderr)
            .context("--debug-bpf: reading the kernel side's log records (aya-log's AYA_LOGS map)")?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::spawn(move || loop {
            let done = stopped.load(Ordering::Acquire);
            let mut fds = [PollFd::new(logger.as_fd(), PollFlags::POLLIN)];
            let waited = poll(&mut fds, PollTimeout::from(POLL_MS));
            logger.flush();
            if done || waited.is_err() {
                return;
            }
        });
        Ok(Self { stop, thread: Some(thread) })
    }
}

impl Drop for BpfLog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Writes each record on stderr.
struct Stderr;

impl log::Log for Stderr {
    fn enabled(&self, _metadata: &log::Metadata) -> bool {
        true
    }

    fn log(&self, record: &log::Record) {
        eprintln!("memtrace: bpf: {}", record.args());
    }

    fn flush(&self) {}
}
