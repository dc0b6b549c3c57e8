//! What the unwinder needs to read CPython's frames, and what it copies of them: where a version
//! keeps them (`PythonLayout`), a process's runtime (`PythonProcess`) and a code object's names
//! (`PythonCode`).

use super::INTERPRETER_MAX_FRAMES;

/// The frames the Python walk looks at, at most: the Python ones it keeps, 3.13's shim frames
/// (one a run of the eval loop) between them, and one more, which says whether they were cut.
pub const PYTHON_MAX_STEPS: u32 = 2 * INTERPRETER_MAX_FRAMES as u32 + 1;
/// Python code objects whose names the kernel keeps at once (all processes).
pub const PYTHON_MAX_CODES: u32 = 16_384;

/// Where a CPython version keeps what the unwinder reads: byte offsets into its structs (for 3.11,
/// from its own headers; for 3.13, from the interpreter's own `_Py_DebugOffsets`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PythonLayout {
    /// 0: the thread is the GIL holder, `_PyRuntime.gilstate.tstate_current` (3.11); 1: the
    /// thread is found in its interpreter's list of threads (3.12 and later keep the current
    /// one in a thread-local).
    pub thread_list: u32,
    /// `_PyRuntime.gilstate.tstate_current`: the thread state holding the GIL (3.11).
    pub runtime_tstate_current: u32,
    /// `_PyRuntime.interpreters.head`, `PyInterpreterState.threads.head`, `PyThreadState.next`
    /// (the list of threads), and `PyThreadState.current_frame` (3.13).
    pub runtime_interpreters_head: u32,
    pub interp_threads_head: u32,
    pub tstate_next: u32,
    pub tstate_current_frame: u32,
    /// `PyThreadState.native_thread_id` (the thread's tid), `.cframe`, `_PyCFrame.current_frame`
    /// (3.11).
    pub tstate_native_thread_id: u32,
    pub tstate_cframe: u32,
    pub cframe_current_frame: u32,
    /// `_PyInterpreterFrame.f_code` (3.13: `f_executable`), `.previous`, `.prev_instr` (3.13:
    /// `instr_ptr`), `.is_entry` (3.11), `.owner` (3.13; a byte), all within 72 bytes of the
    /// first (checked by userspace); the owner of a shim frame its eval loop runs from
    /// (`FRAME_OWNED_BY_CSTACK`, 3.13).
    pub frame_code: u32,
    pub frame_previous: u32,
    pub frame_prev_instr: u32,
    pub frame_is_entry: u32,
    pub frame_owner: u32,
    pub owner_cstack: u32,
    /// `PyCodeObject.co_name`, `.co_filename` (neighbouring words, in either order: checked by
    /// userspace), `.co_firstlineno`, `.co_linetable`, `.co_code_adaptive` (its instructions).
    pub code_name: u32,
    pub code_filename: u32,
    pub code_firstlineno: u32,
    pub code_linetable: u32,
    pub code_instructions: u32,
    /// `PyASCIIObject.state` and the size of a compact ASCII string's header (its characters
    /// follow); the state's bits that say compact and ASCII.
    pub unicode_state: u32,
    pub unicode_ascii_data: u32,
    pub unicode_compact_ascii: u32,
    /// `PyVarObject.ob_size` and `PyBytesObject.ob_sval`.
    pub bytes_size: u32,
    pub bytes_data: u32,
    pub _pad: u32,
}

/// The words of an interpreter frame the unwinder reads at once, from its `frame_code`.
pub const PYTHON_FRAME_WORDS: usize = 9;
/// Code objects each scratch slot remembers having put into PYTHON_CODES (or found there), so
/// that a frame of one of them costs no lookup: a walk's frames mostly repeat the last walk's.
pub const PYTHON_KNOWN_CODES: usize = 64;
/// Thread states looked at to find the allocating thread's (3.13), at most.
pub const PYTHON_MAX_THREADS: u32 = 256;
/// Threads whose thread states the kernel remembers (3.13; all processes).
pub const PYTHON_CACHED_THREADS: u32 = 4096;

/// A process running CPython: where its runtime state is, and the version's layout.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PythonProcess {
    /// The address of `_PyRuntime` in the process.
    pub runtime: u64,
    pub layout: PythonLayout,
}

/// What the kernel copies of a code object the first time a stack holds it, so that it is named
/// after its process is gone: its name and file (NUL-terminated, cut to fit; empty where not
/// compact ASCII), its first line and its location table (cut to fit; lines past it are the
/// last line it gives).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PythonCode {
    pub name: [u8; 64],
    pub filename: [u8; 192],
    pub linetable: [u8; 512],
    /// Bytes of `linetable` copied.
    pub linetable_len: u32,
    pub firstlineno: u32,
    /// 1 once the kernel has written the rest (userspace takes only complete records).
    pub complete: u32,
    pub _pad: u32,
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: #[repr(C)] plain integers and byte arrays, padding spelled out as fields.
    unsafe impl aya::Pod for super::PythonProcess {}
    unsafe impl aya::Pod for super::PythonCode {}
}

const _: () = assert!(PYTHON_KNOWN_CODES.is_power_of_two());
const _: () = assert!(core::mem::size_of::<PythonLayout>().is_multiple_of(8));
