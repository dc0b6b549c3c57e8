//! Finds the object that provides a process's allocator as the dynamic linker resolves `malloc`
//! (the executable itself, an LD_PRELOADed or linked jemalloc, tcmalloc or mimalloc, or the C
//! library), with its entry points (located in each file by entry_points, read once per file
//! through the file cache).

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};

use super::{
    entry_points::ResolvedEntryPoint, facts::FileCache, file::ObjectFile, image::ProcessImage,
    map_calls::MapCalls, objects::SYSTEM_LIBRARY_DIRS, probe_point::ProbePoint,
};

/// Symbol prefixes of allocators built to live beside the system one, and their names.
const KNOWN_PREFIXES: [(&str, &str); 4] =
    [("je_", "jemalloc"), ("tc_", "tcmalloc"), ("mi_", "mimalloc"), ("_rjem_", "jemalloc (Rust)")];

/// What the user said about the allocator: `--lib PATH` and `--allocator NAME|PREFIX`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// The object to probe, as the target sees its path.
    pub lib: Option<PathBuf>,
    /// The symbol prefix of its entry points ("" for plain malloc).
    pub prefix: Option<String>,
}

impl Overrides {
    /// The `--lib` object, resolved where the process resolves its paths.
    fn lib_object(&self, image: &ProcessImage) -> Result<Option<ObjectFile>> {
        let Some(lib) = &self.lib else { return Ok(None) };
        image.open(lib).map(Some).with_context(|| format!("--lib {}", lib.display()))
    }

    /// `--allocator`: a known allocator's name or a literal symbol prefix.
    pub fn prefix_for(name: &str) -> String {
        match name {
            // Allocators that replace the system one export plain malloc.
            "glibc" | "libc" | "system" | "jemalloc" | "tcmalloc" | "mimalloc" => "",
            "je" => "je_",
            "tc" => "tc_",
            "mi" => "mi_",
            "rust-jemalloc" | "rjem" => "_rjem_",
            prefix => prefix,
        }
        .to_owned()
    }
}

/// The object a process's allocator lives in, with its entry points.
#[derive(Debug, Clone)]
pub struct Allocator {
    /// "glibc", "jemalloc", ... or "malloc in <file>" for an executable's own.
    pub kind: String,
    /// The path as the target sees it, for reports.
    pub path: PathBuf,
    /// Where the probes attach: `/proc/self/fd/N` of the opened file, valid while `object` lives.
    pub host_path: PathBuf,
    pub entry_points: Vec<ResolvedEntryPoint>,
    /// The file, kept open.
    pub object: ObjectFile,
    /// The mapping calls the process makes its anonymous mappings through, probed beside the
    /// allocator (by links of their own: the C library is often both); None where no file
    /// defines them.
    pub map_calls: Option<MapCalls>,
}

impl Allocator {
    /// The allocator among a process's objects (or `--lib`), as the dynamic linker resolves
    /// malloc; each file's entry points are read once (`cache`).
    pub fn of_image(image: &ProcessImage, overrides: &Overrides, cache: &FileCache) -> Result<Self> {
        let lib = overrides.lib_object(image)?;
        let allocator = choose(&image.objects, lib, overrides.prefix.as_deref(), cache);
        let allocator = allocator.with_context(|| match image.pid {
            Some(pid) => format!("finding the allocator of pid {pid}"),
            None => format!(
                "finding the allocator of {}",
                image.executable().map(|o| o.path.display().to_string()).unwrap_or_default()
            ),
        })?;
        Ok(Self { map_calls: MapCalls::of_image(image, cache), ..allocator })
    }

    /// The allocator a library file provides, if it provides one (plain or with a known prefix).
    pub fn of_file(object: &ObjectFile, cache: &FileCache) -> Option<Self> {
        let allocator = choose(std::slice::from_ref(object), None, None, cache).ok()?;
        Some(Self { map_calls: MapCalls::of_file(object, cache), ..allocator })
    }

