//! Holding an exec until its new program is probed: fanotify's FAN_OPEN_EXEC_PERM stops a process
//! inside execve(2), before the point of no return, with the program's file open in memtrace's
//! hand, until memtrace answers. [`ExecHold`] marks filesystems, hands each held exec of a wanted
//! process to a `serve` callback ([`HeldExec`]: the pid and the file) on a thread of its own, and
//! always allows the exec: when serve returns, or when a bound passes, whichever comes first.
//!
//! What is held: every open for exec on the marked filesystems, each its own event, one after the
//! other: the program, then (once the first is answered) its ELF interpreter, or a script's
//! interpreter. While it is held the process still runs its old image (/proc/PID/exe and maps are
//! the old program's) and keeps its pid across the exec, so probes attached to the file for that
//! pid during serve are in place for the new program's first instruction. The process sleeps in
//! the kernel (killable, no signal, no stop): neither it nor a parent waiting with
//! waitpid(WUNTRACED) sees anything but the time taken.
//!
//! It never stalls the host: every event is answered FAN_ALLOW (never FAN_DENY), at once for
//! memtrace's own execs and those of processes `wanted` refuses (`wanted` runs on the listener
//! thread and must be quick), and otherwise when serve returns or at the bound, whichever is first;
//! those allowed at the bound are counted as missed ([`HoldStats`]), and so is an exec that waited
//! for serve past its bound behind slower ones (serve is not called for it). A panicking `wanted`
//! ends the hold (everything is allowed); after a panicking `serve`, execs are allowed at once and
//! counted as missed.
//!
//! Stopping: while memtrace is stopped (SIGTSTP, SIGSTOP, a debugger) its threads cannot answer,
//! and every exec on the marked filesystems would wait for it. The caller must release the hold
//! ([`ExecHold::release`]) before memtrace stops: catch SIGTSTP (and SIGTTIN/SIGTTOU), release,
//! then stop with SIGSTOP, and start a new hold after SIGCONT. SIGSTOP itself cannot be caught: a
//! memtrace stopped that way holds the host's execs (which stay killable) until it is continued.
//! Release removes the marks before it answers what is pending and closes the group, because a
//! child memtrace forked and that has not exec'd yet holds a copy of the group's descriptor.
//!
//! The kernel opens the exec'd file in memtrace for each event and refuses the exec (EPERM) when it
//! cannot (memtrace out of descriptors): [`ExecHold::start`] raises the soft descriptor limit, and
//! such refusals are counted. Without CAP_SYS_ADMIN, start fails with [`Unavailable`], whose message
//! says what is missed without the hold.

use std::{
    collections::BTreeMap,
    fmt,
    fs::File,
    io::{self, PipeReader, PipeWriter, Read, Write},
    os::fd::{AsFd, AsRawFd},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc, Arc,
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use nix::{
    errno::Errno,
    poll::{poll, PollFd, PollFlags, PollTimeout},
    sys::fanotify::{
        EventFFlags, Fanotify, FanotifyEvent, FanotifyResponse, InitFlags, MarkFlags, MaskFlags, Response,
    },
};

/// The bound the issue asks for: an exec is held at most this long.
pub const DEFAULT_BOUND: Duration = Duration::from_millis(500);

/// What is missed when execs cannot be held (the end of [`Unavailable`]'s message).
pub const MISSED_WITHOUT_HOLD: &str =
    "execs of static programs and of programs with a private allocator are \
     probed after their first instructions (their first allocations are missed)";

/// One held exec, handed to serve: the process is inside execve(2) until serve returns.
#[derive(Debug)]
pub struct HeldExec {
    /// The process doing the exec (its thread group id, which the exec keeps).
    pub pid: u32,
    /// The file being exec'd, opened read-only by the kernel for memtrace (a copy of the event's
    /// descriptor: serve may keep it after it returns).
    pub file: File,
}

impl HeldExec {
    /// The file's path as memtrace's file system names it, for messages (the descriptor's path
    /// when the kernel cannot say).
    pub fn path(&self) -> PathBuf {
        let link = PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()));
        std::fs::read_link(&link).unwrap_or(link)
    }
}

