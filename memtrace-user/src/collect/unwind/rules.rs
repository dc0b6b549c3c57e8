//! One gimli CFI row as an `UnwindRow` rule (without its `pc`), per architecture: x86-64's (the
//! return address at CFA-8, rbp, the PLT's CFA expression) and arm64's (CFA from sp or x29, the
//! return address in a frame record, a slot near the CFA or still in x30, x29 like rbp). What
//! the 8-byte row cannot say becomes UNSUPPORTED, never a guess.

use gimli::{
    AArch64, CfaRule, EndianSlice, LittleEndian, Reader, Register, RegisterRule, UnwindSection,
    UnwindTableRow, X86_64,
};
use memtrace_common::{unwind_kind, unwind_ra, UnwindRow, UNWIND_RBP_LOST};

/// The CFI sections' bytes as gimli reads them.
pub(super) type Slice<'data> = EndianSlice<'data, LittleEndian>;

/// The instruction sets whose CFI the builder reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    X86_64,
    Aarch64,
}

impl Arch {
    /// The architecture of an ELF file, if the builder reads its CFI.
    pub fn of(architecture: object::Architecture) -> Option<Arch> {
        match architecture {
            object::Architecture::X86_64 => Some(Arch::X86_64),
            object::Architecture::Aarch64 => Some(Arch::Aarch64),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86-64",
            Arch::Aarch64 => "arm64",
        }
    }

    /// The architecture memtrace runs on, whose BPF side steps the rows.
    pub fn native() -> Option<Arch> {
        match std::env::consts::ARCH {
            "x86_64" => Some(Arch::X86_64),
            "aarch64" => Some(Arch::Aarch64),
            _ => None,
        }
    }
}

const UNSUPPORTED: UnwindRow = UnwindRow { pc: 0, cfa_offset: 0, kind: unwind_kind::UNSUPPORTED, rbp: 0 };
const END: UnwindRow = UnwindRow { pc: 0, cfa_offset: 0, kind: unwind_kind::END, rbp: 0 };

/// One gimli row as an `UnwindRow` without its `pc`.
pub fn rule_of<'data, S: UnwindSection<Slice<'data>>>(
    arch: Arch,
    row: &UnwindTableRow<usize>,
    section: &S,
) -> UnwindRow {
    match arch {
        Arch::X86_64 => x86_64_rule(row, section),
        Arch::Aarch64 => aarch64_rule(row),
    }
}

fn x86_64_rule<'data, S: UnwindSection<Slice<'data>>>(row: &UnwindTableRow<usize>, section: &S) -> UnwindRow {
    match row.register(X86_64::RA) {
        Some(RegisterRule::Undefined) => return END,
        Some(RegisterRule::Offset(-8)) => {}
        _ => return UNSUPPORTED,
    }
    let (kind, offset) = match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RSP => {
            (unwind_kind::CFA_RSP, *offset)
        }
        CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RBP => {
            (unwind_kind::CFA_RBP, *offset)
        }
        CfaRule::Expression(expression) => match expression.get(section).ok().and_then(|e| plt_offset(e.0)) {
            Some(offset) => (unwind_kind::CFA_PLT, offset),
            None => return UNSUPPORTED,
        },
        CfaRule::RegisterAndOffset { .. } => return UNSUPPORTED,
    };
    let Ok(cfa_offset) = u16::try_from(offset) else {
        return UNSUPPORTED;
    };
    UnwindRow { pc: 0, cfa_offset, kind, rbp: frame_pointer_slot(row, X86_64::RBP) }
}

/// arm64 (AAPCS64, DWARF registers 31 = sp, 29 = x29, 30 = x30, the return address column). The
/// pointer-authentication state (DW_CFA_AARCH64_negate_ra_state, gimli's RA_SIGN_STATE) is left
/// out: the unwinder strips the signature from every return address it takes.
fn aarch64_rule(row: &UnwindTableRow<usize>) -> UnwindRow {
    let (cfa, offset) = match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } if *register == AArch64::SP => {
            (unwind_kind::CFA_RSP, *offset)
        }
        CfaRule::RegisterAndOffset { register, offset } if *register == AArch64::X29 => {
            (unwind_kind::CFA_RBP, *offset)
        }
        _ => {
            return if row.register(AArch64::X30) == Some(RegisterRule::Undefined) {
                END
            } else {
                UNSUPPORTED
            }
        }
    };
    let Ok(cfa_offset) = u16::try_from(offset) else {
        return UNSUPPORTED;
    };
    let rbp = frame_pointer_slot(row, AArch64::X29);
    let ra = match row.register(AArch64::X30) {
        Some(RegisterRule::Undefined) => return END,
        None | Some(RegisterRule::SameValue) => unwind_ra::LINK_REGISTER,
        Some(RegisterRule::Offset(at)) => match saved_ra_rule(at, rbp) {
            Some(rule) => rule,
            None => return UNSUPPORTED,
        },
        Some(_) => return UNSUPPORTED,
    };
    UnwindRow { pc: 0, cfa_offset, kind: UnwindRow::kind_of(cfa, ra), rbp }
}

