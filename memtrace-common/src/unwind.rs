//! The .eh_frame unwinder's tables: the rows and page index userspace builds for each object file
//! (`UnwindRow`, `UnwindTableInfo`), how the kernel holds them by file and by process
//! (`UnwindFile`, `UnwindMappings`), and why a stack ended (`unwind_stop`, `interpreter_stop`).

// ---- Unwind tables ------------------------------------------------------------------------------
//
// Userspace turns an object file's .eh_frame (and .debug_frame) into `UnwindRow`s indexed by page
// (memtrace-user/src/collect/unwind/); the BPF unwinder looks rows up by file offset and steps one frame
// with each. Addresses here are FILE OFFSETS: for an ELF virtual address `v` inside an executable
// PT_LOAD, `v - p_vaddr + p_offset`; for a runtime address `a` inside a file mapping, `a - start +
// offset` (the mapping's start and file offset as /proc/PID/maps shows them). Both agree because
// the loader maps each PT_LOAD at a page-aligned `p_offset`.

/// Most rows a page's run may hold (`pages[p + 1] - pages[p] + 1`): the run is searched with at most
/// `UNWIND_SEARCH_STEPS` halvings. Tables are built so that no run is longer: each file gets the
/// largest page size whose runs fit (libc: 256-byte pages, runs up to 46 rows; python3.11: 512).
pub const UNWIND_MAX_RUN: u32 = 1 << UNWIND_SEARCH_STEPS;
/// Halvings of the binary search within one page's run (log2 of `UNWIND_MAX_RUN`).
pub const UNWIND_SEARCH_STEPS: u32 = 6;
/// Largest `UnwindTableInfo::page_shift` the builder chooses (4 KiB pages).
pub const UNWIND_MAX_PAGE_SHIFT: u8 = 12;
/// Smallest `UnwindTableInfo::page_shift` the builder chooses (16-byte pages).
pub const UNWIND_MIN_PAGE_SHIFT: u8 = 4;
/// `UnwindRow::rbp` when the caller's rbp cannot be recovered from this frame: an rbp-based CFA in
/// the caller's frame ends the stack.
pub const UNWIND_RBP_LOST: i8 = i8::MIN;

/// How the CFA (the caller's rsp after the return: the address just above the return address) is
/// found, in `UnwindRow::kind & UNWIND_CFA_MASK`. On arm64 `rsp` and `rbp` here stand for sp and
/// x29 (DWARF registers 31 and 29), and `rip` for pc.
pub mod unwind_kind {
    /// No unwind information covers this address (a gap between functions, or before the first):
    /// the lookup finds no row. The BPF side may fall back to frame pointers there.
    pub const NONE: u8 = 0;
    /// CFA = rsp + cfa_offset.
    pub const CFA_RSP: u8 = 1;
    /// CFA = rbp + cfa_offset.
    pub const CFA_RBP: u8 = 2;
    /// The expression of every x86-64 PLT entry (binutils' lazy PLT):
    /// CFA = rsp + cfa_offset + ((rip & 15) >= 11 ? 8 : 0). `rip` is the runtime address; its low 4
    /// bits equal the file offset's, since PT_LOAD segments are mapped page-aligned.
    pub const CFA_PLT: u8 = 3;
    /// The outermost frame (`_start`, thread entry: the return address is DW_CFA_undefined): the
    /// stack is whole and ends here.
    pub const END: u8 = 4;
    /// The function has unwind information that this format cannot express (a CFA in another
    /// register or computed by another expression, a frame over 64 KiB, a return address no
    /// `unwind_ra` rule places, a signal trampoline): the stack ends here, cut short.
    pub const UNSUPPORTED: u8 = 5;
}

/// `UnwindRow::kind`'s low bits: the CFA rule (`unwind_kind`).
pub const UNWIND_CFA_MASK: u8 = 7;
/// `UnwindRow::kind >> UNWIND_RA_SHIFT`: where the return address is (`unwind_ra`). Only CFA_RSP and
/// CFA_RBP rows carry one; NONE, CFA_PLT, END and UNSUPPORTED rows have 0 there.
pub const UNWIND_RA_SHIFT: u8 = 3;

