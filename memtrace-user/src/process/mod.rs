//! A process's image, resolved once: its object files in link order, each opened safely inside the
//! process's root (or as mapped) and known by identity ([`FileId`]), with per-file facts (dynamic
//! section, build ID, allocator entry points, mapping calls) cached by identity ([`FileCache`]).
//! Allocator discovery (allocator), USDT attachment (usdt), symbol indexing (symbolize) and the
//! exec watcher (follow) all read a [`ProcessImage`] instead of working the objects out again.
//!
//! The files, lowest first: `resolve` (paths inside a root), `file` (identity, root, opened
//! object), `sparse` (the parts of an ELF file a question needs), `entry_points` and `map_sites`
//! (what one ELF file defines, with `probe_point` placing their probes), `facts` (the per-file cache of those), `objects` (link order),
//! `image` (a process's objects), and above them `allocator` and `map_calls`, which choose per
//! process what to probe. Beside them, what /proc and the process's memory say of its pages:
//! `smaps` (mappings with their resident bytes), `pagemap` (which pages are present) and `remote`
//! (reading words of its memory), and `cgroup` (which cgroup, container and pod it is in). Each imports from the file that defines what it uses; the `pub use`
//! below is for the rest of memtrace.

pub mod allocator;
pub mod cgroup;
pub mod containerd;
pub mod elf;
pub mod entry_points;
mod facts;
mod file;
#[cfg(test)]
mod fuzz_tests;
mod image;
pub mod map_calls;
mod map_sites;
pub mod memcg;
mod objects;
pub mod pagemap;
pub mod probe_point;
pub mod procfs;
pub mod remote;
mod resolve;
pub mod smaps;
mod sparse;
pub mod thread_keys;
pub mod threads;

use std::path::Path;

pub use self::{
    facts::FileCache,
    file::{FileId, ObjectFile, Root},
    image::ProcessImage,
    objects::open_mapping,
    sparse::{SparseImage, NOTES, SYMBOLS},
};

/// The identity of the file at a path of memtrace's own file system (for the USDT code, whose
/// objects carry a path that reaches the file they opened).
pub fn file_identity(path: &Path) -> Option<FileId> {
    FileId::of_path(path)
}

/// Raises the soft limit of open files to the hard one: system-wide, memtrace holds each object
/// file it has not finished with open (uprobes and readers reach it through its descriptor).
pub fn raise_open_file_limit() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write only the struct they are given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}
