//! The unwind tables in the kernel, kept current for every traced process: each object file's
//! table is built once (by [`FileId`]) and loaded into the shared row and page arrays at a file slot
//! of its own; each process's executable file mappings, as the collector last read them, become
//! its mapping table (`UNWIND_MAPPINGS`), which names those slots. A process that maps a new file
//! (dlopen) or execs gets a new mapping table at the next interval. The layout is specified in
//! memtrace-common (`UnwindFile`, `UnwindMappings`); memtrace-ebpf/src/stacks.rs reads it.
//!
//! Tables are built inline (a few files: --pid, a command) or on a worker thread (--all, where the
//! machine's files are many and start-up must stay fast); until a file's table is loaded, stacks
//! through it end there (`unwind_stop::NO_TABLE`). Once every file of a process is ready, memtrace
//! says so on stderr (`memtrace: unwind tables loaded for pid N`), which tests wait for.

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    sync::mpsc::{channel, Receiver, Sender},
};

use anyhow::Result;
use memtrace_common::{
    interpreter, unwind_file_state, ThreadKeys, UnwindFile, UnwindMapping, UnwindMappings, UNWIND_MAX_FILES,
    UNWIND_MAX_MAPPINGS, UNWIND_MAX_PAGES, UNWIND_MAX_ROWS,
};

use super::{build::table_of_file, index::UnwindTable};
use crate::{
    interpreters::image::InterpreterProcess,
    kernel::Probes,
    model::Model,
    process::procfs::Mapping,
    process::{open_mapping, FileCache, FileId, ObjectFile, Root},
};

/// What the kernel has for one file slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    /// Being built, or it did not fit in the shared arrays.
    Pending,
    Loaded,
    /// No unwind information: frame pointers.
    FramePointers,
}

/// Where a new file's table is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Build {
    /// At once, before the call returns.
    Now,
    /// On the worker, where there is one (--all), else at once.
    Worker,
}

/// A table built away from the main thread: the file's slot and the table, or None without one.
type Built = (u32, Option<UnwindTable>);

/// The worker's ends: files to build (by slot), and the tables built.
type Worker = (Sender<(u32, ObjectFile)>, Receiver<Built>);

/// One traced process as last written to the kernel.
#[derive(Default)]
struct ProcessTable {
    /// The executable file mappings written, as /proc showed them.
    mappings: Vec<Mapping>,
    /// The file slot of each mapped path, opened once per process.
    slots: HashMap<PathBuf, Option<u32>>,
    /// Whether "loaded" has been said for the current mappings.
    announced: bool,
    /// The interpreter it runs, where the kernel reads its frames.
    interpreter: Option<InterpreterProcess>,
    /// Where its C library keeps thread-specific data (each Perl thread's interpreter).
    thread_keys: Option<ThreadKeys>,
}

/// Loaded tables, their file slots, and every traced process's mapping table.
pub struct KernelTables {
    enabled: bool,
    /// Interpreters' frames are read (not with --no-interpreter-frames).
    interpreter_frames: bool,
    /// Say on stderr when a process's tables are all loaded (not under --all: too many).
    announce: bool,
    slots: HashMap<FileId, u32>,
    states: Vec<SlotState>,
    next_row: u32,
    next_page: u32,
    processes: HashMap<u32, ProcessTable>,
    facts: FileCache,
    worker: Option<Worker>,
    /// The tables' epoch (`UNWIND_EPOCH`), and whether a table changed since it was last bumped.
    epoch: u64,
    changed: bool,
}

impl KernelTables {
    /// `enabled` is false with --no-stacks; `background` builds tables on a worker thread;
    /// `interpreter_frames` is false with --no-interpreter-frames.
    pub fn new(enabled: bool, background: bool, interpreter_frames: bool) -> Self {
        let worker = (enabled && background).then(spawn_worker);
        Self {
            enabled,
            interpreter_frames,
            announce: !background,
            slots: HashMap::new(),
            states: Vec::new(),
            next_row: 0,
            next_page: 0,
            processes: HashMap::new(),
            facts: FileCache::default(),
            worker,
            epoch: 0,
            changed: false,
        }
    }

    /// Files with a table in the kernel, and the rows they take.
    pub fn occupancy(&self) -> (usize, usize) {
        let loaded = self.states.iter().filter(|state| **state == SlotState::Loaded).count();
        (loaded, self.next_row as usize)
    }

