//! The traced thread's registers where a probe stopped it, by architecture (aya-ebpf's
//! `bpf_target_arch`, which memtrace-user's build sets to the architecture it is built for): the
//! program counter, stack pointer and frame pointer (x86-64's rip, rsp and rbp; arm64's pc, sp and
//! x29), and where a function stopped at its entry finds its return address (x86-64: on top of the
//! stack, where `call` pushed it; arm64: in the link register, x30, where `bl` put it), and how a
//! return address read from the stack becomes a code address.

use aya_ebpf::bindings::pt_regs;

/// The program counter, stack pointer and frame pointer of the stopped thread.
pub(crate) struct Saved {
    pub(crate) pc: u64,
    pub(crate) sp: u64,
    pub(crate) fp: u64,
}

#[cfg(bpf_target_arch = "x86_64")]
pub(crate) fn saved(regs: *const pt_regs) -> Saved {
    // SAFETY: the probe's saved registers, valid while the program runs; constant offsets.
    unsafe { Saved { pc: (*regs).rip, sp: (*regs).rsp, fp: (*regs).rbp } }
}

#[cfg(bpf_target_arch = "aarch64")]
pub(crate) fn saved(regs: *const pt_regs) -> Saved {
    // SAFETY: the probe's saved registers (user_pt_regs), valid while the program runs; constant
    // offsets.
    unsafe { Saved { pc: (*regs).pc, sp: (*regs).sp, fp: (*regs).regs[29] } }
}

/// The return address of a function stopped at its first instruction.
#[cfg(bpf_target_arch = "x86_64")]
pub(crate) fn return_address_at_entry(regs: *const pt_regs) -> Option<u64> {
    crate::user_memory::read_user(saved(regs).sp)
}

#[cfg(bpf_target_arch = "aarch64")]
pub(crate) fn return_address_at_entry(regs: *const pt_regs) -> Option<u64> {
    // SAFETY: as in `saved`.
    Some(unsafe { (*regs).regs[30] })
}

/// The link register where the probe stopped the thread, which the innermost frame's return
/// address may still be in (`unwind_ra::LINK_REGISTER`): x86-64 has none (0).
#[cfg(bpf_target_arch = "x86_64")]
pub(crate) fn link_register(_regs: *const pt_regs) -> u64 {
    0
}

/// The link register, x30. (In a return probe it holds the kernel's return trampoline, which the
/// probed function returned through: no file maps it, so a stack whose innermost row says the
/// return address is still in x30 ends there, `unwind_stop::NO_MAPPING`.)
#[cfg(bpf_target_arch = "aarch64")]
pub(crate) fn link_register(regs: *const pt_regs) -> u64 {
    // SAFETY: as in `saved`.
    unsafe { (*regs).regs[30] }
}

/// A return address read from the stack, as an address: x86-64's as it is.
#[cfg(bpf_target_arch = "x86_64")]
pub(crate) fn code_address(return_address: u64) -> u64 {
    return_address
}

/// A return address read from the stack, as an address: code built with
/// `-mbranch-protection=standard` (Debian 13's arm64 packages) signs the link register before it
/// saves it (`paciasp`), the signature in the bits above the virtual address. User addresses lie
/// below 2^48 (the kernel gives a process more only where it asks, with an mmap hint): the bits
/// above are the signature, and go.
#[cfg(bpf_target_arch = "aarch64")]
pub(crate) fn code_address(return_address: u64) -> u64 {
    return_address & ((1 << 48) - 1)
}