/// Where a row finds the return address, in the high 5 bits of `UnwindRow::kind`. x86-64's `call`
/// always leaves it at CFA-8 (rule 0, so an x86-64 row is the same 8 bytes it was before arm64's
/// rules); arm64's `bl` leaves it in x30, which a function saves where its prologue chooses: GCC
/// stores the x29/x30 pair (the frame record) at the bottom of its frame, `stp x29, x30, [sp,
/// #-96]!` putting x30 at CFA-88, far below CFA-8 in a large frame; a leaf never saves it.
/// Measured on Debian 12's arm64 libc (19,178 CFI ranges): 13,686 of the 13,922 with x30 saved have
/// it in a frame record (12,915 within 1,016 bytes of the CFA), 157 others within CFA-240; 5,253 have
/// it in x30.
///
/// Why in `kind` rather than a field of its own: a field would make every row 12 bytes (`pc`'s
/// alignment rounds 9 up to 12), x86-64's too: UNWIND_ROWS would grow from 32 to 48 MiB (4 Mi rows
/// x 4 bytes more), Debian 12's x86-64 libc table by 28,274 x 4 = 113,096 bytes. In `kind` it costs
/// no byte; its cost is reach: a return address saved below CFA-240 outside a frame record, or a
/// frame record beyond the 1,016 bytes `rbp` reaches, is UNSUPPORTED (853 of libc's 19,178 ranges).
pub mod unwind_ra {
    /// Rules 0 to `DEEPEST`: the return address is at CFA - 8 * (rule + 1) (CFA-8 to CFA-240).
    pub const DEEPEST: u8 = 29;
    /// In the word above the caller's saved frame pointer (the frame record: rbp/x29 at CFA +
    /// 8 * `UnwindRow::rbp`, the return address at CFA + 8 * `rbp` + 8), as far as `rbp` reaches
    /// (1,016 bytes). Only with a saved frame pointer (`rbp` not 0 nor `UNWIND_RBP_LOST`).
    pub const FRAME_RECORD: u8 = 30;
    /// Still in the link register (arm64's x30: "same value", never saved by this frame): known in
    /// the innermost frame only, from the stopped thread's registers. In any outer frame x30 holds
    /// that frame's own return address (a caller's `bl` set it), so the stack ends there
    /// (`unwind_stop::UNSUPPORTED`).
    pub const LINK_REGISTER: u8 = 31;
}

/// One unwind row: from `pc` (a file offset) up to the next row's `pc`, how to step one frame.
/// 8 bytes. With `rsp`, `rbp` and `rip` of a frame (arm64: sp, x29, pc, and x30 in the innermost
/// frame), the BPF side and the userspace reference (memtrace-user/src/collect/unwind/reference.rs)
/// step to the caller's frame so:
///
/// 1. `cfa` per `kind & UNWIND_CFA_MASK` (see `unwind_kind`); NONE, END and UNSUPPORTED do not
///    step. CFA_RBP with an unknown rbp (a previous row said UNWIND_RBP_LOST) ends the stack.
/// 2. return address per `kind >> UNWIND_RA_SHIFT` (see `unwind_ra`): *(u64 *)(cfa - 8) on x86-64
///    (its return address column, r16, is always saved at CFA-8; rows where it is not are
///    UNSUPPORTED), a deeper slot, the frame record's or x30 on arm64, where pointer
///    authentication's signature above bit 48 is stripped. A return address of 0 ends the stack.
/// 3. caller's rbp = `rbp == 0` ? rbp (unchanged) : `rbp == UNWIND_RBP_LOST` ? unknown :
///    *(u64 *)(cfa + 8 * rbp).
/// 4. caller's rsp = cfa, caller's rip = return address. For every frame but the innermost, the
///    row is looked up at `rip - 1` (inside the call instruction, which may be the function's last).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct UnwindRow {
    /// File offset of the first instruction this row covers.
    pub pc: u32,
    /// Added to rsp or rbp to get the CFA (CFA_RSP, CFA_RBP, CFA_PLT); 0 otherwise.
    pub cfa_offset: u16,
    /// One of `unwind_kind` in the low 3 bits, an `unwind_ra` rule above them.
    pub kind: u8,
    /// Where the caller's rbp was saved, in 8-byte units from the CFA (e.g. -2: at CFA-16); 0 when
    /// rbp still holds the caller's value; `UNWIND_RBP_LOST` when it cannot be recovered.
    pub rbp: i8,
}

