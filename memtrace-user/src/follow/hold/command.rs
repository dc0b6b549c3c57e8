//! The launched command's own exec, held: memtrace forks the child, which waits on a pipe until
//! every probe is in place and only then execs the command, so that it is traced from its first
//! instruction (the execs of the processes it starts are held from BPF, see `super`).

use std::{
    ffi::{CString, OsStr, OsString},
    fs::File,
    io::{Read, Write},
    os::{fd::AsRawFd, unix::ffi::OsStrExt},
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use nix::{
    fcntl::OFlag,
    sys::wait::waitpid,
    unistd::{access, fork, pipe2, AccessFlags, ForkResult, Pid},
};

/// Finds the program a command names, as a shell would: a path if it has a slash, else via PATH.
pub fn resolve_program(name: &OsStr) -> Result<PathBuf> {
    let path = Path::new(name);
    if name.as_bytes().contains(&b'/') {
        if !path.is_file() {
            bail!("cannot run {}: no such file", path.display());
        }
        if access(path, AccessFlags::X_OK).is_err() {
            bail!("cannot run {}: it is not executable (chmod +x?)", path.display());
        }
        return Ok(path.to_owned());
    }
    let search = std::env::var_os("PATH").unwrap_or_else(|| OsString::from("/usr/bin:/bin"));
    std::env::split_paths(&search)
        .map(|dir| dir.join(path))
        .find(|candidate| candidate.is_file() && access(candidate.as_path(), AccessFlags::X_OK).is_ok())
        .with_context(|| format!("command not found: {} (it is in no directory of PATH)", path.display()))
}

/// A child forked to run the command, waiting for `release` before it execs, so that every probe is
/// in place before the command's first instruction.
pub struct HeldCommand {
    pub pid: u32,
    go: File,
    exec_error: File,
}

impl HeldCommand {
    pub fn spawn(program: &Path, command: &[OsString]) -> Result<Self> {
        let program =
            CString::new(program.as_os_str().as_bytes()).context("the command contains a NUL byte")?;
        let argv = command
            .iter()
            .map(|arg| CString::new(arg.as_bytes()))
            .collect::<Result<Vec<_>, _>>()
            .context("an argument of the command contains a NUL byte")?;
        let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|arg| arg.as_ptr()).collect();
        argv_ptrs.push(std::ptr::null());
        let (go_read, go_write) = pipe2(OFlag::O_CLOEXEC)?;
        let (error_read, error_write) = pipe2(OFlag::O_CLOEXEC)?;
        // SAFETY: memtrace is single-threaded here, and the child calls only async-signal-safe
        // functions (sigprocmask, read, execv, write, _exit) on memory prepared before the fork.
        match unsafe { fork() }.context("forking to run the command")? {
            ForkResult::Child => unsafe {
                let unblocked: libc::sigset_t = std::mem::zeroed();
                libc::sigprocmask(libc::SIG_SETMASK, &unblocked, std::ptr::null_mut());
                let mut go = 0u8;
                // The child's own copy of the write end would keep the pipe open forever.
                libc::close(go_write.as_raw_fd());
                // End of file: memtrace failed before attaching; never run the command untraced.
                if libc::read(go_read.as_raw_fd(), (&raw mut go).cast(), 1) == 1 {
                    libc::execv(program.as_ptr(), argv_ptrs.as_ptr());
                    let errno = *libc::__errno_location();
                    libc::write(error_write.as_raw_fd(), (&raw const errno).cast(), size_of::<i32>());
                }
                libc::_exit(127)
            },
            ForkResult::Parent { child } => Ok(Self {
                pid: child.as_raw() as u32,
                go: File::from(go_write),
                exec_error: File::from(error_read),
            }),
        }
    }

    /// Lets the child exec the command; fails if the exec did.
    pub fn release(mut self) -> Result<()> {
        self.go.write_all(b"g").context("releasing the command")?;
        let mut errno = [0u8; 4];
        // The error pipe closes on a successful exec (O_CLOEXEC) and carries errno otherwise.
        match self.exec_error.read(&mut errno)? {
            0 => Ok(()),
            _ => {
                let _ = waitpid(Pid::from_raw(self.pid as i32), None);
                bail!(
                    "cannot run the command: {}",
                    std::io::Error::from_raw_os_error(i32::from_ne_bytes(errno))
                )
            }
        }
    }
}