    /// Gives files a slot and their table before any process maps them (a command's image before
    /// it runs, a program's stopped at its exec), built here and now, not on the worker: the
    /// process's first stacks are whole (its files found through the kernel's mappings, before
    /// it has a mapping table). A file known already costs nothing.
    pub fn preload(&mut self, probes: &mut Probes, objects: &[ObjectFile]) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        for object in objects {
            self.slot_of(probes, object.clone(), Build::Now)?;
        }
        self.publish(probes)
    }

    /// Loads the tables the worker finished, and writes the mapping table of every process whose
    /// executable mappings changed since the last call (from the model's latest sample).
    pub fn update(&mut self, probes: &mut Probes, model: &Model) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let finished: Vec<Built> = match &self.worker {
            Some((_, results)) => results.try_iter().collect(),
            None => Vec::new(),
        };
        for (slot, table) in finished {
            self.load_table(probes, slot, table)?;
        }
        let mut gone: HashSet<u32> = self.processes.keys().copied().collect();
        for process in model.processes.values().filter(|p| !p.exited && !p.released) {
            gone.remove(&process.identity.pid);
            let executable: Vec<Mapping> =
                process.mappings.iter().filter(|m| m.executable).cloned().collect();
            if executable.is_empty() {
                continue;
            }
            let changed =
                self.processes.get(&process.identity.pid).is_none_or(|table| table.mappings != executable);
            if changed {
                // The collector indexes the files it reads in the process's mappings itself.
                self.write_mappings(probes, process.identity.pid, executable, Build::Worker)?;
            }
            self.announce_if_ready(process.identity.pid);
        }
        if !gone.is_empty() {
            for &pid in &gone {
                let interpreter = self.processes.remove(&pid).and_then(|table| table.interpreter);
                if let Some(interpreter) = interpreter {
                    interpreter.forget(&mut probes.unwind_tables(), pid)?;
                }
            }
            probes.unwind_tables().forget(gone)?;
            self.changed = true;
        }
        self.publish(probes)
    }

    /// Writes the mapping table of `pid`, which has just loaded a library (and is held until this
    /// returns), from its mappings as /proc shows them now: a file new to memtrace gets its table
    /// here and now, not on the worker, so that the code that called dlopen unwinds through the
    /// library at once. Nothing is written where the mappings did not change. Returns the files
    /// the process maps that its table did not have (open), for symbolization: it may exit before
    /// its mappings are read again.
    pub fn load_process_now(&mut self, probes: &mut Probes, pid: u32) -> Result<Vec<ObjectFile>> {
        if !self.enabled {
            return Ok(Vec::new());
        }
        let executable: Vec<Mapping> =
            crate::process::procfs::maps(pid)?.files.into_iter().filter(|m| m.executable).collect();
        let mut opened = Vec::new();
        if self.processes.get(&pid).is_none_or(|table| table.mappings != executable) {
            opened = self.write_mappings(probes, pid, executable, Build::Now)?;
        }
        self.publish(probes)?;
        Ok(opened)
    }

    /// Bumps the epoch after tables changed: the kernel's memo of the last walk on each CPU
    /// (memtrace-ebpf/src/stack_read.rs) holds only while nothing the walk read has changed.
    fn publish(&mut self, probes: &mut Probes) -> Result<()> {
        if !std::mem::take(&mut self.changed) {
            return Ok(());
        }
        self.epoch += 1;
        probes.unwind_tables().set_epoch(self.epoch)
    }

    /// Writes a process's mapping table, giving each new file a slot (and a table); returns the
    /// files it opened (those its table did not have).
    fn write_mappings(
        &mut self,
        probes: &mut Probes,
        pid: u32,
        executable: Vec<Mapping>,
        when: Build,
    ) -> Result<Vec<ObjectFile>> {
        let mut opened = Vec::new();
        let mut table = self.processes.remove(&pid).unwrap_or_default();
        let mut root = None;
        let mut value = UnwindMappings {
            count: 0,
            interpreter: 0,
            mappings: [UnwindMapping::default(); UNWIND_MAX_MAPPINGS],
        };
        for mapping in executable.iter().take(UNWIND_MAX_MAPPINGS) {
            let slot = match table.slots.get(&mapping.path) {
                Some(slot) => *slot,
                None => {
                    let root = root.get_or_insert_with(|| Root::of_process(pid).ok());
                    let object = root.as_ref().and_then(|root| open_mapping(pid, root, mapping).ok());
                    if let Some(object) = object.as_ref().filter(|_| self.interpreter_frames) {
                        table.interpreter =
                            table.interpreter.or_else(|| self.interpreter_in(object, mapping));
                        table.thread_keys = table.thread_keys.or_else(|| self.facts.thread_keys(object));
                    }
                    let slot = match object {
                        Some(object) => {
                            opened.push(object.clone());
                            self.slot_of(probes, object, when)?
                        }
                        None => None,
                    };
                    table.slots.insert(mapping.path.clone(), slot);
                    slot
                }
            };
            let Some(slot) = slot else { continue };
            value.mappings[value.count as usize] = UnwindMapping {
                start: mapping.start,
                end: mapping.end,
                file_offset: mapping.file_offset,
                file: slot,
                _pad: 0,
            };
            value.count += 1;
        }
        value.mappings[..value.count as usize].sort_by_key(|m| m.start);
        if let Some(process) = &table.interpreter {
            // Before the flag that has the kernel read it. A full map leaves native frames alone.
            let written = process.write(&mut probes.unwind_tables(), pid, table.thread_keys)?;
            value.interpreter = if written { process.kind() } else { interpreter::NONE };
        }
        // A process that exited meanwhile, or a full map, keeps the frame-pointer walk.
        probes.unwind_tables().set_mappings(pid, &value)?;
        self.changed = true;
        table.mappings = executable;
        table.announced = false;
        self.processes.insert(pid, table);
        Ok(opened)
    }

    /// Where the kernel reads a process's interpreter frames, if `object`, mapped by `mapping`, is
    /// an interpreter (CPython, Perl) of a version memtrace reads.
    fn interpreter_in(&self, object: &ObjectFile, mapping: &Mapping) -> Option<InterpreterProcess> {
        let image = self.facts.interpreter(object)?;
        image.as_ref().as_ref()?.in_process(mapping.start, mapping.file_offset)
    }

    /// The slot of a file, made (and its table built, or asked of the worker where there is one)
    /// on first sight; None when the slots are all taken.
    fn slot_of(&mut self, probes: &mut Probes, object: ObjectFile, when: Build) -> Result<Option<u32>> {
        if let Some(slot) = self.slots.get(&object.id) {
            return Ok(Some(*slot));
        }
        let slot = self.states.len() as u32;
        if slot >= UNWIND_MAX_FILES {
            return Ok(None);
        }
        self.slots.insert(object.id, slot);
        self.states.push(SlotState::Pending);
        let build_id = self.facts.facts(&object).build_id;
        let file = UnwindFile {
            state: unwind_file_state::PENDING,
            has_build_id: u8::from(build_id.is_some()),
            build_id: build_id.unwrap_or_default(),
            ..UnwindFile::default()
        };
        self.write_file(probes, slot, &file)?;
        // The kernel's way to the slot from a mapping of the file (a process's first moments).
        probes.unwind_tables().set_file_keys(&object.kernel_keys(), slot)?;
        match (&self.worker, when) {
            (Some((requests, _)), Build::Worker) => {
                // The worker only ends with memtrace.
                let _ = requests.send((slot, object));
            }
            _ => {
                let table = build(&object);
                self.load_table(probes, slot, table)?;
            }
        }
        Ok(Some(slot))
    }

    /// Copies a built table into the shared arrays and marks its slot loaded (or frame pointers,
    /// without a table). A table that does not fit leaves the slot pending.
    fn load_table(&mut self, probes: &mut Probes, slot: u32, table: Option<UnwindTable>) -> Result<()> {
        let mut file = probes.unwind_tables().file(slot)?;
        let Some(mut table) = table.filter(|table| !table.rows.is_empty()) else {
            file.state = unwind_file_state::FRAME_POINTERS;
            self.states[slot as usize] = SlotState::FramePointers;
            return self.write_file(probes, slot, &file);
        };
        let rows_end = u64::from(self.next_row) + table.rows.len() as u64;
        let pages_end = u64::from(self.next_page) + table.pages.len() as u64;
        if rows_end > u64::from(UNWIND_MAX_ROWS) || pages_end > u64::from(UNWIND_MAX_PAGES) {
            return Ok(());
        }
        table.info.rows_start = self.next_row;
        table.info.pages_start = self.next_page;
        probes.unwind_tables().set_table((self.next_row, &table.rows), (self.next_page, &table.pages))?;
        self.next_row = rows_end as u32;
        self.next_page = pages_end as u32;
        // The rows are in place before the kernel may read them.
        file.table = table.info;
        file.state = unwind_file_state::LOADED;
        self.states[slot as usize] = SlotState::Loaded;
        self.write_file(probes, slot, &file)
    }

    fn write_file(&mut self, probes: &mut Probes, slot: u32, file: &UnwindFile) -> Result<()> {
        probes.unwind_tables().set_file(slot, file)?;
        self.changed = true;
        Ok(())
    }

    /// Says once per change of a process's mappings that all its files are ready.
    fn announce_if_ready(&mut self, pid: u32) {
        let Some(table) = self.processes.get_mut(&pid) else { return };
        if table.announced {
            return;
        }
        let slots: Vec<u32> = table.slots.values().flatten().copied().collect();
        if slots.iter().any(|&slot| self.states[slot as usize] == SlotState::Pending) {
            return;
        }
        table.announced = true;
        if self.announce {
            eprintln!("memtrace: unwind tables loaded for pid {pid} ({} files)", slots.len());
        }
    }
}

/// A file's table, or None when it has no unwind information memtrace can use.
fn build(object: &ObjectFile) -> Option<UnwindTable> {
    table_of_file(&object.host_path).ok().map(|(table, _)| table)
}

fn spawn_worker() -> Worker {
    let (requests, incoming) = channel::<(u32, ObjectFile)>();
    let (done, results) = channel::<Built>();
    std::thread::spawn(move || {
        crate::process::threads::set_urgency(crate::process::threads::Urgency::Background);
        for (slot, object) in incoming {
            if done.send((slot, build(&object))).is_err() {
                return;
            }
        }
    });
    (requests, results)
}
