//! The user stack of each allocation, and what each (process, stack) allocated and still holds.
//!
//! Stacks are unwound at allocation time (unwinder.rs, with the tables userspace builds from each
//! file's .eh_frame). A frame is kept only inside an executable file mapping
//! the unwinder knows; where it cannot go on, the stack ends there (never a guessed frame) and the
//! reason is counted in `ProcessStats::unwind_stops`.
//!
//! Frames are recorded as the unwinder found them, (file slot, file offset); a stack seen for the
//! first time is written to STACKS in build-ID form, each frame's build ID copied from its file's
//! slot, so userspace symbolizes it after the process is gone (memtrace-user/src/collect/symbolize.rs).
//! A process whose mapping table is not loaded yet falls back to the frame-pointer walk and
//! bpf_get_stack's build-ID form, cut at the first frame outside a file.

use core::{
    ffi::c_void,
    ptr::{read_volatile, write_volatile},
};

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_F_USER_BUILD_ID, BPF_F_USER_STACK, BPF_NOEXIST},
    helpers::{
        bpf_probe_read_user,
        generated::{bpf_get_stack, bpf_loop},
    },
    macros::map,
    maps::{Array, HashMap, LruHashMap},
    programs::{ProbeContext, RetProbeContext},
    EbpfContext,
};
use memtrace_common::{
    interpreter, interpreter_stop, unwind_stop, AllocatorCode, DeepStackFrames, ProcessStats, StackFrame,
    StackFrames, StackKey, StackTotals, FRAME_BUILD_ID, FRAME_IP, MAX_ALLOCATOR_CODES, MAX_RAW_STACKS,
    MAX_STACKS, MAX_STACK_TOTALS, NO_STACK, SHALLOW_STACK_DEPTH, STACK_DEPTH,
};

use crate::{
    counters::{add, add_signed},
    frame_memo::FrameMemos,
    helpers::{loaded, map_value, now_ns},
    interpreters::{read_frames, InterpreterFrames},
    registers,
    scratch::{Locations, RawStack, Scratch, UnwindState},
    stack_read::{tables_epoch, Registers, WalkStart},
    unwinder::{find_mapping, unwind, NO_MAPPINGS, UNWIND_FILES, UNWIND_MAPPINGS},
};

/// Call stacks of at most `SHALLOW_STACK_DEPTH` frames by a 64-bit hash of their frames; allocated
/// on demand, as few stacks are distinct.
#[map]
pub(crate) static STACKS: HashMap<u64, StackFrames> =
    HashMap::with_max_entries(MAX_STACKS, BPF_F_NO_PREALLOC);

/// The deeper call stacks, the same way: a stack is in one of the two maps, by its depth.
#[map]
pub(crate) static DEEP_STACKS: HashMap<u64, DeepStackFrames> =
    HashMap::with_max_entries(MAX_STACKS, BPF_F_NO_PREALLOC);

#[map]
pub(crate) static STACK_TOTALS: HashMap<StackKey, StackTotals> =
    HashMap::with_max_entries(MAX_STACK_TOTALS, BPF_F_NO_PREALLOC);

/// Raw stacks seen, by a hash of (process, program image, return addresses), to their key in STACKS.
#[map]
static RAW_STACKS: LruHashMap<u64, RawStackEntry> = LruHashMap::with_max_entries(MAX_RAW_STACKS, 0);

/// A RAW_STACKS value, which names its own key: an LRU map hands a node it evicts to the next
/// insert at once, so a run preempted between its lookup and its read (on a preemptible kernel)
/// can find in the node another raw stack's key. The key is read first, then the owner: a node
/// that names this raw stack after its key was read held this raw stack's key (save within the
/// nanoseconds another CPU takes to copy a new entry in, under the bucket's lock).
#[repr(C)]
#[derive(Clone, Copy)]
struct RawStackEntry {
    key: u64,
    raw: u64,
}

/// The stack key of a raw stack seen before, if its entry is (still) this raw stack's.
fn known_raw_stack(raw_key: u64) -> Option<u64> {
    let entry = RAW_STACKS.get_ptr(raw_key)?;
    // SAFETY: a map value, valid (if perhaps reused for another raw stack) while the program runs.
    let (key, owner) = unsafe { (read_volatile(&(*entry).key), read_volatile(&(*entry).raw)) };
    (owner == raw_key).then_some(key)
}

