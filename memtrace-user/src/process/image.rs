//! A process's image: its object files in link order (a running process's as mapped, an exec'd or
//! held program's and a command's as its dynamic linker will load them), each opened inside the
//! process's root.

use std::{
    io::Read,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};

use super::{
    facts::FileCache,
    file::{ObjectFile, Root},
    objects,
};

/// The object files of one process (running, just exec'd, or a command not started yet).
#[derive(Debug, Clone)]
pub struct ProcessImage {
    /// None for a command not started yet.
    pub pid: Option<u32>,
    /// Where the process resolves its paths.
    pub root: Root,
    /// Every object file, each once, in the dynamic linker's symbol search order; a running
    /// process's files as mapped (objects it dlopen'd last).
    pub objects: Vec<ObjectFile>,
}

impl ProcessImage {
    /// A running process, read through /proc (its mappings, its root, its environment).
    pub fn of_process(pid: u32, cache: &FileCache) -> Result<Self> {
        let root = Root::of_process(pid)?;
        let objects = objects::link_order_of_process(pid, &root, cache)?;
        Ok(Self { pid: Some(pid), root, objects })
    }

    /// A process that has just exec'd a program: the files the program will map, resolved in
    /// the process's root as its dynamic linker will.
    pub fn of_exec(pid: u32, cache: &FileCache) -> Result<Self> {
        let (root, objects) = objects::link_order_of_exec(pid, cache)?;
        Ok(Self { pid: Some(pid), root, objects })
    }

    /// A command memtrace is about to start, in memtrace's own file system and environment: a
    /// script's image is its interpreter's.
    pub fn of_command(program: &Path, cache: &FileCache) -> Result<Self> {
        let root = Root::host();
        let program = interpreter_of(program)?;
        let program = root.open(&program).with_context(|| format!("cannot run {}", program.display()))?;
        let objects = objects::link_order_of_program(program, &root, &[], cache);
        Ok(Self { pid: None, root, objects })
    }

    /// A file the process names by path (`--lib`, `--usdt PATH:...`), resolved in its root.
    pub fn open(&self, path: &Path) -> Result<ObjectFile> {
        self.root.open(path)
    }

    /// The process's executable.
    pub fn executable(&self) -> Option<&ObjectFile> {
        self.objects.first()
    }
}

/// How many scripts may name each other as interpreter before the kernel gives up (ELOOP).
const MAX_SCRIPT_NESTING: usize = 5;

/// The program the kernel runs for `program`: itself, or for a script (`#!INTERPRETER [ARG]`)
/// its interpreter, which may be a script too.
pub fn interpreter_of(program: &Path) -> Result<PathBuf> {
    let mut program = program.to_owned();
    for _ in 0..MAX_SCRIPT_NESTING {
        let mut head = Vec::with_capacity(256);
        let file =
            std::fs::File::open(&program).with_context(|| format!("cannot run {}", program.display()))?;
        file.take(256).read_to_end(&mut head).with_context(|| format!("reading {}", program.display()))?;
        let Some(line) = head.strip_prefix(b"#!") else { return Ok(program) };
        let line = line.split(|&b| b == b'\n').next().unwrap_or_default();
        let Some(interpreter) = line.split(|&b| b == b' ' || b == b'\t').find(|word| !word.is_empty()) else {
            bail!("{}: the script's #! line names no interpreter", program.display());
        };
        program = PathBuf::from(std::ffi::OsStr::from_bytes(interpreter));
    }
    bail!(
        "{}: scripts name each other as interpreter more than {MAX_SCRIPT_NESTING} times",
        program.display()
    )
}
