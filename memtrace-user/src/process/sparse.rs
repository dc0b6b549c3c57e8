//! A sparse image of an ELF file: an anonymous mapping the size of the file (untouched pages cost
//! no memory; a zeroed heap allocation would not do, as an allocator zeroes memory it reuses) into which only the headers and the sections memtrace parses are read: symbol and
//! string tables, the dynamic section, notes, hash and version tables. The code and data of a
//! 200 MB library (libLLVM, librustc_driver) are never read, and no per-string read happens while
//! symbols are scanned. Code bytes an answer needs (an allocator's first instruction) are read on
//! demand. Unlike a memory mapping, nothing here faults if the file shrinks while it is read.

use std::io;

use anyhow::{anyhow, bail, Result};
use object::{
    elf,
    read::elf::{FileHeader as _, ProgramHeader as _, SectionHeader as _},
    Endianness,
};

use super::file::{ObjectFile, MAX_OBJECT_BYTES};
use crate::process::elf::ElfObject;

type FileHeader = elf::FileHeader64<Endianness>;

/// The sections each reader needs (with the string tables they link to).
pub const FACTS: &[u32] = &[elf::SHT_DYNAMIC, elf::SHT_NOTE];
pub const SYMBOLS: &[u32] = &[
    elf::SHT_DYNSYM,
    elf::SHT_SYMTAB,
    elf::SHT_HASH,
    elf::SHT_GNU_HASH,
    elf::SHT_GNU_VERSYM,
    elf::SHT_GNU_VERDEF,
    elf::SHT_GNU_VERNEED,
];
pub const NOTES: &[u32] = &[elf::SHT_NOTE];

/// Reads exactly `buf.len()` bytes at a file offset.
type ReadAt<'a> = Box<dyn Fn(&mut [u8], u64) -> io::Result<()> + 'a>;

pub struct SparseImage<'a> {
    data: memmap2::MmapMut,
    read_at: ReadAt<'a>,
}

impl<'a> SparseImage<'a> {
    /// The headers and the sections of the `types` given (FACTS, SYMBOLS, NOTES) of an object file.
    pub fn of(object: &'a ObjectFile, types: &[u32]) -> Result<Self> {
        Self::load(object.len, types, move |buf, offset| object.read_exact_at(buf, offset))
    }

    /// Reads the headers of a file of `len` bytes and its sections of the `types` given (and its
    /// dynamic and note segments, and the string tables they link to), with `read_at`.
    ///
    /// .symtab is read only for a program (ET_EXEC, or with PT_INTERP) or an object without
    /// .dynsym: the dynamic linker resolves a library's symbols through .dynsym alone, and the
    /// .symtab of a 150 MB library is 20 MB that no answer needs.
    pub fn load(
        len: u64,
        types: &[u32],
        read_at: impl Fn(&mut [u8], u64) -> io::Result<()> + 'a,
    ) -> Result<Self> {
        if len > MAX_OBJECT_BYTES {
            bail!("larger than {MAX_OBJECT_BYTES} bytes");
        }
        if len == 0 {
            bail!("an empty file");
        }
        // Fresh zero pages from the kernel: only what is read below is touched.
        let data = memmap2::MmapOptions::new().len(len as usize).map_anon()?;
        let mut image = Self { data, read_at: Box::new(read_at) };
        image.fill(0, size_of::<FileHeader>() as u64)?;
        let header = *FileHeader::parse(&*image.data).map_err(|_| anyhow!("not a 64-bit ELF file"))?;
        let endian = header.endian()?;
        let phdrs = u64::from(header.e_phnum(endian)) * u64::from(header.e_phentsize(endian));
        image.fill(header.e_phoff(endian), phdrs)?;
        let shentsize = u64::from(header.e_shentsize(endian));
        // e_shnum 0 means the count is in the first section header.
        image.fill(header.e_shoff(endian), u64::from(header.e_shnum(endian)).max(1) * shentsize)?;
        let shnum = header.shnum(endian, &*image.data)?;
        image.fill(header.e_shoff(endian), u64::try_from(shnum)?.saturating_mul(shentsize))?;
        let mut ranges = Vec::new();
        let segments = header.program_headers(endian, &*image.data).unwrap_or_default();
        for segment in segments {
            if matches!(segment.p_type(endian), elf::PT_DYNAMIC | elf::PT_NOTE) {
                ranges.push((segment.p_offset(endian), segment.p_filesz(endian)));
            }
        }
        let is_program = header.e_type(endian) == elf::ET_EXEC
            || segments.iter().any(|segment| segment.p_type(endian) == elf::PT_INTERP);
        if let Ok(sections) = header.section_headers(endian, &*image.data) {
            let has_dynsym = sections.iter().any(|s| s.sh_type(endian) == elf::SHT_DYNSYM);
            let wanted =
                |kind: u32| types.contains(&kind) && (kind != elf::SHT_SYMTAB || is_program || !has_dynsym);
            // Section names live in the string table e_shstrndx names.
            let mut indexes = vec![header.shstrndx(endian, &*image.data).unwrap_or(0) as usize];
            for (index, section) in sections.iter().enumerate().filter(|(_, s)| wanted(s.sh_type(endian))) {
                indexes.push(index);
                indexes.push(section.sh_link(endian) as usize);
            }
            for section in indexes.into_iter().filter_map(|index| sections.get(index)) {
                ranges.push((section.sh_offset(endian), section.sh_size(endian)));
            }
        }
        for (offset, size) in ranges {
            image.fill(offset, size)?;
        }
        Ok(image)
    }

