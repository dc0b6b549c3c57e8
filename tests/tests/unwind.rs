//! Stacks through code without frame pointers, unwound in the kernel from .eh_frame tables: a call
//! chain built with -O2 -fomit-frame-pointer, a leak through libc's strdup (libc has no frame
//! pointers), and a library loaded with dlopen after memtrace attached. Each test waits for
//! memtrace's "unwind tables loaded" line before the fixture allocates.

use std::process::Command;

use memtrace_tests::{fixture, fixture_variant, Memtrace, Outcome, Spawned};
use serde_json::Value;

const NO_FRAME_POINTERS: [&str; 2] = ["-O2", "-fomit-frame-pointer"];

fn stack_names(leak: &Value) -> Vec<&str> {
    leak["stack"].as_array().unwrap().iter().map(|f| f.as_str().unwrap()).collect()
}

fn leaks(process: &Value) -> &Vec<Value> {
    process["leaks"].as_array().unwrap()
}

/// The leak whose innermost frame is `function`; exactly one.
fn only_leak_from<'a>(process: &'a Value, function: &str) -> &'a Value {
    let from: Vec<&Value> = leaks(process).iter().filter(|leak| leak["stack"][0] == function).collect();
    assert_eq!(from.len(), 1, "one leak group from {function}: {:#}", process["leaks"]);
    from[0]
}

/// The stack starts with `chain`, innermost first, and every frame is named or module+offset.
fn assert_chain(leak: &Value, chain: &[&str]) {
    let names = stack_names(leak);
    assert!(names.starts_with(chain), "the stack should start with {chain:?}: {names:?}");
    assert!(names.iter().all(|name| !name.contains("[unknown]")), "a frame outside every mapping: {names:?}");
}

/// The fixture, held on stdin; memtrace attached to it with its tables loaded.
fn attach(fixture: &std::path::Path, args: &[&str]) -> (Spawned, memtrace_tests::Running) {
    let (target, memtrace, _) = attach_with(fixture, args, &[]);
    (target, memtrace)
}

/// `attach`, with more memtrace options; also the fixture's "ready" line.
fn attach_with(
    fixture: &std::path::Path,
    args: &[&str],
    options: &[&str],
) -> (Spawned, memtrace_tests::Running, String) {
    let mut target = Spawned::spawn({
        let mut command = Command::new(fixture);
        command.args(args);
        command
    });
    let ready = target.wait_for_stdout("ready");
    let pid = target.pid().to_string();
    let mut memtrace = Memtrace::new().args(["--pid", &pid]).args(options).spawn();
    memtrace.wait_for_stderr_containing(&format!("unwind tables loaded for pid {pid}"));
    memtrace.wait_for_stderr("memtrace: tracing");
    (target, memtrace, ready)
}

/// The fixture traced by pid (with memtrace's `options`) from its "ready" line to its end: the
/// outcome, the fixture's pid and its "ready" line.
fn run_attached(program: &std::path::Path, options: &[&str]) -> (Outcome, u32, String) {
    let (mut target, memtrace, ready) = attach_with(program, &[], options);
    let pid = target.pid();
    target.send(b"g");
    assert!(target.wait().success());
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    (outcome, pid, ready)
}

/// unwind_chain.c built with -O2 -fomit-frame-pointer, traced by pid to its end.
fn run_chain() -> Outcome {
    run_attached(&fixture_variant("unwind_chain", "nofp", &NO_FRAME_POINTERS), &[]).0
}

#[test]
fn chain_without_frame_pointers_is_whole_and_one_group() {
    let outcome = run_chain();
    let process = outcome.process();
    let leak = only_leak_from(process, "grow_table");
    assert_eq!(leak["bytes"], 4 * 4096, "{leak:#}");
    assert_eq!(leak["allocations"], 4, "{leak:#}");
    assert_chain(leak, &["grow_table", "build_index", "parse_request", "main"]);
    // The strdup leak is the only other group.
    assert_eq!(leaks(process).len(), 2, "{:#}", process["leaks"]);
    let stops = &process["unwind_stops"];
    assert_eq!(stops["whole"], process["allocations"], "every stack reaches _start: {stops:#}");
    assert_eq!(outcome.summary()["lost_events"], 0);
}

