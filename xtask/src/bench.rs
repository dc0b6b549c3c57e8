//! What tracing costs the traced program, in one run, as ratios: a malloc/free loop (one thread,
//! 64 live slots, mixed sizes, built with frame pointers) untraced; under the floor of exact
//! tracing (programs that do nothing on the same probe points, `memtrace --empty-probes`); and
//! under memtrace exact with and without stacks, and sampled. The traced variants are measured in turns, round
//! after round, and the best round of each is kept, so that a noisy moment does not favour one.
//! Then what following a process tree costs everyone else: the same loop, untraced, in a process
//! outside the tree while memtrace follows one (its probes then fire in every process that maps
//! libc); the traced cost of a subsystem report on a 5-byte and on a 1-byte nop site; and how long
//! a whole run of `memtrace -- true` takes.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use crate::{as_root, compile_c, workspace_root};

const PAIRS: &str = "400000";
const ROUNDS: usize = 5;

/// One way of running the loop.
struct Variant {
    name: &'static str,
    /// memtrace's options, or None for the untraced loop.
    memtrace_args: Option<&'static [&'static str]>,
    best_ns: f64,
}

pub fn run(memtrace: &Path) -> Result<()> {
    let program = compile_c("bench/malloc_loop.c", "bench", &[])?;
    let trace = workspace_root().join("target/bench/trace.json");
    let mut variants = [
        Variant { name: "untraced", memtrace_args: None, best_ns: f64::MAX },
        Variant {
            name: "floor (empty programs)",
            memtrace_args: Some(&["--empty-probes"]),
            best_ns: f64::MAX,
        },
        Variant { name: "memtrace", memtrace_args: Some(&[]), best_ns: f64::MAX },
        Variant { name: "memtrace --no-stacks", memtrace_args: Some(&["--no-stacks"]), best_ns: f64::MAX },
        Variant {
            name: "memtrace --no-children",
            memtrace_args: Some(&["--no-children"]),
            best_ns: f64::MAX,
        },
        Variant {
            name: "memtrace --sample 512KiB",
            memtrace_args: Some(&["--sample", "512KiB"]),
            best_ns: f64::MAX,
        },
    ];
    for _ in 0..ROUNDS {
        for variant in &mut variants {
            let mut command = match variant.memtrace_args {
                None => Command::new(&program),
                Some(args) => {
                    let mut command = as_root(memtrace);
                    command.arg("-o").arg(&trace).args(args).arg("--").arg(&program);
                    command
                }
            };
            variant.best_ns = variant.best_ns.min(ns_per_pair(command.arg(PAIRS))?);
        }
    }
    let floor = variants[1].best_ns;
    let untraced = variants[0].best_ns;
    println!(
        "malloc/free pair ({PAIRS} pairs, 64 live slots, mixed sizes; best of {ROUNDS} rounds, one run):"
    );
    for variant in &variants {
        println!(
            "  {:<24} {:>8.1} ns   x untraced {:>6.1}   x floor {:>5.2}",
            variant.name,
            variant.best_ns,
            variant.best_ns / untraced,
            variant.best_ns / floor
        );
    }
    let outside = ns_outside_a_followed_tree(memtrace, &program, &trace)?;
    println!(
        "  {:<24} {:>8.1} ns   x untraced {:>6.1}   (an untraced process while memtrace follows a tree)",
        "outside a followed tree",
        outside,
        outside / untraced
    );
    let [nop5, nop1] = usdt_report_ns(memtrace, &trace)?;
    println!(
        "subsystem report traced ({REPORTS} MEMTRACE_REPORT_DELTA, best of {ROUNDS}): 5-byte nop site \
         (memtrace.h with MEMTRACE_NOP5_SITES) {nop5:.1} ns, 1-byte nop site (the header's default, \
         as sdt.h's STAP_PROBE2) {nop1:.1} ns"
    );
    let whole_run = whole_run_time(memtrace, &trace)?;
    println!(
        "a whole run of `memtrace -- true` (load, attach, detach, outputs): {:.0} ms",
        whole_run.as_secs_f64() * 1e3
    );
    Ok(())
}

/// The loop run outside memtrace's tree while memtrace follows `sleep` and its descendants: the
/// probes fire in the loop's process too and are filtered out in the kernel. Best of ROUNDS.
fn ns_outside_a_followed_tree(memtrace: &Path, program: &Path, trace: &Path) -> Result<f64> {
    let mut follower = as_root(memtrace)
        .arg("-o")
        .arg(trace)
        .args(["--", "sleep", "600"])
        .stderr(Stdio::piped())
        .spawn()
        .context("starting memtrace -- sleep 600")?;
    let stderr = follower.stderr.take().context("memtrace's stderr")?;
    let mut lines = BufReader::new(stderr).lines().map_while(Result::ok);
    // Probes are in place once memtrace says it is tracing.
    let measured = match lines.any(|line| line.starts_with("memtrace: tracing")) {
        true => {
            (0..ROUNDS).map(|_| ns_per_pair(Command::new(program).arg(PAIRS))).collect::<Result<Vec<f64>>>()
        }
        false => Err(anyhow::anyhow!("memtrace -- sleep 600 never said it was tracing")),
    };
    let _ = Command::new("kill").arg("-INT").arg(follower.id().to_string()).status();
    // Read what it says to the end, so that it never blocks on a full pipe.
    lines.for_each(drop);
    let _ = follower.wait();
    Ok(measured?.into_iter().fold(f64::MAX, f64::min))
}

const REPORTS: &str = "400000";

/// The traced cost of one subsystem report, on the site include/memtrace.h writes and on the one
/// sdt.h writes, measured alternately: best of ROUNDS each.
fn usdt_report_ns(memtrace: &Path, trace: &Path) -> Result<[f64; 2]> {
    let include = format!("-I{}", workspace_root().join("include").display());
    let programs = [
        compile_c("bench/usdt_loop.c", "bench", &[&include, "-DMEMTRACE_NOP5_SITES"])?,
        compile_c("bench/usdt_loop.c", "bench-nop1", &["-DONE_BYTE_NOP"])?,
    ];
    let mut best = [f64::MAX; 2];
    for _ in 0..ROUNDS {
        for (program, best) in programs.iter().zip(&mut best) {
            let mut command = as_root(memtrace);
            command.arg("-o").arg(trace).arg("--").arg(program).arg(REPORTS);
            *best = best.min(ns_per_pair(&mut command)?);
        }
    }
    Ok(best)
}

fn ns_per_pair(command: &mut Command) -> Result<f64> {
    let output = command.output().with_context(|| format!("running {command:?}"))?;
    anyhow::ensure!(
        output.status.success(),
        "{command:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8_lossy(&output.stdout);
    text.trim().parse().with_context(|| format!("{command:?} printed {text:?}, not nanoseconds"))
}

/// memtrace's whole run on `true` (which itself takes about a millisecond): start-up, attach,
/// detach and the outputs.
fn whole_run_time(memtrace: &Path, trace: &Path) -> Result<Duration> {
    let started = Instant::now();
    let status = as_root(memtrace).arg("-o").arg(trace).args(["--", "true"]).output()?.status;
    anyhow::ensure!(status.success(), "memtrace -- true failed");
    Ok(started.elapsed())
}
