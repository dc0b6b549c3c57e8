//! The frames of each scratch slot's last walk, so that the next walk, once it comes to a frame
//! the last one passed with the same registers, takes the rest of the stack over from it, frame by
//! frame, after checking that the words each of those frames read still hold what they held. A
//! deep stack whose inner frames changed costs the changed frames, then one read (mostly from the
//! window) and a copy a shared frame: not a mapping search, a row search and the steps of every
//! frame. stack_read.rs's memo skips a walk that repeats the last one from its first frame; this one
//! takes over anywhere, and in processes whose interpreter frames make every stack new.
//!
//! Why it is the same walk: a frame's step is a function of its registers, of the tables (the same
//! epoch, the same program image) and of the words it reads. Where two walks have a frame with the
//! same registers, and the frames from there read the same words, they take the same frames from
//! there on. Two call paths that differ only in an outer frame differ in the word that frame's
//! return address was read from: the takeover stops at that frame, which is walked. Only walks
//! that found every mapping in the process's table are kept (the kernel's mappings can change
//! with no change of the epoch), and none that ended on a read that failed.

use core::ptr::{read_volatile, write_volatile};

use aya_ebpf::{
    macros::map,
    maps::{Array, PerCpuArray},
};
use memtrace_common::{unwind_stop, STACK_DEPTH};

use crate::{
    scratch::{FrameLocation, Slot, UnwindState, SLOTS_PER_CPU, SPARE_SLOTS},
    stack_read::{FrameWords, Registers, StackWindow, WalkStart, FRAME_WORDS},
};

/// One frame of a kept walk: where it was, what its step read.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct MemoFrame {
    /// The frame's registers, before its step: `rip` is its (return) address.
    pub(crate) regs: Registers,
    pub(crate) location: FrameLocation,
    words: FrameWords,
}

/// A whole walk, innermost frame first.
#[repr(C)]
struct FrameMemo {
    /// The walk's start, as far as it decides what the frames are (not its registers).
    tgid: u64,
    started_ns: u64,
    epoch: u64,
    depth: u64,
    stop: u64,
    /// The registers after the last frame's step: where a walk cut at the depth limit goes on.
    next: Registers,
    frames: [MemoFrame; STACK_DEPTH],
}

/// A slot's last walk and the one under way, which becomes the last if it can be kept.
#[repr(C)]
pub(crate) struct FrameMemos {
    /// 1 + the index in `memos` of the last walk kept; 0 when none is.
    last: u64,
    /// Whether the last walk can serve the walk under way (the same program image and tables).
    usable: u64,
    /// While the walk under way takes frames over (1): the last walk's frame its frame `at` took.
    taking: u64,
    from: u64,
    at: u64,
    /// Whether a frame of the walk under way read more words than a kept frame holds.
    overflow: u64,
    /// The bounds of `frame_with`'s search.
    search: [u64; 2],
    memos: [FrameMemo; 2],
}

#[map]
static FRAME_MEMOS: PerCpuArray<FrameMemos> = PerCpuArray::with_max_entries(SLOTS_PER_CPU, 0);

#[map]
static SPARE_FRAME_MEMOS: Array<FrameMemos> = Array::with_max_entries(SPARE_SLOTS, 0);

