//! Perl: which files are its interpreter and where a process keeps its frames (image.rs), its
//! tables in the kernel (tables.rs), and the names of its subs as the kernel copies them and how
//! its frames are shown (names.rs). Its kernel side is memtrace-ebpf/src/interpreters/perl.rs, its
//! shared types memtrace-common's interpreters/perl.rs.

pub mod image;
mod names;
mod tables;

pub use self::{
    image::with_thread_keys,
    names::{PerlNames, LANGUAGE},
    tables::Perl,
};
