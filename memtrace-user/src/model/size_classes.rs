//! What an allocator really hands out for a request: the usable size of the block, by its size
//! classes. A block's `usable - requested` is the allocator's rounding, which counts toward what
//! the allocator reports as allocated (jemalloc's `allocator_allocated`, redis's `INFO memory`) but
//! not toward memtrace's live bytes, which are what the program asked for.
//!
//! Known where the classes follow from the allocator's build alone:
//! - glibc: a chunk is the request plus its 8-byte size field, rounded up to 16, at least 32;
//!   the block is the chunk less that field. From 128 KiB (glibc's default M_MMAP_THRESHOLD) a
//!   block is its own mapping, rounded up to the page, less a 16-byte header; the threshold
//!   grows as such blocks are freed, so a block between 128 KiB and 32 MiB may be either.
//! - jemalloc (5.x, 16-byte quantum): 8; then multiples of 16 to 128; then four classes between
//!   powers of two (160, 192, 224, 256, 320, ...), large sizes alike.
//!
//! tcmalloc's and mimalloc's classes are tables of their own builds: unknown here.

const GLIBC_SIZE_FIELD: u64 = 8;
const GLIBC_MIN_CHUNK: u64 = 32;
const GLIBC_MMAP_THRESHOLD: u64 = 128 * 1024;
const GLIBC_MMAP_HEADER: u64 = 16;
const PAGE: u64 = 4096;

/// The usable size of a block of `requested` bytes from the allocator of kind `kind`
/// (`Allocator::kind`), or None where its size classes are unknown.
pub fn usable_size(kind: &str, requested: u64) -> Option<u64> {
    match kind {
        "glibc" => Some(glibc(requested)),
        "jemalloc" | "jemalloc (Rust)" => Some(jemalloc(requested)),
        _ => None,
    }
}

fn glibc(requested: u64) -> u64 {
    if requested >= GLIBC_MMAP_THRESHOLD {
        return (requested + GLIBC_MMAP_HEADER).next_multiple_of(PAGE) - GLIBC_MMAP_HEADER;
    }
    let chunk = (requested + GLIBC_SIZE_FIELD).next_multiple_of(16).max(GLIBC_MIN_CHUNK);
    chunk - GLIBC_SIZE_FIELD
}

fn jemalloc(requested: u64) -> u64 {
    if requested <= 8 {
        return 8;
    }
    if requested <= 128 {
        return requested.next_multiple_of(16);
    }
    // Between 2^lg and 2^(lg+1), classes are 2^(lg-2) apart.
    let lg = 63 - u64::from((requested - 1).leading_zeros());
    requested.next_multiple_of(1 << (lg - 2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibc_blocks_are_their_chunk_less_its_size_field() {
        // malloc(1000): 1008-byte chunk, nothing lost; calloc(4, 64): 272-byte chunk, 8 lost.
        assert_eq!(usable_size("glibc", 1000), Some(1000));
        assert_eq!(usable_size("glibc", 256), Some(264));
        assert_eq!(usable_size("glibc", 1), Some(24));
        assert_eq!(usable_size("glibc", 24), Some(24));
        assert_eq!(usable_size("glibc", 25), Some(40));
        assert_eq!(usable_size("glibc", 200 * 1024), Some(200 * 1024 + 4096 - 16));
    }

    #[test]
    fn jemalloc_classes_are_four_to_a_doubling() {
        let classes: Vec<u64> = [1, 8, 9, 17, 128, 129, 200, 256, 257, 1000, 1025, 20_000]
            .into_iter()
            .map(|size| usable_size("jemalloc", size).unwrap())
            .collect();
        assert_eq!(classes, [8, 8, 16, 32, 128, 160, 224, 256, 320, 1024, 1280, 20_480]);
        assert_eq!(usable_size("tcmalloc", 100), None);
    }
}
