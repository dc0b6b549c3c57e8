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

use core::ffi::c_void;

use aya_ebpf::{
    helpers::generated::{bpf_find_vma, bpf_get_current_task_btf},
    macros::map,
    maps::HashMap,
};
use memtrace_common::{ImageKey, UnwindMapping, UNWIND_MAX_FILES};

use crate::kernel::{file_image, layout, read_at};

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

    /// The mapping that holds `pc`: one this walk found already, else the kernel's (None where it
    /// has none, its file has no slot, or the lock is held).
    pub(crate) fn find(&mut self, pc: u64) -> Option<&UnwindMapping> {
        let known = self.mappings.iter().position(|m| m.start <= pc && pc < m.end);
        let index = match known {
            Some(index) => index,
            None => {
                let index = self.lookups as usize & (FOUND_MAPPINGS - 1);
                self.lookups += 1;
                let slot = self.mappings.get_mut(index)?;
                *slot = kernel_mapping(pc)?;
                index
            }
        };
        self.mappings.get(index)
    }
}

/// What `found_vma` works on: on the caller's stack, as bpf_find_vma requires.
#[repr(C)]
struct Lookup {
    found: UnwindMapping,
    /// 1 once `found` is filled.
    filled: u64,
}

/// The kernel's mapping of `pc` in the current process, naming its file's unwind slot.
#[inline(never)]
fn kernel_mapping(pc: u64) -> Option<UnwindMapping> {
    if layout().vma_file == 0 {
        return None;
    }
    let mut lookup = Lookup { found: UnwindMapping::default(), filled: 0 };
    // SAFETY: the helper takes the current task's BTF pointer; the callback is a function of this
    // program, and its context lives on this stack for the whole call.
    let result = unsafe {
        bpf_find_vma(bpf_get_current_task_btf(), pc, found_vma as *mut c_void, (&raw mut lookup).cast(), 0)
    };
    (result == 0 && lookup.filled != 0).then_some(lookup.found)
}

/// bpf_find_vma's callback, under the mmap lock: the mapping's bounds, file offset and file slot.
extern "C" fn found_vma(_task: *mut c_void, vma: *mut c_void, lookup: *mut c_void) -> i64 {
    // SAFETY: bpf_find_vma hands back the `Lookup` that `kernel_mapping` passed.
    let lookup = unsafe { &mut *(lookup as *mut Lookup) };
    let layout = layout();
    let vma = vma as u64;
    let (Some(start), Some(end), Some(page), Some(file)) = (
        read_at::<u64>(vma, layout.vma_start),
        read_at::<u64>(vma, layout.vma_end),
        read_at::<u64>(vma, layout.vma_pgoff),
        read_at::<u64>(vma, layout.vma_file),
    ) else {
        return 0;
    };
    let Some(slot) = file_image(file).and_then(|key| UNWIND_FILE_SLOTS.get_ptr(&key)) else {
        return 0;
    };
    // SAFETY: a map value, valid while the program runs.
    let file = unsafe { *slot };
    lookup.found = UnwindMapping { start, end, file_offset: page << 12, file, _pad: 0 };
    lookup.filled = 1;
    0
}
