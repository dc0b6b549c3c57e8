//! The object files of a process, in the order the dynamic linker searches them for symbols: of a
//! running process (from its mappings), of a command not started yet, or of a program just exec'd
//! (resolved as ld.so(8) would: LD_PRELOAD, DT_NEEDED breadth-first through DT_RPATH,
//! LD_LIBRARY_PATH, DT_RUNPATH, /etc/ld.so.conf and the default directories). Paths are resolved
//! inside the process's own root (the file module), so a container's files are its own.

use std::{
    collections::{HashSet, VecDeque},
    io::Read,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};

use super::{
    facts::FileCache,
    file::{ObjectFile, Root},
};
use crate::process::procfs::{self, Mapping};

/// The executable and every file a running process maps executable, in the dynamic linker's
/// symbol search order: the executable, LD_PRELOAD, then DT_NEEDED breadth-first; objects loaded
/// later (dlopen) last. Each file is opened as mapped.
pub fn link_order_of_process(pid: u32, root: &Root, cache: &FileCache) -> Result<Vec<ObjectFile>> {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).with_context(|| {
        format!("reading /proc/{pid}/exe (is pid {pid} still running, and not a kernel thread?)")
    })?;
    let exe = PathBuf::from(exe.to_string_lossy().trim_end_matches(" (deleted)"));
    let program = ObjectFile::open_proc_link(Path::new(&format!("/proc/{pid}/exe")), exe)?;
    let maps = procfs::mappings(pid)
        .with_context(|| format!("reading /proc/{pid}/maps (is pid {pid} still running?)"))?;
    let mut seen = HashSet::new();
    let mapped: Vec<ObjectFile> = maps
        .iter()
        .filter(|mapping| mapping.executable && seen.insert(mapping.path.clone()))
        .filter_map(|mapping| open_mapping(pid, root, mapping).ok())
        .collect();
    // A needed name is a soname; the mapped file may be named otherwise (libtcmalloc.so.4 is
    // libtcmalloc.so.4.5.10), so fall back on the sonames the mapped objects declare.
    let find_mapped = |name: &str| -> Option<ObjectFile> {
        let by_file_name = mapped.iter().find(|object| {
            object.path.as_os_str() == name || object.path.file_name().is_some_and(|n| n == name)
        });
        by_file_name
            .or_else(|| {
                mapped.iter().find(|object| cache.facts(object).dynamic.soname.as_deref() == Some(name))
            })
            .cloned()
    };
    let mut order = vec![program];
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    for preload in preloads(environ.split(|&b| b == 0).map(|var| String::from_utf8_lossy(var).into_owned())) {
        order.extend(find_mapped(&preload));
    }
    let needed = needed_breadth_first(&order[0].clone(), cache, |name, _| find_mapped(name));
    order.extend(needed);
    order.extend(mapped.iter().cloned());
    dedup(&mut order);
    Ok(order)
}

/// A mapped file of process `pid`: through /proc/PID/map_files, the very file mapped (this needs
/// CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE), or else by its path, resolved inside the process's root.
pub fn open_mapping(pid: u32, root: &Root, mapping: &Mapping) -> Result<ObjectFile> {
    let link = format!("/proc/{pid}/map_files/{:x}-{:x}", mapping.start, mapping.end);
    ObjectFile::open_proc_link(Path::new(&link), mapping.path.clone()).or_else(|_| root.open(&mapping.path))
}

/// The objects of a program process `pid` has just exec'd, resolved in its root before it maps them.
pub fn link_order_of_exec(pid: u32, cache: &FileCache) -> Result<(Root, Vec<ObjectFile>)> {
    // Where the process sees its program: the path that outlives the process.
    let seen_as =
        std::fs::read_link(format!("/proc/{pid}/exe")).with_context(|| format!("pid {pid} has exited"))?;
    let program = ObjectFile::open_proc_link(Path::new(&format!("/proc/{pid}/exe")), seen_as)?;
    link_order_of_program_in(pid, program, cache)
}

/// The objects `program` will load when process `pid` runs it, resolved in the process's root
/// with its environment (for a process stopped at exec, the new program's).
pub fn link_order_of_program_in(
    pid: u32,
    program: ObjectFile,
    cache: &FileCache,
) -> Result<(Root, Vec<ObjectFile>)> {
    let root = Root::of_process(pid)?;
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let environ: Vec<String> =
        environ.split(|&b| b == 0).map(|var| String::from_utf8_lossy(var).into_owned()).collect();
    let order = link_order_of_program(program, &root, &environ, cache);
    Ok((root, order))
}

/// The objects `program` will load, resolved before it runs, in the file system under `root`.
/// `environ` is the program's environment when it is not memtrace's own.
pub fn link_order_of_program(
    program: ObjectFile,
    root: &Root,
    environ: &[String],
    cache: &FileCache,
) -> Vec<ObjectFile> {
    let environ: Vec<String> = if environ.is_empty() {
        std::env::vars().map(|(k, v)| format!("{k}={v}")).collect()
    } else {
        environ.to_vec()
    };
    let library_path: Vec<PathBuf> = environ
        .iter()
        .filter_map(|var| var.strip_prefix("LD_LIBRARY_PATH="))
        .flat_map(|paths| std::env::split_paths(paths).collect::<Vec<_>>())
        .collect();
    let system_dirs = system_library_dirs(root);
    let mut order = vec![program];
    for preload in preloads(environ.iter().cloned()) {
        order.extend(find_library(&preload, root, &library_path, &[], &system_dirs));
    }
    let needed = needed_breadth_first(&order[0].clone(), cache, |name, runpath| {
        find_library(name, root, &library_path, runpath, &system_dirs)
    });
    order.extend(needed);
    dedup(&mut order);
    order
}

