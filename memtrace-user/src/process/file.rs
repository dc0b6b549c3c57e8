//! Files of a traced process, opened safely: a file's identity ([`FileId`]), the root its paths are
//! resolved in ([`Root`]), and an opened object file ([`ObjectFile`]) that is known to be a regular
//! file of a sane size before anything reads it.
//!
//! memtrace runs as root and reads files a container's owner controls. A path the target gives
//! (its mappings, `--lib`, DT_NEEDED through its search paths, /etc/ld.so.conf) is resolved inside
//! the target's root with openat2(RESOLVE_IN_ROOT) on a descriptor of /proc/PID/root, so an absolute
//! or `..` symlink planted in the container stays in the container (the resolve module falls
//! back to a walk of its own where openat2 is missing). Mapped files are opened through
//! /proc/PID/map_files where the kernel allows it: that is the very file mapped, with no path
//! resolved at all. Whatever is handed on by path afterwards (to the kernel's uprobes, to the ELF
//! readers) is `/proc/self/fd/N` of the descriptor opened here, which names that file and no other.

use std::{
    fs::File,
    io::{self, Read, Seek, SeekFrom},
    os::{
        fd::{AsFd, AsRawFd, OwnedFd},
        unix::fs::{FileExt, FileTypeExt, MetadataExt},
    },
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::{bail, Context, Result};
use memtrace_common::ImageKey;
use nix::fcntl::OFlag;

use super::resolve;

/// The largest object file memtrace reads: far above any real library (libLLVM is ~120 MB), far
/// below what would hurt the machine.
pub const MAX_OBJECT_BYTES: u64 = 1 << 30;
/// The largest configuration file (/etc/ld.so.conf and its includes) memtrace reads.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// A file's identity, as the kernel's uprobes see it: the same file whatever path names it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

impl FileId {
    #[cfg(test)]
    pub fn of(file: &File) -> io::Result<Self> {
        let metadata = file.metadata()?;
        Ok(Self { dev: metadata.dev(), ino: metadata.ino() })
    }

    /// The identity of the file at a path of memtrace's own (trusted) file system.
    pub fn of_path(path: &Path) -> Option<Self> {
        let metadata = std::fs::metadata(path).ok()?;
        Some(Self { dev: metadata.dev(), ino: metadata.ino() })
    }

    /// The file as the kernel's BPF side names it (`ImageKey`: the kernel's own dev_t, MKDEV(major,
    /// minor) = major << 20 | minor, from stat's encoding, glibc's). Where a file system's stat
    /// names another device than its super block (btrfs subvolumes, overlays, whose mappings are
    /// of the underlying file), the names differ: the BPF side does not know the file by this name.
    pub fn kernel_key(self) -> ImageKey {
        let (major, minor) = (libc::major(self.dev), libc::minor(self.dev));
        ImageKey { dev: (major << 20) | minor, _pad: 0, ino: self.ino }
    }
}

/// The root directory a process resolves its paths in: memtrace's own, or a target's
/// (/proc/PID/root, which differs in a container or a chroot).
#[derive(Debug, Clone)]
pub struct Root {
    /// None: memtrace's own root, where paths are opened as usual.
    dir: Option<Arc<OwnedFd>>,
    pid: Option<u32>,
}

impl Root {
    pub fn host() -> Self {
        Self { dir: None, pid: None }
    }

    pub fn of_process(pid: u32) -> Result<Self> {
        let path = format!("/proc/{pid}/root");
        let dir = nix::fcntl::open(
            path.as_str(),
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .with_context(|| format!("opening {path} (is pid {pid} still running?)"))?;
        // SAFETY: open returned a new descriptor that nothing else owns.
        let dir = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(dir) };
        Ok(Self { dir: Some(Arc::new(dir)), pid: Some(pid) })
    }

    /// Opens `path` (as the process sees it) as an object file: a regular file of a sane size.
    pub fn open(&self, path: &Path) -> Result<ObjectFile> {
        let handle = self.open_path(path).with_context(|| format!("cannot read {}", self.describe(path)))?;
        ObjectFile::from_path_handle(handle, path.to_owned(), self)
    }

    /// A small text file in this root (ld.so.conf), or None if it is missing, not a regular file or
    /// larger than [`MAX_CONFIG_BYTES`].
    pub fn read_config(&self, path: &Path) -> Option<String> {
        let object = self.open(path).ok()?;
        if object.len > MAX_CONFIG_BYTES {
            return None;
        }
        let mut text = String::new();
        object.reader().take(MAX_CONFIG_BYTES).read_to_string(&mut text).ok()?;
        Some(text)
    }

    /// The names in a directory of this root, sorted.
    pub fn list_dir(&self, path: &Path) -> Vec<String> {
        let Ok(handle) = self.open_path(path) else { return Vec::new() };
        // An O_PATH descriptor cannot be listed; /proc/self/fd/N reopens that directory itself.
        let Ok(entries) = std::fs::read_dir(format!("/proc/self/fd/{}", handle.as_raw_fd())) else {
            return Vec::new();
        };
        let mut names: Vec<String> =
            entries.flatten().map(|entry| entry.file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    }

    /// An O_PATH descriptor of `path`, resolved in this root.
    fn open_path(&self, path: &Path) -> io::Result<OwnedFd> {
        match &self.dir {
            Some(dir) => resolve::open_in_root(dir.as_fd(), path),
            None => resolve::open_on_host(path),
        }
    }

    fn describe(&self, path: &Path) -> String {
        match self.pid {
            Some(pid) => format!("{} in the root of pid {pid}", path.display()),
            None => path.display().to_string(),
        }
    }
}

/// An object file as the target sees it and as memtrace opened it. Clones share the descriptor,
/// which stays open while any clone lives.
#[derive(Debug, Clone)]
pub struct ObjectFile {
    /// The path in the target's mount namespace, for messages and matching.
    pub path: PathBuf,
    /// `/proc/self/fd/N` of the opened file: hand this to whatever opens by path (the kernel's
    /// uprobes, ELF readers), and it reaches this very file.
    pub host_path: PathBuf,
    pub id: FileId,
    /// The file's size when opened.
    pub len: u64,
    file: Arc<File>,
}

impl PartialEq for ObjectFile {
    fn eq(&self, other: &Self) -> bool {
        self.path == other.path && self.id == other.id
    }
}

impl ObjectFile {
    /// Opens a magic link of /proc (/proc/PID/exe, /proc/PID/map_files/...): the file it stands for.
    pub fn open_proc_link(link: &Path, path: PathBuf) -> Result<Self> {
        let handle = nix::fcntl::open(link, OFlag::O_PATH | OFlag::O_CLOEXEC, nix::sys::stat::Mode::empty())
            .with_context(|| format!("opening {}", link.display()))?;
        // SAFETY: open returned a new descriptor that nothing else owns.
        let handle = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(handle) };
        Self::from_path_handle(handle, path, &Root::host())
    }

    /// Opens a file given on memtrace's own command line (`memtrace usdt PATH`).
    pub fn open_host(path: &Path) -> Result<Self> {
        Root::host().open(path)
    }

    /// Checks what an O_PATH handle names before opening it for reading: nothing but a regular
    /// file of at most [`MAX_OBJECT_BYTES`] is read (a FIFO would block, /dev/zero never end).
    fn from_path_handle(handle: OwnedFd, path: PathBuf, root: &Root) -> Result<Self> {
        let metadata = File::from(handle.try_clone()?).metadata()?;
        let file_type = metadata.file_type();
        if !file_type.is_file() {
            let kind = if file_type.is_dir() {
                "a directory"
            } else if file_type.is_char_device() {
                "a character device"
            } else if file_type.is_block_device() {
                "a block device"
            } else if file_type.is_fifo() {
                "a FIFO"
            } else if file_type.is_socket() {
                "a socket"
            } else {
                "not a file"
            };
            bail!(
                "{} is not a regular file ({kind}); give the path of an executable or a shared library",
                root.describe(&path)
            );
        }
        if metadata.len() > MAX_OBJECT_BYTES {
            bail!(
                "{} is {} bytes, more than the {} memtrace reads of an object file",
                root.describe(&path),
                metadata.len(),
                MAX_OBJECT_BYTES
            );
        }
        // Reopening through /proc/self/fd opens the file the handle names, with no path resolved.
        let file = File::open(format!("/proc/self/fd/{}", handle.as_raw_fd()))
            .with_context(|| format!("cannot read {}", root.describe(&path)))?;
        let id = FileId { dev: metadata.dev(), ino: metadata.ino() };
        let host_path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        Ok(Self { path, host_path, id, len: metadata.len(), file: Arc::new(file) })
    }

    /// The names the kernel may know this file by in a mapping of it (`ImageKey`s): its own, and,
    /// where a file system maps another file than stat names (an overlay maps the file of the
    /// layer below), that file's, as /proc/self/maps shows a private read-only mapping of one
    /// page of it that memtrace makes and unmaps at once.
    pub fn kernel_keys(&self) -> Vec<ImageKey> {
        let own = self.id.kernel_key();
        match self.mapped_key().filter(|mapped| *mapped != own) {
            Some(mapped) => vec![own, mapped],
            None => vec![own],
        }
    }

    fn mapped_key(&self) -> Option<ImageKey> {
        if self.len == 0 {
            return None;
        }
        // SAFETY: a new private read-only mapping of one page of a file memtrace holds open,
        // never read, unmapped below.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                self.file.as_raw_fd(),
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return None;
        }
        let maps = std::fs::read_to_string("/proc/self/maps");
        // SAFETY: the mapping made above, used by nothing else.
        unsafe { libc::munmap(address, 4096) };
        let start = format!("{:x}-", address as usize);
        let line = maps.ok()?.lines().find(|line| line.starts_with(&start))?.to_owned();
        // start-end perms offset MAJOR:MINOR inode path
        let mut fields = line.split_whitespace().skip(3);
        let (major, minor) = fields.next()?.split_once(':')?;
        let (major, minor) = (u32::from_str_radix(major, 16).ok()?, u32::from_str_radix(minor, 16).ok()?);
        let ino = fields.next()?.parse().ok()?;
        Some(ImageKey { dev: (major << 20) | minor, _pad: 0, ino })
    }

    /// Reads exactly `buf.len()` bytes at `offset`, never past the size the file was opened with.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if offset.saturating_add(buf.len() as u64) > self.len {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.file.read_exact_at(buf, offset)
    }

    /// A reader with a position of its own (clones share the descriptor, not a file offset),
    /// bounded by the size the file had when opened.
    pub fn reader(&self) -> BoundedReader<'_> {
        BoundedReader { file: &self.file, position: 0, len: self.len }
    }

    /// Where this file can be opened once the process is gone: the path the target sees, if
    /// memtrace's own file system has that very file there; else its descriptor (kept open by
    /// whoever keeps this object).
    pub fn stable_path(&self) -> Option<PathBuf> {
        (FileId::of_path(&self.path) == Some(self.id)).then(|| self.path.clone())
    }
}

