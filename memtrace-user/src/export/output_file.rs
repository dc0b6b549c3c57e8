//! The files memtrace writes whole at the end of a run (summary, pprof, flamegraph): staged under a
//! temporary name beside their destination and renamed into place once complete, so that a failed
//! or interrupted run never leaves a 0-byte or half-written file. Also the check, before tracing,
//! that no two outputs name the same file.

use std::{
    fs::{self, File, OpenOptions, Permissions},
    io::Write,
    os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use tempfile::NamedTempFile;

/// An output file being written: staged beside its destination, or appended in place when the
/// destination is not a regular file memtrace may replace (a pipe, /dev/stdout, /dev/null).
pub struct OutputFile {
    destination: PathBuf,
    /// The option that named it, for the fix in error messages.
    flag: &'static str,
    target: Option<Target>,
}

enum Target {
    Staged(NamedTempFile),
    InPlace(File),
}

impl OutputFile {
    /// Opens the output now, so that an unwritable path is reported before anything is traced.
    pub fn create(path: &Path, what: &str, flag: &'static str) -> Result<Self> {
        let cannot =
            || format!("cannot write the {what} to {}; choose another path with {flag}", path.display());
        // /dev/stdout, /proc/self/fd/N: whatever they lead to belongs to someone else; append to it.
        let special = path.starts_with("/dev") || path.starts_with("/proc");
        let destination = if special { path.to_owned() } else { destination_of(path) };
        let target = match fs::metadata(&destination) {
            Ok(metadata) if special || !metadata.is_file() => {
                Target::InPlace(OpenOptions::new().append(true).open(&destination).with_context(cannot)?)
            }
            _ => Target::Staged(stage_beside(&destination).with_context(cannot)?),
        };
        Ok(Self { destination, flag, target: Some(target) })
    }

    /// Writes the output with `write` and puts the file in place; on any error nothing is left at
    /// the destination (a file that was there before is kept as it was).
    pub fn commit(&mut self, write: impl FnOnce(&mut File) -> std::io::Result<()>) -> Result<()> {
        let failed = || format!("writing {} (the {} file)", self.destination.display(), self.flag);
        match self.target.take().context("the output was already written")? {
            Target::InPlace(mut file) => write(&mut file).and_then(|()| file.flush()).with_context(failed),
            Target::Staged(mut staged) => {
                write(staged.as_file_mut())
                    .and_then(|()| staged.as_file().sync_all())
                    .with_context(failed)?;
                staged.persist(&self.destination).map_err(|err| err.error).with_context(failed)?;
                Ok(())
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.destination
    }
}

/// Where a path leads: a symbolic link is followed, so the file it names is replaced, not the link.
fn destination_of(path: &Path) -> PathBuf {
    match fs::symlink_metadata(path) {
        Ok(metadata) if metadata.file_type().is_symlink() => {
            fs::canonicalize(path).unwrap_or_else(|_| path.to_owned())
        }
        _ => path.to_owned(),
    }
}

/// A new, empty temporary file in the destination's directory (a rename never crosses file systems),
/// with the permissions a plainly created file would get.
fn stage_beside(destination: &Path) -> std::io::Result<NamedTempFile> {
    let directory = match destination.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let name = destination.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".memtrace-partial")
        .permissions(Permissions::from_mode(0o666))
        .tempfile_in(directory)
}

/// Which file a path names: an existing file by its device and inode (however the path is spelt,
/// through links or `..`), a file still to be created by its canonical directory and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileIdentity {
    Existing { device: u64, inode: u64 },
    New { directory: PathBuf, name: std::ffi::OsString },
}

impl FileIdentity {
    pub fn of(path: &Path) -> Self {
        if let Ok(metadata) = fs::metadata(path) {
            return Self::Existing { device: metadata.dev(), inode: metadata.ino() };
        }
        let directory = match path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        Self::New {
            directory: fs::canonicalize(directory).unwrap_or_else(|_| directory.to_owned()),
            name: path.file_name().unwrap_or(path.as_os_str()).to_owned(),
        }
    }
}

/// Refuses two outputs that are one file (they would overwrite each other); /dev/null may take
/// any number.
pub fn check_distinct(outputs: &[(&str, &Path)]) -> Result<(), String> {
    let is_null = |path: &Path| {
        fs::metadata(path).is_ok_and(|m| m.file_type().is_char_device() && m.rdev() == libc::makedev(1, 3))
    };
    let identities: Vec<FileIdentity> = outputs.iter().map(|(_, path)| FileIdentity::of(path)).collect();
    for (i, (flag, path)) in outputs.iter().enumerate() {
        for (j, (other_flag, other_path)) in outputs.iter().enumerate().take(i) {
            if identities[i] == identities[j] && !is_null(path) {
                return Err(format!(
                    "{other_flag} {} and {flag} {} are the same file; give each output a path of its own",
                    other_path.display(),
                    path.display()
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("memtrace-output-test-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn one_file_under_two_spellings_is_refused() {
        let dir = scratch_dir("spellings");
        fs::create_dir(dir.join("sub")).unwrap();
        let a = dir.join("out.json");
        let b = dir.join("sub/../out.json");
        let error = check_distinct(&[("-o/--output", &a), ("--summary", &b)]).unwrap_err();
        assert!(error.contains("-o/--output") && error.contains("--summary"), "{error}");
        fs::write(&a, "").unwrap();
        std::os::unix::fs::symlink(&a, dir.join("link.json")).unwrap();
        assert!(check_distinct(&[("-o/--output", &a), ("--pprof", &dir.join("link.json"))]).is_err());
        assert!(check_distinct(&[("-o/--output", &a), ("--summary", &dir.join("other.json"))]).is_ok());
        let null = Path::new("/dev/null");
        assert!(check_distinct(&[("-o/--output", null), ("--summary", null)]).is_ok());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn nothing_is_left_unless_committed_whole() {
        let dir = scratch_dir("staged");
        let path = dir.join("summary.json");
        let output = OutputFile::create(&path, "summary", "--summary").unwrap();
        drop(output);
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0, "an abandoned output leaves nothing");

        let mut output = OutputFile::create(&path, "summary", "--summary").unwrap();
        let error = output.commit(|file| {
            file.write_all(b"{\"half\":")?;
            Err(std::io::Error::other("disk full"))
        });
        assert!(format!("{:#}", error.unwrap_err()).contains("summary.json"));
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0, "a failed output leaves nothing");

        let mut output = OutputFile::create(&path, "summary", "--summary").unwrap();
        output.commit(|file| file.write_all(b"{}")).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "{}");
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1, "no temporary file stays behind");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn devices_are_written_in_place_and_their_errors_name_them() {
        let mut output = OutputFile::create(Path::new("/dev/full"), "summary", "--summary").unwrap();
        let error = output.commit(|file| file.write_all(&[b' '; 8192])).unwrap_err();
        assert!(format!("{error:#}").contains("/dev/full"), "{error:#}");
    }
}
