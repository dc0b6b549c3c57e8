//! Property tests over mutated real ELF files (/bin/true and the C library): the readers of a
//! target's object files (ELF header and sections, dynamic section, symbols, build ID, allocator
//! entry points, USDT notes) never panic whatever the bytes, read whole or as a sparse image
//! (SparseImage, whose section ranges come from the mutated headers). Mutations
//! land mostly where the parsers look (the headers at the start, the section headers at the end),
//! and files are cut short at random.

use std::{io, path::Path, sync::OnceLock};

use proptest::prelude::*;

use super::{entry_points::resolve_entry_points, sparse::SparseImage};
use crate::process::elf::ElfObject;

fn real_file(path: &str) -> &'static [u8] {
    static TRUE: OnceLock<Vec<u8>> = OnceLock::new();
    static LIBC: OnceLock<Vec<u8>> = OnceLock::new();
    let cell = if path.contains("libc") { &LIBC } else { &TRUE };
    cell.get_or_init(|| std::fs::read(Path::new(path)).unwrap())
}

const LIBC: &str = "/usr/lib/x86_64-linux-gnu/libc.so.6";

/// A copy of `original` with each (where, value) written: `where` picks the head or the tail of
/// the file (where the ELF, program and section headers are) or anywhere; `cut` may shorten it.
fn mutate(original: &[u8], mutations: &[(u8, u32, u8)], cut: Option<u32>) -> Vec<u8> {
    let mut bytes = original.to_vec();
    let len = bytes.len();
    for &(region, at, value) in mutations {
        let at = at as usize;
        let index = match region % 3 {
            0 => at % len.min(4096),
            1 => len - 1 - at % len.min(16384),
            _ => at % len,
        };
        bytes[index] = value;
    }
    if let Some(cut) = cut {
        bytes.truncate(cut as usize % (len + 1));
    }
    bytes
}

/// Everything memtrace asks of an object file, which must answer or fail, never panic.
fn read_everything(elf: &ElfObject<'_>) {
    let _ = elf.dynamic_info();
    let _ = elf.build_id();
    for prefix in ["", "je_"] {
        if let Ok(entry_points) = resolve_entry_points(elf, prefix) {
            for entry in entry_points {
                assert!(entry.probe.delta < crate::process::probe_point::WALK_BYTES as u64);
            }
        }
    }
    if let Some(address) = elf.defined_function("malloc") {
        let _ = elf.code_file_offset(address);
    }
}

/// A sparse image of `bytes`, read as from a file of that size.
fn sparse(bytes: &[u8]) -> anyhow::Result<SparseImage<'_>> {
    SparseImage::load(
        bytes.len() as u64,
        &[super::sparse::FACTS, super::sparse::SYMBOLS].concat(),
        move |buf, offset| {
            let start = usize::try_from(offset).map_err(|_| io::ErrorKind::UnexpectedEof)?;
            let source = bytes.get(start..start + buf.len()).ok_or(io::ErrorKind::UnexpectedEof)?;
            buf.copy_from_slice(source);
            Ok(())
        },
    )
}

fn check(bytes: &[u8]) {
    if let Ok(elf) = ElfObject::parse(bytes) {
        read_everything(&elf);
    }
    if let Ok(image) = sparse(bytes) {
        let _ = image.with_elf(|elf| {
            read_everything(elf);
            Ok(())
        });
    }
    let _ = crate::attach::usdt::notes::parse_elf(bytes);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

    #[test]
    fn mutated_bin_true_never_panics(
        mutations in proptest::collection::vec((any::<u8>(), any::<u32>(), any::<u8>()), 1..24),
        cut in proptest::option::weighted(0.2, any::<u32>()),
    ) {
        check(&mutate(real_file("/bin/true"), &mutations, cut));
    }
}

proptest! {
    // libc is 2 MB: fewer cases, each reads far more.
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn mutated_libc_never_panics(
        mutations in proptest::collection::vec((any::<u8>(), any::<u32>(), any::<u8>()), 1..24),
        cut in proptest::option::weighted(0.2, any::<u32>()),
    ) {
        check(&mutate(real_file(LIBC), &mutations, cut));
    }
}

#[test]
fn unmutated_files_read_fully() {
    let libc = real_file(LIBC);
    let elf = ElfObject::parse(libc).unwrap();
    assert!(elf.build_id().is_some());
    assert!(!resolve_entry_points(&elf, "").unwrap().is_empty());
    let expected = resolve_entry_points(&elf, "").unwrap();
    let image = sparse(libc).unwrap();
    image
        .with_elf(|sparse| {
            assert_eq!(sparse.build_id(), elf.build_id());
            assert_eq!(resolve_entry_points(sparse, "").unwrap(), expected);
            Ok(())
        })
        .unwrap();
}
