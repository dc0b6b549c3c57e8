//! Reading the running kernel's own structs, at the offsets the loader found in its BTF (aya-ebpf
//! has no CO-RE): a forked child's tgid, an exiting process's memory counters.

use aya_ebpf::helpers::{bpf_get_current_task, bpf_probe_read_kernel};
use memtrace_common::KernelLayout;

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

/// The `struct task_struct` running now.
pub(crate) fn current_task() -> u64 {
    // SAFETY: the helper takes no arguments and returns the current task's address.
    unsafe { bpf_get_current_task() }
}
