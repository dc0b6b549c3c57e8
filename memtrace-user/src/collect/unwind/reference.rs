//! The userspace reference unwinder: steps a stopped thread's stack frame by frame with the tables
//! of the files its executable mappings come from, exactly as the BPF unwinder will (the rules are
//! on `memtrace_common::UnwindRow`). It reads the target's memory and never writes it; tests use it
//! to prove the tables on real processes.

use std::{collections::HashMap, fs::File, os::unix::fs::FileExt, path::PathBuf, rc::Rc};

use anyhow::{Context, Result};
use memtrace_common::{unwind_kind, unwind_ra, UnwindRow, UNWIND_RBP_LOST};

use super::{build::table_of_file, index::UnwindTable};
use crate::{
    process::procfs::{self, Mapping},
    process::{open_mapping, Root},
};

/// The registers the unwinder needs; `rbp` is None once no frame can tell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registers {
    pub rip: u64,
    pub rsp: u64,
    pub rbp: Option<u64>,
}

/// How a frame's caller was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepSource {
    /// From an unwind row.
    Table,
    /// No row covered the address: rbp was taken as a frame pointer.
    FramePointer,
}

/// Why a walk ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The outermost frame (an END row): the stack is whole.
    Outermost,
    /// A return address of 0.
    ZeroReturnAddress,
    /// The address is in no executable file mapping (anonymous code, [vdso], garbage).
    NoMapping,
    /// No row, and no frame pointer to fall back on.
    NoRow,
    /// The row is UNSUPPORTED.
    Unsupported,
    /// The row needs rbp, which an earlier frame lost.
    RbpLost,
    /// The stack could not be read where the row points.
    ReadFault,
    /// The depth limit.
    DepthLimit,
}

/// Read access to the target's memory.
pub trait Memory {
    fn read_u64(&self, address: u64) -> Option<u64>;
}

/// A process's memory through /proc/PID/mem, opened read-only.
pub struct ProcessMemory(File);

impl ProcessMemory {
    pub fn open(pid: u32) -> Result<Self> {
        let path = format!("/proc/{pid}/mem");
        Ok(Self(File::open(&path).with_context(|| format!("cannot open {path} for reading"))?))
    }
}

impl Memory for ProcessMemory {
    fn read_u64(&self, address: u64) -> Option<u64> {
        let mut bytes = [0u8; 8];
        self.0.read_exact_at(&mut bytes, address).ok()?;
        Some(u64::from_ne_bytes(bytes))
    }
}

/// The caller's registers, per one row (the steps on `UnwindRow`), in a frame whose link register
/// is not known (every frame but a walk's innermost, and x86-64's every frame).
pub fn step(row: UnwindRow, regs: Registers, memory: &impl Memory) -> Result<Registers, StopReason> {
    step_with_link(row, regs, None, memory)
}

/// `step`, with the link register where it is known (arm64's x30 in the innermost frame).
pub fn step_with_link(
    row: UnwindRow,
    regs: Registers,
    link: Option<u64>,
    memory: &impl Memory,
) -> Result<Registers, StopReason> {
    let cfa = match row.cfa_rule() {
        unwind_kind::CFA_RSP => regs.rsp.checked_add(u64::from(row.cfa_offset)),
        unwind_kind::CFA_RBP => regs.rbp.ok_or(StopReason::RbpLost)?.checked_add(u64::from(row.cfa_offset)),
        unwind_kind::CFA_PLT => {
            let extra = if regs.rip & 15 >= 11 { 8 } else { 0 };
            regs.rsp.checked_add(u64::from(row.cfa_offset) + extra)
        }
        unwind_kind::END => return Err(StopReason::Outermost),
        unwind_kind::NONE => return Err(StopReason::NoRow),
        _ => return Err(StopReason::Unsupported),
    }
    .ok_or(StopReason::ReadFault)?;
    let return_address = code_address(return_address(row, cfa, link, memory)?);
    let rbp = match row.rbp {
        0 => regs.rbp,
        UNWIND_RBP_LOST => None,
        units => {
            let slot = cfa.wrapping_add_signed(i64::from(units) * 8);
            Some(memory.read_u64(slot).ok_or(StopReason::ReadFault)?)
        }
    };
    if return_address == 0 {
        return Err(StopReason::ZeroReturnAddress);
    }
    Ok(Registers { rip: return_address, rsp: cfa, rbp })
}