impl FrameMemos {
    /// The memos of the scratch slot `slot`, this run's while it holds the slot.
    pub(crate) fn of(slot: Slot) -> Option<&'static mut FrameMemos> {
        let memos = match slot {
            Slot::Cpu(index) => FRAME_MEMOS.get_ptr_mut(index),
            Slot::Spare(index) => SPARE_FRAME_MEMOS.get_ptr_mut(index),
        }?;
        // SAFETY: a map value, valid while the program runs, and this run's alone at its claimed
        // slot's index.
        Some(unsafe { &mut *memos })
    }

    /// Starts a walk from `start`, which the last walk serves if it began in the same image with
    /// the same tables.
    pub(crate) fn begin(&mut self, start: &WalkStart) {
        let last = self.last_memo();
        self.usable = u64::from(
            self.last != 0
                && last.tgid == start.tgid
                && last.started_ns == start.started_ns
                && last.epoch == start.epoch,
        );
        self.taking = 0;
        self.overflow = 0;
        let next = self.next_memo();
        next.tgid = start.tgid;
        next.started_ns = start.started_ns;
        next.epoch = start.epoch;
    }

    /// Takes the walk's frame at `state` over from the last walk, if that walk had a frame with
    /// the same registers (or the frame before this one was taken over) and the words it read are
    /// still there: its address and location into `raw` and `location`, and the walk's next
    /// state into `state`. Some(false) when the walk ends with it, None when it must be walked.
    pub(crate) fn take_over(
        &mut self,
        state: &mut UnwindState,
        window: &mut StackWindow,
        raw: &mut u64,
        location: &mut FrameLocation,
    ) -> Option<bool> {
        let depth = state.depth;
        let from = match self.taking {
            0 => self.frame_with(&state.regs)?,
            _ => self.from + (depth - self.at),
        };
        // Through pointers, not copies: this runs a call below the walk's step, whose chain of
        // frames takes most of the BPF stack.
        let (last, next): (*const FrameMemo, *mut FrameMemo) = (self.last_memo(), self.next_memo());
        // SAFETY: the two memos of this map value, distinct (`next_index`).
        let (last, next) = unsafe { (&*last, &mut *next) };
        let frame = &last.frames[from as usize & (STACK_DEPTH - 1)];
        if from >= last.depth || !still_there(&frame.words, window) {
            self.taking = 0;
            return None;
        }
        *raw = frame.regs.rip;
        // Copies by volatile reads: a plain copy between two places of one map value becomes a
        // call of BPF's byte-by-byte `memmove`.
        // SAFETY: references, valid and aligned.
        *location = unsafe { read_volatile(&frame.location) };
        // SAFETY: as above.
        next.frames[depth as usize & (STACK_DEPTH - 1)] = unsafe { read_volatile(frame) };
        self.overflow |= (FRAME_WORDS as u64).wrapping_sub(frame.words.count) >> 63;
        if self.taking == 0 {
            (self.taking, self.from, self.at) = (1, from, depth);
        }
        state.depth = depth + 1;
        if from + 1 < last.depth {
            state.regs = last.frames[(from + 1) as usize & (STACK_DEPTH - 1)].regs;
            state.stop = unwind_stop::DEPTH_LIMIT as u64;
            return Some(true);
        }
        // The last walk's last frame: it ended here, or was cut at the depth limit and goes on.
        self.taking = 0;
        state.regs = last.next;
        state.stop = last.stop;
        Some(last.stop == unwind_stop::DEPTH_LIMIT as u64)
    }

    /// Keeps a frame the walk takes itself, before its step: its registers and location.
    pub(crate) fn record(&mut self, depth: u64, regs: &Registers, location: &FrameLocation) {
        let frame = &mut self.next_memo().frames[depth as usize & (STACK_DEPTH - 1)];
        frame.regs = *regs;
        frame.location = *location;
    }

    /// Keeps the words frame `depth`'s step read. Apart from `record`, and without a branch: the
    /// verifier takes each way through the step, and would take this on each.
    pub(crate) fn record_words(&mut self, depth: u64, words: &FrameWords) {
        self.overflow |= (FRAME_WORDS as u64).wrapping_sub(words.count) >> 63;
        self.next_memo().frames[depth as usize & (STACK_DEPTH - 1)].words = *words;
    }

    /// Makes the walk just ended (`state`: its depth, why it ended, where it stood after its last
    /// step) the last one, if it can serve another: it found every mapping in the process's table
    /// (`by_table`), no frame read more than a kept frame holds, and it did not end on a failed
    /// read. Read from the state in place: this runs where the BPF stack is nearly all taken.
    #[inline(never)]
    pub(crate) fn commit(&mut self, state: &UnwindState, by_table: bool) {
        if !by_table || self.overflow != 0 || state.depth == 0 || state.stop == unwind_stop::READ_FAULT as u64
        {
            return;
        }
        let index = self.next_index();
        let memo = self.next_memo();
        memo.depth = state.depth.min(STACK_DEPTH as u64);
        memo.stop = state.stop;
        memo.next = state.regs;
        self.last = 1 + index;
    }

    /// The last walk's frame with registers `regs`, if it had one: by its stack pointer, which
    /// grows frame by frame.
    fn frame_with(&mut self, regs: &Registers) -> Option<u64> {
        if self.usable == 0 {
            return None;
        }
        let searched: *mut [u64; 2] = &raw mut self.search;
        let last = self.last_memo();
        // The first frame whose rsp is at or above this one's. The bounds go through the map
        // value, read back as values the verifier does not know: it would otherwise follow every
        // pair of values they can take, way by way.
        // SAFETY: a field of this map value.
        unsafe { write_volatile(searched, [0, last.depth.min(STACK_DEPTH as u64)]) };
        for _ in 0..8 {
            // SAFETY: as above.
            let [lo, hi] = unsafe { read_volatile(searched) };
            if lo >= hi {
                break;
            }
            let mid = lo + (hi - lo) / 2;
            let bounds = match last.frames.get(mid as usize & (STACK_DEPTH - 1))?.regs.rsp < regs.rsp {
                true => [mid + 1, hi],
                false => [lo, mid],
            };
            // SAFETY: as above.
            unsafe { write_volatile(searched, bounds) };
        }
        // SAFETY: as above.
        let [lo, _] = unsafe { read_volatile(searched) };
        let found = last.frames.get(lo as usize & (STACK_DEPTH - 1))?.regs;
        let differ = (found.rip ^ regs.rip)
            | (found.rsp ^ regs.rsp)
            | (found.rbp ^ regs.rbp)
            | (found.rbp_known ^ regs.rbp_known);
        (lo < last.depth && differ == 0).then_some(lo)
    }

    /// The index of the memo the walk under way writes: the one that is not the last. Read back
    /// through memory, and without a branch, so that the verifier knows it only as 0 or 1: two
    /// known offsets into the value would make every later state two.
    fn next_index(&self) -> u64 {
        // SAFETY: a field of this map value.
        let last = unsafe { read_volatile(&self.last) };
        // last 1 (the first memo) gives 1; 0 (none) and 2 (the second) give 0.
        (last & 1) & 1
    }

    fn last_memo(&self) -> &FrameMemo {
        // SAFETY: as in `next_index`.
        let last = unsafe { read_volatile(&self.last) };
        &self.memos[(last.wrapping_sub(1) & 1) as usize]
    }

    fn next_memo(&mut self) -> &mut FrameMemo {
        let index = self.next_index() as usize & 1;
        &mut self.memos[index]
    }
}

/// Whether the words a kept frame read are still where it read them.
fn still_there(words: &FrameWords, window: &mut StackWindow) -> bool {
    let count = words.count.min(FRAME_WORDS as u64) as usize;
    let mut same = true;
    for i in 0..FRAME_WORDS {
        if i < count {
            same &= window.read::<1>(words.address[i]) == Ok([words.value[i]]);
        }
    }
    same
}