/// Set by the loader: 0 when run with --no-stacks.
#[no_mangle]
pub(crate) static CAPTURE_STACKS: u8 = 1;

/// The key of the current user stack in STACKS, or NO_STACK. Taken in a return probe, where the
/// registers are the allocator's caller's, in a scratch slot this run claims (scratch.rs): a run
/// that finds none free takes no stack and counts a loss.
#[inline(never)]
pub(crate) fn capture_stack(ctx: &RetProbeContext, tgid: u32, stats: &ProcessStats) -> u64 {
    if loaded(&CAPTURE_STACKS) == 0 {
        return NO_STACK;
    }
    let Some(mut claim) = Scratch::claim() else {
        add(&stats.lost_events, 1);
        return NO_STACK;
    };
    let Some(memos) = FrameMemos::of(claim.slot()) else {
        add(&stats.lost_events, 1);
        return NO_STACK;
    };
    capture_in(ctx, tgid, stats, claim.get(), memos)
}

/// `capture_stack` in a claimed slot. A walk that repeats the slot's last one is not done again
/// (stack_read.rs); otherwise the raw return addresses are cheap to take and name the stack within one
/// program image, and its build-ID form, which outlives the process, is written once per distinct
/// raw stack and cached in RAW_STACKS.
fn capture_in(
    ctx: &RetProbeContext,
    tgid: u32,
    stats: &ProcessStats,
    scratch: &mut Scratch,
    memos: &mut FrameMemos,
) -> u64 {
    let saved = registers::saved(ctx.regs);
    let regs = Registers { rip: saved.pc, rsp: saved.sp, rbp: saved.fp, rbp_known: 1 };
    // The epoch is read before any table the walk reads. The start is kept in the slot, not on
    // the BPF stack, which the walk's chain of calls needs.
    let link = registers::link_register(ctx.regs);
    scratch.start =
        WalkStart { tgid: u64::from(tgid), started_ns: stats.started_ns, epoch: tables_epoch(), regs, link };
    let table = UNWIND_MAPPINGS.get_ptr(tgid);
    // SAFETY: a map value, valid while the program runs.
    let interpreter = table.map_or(interpreter::NONE, |table| unsafe { (*table).interpreter });
    scratch.interpreter.count = 0;
    // Its interpreter frames change under the same native frames: read each time, never memoized.
    if !read_frames(interpreter, tgid, stats.started_ns, &mut scratch.interpreter, &mut scratch.cursors) {
        if let Some((key, stop)) = scratch.window.recall(&scratch.start) {
            count_stop(stats, stop as usize);
            return key;
        }
    }
    // A process with no mapping table yet (its first moments) is walked with the kernel's
    // mappings alone (vma.rs).
    let mappings = table.or_else(|| NO_MAPPINGS.get_ptr(0));
    let state: *mut UnwindState = &raw mut scratch.state;
    if let Some(mappings) = mappings {
        scratch.window.begin(&scratch.start);
        // SAFETY: a map value, valid while the program runs.
        let mappings = unsafe { &*mappings };
        unwind(mappings, scratch, memos);
    }
    // SAFETY: the claimed slot's state; read back through memory so that every path's state is one.
    let (depth, stop) = unsafe { (read_volatile(&(*state).depth), read_volatile(&(*state).stop)) };
    // No mapping table, and the kernel's mappings name no file memtrace knows for the innermost
    // frame: frame pointers, and the kernel's build IDs.
    let unknown = table.is_none() && depth <= 1 && stop == unwind_stop::NO_MAPPING as u64;
    let by_tables = mappings.is_some() && !unknown;
    if by_tables {
        // SAFETY: as above.
        memos.commit(unsafe { &*state }, scratch.found.lookups == 0);
    }
    if !by_tables {
        let depth = walk_frame_pointers(ctx, &mut scratch.raw) as u64;
        // SAFETY: as above.
        unsafe {
            write_volatile(&mut (*state).depth, depth);
            write_volatile(&mut (*state).stop, unwind_stop::NO_MAPPINGS as u64);
        }
    }
    // SAFETY: as above.
    let (depth, stop) =
        unsafe { (read_volatile(&(*state).depth) as usize, read_volatile(&(*state).stop) as usize) };
    count_stop(stats, stop);
    count_interpreter_stop(stats, &mut scratch.interpreter, depth as u64);
    // The same addresses in another process, or in this one after an exec, are another stack.
    let seed = fnv1a(fnv1a(FNV_OFFSET, u64::from(tgid)), stats.started_ns);
    let raw_key = raw_stack_key(seed, scratch, depth as u64);
    let key = match known_raw_stack(raw_key) {
        Some(key) => key,
        None => {
            let raw = &scratch.raw;
            let last = raw[depth.wrapping_sub(1) & (STACK_DEPTH - 1)];
            crate::debug::memtrace_short_stack(tgid, depth as u64, stop as u64, raw[0], last);
            let key = match by_tables {
                true => record_locations(stats, scratch),
                false => resolve_build_ids(ctx, stats, &mut scratch.frames, depth),
            };
            if key != NO_STACK {
                // A full cache evicts its least recently used entry: nothing is lost, only
                // resolved again. Never over another run's entry: a node replaced is freed to the
                // next insert while a run may hold it.
                let entry = RawStackEntry { key, raw: raw_key };
                let _ = RAW_STACKS.insert(raw_key, &entry, u64::from(BPF_NOEXIST));
            }
            key
        }
    };
    // Only a walk by the tables is memoized (it read the stack through the window), and only one
    // that needed no mapping of the kernel's, which can change with no change of the epoch.
    if by_tables && interpreter == interpreter::NONE && scratch.found.lookups == 0 && key != NO_STACK {
        scratch.window.remember(key, stop as u64);
    }
    key
}