pub fn preloads(environ: impl Iterator<Item = String>) -> Vec<String> {
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
    root: &ObjectFile,
    cache: &FileCache,
    mut locate: impl FnMut(&str, &[PathBuf]) -> Option<ObjectFile>,
) -> Vec<ObjectFile> {
    let mut found = Vec::new();
    let mut seen = HashSet::new();
    let mut queue = VecDeque::from([root.clone()]);
    while let Some(object) = queue.pop_front() {
        let facts = cache.facts(&object);
        let info = &facts.dynamic;
        let origin = object.path.parent().unwrap_or(Path::new("/"));
        let origin = origin.to_string_lossy();
        let expand =
            |dir: &String| PathBuf::from(dir.replace("${ORIGIN}", &origin).replace("$ORIGIN", &origin));
        // ld.so(8): DT_RPATH only counts when there is no DT_RUNPATH.
        let runpath: Vec<PathBuf> = if info.runpath.is_empty() {
            info.rpath.iter().map(expand).collect()
        } else {
            info.runpath.iter().map(expand).collect()
        };
        for name in &info.needed {
            if !seen.insert(name.clone()) {
                continue;
            }
            if let Some(object) = locate(name, &runpath) {
                queue.push_back(object.clone());
                found.push(object);
            }
        }
    }
    found
}

/// The default search directories of Debian's dynamic linker for memtrace's own architecture (its
/// multiarch directories first), after LD_LIBRARY_PATH and the object's run path.
#[cfg(not(target_arch = "aarch64"))]
pub const SYSTEM_LIBRARY_DIRS: [&str; 6] =
    ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"];
#[cfg(target_arch = "aarch64")]
pub const SYSTEM_LIBRARY_DIRS: [&str; 6] =
    ["/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"];

fn find_library(
    name: &str,
    root: &Root,
    library_path: &[PathBuf],
    runpath: &[PathBuf],
    system_dirs: &[PathBuf],
) -> Option<ObjectFile> {
    if name.contains('/') {
        return root.open(Path::new(name)).ok();
    }
    library_path
        .iter()
        .chain(runpath)
        .chain(system_dirs)
        .filter_map(|dir| root.open(&dir.join(name)).ok())
        .find(is_elf64)
}

/// One object per file, the first place it was found.
fn dedup(objects: &mut Vec<ObjectFile>) {
    let mut seen = HashSet::new();
    objects.retain(|object| seen.insert(object.id));
}

/// The directories of /etc/ld.so.conf (under `root`), searched before the defaults.
fn system_library_dirs(root: &Root) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    read_ld_so_conf(root, Path::new("/etc/ld.so.conf"), &mut dirs, 0);
    dirs.extend(SYSTEM_LIBRARY_DIRS.iter().map(PathBuf::from));
    dirs
}

fn read_ld_so_conf(root: &Root, path: &Path, dirs: &mut Vec<PathBuf>, depth: u32) {
    // Bounded, regular files only: the file is the target's.
    let Some(text) = root.read_config(path) else { return };
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
            let entries: Vec<String> =
                root.list_dir(dir).into_iter().filter(|n| n.ends_with(suffix)).collect();
            for entry in entries.iter().filter(|_| depth < 4).take(256) {
                read_ld_so_conf(root, &dir.join(entry), dirs, depth + 1);
            }
        } else if line.starts_with('/') && dirs.len() < 1024 {
            dirs.push(PathBuf::from(line));
        }
    }
}

/// The dynamic linker skips libraries of another class; so does memtrace.
fn is_elf64(object: &ObjectFile) -> bool {
    let mut header = [0u8; 5];
    object.reader().read_exact(&mut header).is_ok() && header == [0x7f, b'E', b'L', b'F', 2]
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
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let cache = FileCache::default();
        let program = ObjectFile::open_host(&exe).unwrap();
        let objects = link_order_of_program(program, &Root::host(), &[], &cache);
        assert_eq!(objects[0].path, exe);
        let is_libc =
            |o: &ObjectFile| o.path.file_name().is_some_and(|n| n.to_string_lossy().starts_with("libc.so"));
        assert!(objects.iter().any(is_libc), "{objects:?}");
        let pid = std::process::id();
        let in_process = link_order_of_process(pid, &Root::of_process(pid).unwrap(), &cache).unwrap();
        assert_eq!(in_process[0].path, exe);
        assert!(in_process.iter().any(is_libc), "{in_process:?}");
        let unique: HashSet<_> = in_process.iter().map(|o| o.id).collect();
        assert_eq!(unique.len(), in_process.len());
    }
}
