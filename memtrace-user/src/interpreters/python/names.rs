//! Python frames named: the kernel stores a stack's Python frames after its native ones (code
//! object, instruction, entry flag: `memtrace_common::FRAME_PYTHON`) and copies each code object's
//! name, file and location table once (PYTHON_CODES); the names are taken at every sample and kept
//! here for the process's life. Where they go among the native frames is ../frames.rs's.

use std::collections::{HashMap, HashSet};

use anyhow::Result;
use memtrace_common::{until_nul, PythonCode};

use super::{lines::line_of, tables::Python};
use crate::{interpreters::language::Language, kernel::Probes, model::frame::Frame};

/// How memtrace shows CPython: each run of Python frames ran in one call of its eval loop.
pub const LANGUAGE: Language =
    Language { name: "python", functions: "Python function", loop_functions: &["_PyEval_EvalFrameDefault"] };

/// A code object's names, as the kernel copied them.
struct Code {
    name: String,
    file: String,
    first_line: u32,
    linetable: Vec<u8>,
}

/// The code objects of every traced process, by process and address.
#[derive(Default)]
pub struct PythonNames {
    /// By process, address and fingerprint (a code object freed and another made at its address
    /// are two).
    codes: HashMap<(u32, u64, u64), Code>,
}

impl PythonNames {
    /// Takes what the kernel copied since the last sample.
    pub fn drain(&mut self, probes: &Probes) -> Result<()> {
        for (key, code) in probes.take_codes::<Python>()? {
            self.codes.insert((key.tgid, key.code, key.fingerprint), Code::from_kernel(&code));
        }
        Ok(())
    }

    /// Forgets the code objects of processes gone.
    pub fn forget(&mut self, tgids: &HashSet<u32>) {
        self.codes.retain(|(tgid, _, _), _| !tgids.contains(tgid));
    }

    /// A Python frame, named by its code object where the kernel copied it.
    pub fn frame(&self, tgid: u32, code: u64, fingerprint: u64, instruction: u64) -> Frame {
        let known = self.codes.get(&(tgid, code, fingerprint));
        let line = known.and_then(|code| line_of(&code.linetable, code.first_line, instruction));
        Frame {
            function: Some(known.map_or_else(|| format!("[code {code:#x}]"), |code| code.name.clone())),
            file: Some(known.map_or_else(|| "?".to_owned(), |code| code.file.clone())),
            line: line.or(known.map(|code| code.first_line)),
            module: LANGUAGE.name.to_owned(),
            offset: instruction,
            interpreter: Some(LANGUAGE.name.to_owned()),
        }
    }
}

impl Code {
    fn from_kernel(code: &PythonCode) -> Self {
        let text = |bytes: &[u8]| String::from_utf8_lossy(until_nul(bytes)).into_owned();
        let name = text(&code.name);
        let file = text(&code.filename);
        let len = (code.linetable_len as usize).min(code.linetable.len());
        Self {
            name: if name.is_empty() { "?".to_owned() } else { name },
            file: if file.is_empty() { "?".to_owned() } else { file },
            first_line: code.firstlineno,
            linetable: code.linetable[..len].to_vec(),
        }
    }
}