/// Where one file's rows and pages are, and how its pages are cut. A table is two arrays:
/// `rows` (`UnwindRow`, sorted by `pc`, starting with a row at `first_page << page_shift` and ending
/// with a NONE row at the end of the last function) and `pages` (`u32` row indices, `page_count +
/// 1` of them), where `pages[i]` is the index of the last row whose `pc <= (first_page + i) <<
/// page_shift`, so the rows that can cover an address in page `i` are `rows[pages[i]..=pages[i +
/// 1]]`: at most `UNWIND_MAX_RUN` of them.
///
/// The lookup of file offset `pc`, exactly as the BPF side implements it (reference:
/// `memtrace_user::unwind::index::lookup`):
///
/// ```text
/// page = pc >> page_shift                       // page_shift & 31 for the verifier
/// if page < first_page: no row
/// i = page - first_page
/// if i >= page_count: no row
/// lo = pages[i]; hi = pages[i + 1] + 1          // rows[lo].pc <= pc < rows[hi].pc (or hi = end)
/// repeat UNWIND_SEARCH_STEPS times:             // hi - lo <= UNWIND_MAX_RUN
///     if hi - lo <= 1: break
///     mid = lo + (hi - lo) / 2
///     if rows[mid].pc <= pc: lo = mid else: hi = mid
/// row = rows[lo]
/// if row.kind == NONE: no row
/// ```
///
/// Indices into `pages` and `rows` are relative to this file's table; the loader adds
/// `pages_start` and `rows_start` when the tables of many files share two large maps.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindTableInfo {
    /// Page number (`pc >> page_shift`) of `pages[0]`.
    pub first_page: u32,
    /// Pages indexed; `pages` holds one more entry than this.
    pub page_count: u32,
    /// Rows in the table.
    pub row_count: u32,
    /// Where this file's `pages[0]` is in a shared page map (set by the loader; 0 when alone).
    pub pages_start: u32,
    /// Where this file's `rows[0]` is in a shared row map (set by the loader; 0 when alone).
    pub rows_start: u32,
    /// log2 of the page size, between UNWIND_MIN_PAGE_SHIFT and UNWIND_MAX_PAGE_SHIFT.
    pub page_shift: u8,
    pub _pad: [u8; 3],
}

impl UnwindRow {
    /// The CFA rule: one of `unwind_kind`.
    pub const fn cfa_rule(&self) -> u8 {
        self.kind & UNWIND_CFA_MASK
    }

    /// Where the return address is: one of `unwind_ra`'s rules.
    pub const fn ra_rule(&self) -> u8 {
        self.kind >> UNWIND_RA_SHIFT
    }

    /// `kind` for CFA rule `cfa` (one of `unwind_kind`) and return address rule `ra` (`unwind_ra`).
    pub const fn kind_of(cfa: u8, ra: u8) -> u8 {
        cfa | ra << UNWIND_RA_SHIFT
    }
}

#[cfg(feature = "user")]
mod unwind_pod {
    // SAFETY: #[repr(C)] plain integers, padding spelled out as fields.
    unsafe impl aya::Pod for super::UnwindRow {}
    unsafe impl aya::Pod for super::UnwindTableInfo {}
}

const _: () = assert!(core::mem::size_of::<UnwindRow>() == 8);
// Every CFA rule fits below the return address rule, and every return address rule in the bits above.
const _: () =
    assert!(unwind_kind::UNSUPPORTED <= UNWIND_CFA_MASK && UNWIND_CFA_MASK == (1 << UNWIND_RA_SHIFT) - 1);
const _: () = assert!(unwind_ra::LINK_REGISTER as u32 == (u8::MAX >> UNWIND_RA_SHIFT) as u32);
// Rows have distinct `pc`s, so the smallest page's run (the row covering its start, then at most
// one row per byte) always fits: every table can be indexed.
const _: () = assert!((1u32 << UNWIND_MIN_PAGE_SHIFT) < UNWIND_MAX_RUN);
const _: () = assert!(core::mem::size_of::<UnwindTableInfo>() == 24);

// ---- Unwind tables in the kernel ----------------------------------------------------------------
//
// Userspace loads each object file's table once (by file identity) into two shared arrays
// (`UNWIND_ROWS`, `UNWIND_PAGES`) and describes the file in `UNWIND_FILES` at a slot of its own;
// each traced process gets a sorted table of its executable file mappings (`UNWIND_MAPPINGS`, by
// tgid) naming those slots. The BPF unwinder (memtrace-ebpf/src/stacks.rs) finds a frame's mapping
// by binary search, turns its address into a file offset, looks the row up in the file's table
// (the lookup on `UnwindTableInfo`) and steps per `UnwindRow`; where the file has no unwind
// information at all it follows frame pointers.

/// Executable file mappings per process the unwinder knows; a process with more keeps the first.
pub const UNWIND_MAX_MAPPINGS: usize = 256;
/// Halvings of the binary search over a process's mappings (log2 of `UNWIND_MAX_MAPPINGS`).
pub const UNWIND_MAPPING_STEPS: u32 = 8;
/// Processes with a mapping table at once.
pub const UNWIND_MAX_PROCESSES: u32 = 8_192;
/// Object files with a slot in `UNWIND_FILES`.
pub const UNWIND_MAX_FILES: u32 = 8_192;
/// Rows of every loaded table together (8 bytes each: 32 MiB); a file that no longer fits stays
/// without a table (its stacks end with `unwind_stop::NO_TABLE`).
pub const UNWIND_MAX_ROWS: u32 = 1 << 22;
/// Page index entries of every loaded table together (4 bytes each).
pub const UNWIND_MAX_PAGES: u32 = 1 << 21;
/// `UnwindMapping::file` and `FrameLocation::file` when no file slot applies.
pub const UNWIND_NO_FILE: u32 = u32::MAX;

