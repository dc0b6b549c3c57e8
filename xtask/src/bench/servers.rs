//! `cargo xtask bench --servers`: what tracing costs real programs with the allocators servers
//! run, in one run, as ratios to the same work untraced. Each workload runs untraced; under the
//! floor (`memtrace --empty-probes`: programs that do nothing, at memtrace's own probe points);
//! under memtrace exact, `--no-stacks` and `--window 1s/20s`; and under heaptrack. The workloads:
//! Debian's redis-server (jemalloc) driven by redis-benchmark (redis.rs, which also sets
//! memtrace's levels against redis's own `INFO memory`), sqlite3 (glibc) on
//! bench/sqlite_work.sql, and python3 with `PYTHONMALLOC=malloc` on bench/json_work.py, shallow
//! and 40 levels deep, with glibc's malloc, then (shallow) with tcmalloc and with mimalloc
//! preloaded. Variants run in turns, round after round, and the best round of each is kept.
//! Every figure is printed beside the floor's, one table per workload, then all in one markdown
//! table (the guide's, docs/src/bench.md, "Real servers").

use std::{ffi::OsString, path::Path};

use anyhow::{ensure, Context, Result};

use super::python_work::{self, Launch, Runner, Tools};
use crate::{toolchain, workspace_root};

mod redis;

/// The Debian packages of the workloads and of heaptrack, installed when missing.
const PACKAGES: &[&str] = &[
    "redis-server",
    "redis-tools",
    "sqlite3",
    "heaptrack",
    "libtcmalloc-minimal4",
    "libmimalloc2.0",
    "python3",
];
const TCMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4";
const MIMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libmimalloc.so.2";
const ROUNDS: usize = 2;
/// Rounds of bench/json_work.py a run (some 0.2 s untraced here, 15 s under memtrace exact).
const PYTHON_ROUNDS: &str = "8";

/// The ways each workload runs: untraced first, the floor second.
const VARIANTS: [(&str, Runner); 6] = [
    ("untraced", Runner::Untraced),
    ("floor (--empty-probes)", Runner::Memtrace(&["--empty-probes"])),
    ("memtrace exact", Runner::Memtrace(&[])),
    ("memtrace --no-stacks", Runner::Memtrace(&["--no-stacks"])),
    ("memtrace --window 1s/20s", Runner::Memtrace(&["--window", "1s/20s"])),
    ("heaptrack", Runner::Heaptrack),
];
const FLOOR: usize = 1;
/// The variant whose redis run also compares memory figures.
const EXACT: usize = 2;

/// What a workload is.
enum Work {
    Redis,
    Sqlite,
    /// bench/json_work.py with `PYTHONMALLOC=malloc`, nested 40 levels or not, with an allocator
    /// preloaded or glibc's.
    Python {
        deep: bool,
        preload: Option<&'static str>,
    },
}

/// A workload and the best figure of each variant so far.
struct Workload {
    name: &'static str,
    /// What the figure is, for the table's title.
    metric: &'static str,
    work: Work,
    best: [Option<f64>; VARIANTS.len()],
}

impl Workload {
    fn new(name: &'static str, metric: &'static str, work: Work) -> Self {
        Self { name, metric, work, best: [None; VARIANTS.len()] }
    }

    /// Requests a second are better higher, seconds lower.
    fn higher_is_better(&self) -> bool {
        matches!(self.work, Work::Redis)
    }

    fn keep(&mut self, variant: usize, figure: f64) {
        let better = |best: f64| if self.higher_is_better() { figure > best } else { figure < best };
        if self.best[variant].is_none_or(better) {
            self.best[variant] = Some(figure);
        }
    }

    /// How many times slower than untraced a variant ran (its best round against untraced's).
    fn slowdown(&self, variant: usize) -> f64 {
        let (untraced, figure) = (self.best[0].unwrap_or(f64::NAN), self.best[variant].unwrap_or(f64::NAN));
        if self.higher_is_better() {
            untraced / figure
        } else {
            figure / untraced
        }
    }
}

/// Where the runs write (tracers' outputs, redis's log) and what runs them.
struct Bench<'a> {
    memtrace: &'a Path,
    out: &'a Path,
}

pub fn run(memtrace: &Path) -> Result<()> {
    toolchain::ensure_packages(PACKAGES)?;
    for library in [TCMALLOC, MIMALLOC] {
        ensure!(Path::new(library).exists(), "{library} is missing after installing {PACKAGES:?}");
    }
    let out = workspace_root().join("target/bench/servers");
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let context = Bench { memtrace, out: &out };
    let mut workloads = workloads();
    let mut memory = None;
    for round in 0..ROUNDS {
        for workload in &mut workloads {
            for (variant, (name, runner)) in VARIANTS.iter().enumerate() {
                eprintln!(
                    "xtask: bench --servers, round {} of {ROUNDS}: {}, {name}",
                    round + 1,
                    workload.name
                );
                let populate = round == 0 && variant == EXACT;
                let figure = measure(&context, &workload.work, *runner, populate, &mut memory)
                    .with_context(|| format!("{}, {name}", workload.name))?;
                workload.keep(variant, figure);
            }
        }
    }
    workloads.iter().for_each(print_table);
    if let Some(memory) = memory {
        memory.print();
    }
    print_markdown(&workloads);
    Ok(())
}

