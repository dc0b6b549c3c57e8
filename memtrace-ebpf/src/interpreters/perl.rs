//! The Perl frames of an allocation, read from outside the interpreter, as `caller` sees them:
//! userspace writes where a process's `PL_curinterp` lies and the version's struct layout
//! (PERL_PROCESSES, with the process's mapping table, memtrace-user/src/collect/unwind/kernel.rs;
//! not with --no-interpreter-frames). Nothing is written into the process.
//!
//! The statement running is `PL_curcop`; the contexts (`PL_curstackinfo`'s `si_cxstack`, each
//! stack of contexts linked to the one it interrupted by `si_prev`) are walked innermost first.
//! A sub's context is a frame: the sub's CV, at the line of the statement running in it; the
//! statement the sub was called from (`blk_oldcop`) is where its caller is. An `eval` or a
//! `require` is a frame the same way; loops and blocks are not frames. The statement the walk ends
//! at is the main program's (`main::RUNTIME`, as NYTProf names it). Each CV's package, name and
//! file (another kind's file) is copied once into PERL_SUBS, so that the frame is named after the
//! process is gone. A context that cannot be read ends the Perl part, and the stack counts it
//! (`interpreter_stop`).
//!
//! Each thread runs its own interpreter (`threads` clones one for each thread it makes), kept
//! under the thread-specific key `PL_thr_key`: the allocating thread's is read from its glibc
//! `struct pthread` (at its FS base, `task_struct.thread.fsbase`), where the C library's layout
//! of thread keys is known (userspace reads it from glibc's libthread_db descriptors). Where it
//! is not, only the main thread's frames are read, its interpreter `PL_curinterp`.

use core::ffi::c_void;

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_NOEXIST},
    helpers::{bpf_get_current_pid_tgid, generated},
    macros::map,
    maps::{Array, HashMap},
};
use memtrace_common::{
    interpreter_stop, perl_frame, InterpreterCodeKey, PerlLayout, PerlProcess, PerlSub, FRAME_PERL,
    PERL_MAX_CONTEXTS, PYTHON_MAX_CODES, UNWIND_MAX_PROCESSES,
};

use crate::{
    interpreters::frames::{InterpreterFrame, InterpreterFrames},
    kernel,
    user_memory::{read_string, read_user},
};

/// Each Perl process's `PL_curinterp` address and layout, by tgid (written by userspace).
#[map]
static PERL_PROCESSES: HashMap<u32, PerlProcess> =
    HashMap::with_max_entries(UNWIND_MAX_PROCESSES, BPF_F_NO_PREALLOC);

/// The names of the subs (and files) stacks hold, by process and code (taken by userspace).
#[map]
static PERL_SUBS: HashMap<InterpreterCodeKey, PerlSub> =
    HashMap::with_max_entries(PYTHON_MAX_CODES, BPF_F_NO_PREALLOC);

/// A zeroed sub record, never written: new entries are inserted from here.
#[map]
static FRESH_PERL_SUB: Array<PerlSub> = Array::with_max_entries(1, 0);

/// Where the walk is (in the run's scratch slot): the stack of contexts (0 once the walk is whole), its contexts, the index
/// of the next one (-1 once they are all seen), the statement running in the frame it is in, and
/// whether the main program runs.
#[repr(C)]
pub(super) struct PerlCursor {
    stackinfo: u64,
    contexts: u64,
    index: i64,
    cop: u64,
    running: u64,
}

/// What each step of the walk works on, on the caller's stack.
#[repr(C)]
struct PerlWalk {
    process: *const PerlProcess,
    frames: *mut InterpreterFrames,
    cursor: *mut PerlCursor,
    tgid: u64,
}

/// Reads the allocating thread's Perl frames into `frames` (none where the process runs no Perl
/// memtrace knows, or the thread runs no interpreter).
#[inline(never)]
pub(super) fn read_perl_frames(tgid: u32, frames: &mut InterpreterFrames, cursor: &mut PerlCursor) {
    frames.begin(FRAME_PERL);
    let Some(process) = PERL_PROCESSES.get_ptr(&tgid) else { return };
    // SAFETY: a map value, valid while the program runs.
    let layout = unsafe { &(*process).layout };
    let Some(interpreter) = thread_interpreter(process, tgid) else { return };
    // One read at a time, each checked before the next: a tuple of them is code that 6.1's
    // verifier cannot follow (a register read on a path it thinks possible, "R1 !read_ok").
    let Some(cop) = read_user(interpreter + u64::from(layout.interp_curcop)) else { return };
    let Some(stackinfo) = read_user(interpreter + u64::from(layout.interp_curstackinfo)) else { return };
    let Some(phase) = read_user(interpreter + u64::from(layout.interp_phase)) else { return };
    cursor.cop = cop;
    cursor.running = u64::from(phase as u32 == layout.phase_run);
    // No stack of contexts yet (perl constructs its interpreter) or any more: no Perl runs.
    if stackinfo == 0 || cop == 0 {
        return;
    }
    if !enter_stackinfo(cursor, stackinfo, layout) {
        frames.unreadable();
        return;
    }
    let mut walk = PerlWalk { process, frames, cursor, tgid: u64::from(tgid) };
    // SAFETY: the callback is a function of this program; its context lives on this stack for the
    // whole call.
    unsafe { generated::bpf_loop(PERL_MAX_CONTEXTS, perl_step as *mut c_void, (&raw mut walk).cast(), 0) };
    if cursor.stackinfo != 0 {
        // The contexts ran out before the main program's (a reason found first stands).
        frames.cut_at(interpreter_stop::DEPTH_LIMIT);
    }
}

