//! Who owns each resident anonymous page of a process. Every mapping of /proc/PID/smaps gets its
//! owner from the first rule that speaks for it; its anonymous resident and swapped bytes go to
//! that owner, so the owners and dark memory add up to RssAnon + VmSwap by construction. The rules,
//! in order:
//!
//! 1. its name: `[heap]` is the allocator's, `[stack]` a stack; glibc 2.39+ names arenas
//!    (`[anon:glibc: malloc arena]`) and thread stacks (`[anon:glibc: pthread stack: TID]`); a
//!    private file mapping that is not executable holds its object's static data (its anonymous
//!    pages are the copies written to: .data, .got, relocated read-only data);
//! 2. the mappings the probes saw made (the kernel's REGIONS, for processes traced from their
//!    start): inside an allocator call the allocator's, MAP_STACK a stack, otherwise the program's;
//! 3. a glibc heap: 64 MiB-aligned (HEAP_MAX_SIZE), starting with a plausible `heap_info`
//!    (read from the process), reserved to its 64 MiB with PROT_NONE beyond what is open: the
//!    thread arenas, which glibc opens with mprotect and which the probes never see mapped;
//! 4. blocks glibc mapped for a large malloc, found from their chunk headers (prev_size 0, the
//!    IS_MMAPPED bit, a size of whole pages), for processes attached after they were made;
//! 5. a thread stack: read-write anonymous memory right above a small PROT_NONE guard;
//! 6. a .bss: anonymous memory right after its object's writable file mapping.
//!
//! A mapping the kernel merged from several (two adjacent anonymous mappings with one protection)
//! may have several owners: its pages are then counted per part in /proc/PID/pagemap.

use crate::{
    model::levels::ResidentOwners,
    process::{
        pagemap::Pagemap,
        remote::ReadWords,
        smaps::{Backing, Vma},
    },
};

/// Who a page belongs to; a page of no owner is dark memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    Allocator,
    Program,
    Stack,
    Static,
}

/// A mapping the probes saw made, and by whom.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeenMapping {
    pub start: u64,
    pub end: u64,
    pub owner: Owner,
}

/// A process's resident pages by owner, and where its allocator's memory lies.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Classified {
    /// `allocator_free` is left None: it takes the live blocks (free_pool.rs).
    pub owners: ResidentOwners,
    /// The allocator's accessible address ranges, lowest first: where its free pool lies.
    pub allocator_ranges: Vec<(u64, u64)>,
    /// glibc arenas: the main one (a `[heap]`) and one per thread arena's first heap.
    pub arenas: u32,
}

/// glibc's HEAP_MAX_SIZE on 64-bit: 2 * DEFAULT_MMAP_THRESHOLD_MAX (32 MiB).
const GLIBC_HEAP_MAX: u64 = 64 << 20;
/// glibc's IS_MMAPPED bit of a chunk's size field.
const IS_MMAPPED: u64 = 2;
/// The largest guard below a thread stack taken for one (glibc's default is a page).
const MAX_GUARD: u64 = 64 << 10;
/// At most this many chunk headers are read per mapping.
const MAX_CHUNKS: usize = 4096;

/// What a rule says of one mapping.
enum Claim {
    Whole(Owner),
    /// Disjoint parts, lowest first; the rest of the mapping is dark.
    Parts(Vec<(u64, u64, Owner)>),
    Unowned,
}

/// Classifies every mapping of `vmas` (lowest first). `seen` is sorted by start.
pub fn classify(
    vmas: &[Vma],
    seen: &[SeenMapping],
    memory: &impl ReadWords,
    pagemap: Option<&Pagemap>,
) -> Classified {
    let mut classified = Classified::default();
    for (index, vma) in vmas.iter().enumerate() {
        let previous = index.checked_sub(1).map(|before| &vmas[before]).filter(|p| p.end == vma.start);
        let claim = claim_of(vma, previous, seen, memory, &mut classified.arenas);
        classified.owners.anonymous += vma.anonymous_and_swap();
        classified.add(vma, claim, pagemap);
    }
    classified
}

