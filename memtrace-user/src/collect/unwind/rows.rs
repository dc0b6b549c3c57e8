//! From an x86-64 or arm64 ELF file's .eh_frame and .debug_frame (read with gimli) to
//! `UnwindRow`s (each range's rule by rules.rs): one row per address range, keyed by file offset,
//! adjacent identical rows merged, gaps marked. The file is treated as hostile: every count is
//! bounded, a corrupt entry is skipped and counted, nothing panics, and what cannot be expressed
//! becomes an UNSUPPORTED row rather than a guess.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use gimli::{
    BaseAddresses, CieOrFde, CommonInformationEntry, DebugFrame, EhFrame, LittleEndian, UnwindContext,
    UnwindSection, Vendor,
};
use memtrace_common::{unwind_kind, UnwindRow};
use object::{
    elf,
    read::elf::{ElfFile64, ProgramHeader as _},
    Endianness, Object, ObjectSection, ReadRef,
};

use super::rules::{rule_of, Arch, Slice};

/// Most address ranges (rows before merging) one file may produce: a hostile file cannot make the
/// builder allocate without bound. Debian's libc gives 28,274 rows after merging, python3.11 64,576.
pub const MAX_ROWS: usize = 1 << 22;

/// Most executable PT_LOAD segments a file may have (linkers make one; every span is placed by a
/// scan of them).
const MAX_CODE_SEGMENTS: usize = 16;

/// What the builder saw and set aside, for diagnostics and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BuildStats {
    /// FDEs whose rows were used (from both sections).
    pub fdes: u64,
    /// FDEs or CIEs that did not parse, or whose instructions did not evaluate.
    pub corrupt_entries: u64,
    /// FDEs whose range is not inside an executable PT_LOAD (or past 4 GiB of file offsets).
    pub outside_code: u64,
    /// Address ranges already covered by an earlier FDE (duplicates between the two sections).
    pub overlapping: u64,
    /// Ranges whose rules this format cannot express (kind UNSUPPORTED).
    pub unsupported: u64,
    /// Ranges of outermost frames (kind END).
    pub outermost: u64,
    /// True when a section held more than `MAX_ROWS` ranges and the rest was dropped.
    pub truncated: bool,
}

/// One executable PT_LOAD: virtual addresses `vaddr..vaddr + size` are file offsets `offset..`.
#[derive(Debug, Clone, Copy)]
struct CodeSegment {
    vaddr: u64,
    size: u64,
    offset: u64,
}

/// A range of file offsets `row.pc..end` and how to step out of a frame there: 12 bytes, placed in
/// the file as each FDE row is read, since a large binary has millions of them.
#[derive(Debug, Clone, Copy)]
struct Span {
    row: UnwindRow,
    end: u32,
}

impl Span {
    fn start(&self) -> u64 {
        u64::from(self.row.pc)
    }
}

/// Places virtual address ranges in the file: in the executable segment holding a range's start,
/// clipped to it and to the file.
struct Placement {
    segments: Vec<CodeSegment>,
    file_len: u64,
}

impl Placement {
    /// The span of `start..end` with `rule`; None (counted) outside every segment or past 4 GiB.
    fn span(&self, start: u64, end: u64, rule: UnwindRow, stats: &mut BuildStats) -> Option<Span> {
        let placed = self.file_range(start, end);
        if placed.is_none() {
            stats.outside_code += 1;
        }
        let (start, end) = placed?;
        Some(Span { row: UnwindRow { pc: start, ..rule }, end })
    }

    fn file_range(&self, start: u64, end: u64) -> Option<(u32, u32)> {
        let segment = self.segments.iter().find(|s| start >= s.vaddr && start - s.vaddr < s.size)?;
        let end = end.min(segment.vaddr + segment.size);
        let start = segment.offset.checked_add(start - segment.vaddr)?;
        let end = segment.offset.checked_add(end - segment.vaddr)?.min(self.file_len);
        (start < end).then_some((u32::try_from(start).ok()?, u32::try_from(end).ok()?))
    }
}

