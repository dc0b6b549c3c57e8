//! Reading the running kernel's own structs, at the offsets the loader found in its BTF (aya-ebpf
//! has no CO-RE): a forked child's tgid, an exiting (or OOM-killed) process's memory counters, an
//! exec'd file.

use core::ffi::c_void;

use aya_ebpf::helpers::{bpf_get_current_task, bpf_probe_read_kernel, generated::bpf_loop};
use memtrace_common::{mm_counter, ExitMemory, ImageKey, KernelLayout, MAX_PER_CPU_COUNTERS, MM_COUNTERS};

/// Set by the loader from /sys/kernel/btf/vmlinux.
#[no_mangle]
pub(crate) static KERNEL_LAYOUT: KernelLayout = KernelLayout {
    task_tgid: 0,
    task_mm: 0,
    mm_rss_stat: 0,
    mm_start_brk: 0,
    mm_brk: 0,
    percpu_counter_count: 0,
    percpu_counter_size: 0,
    percpu_counter_counters: 0,
    per_cpu_offset: 0,
    possible_cpus: 0,
    binprm_file: 0,
    file_inode: 0,
    inode_ino: 0,
    inode_sb: 0,
    sb_dev: 0,
    oom_victim_is_task: 0,
    task_cgroups: 0,
    css_set_subsys: 0,
    memory_subsys_slot: 0,
    css_cgroup: 0,
    cgroup_kn: 0,
    kernfs_node_id: 0,
    vma_start: 0,
    vma_end: 0,
    vma_pgoff: 0,
    vma_file: 0,
    backing_user_path: 0,
    path_dentry: 0,
    dentry_inode: 0,
    task_thread_pointer: 0,
    _pad: 0,
};

/// The layout as the loader set it, not as compiled.
pub(crate) fn layout() -> KernelLayout {
    crate::helpers::loaded(&KERNEL_LAYOUT)
}

/// Reads a `T` at `offset` bytes into the kernel object at `base`; None if the address cannot be
/// read (the helper checks it and fails rather than faults).
pub(crate) fn read_at<T: Copy>(base: u64, offset: u32) -> Option<T> {
    if base == 0 {
        return None;
    }
    let at = base.wrapping_add(u64::from(offset)) as *const T;
    // SAFETY: bpf_probe_read_kernel validates the address.
    unsafe { bpf_probe_read_kernel(at) }.ok()
}

/// The program an exec runs, as the kernel names its file: `bprm` is sched_process_exec's
/// `struct linux_binprm` (its file is the final program: a script's interpreter). None without
/// the layout (no BTF) or where a pointer cannot be read.
pub(crate) fn exec_image(bprm: u64) -> Option<ImageKey> {
    let layout = layout();
    if layout.binprm_file == 0 {
        return None;
    }
    file_image(read_at(bprm, layout.binprm_file)?)
}

/// A `struct file` as the kernel names it ([`ImageKey`]); None where a pointer cannot be read.
pub(crate) fn file_image(file: u64) -> Option<ImageKey> {
    inode_image(read_at(file, layout().file_inode)?)
}

/// The file an overlay's backing file (a mapping's file there) was opened as: its user path's
/// inode, as stat names it. Read for any file the first name did not find: on a file that is no
/// backing file, what lies past its struct names no file memtrace knows (every read is checked,
/// none can fault).
pub(crate) fn backing_file_image(file: u64) -> Option<ImageKey> {
    let layout = layout();
    if layout.backing_user_path == 0 {
        return None;
    }
    let dentry: u64 = read_at(file, layout.backing_user_path + layout.path_dentry)?;
    inode_image(read_at(dentry, layout.dentry_inode)?)
}

/// An inode as the kernel names its file.
fn inode_image(inode: u64) -> Option<ImageKey> {
    let layout = layout();
    let ino: u64 = read_at(inode, layout.inode_ino)?;
    let super_block: u64 = read_at(inode, layout.inode_sb)?;
    let dev: u32 = read_at(super_block, layout.sb_dev)?;
    Some(ImageKey { dev, _pad: 0, ino })
}

/// The current user thread's thread pointer (its FS base: glibc's `struct pthread`); None where
/// the loader found no offset for it. Only that field is read, not the whole layout.
pub(crate) fn thread_pointer() -> Option<u64> {
    let offset = crate::helpers::loaded(&KERNEL_LAYOUT.task_thread_pointer);
    if offset == 0 {
        return None;
    }
    read_at(current_task(), offset)
}