/// What the hold did so far, so that misses can be reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HoldStats {
    /// Execs of wanted processes held for serve.
    pub held: u64,
    /// Of those, allowed when serve returned.
    pub served: u64,
    /// Of those, allowed without serve having returned: at the bound, behind a slow serve, or at
    /// release. Their programs are probed after their first instructions, if at all.
    pub missed: u64,
    /// Execs allowed at once: memtrace's own and those of processes not wanted.
    pub not_wanted: u64,
    /// Times the kernel's event queue overflowed: execs then went through unheld and unseen.
    pub overflows: u64,
    /// Execs the kernel refused because it could not open their file for memtrace (descriptors).
    pub refused_by_kernel: u64,
    /// The listener stopped on an error of its own before release (everything is allowed since).
    pub failed: bool,
}

/// Why execs cannot be held; the message ends with what is missed ([`MISSED_WITHOUT_HOLD`]).
#[derive(Debug)]
pub enum Unavailable {
    /// fanotify_init refused permission events: memtrace lacks CAP_SYS_ADMIN.
    NotPermitted,
    /// The kernel has no fanotify permission events (CONFIG_FANOTIFY_ACCESS_PERMISSIONS).
    Unsupported(Errno),
    /// A filesystem could not be marked.
    Mark { path: PathBuf, errno: Errno },
    /// The hold's threads or pipes could not be made.
    Resources(io::Error),
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotPermitted => {
                write!(f, "holding execs needs CAP_SYS_ADMIN (fanotify permission events)")?
            }
            Self::Unsupported(errno) => {
                write!(f, "this kernel cannot hold execs (fanotify permission events: {errno})")?
            }
            Self::Mark { path, errno } => write!(f, "cannot watch execs on {}: {errno}", path.display())?,
            Self::Resources(error) => write!(f, "cannot start the exec hold: {error}")?,
        }
        write!(f, "; {MISSED_WITHOUT_HOLD}")
    }
}

impl std::error::Error for Unavailable {}

/// A fanotify exec hold: the group, its listener thread and its serve thread. Dropping it (or
/// [`ExecHold::release`]) lets go of every exec.
pub struct ExecHold {
    /// Written to stop the listener.
    stop: Option<PipeWriter>,
    listener: Option<JoinHandle<()>>,
    counters: Arc<Counters>,
}

impl ExecHold {
    /// Marks the filesystems holding `paths` (each path's whole filesystem, or its mount where the
    /// filesystem cannot be marked) and starts holding execs there. `wanted(pid)` decides, on the
    /// listener thread, whether an exec is held; `serve` is called on a thread of its own for each
    /// held exec, which is allowed when serve returns or after `bound`, whichever is first.
    pub fn start<W, S>(
        paths: &[impl AsRef<Path>],
        wanted: W,
        serve: S,
        bound: Duration,
    ) -> Result<Self, Unavailable>
    where
        W: FnMut(u32) -> bool + Send + 'static,
        S: FnMut(HeldExec) + Send + 'static,
    {
        crate::process::raise_open_file_limit();
        let (stop_rx, stop) = io::pipe().map_err(Unavailable::Resources)?;
        let (wake_rx, wake) = io::pipe().map_err(Unavailable::Resources)?;
        let (jobs, jobs_rx) = mpsc::channel();
        let (done, done_rx) = mpsc::channel();
        thread::Builder::new()
            .name("exec-hold-serve".into())
            .spawn(move || serve_jobs(jobs_rx, done, wake, serve))
            .map_err(Unavailable::Resources)?;
        let init = InitFlags::FAN_CLASS_CONTENT | InitFlags::FAN_CLOEXEC | InitFlags::FAN_NONBLOCK;
        let files = EventFFlags::O_RDONLY | EventFFlags::O_CLOEXEC | EventFFlags::O_LARGEFILE;
        let fanotify = Fanotify::init(init, files).map_err(|errno| match errno {
            Errno::EPERM => Unavailable::NotPermitted,
            errno => Unavailable::Unsupported(errno),
        })?;
        let counters = Arc::new(Counters::default());
        // From here on, dropping the listener (on an error, too) lets go of the marks.
        let listener = Listener {
            fanotify,
            stop: stop_rx,
            wake: Some(wake_rx),
            done: done_rx,
            jobs,
            pending: BTreeMap::new(),
            next_id: 0,
            wanted,
            own_pid: std::process::id(),
            bound,
            counters: Arc::clone(&counters),
        };
        for path in paths {
            mark(&listener.fanotify, path.as_ref())?;
        }
        let listener = thread::Builder::new()
            .name("exec-hold".into())
            .spawn(move || listener.run())
            .map_err(Unavailable::Resources)?;
        Ok(Self { stop: Some(stop), listener: Some(listener), counters })
    }