/// The return address per the row's `unwind_ra` rule, as it is stored (signed, on arm64).
fn return_address(
    row: UnwindRow,
    cfa: u64,
    link: Option<u64>,
    memory: &impl Memory,
) -> Result<u64, StopReason> {
    let slot = match row.ra_rule() {
        unwind_ra::LINK_REGISTER => return link.ok_or(StopReason::Unsupported),
        unwind_ra::FRAME_RECORD if row.rbp != 0 && row.rbp != UNWIND_RBP_LOST => {
            cfa.wrapping_add_signed(i64::from(row.rbp) * 8 + 8)
        }
        rule if rule <= unwind_ra::DEEPEST => cfa.wrapping_sub(8 * (u64::from(rule) + 1)),
        _ => return Err(StopReason::Unsupported),
    };
    memory.read_u64(slot).ok_or(StopReason::ReadFault)
}

/// A return address as a code address: on arm64, without the pointer-authentication signature
/// above bit 48 (as memtrace-ebpf's `registers::code_address`).
fn code_address(return_address: u64) -> u64 {
    if cfg!(target_arch = "aarch64") {
        return_address & ((1 << 48) - 1)
    } else {
        return_address
    }
}

/// The frame-pointer step where no row covers an address: CFA = rbp + 16.
fn frame_pointer_step(regs: Registers, memory: &impl Memory) -> Result<Registers, StopReason> {
    let rbp = regs.rbp.filter(|&rbp| rbp != 0).ok_or(StopReason::NoRow)?;
    let return_address = memory.read_u64(rbp.wrapping_add(8)).ok_or(StopReason::ReadFault)?;
    let caller_rbp = memory.read_u64(rbp).ok_or(StopReason::ReadFault)?;
    if return_address == 0 {
        return Err(StopReason::ZeroReturnAddress);
    }
    Ok(Registers { rip: return_address, rsp: rbp + 16, rbp: Some(caller_rbp) })
}

/// One frame of a walk: the instruction address, and how its caller was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub address: u64,
    /// None for the last frame.
    pub source: Option<StepSource>,
}

/// A walked stack, innermost first, and why it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Walk {
    pub frames: Vec<Frame>,
    pub stop: StopReason,
}

/// The executable mappings of one process and the tables of their files, built once per file.
pub struct ProcessTables {
    pid: u32,
    mappings: Vec<Mapping>,
    tables: HashMap<PathBuf, Option<Rc<UnwindTable>>>,
}

impl ProcessTables {
    pub fn new(pid: u32) -> Result<Self> {
        let mappings = procfs::mappings(pid).with_context(|| format!("cannot read /proc/{pid}/maps"))?;
        let mappings = mappings.into_iter().filter(|m| m.executable).collect();
        Ok(Self { pid, mappings, tables: HashMap::new() })
    }

    /// The table and file offset of a runtime address; None outside every executable file mapping.
    fn locate(&mut self, address: u64) -> Option<(Option<Rc<UnwindTable>>, u64)> {
        let mapping = self.mappings.iter().find(|m| (m.start..m.end).contains(&address))?;
        let offset = address - mapping.start + mapping.file_offset;
        let pid = self.pid;
        let table = self.tables.entry(mapping.path.clone()).or_insert_with(|| {
            let object = Root::of_process(pid).and_then(|root| open_mapping(pid, &root, mapping)).ok()?;
            table_of_file(&object.host_path).ok().map(|(t, _)| Rc::new(t))
        });
        Some((table.clone(), offset))
    }

