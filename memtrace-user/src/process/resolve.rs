//! Path resolution inside a process's root: the root is a directory descriptor (of /proc/PID/root)
//! and every symlink, absolute or with `..`, is followed as if that directory were `/`.
//!
//! openat2(RESOLVE_IN_ROOT) does this in the kernel (Linux 5.6+). Where it is missing (ENOSYS), or
//! refused by a seccomp filter (EPERM), a walk of our own does the same one component at a time
//! with O_NOFOLLOW, reading each symlink and restarting absolute ones at the root; `..` never climbs
//! above it. Either way the result is an O_PATH descriptor: nothing is opened for reading, so a
//! FIFO or a device is not touched before the caller has looked at what it is. (The test that
//! symlinks stay inside the root is file.rs's, which knows a file's identity.)

use std::{
    collections::VecDeque,
    ffi::{OsStr, OsString},
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Component, Path},
};

use nix::{
    errno::Errno,
    fcntl::{openat2, OFlag, OpenHow, ResolveFlag},
    sys::stat::{fstat, Mode, SFlag},
};

/// The most symlinks one resolution follows, as the kernel's own limit.
const MAX_SYMLINKS: usize = 40;

/// An O_PATH descriptor of `path` resolved inside the directory `root`.
pub fn open_in_root(root: BorrowedFd<'_>, path: &Path) -> io::Result<OwnedFd> {
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    for _ in 0..8 {
        match openat2(root.as_raw_fd(), path, how) {
            // SAFETY: openat2 returned a new descriptor that nothing else owns.
            Ok(fd) => return Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
            // The kernel saw a rename race it could not rule out; trying again is the documented cure.
            Err(Errno::EAGAIN) => continue,
            Err(Errno::ENOSYS | Errno::EPERM) => return walk_in_root(root, path),
            Err(errno) => return Err(errno.into()),
        }
    }
    walk_in_root(root, path)
}

/// An O_PATH descriptor of a path of memtrace's own file system (trusted: symlinks are followed).
pub fn open_on_host(path: &Path) -> io::Result<OwnedFd> {
    let fd = nix::fcntl::open(path, OFlag::O_PATH | OFlag::O_CLOEXEC, Mode::empty())?;
    // SAFETY: open returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// RESOLVE_IN_ROOT done one component at a time.
pub fn walk_in_root(root: BorrowedFd<'_>, path: &Path) -> io::Result<OwnedFd> {
    // The directories below the root down to where the walk is; empty: at the root.
    let mut below: Vec<OwnedFd> = Vec::new();
    let mut pending = components(path);
    let mut symlinks = 0;
    while let Some(name) = pending.pop_front() {
        if name == ".." {
            below.pop();
            continue;
        }
        let here = below.last().map_or(root, |dir| dir.as_fd());
        let fd = nix::fcntl::openat(
            Some(here.as_raw_fd()),
            name.as_os_str(),
            OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        // SAFETY: openat returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let kind = SFlag::from_bits_truncate(fstat(fd.as_raw_fd())?.st_mode) & SFlag::S_IFMT;
        if kind == SFlag::S_IFLNK {
            symlinks += 1;
            if symlinks > MAX_SYMLINKS {
                return Err(Errno::ELOOP.into());
            }
            // readlinkat with an empty path reads the link an O_PATH|O_NOFOLLOW descriptor names.
            let target = nix::fcntl::readlinkat(Some(fd.as_raw_fd()), "")?;
            let target = Path::new(&target);
            if target.is_absolute() {
                below.clear();
            }
            let mut rest = components(target);
            rest.extend(pending);
            pending = rest;
        } else if pending.is_empty() {
            return Ok(fd);
        } else if kind == SFlag::S_IFDIR {
            below.push(fd);
        } else {
            return Err(Errno::ENOTDIR.into());
        }
    }
    // The path named a directory (or the root itself).
    match below.pop() {
        Some(dir) => Ok(dir),
        None => Ok(root.try_clone_to_owned()?),
    }
}

/// The names of a path, `..` kept as a name (it is resolved against the walk), `.` and `/` dropped.
fn components(path: &Path) -> VecDeque<OsString> {
    path.components()
        .filter_map(|component| match component {
            Component::Normal(name) => Some(name.to_owned()),
            Component::ParentDir => Some(OsStr::from_bytes(b"..").to_owned()),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
        })
        .collect()
}
