//! The unwinder's second way to a frame's file: the kernel's own mapping of the address
//! (bpf_find_vma), for the addresses a process's mapping table (written by userspace at each
//! interval) does not have yet: a process in its first moments (a launched command, an exec held
//! until its program was probed, a compiler that lives 50 ms), a library dlopen'd since. The
//! mapping names its file; the file names its unwind slot through UNWIND_FILE_SLOTS, which
//! userspace fills as it gives files their slot (by the kernel's device and inode, `ImageKey`),
//! so a file whose table was built for any process serves every process that maps it.
//!
//! bpf_find_vma takes the process's mmap lock for reading, with a trylock: where another thread
//! holds it (mapping memory at that moment), the lookup fails and the frame ends the stack
//! (`unwind_stop::NO_MAPPING`), never a wait. A walk keeps the mappings it found
//! (`FoundMappings`, in its scratch slot), so a stack through three files costs three lookups.

use core::{ffi::c_void, ptr::read_volatile};

use aya_ebpf::{
    helpers::generated::{self, bpf_find_vma, bpf_get_current_task_btf},
    macros::map,
    maps::HashMap,
};
use memtrace_common::{ImageKey, UnwindMapping, UNWIND_MAX_FILES};

use crate::kernel::{backing_file_image, file_image, layout};

/// Unwind file slots by the file's kernel name, written by userspace with each slot.
#[map]
static UNWIND_FILE_SLOTS: HashMap<ImageKey, u32> = HashMap::with_max_entries(UNWIND_MAX_FILES, 0);

/// Mappings one walk found through the kernel, kept for its later frames.
pub(crate) const FOUND_MAPPINGS: usize = 4;

/// The mappings a walk found with bpf_find_vma (in the run's scratch slot).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct FoundMappings {
    /// Lookups this walk made: a walk that made any is not memoized (the kernel's mappings may
    /// change with no change of the tables' epoch).
    pub(crate) lookups: u64,
    /// Mappings kept, the latest in slot `(lookups - 1) % FOUND_MAPPINGS`.
    mappings: [UnwindMapping; FOUND_MAPPINGS],
    /// The mapping of the frame the walk is at (from either table); `end` 0 where none holds it.
    pub(crate) current: UnwindMapping,
}

impl FoundMappings {
    /// Forgets the last walk's mappings.
    pub(crate) fn clear(&mut self) {
        self.lookups = 0;
        for mapping in &mut self.mappings {
            mapping.end = 0;
        }
    }

    /// Makes `mapping` the current one. Read as one volatile value: a plain copy between two
    /// places the compiler cannot tell apart becomes a call of BPF's byte-by-byte `memmove`, some
    /// 230 instructions, at every frame of every walk (and so do its fields copied one by one).
    pub(crate) fn set_current(&mut self, mapping: &UnwindMapping) {
        // SAFETY: a reference, valid and aligned.
        self.current = unsafe { read_volatile(mapping) };
    }

    /// Makes `current` the mapping that holds `pc`: one this walk found already, else the
    /// kernel's (`end` 0 where it has none, its file has no slot, or the lock is held).
    pub(crate) fn locate(&mut self, pc: u64) {
        let known = self.mappings.iter().position(|m| m.start <= pc && pc < m.end);
        let index = match known {
            Some(index) => index,
            None => {
                let index = self.lookups as usize & (FOUND_MAPPINGS - 1);
                self.lookups += 1;
                let Some(slot) = self.mappings.get_mut(index) else { return self.current.end = 0 };
                if !kernel_mapping(pc, slot) {
                    slot.end = 0;
                    return self.current.end = 0;
                }
                index
            }
        };
        if let Some(&mapping) = self.mappings.get(index) {
            self.set_current(&mapping);
        }
    }
}

/// What `found_vma` works on: on the caller's stack, as bpf_find_vma requires; the mapping is
/// written where it is kept (the scratch slot), not on the stack.
#[repr(C)]
struct Lookup {
    into: *mut UnwindMapping,
    /// 1 once `into` is filled.
    filled: u64,
}

/// Writes the kernel's mapping of `pc` in the current process, naming its file's unwind slot,
/// into `into`; false where there is none.
#[inline(never)]
fn kernel_mapping(pc: u64, into: &mut UnwindMapping) -> bool {
    if layout().vma_file == 0 {
        return false;
    }
    let mut lookup = Lookup { into, filled: 0 };
    // SAFETY: the helper takes the current task's BTF pointer; the callback is a function of this
    // program, and its context lives on this stack for the whole call.
    let result = unsafe {
        bpf_find_vma(bpf_get_current_task_btf(), pc, found_vma as *mut c_void, (&raw mut lookup).cast(), 0)
    };
    result == 0 && lookup.filled != 0
}

/// bpf_find_vma's callback, under the mmap lock: the mapping's bounds, file offset and file slot.
extern "C" fn found_vma(_task: *mut c_void, vma: *mut c_void, lookup: *mut c_void) -> i64 {
    // SAFETY: bpf_find_vma hands back the `Lookup` that `kernel_mapping` passed, whose mapping is
    // in the run's scratch slot.
    let (lookup, into) = unsafe {
        let lookup = &mut *(lookup as *mut Lookup);
        let into = &mut *lookup.into;
        (lookup, into)
    };
    let layout = layout();
    let vma = vma as u64;
    // Read straight into the slot (the file pointer for a moment in `file_offset`): this frame
    // adds to the unwinder's chain of frames.
    if !read_into(&mut into.start, vma, layout.vma_start)
        || !read_into(&mut into.end, vma, layout.vma_end)
        || !read_into(&mut into.file_offset, vma, layout.vma_file)
    {
        return 0;
    }
    let file = into.file_offset;
    let slot = file_image(file)
        .and_then(|key| UNWIND_FILE_SLOTS.get_ptr(&key))
        .or_else(|| backing_file_image(file).and_then(|key| UNWIND_FILE_SLOTS.get_ptr(&key)));
    let Some(slot) = slot else { return 0 };
    if !read_into(&mut into.file_offset, vma, layout.vma_pgoff) {
        return 0;
    }
    into.file_offset <<= 12;
    // SAFETY: a map value, valid while the program runs.
    into.file = unsafe { *slot };
    lookup.filled = 1;
    0
}

/// Reads the u64 at `offset` into the kernel object at `base` into `into`; false if unreadable.
fn read_into(into: &mut u64, base: u64, offset: u32) -> bool {
    let at = base.wrapping_add(u64::from(offset)) as *const c_void;
    // SAFETY: the helper writes 8 bytes into `into` and validates the kernel address.
    unsafe { generated::bpf_probe_read_kernel((into as *mut u64).cast(), 8, at) == 0 }
}
