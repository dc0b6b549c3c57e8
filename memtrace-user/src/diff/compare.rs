//! The comparison itself: every stack of each run by name (its frames' function and module names,
//! the command), the base runs made one base (their mean, and what varies among them beyond the
//! tolerance marked noisy), each stack and function side by side with its change, what grew most
//! first. `memtrace diff` writes it (mod.rs, pprof.rs, html.rs); `memtrace check` reads runs with
//! it.

use std::{collections::BTreeMap, path::Path, sync::Arc};

use serde::Serialize;

use crate::model::{frame::Frame, Model};

/// One stack's or function's figures in one run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Figures {
    pub allocated_bytes: i64,
    pub allocations: i64,
    /// Live bytes at the process's highest sample (interval resolution).
    pub peak_bytes: i64,
    pub live_bytes: i64,
    pub leaked_bytes: i64,
    pub temporary_allocations: i64,
}

impl Figures {
    /// The figures' names, in the order of `values`.
    pub const NAMES: [&'static str; 6] = [
        "allocated_bytes",
        "allocations",
        "peak_bytes",
        "live_bytes",
        "leaked_bytes",
        "temporary_allocations",
    ];

    pub fn values(&self) -> [i64; 6] {
        [
            self.allocated_bytes,
            self.allocations,
            self.peak_bytes,
            self.live_bytes,
            self.leaked_bytes,
            self.temporary_allocations,
        ]
    }

    fn from_values(values: [i64; 6]) -> Figures {
        let [allocated_bytes, allocations, peak_bytes, live_bytes, leaked_bytes, temporary_allocations] =
            values;
        Figures { allocated_bytes, allocations, peak_bytes, live_bytes, leaked_bytes, temporary_allocations }
    }

    pub fn add(&mut self, more: &Figures) {
        let (mine, more) = (self.values(), more.values());
        *self = Figures::from_values(std::array::from_fn(|i| mine[i] + more[i]));
    }

    fn minus(&self, base: &Figures) -> Figures {
        let (mine, base) = (self.values(), base.values());
        Figures::from_values(std::array::from_fn(|i| mine[i] - base[i]))
    }

    /// What the order puts first: the most bytes grown, leaked or allocated; what shrank comes
    /// last, the most shrunk at the end.
    fn growth(&self) -> i64 {
        let most = self.leaked_bytes.max(self.allocated_bytes);
        if most > 0 {
            most
        } else {
            self.leaked_bytes.min(self.allocated_bytes)
        }
    }
}

/// A stack as two builds share it: the command and each frame's function and module names.
pub type StackName = (String, Vec<String>);

/// Several runs of one program as one base, by stack: each figure's mean over the runs, and the
/// figures that vary among them by more than the tolerance (noisy: no gate fails on them alone).
/// A stack a run lacks counts 0 in it. With one run, nothing is noisy.
#[derive(Debug, Default)]
pub struct Bases {
    pub mean: BTreeMap<StackName, Figures>,
    pub noisy: BTreeMap<StackName, Vec<&'static str>>,
}

/// The base made of `runs` (each run's stacks), noisy beyond `tolerance` (a fraction).
pub fn bases(runs: &[BTreeMap<StackName, Figures>], tolerance: f64) -> Bases {
    let names: std::collections::BTreeSet<&StackName> = runs.iter().flat_map(BTreeMap::keys).collect();
    let mut bases = Bases::default();
    for name in names {
        let values: Vec<[i64; 6]> =
            runs.iter().map(|run| run.get(name).copied().unwrap_or_default().values()).collect();
        let (mean, noisy) = spread(&values, tolerance);
        bases.mean.insert(name.clone(), Figures::from_values(mean));
        let noisy: Vec<&'static str> =
            Figures::NAMES.iter().zip(noisy).filter(|(_, noisy)| *noisy).map(|(name, _)| *name).collect();
        if !noisy.is_empty() {
            bases.noisy.insert(name.clone(), noisy);
        }
    }
    bases
}