    /// Walks from `regs` (a stopped thread's registers) up to `max_frames` frames.
    pub fn walk(&mut self, regs: Registers, memory: &impl Memory, max_frames: usize) -> Walk {
        let mut frames = Vec::new();
        let mut regs = regs;
        loop {
            if frames.len() == max_frames {
                return Walk { frames, stop: StopReason::DepthLimit };
            }
            frames.push(Frame { address: regs.rip, source: None });
            // Past the innermost frame, rip is a return address: look inside the call.
            let lookup_address = if frames.len() == 1 { regs.rip } else { regs.rip - 1 };
            let Some((table, offset)) = self.locate(lookup_address) else {
                return Walk { frames, stop: StopReason::NoMapping };
            };
            let row = table.and_then(|t| t.lookup(offset));
            let (next, source) = match row {
                Some(row) => (step(row, regs, memory), StepSource::Table),
                None => (frame_pointer_step(regs, memory), StepSource::FramePointer),
            };
            match next {
                Ok(next) => {
                    frames.last_mut().expect("just pushed").source = Some(source);
                    regs = next;
                }
                Err(stop) => return Walk { frames, stop },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// A few stack slots.
    struct Slots(HashMap<u64, u64>);

    impl Memory for Slots {
        fn read_u64(&self, address: u64) -> Option<u64> {
            self.0.get(&address).copied()
        }
    }

    fn row(kind: u8, cfa_offset: u16, rbp: i8) -> UnwindRow {
        UnwindRow { pc: 0, cfa_offset, kind, rbp }
    }

    #[test]
    fn plt_rows_add_eight_once_the_push_has_run() {
        let memory = Slots(HashMap::from([(0x1000, 0xaaaa), (0x1008, 0xbbbb)]));
        // At PLT entry + 0..10 (jmp *GOT), rsp points at the return address.
        let regs = Registers { rip: 0x4026, rsp: 0x1000, rbp: Some(7) };
        let caller = step(row(unwind_kind::CFA_PLT, 8, 0), regs, &memory).unwrap();
        assert_eq!(caller, Registers { rip: 0xaaaa, rsp: 0x1008, rbp: Some(7) });
        // At +11 and later (after `push $n`), one more slot is on the stack.
        let regs = Registers { rip: 0x402b, rsp: 0x1000, rbp: Some(7) };
        let caller = step(row(unwind_kind::CFA_PLT, 8, 0), regs, &memory).unwrap();
        assert_eq!(caller, Registers { rip: 0xbbbb, rsp: 0x1010, rbp: Some(7) });
    }

    #[test]
    fn saved_rbp_is_read_and_a_lost_one_stops_an_rbp_frame() {
        let memory = Slots(HashMap::from([(0x2008, 0x5555), (0x2000, 0x3000)]));
        let regs = Registers { rip: 0x10, rsp: 0x1ff0, rbp: Some(1) };
        // CFA = rsp + 32 = 0x2010: return address at 0x2008, rbp saved at CFA-16.
        let caller = step(row(unwind_kind::CFA_RSP, 32, -2), regs, &memory).unwrap();
        assert_eq!(caller, Registers { rip: 0x5555, rsp: 0x2010, rbp: Some(0x3000) });
        let lost = step(row(unwind_kind::CFA_RSP, 32, UNWIND_RBP_LOST), regs, &memory).unwrap();
        assert_eq!(lost.rbp, None);
        assert_eq!(step(row(unwind_kind::CFA_RBP, 16, 0), lost, &memory), Err(StopReason::RbpLost));
    }

    #[test]
    fn rows_that_do_not_step_say_why() {
        let memory = Slots(HashMap::new());
        let regs = Registers { rip: 0x10, rsp: 0x1000, rbp: None };
        assert_eq!(step(row(unwind_kind::END, 0, 0), regs, &memory), Err(StopReason::Outermost));
        assert_eq!(step(row(unwind_kind::UNSUPPORTED, 0, 0), regs, &memory), Err(StopReason::Unsupported));
        assert_eq!(step(row(unwind_kind::CFA_RSP, 8, 0), regs, &memory), Err(StopReason::ReadFault));
        let regs = Registers { rip: 0x10, rsp: u64::MAX - 4, rbp: None };
        assert_eq!(step(row(unwind_kind::CFA_RSP, 8, 0), regs, &memory), Err(StopReason::ReadFault));
    }

    #[test]
    fn arm64_return_addresses_come_from_the_frame_record_a_slot_or_the_link_register() {
        let kind = |ra| UnwindRow::kind_of(unwind_kind::CFA_RSP, ra);
        // `stp x29, x30, [sp, #-96]!` at sp 0x1fa0: CFA = sp + 96 = 0x2000, x29 at CFA-96 = 0x1fa0
        // (units -12), x30 above it at 0x1fa8.
        let memory = Slots(HashMap::from([(0x1fa0, 0x3000), (0x1fa8, 0x4444), (0x1ff0, 0x5555)]));
        let regs = Registers { rip: 0x10, rsp: 0x1fa0, rbp: Some(1) };
        let caller = step(row(kind(unwind_ra::FRAME_RECORD), 96, -12), regs, &memory).unwrap();
        assert_eq!(caller, Registers { rip: 0x4444, rsp: 0x2000, rbp: Some(0x3000) });
        // `str x30, [sp, #-16]!`: x30 at CFA-16 = 0x1ff0, rule 1; x29 untouched.
        let caller = step(row(kind(1), 96, 0), regs, &memory).unwrap();
        assert_eq!(caller, Registers { rip: 0x5555, rsp: 0x2000, rbp: Some(1) });
        // A leaf: CFA = sp, the return address still in x30, known in the innermost frame only.
        let leaf = row(kind(unwind_ra::LINK_REGISTER), 0, 0);
        let caller = step_with_link(leaf, regs, Some(0x6666), &memory).unwrap();
        assert_eq!(caller, Registers { rip: 0x6666, rsp: 0x1fa0, rbp: Some(1) });
        assert_eq!(step(leaf, regs, &memory), Err(StopReason::Unsupported));
    }
}
