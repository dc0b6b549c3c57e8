//! Helpers shared by memtrace's integration tests: find the `memtrace` binary, compile the C fixtures,
//! run memtrace in a temporary directory of its own and read back what it wrote.
//!
//! The tests load BPF programs into the running kernel, so they must run as root; every entry point
//! that starts memtrace asserts that instead of skipping.

use std::{
    ffi::{OsStr, OsString},
    fs,
    io::{BufRead, BufReader, Read, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, ExitStatus, Stdio},
    sync::{
        atomic::{AtomicUsize, Ordering},
        mpsc::{self, Receiver, RecvTimeoutError},
    },
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;
use tempfile::TempDir;

pub mod chromium;
pub mod containers;
pub mod debian13;
pub mod guide;
pub mod kubernetes;
pub mod memray;
pub mod npm;
pub mod otlp;
pub mod perfetto;
pub mod pprof;
pub mod receiver;
pub mod tmux;
pub mod venv;

/// How long any wait in a test may last before the test fails instead of hanging.
pub const DEADLINE: Duration = Duration::from_secs(120);

/// How long a whole run of memtrace may take: [`DEADLINE`], times `$MEMTRACE_TEST_SLOWDOWN` on a
/// machine known to be that much slower (the kernel matrix's emulated CPUs: tests/matrix/guest.sh).
pub fn run_deadline() -> Duration {
    let slowdown =
        std::env::var("MEMTRACE_TEST_SLOWDOWN").ok().and_then(|factor| factor.parse().ok()).unwrap_or(1);
    DEADLINE * slowdown
}

/// The interval every test run samples at, so that short runs still see several samples.
pub const INTERVAL: &str = "100ms";

/// The workspace this crate belongs to.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives inside the workspace")
        .to_owned()
}

fn target_dir() -> PathBuf {
    workspace_root().join("target")
}

/// `GET /metrics` of the agent at the loopback `port`: the body of its answer.
pub fn scrape_metrics(port: u16) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connecting to the agent");
    stream.set_read_timeout(Some(DEADLINE)).unwrap();
    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").expect("asking for /metrics");
    let mut reply = String::new();
    stream.read_to_string(&mut reply).expect("reading /metrics");
    reply.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or_default()
}

/// Whether a process's resident pages are whole in the kernel's counters as memtrace reads them at
/// its exit: where the counts are per-CPU (6.2 and later: the kernel's BTF has no struct
/// mm_rss_stat), the exit probe sums the CPUs' pending counts only where /proc/kallsyms lists
/// `__per_cpu_offset` (Debian's kernels; not one built without CONFIG_KALLSYMS_ALL, as the
/// project's development host's 6.18); elsewhere up to 31 pages a CPU are left out.
pub fn exit_counts_are_whole() -> bool {
    let btf = fs::read("/sys/kernel/btf/vmlinux").expect("reading the kernel's BTF");
    let per_cpu = !btf.windows(13).any(|name| name == b"\0mm_rss_stat\0");
    let kallsyms = fs::read_to_string("/proc/kallsyms").expect("reading /proc/kallsyms");
    !per_cpu || kallsyms.contains(" __per_cpu_offset\n")
}

/// Fails the test unless it runs as root: it loads BPF programs into the kernel.
pub fn assert_root() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "memtrace's integration tests load BPF programs and must run as root \
         (e.g. `sudo cargo xtask test`); this test runs as uid {euid}"
    );
}

