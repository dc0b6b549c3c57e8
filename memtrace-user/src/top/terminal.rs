//! The terminal while `memtrace top` runs: the view draws on /dev/tty in raw mode on the alternate
//! screen, and what memtrace (or a command it runs) writes on stdout and stderr is held meanwhile,
//! shown in the view's last lines and written out once the terminal is given back, so that no line
//! scribbles over the view and none is lost. A command's stdin is not the terminal either (the keys
//! are the view's): /dev/null, unless memtrace's stdin was something else already.

use std::{
    collections::VecDeque,
    fs::{File, OpenOptions},
    io::{IsTerminal, Write},
    os::fd::{AsFd, AsRawFd, OwnedFd, RawFd},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    thread,
};

use anyhow::{Context, Result};
use nix::{
    fcntl::{fcntl, FcntlArg, OFlag},
    poll::{poll, PollFd, PollFlags, PollTimeout},
    unistd::{dup, dup2, pipe2},
};
use ratatui::{
    backend::CrosstermBackend,
    crossterm::{
        cursor::{Hide, Show},
        execute,
        terminal::{disable_raw_mode, enable_raw_mode, EnterAlternateScreen, LeaveAlternateScreen},
    },
    Terminal,
};

pub type Backend = CrosstermBackend<File>;

/// The terminal in raw mode on the alternate screen; given back as it was when dropped.
pub struct Screen {
    pub terminal: Terminal<Backend>,
}

impl Screen {
    pub fn open() -> Result<Self> {
        let tty = OpenOptions::new().read(true).write(true).open("/dev/tty").context(
            "`memtrace top` draws on a terminal, and this process has none (/dev/tty); run it in one, \
             or trace without `top`",
        )?;
        enable_raw_mode().context("putting the terminal in raw mode")?;
        let mut backend = CrosstermBackend::new(tty);
        if let Err(err) = execute!(backend, EnterAlternateScreen, Hide) {
            let _ = disable_raw_mode();
            return Err(err).context("switching to the terminal's alternate screen");
        }
        let terminal = match Terminal::new(backend) {
            Ok(terminal) => terminal,
            Err(err) => {
                let _ = disable_raw_mode();
                return Err(err).context("reading the terminal's size");
            }
        };
        Ok(Self { terminal })
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        let _ = execute!(self.terminal.backend_mut(), LeaveAlternateScreen, Show);
        let _ = disable_raw_mode();
    }
}

/// The most bytes held per stream; beyond it the oldest go, and the replay says how many.
const HELD_BYTES: usize = 1 << 20;
/// The most recent lines kept for the view.
const RECENT_LINES: usize = 64;

/// One redirected stream: its file descriptor, and where it went before.
struct Redirected {
    fd: RawFd,
    original: OwnedFd,
}

/// What was written while the view had the terminal.
#[derive(Default)]
pub struct Held {
    /// stdout's and stderr's bytes, in order per stream.
    bytes: [Vec<u8>; 2],
    dropped: [usize; 2],
    /// The latest whole lines of both streams, in the order they were ended.
    recent: VecDeque<String>,
    /// Each stream's line being written (a line may come in several writes).
    partial: [String; 2],
    /// The terminal is given back: what comes now goes straight through.
    passthrough: bool,
}

impl Held {
    fn take(&mut self, stream: usize, chunk: &[u8]) {
        if self.passthrough {
            let _ = match stream {
                0 => std::io::stdout().write_all(chunk),
                _ => std::io::stderr().write_all(chunk),
            };
            return;
        }
        let bytes = &mut self.bytes[stream];
        bytes.extend_from_slice(chunk);
        if bytes.len() > HELD_BYTES {
            let excess = bytes.len() - HELD_BYTES / 2;
            bytes.drain(..excess);
            self.dropped[stream] += excess;
        }
        let partial = &mut self.partial[stream];
        partial.push_str(&String::from_utf8_lossy(chunk));
        while let Some(end) = partial.find('\n') {
            let line: String = partial.drain(..=end).collect();
            self.recent.push_back(line);
        }
        // A line that never ends is shown in pieces of a screen's width.
        if partial.len() > 256 {
            self.recent.push_back(std::mem::take(partial));
        }
        while self.recent.len() > RECENT_LINES {
            self.recent.pop_front();
        }
    }

    /// The last `count` lines written, oldest first, without their line ends.
    pub fn recent(&self, count: usize) -> Vec<String> {
        let skip = self.recent.len().saturating_sub(count);
        self.recent.iter().skip(skip).map(|line| line.trim_end().to_owned()).collect()
    }
}

/// stdout and stderr held in pipes, and stdin away from the terminal, while the view runs.
pub struct Capture {
    redirected: Vec<Redirected>,
    /// The pipes' read ends, until the thread that drains them starts.
    pipes: Option<[OwnedFd; 2]>,
    pub held: Arc<Mutex<Held>>,
    restored: bool,
}

