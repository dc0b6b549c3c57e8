//! The budget file of `memtrace check` (TOML, kept in the project's repository): each `[[budget]]`
//! names the processes it holds (`command`, a comm or a glob), optionally the project's own code
//! (`modules`, globs over a frame's file path or file name), and its limits: absolute ones, and
//! `baseline` (a committed summary, relative to the budget file) with a `tolerance`, which limits
//! every figure to the baseline's plus the tolerance; several baselines are one, their mean, and a
//! stack whose figure varies among them beyond the tolerance is noisy. A file that does not parse, an unknown key,
//! a missing baseline, or a budget that limits nothing is refused with the file and the line.

use std::{
    fmt,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use toml::Spanned;

/// The figures a budget can limit, in the order they are checked and reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Figure {
    PeakLiveBytes,
    AllocatedBytes,
    Allocations,
    LeakedBytes,
    TemporaryAllocations,
}

impl Figure {
    pub const ALL: [Figure; 5] = [
        Figure::PeakLiveBytes,
        Figure::AllocatedBytes,
        Figure::Allocations,
        Figure::LeakedBytes,
        Figure::TemporaryAllocations,
    ];

    /// Its key in the budget file, and its name in every report.
    pub fn key(self) -> &'static str {
        match self {
            Figure::PeakLiveBytes => "peak_live_bytes",
            Figure::AllocatedBytes => "allocated_bytes",
            Figure::Allocations => "allocations",
            Figure::LeakedBytes => "leaked_bytes",
            Figure::TemporaryAllocations => "temporary_allocations",
        }
    }

    /// Whether it counts bytes (else blocks).
    pub fn is_bytes(self) -> bool {
        matches!(self, Figure::PeakLiveBytes | Figure::AllocatedBytes | Figure::LeakedBytes)
    }
}

impl fmt::Display for Figure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.key())
    }
}

/// One budget as the file states it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBudget {
    command: String,
    #[serde(default)]
    modules: Vec<String>,
    peak_live_bytes: Option<u64>,
    allocated_bytes: Option<u64>,
    allocations: Option<u64>,
    leaked_bytes: Option<u64>,
    temporary_allocations: Option<u64>,
    baseline: Option<Spanned<Paths>>,
    tolerance: Option<Spanned<String>>,
}

/// A baseline: one committed run, or several (their mean, and what varies among them is noisy).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Paths {
    One(String),
    Several(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    budget: Vec<Spanned<RawBudget>>,
}

/// A limit relative to committed runs: their summaries, and how much more than their mean is
/// allowed (and how much they may vary among themselves before a stack is noisy).
#[derive(Debug, Clone)]
pub struct Baseline {
    pub paths: Vec<PathBuf>,
    /// A fraction: 0.05 for "5%".
    pub tolerance: f64,
}

/// One budget, checked and ready.
#[derive(Debug, Clone)]
pub struct Budget {
    /// The comm or glob of the processes it holds.
    pub command: glob::Pattern,
    /// Globs over frames' file paths or file names; empty for every stack.
    pub modules: Vec<glob::Pattern>,
    pub limits: Vec<(Figure, u64)>,
    pub baseline: Option<Baseline>,
    /// The budget file and the line its `[[budget]]` starts on, to point at.
    pub file: PathBuf,
    pub line: usize,
}

impl Budget {
    /// What the reports call it: its command, and its modules where it has any.
    pub fn name(&self) -> String {
        match self.modules.is_empty() {
            true => self.command.as_str().to_owned(),
            false => {
                let modules: Vec<&str> = self.modules.iter().map(glob::Pattern::as_str).collect();
                format!("{} [{}]", self.command.as_str(), modules.join(", "))
            }
        }
    }
}

/// The budgets of the file at `path`.
pub fn load(path: &Path) -> Result<Vec<Budget>> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!("cannot read the budget file {}: give --budgets the path of a TOML file", path.display())
    })?;
    let file: RawFile = toml::from_str(&text).map_err(|err| {
        let line =
            err.span().map(|span| format!(", line {}", line_of(&text, span.start))).unwrap_or_default();
        anyhow::anyhow!(
            "{}{line}: {}; each [[budget]] takes command, modules, peak_live_bytes, allocated_bytes, \
             allocations, leaked_bytes, temporary_allocations, baseline and tolerance",
            path.display(),
            err.message()
        )
    })?;
    let dir = path.parent().unwrap_or(Path::new("."));
    file.budget.into_iter().map(|raw| budget(raw, path, dir, &text)).collect()
}