    /// Lets go of every exec: removes the marks, allows what is pending (counted as missed) and
    /// closes the group; returns once the listener has stopped. It does not wait for a serve call
    /// in progress (which may be waiting for the caller); that call's exec is already allowed and
    /// no later one is served. Call it before memtrace stops (SIGTSTP). Idempotent.
    pub fn release(&mut self) {
        // A byte, not a hang-up: a child forked meanwhile keeps a copy of the pipe until it execs.
        if let Some(mut stop) = self.stop.take() {
            let _ = stop.write_all(&[1]);
        }
        if let Some(listener) = self.listener.take() {
            // A panic in `wanted` ended the listener, and unwinding released the group already.
            let _ = listener.join();
        }
    }

    /// What the hold did so far (and after release, what it did in all).
    pub fn stats(&self) -> HoldStats {
        self.counters.snapshot()
    }
}

impl Drop for ExecHold {
    fn drop(&mut self) {
        self.release();
    }
}

/// Marks `path`'s filesystem for exec permission events, or its mount where the filesystem
/// cannot be marked (e.g. a btrfs subvolume, or a filesystem without an fsid).
fn mark(fanotify: &Fanotify, path: &Path) -> Result<(), Unavailable> {
    let mask = MaskFlags::FAN_OPEN_EXEC_PERM;
    let add = MarkFlags::FAN_MARK_ADD;
    fanotify
        .mark(add | MarkFlags::FAN_MARK_FILESYSTEM, mask, None, Some(path))
        .or_else(|_| fanotify.mark(add | MarkFlags::FAN_MARK_MOUNT, mask, None, Some(path)))
        .map_err(|errno| Unavailable::Mark { path: path.to_path_buf(), errno })
}

#[derive(Default)]
struct Counters {
    held: AtomicU64,
    served: AtomicU64,
    missed: AtomicU64,
    not_wanted: AtomicU64,
    overflows: AtomicU64,
    refused_by_kernel: AtomicU64,
    failed: AtomicBool,
}

impl Counters {
    fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> HoldStats {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        HoldStats {
            held: get(&self.held),
            served: get(&self.served),
            missed: get(&self.missed),
            not_wanted: get(&self.not_wanted),
            overflows: get(&self.overflows),
            refused_by_kernel: get(&self.refused_by_kernel),
            failed: self.failed.load(Ordering::Relaxed),
        }
    }
}

/// A held exec on its way to serve; its id comes back on the done channel when serve returns.
struct Job {
    id: u64,
    deadline: Instant,
    exec: HeldExec,
}

/// Calls serve for each job still held, and reports each served job's id (then wakes the
/// listener). Ends when the listener drops the job channel.
fn serve_jobs(
    jobs: mpsc::Receiver<Job>,
    done: mpsc::Sender<u64>,
    mut wake: PipeWriter,
    mut serve: impl FnMut(HeldExec),
) {
    for job in jobs {
        if Instant::now() >= job.deadline {
            continue; // allowed at the bound already, and counted as missed
        }
        serve(job.exec);
        if done.send(job.id).is_err() || wake.write_all(&[1]).is_err() {
            return;
        }
    }
}

/// An exec held for serve: the event (whose descriptor the answer names) and when to let it go.
struct Pending {
    event: FanotifyEvent,
    deadline: Instant,
}