pub fn lock(held: &Mutex<Held>) -> MutexGuard<'_, Held> {
    held.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Capture {
    pub fn start() -> Result<Self> {
        let mut capture = Self { redirected: Vec::new(), pipes: None, held: Arc::default(), restored: false };
        if std::io::stdin().is_terminal() {
            let null = File::open("/dev/null").context("opening /dev/null")?;
            capture.redirect(0, null.as_fd().as_raw_fd())?;
        }
        let mut read_ends = Vec::new();
        for fd in [1, 2] {
            let (read, write) = pipe2(OFlag::O_CLOEXEC).context("creating a pipe for the output")?;
            // Room for a burst before the view's thread drains it (at most the system's limit).
            let _ = fcntl(write.as_raw_fd(), FcntlArg::F_SETPIPE_SZ(HELD_BYTES as i32));
            capture.redirect(fd, write.as_raw_fd())?;
            read_ends.push(read);
        }
        capture.pipes = read_ends.try_into().ok();
        Ok(capture)
    }

    /// Points `fd` at `to`, keeping where it pointed.
    fn redirect(&mut self, fd: RawFd, to: RawFd) -> Result<()> {
        let original = dup(fd).with_context(|| format!("duplicating file descriptor {fd}"))?;
        // SAFETY: dup returned a new descriptor that nothing else owns.
        let original = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(original) };
        // The original is not for a command memtrace starts.
        fcntl(original.as_raw_fd(), FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC))?;
        dup2(to, fd).with_context(|| format!("redirecting file descriptor {fd}"))?;
        self.redirected.push(Redirected { fd, original });
        Ok(())
    }

    /// Starts draining the pipes (once): until every writer has closed them.
    pub fn drain(&mut self) {
        let Some(pipes) = self.pipes.take() else { return };
        let held = Arc::clone(&self.held);
        thread::Builder::new()
            .name("memtrace-output".into())
            .spawn(move || drain_pipes(pipes, &held))
            .map(drop)
            .unwrap_or_else(|err| eprintln!("memtrace: warning: cannot hold the output: {err}"));
    }

    /// Gives the streams back and writes out what was held. What a command writes from now on
    /// goes straight through.
    pub fn restore(&mut self) {
        if std::mem::replace(&mut self.restored, true) {
            return;
        }
        let mut held = lock(&self.held);
        for redirected in &self.redirected {
            let _ = dup2(redirected.original.as_raw_fd(), redirected.fd);
        }
        held.passthrough = true;
        for (stream, bytes) in std::mem::take(&mut held.bytes).iter().enumerate() {
            let dropped = held.dropped[stream];
            let mut out: Box<dyn Write> =
                if stream == 0 { Box::new(std::io::stdout()) } else { Box::new(std::io::stderr()) };
            if dropped > 0 {
                let _ = writeln!(std::io::stderr(), "memtrace: ({dropped} earlier bytes of output dropped)");
            }
            let _ = out.write_all(bytes).and_then(|()| out.flush());
        }
        drop(held);
        // A command still running writes into the pipes: keep draining them, now straight through.
        self.drain();
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.restore();
    }
}

fn drain_pipes(pipes: [OwnedFd; 2], held: &Mutex<Held>) {
    let mut open = [true, true];
    let mut buffer = vec![0u8; 64 * 1024];
    while open.iter().any(|&o| o) {
        let mut fds: Vec<PollFd<'_>> =
            pipes.iter().map(|pipe| PollFd::new(pipe.as_fd(), PollFlags::POLLIN)).collect();
        for (fd, &is_open) in fds.iter_mut().zip(&open) {
            if !is_open {
                fd.set_events(PollFlags::empty());
            }
        }
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return,
        }
        let ready: Vec<bool> = fds.iter().map(|fd| fd.revents().is_some_and(|r| !r.is_empty())).collect();
        drop(fds);
        for (stream, pipe) in pipes.iter().enumerate() {
            if !open[stream] || !ready[stream] {
                continue;
            }
            match nix::unistd::read(pipe.as_raw_fd(), &mut buffer) {
                Err(nix::errno::Errno::EINTR) => {}
                Ok(0) | Err(_) => open[stream] = false,
                Ok(count) => lock(held).take(stream, &buffer[..count]),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_lines_join_the_pieces_of_each_streams_lines() {
        let mut held = Held::default();
        held.take(1, b"memtrace: trac");
        held.take(0, b"ready\nleak");
        held.take(1, b"ing pid 7\nwarning: ");
        held.take(0, b"ed\n");
        assert_eq!(held.recent(9), ["ready", "memtrace: tracing pid 7", "leaked"]);
        assert_eq!(held.recent(1), ["leaked"]);
        assert_eq!(held.bytes[1], b"memtrace: tracing pid 7\nwarning: ");
    }

    #[test]
    fn held_bytes_are_bounded() {
        let mut held = Held::default();
        let chunk = vec![b'x'; HELD_BYTES / 4 + 1];
        for _ in 0..8 {
            held.take(0, &chunk);
        }
        assert!(held.bytes[0].len() <= HELD_BYTES);
        assert_eq!(held.bytes[0].len() + held.dropped[0], chunk.len() * 8);
        assert!(held.recent.len() <= RECENT_LINES);
    }
}