/// One budget checked: its patterns, its limits, its baseline (there, relative to `dir`).
fn budget(raw: Spanned<RawBudget>, path: &Path, dir: &Path, text: &str) -> Result<Budget> {
    let line = line_of(text, raw.span().start);
    let at = |span: std::ops::Range<usize>| format!("{}, line {}", path.display(), line_of(text, span.start));
    let raw = raw.into_inner();
    let pattern = |text: &str, what: &str| {
        glob::Pattern::new(text).with_context(|| {
            format!(
                "{}, line {line}: {what} \"{text}\" is not a glob; write a name, or use * and ?",
                path.display()
            )
        })
    };
    let command = pattern(&raw.command, "command")?;
    let modules = raw.modules.iter().map(|module| pattern(module, "module")).collect::<Result<Vec<_>>>()?;
    let limits: Vec<(Figure, u64)> = [
        (Figure::PeakLiveBytes, raw.peak_live_bytes),
        (Figure::AllocatedBytes, raw.allocated_bytes),
        (Figure::Allocations, raw.allocations),
        (Figure::LeakedBytes, raw.leaked_bytes),
        (Figure::TemporaryAllocations, raw.temporary_allocations),
    ]
    .into_iter()
    .filter_map(|(figure, limit)| limit.map(|limit| (figure, limit)))
    .collect();
    let baseline = match (raw.baseline, raw.tolerance) {
        (None, Some(tolerance)) => {
            bail!(
                "{}: a tolerance needs a baseline = \"path/to/summary.json\" beside it",
                at(tolerance.span())
            )
        }
        (None, None) => None,
        (Some(baseline), tolerance) => {
            let at_baseline = at(baseline.span());
            let paths = match baseline.into_inner() {
                Paths::One(path) => vec![path],
                Paths::Several(paths) if !paths.is_empty() => paths,
                Paths::Several(_) => bail!("{at_baseline}: the baseline lists no run; name a summary"),
            };
            let paths = paths.iter().map(|path| existing(dir, path, &at_baseline)).collect::<Result<_>>()?;
            let tolerance = match tolerance {
                Some(tolerance) => parse_tolerance(tolerance.get_ref())
                    .with_context(|| format!("{}: tolerance", at(tolerance.span())))?,
                None => 0.0,
            };
            Some(Baseline { paths, tolerance })
        }
    };
    if limits.is_empty() && baseline.is_none() {
        bail!(
            "{}, line {line}: the budget for \"{}\" limits nothing; give it a limit such as \
             peak_live_bytes = 1048576, or a baseline",
            path.display(),
            raw.command
        );
    }
    Ok(Budget { command, modules, limits, baseline, file: path.to_owned(), line })
}

/// A baseline's summary, `path` relative to the budget file's directory, which must be there.
fn existing(dir: &Path, path: &str, at: &str) -> Result<PathBuf> {
    let resolved = dir.join(path);
    if !resolved.is_file() {
        bail!(
            "{at}: the baseline {} is not there; commit a run's summary (`memtrace --summary {path}`) or \
             fix the path (relative to the budget file)",
            resolved.display()
        );
    }
    Ok(resolved)
}

/// "5%" as 0.05.
fn parse_tolerance(text: &str) -> Result<f64> {
    crate::cli::parse_percent(text).map_err(anyhow::Error::msg)
}

/// The line (from 1) of byte `offset` of `text`.
fn line_of(text: &str, offset: usize) -> usize {
    1 + text.as_bytes()[..offset.min(text.len())].iter().filter(|&&byte| byte == b'\n').count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loaded(text: &str) -> Result<Vec<Budget>> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("base.json"), "{}").unwrap();
        let path = dir.path().join("memtrace.toml");
        std::fs::write(&path, text).unwrap();
        load(&path)
    }

    #[test]
    fn budgets_are_read_with_their_lines() {
        let budgets = loaded(
            "# the service\n[[budget]]\ncommand = \"grown_*\"\nleaked_bytes = 0\n\n[[budget]]\n\
             command = \"app\"\nmodules = [\"libapp*.so\"]\nbaseline = \"base.json\"\ntolerance = \"5%\"\n",
        )
        .unwrap();
        assert_eq!(budgets.len(), 2);
        assert_eq!((budgets[0].line, budgets[1].line), (2, 6));
        assert_eq!(budgets[0].limits, [(Figure::LeakedBytes, 0)]);
        assert!(budgets[0].command.matches("grown_leak"));
        assert_eq!(budgets[1].baseline.as_ref().unwrap().tolerance, 0.05);
        assert_eq!(budgets[1].baseline.as_ref().unwrap().paths.len(), 1);
        assert_eq!(budgets[1].name(), "app [libapp*.so]");
    }

    #[test]
    fn bad_budgets_name_the_file_and_the_line() {
        let error = |text: &str| format!("{:#}", loaded(text).unwrap_err());
        let unknown = error("[[budget]]\ncommand = \"a\"\npeak_bytes = 1\n");
        assert!(unknown.contains("line 3") && unknown.contains("peak_bytes"), "{unknown}");
        let missing = error("[[budget]]\ncommand = \"a\"\n\nbaseline = \"gone.json\"\n");
        assert!(missing.contains("line 4") && missing.contains("gone.json"), "{missing}");
        let tolerance =
            error("[[budget]]\ncommand = \"a\"\nbaseline = \"base.json\"\ntolerance = \"five\"\n");
        assert!(tolerance.contains("line 4") && tolerance.contains("5%"), "{tolerance}");
        let several = error("[[budget]]\ncommand = \"a\"\nbaseline = [\"base.json\", \"gone.json\"]\n");
        assert!(several.contains("line 3") && several.contains("gone.json"), "{several}");
        let nothing = error("[[budget]]\ncommand = \"a\"\n");
        assert!(nothing.contains("line 1") && nothing.contains("limits nothing"), "{nothing}");
        let syntax = error("[[budget]]\ncommand = \n");
        assert!(syntax.contains("line 2"), "{syntax}");
    }
}