    /// Reads `[offset, offset + size)`, cut to the file, into the image.
    fn fill(&mut self, offset: u64, size: u64) -> Result<()> {
        let len = self.data.len() as u64;
        let start = offset.min(len);
        let end = offset.saturating_add(size).min(len);
        if start < end {
            (self.read_at)(&mut self.data[start as usize..end as usize], start)?;
        }
        Ok(())
    }

    /// Bytes read afresh from the file, for parts the image does not hold.
    fn read_fresh(&self, offset: u64, len: usize) -> Vec<u8> {
        let len = (self.data.len() as u64).saturating_sub(offset).min(len as u64) as usize;
        let mut bytes = vec![0u8; len];
        match (self.read_at)(&mut bytes, offset) {
            Ok(()) => bytes,
            Err(_) => Vec::new(),
        }
    }

    /// Parses the image; `run` gets an ElfObject that reads code bytes from the file.
    /// The image's bytes (zero where nothing was read), for parsers of their own (USDT notes).
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    pub fn with_elf<T>(&self, run: impl FnOnce(&ElfObject<'_>) -> Result<T>) -> Result<T> {
        let code = |offset: u64, len: usize| self.read_fresh(offset, len);
        let elf = ElfObject::parse(&self.data)?.with_code_reader(&code);
        run(&elf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_image_answers_as_the_whole_file_does() {
        let path = "/usr/lib/x86_64-linux-gnu/libc.so.6";
        let whole = std::fs::read(path).unwrap();
        let object = ObjectFile::open_host(std::path::Path::new(path)).unwrap();
        let sparse = SparseImage::of(&object, &[FACTS, SYMBOLS].concat()).unwrap();
        let elf = ElfObject::parse(&whole).unwrap();
        let expected = (
            elf.dynamic_info().unwrap(),
            elf.build_id(),
            crate::process::entry_points::resolve_entry_points(&elf, "").unwrap(),
        );
        let got = sparse
            .with_elf(|elf| {
                Ok((
                    elf.dynamic_info()?,
                    elf.build_id(),
                    crate::process::entry_points::resolve_entry_points(elf, "")?,
                ))
            })
            .unwrap();
        assert_eq!(got, expected);
        // Most of the file is never read.
        let touched = sparse.data().iter().filter(|&&b| b != 0).count();
        assert!(touched < whole.len() / 4, "{touched} of {} bytes", whole.len());
    }
}
