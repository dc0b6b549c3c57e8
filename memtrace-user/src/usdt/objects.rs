//! The object files whose probe sites a target can reach: for a running process, every executable
//! file it maps; for a command not started yet, its executable and the shared libraries it needs
//! (DT_NEEDED, resolved on the host as the dynamic linker would).

use std::{
    collections::HashSet,
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use object::{
    read::elf::{Dyn as _, FileHeader as _},
    Endianness,
};

use crate::procfs;

/// An object file as the target sees it and as memtrace opens it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectFile {
    /// The path in the target's mount namespace, for messages and matching.
    pub path: PathBuf,
    /// The path to open from memtrace's mount namespace.
    pub host_path: PathBuf,
}

/// (device, inode): the identity the kernel's uprobes use, whatever the path.
pub fn file_identity(path: &Path) -> Option<(u64, u64)> {
    let metadata = fs::metadata(path).ok()?;
    Some((metadata.dev(), metadata.ino()))
}

/// The executable and every file a running process maps executable, each once.
pub fn of_process(pid: u32) -> Result<Vec<ObjectFile>> {
    let executable = fs::read_link(format!("/proc/{pid}/exe"))
        .with_context(|| format!("reading /proc/{pid}/exe (is pid {pid} still running?)"))?;
    let mappings = procfs::mappings(pid)
        .with_context(|| format!("reading /proc/{pid}/maps (is pid {pid} still running?)"))?;
    let mut seen = HashSet::new();
    let paths =
        std::iter::once(executable).chain(mappings.into_iter().filter(|m| m.executable).map(|m| m.path));
    Ok(paths
        .filter(|path| seen.insert(path.clone()))
        .map(|path| ObjectFile { host_path: procfs::in_root_of(pid, &path), path })
        .collect())
}

/// A command's executable and the libraries it needs, transitively, as found on this host.
pub fn of_command(program: &Path) -> Vec<ObjectFile> {
    let mut objects = vec![program.to_owned()];
    let mut seen: HashSet<PathBuf> = objects.iter().cloned().collect();
    let mut next = 0;
    while next < objects.len() {
        let object = objects[next].clone();
        next += 1;
        let Ok(data) = fs::read(&object) else {
            continue;
        };
        let Some(dynamic) = DynamicInfo::parse(&data) else {
            continue;
        };
        for needed in &dynamic.needed {
            if let Some(found) = resolve_library(needed, &object, &dynamic) {
                if seen.insert(found.clone()) {
                    objects.push(found);
                }
            }
        }
    }
    objects.into_iter().map(|path| ObjectFile { host_path: path.clone(), path }).collect()
}

/// What the dynamic linker reads from an object to find its libraries.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct DynamicInfo {
    pub needed: Vec<String>,
    pub rpath: Vec<String>,
    pub runpath: Vec<String>,
}

impl DynamicInfo {
    /// None for anything but a 64-bit little-endian ELF file with a dynamic section.
    pub fn parse(data: &[u8]) -> Option<Self> {
        let header = object::elf::FileHeader64::<Endianness>::parse(data).ok()?;
        let endian = header.endian().ok()?;
        let sections = header.sections(endian, data).ok()?;
        let (entries, strings_index) = sections.dynamic(endian, data).ok()??;
        let strings = sections.strings(endian, data, strings_index).ok()?;
        let mut info = Self::default();
        for entry in entries {
            let Some(tag) = entry.tag32(endian) else {
                continue;
            };
            let list = match tag {
                object::elf::DT_NEEDED => &mut info.needed,
                object::elf::DT_RPATH => &mut info.rpath,
                object::elf::DT_RUNPATH => &mut info.runpath,
                _ => continue,
            };
            if let Ok(text) = entry.string(endian, strings) {
                let text = String::from_utf8_lossy(text).into_owned();
                if tag == object::elf::DT_NEEDED {
                    list.push(text);
                } else {
                    list.extend(text.split(':').filter(|d| !d.is_empty()).map(str::to_owned));
                }
            }
        }
        Some(info)
    }
}

