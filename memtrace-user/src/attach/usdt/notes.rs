//! Probe sites from an ELF file's `.note.stapsdt` section, as <sys/sdt.h> writes them: each note
//! (owner "stapsdt", type 3) holds the site's address, the address of `_.stapsdt.base` at link time,
//! the semaphore's address (0 for none), then provider, name and argument specs as C strings.

use anyhow::{bail, Context, Result};
use object::{
    elf, read::elf::ProgramHeader as _, Architecture, Endianness, Object, ObjectSection, ObjectSymbol,
};

const NOTE_SECTION: &str = ".note.stapsdt";
const BASE_SECTION: &str = ".stapsdt.base";
const NOTE_OWNER: &[u8] = b"stapsdt";
const NOTE_TYPE: u32 = 3;

/// One note as written, before any address is adjusted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawNote {
    pub address: u64,
    pub base: u64,
    pub semaphore: u64,
    pub provider: String,
    pub name: String,
    pub arguments: String,
}

/// A probe site located in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeSite {
    pub provider: String,
    pub name: String,
    /// The argument specs as written, separated by spaces.
    pub arguments: String,
    /// Link-time address of the site (after the .stapsdt.base adjustment).
    pub address: u64,
    /// File offset of the site: where the uprobe goes.
    pub offset: u64,
    /// File offset of the semaphore, which the kernel raises while the probe is attached.
    pub semaphore_offset: Option<u64>,
}

impl ProbeSite {
    pub fn full_name(&self) -> String {
        format!("{}:{}", self.provider, self.name)
    }
}

/// The probe sites of an ELF file and the link-time addresses of its symbols (for argument specs
/// that name a global variable).
pub struct ElfProbes {
    pub sites: Vec<ProbeSite>,
    symbols: Vec<(String, u64)>,
}

impl ElfProbes {
    pub fn symbol_address(&self, name: &str) -> Option<u64> {
        self.symbols.iter().find(|(symbol, _)| symbol == name).map(|&(_, address)| address)
    }
}

/// Whether the file at `path` may have probe sites: false for a file that cannot be read, that is
/// not ELF or that has no `.note.stapsdt` section. Reads only the headers, not the whole file.
pub fn may_have_probes(path: &std::path::Path) -> bool {
    let Ok(file) = std::fs::File::open(path) else {
        return false;
    };
    let cache = object::read::ReadCache::new(file);
    object::File::parse(&cache).is_ok_and(|parsed| parsed.section_by_name(NOTE_SECTION).is_some())
}

/// Parses the probe sites of an ELF file of memtrace's own architecture (x86-64, arm64); an ELF file
/// without notes has none.
pub fn parse_elf(data: &[u8]) -> Result<ElfProbes> {
    let file = object::File::parse(data).context("not an ELF file")?;
    let object::File::Elf64(elf_file) = &file else {
        bail!("only 64-bit ELF files are supported");
    };
    let own = if cfg!(target_arch = "aarch64") { Architecture::Aarch64 } else { Architecture::X86_64 };
    if file.architecture() != own {
        bail!("this memtrace reads {own:?} files (this one is for {:?})", file.architecture());
    }
    let Some(section) = file.section_by_name(NOTE_SECTION) else {
        return Ok(ElfProbes { sites: Vec::new(), symbols: Vec::new() });
    };
    let notes = parse_notes(section.data().context("reading .note.stapsdt")?);
    let base_section = file.section_by_name(BASE_SECTION).map(|s| s.address());
    let endian: Endianness = elf_file.endian();
    let segments = Segments(
        elf_file
            .elf_program_headers()
            .iter()
            .filter(|ph| ph.p_type(endian) == elf::PT_LOAD)
            .map(|ph| {
                (
                    ph.p_vaddr(endian),
                    ph.p_memsz(endian),
                    ph.p_offset(endian),
                    ph.p_flags(endian) & elf::PF_X != 0,
                )
            })
            .collect(),
    );
    let sites = notes.into_iter().map(|note| segments.site_of(note, base_section)).collect::<Result<_>>()?;
    let symbols = file
        .symbols()
        .chain(file.dynamic_symbols())
        .filter(|symbol| symbol.is_definition())
        .filter_map(|symbol| Some((symbol.name().ok()?.to_owned(), symbol.address())))
        .collect();
    Ok(ElfProbes { sites, symbols })
}

/// (virtual address, memory size, file offset, executable) of each PT_LOAD.
struct Segments(Vec<(u64, u64, u64, bool)>);

impl Segments {
    /// The file offset of `address`, in an executable segment if `executable`.
    fn to_offset(&self, address: u64, executable: bool) -> Option<u64> {
        self.0
            .iter()
            .find(|&&(vaddr, size, _, x)| (!executable || x) && address >= vaddr && address - vaddr < size)
            .map(|&(vaddr, _, offset, _)| address - vaddr + offset)
    }

    /// Locates a note's probe (and its semaphore) in the file; `base_section` is where
    /// `.stapsdt.base` lies now.
    fn site_of(&self, note: RawNote, base_section: Option<u64>) -> Result<ProbeSite> {
        // Prelinking or a moved section shifts everything by the same amount as _.stapsdt.base.
        let shift = match base_section {
            Some(actual) if note.base != 0 => actual.wrapping_sub(note.base),
            _ => 0,
        };
        let address = note.address.wrapping_add(shift);
        let Some(offset) = self.to_offset(address, true) else {
            bail!("probe {}:{} at {address:#x} lies in no executable segment", note.provider, note.name);
        };
        let semaphore_offset = match note.semaphore {
            0 => None,
            semaphore => {
                let semaphore = semaphore.wrapping_add(shift);
                Some(self.to_offset(semaphore, false).with_context(|| {
                    format!(
                        "the semaphore of probe {}:{} at {semaphore:#x} lies in no segment",
                        note.provider, note.name
                    )
                })?)
            }
        };
        Ok(ProbeSite {
            provider: note.provider,
            name: note.name,
            arguments: note.arguments,
            address,
            offset,
            semaphore_offset,
        })
    }
}