/// What the unwinder can do in one file, in `UnwindFile::state`.
pub mod unwind_file_state {
    /// The table is being built or does not fit: stacks end here (`unwind_stop::NO_TABLE`).
    pub const PENDING: u8 = 0;
    /// `UnwindFile::table` is loaded.
    pub const LOADED: u8 = 1;
    /// The file has no unwind information: frame pointers are followed through it.
    pub const FRAME_POINTERS: u8 = 2;
}

/// One object file the unwinder knows, at its slot in `UNWIND_FILES`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindFile {
    /// Where its rows and pages are in the shared arrays (valid when LOADED).
    pub table: UnwindTableInfo,
    /// One of `unwind_file_state`.
    pub state: u8,
    /// 1 when `build_id` is valid.
    pub has_build_id: u8,
    pub _pad: [u8; 2],
    /// The file's GNU build ID, zero-padded to 20 bytes (as `StackFrame::build_id`).
    pub build_id: [u8; 20],
}

/// One executable file mapping of a process: runtime addresses [start, end) map the file from
/// `file_offset`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindMapping {
    pub start: u64,
    pub end: u64,
    pub file_offset: u64,
    /// The file's slot in `UNWIND_FILES`.
    pub file: u32,
    pub _pad: u32,
}

/// A process's executable file mappings, sorted by `start`, not overlapping; `count` are valid.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnwindMappings {
    pub count: u32,
    /// The interpreter whose frames the unwinder reads in the process (`interpreter::PYTHON`,
    /// its `PythonProcess` by tgid; `interpreter::PERL`, its `PerlProcess`), or `interpreter::NONE`.
    pub interpreter: u32,
    pub mappings: [UnwindMapping; UNWIND_MAX_MAPPINGS],
}

/// Why the unwinder ended a stack: the index of its counter in `ProcessStats::unwind_stops`.
pub mod unwind_stop {
    /// The outermost frame (an END row) or a return address of 0: the stack is whole.
    pub const WHOLE: usize = 0;
    /// The process has no mapping table yet: its stack was taken by frame pointers alone, cut at
    /// the first frame outside a file the kernel can name.
    pub const NO_MAPPINGS: usize = 1;
    /// The next return address is in no executable file mapping the unwinder knows (a library
    /// loaded since its table was last written, JIT code): the frame is left out.
    pub const NO_MAPPING: usize = 2;
    /// The frame's file has no table loaded yet.
    pub const NO_TABLE: usize = 3;
    /// No row covers the address and there is no frame pointer to follow.
    pub const NO_ROW: usize = 4;
    /// The row is UNSUPPORTED, or needs an rbp an earlier frame lost.
    pub const UNSUPPORTED: usize = 5;
    /// The stack could not be read where the row points.
    pub const READ_FAULT: usize = 6;
    /// `STACK_DEPTH` frames were taken: deeper callers are cut.
    pub const DEPTH_LIMIT: usize = 7;
    /// Counters.
    pub const COUNT: usize = 8;
    /// Their names, by index, as the summary shows them.
    pub const NAMES: [&str; COUNT] = [
        "whole",
        "no_mappings",
        "no_mapping",
        "no_table",
        "no_row",
        "unsupported",
        "read_fault",
        "depth_limit",
    ];
}

/// Why a stack's interpreter frames (Python's, Perl's) ended before the interpreter's outermost
/// frame: the index of its counter in `ProcessStats::interpreter_stops`. A stack whose interpreter
/// part is whole, or that has none, counts nothing here.
pub mod interpreter_stop {
    /// A frame (or the list of frames, a context) could not be read: the part ends before it.
    pub const UNREADABLE: usize = 0;
    /// `INTERPRETER_MAX_FRAMES` interpreter frames were taken, or the stack's `STACK_DEPTH` frames
    /// were full with native ones: the outer ones are cut.
    pub const DEPTH_LIMIT: usize = 1;
    /// Counters.
    pub const COUNT: usize = 2;
    /// Their names, by index, as the summary shows them among its `unwind_stops`.
    pub const NAMES: [&str; COUNT] = ["interpreter_unreadable", "interpreter_depth_limit"];
}

#[cfg(feature = "user")]
mod unwind_kernel_pod {
    // SAFETY: #[repr(C)] plain integers and byte arrays, padding spelled out as fields.
    unsafe impl aya::Pod for super::UnwindFile {}
    unsafe impl aya::Pod for super::UnwindMapping {}
    unsafe impl aya::Pod for super::UnwindMappings {}
}

const _: () = assert!(1 << UNWIND_MAPPING_STEPS == UNWIND_MAX_MAPPINGS);
const _: () = assert!(interpreter_stop::COUNT.is_power_of_two() && unwind_stop::COUNT.is_power_of_two());
const _: () = assert!(core::mem::size_of::<UnwindFile>() == 48);