/// The listener thread's state: it alone reads and answers the group.
struct Listener<W> {
    fanotify: Fanotify,
    /// Readable when the hold is released.
    stop: PipeReader,
    /// Readable when serve has returned for a job; None once the serve thread has ended (and no
    /// forked child holds a copy of its end).
    wake: Option<PipeReader>,
    done: mpsc::Receiver<u64>,
    jobs: mpsc::Sender<Job>,
    /// Ids are handed out in the order of deadlines, so the first is the next to expire.
    pending: BTreeMap<u64, Pending>,
    next_id: u64,
    wanted: W,
    own_pid: u32,
    bound: Duration,
    counters: Arc<Counters>,
}

/// Which of the listener's descriptors poll found ready.
struct Ready {
    events: bool,
    stop: bool,
    wake: bool,
}

impl<W: FnMut(u32) -> bool> Listener<W> {
    fn run(mut self) {
        loop {
            let ready = match self.wait() {
                Ok(ready) => ready,
                Err(Errno::EINTR) => continue,
                Err(_) => break self.counters.failed.store(true, Ordering::Relaxed),
            };
            if ready.stop {
                break;
            }
            if ready.wake {
                self.take_done();
            }
            if ready.events && self.read_events().is_err() {
                break self.counters.failed.store(true, Ordering::Relaxed);
            }
            self.expire(Instant::now());
        }
        // Drop lets go of the marks and of what is pending.
    }

    /// Polls the group, the stop pipe and the wake pipe until one is ready or the first pending
    /// exec's bound passes.
    fn wait(&self) -> Result<Ready, Errno> {
        let timeout = match self.pending.first_key_value() {
            Some((_, first)) => milliseconds_until(first.deadline),
            None => PollTimeout::NONE,
        };
        let mut fds = vec![
            PollFd::new(self.fanotify.as_fd(), PollFlags::POLLIN),
            PollFd::new(self.stop.as_fd(), PollFlags::POLLIN),
        ];
        if let Some(wake) = &self.wake {
            fds.push(PollFd::new(wake.as_fd(), PollFlags::POLLIN));
        }
        poll(&mut fds, timeout)?;
        let ready = |i: usize| fds.get(i).and_then(|fd| fd.revents()).is_some_and(|r| !r.is_empty());
        Ok(Ready { events: ready(0), stop: ready(1), wake: ready(2) })
    }

    /// Takes one read's worth of events (the kernel's queue is drained over several wakes).
    fn read_events(&mut self) -> Result<(), Errno> {
        match self.fanotify.read_events() {
            Ok(events) => events.into_iter().try_for_each(|event| self.take(event)),
            Err(Errno::EAGAIN | Errno::EINTR) => Ok(()),
            // The kernel could not open the file for memtrace, and refused that exec.
            Err(Errno::EMFILE | Errno::ENFILE | Errno::ENOMEM) => {
                Counters::add(&self.counters.refused_by_kernel);
                Ok(())
            }
            Err(errno) => Err(errno),
        }
    }

    /// Answers an event at once, or hands it to serve and keeps it pending until the bound.
    fn take(&mut self, event: FanotifyEvent) -> Result<(), Errno> {
        if !event.check_version() {
            return Err(Errno::EPROTO);
        }
        let Some(fd) = event.fd() else {
            Counters::add(&self.counters.overflows);
            return Ok(());
        };
        let pid = u32::try_from(event.pid()).unwrap_or(0); // 0: outside memtrace's pid namespace
        if pid == 0 || pid == self.own_pid || !(self.wanted)(pid) {
            self.allow(&event);
            Counters::add(&self.counters.not_wanted);
            return Ok(());
        }
        Counters::add(&self.counters.held);
        let deadline = Instant::now() + self.bound;
        let id = self.next_id;
        self.next_id += 1;
        let job = fd.try_clone_to_owned().map(|file| Job {
            id,
            deadline,
            exec: HeldExec { pid, file: file.into() },
        });
        // Without a copy of the file, or once the serve thread has ended, it is missed at once.
        if !job.is_ok_and(|job| self.jobs.send(job).is_ok()) {
            self.allow(&event);
            Counters::add(&self.counters.missed);
            return Ok(());
        }
        self.pending.insert(id, Pending { event, deadline });
        Ok(())
    }

