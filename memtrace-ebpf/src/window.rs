//! The traced stack as the unwinder reads it: a kilobyte at a time into a per-CPU window, and a memo
//! of the last walk, so that a stack taken again from the same place costs one short read.
//!
//! A call of bpf_probe_read_user costs about 110 ns here whatever its size up to a page, and a frame
//! takes one or two reads: one window read serves the frames of a kilobyte of stack. A walk is a
//! function of its start (program image, registers, the unwind tables as they stand) and of the
//! words it reads; when the next walk on the CPU starts the same and finds the same words where the
//! last one read them, it is the same walk, and its stack is the memo's. A loop that allocates from
//! one place, the common case, is unwound once per CPU.

use core::ffi::c_void;

use aya_ebpf::{
    helpers::{bpf_probe_read_user, generated},
    macros::map,
    maps::{Array, PerCpuArray},
};
use memtrace_common::unwind_stop::READ_FAULT;

/// Words of the traced stack read at once.
const WINDOW_WORDS: usize = 128;

/// User pages: a stack mapping ends on a page boundary.
const PAGE_SIZE: u64 = 4096;

/// Words a memoized walk may have read (two a frame to `STACK_DEPTH` frames).
const MEMO_WORDS: usize = 64;

/// A frame's registers as far as unwinding needs them.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Registers {
    pub(crate) rip: u64,
    pub(crate) rsp: u64,
    pub(crate) rbp: u64,
    /// 0 once a frame's row said the caller's rbp cannot be recovered.
    pub(crate) rbp_known: u64,
}

/// Where a walk starts: what, besides the words it reads, decides where it goes.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct WalkStart {
    pub(crate) tgid: u64,
    /// The program image (`ProcessStats::started_ns`): an exec maps other files.
    pub(crate) started_ns: u64,
    /// `UNWIND_EPOCH` when the walk began.
    pub(crate) epoch: u64,
    pub(crate) regs: Registers,
}

impl WalkStart {
    /// Field by field with no early exit: compared chains of fields may become a call to memcmp,
    /// which BPF has not.
    fn same_as(&self, other: &WalkStart) -> bool {
        let differ = (self.tgid ^ other.tgid)
            | (self.started_ns ^ other.started_ns)
            | (self.epoch ^ other.epoch)
            | (self.regs.rip ^ other.regs.rip)
            | (self.regs.rsp ^ other.regs.rsp)
            | (self.regs.rbp ^ other.regs.rbp);
        differ == 0
    }
}

/// Bumped by userspace (memtrace-user/src/unwind/kernel.rs) after each write to a mapping table or
/// a file slot: a memo from before a change is not used after it.
#[map]
static UNWIND_EPOCH: Array<u64> = Array::with_max_entries(1, 0);

/// The unwind tables' epoch now.
pub(crate) fn tables_epoch() -> u64 {
    UNWIND_EPOCH.get(0).copied().unwrap_or(0)
}

/// Window fills a memoized walk may have made.
const MEMO_REGIONS: usize = 4;

/// A stretch of the traced stack one window fill read, as the memo reads it again: where it
/// starts, and the bytes from there to the furthest word the walk read in it.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Region {
    base: u64,
    span: u64,
}

/// The last walk that read the traced stack in at most `MEMO_REGIONS` window fills, and what it
/// found.
#[repr(C)]
#[derive(Clone, Copy)]
struct WalkMemo {
    /// 0 while a walk writes the memo, and when it could not be memoized.
    valid: u64,
    start: WalkStart,
    regions: [Region; MEMO_REGIONS],
    /// Words read; only the first `MEMO_WORDS` are kept, and a walk that read more is no memo.
    logged: u64,
    /// Each word read, in the order read: its region (high 32 bits) and its index in the
    /// region's window (low 32 bits), and its value.
    place: [u64; MEMO_WORDS],
    value: [u64; MEMO_WORDS],
    /// The stack's key in STACKS and why the walk ended (`unwind_stop`).
    key: u64,
    stop: u64,
}

