//! What the unwinder needs to read Perl's frames, and what it copies of them: where a version
//! keeps them (`PerlLayout`), a process's interpreter and its C library's thread keys
//! (`PerlProcess`, `ThreadKeys`) and a sub's names (`PerlSub`).

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
/// pthread` holds at `specific` pointers to blocks of `keys_per_block` key records of
/// `record_size` bytes each, whose `data` is the value. `specific` is counted from the thread
/// pointer: `struct pthread` lies at it on x86-64 (the FS base), and just below it on arm64
/// (`TPIDR_EL0` points past it, at the TCB), so there it is negative.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadKeys {
    pub specific: i32,
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

/// Perl frames read per stack at most (`INTERPRETER_MAX_FRAMES`); the contexts looked
/// at for them, at most.
pub const PERL_MAX_CONTEXTS: u32 = 128;

#[cfg(feature = "user")]
mod pod {
    // SAFETY: #[repr(C)] plain integers and byte arrays, padding spelled out as fields.
    unsafe impl aya::Pod for super::PerlProcess {}
    unsafe impl aya::Pod for super::PerlSub {}
}

const _: () = assert!(core::mem::size_of::<PerlLayout>().is_multiple_of(8));