fn claim_of(
    vma: &Vma,
    previous: Option<&Vma>,
    seen: &[SeenMapping],
    memory: &impl ReadWords,
    arenas: &mut u32,
) -> Claim {
    if let Some(owner) = by_name(vma) {
        *arenas += u32::from(vma.backing == Backing::Heap);
        return Claim::Whole(owner);
    }
    if !vma.is_plain_anonymous() || vma.is_reservation() {
        return Claim::Unowned;
    }
    // The kernel merges adjacent anonymous mappings of one protection: a thread stack with the
    // program's mapping above it, a heap with the stack below it. Each rule claims its part; what
    // none claims goes to the rule of the mapping's start (its guard, its object).
    let mut parts = seen_parts(vma, seen);
    for heap in glibc_heaps(vma, memory).collect::<Vec<_>>() {
        if !overlaps(&parts, heap.start, heap.end) {
            *arenas += u32::from(heap.first_of_arena);
            parts.push((heap.start, heap.end, Owner::Allocator));
        }
    }
    if parts.is_empty() {
        parts = glibc_mapped_chunks(vma, memory).into_iter().map(|(s, e)| (s, e, Owner::Allocator)).collect();
    }
    parts.sort_unstable_by_key(|part| part.0);
    if let Some(owner) = by_neighbour(previous) {
        parts = filled(parts, vma, owner);
    }
    match parts.is_empty() {
        true => Claim::Unowned,
        false => Claim::Parts(parts),
    }
}

/// Rules 5 and 6: the owner the mapping's lower neighbour gives it.
fn by_neighbour(previous: Option<&Vma>) -> Option<Owner> {
    match previous? {
        guard if guard.is_plain_anonymous() && guard.is_reservation() && guard.len() <= MAX_GUARD => {
            Some(Owner::Stack)
        }
        data if matches!(data.backing, Backing::File(_)) && data.private && data.writable => {
            Some(Owner::Static)
        }
        _ => None,
    }
}

fn overlaps(parts: &[(u64, u64, Owner)], start: u64, end: u64) -> bool {
    parts.iter().any(|&(s, e, _)| s < end && start < e)
}

/// `parts` (sorted, disjoint) with every stretch of `vma` they leave out given to `owner`.
fn filled(parts: Vec<(u64, u64, Owner)>, vma: &Vma, owner: Owner) -> Vec<(u64, u64, Owner)> {
    let mut whole = Vec::with_capacity(parts.len() * 2 + 1);
    let mut cursor = vma.start;
    for part in parts {
        if part.0 > cursor {
            whole.push((cursor, part.0, owner));
        }
        cursor = cursor.max(part.1);
        whole.push(part);
    }
    if cursor < vma.end {
        whole.push((cursor, vma.end, owner));
    }
    whole
}

/// Rule 1: what the mapping's name says.
fn by_name(vma: &Vma) -> Option<Owner> {
    match &vma.backing {
        Backing::Heap => Some(Owner::Allocator),
        Backing::MainStack => Some(Owner::Stack),
        Backing::Named(name) if name.starts_with("glibc: malloc") => Some(Owner::Allocator),
        Backing::Named(name) if name.contains("stack") => Some(Owner::Stack),
        // An executable mapping's copied pages are breakpoints (the probes') or patched code.
        Backing::File(_) if vma.private && !vma.executable => Some(Owner::Static),
        _ => None,
    }
}

/// Rule 2: the parts of the mapping the probes saw made.
fn seen_parts(vma: &Vma, seen: &[SeenMapping]) -> Vec<(u64, u64, Owner)> {
    let first = seen.partition_point(|mapping| mapping.end <= vma.start);
    seen[first..]
        .iter()
        .take_while(|mapping| mapping.start < vma.end)
        .map(|mapping| (mapping.start.max(vma.start), mapping.end.min(vma.end), mapping.owner))
        .filter(|(start, end, _)| start < end)
        .collect()
}

struct GlibcHeap {
    start: u64,
    /// The end of the part open for use (heap_info.mprotect_size from its start).
    end: u64,
    /// heap_info.prev is NULL: the arena's first heap, which holds the arena itself.
    first_of_arena: bool,
}