    fn from_object(object: &ObjectFile, prefix: &str, cache: &FileCache) -> Result<Option<Self>> {
        let entry_points = cache.entry_points(object, prefix)?;
        let defines_malloc = entry_points.iter().any(|e| e.entry.symbol == "malloc");
        Ok(defines_malloc.then(|| Self {
            kind: kind_of(&object.path, prefix),
            path: object.path.clone(),
            host_path: object.host_path.clone(),
            entry_points: entry_points.to_vec(),
            object: object.clone(),
            map_calls: None,
        }))
    }
}

/// An allocator with a known prefix in the program itself wins (`executables_prefixed_allocator`);
/// else the first object in search order that defines malloc, as for the dynamic linker; failing
/// that, an allocator with a known prefix anywhere.
fn choose(
    objects: &[ObjectFile],
    lib: Option<ObjectFile>,
    prefix: Option<&str>,
    cache: &FileCache,
) -> Result<Allocator> {
    if let Some(lib) = lib {
        let prefixes: Vec<&str> = match prefix {
            Some(prefix) => vec![prefix],
            None => std::iter::once("").chain(KNOWN_PREFIXES.iter().map(|(p, _)| *p)).collect(),
        };
        for prefix in prefixes {
            if let Some(allocator) = Allocator::from_object(&lib, prefix, cache)? {
                return Ok(allocator);
            }
        }
        bail!(
            "{} defines no {}malloc; name the symbol prefix with --allocator (e.g. --allocator je_)",
            lib.path.display(),
            prefix.unwrap_or("")
        );
    }
    let prefixes: Vec<&str> = match prefix {
        Some(prefix) => vec![prefix],
        None => std::iter::once("").chain(KNOWN_PREFIXES.iter().map(|(p, _)| *p)).collect(),
    };
    // Objects that are not ELF (or unreadable) cannot be the allocator.
    let defined =
        |object: &ObjectFile, prefix: &str| Allocator::from_object(object, prefix, cache).ok().flatten();
    let first_defining = |prefix: &str| objects.iter().find_map(|object| defined(object, prefix));
    if prefix.is_none() {
        if let Some(own) = executables_prefixed_allocator(objects, defined) {
            return Ok(own);
        }
    }
    if let Some(allocator) = prefixes.iter().find_map(|prefix| first_defining(prefix)) {
        return Ok(allocator);
    }
    bail!(
        "no loaded object defines {}malloc; name the allocator's file with --lib PATH and its symbol \
         prefix with --allocator",
        prefix.unwrap_or("")
    )
}

/// An allocator with a known prefix built into the program itself (Rust's tikv-jemallocator,
/// `_rjem_malloc`; a redis built with its own `je_malloc`), where the program does not define
/// plain malloc: the program's own code calls it, and the C library's malloc only serves the
/// libraries. It wins over a plain malloc found later in search order. Only the prefixes of
/// allocators a program builds in to call them everywhere: CPython 3.13 builds in mimalloc
/// (`mi_malloc`) and uses it only when free-threaded.
fn executables_prefixed_allocator(
    objects: &[ObjectFile],
    defined: impl Fn(&ObjectFile, &str) -> Option<Allocator>,
) -> Option<Allocator> {
    const BUILT_IN_FOR_EVERY_CALL: [&str; 2] = ["_rjem_", "je_"];
    let executable = objects.first()?;
    if defined(executable, "").is_some() {
        return None;
    }
    BUILT_IN_FOR_EVERY_CALL.iter().find_map(|prefix| defined(executable, prefix))
}

fn kind_of(path: &Path, prefix: &str) -> String {
    if let Some((_, name)) = KNOWN_PREFIXES.iter().find(|(p, _)| *p == prefix) {
        return (*name).to_owned();
    }
    let file = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    for name in ["jemalloc", "tcmalloc", "mimalloc"] {
        if file.contains(name) {
            return name.to_owned();
        }
    }
    if is_libc(path) {
        "glibc".to_owned()
    } else {
        format!("malloc in {file}")
    }
}

fn is_libc(path: &Path) -> bool {
    path.file_name().and_then(|name| name.to_str()).is_some_and(|name| {
        name.starts_with("libc.so") || (name.starts_with("libc-") && name.ends_with(".so"))
    })
}