/// The `memtrace` binary under test: `$MEMTRACE_BIN`, or the release build of this workspace.
pub fn memtrace_bin() -> PathBuf {
    let path = std::env::var_os("MEMTRACE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("release/memtrace"));
    assert!(
        path.is_file(),
        "no memtrace binary at {}: build it with `cargo xtask build` (or point MEMTRACE_BIN at one)",
        path.display()
    );
    path
}

/// Compiles `tests/fixtures/<name>.c` into `target/fixtures/<name>` unless that is up to date, and
/// returns the program's path. Safe when tests compile the same fixture in parallel: each compiles
/// to a name of its own and renames the result into place.
pub fn fixture(name: &str) -> PathBuf {
    fixture_variant(name, "", &[])
}

/// The summary of a traced run of fixture `name` with `args`, which must exit 0, written to `path`
/// (as `memtrace --summary PATH` writes it): the saved run that `memtrace diff`, `report` and
/// `check` read.
pub fn saved_run(name: &str, args: &[&str], path: &Path) -> PathBuf {
    let outcome = Memtrace::new().command(&fixture(name)).args(args.iter().copied()).run();
    outcome.assert_exit_code(0);
    std::fs::write(path, outcome.summary().to_string()).expect("writing the summary");
    path.to_owned()
}

/// Like `fixture`, with extra compiler flags (`-static`, `-ljemalloc`, ...), built as
/// `target/fixtures/<name>-<variant>`.
pub fn fixture_variant(name: &str, variant: &str, extra_flags: &[&str]) -> PathBuf {
    static COMPILATIONS: AtomicUsize = AtomicUsize::new(0);
    let source = workspace_root().join("tests/fixtures").join(format!("{name}.c"));
    let out_dir = target_dir().join("fixtures");
    let program = match variant {
        "" => out_dir.join(name),
        variant => out_dir.join(format!("{name}-{variant}")),
    };
    let modified = |path: &Path| fs::metadata(path).and_then(|m| m.modified()).ok();
    let source_modified =
        modified(&source).unwrap_or_else(|| panic!("no fixture source {}", source.display()));
    // A header the fixtures share (say_ready.h) changed is a fixture changed.
    let shared = workspace_root().join("tests/fixtures/say_ready.h");
    let source_modified = modified(&shared).map_or(source_modified, |header| header.max(source_modified));
    if modified(&program).is_some_and(|built| built >= source_modified) {
        return program;
    }
    fs::create_dir_all(&out_dir).unwrap_or_else(|err| panic!("creating {}: {err}", out_dir.display()));
    let unique = COMPILATIONS.fetch_add(1, Ordering::Relaxed);
    let partial = out_dir.join(format!(".{name}.{}.{unique}.tmp", std::process::id()));
    let output = Command::new("cc")
        .args(["-O0", "-g", "-fno-omit-frame-pointer", "-pthread", "-o"])
        .arg(&partial)
        .arg(&source)
        .args(extra_flags)
        .output()
        .unwrap_or_else(|err| panic!("running cc to compile {}: {err}", source.display()));
    assert!(
        output.status.success(),
        "compiling {} failed:\n{}",
        source.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    // On disk before a probe reads it: this machine's 6.18 ext4 warned once (a WARN taint, in
    // ext4_check_map_extents_env) when a uprobe was placed in a static program written a moment
    // before, its blocks not yet allocated.
    fs::File::open(&partial)
        .and_then(|file| file.sync_all())
        .unwrap_or_else(|err| panic!("flushing {}: {err}", partial.display()));
    fs::rename(&partial, &program)
        .unwrap_or_else(|err| panic!("moving the fixture into {}: {err}", program.display()));
    program
}

/// A pid that no process has: pids are always below `pid_max`.
pub fn unused_pid() -> u32 {
    let pid_max = fs::read_to_string("/proc/sys/kernel/pid_max").expect("reading pid_max");
    pid_max.trim().parse().expect("pid_max is a number")
}

/// The lines of a child's output stream, read on a thread of their own so that the child never
/// blocks on a full pipe and a test can wait for one line with a deadline.
struct Lines {
    incoming: Receiver<String>,
    seen: Vec<String>,
    closed: bool,
}

impl Lines {
    fn new(stream: impl Read + Send + 'static) -> Self {
        let (sender, incoming) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stream).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Self { incoming, seen: Vec::new(), closed: false }
    }

    /// Takes the next line if one arrives before `deadline`.
    fn next_line(&mut self, deadline: Instant) -> Option<&str> {
        if self.closed {
            return None;
        }
        let timeout = deadline.saturating_duration_since(Instant::now());
        match self.incoming.recv_timeout(timeout) {
            Ok(line) => {
                self.seen.push(line);
                self.seen.last().map(String::as_str)
            }
            Err(RecvTimeoutError::Disconnected) => {
                self.closed = true;
                None
            }
            Err(RecvTimeoutError::Timeout) => None,
        }
    }

    /// Waits for a line that starts with `prefix`.
    fn wait_for(&mut self, prefix: &str, deadline: Instant) -> Option<String> {
        self.wait_until(|line| line.starts_with(prefix), deadline)
    }

    fn wait_until(&mut self, wanted: impl Fn(&str) -> bool, deadline: Instant) -> Option<String> {
        while let Some(line) = self.next_line(deadline) {
            if wanted(line) {
                return Some(line.to_owned());
            }
        }
        None
    }

    /// Reads until the stream ends (every writer has closed it) or `deadline`.
    fn drain(&mut self, deadline: Instant) {
        while self.next_line(deadline).is_some() {}
    }

    fn text(&self) -> String {
        self.seen.iter().map(|line| format!("{line}\n")).collect()
    }
}

/// Calls `ready` until it gives a value, for at most [`DEADLINE`]: for what a test can only ask
/// again (an endpoint, a file another process writes).
pub fn poll<T>(what: &str, mut ready: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(value) = ready() {
            return value;
        }
        assert!(Instant::now() < deadline, "never saw {what}");
        thread::sleep(Duration::from_millis(50));
    }
}

