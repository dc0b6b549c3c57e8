//! Turns captured stacks into the model's frames, named by function. The kernel resolves most
//! frames to (build ID, file offset) while the process is alive, so a process that has exited is
//! still symbolized: its files are found by build ID among the objects the traced processes mapped.
//! Frames with only an address are placed through the process's last known mappings. A frame in a
//! known file without a symbol is kept as module+offset; a frame in no file ends the stack (it
//! would be a guess).

use std::{
    cell::RefCell,
    collections::HashMap,
    path::{Path, PathBuf},
    sync::Arc,
};

use blazesym::symbolize::{
    source::{Elf, Source},
    Input, Symbolized, Symbolizer,
};
use memtrace_common::{StackFrame, FRAME_BUILD_ID, FRAME_IP};

use crate::{
    model::frame::Frame,
    process::procfs::Mapping,
    process::{FileCache, FileId, ObjectFile},
};

pub struct StackSymbolizer {
    symbolizer: Symbolizer,
    /// Build ID (zero-padded to 20 bytes as the kernel reports it) -> where to read the file.
    build_ids: HashMap<[u8; 20], Readable>,
    /// Every file indexed, by identity: each is read once however many processes map it.
    indexed: HashMap<FileId, Option<[u8; 20]>>,
    facts: FileCache,
    /// Per file, the public name of each exported function address (see `public_name`).
    public_names: RefCell<HashMap<PathBuf, HashMap<u64, String>>>,
    /// Every frame symbolized so far, by file and offset: stacks share most of their frames, and
    /// a run may have hundreds of thousands of stacks.
    resolved: RefCell<HashMap<PathBuf, HashMap<u64, Arc<Frame>>>>,
}

impl Default for StackSymbolizer {
    fn default() -> Self {
        Self {
            // Frames are named by function, file and line; blazesym's inlined-function chains,
            // which it otherwise parses out of every file's DWARF and keeps, are not used.
            symbolizer: Symbolizer::builder().enable_inlined_fns(false).build(),
            build_ids: HashMap::new(),
            indexed: HashMap::new(),
            facts: FileCache::default(),
            public_names: RefCell::default(),
            resolved: RefCell::default(),
        }
    }
}

/// Where an indexed file can be read at the end of the run.
struct Readable {
    path: PathBuf,
    /// The file as the process names it (a container's libc by its path in the container, not
    /// by the descriptor it is read through): frames without a symbol are `module+offset` of it.
    module: PathBuf,
    /// A frame at an offset beyond the file is not in it.
    len: u64,
    /// A file memtrace's own file system does not have at that path (a container's, a deleted
    /// one) stays open, and is read through its descriptor.
    _open: Option<ObjectFile>,
}

impl StackSymbolizer {
    /// Remembers the build ID of an object file a traced process maps, and where to read it once
    /// the process is gone.
    pub fn index(&mut self, object: &ObjectFile) {
        if self.indexed.contains_key(&object.id) {
            return;
        }
        let build_id = self.facts.facts(object).build_id;
        self.indexed.insert(object.id, build_id);
        let Some(build_id) = build_id else { return };
        self.build_ids.entry(build_id).or_insert_with(|| match object.stable_path() {
            Some(path) => Readable { module: path.clone(), path, len: object.len, _open: None },
            None => Readable {
                path: object.host_path.clone(),
                module: object.path.clone(),
                len: object.len,
                _open: Some(object.clone()),
            },
        });
    }

    /// Resolves the frames of a stack, innermost first. A frame that lies in none of the
    /// process's files (what a frame-pointer walk reads out of a frame without one) ends the
    /// stack; only the allocator's caller is kept as a bare address (JIT code, say).
    pub fn resolve(&self, stack: &[StackFrame], mappings: &[Mapping]) -> Vec<Arc<Frame>> {
        stack
            .iter()
            .enumerate()
            .map_while(|(index, frame)| match frame.status {
                FRAME_BUILD_ID => self.resolve_build_id(&frame.build_id, frame.offset_or_ip),
                FRAME_IP => self.resolve_address(frame.offset_or_ip, mappings, index == 0),
                _ => None,
            })
            .collect()
    }

