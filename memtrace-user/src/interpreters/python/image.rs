//! Which object files are a CPython interpreter whose frames the kernel side can read, and where
//! in a process that maps one its runtime state lies: from what the interpreter exports
//! (`_PyRuntime`, and `Py_Version`, which says the version), no debug symbols. 3.11's struct layout
//! is known here, from its headers; 3.13 describes itself (`_Py_DebugOffsets`, at the start of
//! `_PyRuntime`); an interpreter of another version is named (`PythonImage::version`) but not read.

use memtrace_common::{PythonLayout, PythonProcess, PYTHON_FRAME_WORDS};

use crate::process::elf::{load_bias, ElfObject};

/// A CPython interpreter's file, as its symbols describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PythonImage {
    /// (major, minor), from `Py_Version` (PY_VERSION_HEX).
    pub version: (u8, u8),
    /// The virtual address of `_PyRuntime` in the file.
    runtime: u64,
    /// Where the version keeps what the kernel reads; None for one memtrace cannot read.
    layout: Option<PythonLayout>,
    /// The file's PT_LOAD segments: (file offset, virtual address, bytes in the file).
    segments: Vec<(u64, u64, u64)>,
}

impl PythonImage {
    /// The interpreter `elf` is, if it exports CPython's runtime state and version.
    pub fn of(elf: &ElfObject<'_>) -> Option<Self> {
        let runtime = elf.defined_data("_PyRuntime")?;
        let version = elf.bytes_at(elf.defined_data("Py_Version")?, 4)?;
        let hex = u32::from_le_bytes(version.try_into().ok()?);
        let version = ((hex >> 24) as u8, (hex >> 16) as u8);
        let layout = match version {
            (3, 11) => Some(LAYOUT_3_11),
            // _PyRuntime starts with the interpreter's description of itself.
            (3, 13) => elf
                .bytes_at(runtime, DEBUG_OFFSETS_3_13_SIZE)
                .and_then(|bytes| from_debug_offsets(&bytes, hex)),
            _ => None,
        };
        Some(Self { version, runtime, layout, segments: elf.load_segments() })
    }

    /// Whether memtrace reads this version's frames.
    #[cfg(test)]
    pub fn readable(&self) -> bool {
        self.layout.is_some()
    }

    /// What the kernel side reads in a process that maps this file at `start` from file offset
    /// `file_offset` (one of its mappings); None for a version whose layout memtrace lacks.
    pub fn in_process(&self, start: u64, file_offset: u64) -> Option<PythonProcess> {
        let layout = self.layout?;
        let bias = load_bias(&self.segments, start, file_offset)?;
        Some(PythonProcess { runtime: bias.wrapping_add(self.runtime), layout })
    }
}

/// CPython 3.11's layout: Include/internal/pycore_runtime.h, pycore_frame.h, cpython/pystate.h,
/// cpython/code.h and cpython/unicodeobject.h (offsetof, as compiled for x86-64 by Debian's own
/// python3.11-dev headers).
const LAYOUT_3_11: PythonLayout = PythonLayout {
    thread_list: 0,
    // gilstate (568) . tstate_current (8). On arm64 592, as compiled against Debian 12's arm64
    // libpython3.11-dev headers: glibc's pthread_mutex_t is 48 bytes there, not 40, and the runtime
    // state holds locks before gilstate. Every other offset here is the same on both.
    runtime_tstate_current: if cfg!(target_arch = "aarch64") { 592 } else { 576 },
    runtime_interpreters_head: 0,
    interp_threads_head: 0,
    tstate_next: 0,
    tstate_current_frame: 0,
    tstate_native_thread_id: 160,
    tstate_cframe: 56,
    cframe_current_frame: 8,
    frame_code: 32,
    frame_previous: 48,
    frame_prev_instr: 56,
    frame_is_entry: 68,
    frame_owner: 0,
    owner_cstack: 0,
    code_name: 120,
    code_filename: 112,
    code_firstlineno: 72,
    code_linetable: 136,
    code_instructions: 184,
    unicode_state: 32,
    unicode_ascii_data: 48,
    // state bits: interned (2), kind (3), compact (1), ascii (1)
    unicode_compact_ascii: 1 << 5 | 1 << 6,
    bytes_size: 16,
    bytes_data: 32,
    _pad: 0,
};

/// Bytes of 3.13's `_Py_DebugOffsets` read (to the end of its `unicode_object`).
const DEBUG_OFFSETS_3_13_SIZE: usize = 576;

/// CPython 3.13's layout, from the `_Py_DebugOffsets` that starts its `_PyRuntime` (`bytes`):
/// where in it each offset lies is offsetof in Include/internal/pycore_runtime.h of 3.13 (as
/// compiled against Debian 13's libpython3.13-dev; stable between patch releases, not minor
/// ones). None where its cookie, version or build (free-threaded) is not the one expected.
fn from_debug_offsets(bytes: &[u8], version_hex: u32) -> Option<PythonLayout> {
    let word = |at: usize| Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?));
    let field = |at: usize| word(at).and_then(|value| u32::try_from(value).ok());
    if bytes.get(..8)? != b"xdebugpy" || word(8)? >> 16 != u64::from(version_hex >> 16) || word(16)? != 0 {
        return None;
    }
    let layout = PythonLayout {
        thread_list: 1,
        runtime_tstate_current: 0,
        runtime_interpreters_head: field(40)?,
        interp_threads_head: field(72)?,
        tstate_next: field(168)?,
        tstate_current_frame: field(184)?,
        tstate_native_thread_id: field(200)?,
        tstate_cframe: 0,
        cframe_current_frame: 0,
        frame_code: field(240)?,
        frame_previous: field(232)?,
        frame_prev_instr: field(248)?,
        frame_is_entry: 0,
        frame_owner: field(264)?,
        // Include/internal/pycore_frame.h: FRAME_OWNED_BY_CSTACK.
        owner_cstack: 3,
        code_name: field(288)?,
        code_filename: field(280)?,
        code_firstlineno: field(312)?,
        code_linetable: field(304)?,
        code_instructions: field(344)?,
        unicode_state: field(544)?,
        unicode_ascii_data: field(560)?,
        unicode_compact_ascii: 1 << 5 | 1 << 6,
        bytes_size: 16,
        bytes_data: 32,
        _pad: 0,
    };
    fields_fit(&layout).then_some(layout)
}

/// Whether the fields lie where the kernel reads them at once: a frame's within the words it reads
/// of a frame (the word that holds each, for the one-byte `is_entry` and `owner`), a code object's
/// name and file in two neighbouring words.
fn fields_fit(layout: &PythonLayout) -> bool {
    let (start, end) = (layout.frame_code as usize, layout.frame_code as usize + PYTHON_FRAME_WORDS * 8);
    let frame = [layout.frame_previous, layout.frame_prev_instr, layout.frame_is_entry, layout.frame_owner]
        .into_iter()
        .filter(|&offset| offset != 0)
        .all(|offset| offset as usize >= start && (offset as usize & !7) + 8 <= end);
    frame && layout.code_name.abs_diff(layout.code_filename) == 8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debians_python3_is_found_with_its_version() {
        let path = std::path::Path::new("/usr/bin/python3.11");
        let data = std::fs::read(path).expect("Debian 12's python3 is python3.11");
        let elf = ElfObject::parse(&data).unwrap();
        let image = PythonImage::of(&elf).expect("python3.11 exports _PyRuntime and Py_Version");
        assert_eq!(image.version, (3, 11));
        assert!(image.readable());
        assert!(fields_fit(&LAYOUT_3_11));
    }
}