/// Reads a file with pread from a position of its own, never past the length it was opened with.
pub struct BoundedReader<'a> {
    file: &'a File,
    position: u64,
    len: u64,
}

impl Read for BoundedReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.len.saturating_sub(self.position);
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let read = self.file.read_at(&mut buf[..want], self.position)?;
        self.position += read as u64;
        Ok(read)
    }
}

impl Seek for BoundedReader<'_> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let position = match to {
            SeekFrom::Start(offset) => Some(offset),
            SeekFrom::End(delta) => self.len.checked_add_signed(delta),
            SeekFrom::Current(delta) => self.position.checked_add_signed(delta),
        };
        self.position =
            position.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "seek out of range"))?;
        Ok(self.position)
    }
}

#[cfg(test)]
mod tests {
    use std::{fs, os::unix::fs::symlink};

    use super::*;

    /// A file on a plain file system is mapped as itself: one name, stat's.
    #[test]
    fn a_plain_files_mapping_has_its_own_name() {
        let exe = ObjectFile::open_host(&std::env::current_exe().unwrap()).unwrap();
        assert_eq!(exe.kernel_keys(), [exe.id.kernel_key()]);
    }

    /// /dev/vda1 is 254:1; a device of minor 300 (as loop or nvme partitions have) spreads its
    /// minor over both halves of st_dev.
    #[test]
    fn kernel_keys_use_the_kernels_device_numbers() {
        let vda1 = FileId { dev: libc::makedev(254, 1), ino: 12 };
        assert_eq!(vda1.kernel_key(), ImageKey { dev: (254 << 20) | 1, _pad: 0, ino: 12 });
        let wide = FileId { dev: libc::makedev(259, 300), ino: 7 };
        assert_eq!(wide.kernel_key().dev, (259 << 20) | 300);
    }
    use crate::process::resolve::{open_in_root, open_on_host, walk_in_root};