/// Every stapsdt note in a `.note.stapsdt` section's bytes (little-endian). Malformed notes are
/// skipped; a truncated section ends the list. Never panics, whatever the bytes.
pub fn parse_notes(section: &[u8]) -> Vec<RawNote> {
    let mut notes = Vec::new();
    let mut rest = section;
    while rest.len() >= 12 {
        let name_size = u32_at(rest, 0) as usize;
        let desc_size = u32_at(rest, 4) as usize;
        let kind = u32_at(rest, 8);
        let Some(name_end) = 12usize.checked_add(name_size) else {
            break;
        };
        let Some(desc_start) = align4(name_end) else {
            break;
        };
        let Some(desc_end) = desc_start.checked_add(desc_size) else {
            break;
        };
        if desc_end > rest.len() {
            break;
        }
        let owner = &rest[12..name_end];
        let owner = owner.strip_suffix(b"\0").unwrap_or(owner);
        if owner == NOTE_OWNER && kind == NOTE_TYPE {
            if let Some(note) = parse_desc(&rest[desc_start..desc_end]) {
                notes.push(note);
            }
        }
        let next = align4(desc_end).unwrap_or(usize::MAX).min(rest.len());
        rest = &rest[next..];
    }
    notes
}

fn align4(n: usize) -> Option<usize> {
    n.checked_add(3).map(|n| n & !3)
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(word)
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    let word: [u8; 8] = bytes.get(at..at.checked_add(8)?)?.try_into().ok()?;
    Some(u64::from_le_bytes(word))
}

fn parse_desc(desc: &[u8]) -> Option<RawNote> {
    let address = u64_at(desc, 0)?;
    let base = u64_at(desc, 8)?;
    let semaphore = u64_at(desc, 16)?;
    let mut strings = desc.get(24..)?.split(|&b| b == 0);
    let provider = String::from_utf8_lossy(strings.next()?).into_owned();
    let name = String::from_utf8_lossy(strings.next()?).into_owned();
    let arguments = strings.next().map(|args| String::from_utf8_lossy(args).into_owned()).unwrap_or_default();
    if provider.is_empty() || name.is_empty() {
        return None;
    }
    Some(RawNote { address, base, semaphore, provider, name, arguments })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A note as <sys/sdt.h> lays it out.
    pub(crate) fn note(address: u64, base: u64, semaphore: u64, strings: &[&str]) -> Vec<u8> {
        let mut desc = Vec::new();
        desc.extend(address.to_le_bytes());
        desc.extend(base.to_le_bytes());
        desc.extend(semaphore.to_le_bytes());
        for s in strings {
            desc.extend(s.as_bytes());
            desc.push(0);
        }
        let mut bytes = Vec::new();
        bytes.extend(8u32.to_le_bytes());
        bytes.extend((desc.len() as u32).to_le_bytes());
        bytes.extend(3u32.to_le_bytes());
        bytes.extend(b"stapsdt\0");
        bytes.extend(&desc);
        while bytes.len() % 4 != 0 {
            bytes.push(0);
        }
        bytes
    }

    #[test]
    fn notes_are_read_in_order() {
        let mut section = note(0x1139, 0x2004, 0x4010, &["memtrace", "report_total", "8@%rdi -8@%rsi"]);
        section.extend(note(0x1150, 0x2004, 0, &["app", "tick", ""]));
        section.extend(note(0x1160, 0, 0, &["app", "noargs"]));
        let notes = parse_notes(&section);
        assert_eq!(notes.len(), 3);
        assert_eq!(notes[0].provider, "memtrace");
        assert_eq!(notes[0].name, "report_total");
        assert_eq!(notes[0].arguments, "8@%rdi -8@%rsi");
        assert_eq!((notes[0].address, notes[0].base, notes[0].semaphore), (0x1139, 0x2004, 0x4010));
        assert_eq!(notes[1].arguments, "");
        assert_eq!(notes[2].name, "noargs");
    }

    #[test]
    fn other_owners_and_truncation_are_skipped() {
        let mut section = note(1, 2, 3, &["a", "b", ""]);
        section[12..19].copy_from_slice(b"GNU\0\0\0\0");
        section.extend(note(4, 5, 6, &["c", "d", ""]));
        let whole = parse_notes(&section);
        assert_eq!(whole.len(), 1);
        assert_eq!(whole[0].provider, "c");
        for cut in 0..section.len() {
            assert!(parse_notes(&section[..cut]).len() <= 1);
        }
        assert!(parse_notes(&[0xff; 64]).is_empty());
    }

    #[test]
    fn garbage_files_are_errors() {
        assert!(parse_elf(b"not an elf").is_err());
        assert!(parse_elf(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0]).is_err());
    }

    #[test]
    fn an_object_without_notes_has_no_sites() {
        let exe = std::fs::read("/proc/self/exe").unwrap();
        let probes = parse_elf(&exe).unwrap();
        assert!(probes.sites.iter().all(|s| s.provider != "memtrace"));
    }
}
