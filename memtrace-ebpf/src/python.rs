//! The Python frames of an allocation, read from outside the interpreter: in the thread that
//! allocates, the interpreter's current frame is a few pointer chases from `_PyRuntime`, whose
//! address and the version's struct layout userspace writes per process (PYTHON_PROCESSES, with
//! the process's mapping table, memtrace-user/src/collect/unwind/kernel.rs; not with
//! --no-interpreter-frames). Nothing is written into the process.
//!
//! The frames are those of the thread holding the GIL (`gilstate.tstate_current`), and only when
//! that is the allocating thread (its `native_thread_id`): an allocation made without the GIL
//! (PyMem_RawMalloc in a thread that released it) has native frames alone. Each frame gives its
//! code object and its current instruction; the first time a code object is seen in a process,
//! its name, file, first line and location table are copied into PYTHON_CODES, so that the frame
//! is named after the process is gone. A frame that cannot be read ends the Python part.

use core::ffi::c_void;

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_NOEXIST},
    helpers::{bpf_get_current_pid_tgid, generated},
    macros::map,
    maps::{Array, HashMap},
};
use memtrace_common::{
    InterpreterCodeKey, PythonCode, PythonLayout, PythonProcess, FRAME_PYTHON, PYTHON_MAX_CODES,
    PYTHON_MAX_FRAMES, UNWIND_MAX_PROCESSES,
};

use crate::{
    interpreter::{InterpreterFrame, InterpreterFrames},
    user_memory::{read_bytes, read_string, read_user, read_user_into},
};

/// Each CPython process's runtime address and layout, by tgid (written by userspace).
#[map]
static PYTHON_PROCESSES: HashMap<u32, PythonProcess> =
    HashMap::with_max_entries(UNWIND_MAX_PROCESSES, BPF_F_NO_PREALLOC);

/// The names of the code objects stacks hold, by process and code object (taken by userspace).
#[map]
static PYTHON_CODES: HashMap<InterpreterCodeKey, PythonCode> =
    HashMap::with_max_entries(PYTHON_MAX_CODES, BPF_F_NO_PREALLOC);

/// A zeroed code record, never written: new entries are inserted from here.
#[map]
static FRESH_PYTHON_CODE: Array<PythonCode> = Array::with_max_entries(1, 0);

/// Where the walk is (in the run's scratch slot): the interpreter frame read next, and the words
/// read of one (`f_code` to `is_entry`).
#[repr(C)]
pub(crate) struct PythonCursor {
    next: u64,
    read: [u64; 5],
}

/// What each step of the walk works on, on the caller's stack.
#[repr(C)]
struct PythonWalk {
    process: *const PythonProcess,
    frames: *mut InterpreterFrames,
    cursor: *mut PythonCursor,
    tgid: u64,
}

/// Reads the current thread's Python frames into `frames` (none where the process runs no
/// interpreter memtrace knows, or another thread holds the GIL).
#[inline(never)]
pub(crate) fn read_python_frames(tgid: u32, frames: &mut InterpreterFrames, cursor: &mut PythonCursor) {
    frames.begin(FRAME_PYTHON);
    let Some(process) = PYTHON_PROCESSES.get_ptr(&tgid) else { return };
    // SAFETY: a map value, valid while the program runs.
    let layout = unsafe { &(*process).layout };
    // SAFETY: as above.
    let runtime = unsafe { (*process).runtime };
    let Some(first) = current_frame(runtime, layout) else { return };
    cursor.next = first;
    let mut walk = PythonWalk { process, frames, cursor, tgid: u64::from(tgid) };
    // SAFETY: the callback is a function of this program; its context lives on this stack for the
    // whole call.
    unsafe {
        generated::bpf_loop(PYTHON_MAX_FRAMES as u32, python_step as *mut c_void, (&raw mut walk).cast(), 0)
    };
}