    #[test]
    fn devices_and_directories_are_refused_by_name() {
        for (path, kind) in [("/dev/zero", "a character device"), ("/tmp", "a directory")] {
            let err = ObjectFile::open_host(Path::new(path)).unwrap_err();
            let text = format!("{err:#}");
            assert!(
                text.contains(path) && text.contains("not a regular file") && text.contains(kind),
                "{text}"
            );
        }
    }

    #[test]
    fn opened_files_keep_their_identity_and_size() {
        let exe = std::env::current_exe().unwrap();
        let object = ObjectFile::open_host(&exe).unwrap();
        assert_eq!(Some(object.id), FileId::of_path(&exe));
        assert_eq!(FileId::of_path(&object.host_path), Some(object.id));
        assert_eq!(object.stable_path(), Some(exe.clone()));
        let mut header = [0u8; 4];
        let mut reader = object.reader();
        reader.seek(SeekFrom::End(-4)).unwrap();
        reader.read_exact(&mut header).unwrap();
        assert_eq!(reader.read(&mut header).unwrap(), 0, "reads stop at the opened size");
    }

    #[test]
    fn a_process_root_opens_its_own_files() {
        let root = Root::of_process(std::process::id()).unwrap();
        let exe = std::env::current_exe().unwrap();
        assert_eq!(root.open(&exe).unwrap().id, FileId::of_path(&exe).unwrap());
        let err = root.open(Path::new("/no/such/file")).unwrap_err();
        assert!(format!("{err:#}").contains("/no/such/file in the root of pid"), "{err:#}");
    }

