//! A frame of a call stack as the model keeps it: a function, where it is known, in an object file
//! at an offset. The symbolizer makes these; the model's stacks hold them, and every output names
//! them the same way (`Frame::name`).

use std::path::Path;

/// One resolved stack frame.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Frame {
    /// Demangled function name, when the object has symbols for the address.
    pub function: Option<String>,
    /// Source file and line, when the object has debug information.
    pub file: Option<String>,
    pub line: Option<u32>,
    /// The object file (or a description of it when it could not be found).
    pub module: String,
    /// File offset within `module`, or the virtual address when the module is unknown; for an
    /// interpreter's frame, the index of its instruction in its code.
    pub offset: u64,
    /// The interpreter whose frame this is ("python", "perl"), for a frame of the program it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interpreter: Option<String>,
}

impl Frame {
    /// The function a frame is in, as the per-function table counts it: `name` but for an
    /// interpreter's frame, which is one function whatever line it is at (`function (file)`).
    pub fn function_name(&self) -> String {
        match (&self.interpreter, &self.function, &self.file) {
            (Some(_), Some(function), Some(file)) => format!("{function} ({file})"),
            _ => self.name(),
        }
    }

    /// The function as a profile's function table names it (pprof, OTLP), where file and line are
    /// fields of their own: `name`, but an interpreter's frame by its function alone (its system
    /// name there is `function_name`).
    pub fn profile_function(&self) -> String {
        match (&self.interpreter, &self.function) {
            (Some(_), Some(function)) => function.clone(),
            _ => self.name(),
        }
    }

    /// The function name, or module+offset where there is none; an interpreter's frame as
    /// `function (file:line)`.
    pub fn name(&self) -> String {
        if let (Some(_), Some(function), Some(file)) = (&self.interpreter, &self.function, &self.file) {
            return format!("{function} ({file}:{})", self.line.unwrap_or(0));
        }
        match &self.function {
            Some(function) => function.clone(),
            None => {
                let module = Path::new(&self.module)
                    .file_name()
                    .map_or(self.module.as_str(), |n| n.to_str().unwrap_or(self.module.as_str()));
                format!("{module}+{:#x}", self.offset)
            }
        }
    }
}
