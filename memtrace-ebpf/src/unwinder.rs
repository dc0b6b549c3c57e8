//! The unwinder: a stack walked at allocation time with the tables userspace builds from each
//! file's .eh_frame (the rules are on `memtrace_common::UnwindRow` and `UnwindTableInfo`): per
//! frame, the process's mapping table gives the file and the file offset, the file's table gives
//! the row, the row gives the caller's registers. Frame pointers are followed only through files
//! with no unwind information, or where a table has no row. Each frame's steps are global BPF
//! functions (`memtrace_locate_frame`, `memtrace_take_over`, `memtrace_unwind_frame`), verified
//! once each. What is made of the frames found (the stack's key, its build-ID form) is stacks.rs's.

use core::{
    ffi::c_void,
    ptr::{read_volatile, write_volatile},
};

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    helpers::generated::bpf_loop,
    macros::map,
    maps::{Array, HashMap},
};
use memtrace_common::{
    unwind_file_state, unwind_kind, unwind_ra, unwind_stop, UnwindFile, UnwindMapping, UnwindMappings,
    UnwindRow, UnwindTableInfo, STACK_DEPTH, UNWIND_CFA_MASK, UNWIND_MAPPING_STEPS, UNWIND_MAX_FILES,
    UNWIND_MAX_MAPPINGS, UNWIND_MAX_PAGES, UNWIND_MAX_PROCESSES, UNWIND_MAX_ROWS, UNWIND_NO_FILE,
    UNWIND_RA_SHIFT, UNWIND_RBP_LOST, UNWIND_SEARCH_STEPS,
};

use crate::{
    frame_memo::FrameMemos,
    scratch::{FrameLocation, Scratch, UnwindState},
    stack_read::{Registers, StackWindow},
};

/// Each traced process's executable file mappings, by tgid (written by userspace, removed at exec).
#[map]
pub(crate) static UNWIND_MAPPINGS: HashMap<u32, UnwindMappings> =
    HashMap::with_max_entries(UNWIND_MAX_PROCESSES, BPF_F_NO_PREALLOC);

/// An empty mapping table, never written: the table of a process userspace has not written one
/// for yet.
#[map]
pub(crate) static NO_MAPPINGS: Array<UnwindMappings> = Array::with_max_entries(1, 0);

/// The object files the unwinder knows, by slot: state, table placement, build ID.
#[map]
pub(crate) static UNWIND_FILES: Array<UnwindFile> = Array::with_max_entries(UNWIND_MAX_FILES, 0);

/// The rows of every loaded table, one file's after another.
#[map]
static UNWIND_ROWS: Array<UnwindRow> = Array::with_max_entries(UNWIND_MAX_ROWS, 0);

/// The page indices of every loaded table, one file's after another.
#[map]
static UNWIND_PAGES: Array<u32> = Array::with_max_entries(UNWIND_MAX_PAGES, 0);

/// Unwinds from the slot's start (the allocator's caller first) with the process's mapping table
/// and the files' tables, into the slot's `raw` and `locations`; leaves the depth and why the walk
/// ended (`unwind_stop`) in its `state`.
#[inline(never)]
pub(crate) fn unwind(mappings: &UnwindMappings, scratch: &mut Scratch, memos: &mut FrameMemos) {
    memos.begin(&scratch.start);
    let regs = scratch.start.regs;
    // SAFETY: the claimed slot's state.
    unsafe {
        write_volatile(
            &raw mut scratch.state,
            UnwindState { regs, depth: 0, stop: unwind_stop::DEPTH_LIMIT as u64 },
        )
    };
    scratch.found.clear();
    let mut walk = Walk { mappings, scratch, memos };
    // SAFETY: the callback is a function of this program, and its context is `walk`, on this
    // program's stack for the whole call, as bpf_loop requires.
    unsafe { bpf_loop(STACK_DEPTH as u32, unwind_step as *mut c_void, (&raw mut walk).cast(), 0) };
}

/// What each step of the walk works on: the caller's map values, passed to the bpf_loop callback
/// on the caller's stack.
#[repr(C)]
struct Walk {
    mappings: *const UnwindMappings,
    scratch: *mut Scratch,
    memos: *mut FrameMemos,
}

