//! Python's own frames in the stacks of Debian's python3 (CPython 3.11, stripped, no frame
//! pointers), read from outside the interpreter: scripts whose allocations are known from their
//! source (a bytearray of N bytes is one malloc of N + 1: CPython's small-object allocator takes
//! only requests of up to 512 bytes, and memtrace sees the rest), launched, attached, with threads,
//! and with the reading turned off.

use std::{path::Path, process::Command};

use memtrace_tests::{
    debian13, function_row as function, guide::guide_example, leak_stack, leak_through, Memtrace, Outcome,
};
use serde_json::Value;

const PYTHON: &str = "/usr/bin/python3";

/// make_cache fills a list the module made (so that it allocates nothing but the bytearrays):
/// 400 blocks of 10,001 bytes, from line 4, called from line 8.
const CACHE: &str = "\
import os, sys
def make_cache(keep):
    for i in range(len(keep)):
        keep[i] = bytearray(10000)
keep = [None] * 400
if len(sys.argv) > 1:
    sys.stdin.read(1)
make_cache(keep)
os._exit(0)
";
const CACHE_BYTES: u64 = 400 * 10_001;

fn script(dir: &Path, name: &str, source: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, source).unwrap();
    path.to_str().unwrap().to_owned()
}

/// Debian's python3 running the script at `path`, launched by memtrace with `options`; exits 0.
fn run_python(path: &str, options: &[&str]) -> Outcome {
    run_script(&[PYTHON, path], options)
}

/// `command` (an interpreter and its script), launched by memtrace with `options`; exits 0.
fn run_script(command: &[&str], options: &[&str]) -> Outcome {
    let outcome = Memtrace::new().args(options).arg("--").args(command).run();
    outcome.assert_exit_code(0);
    outcome
}

/// The cache script's leak, its frames in order, and make_cache's bytes in the function table.
fn assert_cache(process: &Value, path: &str) {
    let cache = format!("make_cache ({path}:4)");
    let leak = leak_through(process, &cache);
    assert_eq!((leak["bytes"].as_u64(), leak["allocations"].as_u64()), (Some(CACHE_BYTES), Some(400)));
    let stack = leak_stack(leak);
    let at = stack.iter().position(|name| *name == cache).unwrap();
    assert_eq!(stack[at + 1], format!("<module> ({path}:8)"), "{stack:?}");
    assert_eq!(
        stack[at + 2],
        "_PyEval_EvalFrameDefault",
        "Python frames go before the eval frame: {stack:?}"
    );
    let frame = leak["frames"].as_array().unwrap().iter().find(|f| f["function"] == "make_cache").unwrap();
    assert_eq!((frame["file"].as_str(), frame["line"].as_u64()), (Some(path), Some(4)), "{frame:#}");
    assert_eq!(frame["interpreter"], "python", "{frame:#}");
    let row = function(process, &format!("make_cache ({path})"));
    assert_eq!(row["live_exclusive_bytes"].as_u64(), Some(CACHE_BYTES), "{row:#}");
    let stops = &process["unwind_stops"];
    assert_eq!(stops["interpreter_unreadable"], 0, "every frame was read: {stops:#}");
}

#[test]
fn a_launched_scripts_leak_is_named_by_its_functions_and_lines() {
    let dir = tempfile::tempdir().unwrap();
    let path = script(dir.path(), "cache.py", CACHE);
    let outcome = run_python(&path, &[]);
    assert_cache(outcome.process(), &path);
    // The text report names them the same way.
    let frames = format!("make_cache ({path}:4) <- <module> ({path}:8)");
    let leak =
        outcome.stderr.lines().find(|line| line.trim_start().starts_with("leak: ") && line.contains(&frames));
    let leak =
        leak.unwrap_or_else(|| panic!("no leak through {frames:?} in the report:\n{}", outcome.stderr));
    // The guide's stacks.md shows this leak as the report prints it.
    guide_example("python-leak", leak);
}

#[test]
fn an_attached_interpreter_has_its_frames_read_too() {
    let dir = tempfile::tempdir().unwrap();
    let path = script(dir.path(), "cache.py", CACHE);
    let mut command = Command::new(PYTHON);
    command.args([path.as_str(), "wait"]);
    let outcome = memtrace_tests::attached_until_released(command, b"g");
    assert_cache(outcome.process(), &path);
}

