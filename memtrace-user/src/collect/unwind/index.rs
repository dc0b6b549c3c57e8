//! The two-level index over a file's unwind rows (by page, then a short sorted run) and its lookup:
//! the userspace reference of what the BPF unwinder does per frame. The layout and the algorithm are
//! specified on `memtrace_common::UnwindTableInfo`. memtrace builds the index; the lookup is the
//! tests' and the reference unwinder's (the kernel runs it in memtrace-ebpf/src/stacks.rs).

#[cfg(test)]
use memtrace_common::{unwind_kind, UNWIND_SEARCH_STEPS};
use memtrace_common::{
    UnwindRow, UnwindTableInfo, UNWIND_MAX_PAGE_SHIFT, UNWIND_MAX_RUN, UNWIND_MIN_PAGE_SHIFT,
};

/// One file's unwind table, ready to copy into the BPF maps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UnwindTable {
    pub info: UnwindTableInfo,
    /// `info.page_count + 1` row indices (empty when there are no rows).
    pub pages: Vec<u32>,
    pub rows: Vec<UnwindRow>,
}

impl UnwindTable {
    /// Indexes rows as `build_rows` returns them (sorted by `pc`, merged, ending with a NONE row).
    /// Chooses the largest page size whose runs all fit in `UNWIND_MAX_RUN` rows; the smallest
    /// always does (see the assertion next to `UNWIND_MAX_RUN`).
    pub fn new(mut rows: Vec<UnwindRow>) -> Self {
        let Some(first) = rows.first().copied() else {
            return Self::default();
        };
        // Every page's run must start with a row at or before the page's start: the first row is
        // put at the start of a page of the largest size, which starts a page of any size.
        let page_base = first.pc >> UNWIND_MAX_PAGE_SHIFT << UNWIND_MAX_PAGE_SHIFT;
        if first.pc != page_base {
            rows.insert(0, UnwindRow { pc: page_base, ..UnwindRow::default() });
        }
        let shift = (UNWIND_MIN_PAGE_SHIFT..=UNWIND_MAX_PAGE_SHIFT)
            .rev()
            .find(|&shift| longest_run(&rows, shift) <= UNWIND_MAX_RUN as usize)
            .unwrap_or(UNWIND_MIN_PAGE_SHIFT);
        let pages = page_index(&rows, shift);
        let info = UnwindTableInfo {
            first_page: page_base >> shift,
            page_count: u32::try_from(pages.len() - 1).unwrap_or(u32::MAX),
            row_count: u32::try_from(rows.len()).unwrap_or(u32::MAX),
            page_shift: shift,
            ..UnwindTableInfo::default()
        };
        Self { info, pages, rows }
    }

    /// Bytes the table takes in the BPF maps (rows and pages; the info entry aside).
    #[cfg(test)]
    pub fn size_bytes(&self) -> usize {
        self.rows.len() * std::mem::size_of::<UnwindRow>() + self.pages.len() * std::mem::size_of::<u32>()
    }

    /// The row covering file offset `pc`, exactly as specified on `UnwindTableInfo` (bounded steps,
    /// every index checked: a corrupt table gives no row, never a panic). The tests' and the
    /// reference unwinder's: the kernel runs the same search in memtrace-ebpf.
    #[cfg(test)]
    pub fn lookup(&self, pc: u64) -> Option<UnwindRow> {
        lookup(&self.info, &self.pages, &self.rows, pc)
    }
}