/// The `unwind_ra` rule of a return address saved at CFA + `at`, given the row's frame pointer
/// slot: a frame record (the return address in the word above the saved frame pointer) first,
/// whatever its depth, else a slot within CFA-240.
fn saved_ra_rule(at: i64, rbp: i8) -> Option<u8> {
    if rbp != 0 && rbp != UNWIND_RBP_LOST && at == i64::from(rbp) * 8 + 8 {
        return Some(unwind_ra::FRAME_RECORD);
    }
    // at = -8 * (rule + 1)
    let rule = u8::try_from(at.checked_neg()? / 8 - 1).ok()?;
    (at % 8 == 0 && rule <= unwind_ra::DEEPEST).then_some(rule)
}

/// Where the caller's frame pointer (x86-64's rbp, arm64's x29) was saved, in 8-byte units from
/// the CFA; 0 when unchanged; `UNWIND_RBP_LOST` when it cannot be recovered.
fn frame_pointer_slot(row: &UnwindTableRow<usize>, register: Register) -> i8 {
    match row.register(register) {
        None | Some(RegisterRule::SameValue) => 0,
        Some(RegisterRule::Offset(offset)) if offset % 8 == 0 && offset != 0 => {
            i8::try_from(offset / 8).ok().filter(|&units| units != UNWIND_RBP_LOST).unwrap_or(UNWIND_RBP_LOST)
        }
        _ => UNWIND_RBP_LOST,
    }
}

/// The base offset of binutils' x86-64 PLT CFA expression, `DW_OP_breg7 (rsp): N; DW_OP_breg16
/// (rip): 0; DW_OP_lit15; DW_OP_and; DW_OP_lit11; DW_OP_ge; DW_OP_lit3; DW_OP_shl; DW_OP_plus`,
/// or None for any other expression.
fn plt_offset(mut expression: Slice<'_>) -> Option<i64> {
    const DW_OP_BREG7: u8 = 0x77;
    const TAIL: [u8; 9] = [0x80, 0x00, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22];
    if expression.read_u8().ok()? != DW_OP_BREG7 {
        return None;
    }
    let offset = expression.read_sleb128().ok()?;
    (expression.slice() == TAIL).then_some(offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plt_expression_is_recognised_and_others_are_not() {
        let plt = [0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22];
        assert_eq!(plt_offset(EndianSlice::new(&plt, LittleEndian)), Some(8));
        let mut other = plt;
        other[6] = 0x3a; // DW_OP_lit10
        assert_eq!(plt_offset(EndianSlice::new(&other, LittleEndian)), None);
        // The signal trampoline's `DW_OP_breg7 (rsp): 160; DW_OP_deref`.
        assert_eq!(plt_offset(EndianSlice::new(&[0x77, 0xa0, 0x01, 0x06], LittleEndian)), None);
    }

    #[test]
    fn saved_return_addresses_become_a_frame_record_or_a_near_slot() {
        // `stp x29, x30, [sp, #-96]!`: x29 at CFA-96 (units -12), x30 at CFA-88, above it.
        assert_eq!(saved_ra_rule(-88, -12), Some(unwind_ra::FRAME_RECORD));
        // x86-64's and `stp x29, x30, [sp, #-16]!`'s CFA-8 with rbp at CFA-16 is a frame record too;
        // with no frame pointer saved it is rule 0.
        assert_eq!(saved_ra_rule(-8, -2), Some(unwind_ra::FRAME_RECORD));
        assert_eq!(saved_ra_rule(-8, 0), Some(0));
        // `str x30, [sp, #-16]!`: CFA-16 = -8 * (1 + 1).
        assert_eq!(saved_ra_rule(-16, 0), Some(1));
        // The deepest near slot, CFA-240 = -8 * (29 + 1); one deeper, a misaligned one, one above
        // the CFA and one under a lost x29 are not placed.
        assert_eq!(saved_ra_rule(-240, 0), Some(unwind_ra::DEEPEST));
        assert_eq!(saved_ra_rule(-248, 0), None);
        assert_eq!(saved_ra_rule(-12, 0), None);
        assert_eq!(saved_ra_rule(8, 0), None);
        assert_eq!(saved_ra_rule(-1392, UNWIND_RBP_LOST), None);
    }
}