/// Builds the merged, sorted rows of an ELF file (the `pc` of every row is a file offset; see
/// memtrace_common's unwind section). The last row, if any, is a NONE row. `data` is the file in
/// memory or an `object::ReadCache`, which reads only the headers and the two CFI sections.
/// `only` refuses a file of another architecture (the rows' rules are the architecture's: the
/// BPF side steps its own).
pub fn build_rows<'data, R: ReadRef<'data>>(
    data: R,
    only: Option<Arch>,
) -> Result<(Vec<UnwindRow>, BuildStats)> {
    let file = ElfFile64::<Endianness, R>::parse(data).context("not a 64-bit ELF file")?;
    let file_len = data.len().ok().context("cannot tell the file's length")?;
    let arch = Arch::of(file.architecture()).filter(|_| file.is_little_endian());
    let Some(arch) = arch.filter(|arch| only.is_none_or(|only| only == *arch)) else {
        bail!(
            "not an ELF file of {} ({:?})",
            only.map_or("x86-64 or arm64", Arch::name),
            file.architecture()
        );
    };
    let vendor = if arch == Arch::Aarch64 { Vendor::AArch64 } else { Vendor::Default };
    let segments = code_segments(&file);
    if segments.len() > MAX_CODE_SEGMENTS {
        bail!("{} executable segments (at most {MAX_CODE_SEGMENTS} are accepted)", segments.len());
    }
    let placement = Placement { segments, file_len };
    let mut stats = BuildStats::default();
    let mut spans = Vec::new();
    if let Some(section) = file.section_by_name(".eh_frame") {
        if let Some(bytes) = section_bytes(&section) {
            let mut eh_frame = EhFrame::new(bytes, LittleEndian);
            eh_frame.set_address_size(8);
            eh_frame.set_vendor(vendor);
            let bases = eh_frame_bases(&file, section.address());
            collect_spans(arch, &eh_frame, &bases, &placement, &mut spans, &mut stats);
        }
    }
    if let Some(section) = file.section_by_name(".debug_frame") {
        if let Some(bytes) = section_bytes(&section) {
            let mut debug_frame = DebugFrame::new(bytes, LittleEndian);
            debug_frame.set_address_size(8);
            debug_frame.set_vendor(vendor);
            collect_spans(arch, &debug_frame, &BaseAddresses::default(), &placement, &mut spans, &mut stats);
        }
    }
    Ok((sweep(spans, &mut stats), stats))
}

/// A section's bytes, unless it is compressed (this build of `object` does not decompress).
fn section_bytes<'data, R: ReadRef<'data>>(
    section: &object::read::elf::ElfSection64<'data, '_, Endianness, R>,
) -> Option<&'data [u8]> {
    let range = section.compressed_file_range().ok()?;
    if range.format != object::CompressionFormat::None {
        return None;
    }
    section.data().ok()
}

fn eh_frame_bases<'data, R: ReadRef<'data>>(
    file: &ElfFile64<'data, Endianness, R>,
    eh_frame_address: u64,
) -> BaseAddresses {
    let address = |name: &str| file.section_by_name(name).map(|s| s.address());
    let mut bases = BaseAddresses::default().set_eh_frame(eh_frame_address);
    if let Some(text) = address(".text") {
        bases = bases.set_text(text);
    }
    if let Some(got) = address(".got") {
        bases = bases.set_got(got);
    }
    if let Some(hdr) = address(".eh_frame_hdr") {
        bases = bases.set_eh_frame_hdr(hdr);
    }
    bases
}

fn code_segments<'data, R: ReadRef<'data>>(file: &ElfFile64<'data, Endianness, R>) -> Vec<CodeSegment> {
    let endian = file.endian();
    file.elf_program_headers()
        .iter()
        .filter(|ph| ph.p_type(endian) == elf::PT_LOAD && ph.p_flags(endian) & elf::PF_X != 0)
        .map(|ph| CodeSegment {
            vaddr: ph.p_vaddr(endian),
            size: ph.p_filesz(endian),
            offset: ph.p_offset(endian),
        })
        .collect()
}

/// Appends the spans of every FDE of one CFI section. A corrupt entry header ends the section (the
/// next entry's position is unknown); a corrupt FDE is skipped.
fn collect_spans<'data, S>(
    arch: Arch,
    section: &S,
    bases: &BaseAddresses,
    placement: &Placement,
    spans: &mut Vec<Span>,
    stats: &mut BuildStats,
) where
    S: UnwindSection<Slice<'data>>,
    S::Offset: std::hash::Hash + Eq,
{
    let mut context = UnwindContext::new();
    let mut cies: HashMap<S::Offset, CommonInformationEntry<Slice<'data>>> = HashMap::new();
    let mut entries = section.entries(bases);
    loop {
        let partial = match entries.next() {
            Ok(Some(CieOrFde::Fde(partial))) => partial,
            Ok(Some(CieOrFde::Cie(_))) => continue,
            Ok(None) => break,
            Err(_) => {
                stats.corrupt_entries += 1;
                break;
            }
        };
        let fde = partial.parse(|section, bases, offset| match cies.get(&offset) {
            Some(cie) => Ok(cie.clone()),
            None => {
                let cie = section.cie_from_offset(bases, offset)?;
                cies.insert(offset, cie.clone());
                Ok(cie)
            }
        });
        let before = spans.len();
        let evaluated = fde.and_then(|fde| {
            let mut table = fde.rows(section, bases, &mut context)?;
            while let Some(row) = table.next_row()? {
                if spans.len() >= MAX_ROWS {
                    stats.truncated = true;
                    return Ok(());
                }
                if row.start_address() < row.end_address() {
                    let rule = rule_of(arch, row, section);
                    spans.extend(placement.span(row.start_address(), row.end_address(), rule, stats));
                }
            }
            Ok(())
        });
        match evaluated {
            Ok(()) => stats.fdes += 1,
            Err(_) => {
                // A half-evaluated FDE's rows are dropped: its later rows might differ.
                spans.truncate(before);
                stats.corrupt_entries += 1;
            }
        }
        if stats.truncated {
            break;
        }
    }
}

