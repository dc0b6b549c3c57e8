//! Finds the C library's mapping calls (mmap, munmap, mremap) that a process makes its anonymous
//! mappings through, as the dynamic linker resolves `mmap`: libc for a dynamic program, the
//! executable for a static one. Allocators other than the C library's (jemalloc, tcmalloc) map
//! through it too, so these are probed whatever the allocator. Where each call sits in a file is
//! map_sites' work, read once per file through the file cache.

use memtrace_common::MapFunction;

use super::{
    facts::FileCache,
    file::ObjectFile,
    image::ProcessImage,
    map_sites::{LoadSite, MapSite},
};

/// The object that defines a process's mapping calls, with their sites.
#[derive(Debug, Clone)]
pub struct MapCalls {
    pub sites: Vec<MapSite>,
    /// The file offset of the same file's `fork`, where a followed tree's new processes are
    /// caught as they return from it.
    pub fork: Option<u64>,
    /// The same file's dlopen and dlmopen, where a traced process that loads a library is held
    /// until the library's unwind table is in.
    pub library_loads: Vec<LoadSite>,
    /// The file, kept open: the probes attach at its `host_path`.
    pub object: ObjectFile,
}

impl MapCalls {
    /// The first of a process's objects, in symbol search order, that defines every mapping call.
    pub fn of_image(image: &ProcessImage, cache: &FileCache) -> Option<Self> {
        image.objects.iter().find_map(|object| Self::of_file(object, cache))
    }

    /// The mapping calls `object` defines, if it defines them all.
    pub fn of_file(object: &ObjectFile, cache: &FileCache) -> Option<Self> {
        let sites = cache.map_sites(object).ok()?;
        (sites.len() == MapFunction::ALL.len()).then(|| Self {
            sites: sites.to_vec(),
            fork: cache.fork(object),
            library_loads: cache.library_loads(object).map(|sites| sites.to_vec()).unwrap_or_default(),
            object: object.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_mapping_calls_are_libcs() {
        let cache = FileCache::default();
        let image = ProcessImage::of_process(std::process::id(), &cache).unwrap();
        let calls = MapCalls::of_image(&image, &cache).expect("libc defines mmap, munmap and mremap");
        let name = calls.object.path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("libc"), "{name}");
        let offsets: std::collections::HashSet<_> = calls.sites.iter().map(|site| site.offset).collect();
        assert_eq!(offsets.len(), 3, "three distinct functions: {:?}", calls.sites);
        // The executable imports mmap and defines none.
        assert!(MapCalls::of_file(image.executable().unwrap(), &cache).is_none());
    }
}
