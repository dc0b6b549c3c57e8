//! arm64's probe points. The kernel simulates a probed branch (`b`, `bl`, `b.cond`, `cbz`/`cbnz`,
//! `tbz`/`tbnz`, `br`, `blr`, `ret`), `adr`/`adrp` and the literal loads, and single-steps every
//! other instruction out of line (arch/arm64/kernel/probes/decode-insn.c, the same set in 6.1 and
//! 6.12; `nop` is simulated from 6.13). Debian 13's libraries are built with
//! `-mbranch-protection=standard`, so most functions start with `bti c` or `paciasp`, both
//! single-stepped; Debian's jemalloc starts its malloc with a `cmp`.
//!
//! The walk follows x86's (probe_point.rs): from the entry, over straight-line code that is no
//! branch target, to the first instruction the kernel simulates, while every argument the programs
//! read is still in some register. It passes only instructions it knows write no memory, neither
//! the stack pointer nor x29/x30 (a return probe swaps x30 for its trampoline, so it must sit
//! before `stp x29, x30` saves it and before `paciasp` signs it): hints `nop` and `bti`,
//! arithmetic, logic, moves, bit fields, `mrs`, loads without write-back, and `svc` (which returns
//! its result in x0 and keeps every other register). Anything else ends the walk. A literal load
//! is passed, never probed: recent kernels refuse uprobes on it ("Remove broken LDR (literal)
//! uprobe support", 2024, taken into stable kernels too; not checked here per kernel).
//! The decoding is by the Arm ARM's encoding classes (A64, "Top-level encodings"), just the
//! classes the walk needs.

use memtrace_common::{ArgumentRegisters, ArgumentsRead};

use super::point::{ProbePoint, WALK_BYTES};

/// Registers an argument can be named in: `ArgumentRegisters` has 4 bits an argument, so x0..x14.
const NAMEABLE: u32 = (1 << 15) - 1;

/// The probe point of the function whose code starts with `code`, for programs that read
/// `arguments`.
pub(super) fn place(code: &[u8], arguments: ArgumentsRead) -> ProbePoint {
    walk(code, arguments).unwrap_or_else(|| at_entry(code))
}

/// The probe at the function's first instruction, all arguments in x0..x4.
pub(super) fn at_entry(code: &[u8]) -> ProbePoint {
    let word = words(code).next();
    let simulated = word.and_then(simulated);
    ProbePoint {
        delta: 0,
        registers: ArgumentRegisters::AT_ENTRY,
        emulated: simulated.is_some(),
        instruction: match (simulated, word) {
            (Some(name), _) => name.to_owned(),
            (None, Some(word)) => name(word),
            (None, None) => "?".to_owned(),
        },
    }
}

fn walk(code: &[u8], arguments: ArgumentsRead) -> Option<ProbePoint> {
    let walked = &code[..code.len().min(WALK_BYTES)];
    let targets: Vec<u64> = words(code).enumerate().filter_map(|(i, word)| branch_target(i, word)).collect();
    let mut held = Held::at_entry(arguments);
    for (i, word) in words(walked).enumerate() {
        let delta = 4 * i as u64;
        if delta != 0 && targets.contains(&delta) {
            return None;
        }
        if let Some(name) = simulated(word).filter(|_| !is_literal_load(word)) {
            let instruction = name.to_owned();
            return Some(ProbePoint { delta, registers: held.registers(), emulated: true, instruction });
        }
        if !held.pass(step(word)?) {
            return None;
        }
    }
    None
}

/// The code's instructions, little-endian words.
fn words(code: &[u8]) -> impl Iterator<Item = u32> + '_ {
    code.chunks_exact(4).map(|bytes| u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
}

/// The name of an instruction the kernel simulates under a uprobe, if `word` is one.
pub(super) fn simulated(word: u32) -> Option<&'static str> {
    let name = match word {
        _ if word & 0x7c00_0000 == 0x1400_0000 => "b/bl",
        _ if word & 0xff00_0010 == 0x5400_0000 => "b.cond",
        _ if word & 0x7e00_0000 == 0x3400_0000 => "cbz/cbnz",
        _ if word & 0x7e00_0000 == 0x3600_0000 => "tbz/tbnz",
        _ if word & 0xffff_fc1f == 0xd61f_0000 => "br",
        _ if word & 0xffff_fc1f == 0xd63f_0000 => "blr",
        _ if word & 0xffff_fc1f == 0xd65f_0000 => "ret",
        _ if word & 0x1f00_0000 == 0x1000_0000 => "adr/adrp",
        _ if word & 0xbf00_0000 == 0x1800_0000 => "ldr (literal)",
        _ if word & 0xff00_0000 == 0x9800_0000 => "ldrsw (literal)",
        _ => return None,
    };
    Some(name)
}

