//! Reading the running kernel's own structs, at the offsets the loader found in its BTF (aya-ebpf
//! has no CO-RE): a forked child's tgid, an exiting (or OOM-killed) process's memory counters, an
//! exec'd file.

use aya_ebpf::helpers::{bpf_get_current_task, bpf_probe_read_kernel};
use memtrace_common::{mm_counter, ExitMemory, ImageKey, KernelLayout};

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
    let file: u64 = read_at(bprm, layout.binprm_file)?;
    let inode: u64 = read_at(file, layout.file_inode)?;
    let ino: u64 = read_at(inode, layout.inode_ino)?;
    let super_block: u64 = read_at(inode, layout.inode_sb)?;
    let dev: u32 = read_at(super_block, layout.sb_dev)?;
    Some(ImageKey { dev, _pad: 0, ino })
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

/// The memory counters of the process whose `struct task_struct` is at `task`, as `exit_memory`.
pub(crate) fn task_memory(task: u64) -> Option<ExitMemory> {
    let layout = layout();
    if layout.task_mm == 0 {
        return None;
    }
    let mm: u64 = read_at(task, layout.task_mm)?;
    let mut memory = ExitMemory { read: 1, ..ExitMemory::default() };
    for counter in
        [mm_counter::FILE_PAGES, mm_counter::ANON_PAGES, mm_counter::SWAP_ENTRIES, mm_counter::SHMEM_PAGES]
    {
        let at =
            layout.mm_rss_stat + counter as u32 * layout.percpu_counter_size + layout.percpu_counter_count;
        let pages: i64 = read_at(mm, at)?;
        // As /proc reads it: per-CPU deltas can leave the shared count below zero for a moment.
        if let Some(slot) = memory.pages.get_mut(counter) {
            *slot = pages.max(0) as u64;
        }
    }
    let start: u64 = read_at(mm, layout.mm_start_brk)?;
    let end: u64 = read_at(mm, layout.mm_brk)?;
    memory.heap_break_bytes = end.saturating_sub(start);
    Some(memory)
}