/// A python3 that a traced shell starts (its exec held until its probes are in): followed, its
/// frames are read as a launched one's are.
#[test]
fn a_followed_interpreter_has_its_frames_read_too() {
    let dir = tempfile::tempdir().unwrap();
    let path = script(dir.path(), "cache.py", CACHE);
    // The `exit` keeps the shell from exec'ing python3 itself: python3 is the shell's child.
    let outcome = run_script(&["/bin/sh", "-c", &format!("{PYTHON} {path}; exit $?")], &[]);
    assert_cache(outcome.process_named("python3"), &path);
}

/// Two threads allocate in two functions.
const THREADS: &str = "\
import os, threading
def fill_a(keep):
    for i in range(len(keep)):
        keep[i] = bytearray(30000)
def fill_b(keep):
    for i in range(len(keep)):
        keep[i] = bytearray(50000)
a, b = [None] * 100, [None] * 100
threads = [threading.Thread(target=fill_a, args=(a,)), threading.Thread(target=fill_b, args=(b,))]
for t in threads: t.start()
for t in threads: t.join()
os._exit(0)
";

/// Each allocation of THREADS (run at `path`) has the frames of the thread that made it.
fn assert_threads(process: &Value, path: &str) {
    for (name, bytes) in [("fill_a", 100 * 30_001), ("fill_b", 100 * 50_001)] {
        let row = function(process, &format!("{name} ({path})"));
        assert_eq!(row["live_exclusive_bytes"].as_u64(), Some(bytes), "{row:#}");
        let leak =
            leak_through(process, &format!("{name} ({path}:{})", if name == "fill_a" { 4 } else { 7 }));
        assert_eq!(leak["allocations"], 100, "{leak:#}");
    }
}

/// Each thread's allocations have its own frames (on 3.11, those of the thread holding the
/// interpreter's lock, which is the allocating one).
#[test]
fn each_threads_allocations_have_its_own_frames() {
    let dir = tempfile::tempdir().unwrap();
    let path = script(dir.path(), "threads.py", THREADS);
    let outcome = run_python(&path, &[]);
    assert_threads(outcome.process(), &path);
}

/// A generator's and a coroutine's frames are read as a function's are: chunks (line 4) runs as
/// list() drives it, fill (line 7) as asyncio's loop does.
const GENERATORS: &str = "\
import asyncio, os
def chunks(n):
    for i in range(n):
        yield bytearray(20000)
async def fill(keep):
    for i in range(len(keep)):
        keep[i] = bytearray(30000)
        await asyncio.sleep(0)
made = list(chunks(100))
kept = [None] * 100
asyncio.run(fill(kept))
os._exit(0)
";

/// Each of GENERATORS (run at `path`) holds its bytes exactly, under its own frame.
fn assert_generators(process: &Value, path: &str) {
    for (name, bytes) in [("chunks", 100 * 20_001), ("fill", 100 * 30_001)] {
        let row = function(process, &format!("{name} ({path})"));
        assert_eq!(row["live_exclusive_bytes"].as_u64(), Some(bytes), "{row:#}");
    }
}

#[test]
fn generators_and_coroutines_have_their_frames() {
    let dir = tempfile::tempdir().unwrap();
    let path = script(dir.path(), "generators.py", GENERATORS);
    assert_generators(run_python(&path, &[]).process(), &path);
}

/// descend recurses 40 deep and then fills 100 bytearrays of 10,001 bytes (line 6): 41 of its
/// frames and the module's, past the 32 interpreter frames a stack keeps.
const DEEP: &str = "\
import os
def descend(depth, keep):
    if depth:
        return descend(depth - 1, keep)
    for i in range(len(keep)):
        keep[i] = bytearray(10000)
keep = [None] * 100
descend(40, keep)
os._exit(0)
";

