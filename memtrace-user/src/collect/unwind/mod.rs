//! Unwind tables for stacks without frame pointers: each object file's .eh_frame and .debug_frame
//! become compact rows (`memtrace_common::UnwindRow`, 8 bytes) under a two-level index
//! (`memtrace_common::UnwindTableInfo`) that the BPF unwinder searches in a few bounded steps.
//! `build` makes a file's table (`rows`, by `rules` per architecture, then `index`); `kernel` keeps the kernel's copies current
//! for every traced process; `reference` is the same unwinder in userspace, which the tests run on
//! stopped processes.

#[cfg(test)]
mod aarch64_tests;
mod build;
mod index;
mod kernel;
#[cfg(test)]
mod reference;
mod rows;
mod rules;
#[cfg(test)]
mod tests;

pub use kernel::KernelTables;
