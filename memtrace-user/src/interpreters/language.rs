//! How memtrace shows an interpreter's frames: the one description each interpreter's folder
//! gives of itself (its `LANGUAGE`).

/// How memtrace shows an interpreter's frames.
#[derive(Debug, Clone, Copy)]
pub struct Language {
    /// Its name in a frame (`Frame::interpreter`, `Frame::module`).
    pub name: &'static str,
    /// What the report calls its functions ("Python function").
    pub functions: &'static str,
    /// The native functions each run of its frames ran in: its loop.
    pub loop_functions: &'static [&'static str],
}
