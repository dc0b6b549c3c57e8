//! Where a function's probes sit: at its first instruction the kernel emulates, so that a call
//! costs one trap, not two.
//!
//! On x86 the kernel emulates a probed `push` of a register, a one-byte `nop`, `jmp`, `call` and
//! `jcc` (arch/x86/kernel/uprobes.c: `branch_setup_xol_ops`, `push_setup_xol_ops`; the same set from
//! 4.13 through 6.1, 6.12 and 7.2), and single-steps every other instruction out of line: a second
//! trap, some 20 µs in a VM. jemalloc's malloc starts with `cmp $0x1000,%rdi`, its free with
//! `mov %rdi,%rax`, glibc's free with `test %rdi,%rdi`: probed at their first byte, every call is
//! single-stepped.
//!
//! A return probe is an entry probe too: it takes the return address from the top of the stack
//! where it is placed. So one point serves both, found by walking the function's first
//! instructions while all of these hold:
//! - the code is straight-line: no instruction passed is a branch, a `ret` or an indirect jump
//!   (those end the walk), and none is the target of a branch of the function (a path that skips
//!   the entry would meet the probe);
//! - nothing passed writes memory or moves the stack pointer, so the return address is still at
//!   the top of the stack and the program sees what the caller passed;
//! - every argument the programs read is still in some register: copies are followed (mimalloc's
//!   malloc moves the size to rsi and reuses rdi before its first branch), and the probe's cookie
//!   says where each one is (`ArgumentRegisters`). A `syscall` may be passed: the kernel keeps every
//!   register but rax, rcx and r11 (glibc's munmap has no emulated point but the `jae` after it).
//!
//! Where no such point exists the probe stays at the entry (`emulated` says whether the kernel
//! emulates what is there), and doctor and the summary name it. arm64's walk, by the same rules
//! with arm64's instructions, is in probe_point/arm64.rs.

use std::collections::HashSet;

use iced_x86::{
    Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpAccess, OpKind,
    Register,
};
use memtrace_common::{arguments::register, ArgumentRegisters, ArgumentsRead};

pub use point::{ProbePoint, WALK_BYTES};

/// A probe the kernel single-steps: no point of its function has an instruction it emulates where
/// the arguments and the stack are still as the caller left them (summary `single_stepped`, doctor).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SingleStepped {
    /// The file, as the traced process names it.
    pub file: std::path::PathBuf,
    pub function: String,
    /// The instruction at its entry, where the probe stays.
    pub instruction: String,
}

/// The probe point of the function whose code (from its entry at `address`, as far as its symbol
/// reaches, and at least `WALK_BYTES` where the file has them) is `code`, for programs that read
/// `arguments`.
pub fn place(code: &[u8], address: u64, arguments: ArgumentsRead) -> ProbePoint {
    if cfg!(target_arch = "aarch64") {
        return arm64::place(code, arguments);
    }
    walk(code, address, arguments).unwrap_or_else(|| at_entry(code, address))
}

/// A probe that cannot move (a USDT site: its arguments are where its note says, at that
/// instruction): whether the kernel emulates the instruction in `code`, which starts there, or
/// (`nop5_optimized`: 6.18's optimized uprobes) calls into it where it is a 5-byte nop.
pub fn fixed(code: &[u8], nop5_optimized: bool) -> ProbePoint {
    if cfg!(target_arch = "aarch64") {
        return arm64::at_entry(code);
    }
    let mut point = at_entry(code, 0);
    point.emulated |= nop5_optimized && code.starts_with(&NOP5);
    point
}

/// The 5-byte nop (`nopl 0x0(%rax,%rax,1)`) memtrace.h puts at its sites.
const NOP5: [u8; 5] = [0x0f, 0x1f, 0x44, 0x00, 0x00];

/// The probe at the function's first byte, all arguments where the calling convention puts them.
fn at_entry(code: &[u8], address: u64) -> ProbePoint {
    let first = Decoder::with_ip(64, code, address, DecoderOptions::NONE).decode();
    ProbePoint {
        delta: 0,
        registers: ArgumentRegisters::AT_ENTRY,
        emulated: !first.is_invalid() && emulated(instruction_bytes(code, address, &first)),
        instruction: mnemonic(&first),
    }
}

fn walk(code: &[u8], address: u64, arguments: ArgumentsRead) -> Option<ProbePoint> {
    let targets = branch_targets(code, address);
    let mut holders = Holders::at_entry(arguments);
    let mut info = InstructionInfoFactory::new();
    let walked = &code[..code.len().min(WALK_BYTES)];
    for instruction in Decoder::with_ip(64, walked, address, DecoderOptions::NONE) {
        if instruction.is_invalid() || (instruction.ip() != address && targets.contains(&instruction.ip())) {
            return None;
        }
        if emulated(instruction_bytes(code, address, &instruction)) {
            return Some(ProbePoint {
                delta: instruction.ip() - address,
                registers: holders.registers(),
                emulated: true,
                instruction: mnemonic(&instruction),
            });
        }
        if !holders.pass(&instruction, &mut info) {
            return None;
        }
    }
    None
}

fn instruction_bytes<'a>(code: &'a [u8], address: u64, instruction: &Instruction) -> &'a [u8] {
    let start = usize::try_from(instruction.ip() - address).unwrap_or(usize::MAX).min(code.len());
    &code[start..(start + instruction.len()).min(code.len())]
}

fn mnemonic(instruction: &Instruction) -> String {
    format!("{:?}", instruction.mnemonic()).to_lowercase()
}

