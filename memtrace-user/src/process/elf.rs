//! What memtrace reads from ELF files: defined function symbols, their file offsets, the dynamic
//! section's dependencies and the build ID. The files are the target's, so hostile: everything is
//! read through `object`'s bounds-checked readers, from a whole file in memory (tests, fuzzing) or
//! from a sparse image of it (crate::process::SparseImage) that holds only the headers and the
//! sections these questions need, with the code bytes an answer needs read on demand.

use anyhow::{bail, Result};
use object::{
    elf,
    read::elf::{Dyn as _, ElfFile64, FileHeader as _, ProgramHeader as _},
    Endianness, FileKind, Object, ObjectSymbol,
};

/// Reads `len` bytes at a file offset, for data a sparse image does not hold (code).
pub type CodeReader<'data> = &'data (dyn Fn(u64, usize) -> Vec<u8> + 'data);

/// A parsed 64-bit ELF file.
pub struct ElfObject<'data> {
    file: ElfFile64<'data, Endianness>,
    data: &'data [u8],
    code: Option<CodeReader<'data>>,
}

/// A function an object defines, as its symbol gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DefinedFunction {
    pub name: String,
    pub address: u64,
    /// Bytes of code, as the symbol says (0 where it does not).
    pub size: u64,
}

/// DT_NEEDED, DT_SONAME, DT_RPATH and DT_RUNPATH of a dynamic object.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DynamicInfo {
    pub needed: Vec<String>,
    pub soname: Option<String>,
    pub rpath: Vec<String>,
    pub runpath: Vec<String>,
}

impl<'data> ElfObject<'data> {
    pub fn parse(data: &'data [u8]) -> Result<Self> {
        if !matches!(FileKind::parse(data), Ok(FileKind::Elf64)) {
            bail!("not a 64-bit ELF file");
        }
        Ok(Self { file: ElfFile64::parse(data)?, data, code: None })
    }

    /// The machine the file's code is for.
    pub fn architecture(&self) -> object::Architecture {
        self.file.architecture()
    }

    /// Code bytes are read with `code` instead of from the parsed data (a sparse image).
    pub fn with_code_reader(mut self, code: CodeReader<'data>) -> Self {
        self.code = Some(code);
        self
    }

    /// Up to `len` bytes of the file from `offset` (fewer at the end of the file).
    pub fn code_bytes(&self, offset: u64, len: usize) -> Vec<u8> {
        if let Some(read) = self.code {
            return read(offset, len);
        }
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(self.data.len());
        self.data[start..][..len.min(self.data.len() - start)].to_vec()
    }

    /// Address of a function this object defines, from .dynsym or .symtab.
    #[cfg(test)]
    pub fn defined_function(&self, name: &str) -> Option<u64> {
        self.defined_functions(|n| n == name.as_bytes()).into_iter().next().map(|function| function.address)
    }

    /// Every function this object defines whose name `wanted` accepts, with its address: the first
    /// definition of each name, .dynsym before .symtab, in one pass over the symbols.
    pub fn defined_functions(&self, wanted: impl Fn(&[u8]) -> bool) -> Vec<DefinedFunction> {
        let mut found: Vec<DefinedFunction> = Vec::new();
        for symbol in self.file.dynamic_symbols().chain(self.file.symbols()) {
            if !symbol.is_definition() || symbol.kind() != object::SymbolKind::Text {
                continue;
            }
            let Ok(name) = symbol.name_bytes() else { continue };
            if wanted(name) && !found.iter().any(|known| known.name.as_bytes() == name) {
                found.push(DefinedFunction {
                    name: String::from_utf8_lossy(name).into_owned(),
                    address: symbol.address(),
                    size: symbol.size(),
                });
            }
        }
        found
    }

    /// A function's code, as far as its symbol says it reaches, and at least as far as a probe's
    /// placement walks (fewer bytes at the end of the segment).
    pub fn function_code(&self, function: &DefinedFunction) -> Vec<u8> {
        let len = usize::try_from(function.size).unwrap_or(0).max(crate::process::probe_point::WALK_BYTES);
        self.code_file_offset(function.address).map(|offset| self.code_bytes(offset, len)).unwrap_or_default()
    }

    /// The address of a data object this object defines in .dynsym (`_PyRuntime`, say).
    pub fn defined_data(&self, name: &str) -> Option<u64> {
        self.file
            .dynamic_symbols()
            .find(|symbol| {
                symbol.is_definition()
                    && symbol.kind() == object::SymbolKind::Data
                    && symbol.name_bytes().is_ok_and(|n| n == name.as_bytes())
            })
            .map(|symbol| symbol.address())
    }