/// bpf_loop's callback: one frame; 1 ends the loop.
extern "C" fn unwind_step(_index: u64, walk: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the `Walk` that `unwind` passed, whose pointers are map values
    // that live as long as the program runs.
    let walk = unsafe { &*(walk as *const Walk) };
    // Two calls, not one inside the other: the kernel's mapping lookup (vma.rs) and the step each
    // take their chain of frames, and the two together would not fit in the BPF stack.
    let mut went_on = memtrace_take_over(walk.scratch, walk.memos);
    if went_on == MUST_WALK {
        memtrace_locate_frame(walk.mappings, walk.scratch);
        went_on = memtrace_unwind_frame(walk.scratch, walk.memos);
    } else {
        // A run of frames the last walk shared goes on in this step, not a step a frame.
        for _ in 1..TAKEN_AT_ONCE {
            if went_on != 1 {
                break;
            }
            match memtrace_take_over(walk.scratch, walk.memos) {
                // The next step walks it.
                MUST_WALK => break,
                next => went_on = next,
            }
        }
    }
    // A global function's result is any scalar to the verifier, and a callback must return 0 or
    // 1: read back through memory, the result is compared, not bit-flipped by a compiler that
    // knows it is 0 or 1.
    // SAFETY: a local.
    match unsafe { read_volatile(&went_on) } {
        0 => 1,
        _ => 0,
    }
}

/// The address the walk's next frame is looked up by: past the innermost frame, rip is a return
/// address, and the call lies before it.
fn frame_pc(rip: u64, depth: u64) -> u64 {
    if depth == 0 {
        rip
    } else {
        rip.wrapping_sub(1)
    }
}

/// Finds the mapping of the walk's next frame, by the process's mapping table or else the
/// kernel's, into the slot's `FoundMappings::current`.
///
/// The frame's two steps are global functions (exported, `extern "C"`): the verifier checks each
/// once, on its own, with its arguments as the types say (memory of the type's size, or null),
/// rather than once for every state in which a walk calls it. That keeps the unwinder's share of
/// a program's verification small (`memtrace verifier-report` shows each program's). They take
/// map values only as their own arguments: a pointer read from memory is no pointer to them.
#[inline(never)]
#[no_mangle]
pub extern "C" fn memtrace_locate_frame(mappings: *const UnwindMappings, scratch: *mut Scratch) -> i64 {
    // SAFETY: null, or the map values `unwind` passed: the mapping table, which the walk only
    // reads, and the run's claimed slot.
    let (Some(mappings), Some(scratch)) = (unsafe { mappings.as_ref() }, unsafe { scratch.as_mut() }) else {
        return 0;
    };
    // SAFETY: the claimed slot's state.
    let (rip, depth) =
        unsafe { (read_volatile(&scratch.state.regs.rip), read_volatile(&scratch.state.depth)) };
    let pc = frame_pc(rip, depth);
    match find_mapping(mappings, pc) {
        Some(mapping) => scratch.found.set_current(mapping),
        None => scratch.found.locate(pc),
    }
    0
}

/// What `memtrace_take_over` returns where the frame cannot be taken over.
const MUST_WALK: i64 = -1;

/// Frames one step of the walk takes over at most, while the last walk shared them.
const TAKEN_AT_ONCE: usize = 8;

/// The walk's next frame as the slot's last walk took it, if it can be taken over
/// (frame_memo.rs): 1 if the walk goes on, 0 if it ends there, else `MUST_WALK`. Global, as
/// `memtrace_locate_frame` says.
#[inline(never)]
#[no_mangle]
pub extern "C" fn memtrace_take_over(scratch: *mut Scratch, memos: *mut FrameMemos) -> i64 {
    // SAFETY: null, or the run's claimed slot and its memos, which `unwind` passed.
    let (Some(scratch), Some(memos)) = (unsafe { scratch.as_mut() }, unsafe { memos.as_mut() }) else {
        return MUST_WALK;
    };
    let Scratch { raw, locations, state, window, .. } = scratch;
    if state.depth >= STACK_DEPTH as u64 {
        // Cut at the depth limit (a step took several frames): the state says so already.
        return 0;
    }
    let index = state.depth as usize & (STACK_DEPTH - 1);
    let (Some(slot), Some(location)) = (raw.get_mut(index), locations.get_mut(index)) else {
        return MUST_WALK;
    };
    memos.take_over(state, window, slot, location).map_or(MUST_WALK, i64::from)
}

/// Takes one frame (in the mapping `memtrace_locate_frame` found) and steps to its caller; 0 when
/// the walk ends (the reason in the slot's state). Keeps the frame in the walk's memo
/// (frame_memo.rs). Global, as `memtrace_locate_frame` says.
#[inline(never)]
#[no_mangle]
pub extern "C" fn memtrace_unwind_frame(scratch: *mut Scratch, memos: *mut FrameMemos) -> i64 {
    // SAFETY: null, or the run's claimed slot and its memos, which `unwind` passed.
    let (Some(scratch), Some(memos)) = (unsafe { scratch.as_mut() }, unsafe { memos.as_mut() }) else {
        return 0;
    };
    let went_on = unwind_frame(scratch, memos);
    // SAFETY: the claimed slot's state.
    let depth = unsafe { read_volatile(&scratch.state.depth) };
    memos.record_words(depth.wrapping_sub(1), &scratch.window.frame);
    i64::from(went_on)
}