/// Stacks that differ from the CPU's last walk only in a word on the stack are told apart; stacks
/// that repeat it are taken whole (unwind_memo.c: alternating callers, then runs of each).
#[test]
fn stacks_that_differ_only_in_a_return_address_stay_apart() {
    let (outcome, ..) = run_attached(&fixture_variant("unwind_memo", "nofp", &NO_FRAME_POINTERS), &[]);
    let process = outcome.process();
    assert_eq!(process["allocations"], 2000, "{process:#}");
    assert_eq!(leaks(process).len(), 2, "one group per caller: {:#}", process["leaks"]);
    for caller in ["caller_a", "caller_b"] {
        let leak = leaks(process)
            .iter()
            .find(|leak| stack_names(leak).get(1) == Some(&caller))
            .unwrap_or_else(|| panic!("no leak through {caller}: {:#}", process["leaks"]));
        assert_eq!(leak["allocations"], 1000, "{leak:#}");
        assert_eq!(leak["bytes"], 48_000, "{leak:#}");
        assert_chain(leak, &["record", caller, "main"]);
    }
    assert_eq!(process["unwind_stops"]["whole"], 2000, "{:#}", process["unwind_stops"]);
}

/// Deep stacks taken over from the slot's last walk where their frames meet it are still told
/// apart far out (deep_paths.c: 64 frames and more, the leaf and the path near main alternating):
/// four stacks, 1000 allocations and 40000 bytes each, every one whole.
#[test]
fn deep_stacks_that_differ_far_out_stay_apart() {
    let (outcome, ..) = run_attached(&fixture_variant("deep_paths", "nofp", &NO_FRAME_POINTERS), &[]);
    let process = outcome.process();
    assert_eq!(process["allocations"], 4000, "{process:#}");
    assert_eq!(leaks(process).len(), 4, "one group per leaf and path: {:#}", process["leaks"]);
    for leaf in ["leaf_1", "leaf_2"] {
        for path in ["path_a", "path_b"] {
            let leak = leaks(process)
                .iter()
                .find(|leak| {
                    let names = stack_names(leak);
                    names.first() == Some(&leaf) && names.get(62) == Some(&path)
                })
                .unwrap_or_else(|| panic!("no leak through {leaf} and {path}: {:#}", process["leaks"]));
            assert_eq!((&leak["allocations"], &leak["bytes"]), (&1000.into(), &40_000.into()), "{leak:#}");
            let mut chain = vec![leaf];
            chain.extend(["descend"; 61]);
            chain.extend([path, "main"]);
            assert_chain(leak, &chain);
        }
    }
    assert_eq!(process["unwind_stops"]["whole"], 4000, "{:#}", process["unwind_stops"]);
}

/// `--debug-bpf` says why a stack ends short, once per new stack: jit_alloc.c allocates 10 times
/// from code in no file (an anonymous executable page), where the walk must stop.
#[test]
fn debug_bpf_says_why_a_new_stack_ends_short() {
    let (outcome, pid, ready) = run_attached(&fixture("jit_alloc"), &["--debug-bpf"]);
    let page = u64::from_str_radix(ready.trim_start_matches("ready ").trim(), 16).expect("ready <page>");
    let process = outcome.process();
    assert_eq!(process["allocations"], 10, "{process:#}");
    assert_eq!(process["unwind_stops"]["no_mapping"], 10, "{:#}", process["unwind_stops"]);
    // The return address into the page: past its `call *%rax`, 16 bytes in.
    let expected = format!(
        "memtrace: bpf: pid {pid}: a new stack ends after 1 frames: no_mapping (last frame at {:x})",
        page + 16
    );
    let said: Vec<&str> = outcome.stderr.lines().filter(|line| line.starts_with("memtrace: bpf:")).collect();
    assert_eq!(said, [expected.as_str()], "stderr:\n{}", outcome.stderr);
}

#[test]
fn leak_through_strdup_names_strdup_then_its_caller() {
    let outcome = run_chain();
    let process = outcome.process();
    let leak = leaks(process)
        .iter()
        .find(|leak| stack_names(leak).get(1) == Some(&"copy_name"))
        .unwrap_or_else(|| panic!("no leak through copy_name: {:#}", process["leaks"]));
    assert_eq!(leak["bytes"], 2 * 12, "{leak:#}");
    assert_eq!(leak["allocations"], 2, "{leak:#}");
    // glibc exports strdup and __strdup at one address: the public name is the one shown.
    assert_chain(leak, &["strdup", "copy_name", "main"]);
}

#[test]
fn library_loaded_later_gets_its_table_and_whole_stacks() {
    let library =
        fixture_variant("unwind_dlopen_lib", "so", &["-O2", "-fomit-frame-pointer", "-shared", "-fPIC"]);
    let program = fixture_variant("unwind_dlopen", "main", &[]);
    let (mut target, memtrace) = attach(&program, &[library.to_str().unwrap()]);
    let mut memtrace = memtrace;
    let pid = target.pid();
    // Files before dlopen: the line names how many.
    target.send(b"g");
    target.wait_for_stdout("loaded");
    let name = library.file_name().unwrap().to_str().unwrap().to_owned();
    memtrace.wait_for_stderr_containing(&format!("unwind tables loaded for pid {pid} (4 files)"));
    target.send(b"g");
    assert!(target.wait().success());
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    let process = outcome.process();
    let leak = only_leak_from(process, "lib_fill");
    assert_eq!(leak["bytes"], 3 * 2000, "{leak:#}");
    assert_chain(leak, &["lib_fill", "lib_leak", "main"]);
    assert!(leak["frames"][0]["module"].as_str().unwrap().ends_with(&name), "{leak:#}");
}