    /// Allows the execs whose serve has returned.
    fn take_done(&mut self) {
        let mut buffer = [0u8; 256];
        if let Some(wake) = &mut self.wake {
            if matches!(wake.read(&mut buffer), Ok(0)) {
                self.wake = None; // the serve thread has ended (serve panicked)
            }
        }
        while let Ok(id) = self.done.try_recv() {
            if let Some(pending) = self.pending.remove(&id) {
                self.allow(&pending.event);
                Counters::add(&self.counters.served);
            }
        }
    }

    /// Allows the execs whose bound has passed.
    fn expire(&mut self, now: Instant) {
        while let Some(first) = self.pending.first_entry() {
            if first.get().deadline > now {
                break;
            }
            let pending = first.remove();
            self.allow(&pending.event);
            Counters::add(&self.counters.missed);
        }
    }

    fn allow(&self, event: &FanotifyEvent) {
        if let Some(fd) = event.fd() {
            // ENOENT: the process was killed while held, and the kernel dropped the event.
            let _ = self.fanotify.write_response(FanotifyResponse::new(fd, Response::FAN_ALLOW));
        }
    }
}

impl<W> Drop for Listener<W> {
    /// Removes the marks first (a forked child that has not exec'd yet keeps the group open after
    /// memtrace closes it), then allows everything pending and everything queued, then closes.
    fn drop(&mut self) {
        let mask = MaskFlags::FAN_OPEN_EXEC_PERM;
        for kind in [MarkFlags::FAN_MARK_FILESYSTEM, MarkFlags::FAN_MARK_MOUNT, MarkFlags::FAN_MARK_INODE] {
            let _ = self.fanotify.mark::<Path>(MarkFlags::FAN_MARK_FLUSH | kind, mask, None, None);
        }
        let answer = |event: &FanotifyEvent| {
            if let Some(fd) = event.fd() {
                let _ = self.fanotify.write_response(FanotifyResponse::new(fd, Response::FAN_ALLOW));
            }
        };
        for pending in std::mem::take(&mut self.pending).into_values() {
            answer(&pending.event);
            Counters::add(&self.counters.missed);
        }
        while let Ok(events) = self.fanotify.read_events() {
            if events.is_empty() {
                break;
            }
            events.iter().for_each(answer);
        }
    }
}

/// poll's timeout until `deadline`, rounded up to a whole millisecond so poll does not wake early.
fn milliseconds_until(deadline: Instant) -> PollTimeout {
    let left = deadline.saturating_duration_since(Instant::now());
    let milliseconds = left.as_micros().div_ceil(1000);
    PollTimeout::try_from(milliseconds).unwrap_or(PollTimeout::MAX)
}

#[cfg(test)]
mod tests {
    //! Held for real, as root, on this machine's root filesystem; the children exec /bin/true
    //! (dynamic: each exec is two held opens, the program and then its ELF interpreter).

    use std::{
        ffi::{c_void, CStr},
        os::{fd::OwnedFd, unix::fs::MetadataExt},
        sync::atomic::AtomicU32,
    };

    use nix::{
        fcntl::OFlag,
        sys::{
            signal::{kill, Signal},
            wait::{waitpid, WaitPidFlag, WaitStatus},
        },
        unistd::{fork, pipe2, ForkResult, Pid},
    };
    use object::read::elf::{ElfFile64, ProgramHeader};

    use super::*;
    use crate::process::FileId;

    const TRUE: &CStr = c"/bin/true";
    /// A safety net against a hang, never reached when the hold works: a child still held after
    /// this is killed (it would hold a copy of the group) and the test fails.
    const STUCK: Duration = Duration::from_secs(60);
    /// A bound long enough that only serve returning answers an exec.
    const LONG: Duration = Duration::from_secs(60);

    /// A child forked to exec /bin/true when the test says so, so the hold can want its pid first.
    struct Child {
        pid: u32,
        go: OwnedFd,
        exit: mpsc::Receiver<WaitStatus>,
    }

