//! A terminal for tests of `memtrace top`: a tmux server of the test's own running one command
//! in a window of a fixed size, read as text and sent keys; and memtrace run in it
//! ([`InTerminal`]), its streams in files and its exit status written when it ends.

use std::{
    ffi::CString,
    fs::{self, File, OpenOptions},
    io::Write,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
    process::{Command, Output},
    sync::atomic::{AtomicUsize, Ordering},
    thread,
    time::{Duration, Instant},
};

use crate::DEADLINE;

/// A tmux server of the test's own, with one session running `command` in a terminal of a fixed
/// size, which stays once the command has ended. Killed when dropped.
pub struct Tmux {
    socket: String,
}

impl Tmux {
    pub fn start(command: &str) -> Self {
        static SERVERS: AtomicUsize = AtomicUsize::new(0);
        let socket =
            format!("memtrace-test-{}-{}", std::process::id(), SERVERS.fetch_add(1, Ordering::Relaxed));
        let tmux = Self { socket };
        // No user configuration; the pane stays once its command has ended, to be read.
        let options =
            ["-f", "/dev/null", "start-server", ";", "set-option", "-g", "remain-on-exit", "on", ";"];
        let session = ["new-session", "-d", "-x", "160", "-y", "50", "-s", "top", command];
        tmux.run(&[&options[..], &session[..]].concat());
        tmux
    }

    fn run(&self, args: &[&str]) -> Output {
        let output = Command::new("tmux")
            .args(["-L", &self.socket])
            .args(args)
            .output()
            .unwrap_or_else(|err| panic!("running tmux (install it with `cargo xtask setup`): {err}"));
        assert!(output.status.success(), "tmux {args:?}: {}", String::from_utf8_lossy(&output.stderr));
        output
    }

    /// What the terminal shows now, or None once the session has ended.
    pub fn screen(&self) -> Option<String> {
        let output = Command::new("tmux")
            .args(["-L", &self.socket, "capture-pane", "-p", "-t", "top"])
            .output()
            .expect("running tmux");
        output.status.success().then(|| String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// Polls the terminal until `wanted` holds for what it shows, for at most [`DEADLINE`].
    pub fn wait_until(&self, what: &str, wanted: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + DEADLINE;
        let mut last = String::new();
        loop {
            match self.screen() {
                Some(screen) if wanted(&screen) => return screen,
                Some(screen) => last = screen,
                None => panic!("the terminal closed before it showed {what}; it last showed:\n{last}"),
            }
            assert!(Instant::now() < deadline, "the terminal never showed {what}; it shows:\n{last}");
            thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn wait_for(&self, text: &str) -> String {
        self.wait_until(&format!("{text:?}"), |screen| screen.contains(text))
    }

    pub fn send(&self, key: &str) {
        self.run(&["send-keys", "-t", "top", key]);
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux").args(["-L", &self.socket, "kill-server"]).output();
    }
}

/// Quotes a path for the shell tmux runs the command in.
pub fn quoted(path: &Path) -> String {
    format!("'{}'", path.display().to_string().replace('\'', r"'\''"))
}

/// Waits for the shell in tmux to write memtrace's exit status into `path`.
pub fn exit_status(path: &Path, tmux: &Tmux) -> i32 {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(status) = fs::read_to_string(path).ok().filter(|text| text.ends_with('\n')) {
            return status.trim().parse().expect("an exit status");
        }
        assert!(
            Instant::now() < deadline,
            "memtrace did not exit; the terminal shows:\n{}",
            tmux.screen().unwrap_or_default()
        );
        thread::sleep(Duration::from_millis(50));
    }
}

/// A named pipe a command reads as its stdin, held open for writing by the test: the command
/// reads end of file when it is dropped.
pub struct Fifo {
    pub path: PathBuf,
    writer: Option<File>,
}

impl Fifo {
    pub fn create(path: PathBuf) -> Self {
        let name = CString::new(path.as_os_str().as_bytes()).expect("a path without NUL");
        // SAFETY: mkfifo reads a NUL-terminated path and creates a file; no memory is shared.
        let made = unsafe { libc::mkfifo(name.as_ptr(), 0o600) };
        assert_eq!(made, 0, "mkfifo {}: {}", path.display(), std::io::Error::last_os_error());
        // Read and write: the open does not wait for a reader.
        let writer = OpenOptions::new().read(true).write(true).open(&path).expect("opening the fifo");
        Self { path, writer: Some(writer) }
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.writer.as_mut().expect("the fifo is open").write_all(bytes).expect("writing to the fifo");
    }

    pub fn close(&mut self) {
        self.writer = None;
    }
}

/// A path as an argument of [`InTerminal::start`] (the tests' paths are UTF-8).
pub fn path(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

/// Where memtrace's streams go, run in a terminal: stdin from a FIFO where given, stdout and
/// stderr into `stdout` and `stderr` of its directory where asked (else on the terminal).
#[derive(Default)]
pub struct Streams<'a> {
    pub stdin: Option<&'a Fifo>,
    pub stdout_to_file: bool,
    pub stderr_to_file: bool,
}

/// memtrace run in a terminal with `args`, by a shell that writes its exit status to `status` in
/// `dir` once it ends.
pub struct InTerminal {
    pub tmux: Tmux,
    dir: PathBuf,
}

impl InTerminal {
    pub fn start(dir: &Path, args: &[&str], streams: Streams<'_>) -> Self {
        let mut command = quoted(&crate::memtrace_bin());
        for arg in args {
            command += &format!(" {}", quoted(Path::new(arg)));
        }
        if let Some(stdin) = streams.stdin {
            command += &format!(" < {}", quoted(&stdin.path));
        }
        if streams.stdout_to_file {
            command += &format!(" > {}", quoted(&dir.join("stdout")));
        }
        if streams.stderr_to_file {
            command += &format!(" 2> {}", quoted(&dir.join("stderr")));
        }
        command += &format!("; echo $? > {}", quoted(&dir.join("status")));
        Self { tmux: Tmux::start(&command), dir: dir.to_owned() }
    }

    /// Its exit status, once it has exited.
    pub fn status(&self) -> i32 {
        exit_status(&self.dir.join("status"), &self.tmux)
    }

    /// What it wrote to stderr (where that went to a file), so far.
    pub fn stderr(&self) -> String {
        fs::read_to_string(self.dir.join("stderr")).unwrap_or_default()
    }

    /// What it wrote to stdout (where that went to a file), so far.
    pub fn stdout(&self) -> String {
        fs::read_to_string(self.dir.join("stdout")).unwrap_or_default()
    }
}