/// The interpreter the current thread runs: the one kept under `PL_thr_key` in its thread-specific
/// data (glibc's `pthread_getspecific`, read from the thread's `struct pthread` by its thread pointer),
/// or where that cannot be known, `PL_curinterp` for the main thread alone.
#[inline(never)]
fn thread_interpreter(process: *const PerlProcess, tgid: u32) -> Option<u64> {
    // SAFETY: a map value, valid while the program runs.
    let (thr_key, keys, curinterp) = unsafe { ((*process).thr_key, (*process).keys, (*process).curinterp) };
    let thread = kernel::thread_pointer().filter(|_| thr_key != 0);
    let Some(thread) = thread else {
        // The low half of pid_tgid is the thread's id.
        let main = bpf_get_current_pid_tgid() as u32 == tgid;
        return main.then(|| read_user(curinterp)).flatten().filter(|&at| at != 0);
    };
    // pthread_key_t is an unsigned int.
    let key = read_user(thr_key)? as u32;
    let block_index = key.checked_div(keys.keys_per_block)?;
    let in_block = key.checked_rem(keys.keys_per_block)?;
    let specific = thread.wrapping_add_signed(i64::from(keys.specific));
    let block = read_user(specific + u64::from(block_index) * 8)?;
    let record = u64::from(in_block) * u64::from(keys.record_size) + u64::from(keys.data);
    read_user(block.checked_add(record)?).filter(|&at| at != 0 && block != 0)
}

/// Points the cursor at the innermost context of `stackinfo`; false where it cannot be read.
fn enter_stackinfo(cursor: &mut PerlCursor, stackinfo: u64, layout: &PerlLayout) -> bool {
    let Some(contexts) = read_user(stackinfo + u64::from(layout.si_cxstack)) else { return false };
    let Some(index) = read_user(stackinfo + u64::from(layout.si_cxix)) else { return false };
    cursor.stackinfo = stackinfo;
    cursor.contexts = contexts;
    // si_cxix is an I32.
    cursor.index = i64::from(index as u32 as i32);
    true
}

/// bpf_loop's callback: one context; 1 ends the loop.
extern "C" fn perl_step(_index: u64, walk: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the `PerlWalk` that `read_perl_frames` passed, whose pointers
    // are map values that live as long as the program runs.
    let (layout, frames, cursor, tgid) = unsafe {
        let walk = &*(walk as *const PerlWalk);
        (&(*walk.process).layout, &mut *walk.frames, &mut *walk.cursor, walk.tgid as u32)
    };
    if cursor.index < 0 {
        return end_of_stackinfo(tgid, frames, cursor, layout);
    }
    let context = cursor.contexts + cursor.index as u64 * u64::from(layout.context_size);
    cursor.index -= 1;
    let Some(head) = read_user(context) else { return frames.unreadable() };
    let kind = match head as u32 & layout.type_mask {
        t if t == layout.type_sub => perl_frame::SUB,
        t if t == layout.type_eval && (head >> 16 & 0xffff) as u32 >> 7 == layout.op_require => {
            perl_frame::REQUIRE
        }
        t if t == layout.type_eval => perl_frame::EVAL,
        // A loop or a block: its statements are its sub's.
        _ => return 0,
    };
    let code = match kind {
        perl_frame::SUB => read_user(context + u64::from(layout.context_sub_cv)),
        _ => read_user(cursor.cop + u64::from(layout.cop_file)),
    };
    let Some(code) = code else { return frames.unreadable() };
    let Some(caller) = read_user(context + u64::from(layout.context_oldcop)) else {
        return frames.unreadable();
    };
    if !push_frame(tgid, frames, cursor.cop, code, kind, layout) {
        return 1;
    }
    cursor.cop = caller;
    0
}

