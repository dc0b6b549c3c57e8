//! Map keys, map values and constants shared by the BPF programs (`memtrace-ebpf`) and the loader
//! (`memtrace-user`). Everything here is `#[repr(C)]` so both sides agree on the layout byte for byte.
//!
//! Each concern is a module of its own, re-exported here whole: every item is named
//! `memtrace_common::Item`, whichever module holds it.
#![cfg_attr(not(test), no_std)]

pub mod arguments;
pub mod programs;

mod allocator;
mod interpreters;
mod live;
mod mappings;
mod processes;
mod stacks;
mod unwind;
mod usdt;

pub use allocator::*;
pub use arguments::{ArgumentRegisters, ArgumentsRead};
pub use interpreters::*;
pub use live::*;
pub use mappings::*;
pub use processes::*;
pub use stacks::*;
pub use unwind::*;
pub use usdt::*;