/// `memtrace_unwind_frame` in the claimed slot.
fn unwind_frame(scratch: &mut Scratch, memos: &mut FrameMemos) -> bool {
    let Scratch { raw, locations, state, window, found, .. } = scratch;
    let state: *mut UnwindState = state;
    // SAFETY: the claimed slot's state; read and written field by field, never as one value on
    // this frame's stack, which lies on the probe's deepest chain of calls.
    let (regs, depth) = unsafe { (read_volatile(&(*state).regs), read_volatile(&(*state).depth)) };
    let index = depth as usize & (STACK_DEPTH - 1);
    let (Some(slot), Some(location)) = (raw.get_mut(index), locations.get_mut(index)) else {
        return false;
    };
    let end = |depth: u64, stop: usize| {
        // SAFETY: as above.
        unsafe {
            write_volatile(&mut (*state).depth, depth);
            write_volatile(&mut (*state).stop, stop as u64);
        }
        false
    };
    let pc = frame_pc(regs.rip, depth);
    let mapping = &found.current;
    if mapping.end == 0 {
        if depth == 0 {
            // The allocator's caller is real whatever maps it (JIT code): keep its address.
            *slot = regs.rip;
            *location = FrameLocation { file: UNWIND_NO_FILE, _pad: 0, offset: regs.rip };
            return end(1, unwind_stop::NO_MAPPING);
        }
        return end(depth, unwind_stop::NO_MAPPING);
    }
    *slot = regs.rip;
    let base = mapping.file_offset.wrapping_sub(mapping.start);
    *location = FrameLocation { file: mapping.file, _pad: 0, offset: regs.rip.wrapping_add(base) };
    window.begin_frame(depth);
    memos.record(depth, &regs, location);
    match step(&regs, mapping.file, pc.wrapping_add(base), window) {
        Ok(caller) => {
            // SAFETY: as above.
            unsafe {
                write_volatile(&mut (*state).regs, caller);
                write_volatile(&mut (*state).depth, depth + 1);
            }
            true
        }
        Err(stop) => end(depth + 1, stop),
    }
}

