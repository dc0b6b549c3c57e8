//! The unwinder's working memory: more than the 512 bytes of BPF stack a call chain may use, so it
//! lives in a map, in slots a run claims for itself.
//!
//! A per-CPU value alone is not the run's: a uprobe program runs preemptible (migration is off,
//! preemption is not, on PREEMPT(lazy) and PREEMPT_RT kernels), so another thread can run the same
//! program on the same CPU in the middle of a run. Each CPU has `SLOTS_PER_CPU` slots; a run takes
//! the first free one with a compare-and-exchange of its owner word and gives it back when its
//! `Claim` drops. A run that finds them all held takes one of `SPARE_SLOTS` slots every CPU shares
//! (more runs of one CPU can be under way at once than it has slots: as many as threads of traced
//! processes wait on it, each preempted inside a program); a run that finds those held too takes
//! no stack, and its allocation counts it as lost (`capture_stack`): never a slot two runs write at
//! once.

use memtrace_common::{DeepStackFrames, STACK_DEPTH};

use aya_ebpf::{
    macros::map,
    maps::{Array, PerCpuArray},
};

use crate::{
    counters::compare_exchange,
    interpreters::{InterpreterCursors, InterpreterFrames},
    stack_read::{Registers, StackWindow, WalkStart},
    vma::FoundMappings,
};

/// A stack's return addresses, innermost first.
pub(crate) type RawStack = [u64; STACK_DEPTH];

/// Where the unwinder found a frame: the file's slot and the file offset of its address.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct FrameLocation {
    pub(crate) file: u32,
    pub(crate) _pad: u32,
    pub(crate) offset: u64,
}

pub(crate) type Locations = [FrameLocation; STACK_DEPTH];

/// The unwinder's state between frames, kept in memory rather than in registers: values read back
/// from a map are unknown to the verifier, so the states of every path that reaches the next frame
/// (or the end of the walk) are the same state, verified once.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UnwindState {
    pub(crate) regs: Registers,
    /// Frames taken so far.
    pub(crate) depth: u64,
    /// Why the walk ended (`unwind_stop`).
    pub(crate) stop: u64,
}

/// One run's working memory: the stack window and its memo, the walk's frames and state, and the
/// stack in the form it is stored.
#[repr(C)]
pub(crate) struct Scratch {
    owner: u64,
    /// Where this run's walk starts.
    pub(crate) start: WalkStart,
    pub(crate) window: StackWindow,
    pub(crate) raw: RawStack,
    pub(crate) locations: Locations,
    pub(crate) state: UnwindState,
    /// The mappings the walk found through the kernel.
    pub(crate) found: FoundMappings,
    /// The interpreter frames of the stack, where the process runs CPython or Perl, and where
    /// each one's walk is.
    pub(crate) interpreter: InterpreterFrames,
    pub(crate) cursors: InterpreterCursors,
    /// The stack in the form it is stored: a shallow stack's frames are the first of these.
    pub(crate) frames: DeepStackFrames,
}

// SAFETY: #[repr(C)] with the owner word first.
unsafe impl Claimable for Scratch {}

/// Runs that can be under way on one CPU at once, each preempted by the next, before one goes
/// without a stack.
pub(crate) const SLOTS_PER_CPU: u32 = 4;

/// Slots any CPU's runs take when their CPU's are all held. 8 threads on 2 CPUs, each preempted in
/// the unwinder on the same CPU (seen under emulation on a PREEMPT(lazy) kernel), hold 4 of one
/// CPU's slots and 4 of these.
pub(crate) const SPARE_SLOTS: u32 = 16;

#[map]
static SCRATCH: PerCpuArray<Scratch> = PerCpuArray::with_max_entries(SLOTS_PER_CPU, 0);

#[map]
static SPARE_SCRATCH: Array<Scratch> = Array::with_max_entries(SPARE_SLOTS, 0);

impl Scratch {
    /// A free slot of this CPU for the unwinder, else a free spare one; None when every one is
    /// held.
    pub(crate) fn claim() -> Option<Claim<Scratch>> {
        Claim::take(&SCRATCH, SLOTS_PER_CPU).or_else(|| Claim::take_spare(&SPARE_SCRATCH, SPARE_SLOTS))
    }
}

/// A map value that runs claim: its first field is the owner word, `FREE` or `HELD`.
///
/// # Safety
/// The type is `#[repr(C)]` and its first field a `u64` that only claims touch.
pub(crate) unsafe trait Claimable {}

const FREE: u64 = 0;
const HELD: u64 = 1;

/// A slot this run holds until the claim drops.
pub(crate) struct Claim<T: Claimable + 'static> {
    value: *mut T,
    slot: Slot,
}

/// Which slot a claim holds: its index in the CPU's slots, or in the spare ones. A map of other
/// per-slot memory (frame_memo.rs) is this run's at the same slot while the claim lives.
#[derive(Clone, Copy)]
pub(crate) enum Slot {
    Cpu(u32),
    Spare(u32),
}

impl<T: Claimable + 'static> Claim<T> {
    /// The first free one of this CPU's `count` slots, or None when every one is held by a run
    /// under way.
    pub(crate) fn take(slots: &'static PerCpuArray<T>, count: u32) -> Option<Self> {
        (0..count).find_map(|slot| Self::claimed(slots.get_ptr_mut(slot)?, Slot::Cpu(slot)))
    }

    /// The first free one of `count` slots that every CPU shares, or None when every one is held.
    pub(crate) fn take_spare(slots: &'static Array<T>, count: u32) -> Option<Self> {
        (0..count).find_map(|slot| Self::claimed(slots.get_ptr_mut(slot)?, Slot::Spare(slot)))
    }

    /// The slot at `value`, if its owner word was free and is this run's now. (A `Claim` is made
    /// only then: one made and dropped for a slot another run holds would free it.)
    fn claimed(value: *mut T, slot: Slot) -> Option<Self> {
        // The owner word is the value's first (`Claimable`).
        if compare_exchange(value as *const u64, FREE, HELD) == FREE {
            Some(Self { value, slot })
        } else {
            None
        }
    }

    /// The slot's memory, this run's alone while the claim lives.
    pub(crate) fn get(&mut self) -> &mut T {
        // SAFETY: a map value, valid while the program runs; the owner word makes it this run's.
        unsafe { &mut *self.value }
    }

    /// Which slot the claim holds.
    pub(crate) fn slot(&self) -> Slot {
        self.slot
    }
}

impl<T: Claimable + 'static> Drop for Claim<T> {
    fn drop(&mut self) {
        compare_exchange(self.value as *const u64, HELD, FREE);
    }
}