/// The interpreter frame the allocating thread runs, if it holds the GIL.
fn current_frame(runtime: u64, layout: &PythonLayout) -> Option<u64> {
    let tstate = read_user(runtime + u64::from(layout.runtime_tstate_current))?;
    // The low half of pid_tgid is the thread's id.
    let tid = bpf_get_current_pid_tgid() as u32 as u64;
    if tstate == 0 || read_user(tstate + u64::from(layout.tstate_native_thread_id))? != tid {
        return None;
    }
    let cframe = read_user(tstate + u64::from(layout.tstate_cframe))?;
    let frame = read_user(cframe + u64::from(layout.cframe_current_frame))?;
    (frame != 0).then_some(frame)
}

/// bpf_loop's callback: one Python frame; 1 ends the loop.
extern "C" fn python_step(_index: u64, walk: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the `PythonWalk` that `read_python_frames` passed, whose
    // pointers are map values that live as long as the program runs.
    let (layout, frames, cursor, tgid) = unsafe {
        let walk = &*(walk as *const PythonWalk);
        (&(*walk.process).layout, &mut *walk.frames, &mut *walk.cursor, walk.tgid)
    };
    let frame = cursor.next;
    // f_code to is_entry, in one read into the slot (the layout keeps them in that order, within 40
    // bytes: checked by userspace).
    let base = frame + u64::from(layout.frame_code);
    if frame == 0 || !read_user_into(&mut cursor.read, base) {
        return 1;
    }
    let read = &cursor.read;
    let word = |offset: u32| read.get((offset.wrapping_sub(layout.frame_code) / 8) as usize & 7).copied();
    let (Some(code), Some(previous), Some(prev_instr), Some(entry_word)) = (
        word(layout.frame_code),
        word(layout.frame_previous),
        word(layout.frame_prev_instr),
        word(layout.frame_is_entry & !7),
    ) else {
        return 1;
    };
    let entry = (entry_word >> ((layout.frame_is_entry & 7) * 8)) & 0xff;
    let instructions = code + u64::from(layout.code_instructions);
    let at = prev_instr.wrapping_sub(instructions) / 2;
    if !frames.push(InterpreterFrame { code, at, entry, kind: 0 }) {
        return 1;
    }
    cursor.next = previous;
    remember_code(tgid as u32, code, layout);
    0
}

/// Copies a code object's names into PYTHON_CODES the first time the process's stacks hold it.
#[inline(never)]
fn remember_code(tgid: u32, code: u64, layout: &PythonLayout) {
    let key = InterpreterCodeKey { tgid, _pad: 0, code };
    if PYTHON_CODES.get_ptr(&key).is_some() {
        return;
    }
    let Some(zeroed) = FRESH_PYTHON_CODE.get_ptr(0) else { return };
    // SAFETY: a map value, valid while the program runs.
    if PYTHON_CODES.insert(&key, unsafe { &*zeroed }, u64::from(BPF_NOEXIST)).is_err() {
        return;
    }
    let Some(record) = PYTHON_CODES.get_ptr_mut(&key) else { return };
    // SAFETY: the entry this run made; filled through its pointer.
    let record = unsafe { &mut *record };
    if let Some(name) = read_user(code + u64::from(layout.code_name)) {
        read_ascii(&mut record.name, name, layout);
    }
    if let Some(file) = read_user(code + u64::from(layout.code_filename)) {
        read_ascii(&mut record.filename, file, layout);
    }
    if let Some(first) = read_user(code + u64::from(layout.code_firstlineno)) {
        record.firstlineno = first as u32;
    }
    if let Some(table) = read_user(code + u64::from(layout.code_linetable)) {
        let size = read_user(table + u64::from(layout.bytes_size)).unwrap_or(0);
        let len = size.min(record.linetable.len() as u64);
        if len > 0 && read_bytes(&mut record.linetable, table + u64::from(layout.bytes_data), len) {
            record.linetable_len = len as u32;
        }
    }
    record.complete = 1;
}

/// A compact ASCII string's characters, NUL-terminated and cut to fit; nothing for another kind.
fn read_ascii<const N: usize>(into: &mut [u8; N], string: u64, layout: &PythonLayout) {
    let Some(state) = read_user(string + u64::from(layout.unicode_state)) else { return };
    if state as u32 & layout.unicode_compact_ascii != layout.unicode_compact_ascii {
        return;
    }
    read_string(into, string + u64::from(layout.unicode_ascii_data));
}
