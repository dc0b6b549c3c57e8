//! Tests of the unwind tables on real files and real processes: the tables of Debian's libc and
//! python3 (built, measured, checked against gimli's own evaluation at every row), a fuzz over
//! mutated copies of them, and whole stacks walked by the reference unwinder on a C fixture built
//! without frame pointers and on /usr/bin/python3, each stopped with SIGSTOP and read through
//! ptrace's registers and /proc/PID/mem (read-only).

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Instant,
};

use blazesym::{
    symbolize::{
        source::{Process, Source},
        Input, Symbolized, Symbolizer,
    },
    Pid,
};
use memtrace_common::{unwind_kind, UNWIND_MAX_RUN};
use nix::{
    sys::{
        ptrace,
        signal::Signal,
        wait::{waitpid, WaitPidFlag, WaitStatus},
    },
    unistd::Pid as NixPid,
};
use proptest::prelude::*;

use super::{
    build::{build_table, table_of_file},
    index::*,
    reference::*,
    rows,
};

const LIBC: &str = "/usr/lib/x86_64-linux-gnu/libc.so.6";
const PYTHON: &str = "/usr/bin/python3.11";

fn read(path: &str) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e} (the unwind tests need Debian's {path})"))
}

/// Structural invariants the BPF lookup relies on.
fn assert_well_formed(table: &UnwindTable) {
    if table.rows.is_empty() {
        assert_eq!(table.pages.len(), 0);
        return;
    }
    assert!(table.rows.windows(2).all(|pair| pair[0].pc < pair[1].pc), "rows not sorted");
    assert_eq!(table.pages.len(), table.info.page_count as usize + 1);
    assert_eq!(table.info.row_count as usize, table.rows.len());
    assert_eq!(table.rows[0].pc >> table.info.page_shift, table.info.first_page);
    assert_eq!(table.rows[0].pc & ((1 << table.info.page_shift) - 1), 0);
    for pair in table.pages.windows(2) {
        assert!(pair[0] <= pair[1] && pair[1] - pair[0] < UNWIND_MAX_RUN, "run too long");
    }
    assert!((*table.pages.last().unwrap() as usize) < table.rows.len());
    assert_eq!(table.rows.last().unwrap().kind, unwind_kind::NONE);
}

#[test]
fn libc_and_python_tables_build_and_are_measured() {
    for path in [LIBC, PYTHON] {
        let data = read(path);
        let started = Instant::now();
        let (table, stats) = build_table(&data).unwrap();
        let elapsed = started.elapsed();
        assert_well_formed(&table);
        let started_from_disk = Instant::now();
        let (from_disk, _) = table_of_file(Path::new(path)).unwrap();
        let from_disk_elapsed = started_from_disk.elapsed();
        assert_eq!(from_disk, table);
        println!(
            "{path}: {:.1} ms in memory, {:.1} ms from the file, {} rows + {} pages = {} bytes (page 2^{}), {stats:?}",
            elapsed.as_secs_f64() * 1e3,
            from_disk_elapsed.as_secs_f64() * 1e3,
            table.rows.len(),
            table.pages.len(),
            table.size_bytes(),
            table.info.page_shift,
        );
        assert!(stats.fdes > 1000 && stats.corrupt_entries == 0, "{path}: {stats:?}");
        assert!(table.rows.len() > 5000, "{path}: only {} rows", table.rows.len());
        let count = |kind| table.rows.iter().filter(|r| r.kind == kind).count();
        // Every PLT has its expression; _start is the one outermost frame of an executable.
        assert!(count(unwind_kind::CFA_PLT) >= 1, "{path}: no PLT row");
        assert!(count(unwind_kind::UNSUPPORTED) * 100 < table.rows.len(), "{path}: too many unsupported");
    }
}

/// The table's answer at every row start (and one byte before it) equals gimli's own evaluation
/// of the FDE covering that address, converted with the same rule conversion.
#[test]
fn lookups_agree_with_gimli_at_every_row_of_libc() {
    let data = read(LIBC);
    let (table, _) = build_table(&data).unwrap();
    let checked = rows::check_against_gimli(&data, &table).unwrap();
    assert!(checked > 20_000, "only {checked} addresses checked");
}