/// Rule 3: the glibc heaps inside a mapping, at each 64 MiB-aligned address in it whose first
/// words are a plausible `heap_info { ar_ptr, prev, size, mprotect_size, ... }`.
fn glibc_heaps<'a>(vma: &'a Vma, memory: &'a impl ReadWords) -> impl Iterator<Item = GlibcHeap> + 'a {
    let first = vma.start.next_multiple_of(GLIBC_HEAP_MAX);
    let starts = (first..vma.end).step_by(GLIBC_HEAP_MAX as usize);
    starts.filter(|_| vma.writable).filter_map(|start| glibc_heap_at(start, vma.end, memory))
}

fn glibc_heap_at(start: u64, limit: u64, memory: &impl ReadWords) -> Option<GlibcHeap> {
    let ar_ptr = memory.word(start)?;
    let prev = memory.word(start + 8)?;
    let size = memory.word(start + 16)?;
    let open = memory.word(start + 24)?;
    let plausible = ar_ptr != 0
        && 0 < size
        && size <= open
        && open <= GLIBC_HEAP_MAX.min(limit - start)
        && open.is_multiple_of(4096)
        && (prev == 0 || prev.is_multiple_of(GLIBC_HEAP_MAX));
    plausible.then_some(GlibcHeap { start, end: start + open, first_of_arena: prev == 0 })
}

/// Rule 4: the blocks glibc mapped for large allocations, one after another from the mapping's
/// start (the kernel merges adjacent ones); empty when the first header is not one.
fn glibc_mapped_chunks(vma: &Vma, memory: &impl ReadWords) -> Vec<(u64, u64)> {
    let mut chunks = Vec::new();
    let mut at = vma.start;
    while at < vma.end && chunks.len() < MAX_CHUNKS {
        let (Some(0), Some(size)) = (memory.word(at), memory.word(at + 8)) else { break };
        let len = size & !7;
        if size & IS_MMAPPED == 0 || len == 0 || !len.is_multiple_of(4096) || at + len > vma.end {
            break;
        }
        chunks.push((at, at + len));
        at += len;
    }
    chunks
}

impl Classified {
    /// Adds one mapping's anonymous bytes to its owners.
    fn add(&mut self, vma: &Vma, claim: Claim, pagemap: Option<&Pagemap>) {
        let parts = match claim {
            Claim::Unowned => return,
            Claim::Whole(owner) => vec![(vma.start, vma.end, owner)],
            Claim::Parts(parts) => parts,
        };
        if !vma.is_reservation() {
            for &(start, end, _) in parts.iter().filter(|part| part.2 == Owner::Allocator) {
                self.owners.allocator_accessible += end - start;
                match self.allocator_ranges.last_mut() {
                    Some(last) if last.1 == start => last.1 = end,
                    _ => self.allocator_ranges.push((start, end)),
                }
            }
        }
        let whole = parts.len() == 1 && (parts[0].0, parts[0].1) == (vma.start, vma.end);
        let mut left = vma.anonymous_and_swap();
        for (start, end, owner) in parts {
            let bytes = match (whole, pagemap) {
                (true, _) => left,
                // Each part's own pages, as pagemap shows them now: not held to smaps' total, read
                // a moment before, so that pages made resident in between (khugepaged collapsing a
                // thread stack's stretch into a huge page, on 6.1's TCG matrix VM) stay with their
                // part and are not taken from the parts after it.
                (false, Some(pagemap)) => {
                    let pages = pagemap.count(start, end);
                    (pages.present + pages.swapped) * pagemap.page_size()
                }
                // Without pagemap, a part's share of the mapping's pages is its share of its length.
                (false, None) => (vma.anonymous_and_swap() * (end - start) / vma.len().max(1)).min(left),
            };
            left = left.saturating_sub(bytes);
            *self.owner_mut(owner) += bytes;
        }
    }