/// The `struct task_struct` running now.
pub(crate) fn current_task() -> u64 {
    // SAFETY: the helper takes no arguments and returns the current task's address.
    unsafe { bpf_get_current_task() }
}

/// The kernel's memory counters of the exiting process, read before its memory is released: its
/// resident and swapped pages as /proc/PID/status shows them, and the size of its brk heap.
pub(crate) fn exit_memory() -> Option<ExitMemory> {
    task_memory(current_task())
}

/// The id of the memory cgroup of the task at `task` (its kernfs node id); None where the kernel
/// has no memory controller or a pointer on the way cannot be read.
pub(crate) fn memcg_id(task: u64) -> Option<u64> {
    let layout = layout();
    if layout.memory_subsys_slot == 0 {
        return None;
    }
    let css_set: u64 = read_at(task, layout.task_cgroups)?;
    let slot = layout.css_set_subsys + (layout.memory_subsys_slot - 1) * 8;
    let css: u64 = read_at(css_set, slot)?;
    let cgroup: u64 = read_at(css, layout.css_cgroup)?;
    let node: u64 = read_at(cgroup, layout.cgroup_kn)?;
    read_at(node, layout.kernfs_node_id)
}

/// The memory counters of the process whose `struct task_struct` is at `task`, as `exit_memory`:
/// each counter's shared count plus what its CPUs hold not yet folded in (a process that lives a
/// few milliseconds may have all its pages there: below the batch of 32 a CPU folds at).
pub(crate) fn task_memory(task: u64) -> Option<ExitMemory> {
    let layout = layout();
    if layout.task_mm == 0 {
        return None;
    }
    let mm: u64 = read_at(task, layout.task_mm)?;
    let mut sum =
        PerCpuSum { counters: [0; MM_COUNTERS], offsets: layout.per_cpu_offset, pages: [0; MM_COUNTERS] };
    for counter in
        [mm_counter::FILE_PAGES, mm_counter::ANON_PAGES, mm_counter::SWAP_ENTRIES, mm_counter::SHMEM_PAGES]
    {
        let at = layout.mm_rss_stat + counter as u32 * layout.percpu_counter_size;
        let pages: i64 = read_at(mm, at + layout.percpu_counter_count)?;
        if let (Some(slot), Some(counters)) = (sum.pages.get_mut(counter), sum.counters.get_mut(counter)) {
            *slot = pages;
            if layout.percpu_counter_counters != 0 {
                *counters = read_at(mm, at + layout.percpu_counter_counters).unwrap_or(0);
            }
        }
    }
    if sum.offsets != 0 && layout.percpu_counter_counters != 0 {
        let cpus = layout.possible_cpus.min(MAX_PER_CPU_COUNTERS);
        // SAFETY: the callback is a function of this program, and its context is `sum`, on this
        // program's stack for the whole call, as bpf_loop requires.
        unsafe { bpf_loop(cpus, add_cpu_deltas as *mut c_void, (&raw mut sum).cast(), 0) };
    }
    let mut memory = ExitMemory { read: 1, ..ExitMemory::default() };
    for (slot, pages) in memory.pages.iter_mut().zip(sum.pages) {
        // As /proc reads it: per-CPU deltas can leave the sum below zero for a moment.
        *slot = pages.max(0) as u64;
    }
    let start: u64 = read_at(mm, layout.mm_start_brk)?;
    let end: u64 = read_at(mm, layout.mm_brk)?;
    memory.heap_break_bytes = end.saturating_sub(start);
    Some(memory)
}

/// The rss_stat counters being summed: each one's per-CPU `s32` array (a per-CPU address, 0 where
/// unread), the kernel's `__per_cpu_offset` array, and the pages summed so far.
#[repr(C)]
struct PerCpuSum {
    counters: [u64; MM_COUNTERS],
    offsets: u64,
    pages: [i64; MM_COUNTERS],
}

/// bpf_loop's callback: adds CPU `cpu`'s pending deltas of every counter (percpu_counter_sum's
/// step); 1 ends the loop where the CPU's offset cannot be read.
extern "C" fn add_cpu_deltas(cpu: u64, sum: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the `PerCpuSum` that `task_memory` passed, on its stack.
    let sum = unsafe { &mut *(sum as *mut PerCpuSum) };
    let Some(offset) = read_at::<u64>(sum.offsets, (cpu * 8) as u32) else { return 1 };
    for (pages, counters) in sum.pages.iter_mut().zip(sum.counters) {
        if counters != 0 {
            *pages += i64::from(read_at::<i32>(counters.wrapping_add(offset), 0).unwrap_or(0));
        }
    }
    0
}