    fn resolve_build_id(&self, build_id: &[u8; 20], offset: u64) -> Option<Arc<Frame>> {
        match self.build_ids.get(build_id) {
            Some(readable) if offset >= readable.len => None,
            Some(readable) => Some(self.symbolize(&readable.path, &readable.module, offset)),
            None => {
                let hex: String = build_id.iter().map(|b| format!("{b:02x}")).collect();
                Some(Arc::new(unresolved(format!("[build-id {}]", hex.trim_end_matches('0')), offset)))
            }
        }
    }

    fn resolve_address(&self, address: u64, mappings: &[Mapping], innermost: bool) -> Option<Arc<Frame>> {
        match mappings.iter().find(|m| (m.start..m.end).contains(&address)) {
            Some(mapping) => {
                let offset = address - mapping.start + mapping.file_offset;
                Some(self.symbolize(&mapping.path, &mapping.path, offset))
            }
            None => innermost.then(|| Arc::new(unresolved("[unknown]".to_owned(), address))),
        }
    }

    /// The frame at `offset` of the file read at `path` (named `module`), symbolized once and
    /// shared after that.
    fn symbolize(&self, path: &Path, module: &Path, offset: u64) -> Arc<Frame> {
        if let Some(frame) = self.resolved.borrow().get(path).and_then(|frames| frames.get(&offset)) {
            return Arc::clone(frame);
        }
        let frame = Arc::new(self.symbolize_once(path, module, offset));
        self.resolved.borrow_mut().entry(path.to_owned()).or_default().insert(offset, frame.clone());
        frame
    }

    fn symbolize_once(&self, path: &Path, module: &Path, offset: u64) -> Frame {
        // Frames are return addresses; the call instruction ends just before.
        let lookup = offset.saturating_sub(1);
        let mut frame = unresolved(module.display().to_string(), offset);
        let with_debug = Source::Elf(Elf::new(path));
        // Without debug information blazesym's DWARF resolver finds nothing, nor falls back on
        // .dynsym: a stripped library's exported functions are named from its ELF symbols alone.
        let symbols_only = Source::Elf(Elf { debug_syms: false, ..Elf::new(path) });
        let symbolized = [with_debug, symbols_only].into_iter().find_map(|source| {
            match self.symbolizer.symbolize_single(&source, Input::FileOffset(lookup)) {
                Ok(Symbolized::Sym(sym)) => Some(sym),
                _ => None,
            }
        });
        if let Some(sym) = symbolized {
            let public = self.public_name(path, sym.addr, &sym.name);
            frame.function = Some(public.unwrap_or_else(|| sym.name.into_owned()));
            if let Some(code) = sym.code_info {
                frame.file = Some(code.file.to_string_lossy().into_owned());
                frame.line = code.line;
            }
        }
        frame
    }
}

impl StackSymbolizer {
    /// glibc exports a function under several names at one address (`strdup`, a weak alias of
    /// `__strdup`), and blazesym may give either: a reserved name (leading underscore) becomes
    /// the exported name at the same address with the fewest leading underscores, from .dynsym.
    fn public_name(&self, path: &Path, address: u64, name: &str) -> Option<String> {
        if !name.starts_with('_') {
            return None;
        }
        let mut cache = self.public_names.borrow_mut();
        let names = cache.entry(path.to_owned()).or_insert_with(|| exported_names(path));
        names.get(&address).filter(|public| underscores(public) < underscores(name)).cloned()
    }
}

fn underscores(name: &str) -> usize {
    name.len() - name.trim_start_matches('_').len()
}