/// A leak group's stack, as the summary names its frames.
pub fn leak_stack(leak: &Value) -> Vec<&str> {
    leak["stack"].as_array().unwrap().iter().map(|f| f.as_str().unwrap()).collect()
}

/// The leak group of `process` (the summary's) whose stack holds `frame`; exactly one.
pub fn leak_through<'a>(process: &'a Value, frame: &str) -> &'a Value {
    let leaks: Vec<&Value> = process["leaks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|leak| leak_stack(leak).contains(&frame))
        .collect();
    assert_eq!(leaks.len(), 1, "one leak through {frame}: {:#}", process["leaks"]);
    leaks[0]
}

/// The row of `process`'s per-function table named `name`.
pub fn function_row<'a>(process: &'a Value, name: &str) -> &'a Value {
    let functions = process["functions"].as_array().unwrap();
    functions.iter().find(|f| f["name"] == name).unwrap_or_else(|| panic!("no {name}: {functions:#?}"))
}

/// `command` (a program that waits for `release` on its stdin before it does its work), attached
/// with `memtrace --pid` once its unwind tables are loaded, released, and traced to its exit 0;
/// memtrace's outcome, which exited 0.
pub fn attached_until_released(command: Command, release: &[u8]) -> Outcome {
    let mut target = Spawned::spawn(command);
    let pid = target.pid().to_string();
    let mut memtrace = Memtrace::new().args(["--pid", &pid]).spawn();
    memtrace.wait_for_stderr_containing(&format!("unwind tables loaded for pid {pid}"));
    memtrace.wait_for_stderr("memtrace: tracing");
    target.send(release);
    assert!(target.wait().success(), "{pid} exited 0");
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    outcome
}

/// A child process with piped stdin, stdout and stderr, killed if the test ends before it does.
pub struct Spawned {
    what: String,
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: Lines,
    stderr: Lines,
    status: Option<ExitStatus>,
}

impl Spawned {
    pub fn spawn(mut command: Command) -> Self {
        let what = format!("{command:?}");
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|err| panic!("starting {what}: {err}"));
        let stdin = child.stdin.take();
        let stdout = Lines::new(child.stdout.take().expect("stdout is piped"));
        let stderr = Lines::new(child.stderr.take().expect("stderr is piped"));
        Self { what, child, stdin, stdout, stderr, status: None }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for a line on stdout that starts with `prefix` and returns it.
    pub fn wait_for_stdout(&mut self, prefix: &str) -> String {
        let found = self.stdout.wait_for(prefix, Instant::now() + DEADLINE);
        found.unwrap_or_else(|| self.fail(&format!("no line starting with {prefix:?} on stdout")))
    }

