//! Python frames named, and put where they ran among the native frames: the kernel stores a
//! stack's Python frames after its native ones (code object, instruction, entry flag:
//! `memtrace_common::FRAME_PYTHON`) and copies each code object's name, file and location table
//! once (PYTHON_CODES); the names are taken at every sample and kept here for the process's life.
//!
//! Where they go: the frames from one entry frame to the next ran inside one native call of the
//! eval loop (`_PyEval_EvalFrameDefault`), innermost first as the native frames are; so the Python
//! frames are written before each eval frame in turn, up to the next entry frame, as
//! `py-spy --native` and `memray --native` show them. Frames past the last eval frame the native
//! walk reached (it was cut) go at the end.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

use anyhow::Result;
use memtrace_common::{PythonCode, StackFrame, FRAME_PYTHON};

use crate::{kernel::Probes, model::frame::Frame, process::python::line_of};

/// The native function each run of Python frames ran in.
const EVAL_FUNCTION: &str = "_PyEval_EvalFrameDefault";

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
    codes: HashMap<(u32, u64), Code>,
}

impl PythonNames {
    /// Takes what the kernel copied since the last sample.
    pub fn drain(&mut self, probes: &Probes) -> Result<()> {
        for (key, code) in probes.take_python_codes()? {
            self.codes.insert((key.tgid, key.code), Code::from_kernel(&code));
        }
        Ok(())
    }

    /// Forgets the code objects of processes gone.
    pub fn forget(&mut self, tgids: &HashSet<u32>) {
        self.codes.retain(|(tgid, _), _| !tgids.contains(tgid));
    }

    /// `native` (the stack's native frames, resolved) with the stack's Python frames where they
    /// ran.
    pub fn interleave(&self, tgid: u32, stack: &[StackFrame], native: Vec<Arc<Frame>>) -> Vec<Arc<Frame>> {
        let python: Vec<(Arc<Frame>, bool)> = stack
            .iter()
            .filter(|frame| frame.status == FRAME_PYTHON)
            .map(|frame| {
                let (code, entry, instruction) = python_frame(frame);
                (Arc::new(self.frame(tgid, code, instruction)), entry)
            })
            .collect();
        if python.is_empty() {
            return native;
        }
        let mut pending = python.into_iter();
        let mut frames = Vec::with_capacity(native.len() + pending.len());
        for frame in native {
            if frame.function.as_deref() == Some(EVAL_FUNCTION) {
                for (python, entry) in pending.by_ref() {
                    frames.push(python);
                    if entry {
                        break;
                    }
                }
            }
            frames.push(frame);
        }
        frames.extend(pending.map(|(python, _)| python));
        frames
    }

    /// A Python frame, named by its code object where the kernel copied it.
    fn frame(&self, tgid: u32, code: u64, instruction: u64) -> Frame {
        let known = self.codes.get(&(tgid, code));
        let line = known.and_then(|code| line_of(&code.linetable, code.first_line, instruction));
        Frame {
            function: Some(known.map_or_else(|| format!("[code {code:#x}]"), |code| code.name.clone())),
            file: Some(known.map_or_else(|| "?".to_owned(), |code| code.file.clone())),
            line: line.or(known.map(|code| code.first_line)),
            module: "python".to_owned(),
            offset: instruction,
            interpreter: Some("python".to_owned()),
        }
    }
}

impl Code {
    fn from_kernel(code: &PythonCode) -> Self {
        let text = |bytes: &[u8]| {
            let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
            String::from_utf8_lossy(&bytes[..end]).into_owned()
        };
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

/// A stored Python frame's code object, entry flag and instruction (`FRAME_PYTHON`).
fn python_frame(frame: &StackFrame) -> (u64, bool, u64) {
    let id = &frame.build_id;
    let code = u64::from_le_bytes([id[0], id[1], id[2], id[3], id[4], id[5], id[6], id[7]]);
    (code, id[8] != 0, frame.offset_or_ip)
}

/// A Python frame as the kernel stores it, for tests.
#[cfg(test)]
fn stored(code: u64, entry: bool, instruction: u64) -> StackFrame {
    let mut build_id = [0u8; 20];
    build_id[..8].copy_from_slice(&code.to_le_bytes());
    build_id[8] = u8::from(entry);
    StackFrame { status: FRAME_PYTHON, build_id, offset_or_ip: instruction }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn native(name: &str) -> Arc<Frame> {
        Arc::new(Frame {
            function: Some(name.into()),
            file: None,
            line: None,
            module: "python3".into(),
            offset: 0,
            interpreter: None,
        })
    }

    #[test]
    fn python_frames_go_before_the_eval_frame_they_ran_in() {
        let mut names = PythonNames::default();
        for (code, name, line) in [(0x10, "make_cache", 3), (0x20, "<module>", 1), (0x30, "handler", 7)] {
            let code_name = name;
            names.codes.insert(
                (9, code),
                Code {
                    name: code_name.into(),
                    file: "app.py".into(),
                    first_line: line,
                    linetable: Vec::new(),
                },
            );
        }
        // make_cache called from <module> in one eval call; <module> entered from C (a callback
        // of map(), say) that handler's eval call made.
        let stack = [stored(0x10, false, 4), stored(0x20, true, 8), stored(0x30, true, 2)];
        let natives = ["PyByteArray_Resize", EVAL_FUNCTION, "map_next", EVAL_FUNCTION, "main"].map(native);
        let frames = names.interleave(9, &stack, natives.to_vec());
        let shown: Vec<String> = frames.iter().map(|f| f.name()).collect();
        assert_eq!(
            shown,
            [
                "PyByteArray_Resize",
                "make_cache (app.py:3)",
                "<module> (app.py:1)",
                EVAL_FUNCTION,
                "map_next",
                "handler (app.py:7)",
                EVAL_FUNCTION,
                "main"
            ]
        );
    }
}
