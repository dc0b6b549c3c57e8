//! A probed function's arguments, wherever its probe finds them: the loader places a probe at the
//! function's first instruction the kernel emulates and says in the cookie which register holds
//! each argument there (memtrace-common's arguments.rs).

use aya_ebpf::programs::ProbeContext;
use memtrace_common::ArgumentRegisters;

/// Argument `n` of the probed function. Read through `general_register` even where the calling
/// convention put it: aya's `arg(n)` with an `n` the compiler does not fold reads the context at a
/// variable offset, which the verifier refuses.
#[cfg(bpf_target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn argument(ctx: &ProbeContext, registers: ArgumentRegisters, n: usize) -> u64 {
    use memtrace_common::arguments::register::*;
    let at_entry = match n {
        0 => RDI,
        1 => RSI,
        2 => RDX,
        3 => RCX,
        4 => R8,
        _ => return 0,
    };
    general_register(ctx, registers.register(n).unwrap_or(at_entry))
}

/// Argument `n` on arm64: in x<n> at the entry, or in the register the probe's cookie names
/// (memtrace-user's probe_point/arm64.rs: index i is xi, x0..x14).
#[cfg(bpf_target_arch = "aarch64")]
#[inline(always)]
pub(crate) fn argument(ctx: &ProbeContext, registers: ArgumentRegisters, n: usize) -> u64 {
    if n >= ArgumentRegisters::COUNT {
        return 0;
    }
    general_register(ctx, registers.register(n).unwrap_or(n as u8))
}

/// The general register with index `index` (memtrace-common's `register` on x86-64, xi on arm64):
/// both architectures' pt_regs keep register i at byte 8 * i (x86-64's orders r15..rdi so;
/// arm64's starts with `regs[31]`). One arm a register, each an assembly load at a constant offset
/// of the context: the verifier refuses a context read at a variable offset, and plain loads (even
/// volatile ones) were merged by the compiler into one load through a moved context pointer, which
/// it refuses too.
fn general_register(ctx: &ProbeContext, index: u8) -> u64 {
    macro_rules! saved {
        ($offset:literal) => {{
            let value: u64;
            // SAFETY: a read of the probe's saved registers, valid while the program runs, at an
            // offset inside pt_regs; it writes nothing.
            unsafe {
                core::arch::asm!(
                    concat!("{value} = *(u64 *)({regs} + ", $offset, ")"),
                    regs = in(reg) ctx.regs,
                    value = out(reg) value,
                    options(readonly, nostack, preserves_flags),
                );
            }
            value
        }};
    }
    match index {
        0 => saved!(0),
        1 => saved!(8),
        2 => saved!(16),
        3 => saved!(24),
        4 => saved!(32),
        5 => saved!(40),
        6 => saved!(48),
        7 => saved!(56),
        8 => saved!(64),
        9 => saved!(72),
        10 => saved!(80),
        11 => saved!(88),
        12 => saved!(96),
        13 => saved!(104),
        14 => saved!(112),
        _ => 0,
    }
}

// x86-64's indices are its pt_regs slots, r15 first and rdi last, as `general_register` reads them.
const _: () = {
    use memtrace_common::arguments::register::*;
    assert!(R15 == 0 && RBP == 4 && R8 == 9 && RAX == 10 && RDI == 14 && COUNT == 15);
};
