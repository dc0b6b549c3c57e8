//! The object files of a process, in the order the dynamic linker searches them for symbols: of a
//! running process (from its mappings), of a command not started yet, or of a program just exec'd
//! (resolved as ld.so(8) would: LD_PRELOAD, DT_NEEDED breadth-first through DT_RPATH,
//! LD_LIBRARY_PATH, DT_RUNPATH, /etc/ld.so.conf and the default directories). Paths are resolved
//! inside the process's own root, so a container's files are its own.

use std::{
    collections::{HashSet, VecDeque},
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};

use crate::{elf::ElfObject, procfs};

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

/// The executable and every file a running process maps executable, each once, in map order.
pub fn mapped_by(pid: u32) -> Result<Vec<ObjectFile>> {
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

/// The objects of a running process in the dynamic linker's symbol search order: the executable,
/// LD_PRELOAD, then DT_NEEDED breadth-first; objects loaded later (dlopen) last.
pub fn link_order_of_process(pid: u32) -> Result<Vec<ObjectFile>> {
    let maps = procfs::mappings(pid)
        .with_context(|| format!("reading /proc/{pid}/maps (is pid {pid} still running?)"))?;
    let mut mapped: Vec<PathBuf> = Vec::new();
    for mapping in maps.into_iter().filter(|m| m.executable) {
        if !mapped.contains(&mapping.path) {
            mapped.push(mapping.path);
        }
    }
    let exe =
        fs::read_link(format!("/proc/{pid}/exe")).with_context(|| format!("reading /proc/{pid}/exe"))?;
    let exe = PathBuf::from(exe.to_string_lossy().trim_end_matches(" (deleted)"));
    let object = |path: &Path| ObjectFile { path: path.to_owned(), host_path: procfs::in_root_of(pid, path) };
    // A needed name is a soname; the mapped file may be named otherwise (libtcmalloc.so.4 is
    // libtcmalloc.so.4.5.10), so fall back on the sonames the mapped objects declare.
    let sonames = std::cell::OnceCell::new();
    let soname_of = |path: &PathBuf| -> Option<String> {
        let data = fs::read(procfs::in_root_of(pid, path)).ok()?;
        ElfObject::parse(&data).ok()?.dynamic_info().ok()?.soname
    };
    let find_mapped = |name: &str| -> Option<PathBuf> {
        let by_file_name = mapped
            .iter()
            .find(|path| path.as_os_str() == name || path.file_name().is_some_and(|n| n == name));
        by_file_name.cloned().or_else(|| {
            let sonames: &Vec<(PathBuf, Option<String>)> =
                sonames.get_or_init(|| mapped.iter().map(|path| (path.clone(), soname_of(path))).collect());
            sonames.iter().find(|(_, soname)| soname.as_deref() == Some(name)).map(|(path, _)| path.clone())
        })
    };
    let mut order =
        vec![ObjectFile { path: exe.clone(), host_path: PathBuf::from(format!("/proc/{pid}/exe")) }];
    let environ = fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    for preload in preloads(environ.split(|&b| b == 0).map(|var| String::from_utf8_lossy(var).into_owned())) {
        if let Some(path) = find_mapped(&preload) {
            order.push(object(&path));
        }
    }
    let needed = needed_breadth_first(&order[0].host_path, |name, _| find_mapped(name).map(|p| object(&p)));
    order.extend(needed);
    for path in &mapped {
        order.push(object(path));
    }
    dedup(&mut order);
    Ok(order)
}

pub fn link_order_of_exec(pid: u32) -> Result<Vec<ObjectFile>> {
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let program = PathBuf::from(format!("/proc/{pid}/exe"));
    // Where the process sees its program: the path that outlives the process.
    let seen_as = fs::read_link(&program).with_context(|| format!("pid {pid} has exited"))?;
    let environ = fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let environ: Vec<String> =
        environ.split(|&b| b == 0).map(|var| String::from_utf8_lossy(var).into_owned()).collect();
    let mut order = link_order_of_command(&program, &root, &environ)?;
    order[0].path = seen_as;
    Ok(order)
}

/// The objects a program will load, resolved before it runs, in the file system under `root`
/// (`/`, or /proc/PID/root for a process in another mount namespace). `environ` is the program's
/// environment when it is not memtrace's own.
pub fn link_order_of_command(program: &Path, root: &Path, environ: &[String]) -> Result<Vec<ObjectFile>> {
    let in_root = |path: &Path| root.join(path.strip_prefix("/").unwrap_or(path));
    let object = |path: &Path| ObjectFile {
        path: path.strip_prefix(root).map_or_else(|_| path.to_owned(), |p| Path::new("/").join(p)),
        host_path: path.to_owned(),
    };
    let mut order = vec![ObjectFile { path: program.to_owned(), host_path: program.to_owned() }];
    let environ: Vec<String> = if environ.is_empty() {
        std::env::vars().map(|(k, v)| format!("{k}={v}")).collect()
    } else {
        environ.to_vec()
    };
    let library_path: Vec<PathBuf> = environ
        .iter()
        .filter_map(|var| var.strip_prefix("LD_LIBRARY_PATH="))
        .flat_map(|paths| std::env::split_paths(paths).map(|p| in_root(&p)).collect::<Vec<_>>())
        .collect();
    let system_dirs: Vec<PathBuf> = system_library_dirs(root).iter().map(|dir| in_root(dir)).collect();
    for preload in preloads(environ.iter().cloned()) {
        let preload = match preload.strip_prefix('/') {
            Some(_) => in_root(Path::new(&preload)).to_string_lossy().into_owned(),
            None => preload,
        };
        if let Some(path) = find_library(&preload, &library_path, &[], &system_dirs) {
            order.push(object(&path));
        }
    }
    let needed = needed_breadth_first(program, |name, runpath| {
        find_library(name, &library_path, runpath, &system_dirs).map(|p| object(&p))
    });
    order.extend(needed);
    dedup(&mut order);
    Ok(order)
}

fn preloads(environ: impl Iterator<Item = String>) -> Vec<String> {
    environ
        .filter_map(|var| var.strip_prefix("LD_PRELOAD=").map(str::to_owned))
        .flat_map(|value| {
            value.split([' ', ':']).filter(|s| !s.is_empty()).map(str::to_owned).collect::<Vec<_>>()
        })
        .collect()
}

/// DT_NEEDED of `root`, breadth-first as the dynamic linker loads them. `locate` finds a needed
/// name, given the search paths (DT_RUNPATH/DT_RPATH, $ORIGIN expanded) of the object needing it.
fn needed_breadth_first(
    root: &Path,
    mut locate: impl FnMut(&str, &[PathBuf]) -> Option<ObjectFile>,
) -> Vec<ObjectFile> {
    let mut found = Vec::new();
    let mut seen = HashSet::new();
    let mut queue = VecDeque::from([root.to_owned()]);
    while let Some(host_path) = queue.pop_front() {
        let Ok(data) = fs::read(&host_path) else {
            continue;
        };
        let Ok(info) = ElfObject::parse(&data).and_then(|elf| elf.dynamic_info()) else {
            continue;
        };
        let origin = host_path.parent().unwrap_or(Path::new("/"));
        let origin = origin.to_string_lossy();
        let expand =
            |dir: &String| PathBuf::from(dir.replace("${ORIGIN}", &origin).replace("$ORIGIN", &origin));
        // ld.so(8): DT_RPATH only counts when there is no DT_RUNPATH.
        let runpath: Vec<PathBuf> = if info.runpath.is_empty() {
            info.rpath.iter().map(expand).collect()
        } else {
            info.runpath.iter().map(expand).collect()
        };
        for name in info.needed {
            if !seen.insert(name.clone()) {
                continue;
            }
            if let Some(object) = locate(&name, &runpath) {
                queue.push_back(object.host_path.clone());
                found.push(object);
            }
        }
    }
    found
}

/// The default search directories of Debian's x86-64 dynamic linker, after LD_LIBRARY_PATH and
/// the object's run path.
pub const SYSTEM_LIBRARY_DIRS: [&str; 6] =
    ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"];

fn find_library(
    name: &str,
    library_path: &[PathBuf],
    runpath: &[PathBuf],
    system_dirs: &[PathBuf],
) -> Option<PathBuf> {
    if name.contains('/') {
        return Path::new(name).is_file().then(|| PathBuf::from(name));
    }
    library_path
        .iter()
        .chain(runpath)
        .chain(system_dirs)
        .map(|dir| dir.join(name))
        .find(|candidate| is_elf64(candidate))
}

fn dedup(objects: &mut Vec<ObjectFile>) {
    let mut seen = HashSet::new();
    objects.retain(|object| seen.insert(object.path.clone()));
}

/// The directories of /etc/ld.so.conf (under `root`), searched before the defaults.
fn system_library_dirs(root: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    read_ld_so_conf(root, &root.join("etc/ld.so.conf"), &mut dirs, 0);
    dirs.extend(SYSTEM_LIBRARY_DIRS.iter().map(PathBuf::from));
    dirs
}

fn read_ld_so_conf(root: &Path, path: &Path, dirs: &mut Vec<PathBuf>, depth: u32) {
    let Ok(text) = fs::read_to_string(path) else { return };
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if let Some(pattern) = line.strip_prefix("include ") {
            // Only the `dir/*.conf` form Debian uses.
            let pattern = Path::new(pattern.trim());
            let (Some(dir), Some(suffix)) = (
                pattern.parent(),
                pattern.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix('*')),
            ) else {
                continue;
            };
            let dir = root.join(dir.strip_prefix("/").unwrap_or(dir));
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
            for entry in entries.iter().filter(|_| depth < 4) {
                read_ld_so_conf(root, entry, dirs, depth + 1);
            }
        } else if line.starts_with('/') {
            dirs.push(PathBuf::from(line));
        }
    }
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
    fn preload_lists_split_on_spaces_and_colons() {
        let environ = ["HOME=/root".to_owned(), "LD_PRELOAD=/a/libx.so:liby.so libz.so".to_owned()];
        assert_eq!(preloads(environ.into_iter()), ["/a/libx.so", "liby.so", "libz.so"]);
    }

    #[test]
    fn own_executable_needs_libc() {
        let exe = fs::read_link("/proc/self/exe").unwrap();
        let objects = link_order_of_command(&exe, Path::new("/"), &[]).unwrap();
        assert_eq!(objects[0].path, exe);
        let is_libc =
            |o: &ObjectFile| o.path.file_name().is_some_and(|n| n.to_string_lossy().starts_with("libc.so"));
        assert!(objects.iter().any(is_libc), "{objects:?}");
        let in_process = link_order_of_process(std::process::id()).unwrap();
        assert!(in_process.iter().any(is_libc), "{in_process:?}");
    }

    #[test]
    fn own_process_maps_its_executable_first() {
        let objects = mapped_by(std::process::id()).unwrap();
        assert_eq!(objects[0].path, fs::read_link("/proc/self/exe").unwrap());
        let unique: HashSet<_> = objects.iter().map(|o| &o.path).collect();
        assert_eq!(unique.len(), objects.len());
    }
}
