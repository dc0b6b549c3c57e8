//! What tracing costs real Python work (bench/json_work.py: JSON encoding and decoding, timed
//! inside the script so that start-up and shutdown are not counted): untraced; memtrace exact
//! with stacks (with Python's frames, and without them), without stacks and sampled (`--sample
//! 512KiB`); heaptrack; memray (PyPI); and the fleet mode,
//! `--app-sampled`, on the same work with bench/otel_sampler.c preloaded (glibc's malloc made a
//! sampling allocator that fires OpenTelemetry's otel_memory probes), set against the same
//! preloaded work untraced, so that the ratio is what memtrace adds. Last, the same work with
//! CPython's own small-object allocator off (`PYTHONMALLOC=malloc`): Debian's python3 takes most
//! of its allocations from pymalloc's arenas, so the stock work calls malloc only some 10,000
//! times a run; with it off every object is a malloc and a free, as in programs without an
//! allocator of their own. Variants run in turns and the best round of each is kept. Then the
//! same work, 300 rounds, medians of 7 in turns: untraced, exact, free and realloc alone (the
//! floor of any window), `--window 150ms/3s` (5%, as 1s/20s), heaptrack (`cargo xtask bench
//! --windowed` alone).

use std::{
    ffi::OsString,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::{compile_c, toolchain, workspace_root};

const ROUNDS: usize = 3;

/// How one variant runs the script.
#[derive(Clone, Copy)]
pub(super) enum Runner {
    Untraced,
    Memtrace(&'static [&'static str]),
    Heaptrack,
    /// Bloomberg's memray (PyPI), which runs the script in Debian's python3 itself.
    Memray,
}

/// How python3 itself runs, whoever runs it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Python {
    /// As Debian ships it.
    Stock,
    /// LD_PRELOAD the sampling allocator.
    Sampler,
    /// `PYTHONMALLOC=malloc`: every object from malloc.
    SystemMalloc,
}

struct Variant {
    name: &'static str,
    runner: Runner,
    python: Python,
    seconds: f64,
}

impl Variant {
    fn new(name: &'static str, runner: Runner, python: Python) -> Self {
        Self { name, runner, python, seconds: f64::MAX }
    }
}

pub fn run(memtrace: &Path) -> Result<()> {
    toolchain::ensure_packages(&["python3", "python3-venv", "heaptrack"])?;
    let memray = ensure_memray()?;
    let sampler = compile_c("bench/otel_sampler.c", "bench", &["-shared", "-fPIC", "-lm"])?;
    let script = workspace_root().join("bench/json_work.py");
    let out = workspace_root().join("target/bench");
    let mut variants = [
        Variant::new("untraced", Runner::Untraced, Python::Stock),
        Variant::new("memtrace exact", Runner::Memtrace(&[]), Python::Stock),
        Variant::new("  no Python frames", Runner::Memtrace(&["--no-interpreter-frames"]), Python::Stock),
        Variant::new("memtrace --no-stacks", Runner::Memtrace(&["--no-stacks"]), Python::Stock),
        Variant::new("memtrace --sample 512KiB", Runner::Memtrace(&["--sample", "512KiB"]), Python::Stock),
        Variant::new("heaptrack", Runner::Heaptrack, Python::Stock),
        Variant::new("memray", Runner::Memray, Python::Stock),
        Variant::new("sampler, untraced", Runner::Untraced, Python::Sampler),
        Variant::new("sampler, --app-sampled", Runner::Memtrace(&["--app-sampled"]), Python::Sampler),
        Variant::new("malloc, untraced", Runner::Untraced, Python::SystemMalloc),
        Variant::new("malloc, memtrace exact", Runner::Memtrace(&[]), Python::SystemMalloc),
        Variant::new("malloc, --no-stacks", Runner::Memtrace(&["--no-stacks"]), Python::SystemMalloc),
        Variant::new("malloc, heaptrack", Runner::Heaptrack, Python::SystemMalloc),
    ];
    for _ in 0..ROUNDS {
        for variant in &mut variants {
            let preload = (variant.python == Python::Sampler).then_some(sampler.as_path());
            let malloc = variant.python == Python::SystemMalloc;
            let tools = Tools { memtrace, memray: &memray };
            let seconds = seconds_of(command(variant.runner, tools, &script, (preload, malloc), &out))?;
            variant.seconds = variant.seconds.min(seconds);
        }
    }
    print(&variants, &format!("python3 json work (bench/json_work.py, best of {ROUNDS})"));
    windowed(Tools { memtrace, memray: &memray }, &script, &out)
}

