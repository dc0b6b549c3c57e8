//! The Python frames of an allocation, read from outside the interpreter: in the thread that
//! allocates, the interpreter's current frame is a few pointer chases from `_PyRuntime`, whose
//! address and the version's struct layout userspace writes per process (PYTHON_PROCESSES, with
//! the process's mapping table, memtrace-user/src/collect/unwind/kernel.rs; not with
//! --no-interpreter-frames). Nothing is written into the process.
//!
//! On 3.11 the frames are those of the thread holding the GIL (`gilstate.tstate_current`), and
//! only when that is the allocating thread (its `native_thread_id`): an allocation made without
//! the GIL (PyMem_RawMalloc in a thread that released it) has native frames alone. 3.13 keeps the
//! current thread state in a thread-local; the allocating thread's is found in the main
//! interpreter's list of threads by its `native_thread_id` (and remembered, PYTHON_THREADS), so
//! its frames are read whether it holds the GIL or not. Each frame gives its
//! code object and its current instruction; the first time a code object is seen in a process,
//! its name, file, first line and location table are copied into PYTHON_CODES, so that the frame
//! is named after the process is gone. A frame that cannot be read ends the Python part, and the
//! stack counts it (`interpreter_stop`).

use core::ffi::c_void;

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_NOEXIST},
    helpers::{bpf_get_current_pid_tgid, generated},
    macros::map,
    maps::{Array, HashMap, LruHashMap},
};
use memtrace_common::{
    interpreter_stop, InterpreterCodeKey, PythonCode, PythonLayout, PythonProcess, FRAME_PYTHON,
    PYTHON_CACHED_THREADS, PYTHON_FRAME_WORDS, PYTHON_KNOWN_CODES, PYTHON_MAX_CODES, PYTHON_MAX_STEPS,
    PYTHON_MAX_THREADS, UNWIND_MAX_PROCESSES,
};