fn workloads() -> Vec<Workload> {
    let python = |deep, preload| Work::Python { deep, preload };
    let seconds = "seconds of work";
    vec![
        Workload::new(
            "redis-server (jemalloc)",
            "requests a second, mean of SET and GET (redis-benchmark -n 50000 -c 16 -d 64 -t set,get)",
            Work::Redis,
        ),
        Workload::new("sqlite3 (glibc)", "seconds of SQL (bench/sqlite_work.sql)", Work::Sqlite),
        Workload::new("python3 json, shallow (glibc)", seconds, python(false, None)),
        Workload::new("python3 json, 40 levels deep (glibc)", seconds, python(true, None)),
        Workload::new("python3 json, shallow (tcmalloc)", seconds, python(false, Some(TCMALLOC))),
        Workload::new("python3 json, shallow (mimalloc)", seconds, python(false, Some(MIMALLOC))),
    ]
}

/// One run of a workload under one runner: its figure. The redis run of the exact variant in the
/// first round also compares memory figures, kept in `memory`.
fn measure(
    context: &Bench<'_>,
    work: &Work,
    runner: Runner,
    populate: bool,
    memory: &mut Option<redis::Memory>,
) -> Result<f64> {
    match work {
        Work::Redis => {
            let run = redis::run(context, runner, populate)?;
            if run.memory.is_some() {
                *memory = run.memory;
            }
            Ok(run.requests_per_second)
        }
        Work::Sqlite => sqlite_seconds(context, runner),
        Work::Python { deep, preload } => {
            let tools = Tools { memtrace: context.memtrace, memray: Path::new("memray") };
            let script = workspace_root().join("bench/json_work.py");
            let mut command =
                python_work::command(runner, tools, &script, (preload.map(Path::new), true), context.out);
            command.arg(PYTHON_ROUNDS);
            if *deep {
                command.arg("--deep");
            }
            python_work::seconds_of(command)
        }
    }
}

/// sqlite3 on bench/sqlite_work.sql in memory: the seconds its statements took, as `.timer on`
/// says (the sum of their `real` times).
fn sqlite_seconds(context: &Bench<'_>, runner: Runner) -> Result<f64> {
    let script = workspace_root().join("bench/sqlite_work.sql");
    let mut read = OsString::from(".read ");
    read.push(&script);
    let argv = ["/usr/bin/sqlite3".into(), "-bail".into(), ":memory:".into(), read];
    let program = Launch { env: &[], argv: &argv, memtrace_args: &[] };
    let mut command = python_work::launch(runner, context.memtrace, &program, &context.out.join("sqlite"));
    let stdout = super::stdout_of(&mut command)?;
    let times = stdout.lines().filter_map(|line| line.strip_prefix("Run Time: real "));
    let seconds = times
        .map(|rest| rest.split_whitespace().next().unwrap_or_default().parse::<f64>())
        .collect::<Result<Vec<f64>, _>>()
        .with_context(|| format!("{command:?}: a `Run Time` line without seconds"))?;
    ensure!(seconds.len() >= 10, "{command:?} timed {} statements, not all of them: {stdout}", seconds.len());
    Ok(seconds.iter().sum())
}

fn print_table(workload: &Workload) {
    let unit = if workload.higher_is_better() { "req/s" } else { "s" };
    println!("{}: {} (best of {ROUNDS} rounds, one run):", workload.name, workload.metric);
    let floor = workload.slowdown(FLOOR);
    for (variant, (name, _)) in VARIANTS.iter().enumerate() {
        let slowdown = workload.slowdown(variant);
        println!(
            "  {name:<26} {:>12.3} {unit:<5}   x untraced {slowdown:>7.2}   floor x untraced {floor:>6.2}   x floor {:>6.2}",
            workload.best[variant].unwrap_or(f64::NAN),
            slowdown / floor
        );
    }
}

/// Every workload in one markdown table, each figure as slower than untraced, with the floor's
/// figure beside it.
fn print_markdown(workloads: &[Workload]) {
    let names: Vec<&str> = VARIANTS[FLOOR + 1..].iter().map(|(name, _)| *name).collect();
    println!("\n| workload | floor | {} |", names.join(" | "));
    println!("|---|---|{}", "---|".repeat(names.len()));
    for workload in workloads {
        let floor = workload.slowdown(FLOOR);
        let cells: Vec<String> = (FLOOR + 1..VARIANTS.len())
            .map(|variant| {
                let slowdown = workload.slowdown(variant);
                format!("{slowdown:.2}x ({:.2}x floor)", slowdown / floor)
            })
            .collect();
        println!("| {} | {floor:.2}x | {} |", workload.name, cells.join(" | "));
    }
}