    /// Waits for a line on stderr that starts with `prefix` and returns it.
    pub fn wait_for_stderr(&mut self, prefix: &str) -> String {
        let found = self.stderr.wait_for(prefix, Instant::now() + DEADLINE);
        found.unwrap_or_else(|| self.fail(&format!("no line starting with {prefix:?} on stderr")))
    }

    pub fn wait_for_stderr_containing(&mut self, needle: &str) -> String {
        let found = self.stderr.wait_until(|line| line.contains(needle), Instant::now() + DEADLINE);
        found.unwrap_or_else(|| self.fail(&format!("no line containing {needle:?} on stderr")))
    }

    /// Everything the child wrote to stdout so far, once it has ended.
    pub fn stdout_text(&mut self) -> String {
        self.stdout.drain(Instant::now() + DEADLINE);
        self.stdout.text()
    }

    /// Writes to the child's stdin.
    pub fn send(&mut self, bytes: &[u8]) {
        let stdin = self.stdin.as_mut().expect("stdin is still open");
        stdin
            .write_all(bytes)
            .and_then(|()| stdin.flush())
            .unwrap_or_else(|err| panic!("writing to the stdin of {}: {err}", self.what));
    }

    /// Closes the child's stdin: it reads end of file.
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// Waits for the child to exit, for at most [`DEADLINE`].
    pub fn wait(&mut self) -> ExitStatus {
        let deadline = Instant::now() + run_deadline();
        loop {
            if let Some(status) = self.try_wait() {
                return status;
            }
            if Instant::now() >= deadline {
                self.kill();
                self.fail(&format!("still running after {:?}; killed it", run_deadline()));
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// The child's exit status, if it has exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status =
                self.child.try_wait().unwrap_or_else(|err| panic!("waiting for {}: {err}", self.what));
        }
        self.status
    }

    /// Kills the child with SIGKILL and reaps it.
    /// Sends SIGINT, as Ctrl-C would.
    pub fn interrupt(&mut self) {
        // SAFETY: kill has no memory-safety preconditions; the child is ours and not yet reaped.
        let sent = unsafe { libc::kill(self.pid() as libc::pid_t, libc::SIGINT) };
        assert_eq!(sent, 0, "sending SIGINT to {}", self.pid());
    }

    pub fn kill(&mut self) {
        if self.try_wait().is_none() {
            let _ = self.child.kill();
            self.status = Some(self.child.wait().expect("reaping a killed child"));
        }
    }

    /// What the child wrote on stderr so far.
    pub fn stderr_text(&self) -> String {
        self.stderr.text()
    }

    fn fail(&self, problem: &str) -> ! {
        panic!(
            "{}: {problem}\n--- stdout so far ---\n{}--- stderr so far ---\n{}",
            self.what,
            self.stdout.text(),
            self.stderr.text()
        )
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A memtrace invocation: by default `memtrace -o <dir>/trace.json --summary <dir>/summary.json
/// -i 100ms`, then the test's arguments, run in a temporary directory of its own under target/.
pub struct Memtrace {
    dir: TempDir,
    wrapper: Vec<OsString>,
    /// The binary to run, when not [`memtrace_bin`] (a copy another user can reach).
    binary: Option<PathBuf>,
    default_outputs: bool,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
}

/// The user unprivileged runs take, as setpriv spells it: nobody.
const NOBODY: [&str; 3] = ["--reuid=65534", "--regid=65534", "--clear-groups"];

impl Memtrace {
    pub fn new() -> Self {
        assert_root();
        let parent = target_dir().join("memtrace-tests");
        fs::create_dir_all(&parent).unwrap_or_else(|err| panic!("creating {}: {err}", parent.display()));
        Self::in_dir(&parent)
    }

    /// A run whose directory is made in `parent`.
    fn in_dir(parent: &Path) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("run-")
            .tempdir_in(parent)
            .unwrap_or_else(|err| panic!("creating a directory in {}: {err}", parent.display()));
        Self {
            dir,
            wrapper: Vec::new(),
            binary: None,
            default_outputs: true,
            args: Vec::new(),
            env: Vec::new(),
        }
    }

    /// memtrace as nobody through `setpriv` with `setpriv_args` (capabilities), able to reach its
    /// binary and write its outputs in its directory whoever owns the clone: the directory is made
    /// in the system's temporary directory, open to all, and the binary is copied into it when
    /// nobody cannot run it where it is (a clone under root's 0700 home).
    pub fn as_nobody<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(setpriv_args: I) -> Self {
        use std::os::unix::fs::PermissionsExt;
        assert_root();
        let mut memtrace = Self::in_dir(&std::env::temp_dir());
        fs::set_permissions(memtrace.dir(), fs::Permissions::from_mode(0o777))
            .expect("opening the run's directory");
        memtrace.binary = Some(memtrace.reachable(&memtrace_bin()));
        let setpriv = ["setpriv"].into_iter().chain(NOBODY).map(OsString::from);
        memtrace.wrapped_in(setpriv.chain(setpriv_args.into_iter().map(|arg| arg.as_ref().to_owned())))
    }

    /// `program` where nobody can run it: where it is, or else a copy in the run's directory.
    pub fn reachable(&self, program: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let runs = Command::new("setpriv")
            .args(NOBODY)
            .args(["test", "-x"])
            .arg(program)
            .status()
            .expect("running setpriv")
            .success();
        if runs {
            return program.to_owned();
        }
        let copy = self.dir().join(program.file_name().expect("a program has a file name"));
        fs::copy(program, &copy)
            .unwrap_or_else(|err| panic!("copying {} to {}: {err}", program.display(), copy.display()));
        fs::set_permissions(&copy, fs::Permissions::from_mode(0o755)).expect("making the copy executable");
        copy
    }

    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(self, args: I) -> Self {
        args.into_iter().fold(self, Self::arg)
    }

    /// Sets an environment variable of memtrace's (and of a command it runs).
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.env.push((key.as_ref().to_owned(), value.as_ref().to_owned()));
        self
    }

    /// Traces `program` from its first instruction: `-- program`.
    pub fn command(self, program: &Path) -> Self {
        self.arg("--").arg(program)
    }

    /// Leaves out `-o`, `--summary` and `-i`, for tests that pass their own.
    pub fn without_default_outputs(mut self) -> Self {
        self.default_outputs = false;
        self
    }

    /// Runs memtrace through another program, e.g. `setpriv ...`.
    pub fn wrapped_in<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(mut self, wrapper: I) -> Self {
        self.wrapper = wrapper.into_iter().map(|arg| arg.as_ref().to_owned()).collect();
        self
    }

    /// The run's own directory, where the trace and the summary go.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// memtrace as nobody, with no capabilities, able to reach its binary and write its outputs
    /// (see [`Memtrace::as_nobody`]): only privileges stand in its way.
    pub fn unprivileged() -> Self {
        Self::as_nobody(["--inh-caps=-all"])
    }

    pub fn spawn(self) -> Running {
        let binary = self.binary.clone().unwrap_or_else(memtrace_bin);
        let mut command = match self.wrapper.split_first() {
            Some((program, wrapper_args)) => {
                let mut command = Command::new(program);
                command.args(wrapper_args).arg(binary);
                command
            }
            None => Command::new(binary),
        };
        if self.default_outputs {
            command
                .arg("-o")
                .arg(self.dir.path().join("trace.json"))
                .arg("--summary")
                .arg(self.dir.path().join("summary.json"))
                .args(["-i", INTERVAL]);
        }
        command.args(&self.args).envs(self.env.iter().map(|(key, value)| (key, value)));
        Running { process: Spawned::spawn(command), dir: self.dir }
    }

    /// Runs memtrace to its end, with its stdin closed.
    pub fn run(self) -> Outcome {
        self.spawn().finish()
    }
}

impl Default for Memtrace {
    fn default() -> Self {
        Self::new()
    }
}

/// A memtrace process that is running. Its stdin, stdout and stderr are pipes; a command it runs
/// inherits them, so [`Spawned::send`] and [`Spawned::wait_for_stdout`] talk to the command.
pub struct Running {
    process: Spawned,
    dir: TempDir,
}

impl std::ops::Deref for Running {
    type Target = Spawned;