mod window_state {
    /// Nothing read yet in this walk.
    pub const EMPTY: u64 = 0;
    pub const FILLED: u64 = 1;
    /// A window read failed (the stack ends within a window): the walk reads word by word.
    pub const EXHAUSTED: u64 = 2;
}

/// A copy of the traced stack from `base` up, refilled where a read falls outside it.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct StackWindow {
    base: u64,
    /// `window_state`.
    state: u64,
    /// Window fills in this walk.
    fills: u64,
    /// Words the last fill read (the window, or less at the end of the stack).
    valid: u64,
    /// The window, and a spare word that no read fills: a read of two words starting at the last
    /// stays inside the value for the verifier (the test that rejects it is on another register).
    words: [u64; WINDOW_WORDS + 1],
    memo: WalkMemo,
}

/// What `check_word` works on, on the caller's stack.
#[repr(C)]
struct Check {
    window: *mut StackWindow,
    /// The region now in the window, plus one (0: none yet).
    loaded: u64,
    /// 0 once a word differs.
    same: u64,
}

/// bpf_loop's callback: whether the memo's word `index` still holds its value, reading its region
/// into the window first if another is there; 1 ends the loop.
extern "C" fn check_word(index: u64, check: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the `Check` that `recall` passed, whose window is this CPU's
    // map value, ours until the program ends.
    let (check, window) = unsafe {
        let check = &mut *(check as *mut Check);
        let window = &mut *check.window;
        (check, window)
    };
    let slot = index as usize & (MEMO_WORDS - 1);
    let place = window.memo.place[slot];
    let region = place >> 32;
    if region + 1 != check.loaded {
        if !window.load(window.memo.regions[region as usize & (MEMO_REGIONS - 1)]) {
            check.same = 0;
            return 1;
        }
        check.loaded = region + 1;
    }
    if window.words[place as usize & (WINDOW_WORDS - 1)] != window.memo.value[slot] {
        check.same = 0;
        return 1;
    }
    0
}

#[map]
static STACK_WINDOW: PerCpuArray<StackWindow> = PerCpuArray::with_max_entries(1, 0);

/// This CPU's window.
pub(crate) fn stack_window() -> Option<&'static mut StackWindow> {
    // SAFETY: a per-CPU map value, ours until the program ends.
    STACK_WINDOW.get_ptr_mut(0).map(|window| unsafe { &mut *window })
}

impl StackWindow {
    /// The memo's stack key and stop if a walk from `start` would be the memoized walk: the same
    /// start, and the same words where it read them (one read per window fill it made).
    pub(crate) fn recall(&mut self, start: &WalkStart) -> Option<(u64, u64)> {
        let logged = self.memo.logged;
        if self.memo.valid == 0 || !start.same_as(&self.memo.start) || logged > MEMO_WORDS as u64 {
            return None;
        }
        let mut check = Check { window: self, loaded: 0, same: 1 };
        // A word a step, the step verified once: a loop in the program would be verified once
        // per iteration and per way through it.
        // SAFETY: the callback is a function of this program, and its context is `check`, on this
        // program's stack for the whole call, as bpf_loop requires.
        unsafe { generated::bpf_loop(logged as u32, check_word as *mut c_void, (&raw mut check).cast(), 0) };
        (check.same != 0).then_some((self.memo.key, self.memo.stop))
    }

    /// Reads `region` of the traced stack into the window; false if it cannot be read.
    fn load(&mut self, region: Region) -> bool {
        self.copy_in(region.base, region.span)
    }

    /// Copies `bytes` of the traced stack at `address` into the window (8 to a kilobyte); false if
    /// they cannot be read, or are no size the window takes.
    fn copy_in(&mut self, address: u64, bytes: u64) -> bool {
        if !(8..=(WINDOW_WORDS * 8) as u64).contains(&bytes) {
            return false;
        }
        // Straight into the map value (a kilobyte is more than the BPF stack holds).
        // SAFETY: the helper writes at most `bytes` bytes (at most the window) into `words` and
        // checks the user addresses, failing rather than faulting.
        let read = unsafe {
            generated::bpf_probe_read_user(
                self.words.as_mut_ptr().cast(),
                bytes as u32,
                address as *const c_void,
            )
        };
        read == 0
    }

