//! `memtrace check`: memory as a CI gate. Budgets from a TOML file in the project (budgets.rs),
//! held against a run, traced for the occasion or saved (verdict.rs), reported as text, JUnit XML
//! and GitHub annotations (ci_report.rs). Exit 0 within every budget, 1 on a breach, 2 on bad
//! input (the budget file, a baseline, the summary), each error naming the file and the fix.

mod budgets;
mod ci_report;
mod verdict;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::{Context, Result};

use crate::{export::saved, model::Model};

/// What `memtrace check` reads and writes, once the run to check is a saved summary.
pub struct Gate<'a> {
    pub budgets: &'a Path,
    pub summary: &'a Path,
    pub junit: Option<&'a Path>,
    pub github: bool,
    /// Stacks named a breach.
    pub top: usize,
}

/// Exit status on bad input: a budget file, a baseline or a summary that cannot be read.
pub const BAD_INPUT: u8 = 2;

/// Holds the budgets against the summary and reports; the exit status says how it went.
pub fn run(gate: &Gate) -> ExitCode {
    let (budgets, baselines, model) = match inputs(gate) {
        Ok(inputs) => inputs,
        Err(err) => {
            eprintln!("memtrace check: error: {err:#}");
            return ExitCode::from(BAD_INPUT);
        }
    };
    let verdicts: Vec<verdict::Verdict> = budgets
        .iter()
        .map(|budget| {
            let paths = budget.baseline.iter().flat_map(|baseline| &baseline.paths);
            let runs: Vec<&Model> = paths.filter_map(|path| baselines.get(path)).collect();
            verdict::check(budget, &model, &runs, gate.top)
        })
        .collect();
    print!("{}", ci_report::text(&verdicts, gate.budgets));
    if gate.github {
        print!("{}", ci_report::github(&verdicts));
    }
    if let Some(path) = gate.junit {
        if let Err(err) = ci_report::write_junit(&verdicts, path) {
            eprintln!("memtrace check: error: {err:#}");
            return ExitCode::from(BAD_INPUT);
        }
    }
    match verdicts.iter().all(verdict::Verdict::passed) {
        true => ExitCode::SUCCESS,
        false => ExitCode::from(1),
    }
}

/// The budgets, each baseline they name (loaded once), and the run.
fn inputs(gate: &Gate) -> Result<(Vec<budgets::Budget>, BTreeMap<PathBuf, Model>, Model)> {
    let budgets = budgets::load(gate.budgets)?;
    let mut baselines = BTreeMap::new();
    for budget in &budgets {
        for path in budget.baseline.iter().flat_map(|baseline| &baseline.paths) {
            if !baselines.contains_key(path) {
                let (model, _) = saved::load(path).with_context(|| {
                    format!("the baseline of the budget at {}, line {}", budget.file.display(), budget.line)
                })?;
                baselines.insert(path.clone(), model);
            }
        }
    }
    let (model, _) = saved::load(gate.summary)?;
    Ok((budgets, baselines, model))
}
