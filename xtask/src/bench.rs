//! What tracing costs the traced program: a malloc/free loop timed untraced, traced with stacks and
//! traced without, in one run, reported as ratios.

use std::{path::Path, process::Command};

use anyhow::{Context, Result};

use crate::{as_root, compile_c, workspace_root};

const PAIRS: &str = "200000";

pub fn run(memtrace: &Path) -> Result<()> {
    let program = compile_c("bench/malloc_loop.c", "bench", &[])?;
    let trace = workspace_root().join("target/bench/trace.json");
    let traced = |extra: &[&str]| {
        let mut command = as_root(memtrace);
        command.arg("-o").arg(&trace).args(extra).arg("--").arg(&program).arg(PAIRS);
        ns_per_pair(&mut command)
    };
    let untraced = ns_per_pair(Command::new(&program).arg(PAIRS))?;
    let with_stacks = traced(&[])?;
    let without_stacks = traced(&["--no-stacks"])?;
    println!("malloc/free pair, {PAIRS} pairs, one run:");
    println!("  untraced             {untraced:>8.1} ns");
    println!("  traced               {with_stacks:>8.1} ns   ratio {:.1}", with_stacks / untraced);
    println!("  traced, --no-stacks  {without_stacks:>8.1} ns   ratio {:.1}", without_stacks / untraced);
    Ok(())
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