    fn owner_mut(&mut self, owner: Owner) -> &mut u64 {
        match owner {
            Owner::Allocator => &mut self.owners.allocator,
            Owner::Program => &mut self.owners.program,
            Owner::Stack => &mut self.owners.stacks,
            Owner::Static => &mut self.owners.statics,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    const MIB: u64 = 1 << 20;
    const KIB: u64 = 1 << 10;

    struct Words(HashMap<u64, u64>);

    impl ReadWords for Words {
        fn word(&self, address: u64) -> Option<u64> {
            self.0.get(&address).copied()
        }
    }

    fn anonymous(start: u64, end: u64, resident: u64, perms: &str) -> Vma {
        Vma {
            start,
            end,
            readable: perms.starts_with('r'),
            writable: perms.as_bytes()[1] == b'w',
            executable: perms.as_bytes()[2] == b'x',
            private: true,
            backing: Backing::Anonymous,
            anonymous: resident,
            swap: 0,
        }
    }

    fn backed(start: u64, end: u64, resident: u64, perms: &str, backing: Backing) -> Vma {
        Vma { backing, ..anonymous(start, end, resident, perms) }
    }

    /// A process of one executable with a .bss, a brk heap, a thread arena (heap_info readable),
    /// a thread stack with its guard, a block glibc mapped before the attach, a mapping the program
    /// made (seen by the probes), JIT code and the main stack: every rule once.
    #[test]
    fn every_rule_gives_its_owner_and_what_is_left_is_dark() {
        let arena = 0x7f00_0000_0000; // 64 MiB-aligned
        let block = 0x7f10_0000_0000;
        let exe = Backing::File("/usr/bin/app".into());
        let vmas = vec![
            backed(0x5500_0000, 0x5500_1000, 0, "r-xp", exe.clone()),
            backed(0x5500_1000, 0x5500_2000, 4 * KIB, "rw-p", exe),
            anonymous(0x5500_2000, 0x5560_2000, 6 * MIB, "rw-p"), // .bss
            backed(0x5600_0000, 0x5640_0000, 3 * MIB, "rw-p", Backing::Heap),
            anonymous(arena, arena + 32 * MIB, 20 * MIB, "rw-p"),
            anonymous(arena + 32 * MIB, arena + 64 * MIB, 0, "---p"),
            anonymous(0x7f08_0000_0000, 0x7f08_0000_1000, 0, "---p"), // guard
            anonymous(0x7f08_0000_1000, 0x7f08_0080_0000, 64 * KIB, "rw-p"),
            anonymous(block, block + 2 * MIB, 2 * MIB, "rw-p"),
            anonymous(0x7f20_0000_0000, 0x7f20_0100_0000, 5 * MIB, "rw-p"), // the program's
            anonymous(0x7f30_0000_0000, 0x7f30_0001_0000, 64 * KIB, "rwxp"), // JIT
            backed(0x7ffc_0000_0000, 0x7ffc_0002_1000, 132 * KIB, "rw-p", Backing::MainStack),
        ];
        let words = Words(HashMap::from([
            (arena, arena + 48),
            (arena + 8, 0),
            (arena + 16, 30 * MIB),
            (arena + 24, 32 * MIB),
            (block, 0),
            (block + 8, (2 * MIB) | IS_MMAPPED),
        ]));
        let seen = [SeenMapping { start: 0x7f20_0000_0000, end: 0x7f20_0100_0000, owner: Owner::Program }];
        let classified = classify(&vmas, &seen, &words, None);
        let owners = classified.owners;
        assert_eq!(owners.allocator, 3 * MIB + 20 * MIB + 2 * MIB);
        assert_eq!(owners.allocator_accessible, 4 * MIB + 32 * MIB + 2 * MIB);
        assert_eq!(owners.program, 5 * MIB);
        assert_eq!(owners.stacks, 64 * KIB + 132 * KIB);
        assert_eq!(owners.statics, 4 * KIB + 6 * MIB);
        let total: u64 = vmas.iter().map(Vma::anonymous_and_swap).sum();
        assert_eq!(owners.anonymous, total);
        assert_eq!(total - owners.owned(), 64 * KIB, "the JIT code alone is dark");
        assert_eq!(classified.arenas, 2, "the main arena and one thread arena");
        assert_eq!(
            classified.allocator_ranges,
            [(0x5600_0000, 0x5640_0000), (arena, arena + 32 * MIB), (block, block + 2 * MIB)]
        );
    }

    /// The kernel merged a block the allocator mapped with one the program mapped: each part's
    /// pages go to its maker (here, without pagemap, by length).
    #[test]
    fn a_merged_mapping_is_shared_by_its_parts() {
        let vmas = [anonymous(0x1000_0000, 0x1040_0000, 4 * MIB, "rw-p")];
        let seen = [
            SeenMapping { start: 0x1000_0000, end: 0x1010_0000, owner: Owner::Allocator },
            SeenMapping { start: 0x1010_0000, end: 0x1040_0000, owner: Owner::Program },
        ];
        let classified = classify(&vmas, &seen, &Words(HashMap::new()), None);
        assert_eq!((classified.owners.allocator, classified.owners.program), (MIB, 3 * MIB));
    }

    /// An aligned mapping whose first words are no heap_info is no arena.
    #[test]
    fn an_aligned_mapping_without_a_heap_header_is_not_an_arena() {
        let start = 0x7f00_0000_0000;
        let vmas = [anonymous(start, start + MIB, MIB, "rw-p")];
        let words = Words(HashMap::from([(start, 7), (start + 8, 3), (start + 16, 1), (start + 24, 5)]));
        let classified = classify(&vmas, &[], &words, None);
        assert_eq!(classified.owners.owned(), 0);
        assert_eq!(classified.arenas, 0);
    }

    /// A thread stack the kernel merged with a thread arena's heap above it (6.1 places them so):
    /// the heap is found at its aligned start inside the mapping, the rest is the stack its guard
    /// says it is.
    #[test]
    fn a_heap_merged_with_a_stack_below_it_is_split_at_the_heap() {
        let heap = 0x7f00_0000_0000;
        let vmas = [
            anonymous(heap - 0x80_1000, heap - 0x80_0000, 0, "---p"),
            anonymous(heap - 0x80_0000, heap + 16 * MIB, 16 * MIB + 64 * KIB, "rw-p"),
            anonymous(heap + 16 * MIB, heap + 64 * MIB, 0, "---p"),
        ];
        let words = Words(HashMap::from([
            (heap, heap + 48),
            (heap + 8, 0),
            (heap + 16, 15 * MIB),
            (heap + 24, 16 * MIB),
        ]));
        let pagemap = None;
        let classified = classify(&vmas, &[], &words, pagemap);
        // Without pagemap, by length: 16 MiB of 24 MiB are the heap's, 8 MiB the stack's.
        let resident = 16 * MIB + 64 * KIB;
        assert_eq!(classified.owners.allocator, resident * 2 / 3);
        assert_eq!(classified.owners.stacks, resident / 3);
        assert_eq!(classified.arenas, 1);
        assert_eq!(classified.allocator_ranges, [(heap, heap + 16 * MIB)]);
    }

    /// A mapping the kernel merged from two (a thread stack below, the program's mapping above)
    /// whose pages grew between smaps and pagemap (khugepaged made the stack's stretch a huge
    /// page): each part keeps the pages pagemap shows it, and the part after the one that grew
    /// loses none of its own. Pages of this test's own mapping, 2 touched below and 3 above.
    #[test]
    fn a_part_keeps_its_pages_when_an_earlier_part_grew_after_smaps_was_read() {
        let page = crate::process::procfs::page_size();
        let len = 8 * page as usize;
        // SAFETY: a fresh private anonymous mapping of our own, unmapped below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        for touched in [0, 1, 4, 5, 6] {
            // SAFETY: each page lies inside the mapping made above.
            unsafe { *(base as *mut u8).add(touched * page as usize) = 1 };
        }
        let Some(pagemap) = Pagemap::open(std::process::id(), page) else { return };
        let (start, middle, end) = (base as u64, base as u64 + 4 * page, base as u64 + len as u64);
        // smaps, read before the stack's second page came in, said 4 pages.
        let vmas = vec![anonymous(start, end, 4 * page, "rw-p")];
        let seen = [
            SeenMapping { start, end: middle, owner: Owner::Stack },
            SeenMapping { start: middle, end, owner: Owner::Program },
        ];
        let classified = classify(&vmas, &seen, &Words(HashMap::new()), Some(&pagemap));
        assert_eq!((classified.owners.stacks, classified.owners.program), (2 * page, 3 * page));
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(base, len) };
    }
}
