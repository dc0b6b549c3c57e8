//! What the unwinder needs to read an interpreter's frames, and what it copies of them: CPython's
//! (`PythonLayout`, `PythonProcess`, `PythonCode`) and Perl's (`PerlLayout`, `PerlProcess`,
//! `ThreadKeys`, `PerlSub`), their code named alike (`InterpreterCodeKey`).

/// Python frames read per stack at most (innermost first); deeper ones are left out.
pub const PYTHON_MAX_FRAMES: usize = 32;
/// The frames the Python walk looks at, at most: the Python ones it keeps, 3.13's shim frames
/// (one a run of the eval loop) between them, and one more, which says whether they were cut.
pub const PYTHON_MAX_STEPS: u32 = 2 * PYTHON_MAX_FRAMES as u32 + 1;
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

/// Where Perl 5.36 keeps what the unwinder reads: byte offsets into its structs, from its own
/// headers (`offsetof`, as Debian's perl is built: threads and multiplicity, x86-64).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerlLayout {
    /// `PerlInterpreter.Icurcop` (the statement running), `.Icurstackinfo`.
    pub interp_curcop: u32,
    pub interp_curstackinfo: u32,
    /// `.Iphase` (an enum, 4 bytes) and `PERL_PHASE_RUN`: the main program runs (not compiled,
    /// constructed or destructed).
    pub interp_phase: u32,
    pub phase_run: u32,
    /// `PERL_SI.si_cxstack`, `.si_prev`, `.si_cxix` (the innermost context's index, I32).
    pub si_cxstack: u32,
    pub si_prev: u32,
    pub si_cxix: u32,
    /// `sizeof(PERL_CONTEXT)`; its `blk_oldcop` (the caller's statement) and `blk_sub.cv`. Its
    /// first word holds the type (`cx_type & CXTYPEMASK`) and, in bytes 2 and 3, `blk_u16`, whose
    /// bits from 7 up are an eval's op type (`CxOLD_OP_TYPE`).
    pub context_size: u32,
    pub context_oldcop: u32,
    pub context_sub_cv: u32,
    /// `CXt_SUB`, `CXt_EVAL`, `CXTYPEMASK`, and `OP_REQUIRE`.
    pub type_sub: u32,
    pub type_eval: u32,
    pub type_mask: u32,
    pub op_require: u32,
    /// `COP.cop_line` (U32) and `.cop_file` (a char pointer, with threads).
    pub cop_line: u32,
    pub cop_file: u32,
    /// `XPVCV.xcv_gv_u` (the sub's GV; its name's HEK for a lexical sub), `.xcv_file`,
    /// `.xcv_flags` (U32), `.xcv_stash`; `CVf_NAMED`.
    pub cv_gv: u32,
    pub cv_file: u32,
    pub cv_flags: u32,
    pub cv_stash: u32,
    pub cv_named: u32,
    /// `XPVGV.xiv_u.xivu_namehek` (the GV's name) and `.xnv_u.xgv_stash` (its package).
    pub gv_name: u32,
    pub gv_stash: u32,
    /// The stash's body: `xpvhv_with_aux.xhv_aux.xhv_name_u` and `.xhv_name_count` (I32).
    pub stash_name: u32,
    pub stash_name_count: u32,
    /// `HEK.hek_key`: a name's characters.
    pub hek_key: u32,
}

/// A process running Perl: the address of its `PL_curinterp` (the main thread's interpreter), of
/// its `PL_thr_key` (the thread-specific key each thread's interpreter is kept under, 0 where it
/// has none or its C library's keys are not known), the C library's thread keys, and the
/// version's layout.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerlProcess {
    pub curinterp: u64,
    pub thr_key: u64,
    pub keys: ThreadKeys,
    pub layout: PerlLayout,
}

/// Where a C library keeps a thread's thread-specific data (what `pthread_getspecific` returns),
/// as glibc describes it to libthread_db (its `_thread_db_*` symbols): the thread's `struct
/// pthread` (at the thread pointer, the FS base on x86-64) holds at `specific` pointers to blocks
/// of `keys_per_block` key records of `record_size` bytes each, whose `data` is the value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadKeys {
    pub specific: u32,
    pub keys_per_block: u32,
    pub record_size: u32,
    pub data: u32,
}

/// What the kernel copies of a Perl frame's code the first time a stack holds it: a sub's package,
/// name and file; another kind's file alone (NUL-terminated, cut to fit).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PerlSub {
    pub package: [u8; 64],
    pub name: [u8; 64],
    pub file: [u8; 192],
    /// 1 once the kernel has written the rest (userspace takes only complete records).
    pub complete: u32,
    pub _pad: u32,
}

/// Perl frames read per stack at most (they share `PYTHON_MAX_FRAMES` slots); the contexts looked
/// at for them, at most.
pub const PERL_MAX_CONTEXTS: u32 = 128;

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
    unsafe impl aya::Pod for super::InterpreterCodeKey {}
    unsafe impl aya::Pod for super::PythonCode {}
    unsafe impl aya::Pod for super::PerlProcess {}
    unsafe impl aya::Pod for super::PerlSub {}
}

const _: () = assert!(PYTHON_MAX_FRAMES.is_power_of_two());
const _: () = assert!(PYTHON_KNOWN_CODES.is_power_of_two());
const _: () = assert!(core::mem::size_of::<PythonLayout>().is_multiple_of(8));
const _: () = assert!(core::mem::size_of::<PerlLayout>().is_multiple_of(8));
