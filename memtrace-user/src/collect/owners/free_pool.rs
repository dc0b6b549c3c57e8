//! The allocator's free pool, measured: the gaps between live blocks in the allocator's mappings,
//! by power-of-two size class, and the whole resident pages inside them. A resident page that no
//! live block touches is one malloc_trim(0) (or jemalloc's purge) could give back; the sum over
//! every gap is `allocator_free_resident_bytes`, so the classes add up to it by construction.
//! It takes every live block of the process, so it is only measured for a process whose every
//! block the probes saw (collect/owners/mod.rs decides).

use std::collections::BTreeMap;

use crate::model::levels::FreeClass;

/// A gap smaller than this is padding between blocks, not free memory: glibc's smallest free
/// chunk (MINSIZE) is 32 bytes on 64-bit.
const MIN_GAP: u64 = 32;

/// One live block: its address and requested size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct LiveBlock {
    pub address: u64,
    pub size: u64,
}

/// Whether each page of a range is resident, lowest first.
pub trait ResidentPages {
    fn page_size(&self) -> u64;
    fn present(&self, start: u64, end: u64) -> Vec<bool>;
}

impl ResidentPages for crate::process::pagemap::Pagemap {
    fn page_size(&self) -> u64 {
        self.page_size()
    }

    fn present(&self, start: u64, end: u64) -> Vec<bool> {
        self.present(start, end)
    }
}

/// The free pool of the allocator ranges `ranges` (page-aligned, lowest first) around `blocks`
/// (sorted by address), each block taking `header` bytes before it (glibc's chunk header).
/// Returns the resident free bytes and the pool by size class.
pub fn measure(
    ranges: &[(u64, u64)],
    blocks: &[LiveBlock],
    header: u64,
    pages: &impl ResidentPages,
) -> (u64, Vec<FreeClass>) {
    let mut classes: BTreeMap<u64, FreeClass> = BTreeMap::new();
    let mut resident_total = 0;
    for &(start, end) in ranges {
        let range = ResidentRange::read(pages, start, end);
        let mut gap = |from: u64, to: u64| {
            if to.saturating_sub(from) < MIN_GAP {
                return;
            }
            let len = to - from;
            let min_bytes = 1 << (63 - len.leading_zeros());
            let class = classes.entry(min_bytes).or_insert(FreeClass { min_bytes, ..FreeClass::default() });
            let resident = range.whole_pages_resident(from, to);
            class.gaps += 1;
            class.bytes += len;
            class.resident_bytes += resident;
            resident_total += resident;
        };
        let mut cursor = start;
        let first = blocks.partition_point(|block| block.address + block.size <= start);
        for block in &blocks[first..] {
            let (taken_from, taken_to) = (block.address.saturating_sub(header), block.address + block.size);
            if taken_from >= end {
                break;
            }
            if taken_from > cursor {
                gap(cursor, taken_from);
            }
            cursor = cursor.max(taken_to);
        }
        if cursor < end {
            gap(cursor, end);
        }
    }
    (resident_total, classes.into_values().collect())
}

/// The resident pages of one range, counted so that any stretch of it is answered at once.
struct ResidentRange {
    start: u64,
    page: u64,
    /// before[i]: resident pages among the range's first i.
    before: Vec<u64>,
}

impl ResidentRange {
    fn read(pages: &impl ResidentPages, start: u64, end: u64) -> Self {
        let mut before = vec![0];
        let mut count = 0;
        for present in pages.present(start, end) {
            count += u64::from(present);
            before.push(count);
        }
        Self { start, page: pages.page_size(), before }
    }

    /// Resident bytes of the pages wholly inside [from, to).
    fn whole_pages_resident(&self, from: u64, to: u64) -> u64 {
        let first = (from - self.start).div_ceil(self.page) as usize;
        let last = ((to - self.start) / self.page) as usize;
        if first >= last || last >= self.before.len() {
            return 0;
        }
        (self.before[last] - self.before[first]) * self.page
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 4096;

    /// Pages resident where the list says so.
    struct Pages(Vec<bool>, u64);

    impl ResidentPages for Pages {
        fn page_size(&self) -> u64 {
            PAGE
        }

        fn present(&self, start: u64, end: u64) -> Vec<bool> {
            let first = ((start - self.1) / PAGE) as usize;
            self.0[first..first + ((end - start) / PAGE) as usize].to_vec()
        }
    }

    /// 16 pages, all resident: blocks of 4096 - 16 bytes (with glibc's 16-byte header, a page each)
    /// on pages 0, 1, 5 and 15. Gaps: pages 2-4 (3 pages, the 8 KiB class), 6-14 (9 pages, 32 KiB
    /// class): 12 pages free, as malloc_trim(0) would return them.
    #[test]
    fn the_gaps_between_live_blocks_by_size_class_with_their_resident_pages() {
        let base = 0x10_0000;
        let block = |page: u64| LiveBlock { address: base + page * PAGE + 16, size: PAGE - 16 };
        let blocks = [block(0), block(1), block(5), block(15)];
        let (resident, classes) =
            measure(&[(base, base + 16 * PAGE)], &blocks, 16, &Pages(vec![true; 16], base));
        assert_eq!(resident, 12 * PAGE);
        assert_eq!(classes.len(), 2);
        assert_eq!((classes[0].min_bytes, classes[0].gaps, classes[0].bytes), (8192, 1, 3 * PAGE));
        assert_eq!(
            (classes[1].min_bytes, classes[1].bytes, classes[1].resident_bytes),
            (32768, 9 * PAGE, 9 * PAGE)
        );
    }

    /// A gap counts only the pages it holds whole and resident; padding is no gap.
    #[test]
    fn partial_and_absent_pages_are_not_free_resident_memory() {
        let base = 0x10_0000;
        let mut present = vec![true; 4];
        present[2] = false;
        let blocks = [
            LiveBlock { address: base + 16, size: 100 },
            LiveBlock { address: base + 124, size: 100 }, // 8 bytes after the first: padding
            LiveBlock { address: base + 3 * PAGE + 100, size: 8 },
        ];
        let (resident, classes) = measure(&[(base, base + 4 * PAGE)], &blocks, 16, &Pages(present, base));
        // The gap from 224 to 3 pages + 84 holds pages 1 and 2 whole; page 2 is not resident.
        assert_eq!(resident, PAGE);
        assert!(classes.iter().all(|class| class.bytes >= MIN_GAP));
        let gaps: u64 = classes.iter().map(|class| class.gaps).sum();
        assert_eq!(gaps, 2, "the big gap and the tail after the last block");
    }
}
