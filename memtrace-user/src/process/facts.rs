//! What memtrace learns from an object file, read once per file ([`FileId`]) however many processes
//! map it: under `--all` a libc mapped by 300 processes is parsed once. Parsing reads only the
//! headers and sections a question needs, never the whole file.

use std::{
    collections::HashMap,
    hash::Hash,
    sync::{Arc, Mutex, PoisonError},
};

use anyhow::{anyhow, Context, Result};
use memtrace_common::ThreadKeys;

use super::{
    entry_points::{resolve_entry_points, ResolvedEntryPoint},
    file::{FileId, ObjectFile},
    map_sites::{resolve_library_loads, resolve_map_sites, LoadSite, MapSite},
    sparse::{self, SparseImage},
    thread_keys::thread_keys,
};
use crate::{
    interpreters::image::Interpreter,
    process::elf::{DynamicInfo, ElfObject},
};

/// Files remembered before the cache starts afresh: far more than a machine maps at once, and a
/// bound on memtrace's memory over a long `--all` run that sees many short-lived programs.
const MAX_FILES: usize = 16_384;

/// What one object file is, for link order and symbolization.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileFacts {
    /// A 64-bit ELF file: the dynamic linker skips others, and so does memtrace.
    pub is_elf64: bool,
    pub dynamic: DynamicInfo,
    pub build_id: Option<[u8; 20]>,
}

/// Facts about object files, by identity; shared (cheaply cloned) between the threads that
/// resolve images.
#[derive(Clone, Default)]
pub struct FileCache {
    inner: Arc<Mutex<Cached>>,
}

#[derive(Default)]
struct Cached {
    facts: HashMap<FileId, Arc<FileFacts>>,
    /// (file, symbol prefix) -> the allocator entry points it defines, or why they cannot be used.
    entry_points: HashMap<(FileId, String), EntryPointsOrError>,
    /// file -> the mapping calls it defines, or why they cannot be read.
    map_sites: HashMap<FileId, MapSitesOrError>,
    /// file -> the interpreter it is, if one.
    interpreters: HashMap<FileId, Result<Arc<Option<Interpreter>>, String>>,
    /// file -> where the C library it is keeps thread-specific data, if one.
    thread_keys: HashMap<FileId, Result<Arc<Option<ThreadKeys>>, String>>,
    /// file -> the file offset of the fork it defines, if one.
    forks: HashMap<FileId, Result<Arc<Option<u64>>, String>>,
    /// file -> the calls that load a library it defines (dlopen, dlmopen).
    library_loads: HashMap<FileId, Result<Arc<Vec<LoadSite>>, String>>,
}

type MapSitesOrError = Result<Arc<Vec<MapSite>>, String>;

/// A file's allocator entry points for one prefix, or why they cannot be read.
type EntryPointsOrError = Result<Arc<Vec<ResolvedEntryPoint>>, String>;

impl FileCache {
    pub fn facts(&self, object: &ObjectFile) -> Arc<FileFacts> {
        if let Some(facts) = self.lock().facts.get(&object.id) {
            return facts.clone();
        }
        let facts = Arc::new(read_facts(object));
        remember(&mut self.lock().facts, object.id, facts.clone());
        facts
    }

    /// The allocator entry points `object` defines with symbol prefix `prefix`.
    pub fn entry_points(&self, object: &ObjectFile, prefix: &str) -> Result<Arc<Vec<ResolvedEntryPoint>>> {
        self.symbols_once(
            |cached| &mut cached.entry_points,
            (object.id, prefix.to_owned()),
            || read_symbols(object, |elf| resolve_entry_points(elf, prefix)),
        )
    }

    /// The mapping calls (mmap, munmap, mremap) `object` defines.
    pub fn map_sites(&self, object: &ObjectFile) -> Result<Arc<Vec<MapSite>>> {
        self.symbols_once(
            |cached| &mut cached.map_sites,
            object.id,
            || read_symbols(object, resolve_map_sites),
        )
    }