    /// Empties the window for a walk from `start`, which the memo will describe if it can.
    pub(crate) fn begin(&mut self, start: &WalkStart) {
        self.state = window_state::EMPTY;
        self.fills = 0;
        self.memo.valid = 0;
        self.memo.start = *start;
        self.memo.logged = 0;
    }

    /// Makes the walk just ended the memo, if every word it read came from a window fill.
    pub(crate) fn remember(&mut self, key: u64, stop: u64) {
        if self.fills > MEMO_REGIONS as u64
            || self.state == window_state::EXHAUSTED
            || self.memo.logged > MEMO_WORDS as u64
        {
            return;
        }
        self.memo.key = key;
        self.memo.stop = stop;
        self.memo.valid = 1;
    }

    /// `N` words of the traced stack at `address`: from the window, else after refilling it there.
    pub(crate) fn read<const N: usize>(&mut self, address: u64) -> Result<[u64; N], usize> {
        if let Some(words) = self.cached(address) {
            self.log(address, words);
            return Ok(words);
        }
        if self.state != window_state::EXHAUSTED {
            if self.fill(address) {
                let words = self.cached(address).ok_or(READ_FAULT)?;
                self.log(address, words);
                return Ok(words);
            }
            self.state = window_state::EXHAUSTED;
        }
        // SAFETY: the helper checks the user address and fails rather than faults.
        unsafe { bpf_probe_read_user(address as *const [u64; N]) }.map_err(|_| READ_FAULT)
    }

    /// Refills the window from `address`: a kilobyte, or, where that runs past the end of the
    /// stack's mapping (the outermost frames lie within a kilobyte of it), to the end of the page.
    /// False if neither can be read.
    fn fill(&mut self, address: u64) -> bool {
        let to_page_end = PAGE_SIZE - (address & (PAGE_SIZE - 1));
        for size in [(WINDOW_WORDS * 8) as u64, to_page_end] {
            let size = size.min((WINDOW_WORDS * 8) as u64) & !7;
            if self.copy_in(address, size) {
                self.base = address;
                self.valid = size / 8;
                self.state = window_state::FILLED;
                self.fills += 1;
                self.memo.regions[self.region()] = Region { base: address, span: 0 };
                return true;
            }
        }
        false
    }

    /// The memo's region of the current window fill (the first again past `MEMO_REGIONS` fills,
    /// when the walk is no memo anyway).
    fn region(&self) -> usize {
        self.fills.wrapping_sub(1) as usize & (MEMO_REGIONS - 1)
    }

    /// Notes words read from a window fill, for the memo. With one branch (the span's maximum):
    /// this runs for every read of every frame, and the verifier walks each way through a frame.
    fn log<const N: usize>(&mut self, address: u64, words: [u64; N]) {
        let region = self.region();
        let first = address.wrapping_sub(self.base) / 8;
        for (i, word) in words.into_iter().enumerate() {
            let slot = (self.memo.logged as usize + i) & (MEMO_WORDS - 1);
            self.memo.place[slot] = (region as u64) << 32 | (first + i as u64);
            self.memo.value[slot] = word;
        }
        self.memo.logged += N as u64;
        let span = &mut self.memo.regions[region].span;
        *span = (*span).max((first + N as u64) * 8);
    }

    /// The words at `address` if the window holds them all.
    fn cached<const N: usize>(&self, address: u64) -> Option<[u64; N]> {
        const { assert!(N <= 2, "the window has one spare word") };
        let offset = address.wrapping_sub(self.base);
        if self.state != window_state::FILLED
            || offset % 8 != 0
            || offset / 8 + N as u64 > self.valid
            || self.valid > WINDOW_WORDS as u64
        {
            return None;
        }
        // Masked for the verifier, which does not carry the test above over to this register.
        let first = (offset / 8) as usize & (WINDOW_WORDS - 1);
        let mut words = [0u64; N];
        for (i, word) in words.iter_mut().enumerate() {
            *word = *self.words.get(first + i)?;
        }
        Some(words)
    }
}