/// `cargo xtask bench --windowed`: the long work alone.
pub fn run_windowed(memtrace: &Path) -> Result<()> {
    toolchain::ensure_packages(&["python3", "heaptrack"])?;
    let script = workspace_root().join("bench/json_work.py");
    let out = workspace_root().join("target/bench");
    windowed(Tools { memtrace, memray: Path::new("memray") }, &script, &out)
}

/// The windowed comparison: 300 rounds (about 3.3 s here), windows of 5% (as 1s/20s), each variant
/// run `REPEATS` times in turns and its median kept: one run here varies by 5% and more, more than
/// what is measured (heaptrack once ran 0.96x of untraced).
const LONG_ROUNDS: &str = "300";
const WINDOW: &str = "150ms/3s";
const REPEATS: usize = 7;

/// The work untraced, exact, with the window's probes only (its first 50 ms, then free and realloc
/// alone: the floor of any window), in windows, and under heaptrack.
fn windowed(tools: Tools<'_>, script: &Path, out: &Path) -> Result<()> {
    let mut variants = [
        Variant::new("untraced", Runner::Untraced, Python::Stock),
        Variant::new("memtrace exact", Runner::Memtrace(&[]), Python::Stock),
        Variant::new("  free and realloc alone", Runner::Memtrace(&["--window", "50ms/1h"]), Python::Stock),
        Variant::new("memtrace --window 150ms/3s", Runner::Memtrace(&["--window", WINDOW]), Python::Stock),
        Variant::new("heaptrack", Runner::Heaptrack, Python::Stock),
    ];
    let mut times = vec![Vec::with_capacity(REPEATS); variants.len()];
    for _ in 0..REPEATS {
        for (variant, times) in variants.iter().zip(&mut times) {
            let mut command = command(variant.runner, tools, script, (None, false), out);
            command.arg(LONG_ROUNDS);
            times.push(seconds_of(command)?);
        }
    }
    for (variant, times) in variants.iter_mut().zip(&mut times) {
        times.sort_by(f64::total_cmp);
        variant.seconds = times[times.len() / 2];
    }
    print(&variants, &format!("the same work, {LONG_ROUNDS} rounds, median of {REPEATS} in turns"));
    Ok(())
}

fn print(variants: &[Variant], title: &str) {
    let untraced = variants[0].seconds;
    // Each variant beside the same python run untraced, where that is not the stock one.
    let base =
        |python: Python| variants.iter().find(|v| v.python == python && matches!(v.runner, Runner::Untraced));
    println!("{title}:");
    for variant in variants {
        let against_base = match (variant.python, base(variant.python)) {
            (Python::Stock, _) | (_, None) => String::new(),
            (_, Some(base)) => format!("   x the same untraced {:.3}", variant.seconds / base.seconds),
        };
        println!(
            "  {:<28} {:>7.3} s   x untraced {:>5.2}{against_base}",
            variant.name,
            variant.seconds,
            variant.seconds / untraced
        );
    }
}

