//! What a USDT argument spec says, whatever the architecture's syntax (args.rs: x86-64's AT&T,
//! arm64_args.rs: arm64's): a constant, a register, or memory at a register plus a displacement.

/// A general-purpose register and where the kernel saves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Register {
    pub name: &'static str,
    /// Byte offset in the architecture's saved registers (x86-64's `struct pt_regs`, arm64's
    /// `user_pt_regs`).
    pub offset: u16,
    /// Right shift for the high-byte registers (%ah...), else 0.
    pub shift: u8,
}

/// A memory displacement: a number, a symbol, or a symbol plus a number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Displacement {
    pub symbol: Option<String>,
    pub offset: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    Constant(i64),
    Register(Register),
    Memory {
        displacement: Displacement,
        base: Option<Register>,
        /// Index register and scale (1, 2, 4 or 8).
        index: Option<(Register, u8)>,
    },
}