    /// The interpreter (CPython, Perl) `object` is, if it is one.
    pub fn interpreter(&self, object: &ObjectFile) -> Option<Arc<Option<Interpreter>>> {
        let read = || read_symbols(object, |elf| Ok(Interpreter::of(elf)));
        self.symbols_once(|cached| &mut cached.interpreters, object.id, read).ok()
    }

    /// Where `object`, a C library, keeps each thread's thread-specific data, if it says.
    pub fn thread_keys(&self, object: &ObjectFile) -> Option<ThreadKeys> {
        let read = || read_symbols(object, |elf| Ok(thread_keys(elf)));
        *self.symbols_once(|cached| &mut cached.thread_keys, object.id, read).ok()?
    }

    /// The file offset of the `fork` that `object` (a C library) defines, if it defines one.
    pub fn fork(&self, object: &ObjectFile) -> Option<u64> {
        let read = || {
            read_symbols(object, |elf| {
                let fork = elf.defined_functions(|name| name == b"fork").into_iter().next();
                Ok(fork.and_then(|fork| elf.code_file_offset(fork.address)))
            })
        };
        *self.symbols_once(|cached| &mut cached.forks, object.id, read).ok()?
    }

    /// The calls that load a library (dlopen, dlmopen) `object` (a C library) defines.
    pub fn library_loads(&self, object: &ObjectFile) -> Result<Arc<Vec<LoadSite>>> {
        let read = || read_symbols(object, resolve_library_loads);
        self.symbols_once(|cached| &mut cached.library_loads, object.id, read)
    }

    /// What `read` finds, or why it cannot, remembered in `table` under `key`.
    fn symbols_once<K: Eq + Hash, T>(
        &self,
        table: impl Fn(&mut Cached) -> &mut HashMap<K, Result<Arc<T>, String>>,
        key: K,
        read: impl FnOnce() -> Result<T>,
    ) -> Result<Arc<T>> {
        if let Some(known) = table(&mut self.lock()).get(&key) {
            return known.clone().map_err(|err| anyhow!(err));
        }
        let found = read().map(Arc::new).map_err(|err| format!("{err:#}"));
        remember(table(&mut self.lock()), key, found.clone());
        found.map_err(|err| anyhow!(err))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cached> {
        // A panic elsewhere leaves plain data behind, still usable.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Keeps `value` under `key`, starting the table afresh when it holds MAX_FILES files.
fn remember<K: Eq + Hash, V>(table: &mut HashMap<K, V>, key: K, value: V) {
    if table.len() >= MAX_FILES {
        table.clear();
    }
    table.insert(key, value);
}

/// Reads an object file's facts; a file that is not ELF, or not all of it valid, has fewer.
pub fn read_facts(object: &ObjectFile) -> FileFacts {
    let facts = SparseImage::of(object, sparse::FACTS).and_then(|image| {
        image.with_elf(|elf| {
            Ok(FileFacts {
                is_elf64: true,
                dynamic: elf.dynamic_info().unwrap_or_default(),
                build_id: elf.build_id(),
            })
        })
    });
    facts.unwrap_or_default()
}

/// What `resolve` finds in an object file's symbol tables.
fn read_symbols<T>(object: &ObjectFile, resolve: impl FnOnce(&ElfObject<'_>) -> Result<T>) -> Result<T> {
    let image = SparseImage::of(object, sparse::SYMBOLS)
        .with_context(|| format!("reading {}", object.path.display()))?;
    image.with_elf(resolve).with_context(|| format!("reading the symbols of {}", object.path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_are_read_once_per_file() {
        let exe = std::env::current_exe().unwrap();
        let cache = FileCache::default();
        let first = cache.facts(&ObjectFile::open_host(&exe).unwrap());
        assert!(first.is_elf64 && first.build_id.is_some(), "{first:?}");
        assert!(first.dynamic.needed.iter().any(|name| name.starts_with("libc.so")), "{first:?}");
        // A second opening of the same file is the same entry.
        let second = cache.facts(&ObjectFile::open_host(&exe).unwrap());
        assert!(Arc::ptr_eq(&first, &second));
        let not_elf = cache.facts(&ObjectFile::open_host(std::path::Path::new("/etc/passwd")).unwrap());
        assert!(!not_elf.is_elf64);
    }
}