/// The command of one variant; `(preload, malloc)`: the library python preloads, and whether
/// pymalloc is off. Both go to python alone, through env (see `launch`).
pub(super) fn command(
    runner: Runner,
    Tools { memtrace, memray }: Tools<'_>,
    script: &Path,
    (preload, malloc): (Option<&Path>, bool),
    out: &Path,
) -> Command {
    let mut assignments: Vec<String> = Vec::new();
    if let Some(preload) = preload {
        assignments.push(format!("LD_PRELOAD={}", preload.display()));
    }
    if malloc {
        assignments.push("PYTHONMALLOC=malloc".to_owned());
    }
    if let Runner::Memray = runner {
        let mut command = Command::new("env");
        command.args(&assignments).arg(memray).args(["run", "--quiet", "--force", "-o"]);
        command.arg(out.join("python.memray")).arg(script);
        return command;
    }
    // Debian's python3, by its path: a python3 earlier on PATH may be a wrapper (pyenv's shims are
    // shell scripts), which heaptrack would trace instead.
    let python = [OsString::from("/usr/bin/python3"), script.into()];
    launch(
        runner,
        memtrace,
        &Launch { env: &assignments, argv: &python, memtrace_args: &[] },
        &out.join("python"),
    )
}

/// A program to run under one of the runners.
pub(super) struct Launch<'a> {
    /// `NAME=value` assignments for the program alone.
    pub env: &'a [String],
    /// The program and its arguments.
    pub argv: &'a [OsString],
    /// memtrace's options beyond the runner's own (e.g. `--summary PATH`).
    pub memtrace_args: &'a [OsString],
}

/// `program` run untraced, under memtrace or under heaptrack (not memray, which runs python
/// scripts alone), the tracer writing `out` with its own extension. The assignments go to the
/// program through env: never to memtrace; to heaptrack too, whose own programs ignore them or
/// run fine with them (heaptrack must run the program itself: run through env, it traces env and
/// not what env execs).
pub(super) fn launch(runner: Runner, memtrace: &Path, program: &Launch<'_>, out: &Path) -> Command {
    let Launch { env, argv, memtrace_args } = program;
    match runner {
        Runner::Untraced => {
            let mut command = Command::new("env");
            command.args(*env).args(*argv);
            command
        }
        Runner::Memtrace(args) => {
            let mut command = crate::as_root(memtrace);
            command.args(args).args(*memtrace_args).arg("-o").arg(out.with_extension("json"));
            command.arg("--").arg("env").args(*env).args(*argv);
            command
        }
        Runner::Heaptrack => {
            let mut command = Command::new("env");
            command.args(*env).arg("heaptrack").arg("-o").arg(out.with_extension("heaptrack"));
            command.args(*argv);
            command
        }
        Runner::Memray => unreachable!("memray runs python scripts alone: see `command`"),
    }
}

/// The tracers a variant may run.
#[derive(Clone, Copy)]
pub(super) struct Tools<'a> {
    pub memtrace: &'a Path,
    pub memray: &'a Path,
}

/// The memray release the bench runs (the one tests/src/memray.rs compares with).
const MEMRAY_VERSION: &str = "1.20.0";

/// memray in a venv of Debian's python3 under target/ (the tests' venv), installed when missing.
fn ensure_memray() -> Result<PathBuf> {
    let venv = workspace_root().join("target/memray-venv");
    let memray = venv.join("bin/memray");
    let check = format!("import importlib.metadata as m; assert m.version('memray') == '{MEMRAY_VERSION}'");
    let python = venv.join("bin/python3");
    if python.exists() && Command::new(&python).args(["-c", &check]).status().is_ok_and(|s| s.success()) {
        return Ok(memray);
    }
    let made = Command::new("/usr/bin/python3").arg("-m").arg("venv").arg(&venv).status()?;
    let pip = venv.join("bin/pip");
    if !made.success()
        || !Command::new(&pip)
            .args(["install", "--quiet", &format!("memray=={MEMRAY_VERSION}")])
            .status()?
            .success()
    {
        bail!("installing memray {MEMRAY_VERSION} from PyPI into {} failed", venv.display());
    }
    Ok(memray)
}

/// Runs the script and reads the seconds it printed.
pub(super) fn seconds_of(mut command: Command) -> Result<f64> {
    let stdout = super::stdout_of(&mut command)?;
    let Some(seconds) = stdout.lines().find_map(|line| line.strip_prefix("seconds ")) else {
        bail!("{command:?} printed no `seconds` line: {stdout}");
    };
    seconds.trim().parse().context("the script's seconds")
}
