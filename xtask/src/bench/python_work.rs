//! What tracing costs real Python work (bench/json_work.py: JSON encoding and decoding, timed
//! inside the script so that start-up and shutdown are not counted): untraced; memtrace exact
//! with stacks, without stacks and sampled (`--sample 512KiB`); heaptrack; and the fleet mode,
//! `--app-sampled`, on the same work with bench/otel_sampler.c preloaded (glibc's malloc made a
//! sampling allocator that fires OpenTelemetry's otel_memory probes), set against the same
//! preloaded work untraced, so that the ratio is what memtrace adds. Variants run in turns and
//! the best round of each is kept.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context, Result};

use crate::{compile_c, toolchain, workspace_root};

const ROUNDS: usize = 3;

/// How one variant runs the script.
#[derive(Clone, Copy)]
enum Runner {
    Untraced,
    Memtrace(&'static [&'static str]),
    Heaptrack,
}

struct Variant {
    name: &'static str,
    runner: Runner,
    /// LD_PRELOAD the sampling allocator.
    sampler: bool,
    best_s: f64,
}

pub fn run(memtrace: &Path) -> Result<()> {
    toolchain::ensure_packages(&["python3", "heaptrack"])?;
    let sampler = compile_c("bench/otel_sampler.c", "bench", &["-shared", "-fPIC", "-lm"])?;
    let script = workspace_root().join("bench/json_work.py");
    let out = workspace_root().join("target/bench");
    let mut variants = [
        Variant { name: "untraced", runner: Runner::Untraced, sampler: false, best_s: f64::MAX },
        Variant { name: "memtrace exact", runner: Runner::Memtrace(&[]), sampler: false, best_s: f64::MAX },
        Variant {
            name: "memtrace --no-stacks",
            runner: Runner::Memtrace(&["--no-stacks"]),
            sampler: false,
            best_s: f64::MAX,
        },
        Variant {
            name: "memtrace --sample 512KiB",
            runner: Runner::Memtrace(&["--sample", "512KiB"]),
            sampler: false,
            best_s: f64::MAX,
        },
        Variant { name: "heaptrack", runner: Runner::Heaptrack, sampler: false, best_s: f64::MAX },
        Variant { name: "sampler, untraced", runner: Runner::Untraced, sampler: true, best_s: f64::MAX },
        Variant {
            name: "sampler, --app-sampled",
            runner: Runner::Memtrace(&["--app-sampled"]),
            sampler: true,
            best_s: f64::MAX,
        },
    ];
    for _ in 0..ROUNDS {
        for variant in &mut variants {
            let preload = variant.sampler.then_some(sampler.as_path());
            let seconds = seconds_of(command(variant.runner, memtrace, &script, preload, &out))?;
            variant.best_s = variant.best_s.min(seconds);
        }
    }
    print(&variants);
    Ok(())
}

fn print(variants: &[Variant]) {
    let untraced = variants[0].best_s;
    let preloaded = variants.iter().find(|v| v.sampler && matches!(v.runner, Runner::Untraced));
    println!("python3 json work (bench/json_work.py, best of {ROUNDS}):");
    for variant in variants {
        let against_preloaded = match (variant.sampler, preloaded) {
            (true, Some(base)) => format!("   x the sampler untraced {:.3}", variant.best_s / base.best_s),
            _ => String::new(),
        };
        println!(
            "  {:<28} {:>7.3} s   x untraced {:>5.2}{against_preloaded}",
            variant.name,
            variant.best_s,
            variant.best_s / untraced
        );
    }
}

fn command(runner: Runner, memtrace: &Path, script: &Path, preload: Option<&Path>, out: &Path) -> Command {
    // The preload goes to python alone (through env), never to memtrace or heaptrack.
    let mut python = vec![PathBuf::from("env")];
    if let Some(preload) = preload {
        python.push(format!("LD_PRELOAD={}", preload.display()).into());
    }
    python.extend([PathBuf::from("python3"), script.to_owned()]);
    match runner {
        Runner::Untraced => {
            let mut command = Command::new(&python[0]);
            command.args(&python[1..]);
            command
        }
        Runner::Memtrace(args) => {
            let mut command = crate::as_root(memtrace);
            command.args(args).arg("-o").arg(out.join("python.json")).arg("--").args(&python);
            command
        }
        Runner::Heaptrack => {
            let mut command = Command::new("heaptrack");
            command.arg("-o").arg(out.join("python.heaptrack")).args(&python);
            command
        }
    }
}

/// Runs the script and reads the seconds it printed.
fn seconds_of(mut command: Command) -> Result<f64> {
    let output = command.stdin(Stdio::null()).output().with_context(|| format!("running {command:?}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let Some(seconds) = stdout.lines().find_map(|line| line.strip_prefix("seconds ")) else {
        bail!(
            "{command:?} printed no `seconds` line ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    };
    seconds.trim().parse().context("the script's seconds")
}
