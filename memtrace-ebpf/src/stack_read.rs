//! The traced stack as the unwinder reads it: a kilobyte at a time into a window (in the run's
//! claimed scratch slot, scratch.rs), and a memo of the slot's last walk, so that a stack taken
//! again from the same place costs one short read.
//!
//! A call of bpf_probe_read_user costs about 110 ns here whatever its size up to a page, and a frame
//! takes one or two reads: one window read serves the frames of a kilobyte of stack. A walk is a
//! function of its start (program image, registers, the unwind tables as they stand) and of the
//! words it reads; when the next walk in the slot starts the same and finds the same words where the
//! last one read them, it is the same walk, and its stack is the memo's. A loop that allocates from
//! one place, the common case, is unwound once per slot.

use core::{arch::asm, ffi::c_void};

use aya_ebpf::{
    helpers::{bpf_probe_read_user, generated},
    macros::map,
    maps::Array,
};
use memtrace_common::unwind_stop::READ_FAULT;

/// Words of the traced stack read at once.
const WINDOW_WORDS: usize = 128;

/// User pages: a stack mapping ends on a page boundary.
const PAGE_SIZE: u64 = 4096;

/// Words a memoized walk may have read: two a frame to `SHALLOW_STACK_DEPTH` frames. A deeper walk
/// is not memoized (its raw stack is still known by RAW_STACKS).
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
    /// The innermost frame's link register (arm64's x30; 0 on x86-64), which its row may name as
    /// where its return address is (`unwind_ra::LINK_REGISTER`). Not compared by `same_as`: a walk
    /// that took it is not memoized (`StackWindow::take_link`), and one that did not went the same
    /// way whatever it held.
    pub(crate) link: u64,
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

/// Bumped by userspace (memtrace-user/src/collect/unwind/kernel.rs) after each write to a mapping table or
/// a file slot: a memo from before a change is not used after it.
#[map]
static UNWIND_EPOCH: Array<u64> = Array::with_max_entries(1, 0);

/// The unwind tables' epoch now.
pub(crate) fn tables_epoch() -> u64 {
    UNWIND_EPOCH.get(0).copied().unwrap_or(0)
}

/// Window fills a memoized walk may have made.
const MEMO_REGIONS: usize = 4;

/// The memo's regions as `recall` reads them again, each at `region * WINDOW_WORDS`.
const RECALL_WORDS: usize = MEMO_REGIONS * WINDOW_WORDS;

/// Logged words `recall` compares without a branch: a walk of a few frames checks one run, a deep
/// one up to `MEMO_WORDS / RECALL_RUN`.
const RECALL_RUN: usize = 16;

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
    /// The memo's regions, read again by `recall`.
    again: [u64; RECALL_WORDS],
    memo: WalkMemo,
    /// The words the current frame's step read, for frame_memo.rs.
    pub(crate) frame: FrameWords,
    /// The walk's start's link register while the walk is at its innermost frame; 0 after.
    link: u64,
}

/// Words a frame's step reads at most: two, one read of two or two of one.
pub(crate) const FRAME_WORDS: usize = 2;

/// The words one frame's step read, where and what: a frame that read more is counted, not kept
/// (`count` past `FRAME_WORDS`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct FrameWords {
    pub(crate) count: u64,
    pub(crate) address: [u64; FRAME_WORDS],
    pub(crate) value: [u64; FRAME_WORDS],
}

impl StackWindow {
    /// The memo's stack key and stop if a walk from `start` would be the memoized walk: the same
    /// start, and the same words where it read them (one read per window fill it made).
    #[inline(never)]
    pub(crate) fn recall(&mut self, start: &WalkStart) -> Option<(u64, u64)> {
        let logged = self.memo.logged;
        if self.memo.valid == 0 || !start.same_as(&self.memo.start) || logged > MEMO_WORDS as u64 {
            return None;
        }
        for (index, region) in self.memo.regions.into_iter().enumerate() {
            if region.span != 0 && !self.read_again(index, region) {
                return None;
            }
        }
        // Runs of words without a branch inside (a branch a word would be verified once per
        // way through every word before it), words past the last logged masked out.
        let logged = opaque(logged);
        let mut differ = 0;
        for run in 0..MEMO_WORDS / RECALL_RUN {
            if (run * RECALL_RUN) as u64 >= logged {
                break;
            }
            for slot in run * RECALL_RUN..(run + 1) * RECALL_RUN {
                let place = self.memo.place[slot];
                let at = ((place >> 32) as usize * WINDOW_WORDS + (place as usize & (WINDOW_WORDS - 1)))
                    & (RECALL_WORDS - 1);
                // All ones for a logged word (slot < logged), else 0.
                let logged_mask = ((slot as u64).wrapping_sub(logged) >> 63).wrapping_neg();
                differ |= (self.again[at] ^ self.memo.value[slot]) & logged_mask;
            }
        }
        (differ == 0).then_some((self.memo.key, self.memo.stop))
    }