    impl Child {
        fn fork() -> Self {
            let (ready, go) = pipe2(OFlag::O_CLOEXEC).unwrap();
            let argv = [TRUE.as_ptr(), std::ptr::null()];
            // SAFETY: the child calls only async-signal-safe functions (read, execv, _exit) on
            // memory made before the fork.
            match unsafe { fork() }.unwrap() {
                ForkResult::Child => unsafe {
                    let mut byte = 0u8;
                    libc::read(ready.as_raw_fd(), (&mut byte as *mut u8).cast::<c_void>(), 1);
                    libc::execv(TRUE.as_ptr(), argv.as_ptr());
                    libc::_exit(127)
                },
                ForkResult::Parent { child } => {
                    // Waits from now on with WUNTRACED: the first change it sees is the one reported.
                    let (tx, exit) = mpsc::channel();
                    thread::spawn(move || tx.send(waitpid(child, Some(WaitPidFlag::WUNTRACED)).unwrap()));
                    Self { pid: child.as_raw() as u32, go, exit }
                }
            }
        }

        fn exec(&self) {
            nix::unistd::write(&self.go, &[1]).unwrap();
        }

        /// The first change of state its parent saw (an exit, if nothing stopped it).
        fn first_change(&self) -> WaitStatus {
            self.exit.recv_timeout(STUCK).unwrap_or_else(|_| {
                let _ = kill(self.nix_pid(), Signal::SIGKILL);
                panic!("child {} still held after {STUCK:?}", self.pid)
            })
        }

        fn nix_pid(&self) -> Pid {
            Pid::from_raw(self.pid as i32)
        }
    }

    /// A hold on the root filesystem wanting only the pid in `target`.
    fn hold(
        target: &Arc<AtomicU32>,
        serve: impl FnMut(HeldExec) + Send + 'static,
        bound: Duration,
    ) -> ExecHold {
        let target = Arc::clone(target);
        let wanted = move |pid| pid == target.load(Ordering::Relaxed);
        ExecHold::start(&["/", "/usr/bin"], wanted, serve, bound).expect("memtrace's tests run as root")
    }

    fn identity(path: &Path) -> FileId {
        FileId::of_path(path).unwrap()
    }

    /// The held file's identity (the same file whatever path names it, as uprobes see it).
    fn file_id(exec: &HeldExec) -> FileId {
        let metadata = exec.file.metadata().unwrap();
        FileId { dev: metadata.dev(), ino: metadata.ino() }
    }

    /// The ELF interpreter /bin/true names (PT_INTERP).
    fn interpreter_of_true() -> PathBuf {
        let data = std::fs::read("/bin/true").unwrap();
        let elf = ElfFile64::<object::Endianness>::parse(&*data).unwrap();
        let endian = elf.endian();
        let interpreter =
            elf.elf_program_headers().iter().find_map(|header| header.interpreter(endian, &*data).unwrap());
        PathBuf::from(std::str::from_utf8(interpreter.expect("/bin/true is dynamic")).unwrap())
    }

    #[test]
    fn exec_is_held_with_its_file_before_the_new_program_runs() {
        let target = Arc::new(AtomicU32::new(0));
        let (seen, served) = mpsc::channel();
        let serve = move |exec: HeldExec| {
            let running = std::fs::read_link(format!("/proc/{}/exe", exec.pid)).unwrap();
            seen.send((exec.pid, file_id(&exec), running)).unwrap();
        };
        let mut hold = hold(&target, serve, LONG);
        let child = Child::fork();
        target.store(child.pid, Ordering::Relaxed);
        child.exec();
        assert_eq!(child.first_change(), WaitStatus::Exited(child.nix_pid(), 0));
        hold.release();
        let served: Vec<_> = served.try_iter().collect();
        let files: Vec<_> = served.iter().map(|(pid, file, _)| (*pid, *file)).collect();
        let expected =
            [(child.pid, identity(Path::new("/bin/true"))), (child.pid, identity(&interpreter_of_true()))];
        assert_eq!(files, expected);
        // Held before the exec's point of no return: the child still ran this test program.
        let this_program = std::fs::read_link("/proc/self/exe").unwrap();
        assert!(served.iter().all(|(_, _, running)| *running == this_program), "{served:?}");
        let stats = hold.stats();
        assert_eq!((stats.held, stats.served, stats.missed, stats.failed), (2, 2, 0, false));
    }