/// The lookup the BPF side implements, over the same arrays it reads from maps.
#[cfg(test)]
pub fn lookup(info: &UnwindTableInfo, pages: &[u32], rows: &[UnwindRow], pc: u64) -> Option<UnwindRow> {
    let page = pc >> (info.page_shift & 31);
    let index = page.checked_sub(u64::from(info.first_page))?;
    if index >= u64::from(info.page_count) {
        return None;
    }
    let index = usize::try_from(index).ok()?;
    let mut lo = *pages.get(index)? as usize;
    let mut hi = *pages.get(index + 1)? as usize + 1;
    for _ in 0..UNWIND_SEARCH_STEPS {
        if hi - lo <= 1 {
            break;
        }
        let mid = lo + (hi - lo) / 2;
        if u64::from(rows.get(mid)?.pc) <= pc {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let row = *rows.get(lo)?;
    (row.kind != unwind_kind::NONE).then_some(row)
}

/// `pages[i]`: the index of the last row with `pc <= (first_page + i) << shift`, for every page
/// from the first row's to the last row's, plus one more entry closing the last run.
fn page_index(rows: &[UnwindRow], shift: u8) -> Vec<u32> {
    let (Some(first), Some(last)) = (rows.first(), rows.last()) else {
        return Vec::new();
    };
    let first_page = u64::from(first.pc >> shift);
    let last_page = u64::from(last.pc >> shift);
    let mut pages = Vec::with_capacity((last_page - first_page + 2) as usize);
    let mut row = 0usize;
    for page in first_page..=last_page + 1 {
        let base = page << shift;
        while row + 1 < rows.len() && u64::from(rows[row + 1].pc) <= base {
            row += 1;
        }
        pages.push(row as u32);
    }
    pages
}

/// The longest run (`pages[i + 1] - pages[i] + 1`) the rows give at a page size.
fn longest_run(rows: &[UnwindRow], shift: u8) -> usize {
    let pages = page_index(rows, shift);
    pages.windows(2).map(|pair| (pair[1] - pair[0]) as usize + 1).max().unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(pc: u32, kind: u8, cfa_offset: u16) -> UnwindRow {
        UnwindRow { pc, cfa_offset, kind, rbp: 0 }
    }

    /// The lookup by brute force: the last row at or before `pc`.
    fn linear(rows: &[UnwindRow], pc: u64) -> Option<UnwindRow> {
        rows.iter().rev().find(|r| u64::from(r.pc) <= pc).copied().filter(|r| r.kind != unwind_kind::NONE)
    }

    #[test]
    fn lookup_agrees_with_a_linear_scan_around_every_row() {
        // Dense rows at the start (forcing a small page), sparse ones later, gaps between.
        let mut rows = Vec::new();
        for i in 0..40u32 {
            rows.push(row(0x1003 + i * 3, unwind_kind::CFA_RSP, 8 + (i as u16 % 5) * 8));
        }
        rows.push(row(0x1200, unwind_kind::NONE, 0));
        rows.push(row(0x5000, unwind_kind::CFA_RBP, 16));
        rows.push(row(0x9ff0, unwind_kind::NONE, 0));
        let table = UnwindTable::new(rows.clone());
        let run = |i: usize| table.pages[i + 1] - table.pages[i] + 1;
        assert!((0..table.info.page_count as usize).all(|i| run(i) <= UNWIND_MAX_RUN));
        for pc in (0..0xa100u64).filter(|pc| rows.iter().any(|r| (u64::from(r.pc)).abs_diff(*pc) < 40)) {
            assert_eq!(table.lookup(pc), linear(&rows, pc), "pc {pc:#x} in {table:?}");
        }
        assert_eq!(table.lookup(u64::MAX), None);
    }

    #[test]
    fn one_row_per_byte_still_fits_a_small_page() {
        // Denser than any compiler's output: the table must still be indexed within the bound.
        let rows: Vec<_> = (0..300u32)
            .map(|i| row(0x2000 + i, unwind_kind::CFA_RSP, 8 * (1 + i as u16 % 2)))
            .chain([row(0x2000 + 300, unwind_kind::NONE, 0)])
            .collect();
        let table = UnwindTable::new(rows.clone());
        // 32-byte pages: 33 rows per run at most; 64-byte pages would need 65.
        assert_eq!(table.info.page_shift, 5);
        let run = |i: usize| table.pages[i + 1] - table.pages[i] + 1;
        assert!((0..table.info.page_count as usize).all(|i| run(i) <= UNWIND_MAX_RUN));
        for pc in 0x1ff0..0x2200u64 {
            assert_eq!(table.lookup(pc), linear(&rows, pc), "pc {pc:#x}");
        }
    }

    #[test]
    fn empty_table_finds_nothing() {
        let table = UnwindTable::new(Vec::new());
        assert_eq!(table.lookup(0), None);
        assert_eq!(table.size_bytes(), 0);
    }
}