    fn id(fd: &OwnedFd) -> FileId {
        FileId::of(&fs::File::from(fd.try_clone().unwrap())).unwrap()
    }

    /// A root whose lib.so is an absolute symlink to a path that also exists on the host, and
    /// whose escape.so climbs with `..` past the root: both must stay inside.
    #[test]
    fn symlinks_stay_inside_the_root() {
        let host = std::env::temp_dir().join(format!("memtrace-resolve-{}", std::process::id()));
        let root = host.join("root");
        let _ = fs::remove_dir_all(&host);
        fs::create_dir_all(root.join("lib")).unwrap();
        // The host's file at the path the symlink names, and the root's own.
        fs::write(host.join("target.so"), b"host").unwrap();
        let inner = root.join(host.strip_prefix("/").unwrap());
        fs::create_dir_all(&inner).unwrap();
        fs::write(inner.join("target.so"), b"inside").unwrap();
        symlink(host.join("target.so"), root.join("lib/lib.so")).unwrap();
        fs::write(root.join("top.so"), b"top").unwrap();
        symlink("../../../../../../top.so", root.join("lib/escape.so")).unwrap();
        symlink("loop.so", root.join("lib/loop.so")).unwrap();

        let dir = open_on_host(&root).unwrap();
        let inside = FileId::of_path(&inner.join("target.so")).unwrap();
        let top = FileId::of_path(&root.join("top.so")).unwrap();
        for open in [open_in_root, walk_in_root] {
            assert_eq!(id(&open(dir.as_fd(), Path::new("/lib/lib.so")).unwrap()), inside);
            assert_eq!(id(&open(dir.as_fd(), Path::new("lib/escape.so")).unwrap()), top);
            assert_eq!(id(&open(dir.as_fd(), Path::new("/../../top.so")).unwrap()), top);
            assert!(open(dir.as_fd(), Path::new("/lib/loop.so")).is_err());
            assert!(open(dir.as_fd(), Path::new("/top.so/x")).is_err());
            assert_eq!(id(&open(dir.as_fd(), Path::new("/lib/..")).unwrap()), id(&dir));
        }
        fs::remove_dir_all(&host).unwrap();
    }
}