/// A recursion deeper than the interpreter frames a stack keeps: the innermost 32 are kept, and
/// each stack cut so is counted in `unwind_stops` (`interpreter_depth_limit`); no frame was
/// unreadable.
#[test]
fn python_frames_past_the_limit_keep_the_innermost_and_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let path = script(dir.path(), "deep.py", DEEP);
    let outcome = run_python(&path, &[]);
    let process = outcome.process();
    let leak = leak_through(process, &format!("descend ({path}:6)"));
    assert_eq!((leak["bytes"].as_u64(), leak["allocations"].as_u64()), (Some(100 * 10_001), Some(100)));
    let python: Vec<&Value> =
        leak["frames"].as_array().unwrap().iter().filter(|f| f["interpreter"] == "python").collect();
    let lines: Vec<u64> = python.iter().map(|f| f["line"].as_u64().unwrap()).collect();
    let mut expected = vec![6];
    expected.resize(32, 4);
    assert_eq!(lines, expected, "the innermost 32, every one descend's: {leak:#}");
    assert!(python.iter().all(|f| f["function"] == "descend"), "{leak:#}");
    let stops = &process["unwind_stops"];
    // Exactly the bytearrays: nothing else allocates that deep.
    assert_eq!(stops["interpreter_depth_limit"], 100, "{stops:#}");
    assert_eq!(stops["interpreter_unreadable"], 0, "{stops:#}");
}

/// A frame memtrace cannot read, made by the script itself: at the bottom of a recursion it finds
/// the first page of its thread's frame stack (3.11's data stack, each frame's address from its
/// frame object's `f_frame`) that holds an outer frame and none of the frames inside it, makes
/// that page unreadable (PROT_NONE: no frame is touched while it is, with the collector off) and
/// mallocs 123,457 bytes through ctypes with the GIL held (PyDLL), then makes the page readable
/// again.
const UNREADABLE: &str = "\
import ctypes, gc, os, sys
libc = ctypes.PyDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
PAGE = os.sysconf('SC_PAGESIZE')
def frame_at(level):
    frame = sys._getframe(level + 1)
    return ctypes.c_void_p.from_address(id(frame) + 24).value
def bottom():
    pages = [frame_at(level) // PAGE for level in range(32)]
    k = next(k for k in range(1, 32) if pages[k] < pages[k - 1])
    gc.disable()
    assert libc.mprotect(pages[k] * PAGE, PAGE, 0) == 0
    kept = libc.malloc(123457)
    assert libc.mprotect(pages[k] * PAGE, PAGE, 3) == 0
    return kept
def descend(depth, a0=0, a1=0, a2=0, a3=0, a4=0, a5=0, a6=0, a7=0, a8=0, a9=0):
    if depth:
        return descend(depth - 1)
    return bottom()
descend(40)
os._exit(0)
";

/// A frame that cannot be read ends the Python part of the stack there, and is counted in
/// `unwind_stops` (`interpreter_unreadable`): the one allocation made while it was unreadable.
#[test]
fn an_unreadable_python_frame_ends_the_python_frames_and_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let path = script(dir.path(), "unreadable.py", UNREADABLE);
    let outcome = run_python(&path, &[]);
    let process = outcome.process();
    let leak = process["leaks"].as_array().unwrap().iter().find(|leak| leak["bytes"] == 123_457);
    let leak = leak.unwrap_or_else(|| panic!("no leak of 123,457 B: {:#}", process["leaks"]));
    let python: Vec<&str> = leak["frames"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["interpreter"] == "python")
        .map(|f| f["function"].as_str().unwrap())
        .collect();
    assert_eq!(python.first(), Some(&"bottom"), "{leak:#}");
    assert!(
        python.len() > 1 && python[1..].iter().all(|f| *f == "descend"),
        "ends before <module>: {python:?}"
    );
    assert_eq!(process["unwind_stops"]["interpreter_unreadable"], 1, "{:#}", process["unwind_stops"]);
}

#[test]
fn no_interpreter_frames_leaves_native_frames_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = script(dir.path(), "cache.py", CACHE);
    let outcome = run_python(&path, &["--no-interpreter-frames"]);
    let process = outcome.process();
    let leak = leak_through(process, "PyByteArray_Resize");
    assert_eq!(leak["bytes"].as_u64(), Some(CACHE_BYTES), "{leak:#}");
    let frames = outcome.summary()["frame_table"].as_array().unwrap();
    assert!(frames.iter().all(|f| f.get("interpreter").is_none()), "{frames:#?}");
}