/// The defined functions of a file's .dynsym, the least reserved name per address. Only the
/// headers and the dynamic symbol and string tables are read (librustc_driver is 150 MB).
fn exported_names(path: &Path) -> HashMap<u64, String> {
    use object::{Object, ObjectSymbol, SymbolKind};
    let mut names: HashMap<u64, String> = HashMap::new();
    let Ok(data) = std::fs::File::open(path).map(object::ReadCache::new) else { return names };
    let Ok(file) = object::File::parse(&data) else { return names };
    for symbol in file.dynamic_symbols().filter(|s| s.is_definition() && s.kind() == SymbolKind::Text) {
        let Ok(name) = symbol.name() else { continue };
        let entry = names.entry(symbol.address()).or_insert_with(|| name.to_owned());
        if underscores(name) < underscores(entry) {
            *entry = name.to_owned();
        }
    }
    names
}

fn unresolved(module: String, offset: u64) -> Frame {
    Frame { function: None, file: None, line: None, module, offset, interpreter: None }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memtrace_common::{FRAME_EMPTY, STACK_DEPTH};

    const EMPTY: StackFrame = StackFrame { status: FRAME_EMPTY, build_id: [0; 20], offset_or_ip: 0 };

    #[test]
    fn frames_in_no_file_end_the_stack_but_the_allocators_caller() {
        let mut stack = [EMPTY; STACK_DEPTH];
        let address = |ip| StackFrame { status: FRAME_IP, build_id: [0; 20], offset_or_ip: ip };
        // JIT code, say: the allocator's caller is kept whatever maps it.
        stack[0] = address(0x7fff_0000);
        // A file memtrace never found: kept as build ID and offset, for later symbolization.
        stack[1] = StackFrame { status: FRAME_BUILD_ID, build_id: [0xab; 20], offset_or_ip: 0x1234 };
        // In no mapping: a guess, which ends the stack.
        stack[2] = address(0x7fff_1000);
        stack[3] = address(0x7fff_2000);
        let frames = StackSymbolizer::default().resolve(&stack, &[]);
        assert_eq!(frames.len(), 2, "{frames:?}");
        assert_eq!(frames[0].name(), "[unknown]+0x7fff0000");
        assert_eq!(frames[1].name(), format!("[build-id {}]+0x1234", "ab".repeat(20)));
    }

    #[test]
    fn own_functions_resolve_by_build_id() {
        let exe = std::env::current_exe().unwrap();
        let mut symbolizer = StackSymbolizer::default();
        let object = ObjectFile::open_host(&exe).unwrap();
        symbolizer.index(&object);
        let build_id = symbolizer.indexed[&object.id].expect("rustc links test binaries with a build ID");
        // Find this function's file offset through our own mappings.
        let address = own_functions_resolve_by_build_id as fn() as usize as u64;
        let mappings = crate::process::procfs::mappings(std::process::id()).unwrap();
        let mapping = mappings.iter().find(|m| (m.start..m.end).contains(&address)).unwrap();
        let offset = address - mapping.start + mapping.file_offset;
        let frame =
            symbolizer.resolve_build_id(&build_id, offset + 1).expect("the offset is inside the file");
        assert!(frame.name().contains("own_functions_resolve_by_build_id"), "{frame:?}");
        // An offset beyond the file is no frame of it.
        assert_eq!(symbolizer.resolve_build_id(&build_id, object.len), None);
    }

    #[test]
    fn exported_functions_of_a_stripped_library_are_named_from_dynsym() {
        // Debian's libc has no .symtab; strdup is in .dynsym.
        let libc = Path::new("/usr/lib/x86_64-linux-gnu/libc.so.6");
        let symbolizer = StackSymbolizer::default();
        let offset = strdup_offset(libc);
        let frame = symbolizer.symbolize(libc, libc, offset + 8);
        assert_eq!(frame.function.as_deref(), Some("strdup"), "the exported name, not __strdup: {frame:?}");
    }

    /// strdup's file offset in `library`, from its .dynsym.
    fn strdup_offset(library: &Path) -> u64 {
        use object::{Object, ObjectSymbol};
        let data = std::fs::read(library).unwrap();
        let file = object::File::parse(&*data).unwrap();
        let symbol = file.dynamic_symbols().find(|s| s.name() == Ok("strdup")).unwrap();
        // Debian's libc maps its text at equal offsets and addresses.
        symbol.address()
    }
}