    #[test]
    fn a_serve_slower_than_the_bound_does_not_hold_the_exec_and_counts_as_missed() {
        let target = Arc::new(AtomicU32::new(0));
        let (let_go, slow) = mpsc::channel::<()>();
        let serve = move |_: HeldExec| {
            let _ = slow.recv(); // returns once the test has seen the exit
        };
        let mut hold = hold(&target, serve, Duration::from_millis(100));
        let child = Child::fork();
        target.store(child.pid, Ordering::Relaxed);
        child.exec();
        assert_eq!(child.first_change(), WaitStatus::Exited(child.nix_pid(), 0));
        // Returns with serve still blocked: release never waits for serve.
        hold.release();
        drop(let_go);
        let stats = hold.stats();
        // The program at its bound; its interpreter at its own, queued behind the blocked serve.
        assert_eq!((stats.held, stats.served, stats.missed), (2, 0, 2));
    }

    #[test]
    fn execs_of_processes_not_wanted_are_allowed_at_once_and_not_served() {
        let (asked, asked_about) = mpsc::channel();
        let wanted = move |pid| {
            let _ = asked.send(pid);
            false
        };
        let (seen, served) = mpsc::channel();
        let serve = move |exec: HeldExec| seen.send(exec.pid).unwrap();
        let mut hold = ExecHold::start(&["/"], wanted, serve, LONG).unwrap();
        let child = Child::fork();
        child.exec();
        assert_eq!(child.first_change(), WaitStatus::Exited(child.nix_pid(), 0));
        hold.release();
        assert!(asked_about.try_iter().any(|pid| pid == child.pid), "wanted was not asked about the child");
        assert_eq!(served.try_iter().count(), 0);
        let stats = hold.stats();
        assert_eq!(stats.held, 0);
        assert!(stats.not_wanted >= 2, "{stats:?}");
    }

    #[test]
    fn after_release_execs_are_not_held_even_by_a_child_forked_during_the_hold() {
        let target = Arc::new(AtomicU32::new(0));
        let (seen, served) = mpsc::channel();
        let serve = move |exec: HeldExec| seen.send(exec.pid).unwrap();
        let mut hold = hold(&target, serve, LONG);
        // Forked while the hold exists: the child holds a copy of the group until it execs.
        let child = Child::fork();
        target.store(child.pid, Ordering::Relaxed);
        hold.release();
        child.exec();
        assert_eq!(child.first_change(), WaitStatus::Exited(child.nix_pid(), 0));
        assert_eq!(served.try_iter().count(), 0);
        assert_eq!(hold.stats().held, 0);
    }

    #[test]
    fn a_parent_waiting_with_wuntraced_sees_no_stop_while_the_exec_is_held() {
        let target = Arc::new(AtomicU32::new(0));
        let (held, held_now) = mpsc::channel();
        let (let_go, go) = mpsc::channel::<()>();
        let serve = move |exec: HeldExec| {
            let _ = held.send(exec.pid);
            let _ = go.recv();
        };
        let mut hold = hold(&target, serve, LONG);
        let child = Child::fork();
        target.store(child.pid, Ordering::Relaxed);
        child.exec();
        assert_eq!(held_now.recv().unwrap(), child.pid);
        // Held now: no change of state for the parent, and the child is not stopped.
        let now = waitpid(child.nix_pid(), Some(WaitPidFlag::WUNTRACED | WaitPidFlag::WNOHANG)).unwrap();
        assert_eq!(now, WaitStatus::StillAlive);
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", child.pid)).unwrap();
        let state = stat.rsplit(") ").next().unwrap().chars().next().unwrap();
        assert!(state != 't' && state != 'T', "child state {state}");
        drop(let_go);
        assert_eq!(child.first_change(), WaitStatus::Exited(child.nix_pid(), 0));
        hold.release();
        assert_eq!(hold.stats().served, 2);
    }