/// A library a launched program loads and calls at once (unwind_dlopen.c with "now"): the program is
/// held at dlopen's return until the library's table is in, so the 3 blocks of 2000 bytes it leaks
/// right away have whole stacks, through the library down to `_start`.
#[test]
fn a_library_called_right_after_dlopen_has_whole_stacks() {
    let library =
        fixture_variant("unwind_dlopen_lib", "so", &["-O2", "-fomit-frame-pointer", "-shared", "-fPIC"]);
    let program = fixture_variant("unwind_dlopen", "main", &[]);
    let outcome = Memtrace::new().arg("--").arg(&program).arg(&library).arg("now").run();
    outcome.assert_exit_code(0);
    let leak = only_leak_from(outcome.process(), "lib_fill");
    assert_eq!((leak["bytes"].as_u64(), leak["allocations"].as_u64()), (Some(6000), Some(3)), "{leak:#}");
    assert_chain(leak, &["lib_fill", "lib_leak", "main"]);
    assert_eq!(stack_names(leak).last(), Some(&"_start"), "{leak:#}");
    assert_eq!(outcome.summary()["library_loads_held"], 1, "one dlopen, held once");
}

/// Debian's python3 importing modules whose C extensions it loads (`_json`, `_decimal`, `_ssl`'s
/// neighbours), each extension's module init allocating right after its dlopen: at least 95% of
/// the live bytes are in stacks that reach `_start` (without the hold at dlopen, 93.9%: the
/// extensions' frames had no table yet).
#[test]
fn a_stock_python3_importing_extensions_unwinds_to_start() {
    let imports = "import json, email.parser, http.client, decimal, os\nos._exit(0)\n";
    let outcome = Memtrace::new().arg("--").arg("/usr/bin/python3").arg("-c").arg(imports).run();
    outcome.assert_exit_code(0);
    let summary = outcome.summary();
    let frames = summary["frame_table"].as_array().expect("frame_table");
    let process = outcome.process();
    let (mut whole, mut all) = (0, 0);
    for stack in process["stacks"].as_array().expect("stacks") {
        let live = stack["live_bytes"].as_u64().unwrap();
        all += live;
        let ids = stack["frame_ids"].as_array().unwrap();
        if ids.iter().any(|id| frames[id.as_u64().unwrap() as usize]["function"] == "_start") {
            whole += live;
        }
    }
    assert!(
        all > 0 && whole * 100 >= all * 95,
        "{whole} of {all} live bytes reach _start: {:#}",
        process["unwind_stops"]
    );
    assert!(summary["library_loads_held"].as_u64() > Some(0), "no dlopen held");
}

/// A stock distribution program launched by memtrace: Debian's /usr/bin/python3 (no frame pointers,
/// no .symtab) keeping 300 strings of about 5 KB, built by the interpreter itself (no extension
/// module, which would be dlopen'ed while the program runs). The biggest leak's stack goes through
/// the interpreter down to its entry, with the CPython functions .dynsym names, and no frame
/// outside the process's file mappings.
#[test]
fn a_stock_python3_leak_has_its_interpreter_stack() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("keep.py");
    let source = "import os\nkeep = ['x' * 5000 + str(i) for i in range(300)]\nos._exit(0)\n";
    std::fs::write(&script, source).unwrap();
    let outcome = Memtrace::new().arg("--").arg("/usr/bin/python3").arg(&script).run();
    outcome.assert_exit_code(0);
    let process = outcome.process();
    let biggest = leaks(process).iter().max_by_key(|leak| leak["bytes"].as_u64()).expect("a leak");
    let names = stack_names(biggest);
    // Most of the strings (the list, and a few strings, may come from other call paths).
    assert!(biggest["bytes"].as_u64().unwrap() >= 250 * 5000, "{biggest:#}");
    for function in ["_PyEval_EvalFrameDefault", "Py_RunMain", "_start"] {
        assert!(names.contains(&function), "{function} is not on the stack: {names:?}");
    }
    assert!(names.iter().all(|name| !name.contains("[unknown]")), "a frame outside every mapping: {names:?}");
}