use crate::{
    helpers::map_value,
    interpreters::frames::{InterpreterFrame, InterpreterFrames},
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

/// The thread state of each thread whose frames were read (3.13), by tid: checked against the
/// state's `native_thread_id` at each use, so a stale one is only looked for again.
#[map]
static PYTHON_THREADS: LruHashMap<u32, u64> = LruHashMap::with_max_entries(PYTHON_CACHED_THREADS, 0);

/// Where the walk is (in the run's scratch slot): the interpreter frame read next (the thread
/// state looked at next, while the thread is looked for), the thread state found, the words read
/// of one frame and of its code object's names; and the code objects this slot's runs found in
/// PYTHON_CODES or put there, by `known_tag`, so that a frame of one of them costs no map lookup.
#[repr(C)]
pub(super) struct PythonCursor {
    next: u64,
    found: u64,
    read: [u64; PYTHON_FRAME_WORDS],
    names: [u64; 2],
    known: [u64; PYTHON_KNOWN_CODES],
}

/// What each step of the walk works on, on the caller's stack.
#[repr(C)]
struct PythonWalk {
    process: *const PythonProcess,
    frames: *mut InterpreterFrames,
    cursor: *mut PythonCursor,
    tgid: u64,
    /// The process's start time: a code object of a process before it with the same pid is
    /// another.
    started_ns: u64,
}

/// Reads the current thread's Python frames into `frames` (none where the process runs no
/// interpreter memtrace knows, or, on 3.11, another thread holds the GIL).
#[inline(never)]
pub(super) fn read_python_frames(
    tgid: u32,
    started_ns: u64,
    frames: &mut InterpreterFrames,
    cursor: &mut PythonCursor,
) {
    frames.begin(FRAME_PYTHON);
    let Some(process) = PYTHON_PROCESSES.get_ptr(&tgid) else { return };
    let mut walk = PythonWalk { process, frames, cursor, tgid: u64::from(tgid), started_ns };
    let Some(first) = current_frame(&mut walk) else { return };
    // SAFETY: the cursor is the claimed slot's.
    unsafe { (*walk.cursor).next = first };
    // SAFETY: the callback is a function of this program; its context lives on this stack for the
    // whole call.
    unsafe { generated::bpf_loop(PYTHON_MAX_STEPS, python_step as *mut c_void, (&raw mut walk).cast(), 0) };
    if cursor.next != 0 {
        // The steps ran out before the outermost frame (a reason found first stands).
        frames.cut_at(interpreter_stop::DEPTH_LIMIT);
    }
}

/// The interpreter frame the allocating thread runs: on 3.11 only if it holds the GIL.
fn current_frame(walk: &mut PythonWalk) -> Option<u64> {
    // SAFETY: a map value, valid while the program runs.
    let (layout, runtime) = unsafe { (&(*walk.process).layout, (*walk.process).runtime) };
    // The low half of pid_tgid is the thread's id.
    let tid = bpf_get_current_pid_tgid() as u32;
    if layout.thread_list != 0 {
        let tstate = thread_state(walk, tid)?;
        let frame = read_user(tstate + u64::from(layout.tstate_current_frame))?;
        return (frame != 0).then_some(frame);
    }
    let tstate = read_user(runtime + u64::from(layout.runtime_tstate_current))?;
    if tstate == 0 || read_user(tstate + u64::from(layout.tstate_native_thread_id))? != u64::from(tid) {
        return None;
    }
    let cframe = read_user(tstate + u64::from(layout.tstate_cframe))?;
    let frame = read_user(cframe + u64::from(layout.cframe_current_frame))?;
    (frame != 0).then_some(frame)
}

/// The thread state of thread `tid`, from the cache or the main interpreter's list of threads.
#[inline(never)]
fn thread_state(walk: &mut PythonWalk, tid: u32) -> Option<u64> {
    // SAFETY: map values, valid while the program runs; the cursor is the claimed slot's.
    let (layout, runtime, cursor) =
        unsafe { (&(*walk.process).layout, (*walk.process).runtime, &mut *walk.cursor) };
    if let Some(&cached) = PYTHON_THREADS.get_ptr(&tid).map(map_value) {
        if read_user(cached + u64::from(layout.tstate_native_thread_id)) == Some(u64::from(tid)) {
            return Some(cached);
        }
    }
    let interpreter = read_user(runtime + u64::from(layout.runtime_interpreters_head))?;
    cursor.next = read_user(interpreter + u64::from(layout.interp_threads_head))?;
    cursor.found = 0;
    // SAFETY: the callback is a function of this program; its context lives on this stack for the
    // whole call.
    unsafe {
        generated::bpf_loop(
            PYTHON_MAX_THREADS,
            thread_step as *mut c_void,
            (walk as *mut PythonWalk).cast(),
            0,
        )
    };
    let found = cursor.found;
    if found == 0 {
        return None;
    }
    let _ = PYTHON_THREADS.insert(&tid, &found, 0);
    Some(found)
}

/// bpf_loop's callback: one thread state of the list; 1 ends the loop (found, or the list ended).
extern "C" fn thread_step(_index: u64, walk: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the `PythonWalk` that `thread_state` passed.
    let (layout, cursor) = unsafe {
        let walk = &*(walk as *const PythonWalk);
        (&(*walk.process).layout, &mut *walk.cursor)
    };
    let tstate = cursor.next;
    if tstate == 0 {
        return 1;
    }
    // The low half of pid_tgid is the thread's id.
    let tid = u64::from(bpf_get_current_pid_tgid() as u32);
    let Some(native) = read_user(tstate + u64::from(layout.tstate_native_thread_id)) else { return 1 };
    if native == tid {
        cursor.found = tstate;
        return 1;
    }
    let Some(next) = read_user(tstate + u64::from(layout.tstate_next)) else { return 1 };
    cursor.next = next;
    0
}

/// bpf_loop's callback: one Python frame; 1 ends the loop.
extern "C" fn python_step(_index: u64, walk: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the `PythonWalk` that `read_python_frames` passed, whose
    // pointers are map values that live as long as the program runs.
    let (layout, frames, cursor, tgid, started_ns) = unsafe {
        let walk = &*(walk as *const PythonWalk);
        (&(*walk.process).layout, &mut *walk.frames, &mut *walk.cursor, walk.tgid, walk.started_ns)
    };
    let frame = cursor.next;
    if frame == 0 {
        return 1;
    }
    // The frame's fields, in one read into the slot (the layout keeps them within
    // PYTHON_FRAME_WORDS words of f_code: checked by userspace).
    if !read_user_into(&mut cursor.read, frame + u64::from(layout.frame_code)) {
        return frames.unreadable();
    }
    let read = &cursor.read;
    let word = |offset: u32| read.get((offset.wrapping_sub(layout.frame_code) / 8) as usize).copied();
    let byte = |offset: u32| word(offset & !7).map(|word| (word >> ((offset & 7) * 8)) & 0xff);
    let Some(code) = word(layout.frame_code) else { return frames.unreadable() };
    let Some(previous) = word(layout.frame_previous) else { return frames.unreadable() };
    let Some(prev_instr) = word(layout.frame_prev_instr) else { return frames.unreadable() };
    cursor.next = previous;
    let entry = if layout.thread_list != 0 {
        // 3.13: an eval loop's run starts from a shim frame of its own, not a Python one: the
        // frame before it is the run's entry frame.
        if byte(layout.frame_owner) == Some(u64::from(layout.owner_cstack)) {
            frames.mark_entry();
            return 0;
        }
        0
    } else {
        byte(layout.frame_is_entry).unwrap_or(0)
    };
    let instructions = code + u64::from(layout.code_instructions);
    let at = prev_instr.wrapping_sub(instructions) / 2;
    let fingerprint = fingerprint(code, layout, &mut cursor.names);
    if !frames.push(InterpreterFrame::new(code, at, entry, 0, fingerprint)) {
        return 1;
    }
    let tag = known_tag(code, fingerprint, tgid, started_ns);
    let known = &mut cursor.known[(code >> 4) as usize & (PYTHON_KNOWN_CODES - 1)];
    if *known != tag
        && remember_code(InterpreterCodeKey { tgid: tgid as u32, _pad: 0, code, fingerprint }, layout)
    {
        *known = tag;
    }
    0
}

/// What tells a code object from one freed before it at the same address: its name's and file's
/// string objects (a function of the same name in the same file may share them, and its name),
/// read at once: the two are neighbouring words (checked by userspace).
fn fingerprint(code: u64, layout: &PythonLayout, names: &mut [u64; 2]) -> u64 {
    let first = layout.code_name.min(layout.code_filename);
    if !read_user_into(names, code + u64::from(first)) {
        return 0;
    }
    let word = |offset: u32| names.get((offset.wrapping_sub(first) / 8) as usize).copied().unwrap_or(0);
    word(layout.code_name) ^ word(layout.code_filename).rotate_left(32)
}

/// A code object of one process, as one nonzero word: the multiplier is the 64-bit golden ratio,
/// so that each field spreads over the whole word.
fn known_tag(code: u64, fingerprint: u64, tgid: u64, started_ns: u64) -> u64 {
    const MIX: u64 = 0x9e37_79b9_7f4a_7c15;
    let process = (tgid ^ started_ns.rotate_left(20)).wrapping_mul(MIX);
    let code = (code ^ process).wrapping_mul(MIX);
    (code ^ fingerprint.rotate_left(29)).wrapping_mul(MIX) | 1
}

/// Copies a code object's names into PYTHON_CODES the first time the process's stacks hold it;
/// true where the map holds it now (userspace takes each once it is complete, and keeps it).
#[inline(never)]
fn remember_code(key: InterpreterCodeKey, layout: &PythonLayout) -> bool {
    let code = key.code;
    if PYTHON_CODES.get_ptr(&key).is_some() {
        return true;
    }
    let Some(zeroed) = FRESH_PYTHON_CODE.get_ptr(0) else { return false };
    // SAFETY: a map value, valid while the program runs.
    if PYTHON_CODES.insert(&key, unsafe { &*zeroed }, u64::from(BPF_NOEXIST)).is_err() {
        return false;
    }
    let Some(record) = PYTHON_CODES.get_ptr_mut(&key) else { return false };
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
    true
}

/// A compact ASCII string's characters, NUL-terminated and cut to fit; nothing for another kind.
fn read_ascii<const N: usize>(into: &mut [u8; N], string: u64, layout: &PythonLayout) {
    let Some(state) = read_user(string + u64::from(layout.unicode_state)) else { return };
    if state as u32 & layout.unicode_compact_ascii != layout.unicode_compact_ascii {
        return;
    }
    read_string(into, string + u64::from(layout.unicode_ascii_data));
}
