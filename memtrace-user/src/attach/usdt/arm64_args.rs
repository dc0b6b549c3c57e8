//! arm64 USDT argument operands, as gcc writes them for aarch64 into `.note.stapsdt`: `x0` or `w1`
//! (a register; w is its low 32 bits, the spec's size says how much is the value), `sp`, `[sp, 16]`,
//! `[x1, -8]` and `[x2]` (memory at a register plus an offset), `5` or `-3` (a constant). A
//! uprobe program's context on arm64 is `user_pt_regs`: regs[0..31] (x0-x30) at 8 bytes each, then
//! sp. (The same forms libbpf's usdt.c reads on aarch64.)

use super::operand::{Displacement, Location, Register};

/// Byte offset of `sp` in `user_pt_regs`, after regs[31].
const SP_OFFSET: u16 = 31 * 8;

const X_NAMES: [&str; 31] = [
    "x0", "x1", "x2", "x3", "x4", "x5", "x6", "x7", "x8", "x9", "x10", "x11", "x12", "x13", "x14", "x15",
    "x16", "x17", "x18", "x19", "x20", "x21", "x22", "x23", "x24", "x25", "x26", "x27", "x28", "x29", "x30",
];

/// A general register (x0-x30, w0-w30, sp) and where the kernel saves it.
pub fn register(name: &str) -> Option<Register> {
    if name == "sp" || name == "wsp" {
        return Some(Register { name: "sp", offset: SP_OFFSET, shift: 0 });
    }
    let digits = name.strip_prefix('x').or_else(|| name.strip_prefix('w'))?;
    if digits.is_empty() || digits.len() > 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let number: usize = digits.parse().ok()?;
    X_NAMES.get(number).map(|name| Register { name, offset: number as u16 * 8, shift: 0 })
}

/// One operand: a register, memory at a register plus an offset, or a constant.
pub fn parse_operand(operand: &str, integer: fn(&str) -> Option<i64>) -> Result<Location, String> {
    if let Some(inner) = operand.strip_prefix('[') {
        let inner = inner.strip_suffix(']').ok_or("a memory operand must end with `]`")?;
        let (base, offset) = match inner.split_once(',') {
            Some((base, offset)) => {
                let offset = offset.trim();
                (base.trim(), integer(offset).ok_or_else(|| format!("`{offset}` is not an integer offset"))?)
            }
            None => (inner.trim(), 0),
        };
        let base = register(base).ok_or_else(|| format!("`{base}` is not an arm64 register (x0-x30, sp)"))?;
        return Ok(Location::Memory {
            displacement: Displacement { symbol: None, offset },
            base: Some(base),
            index: None,
        });
    }
    if let Some(register) = register(operand) {
        return Ok(Location::Register(register));
    }
    integer(operand).map(Location::Constant).ok_or_else(|| {
        format!(
            "`{operand}` is no arm64 operand: a register (x0-x30, w0-w30, sp), memory ([x1, -8]) or a \
             constant"
        )
    })
}