    fn deref(&self) -> &Spawned {
        &self.process
    }
}

impl std::ops::DerefMut for Running {
    fn deref_mut(&mut self) -> &mut Spawned {
        &mut self.process
    }
}

impl Running {
    pub fn trace_path(&self) -> PathBuf {
        self.dir.path().join("trace.json")
    }

    /// The trace as written so far, or None while it ends in the middle of an event.
    pub fn trace_so_far(&self) -> Option<Trace> {
        let text = fs::read_to_string(self.trace_path()).ok()?;
        parse_trace(&text).ok()
    }

    /// Polls the trace file until `ready` holds for what it holds, for at most [`DEADLINE`].
    pub fn wait_for_trace(&mut self, what: &str, ready: impl Fn(&Trace) -> bool) -> Trace {
        let deadline = Instant::now() + run_deadline();
        loop {
            if let Some(trace) = self.trace_so_far().filter(&ready) {
                return trace;
            }
            if Instant::now() >= deadline || self.process.try_wait().is_some() {
                self.process.fail(&format!("the trace file never showed {what}"));
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Polls the trace until it names a process `name` (its `process_name` metadata event).
    pub fn wait_for_process_named(&mut self, name: &str) -> Trace {
        self.wait_for_trace(name, |trace| trace.phase("M").any(|event| event["args"]["name"] == name))
    }

    /// Waits until `memtrace serve --listen 127.0.0.1:0` says where it serves; its port.
    pub fn serving_port(&mut self) -> u16 {
        const SERVING: &str = "memtrace: serving http://127.0.0.1:";
        let serving = self.wait_for_stderr(SERVING);
        serving[SERVING.len()..]
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .and_then(|port| port.parse().ok())
            .unwrap_or_else(|| panic!("no port in {serving:?}"))
    }

    /// Closes stdin, waits for memtrace to exit and reads what it wrote.
    pub fn finish(mut self) -> Outcome {
        self.process.close_stdin();
        let status = self.process.wait();
        // The pipes end when every writer (memtrace and the processes it started) is gone.
        self.process.stderr.drain(Instant::now() + DEADLINE);
        let stderr = self.process.stderr_text();
        let read =
            |name: &str| fs::read_to_string(self.dir.path().join(name)).ok().filter(|text| !text.is_empty());
        let summary = read("summary.json").map(|text| {
            serde_json::from_str(&text).unwrap_or_else(|err| {
                panic!("the summary is not JSON ({err}):\n{text}\n--- stderr ---\n{stderr}")
            })
        });
        let trace = read("trace.json").map(|text| {
            parse_trace(&text).unwrap_or_else(|err| {
                panic!("the trace does not load ({err}):\n{text}\n--- stderr ---\n{stderr}")
            })
        });
        Outcome { status, stderr, summary, trace, dir: self.dir }
    }
}

/// What a finished memtrace run left behind.
pub struct Outcome {
    pub status: ExitStatus,
    pub stderr: String,
    /// The parsed summary, when memtrace wrote one.
    pub summary: Option<Value>,
    /// The parsed trace, when memtrace wrote one.
    pub trace: Option<Trace>,
    dir: TempDir,
}

impl Outcome {
    /// Asserts memtrace's exit status.
    pub fn assert_exit_code(&self, expected: i32) {
        assert_eq!(
            self.status.code(),
            Some(expected),
            "memtrace exited with {}, expected {expected}; stderr:\n{}",
            self.status,
            self.stderr
        );
    }

    /// Asserts that stderr contains every one of `needles`.
    pub fn assert_stderr_mentions(&self, needles: &[&str]) {
        for needle in needles {
            assert!(self.stderr.contains(needle), "stderr does not mention {needle:?}:\n{}", self.stderr);
        }
    }

    pub fn summary(&self) -> &Value {
        self.summary.as_ref().unwrap_or_else(|| panic!("memtrace wrote no summary; stderr:\n{}", self.stderr))
    }

    /// The line of stderr that reports a runtime error (`memtrace: error: ...`).
    pub fn error_line(&self) -> &str {
        self.stderr
            .lines()
            .find(|line| line.starts_with("memtrace: error:"))
            .unwrap_or_else(|| panic!("no `memtrace: error:` line on stderr:\n{}", self.stderr))
    }

    /// The run's own directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The trace file as memtrace left it.
    pub fn trace_text(&self) -> String {
        let path = self.dir.path().join("trace.json");
        fs::read_to_string(&path).unwrap_or_else(|err| panic!("reading {}: {err}", path.display()))
    }

    pub fn trace(&self) -> &Trace {
        self.trace.as_ref().unwrap_or_else(|| panic!("memtrace wrote no trace; stderr:\n{}", self.stderr))
    }

    /// The summary's entry for the one process traced.
    pub fn process(&self) -> &Value {
        let processes = self.summary()["processes"]
            .as_array()
            .unwrap_or_else(|| panic!("the summary has no processes: {}", self.summary()));
        assert_eq!(processes.len(), 1, "expected one traced process: {}", self.summary());
        &processes[0]
    }

    /// The summary's entry for the process named `comm`, of a run that traced several.
    pub fn process_named(&self, comm: &str) -> &Value {
        let processes = self.summary()["processes"].as_array().expect("the summary's processes");
        let named = processes.iter().find(|process| process["comm"] == comm);
        named.unwrap_or_else(|| panic!("no process {comm} in the summary: {}", self.summary()))
    }
}

/// A trace file, whole or cut short.
#[derive(Debug, Clone)]
pub struct Trace {
    pub events: Vec<Value>,
    /// Whether the file ends with the closing `]` (a clean end).
    pub closed: bool,
}

impl Trace {
    /// The counter events named `name` ("ph":"C"), in file order.
    pub fn counters(&self, name: &str) -> impl Iterator<Item = &Value> + '_ {
        let name = name.to_owned();
        self.events.iter().filter(move |event| event["ph"] == "C" && event["name"] == name)
    }

    /// The events of one phase ("M", "C", "v", ...).
    pub fn phase(&self, ph: &str) -> impl Iterator<Item = &Value> + '_ {
        let ph = ph.to_owned();
        self.events.iter().filter(move |event| event["ph"] == ph)
    }
}

/// Parses a Chrome trace in JSON Array Format, accepting a file cut short as the format allows: the
/// closing `]` may be missing, and so may anything after the last complete event's comma.
pub fn parse_trace(text: &str) -> serde_json::Result<Trace> {
    let body = text.trim_end();
    let closed = body.ends_with(']');
    let events = if closed {
        serde_json::from_str(body)?
    } else {
        serde_json::from_str(&format!("{}]", body.trim_end_matches(',')))?
    };
    Ok(Trace { events, closed })
}

/// fixtures/leaks.c: 5 x malloc(1000) and 3 x calloc(4, 64) never freed; 20 x malloc(333) each
/// freed at once. The peak is the final live total (the 333-byte temporaries come and go while
/// only the 5000 bytes are live).
pub const LEAKS: Figures = Figures {
    allocations: 5 + 3 + 20,
    frees: 20,
    allocated_bytes: 5000 + 768 + 20 * 333,
    freed_bytes: 20 * 333,
    live_allocations: 8,
    live_bytes: 5768,
    peak_live_bytes: Some(5768),
    untracked_frees: 0,
    failed_allocations: 0,
};

/// A process's figures in the summary, as the accounting semantics define them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Figures {
    pub allocations: u64,
    pub frees: u64,
    pub allocated_bytes: u64,
    pub freed_bytes: u64,
    pub live_allocations: i64,
    pub live_bytes: i64,
    /// None where the peak depends on scheduling (threads), and is not compared.
    pub peak_live_bytes: Option<i64>,
    pub untracked_frees: u64,
    pub failed_allocations: u64,
}

impl Figures {
    fn of(process: &Value, with_peak: bool) -> Self {
        let unsigned = |field: &str| {
            process[field]
                .as_u64()
                .unwrap_or_else(|| panic!("summary field {field} is not a count: {process}"))
        };
        let signed = |field: &str| {
            process[field]
                .as_i64()
                .unwrap_or_else(|| panic!("summary field {field} is not an integer: {process}"))
        };
        Self {
            allocations: unsigned("allocations"),
            frees: unsigned("frees"),
            allocated_bytes: unsigned("allocated_bytes"),
            freed_bytes: unsigned("freed_bytes"),
            live_allocations: signed("live_allocations"),
            live_bytes: signed("live_bytes"),
            peak_live_bytes: with_peak.then(|| signed("peak_live_bytes")),
            untracked_frees: unsigned("untracked_frees"),
            failed_allocations: unsigned("failed_allocations"),
        }
    }
}

/// Asserts the figures of the one traced process exactly, and that nothing was lost.
pub fn assert_figures(outcome: &Outcome, expected: Figures) {
    // memtrace's stderr says why events were lost.
    let stderr = format!("\n--- memtrace's stderr ---\n{}", outcome.stderr);
    check_process_figures(outcome.process(), expected, &stderr);
    assert_eq!(outcome.summary()["lost_events"], 0, "the run lost events: {:#}{stderr}", outcome.summary());
}

/// A process's figures in the summary, its peak included.
pub fn figures_of(process: &Value) -> Figures {
    Figures::of(process, true)
}

/// Compares one process entry of a summary with the fixture's figures, exactly, and asserts that
/// it lost nothing.
pub fn assert_figures_of(process: &Value, expected: Figures) {
    check_process_figures(process, expected, "");
}

/// `assert_figures_of`, with `context` added to each failure's message.
fn check_process_figures(process: &Value, expected: Figures, context: &str) {
    let actual = Figures::of(process, expected.peak_live_bytes.is_some());
    assert_eq!(
        actual, expected,
        "summary figures (left: memtrace, right: the fixture's source)\nsummary: {process:#}{context}"
    );
    assert_eq!(process["lost_events"], 0, "the process lost events: {process:#}{context}");
}

/// Runs `memtrace -- <fixture>` to its end and asserts that the fixture exited with 0 (its own
/// checks of glibc's behaviour passed) and that the summary holds exactly `expected`.
pub fn assert_fixture_figures(name: &str, expected: Figures) -> Outcome {
    let outcome = Memtrace::new().command(&fixture(name)).run();
    outcome.assert_exit_code(0);
    assert_figures(&outcome, expected);
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_cut_short_still_parse() {
        let whole = "[\n{\"ph\":\"M\"},\n{\"ph\":\"C\"}\n]\n";
        let trace = parse_trace(whole).unwrap();
        assert!(trace.closed);
        assert_eq!(trace.events.len(), 2);

        let cut = parse_trace("[\n{\"ph\":\"M\"},\n{\"ph\":\"C\"}").unwrap();
        assert!(!cut.closed);
        assert_eq!(cut.events.len(), 2);
        assert_eq!(parse_trace("[\n{\"ph\":\"M\"},\n").unwrap().events.len(), 1);
        assert!(parse_trace("[").unwrap().events.is_empty());
        assert!(parse_trace("[\n{\"ph\":\"M\"},\n{\"ph\"").is_err());
    }
}