/// The contexts of one stack are all seen: the frames so far ran in one run of the op loop, and the
/// one it interrupted goes on. The outermost's ran in the main program's run, whose statement is
/// its last frame while it runs (not while perl compiles it, or starts or ends).
fn end_of_stackinfo(
    tgid: u32,
    frames: &mut InterpreterFrames,
    cursor: &mut PerlCursor,
    layout: &PerlLayout,
) -> i64 {
    if let Some(previous) = read_user(cursor.stackinfo + u64::from(layout.si_prev)).filter(|&at| at != 0) {
        frames.mark_entry();
        return match enter_stackinfo(cursor, previous, layout) {
            true => 0,
            false => frames.unreadable(),
        };
    }
    if cursor.running != 0 {
        if let Some(file) = read_user(cursor.cop + u64::from(layout.cop_file)) {
            push_frame(tgid, frames, cursor.cop, file, perl_frame::MAIN, layout);
        }
    }
    frames.mark_entry();
    // The walk is whole.
    cursor.stackinfo = 0;
    1
}

/// Adds a frame of `code` at `cop`'s line, naming its code the first time; false when full.
fn push_frame(
    tgid: u32,
    frames: &mut InterpreterFrames,
    cop: u64,
    code: u64,
    kind: u8,
    layout: &PerlLayout,
) -> bool {
    // cop_line is a U32.
    let line = read_user(cop + u64::from(layout.cop_line)).map_or(0, |word| word as u32);
    let fingerprint = match kind {
        perl_frame::SUB => fingerprint(code, layout),
        _ => 0,
    };
    let frame = InterpreterFrame::new(code, u64::from(line), 0, kind, fingerprint);
    if !frames.push(frame) {
        return false;
    }
    remember_sub(InterpreterCodeKey { tgid, _pad: 0, code, fingerprint }, kind, layout);
    true
}

/// What tells a CV from one freed before it at the same address: its body and its GV (its name).
fn fingerprint(cv: u64, layout: &PerlLayout) -> u64 {
    let body = read_user(cv).unwrap_or(0);
    let gv = read_user(body + u64::from(layout.cv_gv)).unwrap_or(0);
    body ^ gv.rotate_left(32)
}

/// Copies a sub's package, name and file (another kind's file) into PERL_SUBS the first time the
/// process's stacks hold it.
#[inline(never)]
fn remember_sub(key: InterpreterCodeKey, kind: u8, layout: &PerlLayout) {
    let code = key.code;
    if PERL_SUBS.get_ptr(&key).is_some() {
        return;
    }
    let Some(zeroed) = FRESH_PERL_SUB.get_ptr(0) else { return };
    // SAFETY: a map value, valid while the program runs.
    if PERL_SUBS.insert(&key, unsafe { &*zeroed }, u64::from(BPF_NOEXIST)).is_err() {
        return;
    }
    let Some(record) = PERL_SUBS.get_ptr_mut(&key) else { return };
    // SAFETY: the entry this run made; filled through its pointer.
    let record = unsafe { &mut *record };
    if kind == perl_frame::SUB {
        name_sub(record, code, layout);
    } else {
        read_string(&mut record.file, code);
    }
    record.complete = 1;
}

/// A CV's package, name and file: a named sub's from its GV; a lexical sub's (CVf_NAMED) from its
/// name's HEK and its stash.
fn name_sub(record: &mut PerlSub, cv: u64, layout: &PerlLayout) {
    let Some(body) = read_user(cv) else { return };
    let Some(gv) = read_user(body + u64::from(layout.cv_gv)) else { return };
    let Some(flags) = read_user(body + u64::from(layout.cv_flags)) else { return };
    let named = flags as u32 & layout.cv_named != 0;
    let (name, stash) = match named {
        true => (Some(gv), read_user(body + u64::from(layout.cv_stash))),
        false => match read_user(gv) {
            Some(gv_body) => (
                read_user(gv_body + u64::from(layout.gv_name)),
                read_user(gv_body + u64::from(layout.gv_stash)),
            ),
            None => (None, None),
        },
    };
    if let Some(name) = name.filter(|&hek| hek != 0) {
        read_string(&mut record.name, name + u64::from(layout.hek_key));
    }
    if let Some(package) = stash.and_then(|stash| stash_name(stash, layout)) {
        read_string(&mut record.package, package + u64::from(layout.hek_key));
    }
    if let Some(file) = read_user(body + u64::from(layout.cv_file)).filter(|&file| file != 0) {
        read_string(&mut record.file, file);
    }
}

/// A stash's name's HEK (`HvNAME_HEK`): the first of its names where it has several.
fn stash_name(stash: u64, layout: &PerlLayout) -> Option<u64> {
    let body = read_user(stash).filter(|&body| body != 0)?;
    let names = read_user(body + u64::from(layout.stash_name)).filter(|&names| names != 0)?;
    let count = read_user(body + u64::from(layout.stash_name_count))? as u32 as i32;
    match count {
        0 => Some(names),
        _ => read_user(names).filter(|&hek| hek != 0),
    }
}
