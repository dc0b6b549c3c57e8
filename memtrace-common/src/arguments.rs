//! Where a probe finds its function's arguments. A probe sits at the function's first instruction
//! the kernel emulates (see memtrace-user's process/probe_point.rs), which may come after the
//! function has copied an argument to another register and reused the one the calling convention
//! put it in: mimalloc's malloc moves the size to rsi before its first branch. The loader works out
//! where each argument is at the probe and hands it to the program in the probe's BPF cookie, so
//! one program serves every placement.

/// x86-64's general registers as the kernel's `struct pt_regs` orders them: the index a
/// register code names. rsp is not among them: a probe is never placed where the stack pointer
/// moved.
pub mod register {
    pub const R15: u8 = 0;
    pub const R14: u8 = 1;
    pub const R13: u8 = 2;
    pub const R12: u8 = 3;
    pub const RBP: u8 = 4;
    pub const RBX: u8 = 5;
    pub const R11: u8 = 6;
    pub const R10: u8 = 7;
    pub const R9: u8 = 8;
    pub const R8: u8 = 9;
    pub const RAX: u8 = 10;
    pub const RCX: u8 = 11;
    pub const RDX: u8 = 12;
    pub const RSI: u8 = 13;
    pub const RDI: u8 = 14;
    /// How many: every index is below this.
    pub const COUNT: u8 = 15;
}

/// For each of a function's first `COUNT` arguments, the register that holds it at the probe:
/// 4 bits an argument, 0 for the calling convention's own register (rdi, rsi, rdx, rcx, r8) and
/// otherwise 1 + the register's `register` index (on arm64, whose convention puts argument n in
/// xn, the index of xi is i, for x0..x14). All zero (`AT_ENTRY`) at a function's entry.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ArgumentRegisters(pub u32);

impl ArgumentRegisters {
    /// Arguments a placement can name: mmap's flags are its fourth, and nothing reads a sixth.
    pub const COUNT: usize = 5;
    const BITS: usize = 4;
    /// Every argument where the calling convention put it.
    pub const AT_ENTRY: Self = Self(0);

    /// The same, with `argument` in `register` (a `register` index).
    pub const fn with(self, argument: usize, register: u8) -> Self {
        let shift = argument * Self::BITS;
        let cleared = self.0 & !(0xf << shift);
        Self(cleared | ((register as u32 + 1) & 0xf) << shift)
    }

    /// Where `argument` is: None in the calling convention's register, else a `register` index.
    pub const fn register(self, argument: usize) -> Option<u8> {
        match (self.0 >> (argument * Self::BITS)) & 0xf {
            0 => None,
            code => Some(code as u8 - 1),
        }
    }
}

/// The arguments a function's programs read, a bit each (bit n: argument n), and which of them
/// are C `int`s, whose low 32 bits are all the programs use (a 32-bit copy keeps them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArgumentsRead {
    pub read: u8,
    pub narrow: u8,
}

impl ArgumentsRead {
    pub const fn wide(read: u8) -> Self {
        Self { read, narrow: 0 }
    }

    pub const fn reads(self, argument: usize) -> bool {
        self.read & (1 << argument) != 0
    }

    pub const fn narrow(self, argument: usize) -> bool {
        self.narrow & (1 << argument) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_round_trip() {
        let registers = ArgumentRegisters::AT_ENTRY.with(0, register::RSI).with(3, register::R10);
        assert_eq!(registers.register(0), Some(register::RSI));
        assert_eq!(registers.register(1), None);
        assert_eq!(registers.register(3), Some(register::R10));
        assert_eq!(registers.with(0, register::R15).register(0), Some(register::R15));
        assert!(registers.0 < 1 << 20, "five arguments fit 20 bits of the cookie");
    }
}