/// deep_recursion.c built without frame pointers, launched by memtrace with `args`.
fn run_deep(args: &[&str]) -> Outcome {
    let program = fixture_variant("deep_recursion", "nofp", &NO_FRAME_POINTERS);
    let outcome = Memtrace::new().arg("--").arg(&program).args(args).run();
    outcome.assert_exit_code(0);
    outcome
}

/// The one leak of deep_recursion.c: 2 blocks of 4000 bytes from the deepest call.
fn deep_leak(process: &Value) -> &Value {
    let leak = only_leak_from(process, "descend");
    assert_eq!((leak["bytes"].as_u64(), leak["allocations"].as_u64()), (Some(8000), Some(2)), "{leak:#}");
    leak
}

/// A stack of 104 frames (100 calls of descend, then main down to _start) is taken whole, from
/// the launched program's first instruction: before memtrace has written its mapping table, the
/// unwinder finds its files through the kernel's own mappings.
#[test]
fn a_stack_of_a_hundred_frames_is_whole_from_the_first_instruction() {
    let outcome = run_deep(&["100"]);
    let process = outcome.process();
    let names = stack_names(deep_leak(process));
    assert_eq!(names.len(), 104, "{names:?}");
    assert!(names[..100].iter().all(|name| *name == "descend"), "{names:?}");
    assert_eq!(names[100], "main", "{names:?}");
    assert_eq!(names.last(), Some(&"_start"), "{names:?}");
    assert_eq!(process["unwind_stops"]["whole"], 2, "{:#}", process["unwind_stops"]);
    // The text report writes the recursion once, with its count.
    assert!(outcome.stderr.contains("from descend (x100) <- main <- "), "{}", outcome.stderr);
}

/// A stack deeper than memtrace's 128 frames keeps its innermost 128, and says why it ends.
#[test]
fn a_stack_past_the_depth_limit_keeps_128_frames_and_says_so() {
    let outcome = run_deep(&["200"]);
    let process = outcome.process();
    let names = stack_names(deep_leak(process));
    assert_eq!(names.len(), 128, "{names:?}");
    assert!(names.iter().all(|name| *name == "descend"), "{names:?}");
    let stops = &process["unwind_stops"];
    assert_eq!((stops["depth_limit"].as_u64(), stops["whole"].as_u64()), (Some(2), Some(0)), "{stops:#}");
}

/// Programs that live a few milliseconds, as a build runs them: each of five runs of the fixture
/// (a new program at the first, stopped at its exec until its tables are built; known after) has
/// its stacks whole from its first allocation.
#[test]
fn short_lived_programs_a_shell_runs_have_whole_stacks() {
    let program = fixture_variant("deep_recursion", "nofp", &NO_FRAME_POINTERS);
    let script = format!("for i in 1 2 3 4 5; do {} 20; done", program.display());
    let outcome = Memtrace::new().args(["--", "sh", "-c", &script]).run();
    outcome.assert_exit_code(0);
    let processes = outcome.summary()["processes"].as_array().unwrap();
    // The kernel's command name: the file's name, cut to 15 bytes.
    let runs: Vec<&Value> = processes.iter().filter(|p| p["comm"] == "deep_recursion-").collect();
    assert_eq!(runs.len(), 5, "{processes:#?}");
    for run in runs {
        assert_eq!(stack_names(deep_leak(run)).len(), 24, "{run:#}");
        assert_eq!(run["unwind_stops"]["whole"], 2, "{:#}", run["unwind_stops"]);
    }
}

/// Debian's gcc compiling a file: cc1 lives a fraction of a second and allocates thousands of
/// times from its first moments; none of its stacks falls back to frame pointers (they all did,
/// each cut after a frame, before the unwinder could find files through the kernel's mappings).
#[test]
fn a_compilers_stacks_are_unwound_from_its_first_allocation() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("unit.c");
    std::fs::write(&source, "#include <stdlib.h>\nint f(int n) { return n ? abs(n) : 0; }\n").unwrap();
    let object = dir.path().join("unit.o");
    let outcome = Memtrace::new().args(["--", "gcc", "-O2", "-c"]).arg(&source).arg("-o").arg(&object).run();
    outcome.assert_exit_code(0);
    let processes = outcome.summary()["processes"].as_array().unwrap();
    let cc1 = processes.iter().find(|p| p["comm"] == "cc1").unwrap_or_else(|| panic!("{processes:#?}"));
    let stops = &cc1["unwind_stops"];
    let allocations = cc1["allocations"].as_u64().unwrap();
    assert!(allocations > 1000, "{cc1:#}");
    assert_eq!(stops["no_mappings"], 0, "{stops:#}");
    // Whole down to _start, but for the odd frame an unwind table does not cover.
    assert!(stops["whole"].as_u64().unwrap() * 100 >= allocations * 99, "{stops:#}");
}
