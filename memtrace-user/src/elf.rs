//! What memtrace reads from ELF files: defined function symbols, their file offsets, and the
//! dynamic section's dependencies.

use anyhow::{bail, Result};
use object::{
    elf,
    read::elf::{Dyn as _, ElfFile64, FileHeader as _, ProgramHeader as _},
    Endianness, Object, ObjectSymbol,
};

/// A parsed 64-bit ELF file.
pub struct ElfObject<'data> {
    file: ElfFile64<'data, Endianness>,
    data: &'data [u8],
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
        match object::File::parse(data)? {
            object::File::Elf64(file) => Ok(Self { file, data }),
            _ => bail!("not a 64-bit ELF file"),
        }
    }

    pub fn data(&self) -> &'data [u8] {
        self.data
    }

    /// Address of a function this object defines, from .dynsym or .symtab.
    pub fn defined_function(&self, name: &str) -> Option<u64> {
        self.file
            .dynamic_symbols()
            .chain(self.file.symbols())
            .find(|symbol| {
                symbol.is_definition()
                    && symbol.kind() == object::SymbolKind::Text
                    && symbol.name_bytes().is_ok_and(|n| n == name.as_bytes())
            })
            .map(|symbol| symbol.address())
    }

    /// The file offset of a virtual address in an executable PT_LOAD segment.
    pub fn code_file_offset(&self, address: u64) -> Option<u64> {
        let endian = self.file.endian();
        self.file
            .elf_program_headers()
            .iter()
            .filter(|ph| ph.p_type(endian) == elf::PT_LOAD && ph.p_flags(endian) & elf::PF_X != 0)
            .map(|ph| (ph.p_vaddr(endian), ph.p_memsz(endian), ph.p_offset(endian)))
            .find(|&(vaddr, size, _)| (vaddr..vaddr.saturating_add(size)).contains(&address))
            .map(|(vaddr, _, offset)| address - vaddr + offset)
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
            let Ok(text) = entry.string(endian, strings) else {
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
