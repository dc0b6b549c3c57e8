//! Each budget held against a run: the figures of the processes it names (their own totals, or,
//! where it names the project's modules, the sum of the stacks that pass through them), each
//! against its limit, absolute or the committed baseline's figure plus the tolerance; and for a
//! figure over its limit, the stacks responsible (those that grew most over the baseline, or the
//! largest). With several baseline runs the baseline is their mean, and a stack whose figure
//! varies among them beyond the tolerance is noisy: what it adds over its mean is not held
//! against the limit, so no gate fails on it alone.

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
    /// The baseline's figure (the mean of its `runs`) and the tolerance (a fraction), and the
    /// limit they make.
    Baseline {
        base: i64,
        runs: usize,
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
    /// What noisy stacks add over their mean in the base runs: not held against the limit.
    pub noisy_excess: i64,
    /// Over its limit: the stacks most responsible (frames innermost first, and their share).
    pub responsible: Vec<(StackName, i64)>,
}

impl Outcome {
    /// Over its limit, noise aside: the gate fails.
    pub fn breached(&self) -> bool {
        self.value - self.noisy_excess > self.limit.value() as i64
    }

    /// Over its limit only through noisy stacks: said, and no failure.
    pub fn noisy(&self) -> bool {
        self.value > self.limit.value() as i64 && !self.breached()
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

/// Holds `budget` against `run`, and against `baselines` (the budget's runs, loaded) where it has
/// them.
pub fn check<'a>(budget: &'a Budget, run: &Model, baselines: &[&Model], top: usize) -> Verdict<'a> {
    let new = seen(budget, run);
    let tolerance = budget.baseline.as_ref().map_or(0.0, |baseline| baseline.tolerance);
    let base_runs: Vec<Seen> = baselines.iter().map(|model| seen(budget, model)).collect();
    let base_figures: Vec<[i64; 5]> =
        base_runs.iter().map(|run| Figure::ALL.map(|f| get(&run.figures, f))).collect();
    let (base_mean, _) = diff::spread(&base_figures, tolerance);
    let stack_runs: Vec<_> = base_runs.into_iter().map(|run| run.stacks).collect();
    let bases = diff::bases(&stack_runs, tolerance);
    let mut outcomes = Vec::new();
    for (index, figure) in Figure::ALL.into_iter().enumerate() {
        let absolute = budget.limits.iter().find(|(limited, _)| *limited == figure).map(|&(_, limit)| limit);
        let relative = budget.baseline.as_ref().filter(|_| !baselines.is_empty()).map(|baseline| {
            let base = base_mean[index];
            let limit = (base.max(0) as f64 * (1.0 + baseline.tolerance)).floor() as u64;
            Limit::Baseline { base, runs: baselines.len(), tolerance: baseline.tolerance, limit }
        });
        let value = get(&new.figures, figure);
        let noisy_excess = noisy_excess(figure, &new.stacks, &bases);
        for limit in absolute.map(Limit::Absolute).into_iter().chain(relative) {
            let mut outcome = Outcome { figure, value, limit, noisy_excess, responsible: Vec::new() };
            if outcome.breached() || outcome.noisy() {
                let base = (!baselines.is_empty()).then_some(&bases.mean);
                outcome.responsible = responsible(figure, &new.stacks, base, top);
            }
            outcomes.push(outcome);
        }
    }
    Verdict { budget, processes: new.processes, outcomes }
}

/// What the stacks noisy in `figure` add over their mean in the base runs.
fn noisy_excess(figure: Figure, new: &BTreeMap<StackName, Figures>, bases: &diff::Bases) -> i64 {
    let name = diff_name(figure);
    bases
        .noisy
        .iter()
        .filter(|(_, figures)| figures.contains(&name))
        .map(|(stack, _)| {
            let now = new.get(stack).map_or(0, |figures| get(figures, figure));
            let mean = bases.mean.get(stack).map_or(0, |figures| get(figures, figure));
            (now - mean).max(0)
        })
        .sum()
}

/// A figure's name among `diff::Figures::NAMES`: the one place a budget's figure meets the
/// comparison's.
fn diff_name(figure: Figure) -> &'static str {
    match figure {
        Figure::PeakLiveBytes => "peak_bytes",
        Figure::AllocatedBytes => "allocated_bytes",
        Figure::Allocations => "allocations",
        Figure::LeakedBytes => "leaked_bytes",
        Figure::TemporaryAllocations => "temporary_allocations",
    }
}

/// The processes and stacks of `model` that `budget` names.
fn seen(budget: &Budget, model: &Model) -> Seen {
    let named = |comm: &str| budget.command.matches(comm);
    let in_modules = |frames: &[Arc<Frame>]| {
        budget.modules.is_empty() || frames.iter().any(|frame| in_module(&budget.modules, &frame.module))
    };
    let stacks = diff::stacks_where(model, named, in_modules);
    let processes: Vec<_> = model.every_process().filter(|process| named(&process.identity.comm)).collect();
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
    let name = diff_name(figure);
    let index = Figures::NAMES.iter().position(|known| *known == name);
    figures.values()[index.expect("every budget figure is one of the comparison's")]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A leak that adds 3% at every change, each change's run held against the one committed
    /// baseline (never the run before it) with 20%: the seventh change is the first over it.
    #[test]
    fn a_baseline_that_cannot_drift_fails_the_change_that_crosses_it() {
        let base = 100_000.0_f64;
        let limit =
            Limit::Baseline { base: base as i64, runs: 1, tolerance: 0.20, limit: (base * 1.2) as u64 };
        let first_over = (1..=10).find(|change| {
            let value = (base * 1.03_f64.powi(*change)) as i64;
            let limit = limit.clone();
            Outcome { figure: Figure::LeakedBytes, value, limit, noisy_excess: 0, responsible: Vec::new() }
                .breached()
        });
        assert_eq!(first_over, Some(7), "1.03^6 = 1.194 is within 20%, 1.03^7 = 1.230 is not");
    }

    #[test]
    fn every_budget_figure_reads_its_own_field() {
        let figures = Figures {
            allocated_bytes: 1,
            allocations: 2,
            peak_bytes: 3,
            live_bytes: 4,
            leaked_bytes: 5,
            temporary_allocations: 6,
        };
        let read = Figure::ALL.map(|figure| get(&figures, figure));
        assert_eq!(read, [3, 1, 2, 5, 6], "peak, allocated, allocations, leaked, temporaries");
    }

    #[test]
    fn modules_match_by_path_or_by_file_name() {
        let modules = [glob::Pattern::new("libapp*.so").unwrap(), glob::Pattern::new("/opt/app/*").unwrap()];
        assert!(in_module(&modules, "/usr/lib/libapp-core.so"));
        assert!(in_module(&modules, "/opt/app/server"));
        assert!(!in_module(&modules, "/usr/lib/x86_64-linux-gnu/libc.so.6"));
    }
}