    /// Reads the memo's region `index` of the traced stack again, into its place in `again`;
    /// false if it cannot be read.
    fn read_again(&mut self, index: usize, region: Region) -> bool {
        let index = index & (MEMO_REGIONS - 1);
        let words = &mut self.again[index * WINDOW_WORDS..(index + 1) * WINDOW_WORDS];
        copy_user(words, region.base, region.span)
    }

    /// Copies `bytes` of the traced stack at `address` into the window (8 to a kilobyte); false if
    /// they cannot be read, or are no size the window takes.
    fn copy_in(&mut self, address: u64, bytes: u64) -> bool {
        copy_user(&mut self.words[..WINDOW_WORDS], address, bytes)
    }

    /// Empties the window for a walk from `start`, which the memo will describe if it can.
    pub(crate) fn begin(&mut self, start: &WalkStart) {
        self.state = window_state::EMPTY;
        self.fills = 0;
        self.memo.valid = 0;
        self.memo.start = *start;
        self.memo.logged = 0;
        self.link = start.link;
        // A region this walk does not fill is not read again by a recall.
        for region in &mut self.memo.regions {
            region.span = 0;
        }
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
        let words = unsafe { bpf_probe_read_user(address as *const [u64; N]) }.map_err(|_| READ_FAULT)?;
        self.log_frame(address, words);
        Ok(words)
    }

    /// Starts the words of the walk's frame `depth`. Past the innermost frame no link register is
    /// known: x30 there is that frame's own return address.
    pub(crate) fn begin_frame(&mut self, depth: u64) {
        self.frame.count = 0;
        if depth != 0 {
            self.link = 0;
        }
    }

    /// The innermost frame's link register, for a row that says its return address is still there
    /// (0 past the innermost frame). A walk that takes it is no memo for another, whose link
    /// register may differ: its frame is marked as having read more words than a kept frame holds
    /// (frame_memo.rs), and the walk as having read more than `MEMO_WORDS`.
    pub(crate) fn take_link(&mut self) -> u64 {
        self.frame.count = FRAME_WORDS as u64 + 1;
        self.memo.logged = MEMO_WORDS as u64 + 1;
        self.link
    }

    /// Notes words read for the current frame.
    fn log_frame<const N: usize>(&mut self, address: u64, words: [u64; N]) {
        for (i, word) in words.into_iter().enumerate() {
            let slot = (self.frame.count as usize + i) & (FRAME_WORDS - 1);
            self.frame.address[slot] = address + 8 * i as u64;
            self.frame.value[slot] = word;
        }
        self.frame.count += N as u64;
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
        self.log_frame(address, words);
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

/// Copies `bytes` of the traced stack at `address` into `words` (8 bytes up to all of `words`);
/// false if they cannot be read, or do not fit.
fn copy_user(words: &mut [u64], address: u64, bytes: u64) -> bool {
    if bytes < 8 || bytes > (words.len() * 8) as u64 {
        return false;
    }
    // Straight into the map value (a kilobyte is more than the BPF stack holds).
    // SAFETY: the helper writes at most `bytes` bytes, which fit in `words`, and checks the user
    // addresses, failing rather than faulting.
    let read = unsafe {
        generated::bpf_probe_read_user(words.as_mut_ptr().cast(), bytes as u32, address as *const c_void)
    };
    read == 0
}

/// `value`, as something the compiler knows nothing about. Where it knows a bound (the memo's
/// `logged` is at most `MEMO_WORDS` past the check), it turns `(slot - logged) >> 63` into a compare,
/// and a compare into a branch (BPF has no conditional move): a branch a word, and 6.1's verifier
/// walks every way through a run of sixteen of them ("BPF program is too large").
fn opaque(value: u64) -> u64 {
    let mut value = value;
    // SAFETY: a move of the register to itself. (An empty template would leave two line-info
    // records on one instruction, which the kernel refuses.)
    unsafe { asm!("{value} = {value}", value = inout(reg) value) };
    value
}