    /// Each PT_LOAD segment: (file offset, virtual address, bytes in the file).
    pub fn load_segments(&self) -> Vec<(u64, u64, u64)> {
        let endian = self.file.endian();
        self.file
            .elf_program_headers()
            .iter()
            .filter(|ph| ph.p_type(endian) == elf::PT_LOAD)
            .map(|ph| (ph.p_offset(endian), ph.p_vaddr(endian), ph.p_filesz(endian)))
            .collect()
    }

    /// `len` bytes of the file at a virtual address its segments hold (fewer past their end).
    pub fn bytes_at(&self, address: u64, len: usize) -> Option<Vec<u8>> {
        let (offset, vaddr, _) = self
            .load_segments()
            .into_iter()
            .find(|&(_, vaddr, size)| (vaddr..vaddr.saturating_add(size)).contains(&address))?;
        Some(self.code_bytes(offset + (address - vaddr), len))
    }

    /// The contents of the section named `name`, if the file has one.
    pub fn section_data(&self, name: &str) -> Option<&'data [u8]> {
        use object::ObjectSection as _;
        self.file.section_by_name(name)?.data().ok()
    }

    /// The GNU build ID, zero-padded to 20 bytes as the kernel reports it in stacks.
    pub fn build_id(&self) -> Option<[u8; 20]> {
        let id = self.file.build_id().ok()??;
        let mut padded = [0u8; 20];
        let len = id.len().min(20);
        padded[..len].copy_from_slice(&id[..len]);
        Some(padded)
    }

    /// The file offset of a virtual address in an executable PT_LOAD segment.
    pub fn code_file_offset(&self, address: u64) -> Option<u64> {
        self.code_segment(address).map(|(start, _)| address - start.0 + start.1)
    }

    /// The executable PT_LOAD segment holding a virtual address: ((vaddr, file offset) of its
    /// start, its length).
    fn code_segment(&self, address: u64) -> Option<((u64, u64), u64)> {
        let endian = self.file.endian();
        self.file
            .elf_program_headers()
            .iter()
            .filter(|ph| ph.p_type(endian) == elf::PT_LOAD && ph.p_flags(endian) & elf::PF_X != 0)
            .map(|ph| ((ph.p_vaddr(endian), ph.p_offset(endian)), ph.p_memsz(endian)))
            .find(|&((vaddr, _), size)| (vaddr..vaddr.saturating_add(size)).contains(&address))
    }

    /// How far the executable segment holding `address` reaches before it and after it (bytes).
    pub fn code_around(&self, address: u64) -> Option<(u64, u64)> {
        let ((start, _), size) = self.code_segment(address)?;
        Some((address - start, start + size - address))
    }

    pub fn dynamic_info(&self) -> Result<DynamicInfo> {
        let endian = self.file.endian();
        let sections = self.file.elf_header().sections(endian, self.data)?;
        let mut info = DynamicInfo::default();
        let Some((entries, strings_index)) = sections.dynamic(endian, self.data)? else {
            return Ok(info);
        };
        let strings = sections.strings(endian, self.data, strings_index)?;
        for entry in entries {
            let Ok(text) = u32::try_from(entry.d_val(endian)).map_err(drop).and_then(|at| strings.get(at))
            else {
                continue;
            };
            let text = String::from_utf8_lossy(text).into_owned();
            match entry.tag32(endian) {
                Some(elf::DT_NEEDED) => info.needed.push(text),
                Some(elf::DT_SONAME) => info.soname = Some(text),
                Some(elf::DT_RPATH) => info.rpath.extend(search_list(&text)),
                Some(elf::DT_RUNPATH) => info.runpath.extend(search_list(&text)),
                _ => {}
            }
        }
        Ok(info)
    }
}

fn search_list(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(':').filter(|dir| !dir.is_empty()).map(str::to_owned)
}

/// Where a file's address 0 lies in a process that maps it at `start` from file offset
/// `file_offset` (one of its mappings), given its PT_LOAD segments (`ElfObject::load_segments`):
/// 0 for a non-PIE executable; None where no segment holds the offset.
pub fn load_bias(segments: &[(u64, u64, u64)], start: u64, file_offset: u64) -> Option<u64> {
    let &(offset, vaddr, _) = segments
        .iter()
        .find(|&&(offset, _, size)| (offset..offset.saturating_add(size.max(1))).contains(&file_offset))?;
    Some(start.wrapping_sub(vaddr.wrapping_add(file_offset - offset)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_executable_needs_libc() {
        let data = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let object = ElfObject::parse(&data).unwrap();
        let info = object.dynamic_info().unwrap();
        assert!(info.needed.iter().any(|n| n.starts_with("libc.so")), "{info:?}");
        let main = object.defined_function("main").expect("test binaries keep .symtab");
        assert!(object.code_file_offset(main).is_some());
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(ElfObject::parse(b"not an ELF file").is_err());
        assert!(ElfObject::parse(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0]).is_err());
    }
}
