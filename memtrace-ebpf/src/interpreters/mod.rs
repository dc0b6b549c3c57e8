//! The interpreters whose frames the kernel side reads, one module each (python.rs: CPython;
//! perl.rs: Perl), what they share (frames.rs: the frames as read, stored after a stack's native
//! frames), and one entry point, [`read_frames`], that runs the process's interpreter's walk: a
//! new interpreter adds its module, its cursor and its line in `read_frames`.

mod frames;
mod perl;
mod python;

use memtrace_common::interpreter;

pub(crate) use self::frames::InterpreterFrames;
use self::{perl::PerlCursor, python::PythonCursor};

/// Where each interpreter's walk is, in the run's scratch slot (scratch.rs).
#[repr(C)]
pub(crate) struct InterpreterCursors {
    python: PythonCursor,
    perl: PerlCursor,
}

/// Reads the frames of process `tgid`'s interpreter, of kind `kind` (`interpreter::PYTHON`,
/// `PERL`: its mapping table's), into `frames`; false where it runs none.
#[inline(always)]
pub(crate) fn read_frames(
    kind: u32,
    tgid: u32,
    started_ns: u64,
    frames: &mut InterpreterFrames,
    cursors: &mut InterpreterCursors,
) -> bool {
    if kind == interpreter::PYTHON {
        python::read_python_frames(tgid, started_ns, frames, &mut cursors.python);
    } else if kind == interpreter::PERL {
        perl::read_perl_frames(tgid, frames, &mut cursors.perl);
    } else {
        return false;
    }
    true
}