/// Every address a direct branch of the function leads to.
fn branch_targets(code: &[u8], address: u64) -> HashSet<u64> {
    Decoder::with_ip(64, code, address, DecoderOptions::NONE)
        .into_iter()
        .filter(|instruction| matches!(instruction.op0_kind(), OpKind::NearBranch64))
        .map(|instruction| instruction.near_branch_target())
        .collect()
}

/// Whether the kernel emulates `bytes`, one instruction (uprobes.c of 6.1 through 7.2): a push
/// of a register (a REX.B prefix allowed, no other), a one-byte nop, a relative jmp or call, a
/// jcc; none with an operand-size prefix (0x66, refused), nor a segment or lock prefix (which the
/// kernel refuses to probe at all). Multi-byte nops are single-stepped before 6.18: not counted.
pub fn emulated(bytes: &[u8]) -> bool {
    let prefixes = bytes.iter().take_while(|byte| matches!(byte, 0xf2 | 0xf3)).count();
    match &bytes[prefixes..] {
        [0x50..=0x57] | [0x41, 0x50..=0x57] => prefixes == 0,
        [0x90] | [0xeb, _] | [0x70..=0x7f, _] => true,
        [0xe9 | 0xe8, _, _, _, _] | [0x0f, 0x80..=0x8f, _, _, _, _] => true,
        _ => false,
    }
}

/// The calling convention's argument registers, in order (`register` indices).
const ARGUMENT_REGISTERS: [u8; ArgumentRegisters::COUNT] =
    [register::RDI, register::RSI, register::RDX, register::RCX, register::R8];

/// For each argument the programs read, the registers that hold it (a bit a `register` index).
struct Holders {
    arguments: ArgumentsRead,
    held: [u16; ArgumentRegisters::COUNT],
}

impl Holders {
    fn at_entry(arguments: ArgumentsRead) -> Self {
        let mut held = [0; ArgumentRegisters::COUNT];
        for (n, register) in ARGUMENT_REGISTERS.iter().enumerate() {
            if arguments.reads(n) {
                held[n] = 1 << register;
            }
        }
        Self { arguments, held }
    }

    /// Where the probe finds each argument: the calling convention's register while it holds
    /// it, otherwise the lowest-numbered register that does.
    fn registers(&self) -> ArgumentRegisters {
        let mut registers = ArgumentRegisters::AT_ENTRY;
        for (n, &held) in self.held.iter().enumerate() {
            if held != 0 && held & (1 << ARGUMENT_REGISTERS[n]) == 0 {
                registers = registers.with(n, held.trailing_zeros() as u8);
            }
        }
        registers
    }

    /// Steps over `instruction`, which the kernel would single-step: false where the walk must
    /// end before it (control flow, a store, the stack pointer moved, an argument lost).
    fn pass(&mut self, instruction: &Instruction, info: &mut InstructionInfoFactory) -> bool {
        let syscall = instruction.mnemonic() == Mnemonic::Syscall;
        if instruction.flow_control() != FlowControl::Next && !syscall {
            return false;
        }
        let info = info.info(instruction);
        if info.used_memory().iter().any(|memory| writes(memory.access())) {
            return false;
        }
        let mut written: Vec<Register> = info
            .used_registers()
            .iter()
            .filter(|used| writes(used.access()))
            .map(|used| used.register().full_register())
            .collect();
        if syscall {
            written.extend([Register::RAX, Register::RCX, Register::R11]);
        }
        if written.contains(&Register::RSP) {
            return false;
        }
        let before = self.held;
        for index in written.into_iter().filter_map(register_index) {
            self.held.iter_mut().for_each(|held| *held &= !(1 << index));
        }
        if let Some((to, from, wide)) = register_copy(instruction) {
            for (n, held) in self.held.iter_mut().enumerate() {
                if before[n] & (1 << from) != 0 && (wide || self.arguments.narrow(n)) {
                    *held |= 1 << to;
                }
            }
        }
        (0..ArgumentRegisters::COUNT).all(|n| !self.arguments.reads(n) || self.held[n] != 0)
    }
}

fn writes(access: OpAccess) -> bool {
    matches!(access, OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite)
}

/// `mov` from one general register to another: (to, from, whether all 64 bits are copied).
fn register_copy(instruction: &Instruction) -> Option<(u8, u8, bool)> {
    if instruction.mnemonic() != Mnemonic::Mov
        || instruction.op0_kind() != OpKind::Register
        || instruction.op1_kind() != OpKind::Register
    {
        return None;
    }
    let (to, from) = (instruction.op0_register(), instruction.op1_register());
    let width = |register: Register| (register.is_gpr64(), register.is_gpr32());
    match (width(to), width(from)) {
        ((true, _), (true, _)) | ((_, true), (_, true)) => {
            Some((register_index(to.full_register())?, register_index(from.full_register())?, to.is_gpr64()))
        }
        _ => None,
    }
}

/// A 64-bit general register's `register` index (none for rsp).
fn register_index(register: Register) -> Option<u8> {
    Some(match register {
        Register::R15 => register::R15,
        Register::R14 => register::R14,
        Register::R13 => register::R13,
        Register::R12 => register::R12,
        Register::RBP => register::RBP,
        Register::RBX => register::RBX,
        Register::R11 => register::R11,
        Register::R10 => register::R10,
        Register::R9 => register::R9,
        Register::R8 => register::R8,
        Register::RAX => register::RAX,
        Register::RCX => register::RCX,
        Register::RDX => register::RDX,
        Register::RSI => register::RSI,
        Register::RDI => register::RDI,
        _ => return None,
    })
}

mod arm64;
mod point;
#[cfg(test)]
mod tests;
