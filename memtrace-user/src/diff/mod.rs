//! `memtrace diff BASE.json NEW.json`: two saved runs (summaries of `--summary`) compared by call
//! stack and by function, what grew most first. Stacks are matched by their frames' function and
//! module names, never lines or addresses, so that two builds of a program compare; processes by
//! their command, the figures of several processes of one command added up. Every stack of the
//! summaries takes part, not a report's top N. A stack's peak is its live bytes at its process's
//! highest sample, so at the interval's resolution; the text says so.
//!
//! Written as a text table on stdout, and with `--json PATH` as JSON: `stacks` and `functions`,
//! each `{command, frames | function, base, new, delta}`; with `--pprof PATH` as a differential
//! pprof profile (pprof.rs), with `--html PATH` as a page of differential flamegraphs (html.rs).

mod compare;
mod html;
mod pprof;

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::{Context, Result};

pub use compare::*;

use crate::export::saved;

/// How many stacks and functions the text lists (the JSON has them all).
const TEXT_ROWS: usize = 20;

/// Where `memtrace diff` writes the comparison besides stdout.
pub struct DiffOutputs<'a> {
    pub json: Option<&'a Path>,
    pub pprof: Option<&'a Path>,
    pub html: Option<&'a Path>,
}

/// `memtrace diff`: reads the summaries (the base runs, then the new one), prints the table and
/// writes the other forms asked for; several base runs are one base, noisy beyond `tolerance`.
pub fn run(base: &[PathBuf], new: &Path, tolerance: f64, outputs: &DiffOutputs) -> Result<ExitCode> {
    let runs = base.iter().map(|path| Ok(stacks_of(&saved::load(path)?.0))).collect::<Result<Vec<_>>>()?;
    let (new_model, _) = saved::load(new)?;
    let diff = compare(&bases(&runs, tolerance), &stacks_of(&new_model));
    let names: Vec<String> = base.iter().map(|path| path.display().to_string()).collect();
    let table = text(&diff, &names.join(" + "), new);
    print!("{table}");
    if let Some(path) = outputs.pprof {
        pprof::write(&diff, path)?;
    }
    if let Some(path) = outputs.html {
        html::write(&diff, &table, path)?;
    }
    if let Some(path) = outputs.json {
        let text = serde_json::to_string_pretty(&diff)?;
        std::fs::write(path, text + "\n").with_context(|| {
            format!("cannot write {}: is its directory there and writable?", path.display())
        })?;
    }
    Ok(ExitCode::SUCCESS)
}

/// A row's mark where the base runs disagree on some of its figures.
fn noisy(figures: &[&str]) -> String {
    match figures.is_empty() {
        true => String::new(),
        false => format!("  (noisy among the base runs: {})", figures.join(", ")),
    }
}

/// The table: the stacks and functions that grew most, each figure as new (change).
fn text(diff: &Diff, base: &str, new: &Path) -> String {
    let mut out = format!(
        "memtrace diff: {} -> {} (peak: live bytes at each process's highest sample, at the \
         interval's resolution)\n\n{:>22} {:>16} {:>22} {:>16}  stack\n",
        base,
        new.display(),
        "allocated (change)",
        "allocations",
        "leaked (change)",
        "peak",
    );
    let row = |figures: &Figures, delta: &Figures| {
        format!(
            "{:>22} {:>16} {:>22} {:>16}",
            format!("{} ({:+})", figures.allocated_bytes, delta.allocated_bytes),
            format!("{} ({:+})", figures.allocations, delta.allocations),
            format!("{} ({:+})", figures.leaked_bytes, delta.leaked_bytes),
            format!("{} ({:+})", figures.peak_bytes, delta.peak_bytes),
        )
    };
    for stack in diff.stacks.iter().take(TEXT_ROWS) {
        let frames: Vec<&str> = stack.key.frames.iter().take(4).map(String::as_str).collect();
        let _ = writeln!(
            out,
            "{}  [{}] {}{}",
            row(&stack.new, &stack.delta),
            stack.key.command,
            frames.join(" <- "),
            noisy(&stack.noisy)
        );
    }
    let _ = writeln!(out, "\n{:>22} {:>16} {:>22} {:>16}  function", "", "", "", "");
    for function in diff.functions.iter().take(TEXT_ROWS) {
        let kind = if function.key.inclusive { "incl" } else { "excl" };
        let _ = writeln!(
            out,
            "{}  [{}] {} ({kind}){}",
            row(&function.new, &function.delta),
            function.key.command,
            function.key.function,
            noisy(&function.noisy)
        );
    }
    out
}