/// The directories the dynamic linker searches after RPATH, LD_LIBRARY_PATH and RUNPATH: those of
/// /etc/ld.so.conf, then the defaults.
fn system_library_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    read_ld_so_conf(Path::new("/etc/ld.so.conf"), &mut dirs, 0);
    for default in
        ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"]
    {
        dirs.push(PathBuf::from(default));
    }
    dirs
}

fn read_ld_so_conf(path: &Path, dirs: &mut Vec<PathBuf>, depth: u32) {
    let Ok(text) = fs::read_to_string(path) else {
        return;
    };
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if let Some(pattern) = line.strip_prefix("include ") {
            if depth > 4 {
                continue;
            }
            // Only the `dir/*.conf` form Debian uses.
            let pattern = Path::new(pattern.trim());
            let (Some(dir), Some(suffix)) = (
                pattern.parent(),
                pattern.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix('*')),
            ) else {
                continue;
            };
            let mut entries: Vec<PathBuf> = fs::read_dir(dir)
                .map(|entries| {
                    entries
                        .flatten()
                        .map(|e| e.path())
                        .filter(|p| p.to_string_lossy().ends_with(suffix))
                        .collect()
                })
                .unwrap_or_default();
            entries.sort();
            for entry in entries {
                read_ld_so_conf(&entry, dirs, depth + 1);
            }
        } else if line.starts_with('/') {
            dirs.push(PathBuf::from(line));
        }
    }
}

/// Finds a DT_NEEDED library in the order of ld.so(8): RPATH (when there is no RUNPATH),
/// LD_LIBRARY_PATH, RUNPATH, then the system directories.
fn resolve_library(needed: &str, requester: &Path, dynamic: &DynamicInfo) -> Option<PathBuf> {
    if needed.contains('/') {
        return Some(PathBuf::from(needed)).filter(|p| p.is_file());
    }
    let origin = requester.parent().map(Path::to_owned).unwrap_or_else(|| PathBuf::from("."));
    let expand = |dir: &str| -> PathBuf {
        let origin = origin.to_string_lossy();
        PathBuf::from(dir.replace("${ORIGIN}", &origin).replace("$ORIGIN", &origin))
    };
    let mut dirs: Vec<PathBuf> = Vec::new();
    if dynamic.runpath.is_empty() {
        dirs.extend(dynamic.rpath.iter().map(|d| expand(d)));
    }
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&paths).filter(|d| !d.as_os_str().is_empty()));
    }
    dirs.extend(dynamic.runpath.iter().map(|d| expand(d)));
    dirs.extend(system_library_dirs());
    dirs.into_iter().map(|dir| dir.join(needed)).find(|candidate| is_elf64(candidate))
}

/// The dynamic linker skips libraries of another class; so does memtrace.
fn is_elf64(path: &Path) -> bool {
    use std::io::Read;
    let mut header = [0u8; 5];
    fs::File::open(path).and_then(|mut file| file.read_exact(&mut header)).is_ok()
        && header == [0x7f, b'E', b'L', b'F', 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_executable_needs_libc() {
        let exe = fs::read_link("/proc/self/exe").unwrap();
        let objects = of_command(&exe);
        assert_eq!(objects[0].path, exe);
        assert!(
            objects
                .iter()
                .any(|o| o.path.file_name().is_some_and(|n| n.to_string_lossy().starts_with("libc.so"))),
            "{objects:?}"
        );
    }

    #[test]
    fn own_process_maps_its_executable_first() {
        let objects = of_process(std::process::id()).unwrap();
        assert_eq!(objects[0].path, fs::read_link("/proc/self/exe").unwrap());
        let unique: HashSet<_> = objects.iter().map(|o| &o.path).collect();
        assert_eq!(unique.len(), objects.len());
    }

    #[test]
    fn garbage_has_no_dynamic_section() {
        assert_eq!(DynamicInfo::parse(b"garbage"), None);
        assert_eq!(DynamicInfo::parse(&[0x7f, b'E', b'L', b'F', 2, 1, 1]), None);
    }
}
