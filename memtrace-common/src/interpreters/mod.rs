//! The interpreters whose frames the unwinder reads, each in a module of its own (python.rs:
//! CPython; perl.rs: Perl), and what they share: the kinds a process's mapping table names
//! (`interpreter`), how many frames a stack keeps, and how a frame's code is named
//! (`InterpreterCodeKey`).

mod perl;
mod python;

pub use perl::*;
pub use python::*;

/// Interpreter frames read per stack at most, whichever the interpreter (innermost first); deeper
/// ones are left out.
pub const INTERPRETER_MAX_FRAMES: usize = 32;

/// A NUL-terminated string the kernel copied (a name of `PythonCode`, `PerlSub`), without its NUL
/// and what follows it.
pub fn until_nul(bytes: &[u8]) -> &[u8] {
    bytes.split(|&b| b == 0).next().unwrap_or(bytes)
}

/// The interpreters whose frames the unwinder reads (`UnwindMappings::interpreter`).
pub mod interpreter {
    pub const NONE: u32 = 0;
    pub const PYTHON: u32 = 1;
    pub const PERL: u32 = 2;
}

/// A code object (Python) or sub (Perl) of a process, as the kernel names it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct InterpreterCodeKey {
    pub tgid: u32,
    pub _pad: u32,
    pub code: u64,
    /// What tells the code object from another freed before it at the same address (Python's:
    /// its name's and file's string objects; 0 for Perl).
    pub fingerprint: u64,
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: #[repr(C)] plain integers, padding spelled out as a field.
    unsafe impl aya::Pod for super::InterpreterCodeKey {}
}

const _: () = assert!(INTERPRETER_MAX_FRAMES.is_power_of_two());