/// The mapping holding `pc`: the last one starting at or before it, if it ends after it.
pub(crate) fn find_mapping(mappings: &UnwindMappings, pc: u64) -> Option<&UnwindMapping> {
    let count = mappings.count as usize;
    if count == 0 || count > UNWIND_MAX_MAPPINGS {
        return None;
    }
    let (mut lo, mut hi) = (0usize, count);
    for _ in 0..UNWIND_MAPPING_STEPS {
        if hi - lo <= 1 {
            break;
        }
        let mid = lo + (hi - lo) / 2;
        if mappings.mappings.get(mid & (UNWIND_MAX_MAPPINGS - 1))?.start <= pc {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let mapping = mappings.mappings.get(lo & (UNWIND_MAX_MAPPINGS - 1))?;
    (mapping.start <= pc && pc < mapping.end).then_some(mapping)
}

/// The caller's registers, or why there is none: by the file's row at `offset`, else by frame
/// pointers where the file has no unwind information or no row covers the address.
fn step(regs: &Registers, file: u32, offset: u64, window: &mut StackWindow) -> Result<Registers, usize> {
    let Some(file) = UNWIND_FILES.get(file) else {
        return Err(unwind_stop::NO_TABLE);
    };
    match file.state {
        unwind_file_state::LOADED => match find_row(&file.table, offset) {
            Some(row) => step_by_row(row, regs, window),
            None => step_by_frame_pointer(regs, window),
        },
        unwind_file_state::FRAME_POINTERS => step_by_frame_pointer(regs, window),
        _ => Err(unwind_stop::NO_TABLE),
    }
}

/// The lookup specified on `UnwindTableInfo`, over the shared arrays.
fn find_row(table: &UnwindTableInfo, pc: u64) -> Option<UnwindRow> {
    let page = pc >> (table.page_shift & 31);
    let index = page.checked_sub(u64::from(table.first_page))?;
    if index >= u64::from(table.page_count) {
        return None;
    }
    let page_slot = u64::from(table.pages_start) + index;
    if page_slot + 1 >= u64::from(UNWIND_MAX_PAGES) {
        return None;
    }
    let mut lo = *UNWIND_PAGES.get(page_slot as u32)?;
    let mut hi = UNWIND_PAGES.get(page_slot as u32 + 1)?.wrapping_add(1);
    if hi <= lo {
        return None;
    }
    for _ in 0..UNWIND_SEARCH_STEPS {
        if hi - lo <= 1 {
            break;
        }
        let mid = lo + (hi - lo) / 2;
        if u64::from(UNWIND_ROWS.get(table.rows_start.wrapping_add(mid))?.pc) <= pc {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let row = *UNWIND_ROWS.get(table.rows_start.wrapping_add(lo))?;
    (row.kind != unwind_kind::NONE).then_some(row)
}

/// One 8-byte read of the traced stack.
fn read_stack(window: &mut StackWindow, address: u64) -> Result<u64, usize> {
    window.read::<1>(address).map(|[word]| word)
}

/// The steps on `UnwindRow`.
fn step_by_row(row: UnwindRow, regs: &Registers, window: &mut StackWindow) -> Result<Registers, usize> {
    let offset = u64::from(row.cfa_offset);
    let cfa = match row.kind & UNWIND_CFA_MASK {
        unwind_kind::CFA_RSP => regs.rsp.wrapping_add(offset),
        unwind_kind::CFA_RBP if regs.rbp_known != 0 => regs.rbp.wrapping_add(offset),
        unwind_kind::CFA_PLT => regs.rsp.wrapping_add(offset + if regs.rip & 15 >= 11 { 8 } else { 0 }),
        unwind_kind::END => return Err(unwind_stop::WHOLE),
        _ => return Err(unwind_stop::UNSUPPORTED),
    };
    let (return_address, rbp, rbp_known) = match row.kind >> UNWIND_RA_SHIFT {
        unwind_ra::LINK_REGISTER => {
            let link = window.take_link();
            if link == 0 {
                return Err(unwind_stop::UNSUPPORTED);
            }
            let (rbp, rbp_known) = caller_frame_pointer(row.rbp, cfa, regs, window)?;
            (link, rbp, rbp_known)
        }
        unwind_ra::FRAME_RECORD if row.rbp != 0 && row.rbp != UNWIND_RBP_LOST => {
            // The frame pointer and the return address above it (x86-64's `push %rbp` prologue,
            // arm64's `stp x29, x30`): one read.
            let [rbp, return_address] =
                window.read::<2>(cfa.wrapping_add((i64::from(row.rbp) * 8) as u64))?;
            (return_address, rbp, 1)
        }
        rule if rule <= unwind_ra::DEEPEST => {
            // At CFA - 8 * (rule + 1); x86-64's rows all say rule 0, CFA-8.
            let slot = cfa.wrapping_sub(8 * (u64::from(rule) + 1));
            if row.rbp == -2 && rule == 0 {
                // x86-64's `push %rbp` prologue: rbp right below the return address, one read.
                let [rbp, return_address] = window.read::<2>(cfa.wrapping_sub(16))?;
                (return_address, rbp, 1)
            } else {
                let return_address = read_stack(window, slot)?;
                let (rbp, rbp_known) = caller_frame_pointer(row.rbp, cfa, regs, window)?;
                (return_address, rbp, rbp_known)
            }
        }
        _ => return Err(unwind_stop::UNSUPPORTED),
    };
    let return_address = crate::registers::code_address(return_address);
    if return_address == 0 {
        return Err(unwind_stop::WHOLE);
    }
    Ok(Registers { rip: return_address, rsp: cfa, rbp, rbp_known })
}

/// The caller's frame pointer (rbp, x29) and whether it is known, per the row's `rbp`.
fn caller_frame_pointer(
    units: i8,
    cfa: u64,
    regs: &Registers,
    window: &mut StackWindow,
) -> Result<(u64, u64), usize> {
    match units {
        0 => Ok((regs.rbp, regs.rbp_known)),
        UNWIND_RBP_LOST => Ok((0, 0)),
        units => Ok((read_stack(window, cfa.wrapping_add((i64::from(units) * 8) as u64))?, 1)),
    }
}

/// CFA = rbp + 16, where rbp must point into the stack above this frame. (arm64's frame record is
/// laid out the same way: [x29] the caller's x29, [x29 + 8] the saved x30; its ABI keeps x29 for
/// the frame pointer, and the C library's `_start` zeroes it: a chain that reaches 0 is whole.)
fn step_by_frame_pointer(regs: &Registers, window: &mut StackWindow) -> Result<Registers, usize> {
    if cfg!(bpf_target_arch = "aarch64") && regs.rbp_known != 0 && regs.rbp == 0 {
        return Err(unwind_stop::WHOLE);
    }
    if regs.rbp_known == 0 || regs.rbp == 0 || regs.rbp < regs.rsp {
        return Err(unwind_stop::NO_ROW);
    }
    // [rbp] is the caller's rbp, [rbp + 8] the return address into the caller.
    let [caller_rbp, return_address] = window.read::<2>(regs.rbp)?;
    let return_address = crate::registers::code_address(return_address);
    if return_address == 0 {
        return Err(unwind_stop::WHOLE);
    }
    Ok(Registers { rip: return_address, rsp: regs.rbp + 16, rbp: caller_rbp, rbp_known: 1 })
}