/// The fixture's functions, by name: (start address, size) from the file's .symtab.
fn fixture_functions(data: &[u8]) -> Vec<(String, u64, u64)> {
    use object::{Object, ObjectSymbol};
    let file = object::File::parse(data).unwrap();
    let names = ["stop_here", "grow_table", "build_index", "parse_request", "main"];
    names
        .iter()
        .map(|&name| {
            let symbol = file.symbols().find(|s| s.name() == Ok(name)).unwrap_or_else(|| panic!("no {name}"));
            (name.to_owned(), symbol.address(), symbol.size())
        })
        .collect()
}

/// The same code described by .debug_frame only (`-fno-asynchronous-unwind-tables -g`) gives the
/// same rule at every byte of every function as when .eh_frame describes it.
#[test]
fn debug_frame_gives_the_rows_eh_frame_gives() {
    let dir = std::env::temp_dir().join(format!("memtrace-unwind-df-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let eh_flags = ["-O2", "-fomit-frame-pointer"];
    let eh = std::fs::read(compile_fixture("deep_chain", &eh_flags, &dir.join("eh"))).unwrap();
    let df_flags = ["-O2", "-fomit-frame-pointer", "-fno-asynchronous-unwind-tables", "-g"];
    let df = std::fs::read(compile_fixture("deep_chain", &df_flags, &dir.join("df"))).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    {
        use object::Object;
        let file = object::File::parse(&*df).unwrap();
        assert!(file.section_by_name(".debug_frame").is_some(), "cc made no .debug_frame");
    }
    let (eh_table, _) = build_table(&eh).unwrap();
    let (df_table, df_stats) = build_table(&df).unwrap();
    assert!(df_stats.fdes >= 5, "{df_stats:?}");
    let file_offset = |data: &[u8], address: u64| {
        crate::process::elf::ElfObject::parse(data).unwrap().code_file_offset(address).unwrap()
    };
    let eh_functions = fixture_functions(&eh);
    for ((name, eh_start, size), (_, df_start, df_size)) in eh_functions.iter().zip(fixture_functions(&df)) {
        assert_eq!(*size, df_size, "{name} differs between the builds");
        let rows_seen: Vec<_> = (0..*size)
            .map(|at| {
                let eh_row =
                    eh_table.lookup(file_offset(&eh, eh_start + at)).map(|r| (r.kind, r.cfa_offset, r.rbp));
                let df_row =
                    df_table.lookup(file_offset(&df, df_start + at)).map(|r| (r.kind, r.cfa_offset, r.rbp));
                assert_eq!(eh_row, df_row, "{name}+{at:#x}");
                eh_row
            })
            .collect();
        assert!(rows_seen.iter().all(Option::is_some), "{name} has bytes without a row");
    }
}

/// A mutation of a real file: bytes overwritten, mostly inside the CFI sections and the headers.
#[derive(Debug, Clone)]
struct Mutation {
    writes: Vec<(u8, f64, u8)>,
    truncate_to: Option<f64>,
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let write = (0u8..10, 0.0f64..1.0, any::<u8>());
    (proptest::collection::vec(write, 1..24), proptest::option::weighted(0.1, 0.0f64..1.0))
        .prop_map(|(writes, truncate_to)| Mutation { writes, truncate_to })
}

/// Applies a mutation: where 0-6 aim at .eh_frame, 7 at .eh_frame_hdr or the headers, 8-9 anywhere.
fn mutate(original: &[u8], cfi: std::ops::Range<usize>, mutation: &Mutation) -> Vec<u8> {
    let mut data = original.to_vec();
    for &(zone, at, byte) in &mutation.writes {
        let (start, len) = match zone {
            0..=6 => (cfi.start, cfi.len()),
            7 => (0, 4096),
            _ => (0, data.len()),
        };
        let index = start + ((len as f64 * at) as usize).min(len.saturating_sub(1));
        if let Some(slot) = data.get_mut(index) {
            *slot = byte;
        }
    }
    if let Some(fraction) = mutation.truncate_to {
        data.truncate((data.len() as f64 * fraction) as usize);
    }
    data
}

fn eh_frame_range(data: &[u8]) -> std::ops::Range<usize> {
    use object::{Object, ObjectSection};
    let file = object::File::parse(data).unwrap();
    let (offset, size) = file.section_by_name(".eh_frame").unwrap().file_range().unwrap();
    offset as usize..(offset + size) as usize
}

/// Fuzz cases per file (the report quotes this figure).
const FUZZ_CASES: u32 = 256;

fn fuzz_one(original: &[u8], cfi: std::ops::Range<usize>, mutation: &Mutation) {
    let data = mutate(original, cfi, mutation);
    if let Ok((table, _)) = build_table(&data) {
        assert_well_formed(&table);
        let last = table.rows.last().map_or(0, |r| u64::from(r.pc));
        for pc in (0..last + 64).step_by(97) {
            let _ = table.lookup(pc);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: FUZZ_CASES, ..ProptestConfig::default() })]

    #[test]
    fn mutated_libc_never_panics(mutation in mutation()) {
        thread_local!(static ORIGINAL: Vec<u8> = read(LIBC));
        ORIGINAL.with(|original| fuzz_one(original, eh_frame_range(original), &mutation));
    }

    #[test]
    fn mutated_python_never_panics(mutation in mutation()) {
        thread_local!(static ORIGINAL: Vec<u8> = read(PYTHON));
        ORIGINAL.with(|original| fuzz_one(original, eh_frame_range(original), &mutation));
    }
}

// ---- whole stacks of stopped processes -----------------------------------------------------------

/// A spawned child that is killed and reaped however the test ends.
struct Stopped(Child);

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spawns a program that stops itself with SIGSTOP, waits for the stop, takes it under ptrace (it
/// is our child, so no privilege is needed) and returns its registers. Nothing is written to it.
fn spawn_stopped(command: &mut Command) -> (Stopped, Registers) {
    let child = Stopped(command.stdin(Stdio::null()).spawn().expect("spawn the fixture"));
    let pid = NixPid::from_raw(child.0.id() as i32);
    match waitpid(pid, Some(WaitPidFlag::WUNTRACED)).expect("wait for the stop") {
        WaitStatus::Stopped(_, Signal::SIGSTOP) => {}
        other => panic!("the fixture did not stop itself: {other:?}"),
    }
    // Seizing a stopped task moves it into a ptrace stop, where its registers can be read.
    ptrace::seize(pid, ptrace::Options::empty()).expect("PTRACE_SEIZE");
    let regs = match ptrace::getregs(pid) {
        Ok(regs) => regs,
        Err(_) => {
            waitpid(pid, Some(WaitPidFlag::__WALL)).expect("wait for the ptrace stop");
            ptrace::getregs(pid).expect("PTRACE_GETREGS")
        }
    };
    let regs = Registers { rip: regs.rip, rsp: regs.rsp, rbp: Some(regs.rbp) };
    (child, regs)
}

/// One walked frame with its name (None where no symbol covers it) and the file it is in.
#[derive(Debug)]
struct Named {
    name: Option<String>,
    module: PathBuf,
    source: Option<StepSource>,
}

fn walk_and_name(pid: u32, regs: Registers) -> (Vec<Named>, StopReason) {
    let memory = ProcessMemory::open(pid).unwrap();
    let mut tables = ProcessTables::new(pid).unwrap();
    let walk = tables.walk(regs, &memory, 128);
    let maps = crate::process::procfs::mappings(pid).unwrap();
    let addresses: Vec<u64> = walk.frames.iter().map(|f| f.address).collect();
    let symbolizer = Symbolizer::new();
    // Names from the files' own .symtab/.dynsym: blazesym (built without zlib) fails on the
    // compressed sections of libc6-dbg's debug files, and the test must not depend on them.
    let mut process = Process::new(Pid::from(pid));
    process.debug_syms = false;
    let source = Source::Process(process);
    let symbols = symbolizer.symbolize(&source, Input::AbsAddr(&addresses)).unwrap();
    let named = walk
        .frames
        .iter()
        .zip(symbols)
        .map(|(frame, symbol)| Named {
            name: match symbol {
                Symbolized::Sym(sym) => Some(sym.name.to_string()),
                Symbolized::Unknown(_) => None,
            },
            module: maps
                .iter()
                .find(|m| (m.start..m.end).contains(&frame.address))
                .map(|m| m.path.clone())
                .unwrap_or_default(),
            source: frame.source,
        })
        .collect();
    (named, walk.stop)
}

fn describe(frames: &[Named]) -> String {
    frames
        .iter()
        .map(|f| format!("  {} ({}, {:?})\n", f.name.as_deref().unwrap_or("?"), f.module.display(), f.source))
        .collect()
}

fn position(frames: &[Named], name: &str) -> Option<usize> {
    frames.iter().position(|f| f.name.as_deref() == Some(name))
}

/// Compiles tests/fixtures/<name>.c with the given flags into `program`.
fn compile_fixture(name: &str, flags: &[&str], program: &Path) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(format!("{name}.c"));
    let status = Command::new("cc").args(flags).arg("-o").arg(program).arg(&source).status().expect("run cc");
    assert!(status.success(), "cc failed on {}", source.display());
    program.to_owned()
}

/// The fixture's build_index has an rbp-based CFA and grow_table saves rbp in its frame: the chain
/// only comes out whole when the rbp rules are right too.
#[test]
fn c_chain_without_frame_pointers_unwinds_to_start() {
    let dir = std::env::temp_dir().join(format!("memtrace-unwind-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let program = compile_fixture("deep_chain", &["-O2", "-fomit-frame-pointer"], &dir.join("deep_chain"));
    let (child, regs) = spawn_stopped(&mut Command::new(&program));
    let (frames, stop) = walk_and_name(child.0.id(), regs);
    let text = describe(&frames);
    std::fs::remove_dir_all(&dir).ok();
    println!("deep_chain stack:\n{text}");

    let chain = ["stop_here", "grow_table", "build_index", "parse_request", "main"];
    let first = position(&frames, "stop_here").unwrap_or_else(|| panic!("no stop_here in\n{text}"));
    let names: Vec<_> = frames[first..first + chain.len()].iter().map(|f| f.name.as_deref()).collect();
    assert_eq!(names, chain.map(Some), "\n{text}");
    // Above stop_here: raise and its helpers, all in libc.
    assert!(frames[..first].iter().all(|f| f.module.ends_with("libc.so.6")), "\n{text}");
    // raise and gsignal are one function: blazesym may give either name.
    let raise = frames[..first].iter().any(|f| matches!(f.name.as_deref(), Some("raise" | "gsignal")));
    assert!(raise, "\n{text}");
    // Below main: libc's start code (its static helper is named only with libc6-dbg), then _start.
    let tail = &frames[first + chain.len()..];
    assert!(tail.len() == 3 && tail[..2].iter().all(|f| f.module.ends_with("libc.so.6")), "\n{text}");
    assert!(tail[1].name.as_deref().is_some_and(|n| n.starts_with("__libc_start_main")), "\n{text}");
    assert_eq!(tail[2].name.as_deref(), Some("_start"), "\n{text}");
    assert_eq!(stop, StopReason::Outermost, "\n{text}");
    assert!(frames.iter().all(|f| f.source != Some(StepSource::FramePointer)), "\n{text}");
}

#[test]
fn debian_python3_unwinds_to_its_entry() {
    let script = "import os, signal\n\
                  def leaf():\n    os.kill(os.getpid(), signal.SIGSTOP)\n\
                  def middle():\n    leaf()\n\
                  middle()\n";
    let (child, regs) = spawn_stopped(Command::new("/usr/bin/python3").args(["-c", script]));
    let (frames, stop) = walk_and_name(child.0.id(), regs);
    let text = describe(&frames);
    println!("python3 stack:\n{text}");

    assert_eq!(stop, StopReason::Outermost, "\n{text}");
    assert!(frames.iter().all(|f| f.source != Some(StepSource::FramePointer)), "\n{text}");
    let order = ["_PyEval_EvalFrameDefault", "Py_RunMain", "Py_BytesMain", "_start"];
    let positions: Vec<_> = order.iter().map(|name| position(&frames, name)).collect();
    assert!(positions.iter().all(Option::is_some), "{positions:?}\n{text}");
    assert!(positions.windows(2).all(|pair| pair[0] < pair[1]), "{positions:?}\n{text}");
    assert_eq!(frames[0].module, Path::new("/usr/lib/x86_64-linux-gnu/libc.so.6"), "\n{text}");
    let named = frames.iter().filter(|f| f.name.is_some()).count();
    assert!(named * 2 > frames.len(), "most frames should be named\n{text}");
}