/// A name for an instruction the kernel single-steps at an entry: a prologue's hint, pair store
/// or store, else its word in hex.
fn name(word: u32) -> String {
    let hint = (word & 0xffff_f01f == 0xd503_201f).then_some((word >> 5) & 0x7f);
    let known = match hint {
        Some(0) => "nop",
        Some(25) => "paciasp",
        Some(27) => "pacibsp",
        Some(32) => "bti",
        Some(34) => "bti c",
        Some(36) => "bti j",
        Some(38) => "bti jc",
        _ if word & 0x3a00_0000 == 0x2800_0000 => ["stp", "ldp"][(word >> 22) as usize & 1],
        _ if word & 0x3b00_0000 == 0x3900_0000 => ["str", "ldr"][usize::from((word >> 22) & 0b11 != 0)],
        _ => return format!("{word:#010x}"),
    };
    known.to_owned()
}

fn is_literal_load(word: u32) -> bool {
    word & 0x3b00_0000 == 0x1800_0000
}

/// Where the direct branch at instruction `index` leads, in bytes from the entry: `b` (not `bl`,
/// which leaves the function), `b.cond`, `cbz`/`cbnz`, `tbz`/`tbnz`.
fn branch_target(index: usize, word: u32) -> Option<u64> {
    let signed = |bits: u32, width: u32| ((bits << (32 - width)) as i32 >> (32 - width)) as i64;
    let offset = match word {
        _ if word & 0xfc00_0000 == 0x1400_0000 => signed(word & 0x03ff_ffff, 26),
        _ if word & 0xff00_0010 == 0x5400_0000 || word & 0x7e00_0000 == 0x3400_0000 => {
            signed((word >> 5) & 0x7_ffff, 19)
        }
        _ if word & 0x7e00_0000 == 0x3600_0000 => signed((word >> 5) & 0x3fff, 14),
        _ => return None,
    };
    u64::try_from(4 * (index as i64 + offset)).ok()
}

/// What passing a single-stepped instruction does to the registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Step {
    /// General registers it writes, a bit each (x0..x30).
    writes: u32,
    /// A register copy: (to, from, all 64 bits).
    copy: Option<(u32, u32, bool)>,
}

impl Step {
    const NOTHING: Self = Self { writes: 0, copy: None };

    fn writes(register: u32) -> Self {
        // Register 31 is xzr (or sp, which callers refuse before).
        Self { writes: if register == 31 { 0 } else { 1 << register }, copy: None }
    }
}

/// What a single-stepped instruction the walk may pass does, or None where the walk must end.
fn step(word: u32) -> Option<Step> {
    let rd = word & 0x1f;
    let step = match word {
        // Hints: nop (#0) and bti (#32, #34, #36, #38); paciasp and the rest touch x30 or more.
        _ if word & 0xffff_f01f == 0xd503_201f => {
            let imm = (word >> 5) & 0x7f;
            return (imm == 0 || ((32..=38).contains(&imm) && imm.is_multiple_of(2)))
                .then_some(Step::NOTHING);
        }
        // mrs Xt, <system register>.
        _ if word & 0xfff0_0000 == 0xd530_0000 => Step::writes(rd),
        // svc #imm: the result in x0, every other register kept.
        _ if word & 0xffe0_001f == 0xd400_0001 => Step::writes(0),
        _ if (word >> 26) & 0b111 == 0b100 => immediate(word)?,
        _ if (word >> 25) & 0b111 == 0b101 => register_operands(word)?,
        _ if (word >> 25) & 0b101 == 0b100 => load(word)?,
        _ => return None,
    };
    (step.writes & (0b11 << 29) == 0).then_some(step)
}

/// Data processing with an immediate (bits 28:26 = 100): add/sub, logic, moves, bit fields.
fn immediate(word: u32) -> Option<Step> {
    let (rd, sets_flags) = (word & 0x1f, (word >> 29) & 1 == 1);
    match (word >> 23) & 0b111 {
        // add/sub (immediate); Rd 31 is sp unless flags are set.
        0b010 if rd == 31 && !sets_flags => None,
        // Logical (immediate): opc 11 is ands, which names xzr; the others name sp.
        0b100 if rd == 31 && (word >> 29) & 0b11 != 0b11 => None,
        0b010 | 0b100 | 0b101 | 0b110 | 0b111 => Some(Step::writes(rd)),
        _ => None,
    }
}