/// Allocator libraries installed in the system's library directories, which a program started
/// later may load: probing them up front traces such a program from its first allocation.
pub fn installed_allocator_libraries() -> Vec<PathBuf> {
    let mut found = Vec::new();
    for dir in SYSTEM_LIBRARY_DIRS {
        let Ok(entries) = fs::read_dir(dir) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let allocator = ["libjemalloc.so", "libtcmalloc", "libmimalloc"]
                .iter()
                .any(|prefix| name.starts_with(prefix));
            if (allocator && name.contains(".so")) || name == "libc.so.6" {
                found.push(entry.path());
            }
        }
    }
    found
}

/// Where memtrace's probes sit in an allocator library (`path` on the host): every entry point it
/// defines, then the mapping calls where it defines them, each by its symbol.
pub fn probe_points_in(path: &Path, cache: &FileCache) -> Result<Vec<(String, ProbePoint)>> {
    let object = super::Root::host().open(path)?;
    let entry_points = cache.entry_points(&object, "")?;
    let mut points: Vec<(String, ProbePoint)> =
        entry_points.iter().map(|point| (point.name.clone(), point.probe.clone())).collect();
    if let Some(calls) = MapCalls::of_file(&object, cache) {
        points.extend(calls.sites.iter().map(|site| (site.function.symbol().to_owned(), site.probe.clone())));
    }
    Ok(points)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::{process::elf::ElfObject, process::entry_points::resolve_entry_points};

    fn own_libc() -> PathBuf {
        crate::process::procfs::mappings(std::process::id())
            .unwrap()
            .into_iter()
            .map(|m| m.path)
            .find(|path| is_libc(path))
            .expect("tests run on glibc")
    }

    #[test]
    fn host_libc_provides_every_glibc_entry_point_once() {
        let data = fs::read(own_libc()).unwrap();
        let resolved = resolve_entry_points(&ElfObject::parse(&data).unwrap(), "").unwrap();
        let names: Vec<_> = resolved.iter().map(|r| r.entry.symbol).collect();
        for expected in ["malloc", "calloc", "realloc", "reallocarray", "posix_memalign", "memalign", "free"]
        {
            assert!(names.contains(&expected), "{expected} missing from {names:?}");
        }
        let offsets: HashSet<_> = resolved.iter().map(|r| r.offset).collect();
        assert_eq!(offsets.len(), resolved.len(), "an address is probed twice: {resolved:?}");
    }

    #[test]
    fn own_process_is_traced_through_glibc() {
        let cache = FileCache::default();
        let image = ProcessImage::of_process(std::process::id(), &cache).unwrap();
        let allocator = Allocator::of_image(&image, &Overrides::default(), &cache).unwrap();
        assert_eq!(allocator.kind, "glibc");
        let image = ProcessImage::of_command(&std::env::current_exe().unwrap(), &cache).unwrap();
        let command = Allocator::of_image(&image, &Overrides::default(), &cache).unwrap();
        assert_eq!(command.kind, "glibc");
    }

    #[test]
    fn a_lib_without_the_prefix_is_a_clear_error() {
        let overrides = Overrides { lib: Some(own_libc()), prefix: Some("je_".into()) };
        let cache = FileCache::default();
        let image = ProcessImage::of_process(std::process::id(), &cache).unwrap();
        let err = Allocator::of_image(&image, &overrides, &cache).unwrap_err();
        assert!(format!("{err:#}").contains("defines no je_malloc"), "{err:#}");
        let overrides = Overrides { lib: Some("/dev/zero".into()), prefix: None };
        let err = Allocator::of_image(&image, &overrides, &cache).unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains("--lib /dev/zero") && text.contains("not a regular file"), "{text}");
    }

    #[test]
    fn allocator_names_map_to_prefixes() {
        assert_eq!(Overrides::prefix_for("glibc"), "");
        assert_eq!(Overrides::prefix_for("jemalloc"), "");
        assert_eq!(Overrides::prefix_for("je"), "je_");
        assert_eq!(Overrides::prefix_for("rjem"), "_rjem_");
        assert_eq!(Overrides::prefix_for("my_"), "my_");
    }
}