/// The raw stack's key: its return addresses and its interpreter frames, hashed from `seed`. Not
/// inlined: its frame would add to that of every chain through `capture_in`.
#[inline(never)]
fn raw_stack_key(seed: u64, scratch: &Scratch, depth: u64) -> u64 {
    let native = hash_words(seed, &scratch.raw, depth.min(STACK_DEPTH as u64));
    hash_words(native, scratch.interpreter.words(), scratch.interpreter.count * 4)
}

/// Counts why a stack ended.
fn count_stop(stats: &ProcessStats, stop: usize) {
    if let Some(counter) = stats.unwind_stops.get(stop & (unwind_stop::COUNT - 1)) {
        add(counter, 1);
    }
}

/// Counts why a stack's interpreter frames ended short, if they did: as they were read, or cut by
/// the native frames filling the stack's `STACK_DEPTH` (they follow the native ones).
fn count_interpreter_stop(stats: &ProcessStats, frames: &mut InterpreterFrames, depth: u64) {
    if frames.count > 0 && depth + frames.count > STACK_DEPTH as u64 {
        frames.cut_at(interpreter_stop::DEPTH_LIMIT);
    }
    let Some(stop) = frames.stop() else { return };
    // Masked, not only bounded: the verifier must see the index's bounds in the register used
    // (6.1 saw them in a copy only).
    if let Some(counter) = stats.interpreter_stops.get(stop & (interpreter_stop::COUNT - 1)) {
        add(counter, 1);
    }
}

/// Each probed allocator's code around its free probe (`AllocatorCode`), written by the loader.
#[map]
pub(crate) static ALLOCATOR_CODES: Array<AllocatorCode> = Array::with_max_entries(MAX_ALLOCATOR_CODES, 0);

/// Whether the function a probe stopped at (free, at its entry: the return address is on top of
/// the stack) was called from its own code: the allocator's library calling itself, as glibc does
/// when it flushes an exiting thread's tcache. By allocator `allocator`'s executable segment
/// around the probe (ALLOCATOR_CODES), else by the process's mapping table (same file); false
/// where neither is known.
pub(crate) fn called_from_within(ctx: &ProbeContext, tgid: u32, allocator: u64) -> bool {
    let rip = registers::saved(ctx.regs).pc;
    let Some(return_address) = registers::return_address_at_entry(ctx.regs) else {
        return false;
    };
    // The allocator's executable segment around the probe, as the loader found it in the file: no
    // need of the process's mapping table, which a process in its first moments has not yet.
    if let Some(code) = ALLOCATOR_CODES.get(allocator as u32).filter(|code| code.after != 0) {
        return rip.wrapping_sub(code.before) <= return_address
            && return_address < rip.wrapping_add(code.after);
    }
    let Some(mappings) = UNWIND_MAPPINGS.get_ptr(&tgid) else {
        return false;
    };
    // SAFETY: a map value, valid while the program runs.
    let mappings = unsafe { &*mappings };
    match (find_mapping(mappings, rip), find_mapping(mappings, return_address)) {
        (Some(callee), Some(caller)) => callee.file == caller.file,
        _ => false,
    }
}

