//! Each budget held against a run: the figures of the processes it names (their own totals, or,
//! where it names the project's modules, the sum of the stacks that pass through them), each
//! against its limit, absolute or the committed baseline's figure plus the tolerance; and for a
//! figure over its limit, the stacks responsible (those that grew most over the baseline, or the
//! largest).

use std::{collections::BTreeMap, path::Path, sync::Arc};

use super::budgets::{Budget, Figure};
use crate::{
    diff::{self, Figures, StackName},
    model::{frame::Frame, Model},
};

/// Where a figure's limit comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum Limit {
    Absolute(u64),
    /// The baseline's figure and the tolerance (a fraction), and the limit they make.
    Baseline {
        base: i64,
        tolerance: f64,
        limit: u64,
    },
}

impl Limit {
    pub fn value(&self) -> u64 {
        match *self {
            Limit::Absolute(limit) | Limit::Baseline { limit, .. } => limit,
        }
    }
}

/// One figure of one budget, checked.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub figure: Figure,
    pub value: i64,
    pub limit: Limit,
    /// Over its limit: the stacks most responsible (frames innermost first, and their share).
    pub responsible: Vec<(StackName, i64)>,
}

impl Outcome {
    pub fn breached(&self) -> bool {
        self.value > self.limit.value() as i64
    }
}

/// A budget's verdict.
#[derive(Debug)]
pub struct Verdict<'a> {
    pub budget: &'a Budget,
    /// How many processes of the run it names: none is a breach of its own (a renamed command
    /// must not pass unseen).
    pub processes: usize,
    pub outcomes: Vec<Outcome>,
}

impl Verdict<'_> {
    pub fn passed(&self) -> bool {
        self.processes > 0 && !self.outcomes.iter().any(Outcome::breached)
    }
}

/// What one run shows of a budget: how many processes it names, their figures, their stacks.
struct Seen {
    processes: usize,
    figures: Figures,
    stacks: BTreeMap<StackName, Figures>,
}

/// Holds `budget` against `run`, and against `baseline` (the budget's, loaded) where it has one.
pub fn check<'a>(budget: &'a Budget, run: &Model, baseline: Option<&Model>, top: usize) -> Verdict<'a> {
    let new = seen(budget, run);
    let base = baseline.map(|baseline| seen(budget, baseline));
    let mut outcomes = Vec::new();
    for figure in Figure::ALL {
        let absolute = budget.limits.iter().find(|(limited, _)| *limited == figure).map(|&(_, limit)| limit);
        let relative = base.as_ref().zip(budget.baseline.as_ref()).map(|(base, baseline)| {
            let base = get(&base.figures, figure);
            let limit = (base.max(0) as f64 * (1.0 + baseline.tolerance)).floor() as u64;
            Limit::Baseline { base, tolerance: baseline.tolerance, limit }
        });
        let limits = absolute.map(Limit::Absolute).into_iter().chain(relative);
        for limit in limits {
            let mut outcome =
                Outcome { figure, value: get(&new.figures, figure), limit, responsible: Vec::new() };
            if outcome.breached() {
                outcome.responsible =
                    responsible(figure, &new.stacks, base.as_ref().map(|base| &base.stacks), top);
            }
            outcomes.push(outcome);
        }
    }
    Verdict { budget, processes: new.processes, outcomes }
}

/// The processes and stacks of `model` that `budget` names.
fn seen(budget: &Budget, model: &Model) -> Seen {
    let named = |comm: &str| budget.command.matches(comm);
    let in_modules = |frames: &[Arc<Frame>]| {
        budget.modules.is_empty() || frames.iter().any(|frame| in_module(&budget.modules, &frame.module))
    };
    let stacks = diff::stacks_where(model, named, in_modules);
    let processes: Vec<_> = model
        .retired
        .iter()
        .chain(model.processes.values())
        .filter(|process| named(&process.identity.comm))
        .collect();
    let mut figures = Figures::default();
    for figure in stacks.values() {
        figures.add(figure);
    }
    if budget.modules.is_empty() {
        // The processes' own totals: they count what no stack holds too (a stack the kernel
        // could not record), and the exact peak, not the stacks' at a sample.
        let sum =
            |get: fn(&memtrace_common::ProcessStats) -> i64| processes.iter().map(|p| get(&p.stats)).sum();
        figures.peak_bytes = sum(|stats| stats.peak_live_bytes);
        figures.allocated_bytes = sum(|stats| stats.allocated_bytes as i64);
        figures.allocations = sum(|stats| stats.allocations as i64);
        figures.temporary_allocations = sum(|stats| stats.temporary_allocations as i64);
    }
    Seen { processes: processes.len(), figures, stacks }
}

/// Whether a frame's module (its file's path) is one of `modules`, by path or by file name.
fn in_module(modules: &[glob::Pattern], module: &str) -> bool {
    let name = Path::new(module).file_name().and_then(|name| name.to_str()).unwrap_or(module);
    modules.iter().any(|pattern| pattern.matches(module) || pattern.matches(name))
}

/// The stacks that grew `figure` most over the baseline's (or hold most of it, without one).
fn responsible(
    figure: Figure,
    new: &BTreeMap<StackName, Figures>,
    base: Option<&BTreeMap<StackName, Figures>>,
    top: usize,
) -> Vec<(StackName, i64)> {
    let mut stacks: Vec<(StackName, i64)> = new
        .iter()
        .map(|(name, figures)| {
            let before = base.and_then(|base| base.get(name)).map_or(0, |base| get(base, figure));
            (name.clone(), get(figures, figure) - before)
        })
        .filter(|(_, share)| *share > 0)
        .collect();
    stacks.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    stacks.truncate(top);
    stacks
}

/// A figure of `figures`.
pub fn get(figures: &Figures, figure: Figure) -> i64 {
    match figure {
        Figure::PeakLiveBytes => figures.peak_bytes,
        Figure::AllocatedBytes => figures.allocated_bytes,
        Figure::Allocations => figures.allocations,
        Figure::LeakedBytes => figures.leaked_bytes,
        Figure::TemporaryAllocations => figures.temporary_allocations,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A leak that adds 3% at every change, each change's run held against the one committed
    /// baseline (never the run before it) with 20%: the seventh change is the first over it.
    #[test]
    fn a_baseline_that_cannot_drift_fails_the_change_that_crosses_it() {
        let base = 100_000.0_f64;
        let limit = Limit::Baseline { base: base as i64, tolerance: 0.20, limit: (base * 1.2) as u64 };
        let first_over = (1..=10).find(|change| {
            let value = (base * 1.03_f64.powi(*change)) as i64;
            Outcome { figure: Figure::LeakedBytes, value, limit: limit.clone(), responsible: Vec::new() }
                .breached()
        });
        assert_eq!(first_over, Some(7), "1.03^6 = 1.194 is within 20%, 1.03^7 = 1.230 is not");
    }

    #[test]
    fn modules_match_by_path_or_by_file_name() {
        let modules = [glob::Pattern::new("libapp*.so").unwrap(), glob::Pattern::new("/opt/app/*").unwrap()];
        assert!(in_module(&modules, "/usr/lib/libapp-core.so"));
        assert!(in_module(&modules, "/opt/app/server"));
        assert!(!in_module(&modules, "/usr/lib/x86_64-linux-gnu/libc.so.6"));
    }
}