/// Data processing with registers (bits 27:25 = 101).
fn register_operands(word: u32) -> Option<Step> {
    let rd = word & 0x1f;
    // mov Xd, Xm (orr Xd, xzr, Xm, no shift): a copy.
    if word & 0x7fe0_ffe0 == 0x2a00_03e0 {
        let (from, wide) = ((word >> 16) & 0x1f, word >> 31 == 1);
        return Some(Step { copy: (from != 31 && rd != 31).then_some((rd, from, wide)), ..Step::writes(rd) });
    }
    // add/sub (extended register): Rd 31 is sp unless flags are set.
    if word & 0x1f20_0000 == 0x0b20_0000 && rd == 31 && (word >> 29) & 1 == 0 {
        return None;
    }
    // Conditional compare (ccmp, ccmn) writes only flags.
    if (word >> 21) & 0xff == 0b1101_0010 {
        return Some(Step::NOTHING);
    }
    // Bit 28 clear with bit 24 set but not add/sub: unallocated; the rest writes Rd (SIMD lives
    // elsewhere).
    Some(Step::writes(rd))
}

/// Loads without write-back: unsigned offset, unscaled (ldur) and register offset forms, and
/// literal loads; a store, a pair or an exclusive ends the walk. A SIMD load writes no general
/// register.
fn load(word: u32) -> Option<Step> {
    let (rt, simd) = (word & 0x1f, (word >> 26) & 1 == 1);
    // A SIMD load or a prefetch writes no general register.
    let loaded = |writes_none: bool| Some(if writes_none { Step::NOTHING } else { Step::writes(rt) });
    if is_literal_load(word) {
        return loaded(simd || word >> 30 == 0b11);
    }
    // size 111 V 0 opc ...: general registers' opc 00 stores, 01 loads, 1x loads signed (or
    // prefetches); SIMD's low bit of opc says load (its 10 stores a q register).
    let opc = (word >> 22) & 0b11;
    let loads = if simd { opc & 1 == 1 } else { opc != 0b00 };
    let prefetch = word >> 30 == 0b11 && opc == 0b10 && !simd;
    // Unsigned offset (bits 25:24 = 01, any imm12), unscaled (ldur) and register offset.
    let no_write_back =
        word & 0x3b00_0000 == 0x3900_0000 || matches!(word & 0x3b20_0c00, 0x3800_0000 | 0x3820_0800);
    if !(no_write_back && loads) {
        return None;
    }
    loaded(simd || prefetch)
}

/// For each argument the programs read, the registers (x0..x14) that hold it, a bit each.
struct Held {
    arguments: ArgumentsRead,
    held: [u32; ArgumentRegisters::COUNT],
}

impl Held {
    fn at_entry(arguments: ArgumentsRead) -> Self {
        let mut held = [0; ArgumentRegisters::COUNT];
        for (n, held) in held.iter_mut().enumerate() {
            if arguments.reads(n) {
                *held = 1 << n;
            }
        }
        Self { arguments, held }
    }

    /// Where the probe finds each argument: xn while it holds argument n, else the lowest
    /// register that does.
    fn registers(&self) -> ArgumentRegisters {
        let mut registers = ArgumentRegisters::AT_ENTRY;
        for (n, &held) in self.held.iter().enumerate() {
            if held != 0 && held & (1 << n) == 0 {
                registers = registers.with(n, held.trailing_zeros() as u8);
            }
        }
        registers
    }

    /// Steps over an instruction that does `step`: false where an argument is lost with it.
    fn pass(&mut self, step: Step) -> bool {
        let before = self.held;
        for held in &mut self.held {
            *held &= !step.writes;
        }
        if let Some((to, from, wide)) = step.copy {
            for (n, held) in self.held.iter_mut().enumerate() {
                if before[n] & (1 << from) != 0 && (wide || self.arguments.narrow(n)) {
                    *held |= (1 << to) & NAMEABLE;
                }
            }
        }
        (0..ArgumentRegisters::COUNT).all(|n| !self.arguments.reads(n) || self.held[n] != 0)
    }
}

#[cfg(test)]
mod tests;