/// Sorted, non-overlapping rows: earlier sections win over later ones at the same address (the
/// sort is stable), gaps between spans become NONE rows, and equal neighbours merge.
fn sweep(mut spans: Vec<Span>, stats: &mut BuildStats) -> Vec<UnwindRow> {
    spans.sort_by_key(Span::start);
    let mut rows: Vec<UnwindRow> = Vec::with_capacity(spans.len() + spans.len() / 4);
    let mut covered_until = 0u64;
    for span in spans {
        let start = span.start().max(covered_until);
        if start >= u64::from(span.end) {
            stats.overlapping += 1;
            continue;
        }
        if start > covered_until && !rows.is_empty() {
            push_merged(&mut rows, row_at(covered_until, UnwindRow::default()));
        }
        match span.row.kind {
            unwind_kind::UNSUPPORTED => stats.unsupported += 1,
            unwind_kind::END => stats.outermost += 1,
            _ => {}
        }
        push_merged(&mut rows, row_at(start, span.row));
        covered_until = u64::from(span.end);
    }
    if !rows.is_empty() {
        push_merged(&mut rows, row_at(covered_until, UnwindRow::default()));
    }
    rows
}

/// A rule placed at a file offset already known to fit in 32 bits.
fn row_at(pc: u64, rule: UnwindRow) -> UnwindRow {
    UnwindRow { pc: u32::try_from(pc).unwrap_or(u32::MAX), ..rule }
}

/// Appends `row` unless the previous row already says the same thing; a row at the same address
/// as the previous one replaces it.
fn push_merged(rows: &mut Vec<UnwindRow>, row: UnwindRow) {
    let same_rule =
        |a: &UnwindRow, b: &UnwindRow| (a.kind, a.cfa_offset, a.rbp) == (b.kind, b.cfa_offset, b.rbp);
    if let Some(last) = rows.last() {
        if last.pc == row.pc {
            rows.pop();
        }
    }
    match rows.last() {
        Some(last) if same_rule(last, &row) => {}
        _ => rows.push(row),
    }
}

/// Test helper: evaluates every row of every .eh_frame FDE with gimli again and checks that the
/// table gives the same rule at the row's first and last byte. Returns the addresses checked.
#[cfg(test)]
pub(super) fn check_against_gimli(data: &[u8], table: &super::index::UnwindTable) -> Result<usize> {
    let file = ElfFile64::<Endianness>::parse(data)?;
    let arch = Arch::of(file.architecture()).context("no architecture the builder reads")?;
    let placement = Placement { segments: code_segments(&file), file_len: data.len() as u64 };
    let section = file.section_by_name(".eh_frame").context("no .eh_frame")?;
    let mut eh_frame = EhFrame::new(section.data()?, LittleEndian);
    eh_frame.set_address_size(8);
    eh_frame.set_vendor(if arch == Arch::Aarch64 { Vendor::AArch64 } else { Vendor::Default });
    let bases = eh_frame_bases(&file, section.address());
    let mut spans = Vec::new();
    let mut stats = BuildStats::default();
    collect_spans(arch, &eh_frame, &bases, &placement, &mut spans, &mut stats);
    let mut checked = 0;
    for span in spans {
        for pc in [span.start(), u64::from(span.end) - 1] {
            let found = table.lookup(pc).unwrap_or_default();
            let same = (found.kind, found.cfa_offset, found.rbp)
                == (span.row.kind, span.row.cfa_offset, span.row.rbp);
            anyhow::ensure!(same, "at {pc:#x}: table {found:?}, gimli {:?}", span.row);
            checked += 1;
        }
    }
    Ok(checked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merging_keeps_one_row_per_change_and_the_latest_at_one_address() {
        let rsp = |pc, cfa_offset| UnwindRow { pc, cfa_offset, kind: unwind_kind::CFA_RSP, rbp: 0 };
        let mut rows = Vec::new();
        for row in [rsp(0, 8), rsp(4, 8), rsp(8, 16), rsp(8, 24), rsp(12, 8)] {
            push_merged(&mut rows, row);
        }
        assert_eq!(rows, vec![rsp(0, 8), rsp(8, 24), rsp(12, 8)]);
    }

    #[test]
    fn gaps_become_none_rows_and_duplicates_are_dropped() {
        let rule = UnwindRow { kind: unwind_kind::CFA_RSP, cfa_offset: 8, ..UnwindRow::default() };
        let spans = vec![
            Span { row: UnwindRow { pc: 0x100, ..rule }, end: 0x110 },
            Span { row: UnwindRow { pc: 0x200, ..rule }, end: 0x210 },
            Span { row: UnwindRow { pc: 0x100, cfa_offset: 16, ..rule }, end: 0x110 },
        ];
        let mut stats = BuildStats::default();
        let rows = sweep(spans, &mut stats);
        let none = |pc| UnwindRow { pc, ..UnwindRow::default() };
        assert_eq!(
            rows,
            vec![UnwindRow { pc: 0x100, ..rule }, none(0x110), UnwindRow { pc: 0x200, ..rule }, none(0x210)]
        );
        assert_eq!(stats.overlapping, 1);
    }
}