/// Writes the unwound stack to STACKS in build-ID form (each frame's build ID from its file's
/// slot; the address where the file has none); its key, or NO_STACK. The depth is read back from
/// the slot's state, so every path that gets here is verified as one.
fn record_locations(stats: &ProcessStats, scratch: &mut Scratch) -> u64 {
    // SAFETY: the claimed slot's state.
    let depth = unsafe { read_volatile(&scratch.state.depth) };
    let frames: *mut DeepStackFrames = &raw mut scratch.frames;
    // The interpreter frames follow the native ones, as many as fit.
    let total = (depth + scratch.interpreter.count).min(STACK_DEPTH as u64);
    let mut record = Record {
        raw: &scratch.raw,
        locations: &scratch.locations,
        interpreter: &scratch.interpreter,
        frames: frames.cast(),
        depth,
        total,
    };
    // Frames past the stack are zeroed to the end of the form it is stored in.
    let stored = if total <= SHALLOW_STACK_DEPTH as u64 { SHALLOW_STACK_DEPTH } else { STACK_DEPTH };
    // SAFETY: the callback is a function of this program; its context lives on this stack for the
    // whole call.
    unsafe { bpf_loop(stored as u32, record_frame as *mut c_void, (&raw mut record).cast(), 0) };
    store_frames(stats, frames, total * 4)
}

/// What `record_frame` works on, on the caller's stack.
#[repr(C)]
struct Record {
    raw: *const RawStack,
    locations: *const Locations,
    /// STACK_SCRATCH, as words: a StackFrame is four u64 words (status and the build ID's first 4
    /// bytes, then 8 and 8 more bytes of it, then the offset or address).
    frames: *mut [[u64; 4]; STACK_DEPTH],
    interpreter: *const InterpreterFrames,
    /// Native frames, then native and interpreter frames.
    depth: u64,
    total: u64,
}

/// bpf_loop's callback: writes frame `index` of the stack (zeroes past the depth).
extern "C" fn record_frame(index: u64, record: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the `Record` that `record_locations` passed, whose pointers are
    // into the slot this run claimed.
    let (raw, locations, interpreter, frames, depth, total) = unsafe {
        let record = &*(record as *const Record);
        (
            &*record.raw,
            &*record.locations,
            &*record.interpreter,
            &mut *record.frames,
            record.depth,
            record.total,
        )
    };
    let slot = index as usize & (STACK_DEPTH - 1);
    let (Some(frame), Some(location), Some(address)) =
        (frames.get_mut(slot), locations.get(slot), raw.get(slot))
    else {
        return 1;
    };
    let words = if index >= total {
        [0; 4]
    } else if index >= depth {
        interpreter.stored_words(index - depth)
    } else {
        match UNWIND_FILES.get(location.file) {
            Some(file) if file.has_build_id != 0 => {
                let id = &file.build_id;
                let head = u32::from_le_bytes([id[0], id[1], id[2], id[3]]);
                let middle = u64::from_le_bytes([id[4], id[5], id[6], id[7], id[8], id[9], id[10], id[11]]);
                let tail =
                    u64::from_le_bytes([id[12], id[13], id[14], id[15], id[16], id[17], id[18], id[19]]);
                [FRAME_BUILD_ID as u32 as u64 | u64::from(head) << 32, middle, tail, location.offset]
            }
            _ => [FRAME_IP as u32 as u64, 0, 0, *address],
        }
    };
    // Word by word: a whole-struct store would be a call to a byte loop (memset, memcpy), which
    // the verifier walks byte by byte.
    for (slot, word) in frame.iter_mut().zip(words) {
        // SAFETY: a word of the scratch value.
        unsafe { write_volatile(slot, word) };
    }
    0
}