/// Each figure's mean over `runs` (rounded), and whether its range exceeds `tolerance` of it.
pub fn spread<const N: usize>(runs: &[[i64; N]], tolerance: f64) -> ([i64; N], [bool; N]) {
    let count = runs.len().max(1) as f64;
    let mean: [f64; N] = std::array::from_fn(|i| runs.iter().map(|run| run[i] as f64).sum::<f64>() / count);
    let noisy = std::array::from_fn(|i| {
        let (low, high) =
            runs.iter().fold((i64::MAX, i64::MIN), |(low, high), run| (low.min(run[i]), high.max(run[i])));
        runs.len() > 1 && (high - low) as f64 > tolerance * mean[i].abs()
    });
    (mean.map(|mean| mean.round() as i64), noisy)
}

/// One row of the comparison.
#[derive(Debug, Serialize)]
pub struct Compared<K> {
    #[serde(flatten)]
    pub key: K,
    pub base: Figures,
    pub new: Figures,
    pub delta: Figures,
    /// The figures that vary among the base runs by more than the tolerance.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub noisy: Vec<&'static str>,
}

#[derive(Debug, Serialize)]
pub struct StackKey {
    pub command: String,
    pub frames: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct FunctionKey {
    pub command: String,
    pub function: String,
    /// Anywhere on the stack (inclusive) or the allocator's caller (exclusive).
    pub inclusive: bool,
}

/// The two runs compared.
#[derive(Debug, Serialize)]
pub struct Diff {
    pub stacks: Vec<Compared<StackKey>>,
    pub functions: Vec<Compared<FunctionKey>>,
}

/// A frame's name for matching: its function (or `?`) and its module's file name.
fn frame_name(frame: &Frame) -> String {
    let module = Path::new(&frame.module)
        .file_name()
        .map_or(frame.module.clone(), |name| name.to_string_lossy().into_owned());
    format!("{} ({module})", frame.function.as_deref().unwrap_or("?"))
}

/// Every stack of a run by name, with its figures; stacks of one name added up.
pub fn stacks_of(model: &Model) -> BTreeMap<StackName, Figures> {
    stacks_where(model, |_| true, |_| true)
}

/// The stacks of the processes `process` keeps (by command) that `stack` keeps (by frames), the
/// same way.
pub fn stacks_where(
    model: &Model,
    process: impl Fn(&str) -> bool,
    stack: impl Fn(&[Arc<Frame>]) -> bool,
) -> BTreeMap<StackName, Figures> {
    let mut stacks: BTreeMap<StackName, Figures> = BTreeMap::new();
    for process in model.every_process().filter(|p| process(&p.identity.comm)) {
        let command = process.identity.comm.clone();
        let mut peaks: BTreeMap<Vec<String>, i64> = BTreeMap::new();
        for consumer in process.peak.iter().flat_map(|peak| &peak.consumers) {
            *peaks.entry(consumer.frames.iter().map(|f| frame_name(f)).collect()).or_default() +=
                consumer.live_bytes;
        }
        for stack in process.stacks.iter().filter(|profile| stack(&profile.frames)) {
            let frames: Vec<String> = stack.frames.iter().map(|f| frame_name(f)).collect();
            let figures = Figures {
                allocated_bytes: stack.totals.allocated_bytes as i64,
                allocations: stack.totals.allocations as i64,
                peak_bytes: peaks.remove(&frames).unwrap_or(0),
                live_bytes: stack.totals.live_bytes,
                leaked_bytes: stack.leaked_bytes as i64,
                temporary_allocations: stack.totals.temporary_allocations as i64,
            };
            stacks.entry((command.clone(), frames)).or_default().add(&figures);
        }
    }
    stacks
}

/// A function's figures in the base and the new run, and the figures noisy on a stack through it.
type FunctionSums = (Figures, Figures, Vec<&'static str>);

/// The two runs' stacks side by side, and each function's inclusive and exclusive figures; most
/// growth first.
pub fn compare(base: &Bases, new: &BTreeMap<StackName, Figures>) -> Diff {
    let names: std::collections::BTreeSet<&StackName> = base.mean.keys().chain(new.keys()).collect();
    let mut stacks = Vec::new();
    let mut functions: BTreeMap<(String, String, bool), FunctionSums> = BTreeMap::new();
    for name in names {
        let (b, n) =
            (base.mean.get(name).copied().unwrap_or_default(), new.get(name).copied().unwrap_or_default());
        let noisy = base.noisy.get(name).cloned().unwrap_or_default();
        let (command, frames) = name;
        let mut seen = std::collections::HashSet::new();
        for (depth, frame) in frames.iter().enumerate() {
            // A frame without a function name says nothing of which code it is.
            if frame.starts_with("? (") {
                continue;
            }
            let mut count = |inclusive: bool| {
                let sums = functions.entry((command.clone(), frame.clone(), inclusive)).or_default();
                sums.0.add(&b);
                sums.1.add(&n);
                for figure in &noisy {
                    if !sums.2.contains(figure) {
                        sums.2.push(figure);
                    }
                }
            };
            // A recursive function counts once a stack.
            if seen.insert(frame) {
                count(true);
            }
            if depth == 0 {
                count(false);
            }
        }
        stacks.push(Compared {
            key: StackKey { command: command.clone(), frames: frames.clone() },
            base: b,
            new: n,
            delta: n.minus(&b),
            noisy,
        });
    }
    let mut functions: Vec<Compared<FunctionKey>> = functions
        .into_iter()
        .map(|((command, function, inclusive), (b, n, noisy))| Compared {
            key: FunctionKey { command, function, inclusive },
            base: b,
            new: n,
            delta: n.minus(&b),
            noisy,
        })
        .collect();
    stacks.sort_by_key(|row| std::cmp::Reverse(row.delta.growth()));
    functions.sort_by_key(|row| std::cmp::Reverse(row.delta.growth()));
    Diff { stacks, functions }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(leaked: i64, allocated: i64) -> Figures {
        Figures { allocated_bytes: allocated, leaked_bytes: leaked, allocations: 1, ..Figures::default() }
    }

    fn name(frames: &[&str]) -> StackName {
        ("app".into(), frames.iter().map(|frame| (*frame).to_owned()).collect())
    }

    #[test]
    fn several_base_runs_are_their_mean_and_what_varies_among_them_is_noisy() {
        let run = |leaked: i64| {
            BTreeMap::from([
                (name(&["leak", "main"]), figures(leaked, 500)),
                (name(&["work", "main"]), figures(0, 500)),
            ])
        };
        // leaked 100, 110, 150: mean 120, range 50 over 5% of 120; allocated the same in all.
        let bases = bases(&[run(100), run(110), run(150)], 0.05);
        assert_eq!(bases.mean[&name(&["leak", "main"])].leaked_bytes, 120);
        assert_eq!(bases.noisy[&name(&["leak", "main"])], ["leaked_bytes"]);
        assert!(!bases.noisy.contains_key(&name(&["work", "main"])));
        // Within the tolerance, nothing is noisy; one run never is.
        assert!(super::bases(&[run(100), run(104)], 0.05).noisy.is_empty());
        assert!(super::bases(&[run(100)], 0.0).noisy.is_empty());
        let diff = compare(&bases, &run(400));
        assert_eq!(
            (diff.stacks[0].delta.leaked_bytes, diff.stacks[0].noisy.clone()),
            (280, vec!["leaked_bytes"])
        );
    }

    #[test]
    fn stacks_are_matched_by_name_and_what_grew_most_comes_first() {
        let base = BTreeMap::from([
            (name(&["leak", "main"]), figures(100, 100)),
            (name(&["work", "main"]), figures(0, 500)),
            (name(&["gone", "main"]), figures(0, 50)),
        ]);
        let new = BTreeMap::from([
            (name(&["leak", "main"]), figures(400, 400)),
            (name(&["work", "main"]), figures(0, 500)),
            (name(&["new", "main"]), figures(0, 10)),
        ]);
        let diff = compare(&bases(&[base], 0.05), &new);
        let order: Vec<&str> = diff.stacks.iter().map(|row| row.key.frames[0].as_str()).collect();
        assert_eq!(order, ["leak", "new", "work", "gone"]);
        assert_eq!(diff.stacks[0].delta.leaked_bytes, 300);
        assert_eq!(diff.stacks[3].new, Figures::default(), "a stack only the base has");
        // main is on every stack: inclusive, it sums them; exclusive, no stack ends in it.
        let main = diff.functions.iter().find(|row| row.key.function == "main" && row.key.inclusive).unwrap();
        assert_eq!((main.base.allocated_bytes, main.new.allocated_bytes), (650, 910));
        assert!(!diff.functions.iter().any(|row| row.key.function == "main" && !row.key.inclusive));
    }
}