/// The same script under memray and under memtrace: the bytes each of its two allocation sites
/// allocated (the innermost Python frame of each allocation, as memray counts them) agree
/// exactly, both tools counting every malloc.
#[test]
fn allocation_sites_agree_with_memray() {
    let dir = tempfile::tempdir().unwrap();
    let source = "\
def make_cache(keep):
    for i in range(len(keep)):
        keep[i] = bytearray(10000)
def other(keep):
    for i in range(len(keep)):
        keep[i] = bytearray(20000)
keep, more = [None] * 400, [None] * 100
make_cache(keep)
other(more)
";
    let path = script(dir.path(), "sites.py", source);
    let memray = memtrace_tests::memray::allocated_by_site(Path::new(&path), dir.path());
    let outcome = run_python(&path, &[]);
    let process = outcome.process();
    let table = outcome.summary()["frame_table"].as_array().unwrap();
    // Allocated bytes by the innermost Python frame of each stack, as memray names sites.
    let mut memtrace: std::collections::BTreeMap<String, u64> = Default::default();
    for stack in process["stacks"].as_array().unwrap() {
        let innermost = stack["frame_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|id| &table[id.as_u64().unwrap() as usize])
            .find(|frame| frame["interpreter"] == "python");
        if let Some(frame) = innermost {
            let site = format!(
                "{}:{}:{}",
                frame["function"].as_str().unwrap(),
                frame["file"].as_str().unwrap(),
                frame["line"]
            );
            *memtrace.entry(site).or_default() += stack["allocated_bytes"].as_u64().unwrap();
        }
    }
    for (site, bytes) in
        [(format!("make_cache:{path}:3"), 400 * 10_001), (format!("other:{path}:6"), 100 * 20_001)]
    {
        assert_eq!(memray.get(&site), Some(&bytes), "memray: {memray:#?}");
        assert_eq!(memtrace.get(&site), Some(&bytes), "memtrace: {memtrace:#?}");
    }
}

/// A script for Debian 13's python3.13, in a directory of its own under its root's /tmp.
struct Debian13Script {
    root: std::path::PathBuf,
    _dir: tempfile::TempDir,
    /// The script's path as the interpreter sees it.
    path: String,
}

impl Debian13Script {
    fn new(name: &str, source: &str) -> Self {
        let root = debian13::root();
        let dir = tempfile::tempdir_in(root.join("tmp")).unwrap();
        script(dir.path(), name, source);
        let inside = Path::new("/tmp").join(dir.path().file_name().unwrap()).join(name);
        Self { root, _dir: dir, path: inside.to_str().unwrap().to_owned() }
    }

    /// chroot's command line that runs it, with `args`.
    fn command<'a>(&'a self, args: &[&'a str]) -> Vec<&'a str> {
        let mut command = vec!["chroot", self.root.to_str().unwrap(), debian13::PYTHON, &self.path];
        command.extend(args);
        command
    }
}

/// CPython 3.13: its layout from its own _Py_DebugOffsets, the allocating thread found in the
/// interpreter's list of threads.
#[test]
fn python_3_13s_frames_are_read_from_its_own_description() {
    let script = Debian13Script::new("cache.py", CACHE);
    let outcome = run_script(&script.command(&[]), &[]);
    assert_cache(outcome.process(), &script.path);
    // Its C library, read through a descriptor (the host has another at that path), is named by
    // its path in the root, as the process sees it: not by the descriptor.
    let leak = leak_through(outcome.process(), &format!("make_cache ({}:4)", script.path));
    let frames = leak["frames"].as_array().unwrap();
    let modules: Vec<&str> = frames.iter().filter_map(|frame| frame["module"].as_str()).collect();
    assert!(modules.contains(&"/lib/x86_64-linux-gnu/libc.so.6"), "{modules:?}");
    let executable = outcome.process()["executable"].as_str().unwrap_or_default().to_owned();
    assert!(executable.ends_with("python3.13"), "the process is Debian 13's python3.13: {executable}");
}

#[test]
fn python_3_13s_threads_have_their_own_frames() {
    let script = Debian13Script::new("threads.py", THREADS);
    let outcome = run_script(&script.command(&[]), &[]);
    assert_threads(outcome.process(), &script.path);
}

#[test]
fn an_attached_python_3_13_has_its_frames_read_too() {
    let script = Debian13Script::new("cache.py", CACHE);
    let command = script.command(&["wait"]);
    let mut spawned = Command::new(command[0]);
    spawned.args(&command[1..]);
    let outcome = memtrace_tests::attached_until_released(spawned, b"g");
    assert_cache(outcome.process(), &script.path);
}

#[test]
fn python_3_13s_generators_and_coroutines_have_their_frames() {
    let script = Debian13Script::new("generators.py", GENERATORS);
    let outcome = run_script(&script.command(&[]), &[]);
    assert_generators(outcome.process(), &script.path);
}
