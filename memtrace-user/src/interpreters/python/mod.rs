//! CPython: which files are its interpreter and where a process keeps its frames (image.rs), its
//! tables in the kernel (tables.rs), the names of its code objects as the kernel copies them and
//! how its frames are shown (names.rs), and their lines (lines.rs). Its kernel side is
//! memtrace-ebpf/src/interpreters/python.rs, its shared types memtrace-common's
//! interpreters/python.rs.

pub mod image;
mod lines;
mod names;
mod tables;

pub use self::{
    names::{PythonNames, LANGUAGE},
    tables::Python,
};
