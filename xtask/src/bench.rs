//! What tracing costs the traced program: a malloc/free loop timed untraced and traced in one run.

use std::{path::Path, process::Command};

use anyhow::{Context, Result};

use crate::{as_root, compile_c, workspace_root};

const PAIRS: &str = "200000";

pub fn run(memtrace: &Path) -> Result<()> {
    let program = compile_c("bench/malloc_loop.c", "bench", &[])?;
    let untraced = ns_per_pair(Command::new(&program).arg(PAIRS))?;
    let trace = workspace_root().join("target/bench/trace.json");
    let traced = ns_per_pair(as_root(memtrace).arg("-o").arg(&trace).arg("--").arg(&program).arg(PAIRS))?;
    println!("malloc/free pair, {PAIRS} pairs: untraced {untraced:.1} ns, traced {traced:.1} ns");
    println!("traced/untraced ratio: {:.1}", traced / untraced);
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