/// Stores the stack in `scratch` (its first `used` words hashed, zeroed after them) in STACKS, or
/// in DEEP_STACKS if it has more than `SHALLOW_STACK_DEPTH` frames; its key or NO_STACK.
fn store_frames(stats: &ProcessStats, scratch: *mut DeepStackFrames, used: u64) -> u64 {
    // SAFETY: the frames of the slot this run claimed; a stack is whole u64 words.
    let words = unsafe { &*(scratch as *const [u64; STACK_DEPTH * 4]) };
    let hash = hash_words(FNV_OFFSET, words, used);
    let stored = if used <= (SHALLOW_STACK_DEPTH * 4) as u64 {
        // SAFETY: as above; a shallow stack is the first frames of the deep form.
        let shallow = unsafe { &*(scratch as *const StackFrames) };
        STACKS.get_ptr(hash).is_some() || STACKS.insert(hash, shallow, 0).is_ok()
    } else {
        // SAFETY: as above.
        DEEP_STACKS.get_ptr(hash).is_some() || DEEP_STACKS.insert(hash, unsafe { &*scratch }, 0).is_ok()
    };
    if !stored {
        add(&stats.lost_events, 1);
        return NO_STACK;
    }
    hash
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv1a(hash: u64, word: u64) -> u64 {
    (hash ^ word).wrapping_mul(0x0100_0000_01b3)
}

/// FNV-1a over the first `used` words: 64 bits make collisions between distinct stacks negligible.
/// A word a step of bpf_loop, verified once: a loop of up to 512 words would be walked by the
/// verifier once per word.
fn hash_words<const N: usize>(seed: u64, words: &[u64; N], used: u64) -> u64 {
    let mut run = HashRun { words, hash: seed };
    let steps = used.min(N as u64) as u32;
    // SAFETY: the callback is a function of this program; its context lives on this stack for the
    // whole call, and its words as long as the caller's borrow.
    unsafe { bpf_loop(steps, hash_word::<N> as *mut c_void, (&raw mut run).cast(), 0) };
    if run.hash == NO_STACK {
        1
    } else {
        run.hash
    }
}

/// What `hash_word` works on, on the caller's stack.
#[repr(C)]
struct HashRun<const N: usize> {
    words: *const [u64; N],
    hash: u64,
}

/// bpf_loop's callback: folds word `index` into the hash.
extern "C" fn hash_word<const N: usize>(index: u64, run: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the `HashRun` that `hash_words` passed.
    let run = unsafe { &mut *(run as *mut HashRun<N>) };
    // SAFETY: the caller's words, borrowed for the whole loop.
    let Some(word) = (unsafe { &*run.words }).get(index as usize & (N - 1)) else {
        return 1;
    };
    run.hash = fnv1a(run.hash, *word);
    0
}

/// Return addresses by frame pointers, from a return probe's registers: the allocator's caller
/// first. A frame must lie above the one it was called from (the stack grows down), which ends the
/// walk at code without frame pointers instead of reading on through its data. Returns the depth.
fn walk_frame_pointers(ctx: &RetProbeContext, raw: &mut RawStack) -> usize {
    let saved = registers::saved(ctx.regs);
    let (mut ip, mut frame) = (saved.pc, saved.fp);
    let mut depth = 0;
    for slot in raw.iter_mut().take(SHALLOW_STACK_DEPTH) {
        *slot = ip;
        depth += 1;
        if frame == 0 {
            break;
        }
        // [frame] is the caller's frame pointer, [frame + 8] the return address into the caller.
        // SAFETY: the helper checks the user address and fails rather than faults.
        let Ok([next, return_address]) = (unsafe { bpf_probe_read_user(frame as *const [u64; 2]) }) else {
            break;
        };
        let return_address = registers::code_address(return_address);
        if return_address == 0 {
            break;
        }
        ip = return_address;
        frame = if next > frame { next } else { 0 };
    }
    depth
}

/// The current stack in build-ID form, cut to the `depth` frames the frame-pointer walk found
/// (at most `SHALLOW_STACK_DEPTH`), stored in STACKS; its key, or NO_STACK.
fn resolve_build_ids(
    ctx: &RetProbeContext,
    stats: &ProcessStats,
    deep: &mut DeepStackFrames,
    depth: usize,
) -> u64 {
    let deep: *mut DeepStackFrames = deep;
    // The shallow form: the first frames of the deep one.
    let frames: *mut StackFrames = deep.cast();
    let flags = u64::from(BPF_F_USER_STACK | BPF_F_USER_BUILD_ID);
    let size = core::mem::size_of::<StackFrames>() as u32;
    // bpf_get_stack zeroes what it does not fill, so equal stacks are equal bytes.
    // SAFETY: the helper writes at most `size` bytes into the claimed slot's frames.
    let copied = unsafe { bpf_get_stack(ctx.as_ptr(), frames.cast(), size, flags) };
    if copied <= 0 {
        add(&stats.lost_events, 1);
        return NO_STACK;
    }
    // A frame the kernel could not place in a file is what a frame-pointer walk reads out of a
    // frame without one: the stack ends before it (the allocator's caller is always kept).
    let mut cut = Cut { frames, kept: depth as u64 };
    // SAFETY: the callback is a function of this program; its context lives on this stack for the
    // whole call.
    unsafe { bpf_loop(SHALLOW_STACK_DEPTH as u32, cut_frame as *mut c_void, (&raw mut cut).cast(), 0) };
    let used = (copied as u64 / 8).min(cut.kept * 4);
    store_frames(stats, deep, used)
}

/// What `cut_frame` works on, on the caller's stack.
#[repr(C)]
struct Cut {
    frames: *mut StackFrames,
    /// Frames kept so far: the walk's depth, or less where a frame lies in no file.
    kept: u64,
}

/// bpf_loop's callback: ends the stack at frame `index` if the kernel placed it in no file, and
/// zeroes it if the stack has ended.
extern "C" fn cut_frame(index: u64, cut: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the `Cut` that `resolve_build_ids` passed; its frames are the
    // claimed slot's.
    let (cut, frames) = unsafe {
        let cut = &mut *(cut as *mut Cut);
        let frames = &mut *cut.frames;
        (cut, frames)
    };
    let Some(frame) = frames.frames.get_mut(index as usize & (SHALLOW_STACK_DEPTH - 1)) else {
        return 1;
    };
    if index > 0 && frame.status != FRAME_BUILD_ID && cut.kept > index {
        cut.kept = index;
    }
    if index >= cut.kept {
        // SAFETY: a frame of the scratch value is four u64 words; see `Record::frames`.
        let words = unsafe { &mut *(frame as *mut StackFrame as *mut [u64; 4]) };
        for word in words.iter_mut() {
            // SAFETY: as above.
            unsafe { write_volatile(word, 0) };
        }
    }
    0
}

/// Adds an allocation (or, with a negative count, a free) to its stack's totals.
/// What one allocation or free changes in its stack's totals.
pub(crate) struct StackChange {
    /// +1 for an allocation, -1 for a free.
    pub(crate) allocations: i64,
    pub(crate) bytes: i64,
    /// A free of the thread's latest allocation.
    pub(crate) temporary: bool,
}

impl StackChange {
    pub(crate) fn allocated(size: u64) -> Self {
        Self { allocations: 1, bytes: size as i64, temporary: false }
    }

    pub(crate) fn freed(size: u64) -> Self {
        Self { allocations: -1, bytes: -(size as i64), temporary: false }
    }
}

/// Zeroed stack totals, never written: new entries are inserted from here (memleak's zeroed
/// template), not built on the BPF stack.
#[map]
static FRESH_STACK_TOTALS: Array<StackTotals> = Array::with_max_entries(1, 0);

/// A stack's totals, made on its first allocation; None when the table is full.
#[inline(never)]
fn stack_totals(key: StackKey) -> Option<&'static StackTotals> {
    if let Some(totals) = STACK_TOTALS.get_ptr(key) {
        return Some(map_value(totals));
    }
    let zeroed = FRESH_STACK_TOTALS.get_ptr(0)?;
    let created = STACK_TOTALS.insert(key, map_value(zeroed), u64::from(BPF_NOEXIST)).is_ok();
    let totals = STACK_TOTALS.get_ptr_mut(key)?;
    if created {
        // SAFETY: a map value, valid while the program runs; only its creator writes the field.
        unsafe { (*totals).started_ns = now_ns() };
    }
    Some(map_value(totals))
}

pub(crate) fn count_in_stack(tgid: u32, stats: &ProcessStats, stack: u64, change: StackChange) {
    if stack == NO_STACK {
        return;
    }
    let key = StackKey { tgid, _pad: 0, stack };
    let Some(totals) = stack_totals(key) else {
        add(&stats.lost_events, 1);
        crate::debug::memtrace_stack_totals_lost(tgid, stack);
        return;
    };
    if change.allocations > 0 {
        add(&totals.allocations, 1);
        add(&totals.allocated_bytes, change.bytes as u64);
    }
    if change.temporary {
        add(&totals.temporary_allocations, 1);
        add(&totals.temporary_bytes, change.bytes.unsigned_abs());
    }
    add_signed(&totals.live_allocations, change.allocations);
    add_signed(&totals.live_bytes, change.bytes);
}
