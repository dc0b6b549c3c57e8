//! A probed function's arguments, wherever its probe finds them: the loader places a probe at the
//! function's first instruction the kernel emulates and says in the cookie which register holds
//! each argument there (memtrace-common's arguments.rs).

use aya_ebpf::programs::ProbeContext;
use memtrace_common::ArgumentRegisters;

/// Argument `n` of the probed function.
pub(crate) fn argument(ctx: &ProbeContext, registers: ArgumentRegisters, n: usize) -> u64 {
    match registers.register(n) {
        None => ctx.arg::<u64>(n).unwrap_or(0),
        Some(index) => general_register(ctx, index),
    }
}

/// The general register with `register` index `index`. One arm a register, each a read at a
/// constant offset of the context (the verifier refuses a context read at a variable offset); the
/// reads are volatile so that the compiler cannot merge them into one such read.
#[cfg(bpf_target_arch = "x86_64")]
fn general_register(ctx: &ProbeContext, index: u8) -> u64 {
    use core::ptr::{addr_of, read_volatile};
    use memtrace_common::arguments::register::*;
    let regs = ctx.regs;
    // SAFETY: the probe's saved registers, valid to read while the program runs.
    unsafe {
        match index {
            R15 => read_volatile(addr_of!((*regs).r15)),
            R14 => read_volatile(addr_of!((*regs).r14)),
            R13 => read_volatile(addr_of!((*regs).r13)),
            R12 => read_volatile(addr_of!((*regs).r12)),
            RBP => read_volatile(addr_of!((*regs).rbp)),
            RBX => read_volatile(addr_of!((*regs).rbx)),
            R11 => read_volatile(addr_of!((*regs).r11)),
            R10 => read_volatile(addr_of!((*regs).r10)),
            R9 => read_volatile(addr_of!((*regs).r9)),
            R8 => read_volatile(addr_of!((*regs).r8)),
            RAX => read_volatile(addr_of!((*regs).rax)),
            RCX => read_volatile(addr_of!((*regs).rcx)),
            RDX => read_volatile(addr_of!((*regs).rdx)),
            RSI => read_volatile(addr_of!((*regs).rsi)),
            RDI => read_volatile(addr_of!((*regs).rdi)),
            _ => 0,
        }
    }
}

/// Elsewhere probes stay at the entry (the loader places them only on x86-64), where every
/// argument is in the calling convention's register.
#[cfg(not(bpf_target_arch = "x86_64"))]
fn general_register(_ctx: &ProbeContext, _index: u8) -> u64 {
    0
}