    /// Drops CAP_SYS_ADMIN from the calling thread's effective set (capabilities are per thread
    /// for the kernel: the test's other threads keep theirs).
    fn drop_sys_admin_in_this_thread() {
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        #[derive(Clone, Copy, Default)]
        struct Sets {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        const VERSION_3: u32 = 0x2008_0522;
        const CAP_SYS_ADMIN: u32 = 21;
        let mut header = Header { version: VERSION_3, pid: 0 };
        let mut sets = [Sets::default(); 2];
        // SAFETY: capget and capset (version 3) read a header and two sets, and capget writes the
        // two sets; both point at live values of the kernel's layout.
        unsafe {
            assert_eq!(libc::syscall(libc::SYS_capget, &mut header, sets.as_mut_ptr()), 0);
            sets[0].effective &= !(1 << CAP_SYS_ADMIN);
            assert_eq!(libc::syscall(libc::SYS_capset, &header, sets.as_ptr()), 0);
        }
    }

    #[test]
    fn without_cap_sys_admin_start_says_what_is_missed() {
        let refused = thread::spawn(|| {
            drop_sys_admin_in_this_thread();
            ExecHold::start(&["/"], |_| true, |_: HeldExec| {}, DEFAULT_BOUND).err()
        });
        let refused = refused.join().unwrap().expect("a hold without CAP_SYS_ADMIN");
        assert!(matches!(refused, Unavailable::NotPermitted), "{refused:?}");
        let message = refused.to_string();
        assert!(message.contains("CAP_SYS_ADMIN") && message.ends_with(MISSED_WITHOUT_HOLD), "{message}");
    }

    #[test]
    fn a_path_that_cannot_be_marked_is_named_and_nothing_stays_held() {
        let missing = Path::new("/nonexistent-memtrace-exec-hold");
        let refused = ExecHold::start(&[Path::new("/"), missing], |_| true, |_: HeldExec| {}, LONG).err();
        let refused = refused.expect("a hold on a path that does not exist");
        assert!(
            matches!(&refused, Unavailable::Mark { path, errno: Errno::ENOENT } if path == missing),
            "{refused:?}"
        );
        assert!(refused
            .to_string()
            .starts_with("cannot watch execs on /nonexistent-memtrace-exec-hold: ENOENT"));
        let child = Child::fork();
        child.exec();
        assert_eq!(child.first_change(), WaitStatus::Exited(child.nix_pid(), 0));
    }

    /// Not a check: what a held exec of /bin/true costs, as a ratio to an exec not held.
    /// `cargo test --release -p memtrace-user fanotify -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn cost_of_a_held_exec() {
        const RUNS: u32 = 300;
        let run = |target: &Arc<AtomicU32>| {
            let start = Instant::now();
            for _ in 0..RUNS {
                let child = Child::fork();
                target.store(child.pid, Ordering::Relaxed);
                child.exec();
                assert_eq!(child.first_change(), WaitStatus::Exited(child.nix_pid(), 0));
            }
            start.elapsed() / RUNS
        };
        let target = Arc::new(AtomicU32::new(0));
        let free = run(&target);
        let mut passing = ExecHold::start(&["/"], |_| false, |_: HeldExec| {}, DEFAULT_BOUND).unwrap();
        let not_wanted = run(&target);
        passing.release();
        let mut hold = hold(&target, |_: HeldExec| {}, DEFAULT_BOUND);
        let held = run(&target);
        hold.release();
        let stats = hold.stats();
        assert_eq!((stats.served, stats.missed), (2 * u64::from(RUNS), 0));
        let ratio = |time: Duration| time.as_secs_f64() / free.as_secs_f64();
        println!(
            "fork+exec+exit of /bin/true: {free:?} free, {not_wanted:?} not wanted ({:.2}x), {held:?} held and served ({:.2}x)",
            ratio(not_wanted),
            ratio(held)
        );
    }
}
