//! The verdicts as people and CI systems read them: a text table (stdout), JUnit XML (a testcase a
//! budget's figure, with the stacks responsible in its failure), and GitHub Actions' annotations
//! (`::error file=...,line=...::`, shown on the budget file's line in a pull request).

use std::{fmt::Write as _, path::Path};

use anyhow::{Context, Result};
use quick_xml::escape::escape;

use super::{
    budgets::Figure,
    verdict::{Limit, Outcome, Verdict},
};

/// A figure with its unit.
fn amount(figure: Figure, value: i64) -> String {
    match figure.is_bytes() {
        true => format!("{value} bytes"),
        false => value.to_string(),
    }
}

/// One figure's finding: its value, and its limit with where it comes from.
pub fn finding(outcome: &Outcome) -> String {
    let limit = match &outcome.limit {
        Limit::Absolute(limit) => amount(outcome.figure, *limit as i64),
        Limit::Baseline { base, runs, tolerance, limit } => format!(
            "{} ({} {} + {}%)",
            amount(outcome.figure, *limit as i64),
            if *runs == 1 {
                "the baseline's".to_owned()
            } else {
                format!("the mean of {runs} baseline runs,")
            },
            base,
            (tolerance * 100.0 * 1000.0).round() / 1000.0
        ),
    };
    let relation = match (outcome.breached(), outcome.noisy()) {
        (true, _) => "over its limit",
        (false, true) => "over, only through stacks noisy among the base runs (not failed), its limit",
        (false, false) => "within",
    };
    format!("{} {} {relation} {limit}", outcome.figure, amount(outcome.figure, outcome.value))
}

/// Why a budget that names no process of the run fails.
fn unmatched(verdict: &Verdict) -> String {
    format!(
        "no process of the run is named {}: check the budget's command (a comm, at most 15 characters, \
         or a glob)",
        verdict.budget.command.as_str()
    )
}

/// The stacks responsible for a breach, a line each: the share, then frames innermost first.
fn stacks(outcome: &Outcome) -> Vec<String> {
    outcome
        .responsible
        .iter()
        .map(|((command, frames), share)| {
            let shown: Vec<&str> = frames.iter().take(6).map(String::as_str).collect();
            let more = if frames.len() > shown.len() { " <- ..." } else { "" };
            format!("{:+} [{command}] {}{more}", share, shown.join(" <- "))
        })
        .collect()
}

/// The table: each budget's figures, PASS or FAIL, and each breach's stacks.
pub fn text(verdicts: &[Verdict], budgets: &Path) -> String {
    let mut out = format!("memtrace check: {}\n", budgets.display());
    for verdict in verdicts {
        let budget = verdict.budget;
        let status = if verdict.passed() { "PASS" } else { "FAIL" };
        let _ = writeln!(out, "  {status} {} (line {})", budget.name(), budget.line);
        if verdict.processes == 0 {
            let _ = writeln!(out, "    {}", unmatched(verdict));
        }
        for outcome in &verdict.outcomes {
            let _ = writeln!(out, "    {}", finding(outcome));
            for stack in stacks(outcome) {
                let _ = writeln!(out, "        {stack}");
            }
        }
    }
    let failed = verdicts.iter().filter(|verdict| !verdict.passed()).count();
    let _ = writeln!(out, "memtrace check: {failed} of {} budgets breached", verdicts.len());
    out
}

/// GitHub Actions' workflow commands: an `::error` a breach, on the budget's line.
pub fn github(verdicts: &[Verdict]) -> String {
    let mut out = String::new();
    for verdict in verdicts.iter().filter(|verdict| !verdict.passed()) {
        let budget = verdict.budget;
        let mut messages: Vec<String> = Vec::new();
        if verdict.processes == 0 {
            messages.push(unmatched(verdict));
        }
        for outcome in verdict.outcomes.iter().filter(|outcome| outcome.breached()) {
            messages
                .push([finding(outcome)].into_iter().chain(stacks(outcome)).collect::<Vec<_>>().join("\n"));
        }
        for message in messages {
            let _ = writeln!(
                out,
                "::error file={},line={},title={}::{}",
                property(&budget.file.display().to_string()),
                budget.line,
                property(&format!("memory budget {}", budget.name())),
                data(&message)
            );
        }
    }
    out
}

/// A workflow command's message, escaped as GitHub's toolkit escapes it.
fn data(text: &str) -> String {
    text.replace('%', "%25").replace('\r', "%0D").replace('\n', "%0A")
}

/// A workflow command's property value, escaped the same way, with its separators.
fn property(text: &str) -> String {
    data(text).replace(':', "%3A").replace(',', "%2C")
}

/// JUnit XML: a testsuite of a testcase a budget's figure, failed with its stacks.
pub fn write_junit(verdicts: &[Verdict], path: &Path) -> Result<()> {
    let mut cases = String::new();
    let (mut tests, mut failures) = (0, 0);
    for verdict in verdicts {
        let budget = verdict.budget;
        let mut case = |name: &str, failure: Option<(String, Vec<String>)>| {
            tests += 1;
            let _ = write!(
                cases,
                "    <testcase classname=\"{}\" name=\"{}\" file=\"{}\" line=\"{}\">",
                escape(budget.name()),
                escape(name),
                escape(budget.file.display().to_string()),
                budget.line
            );
            if let Some((message, lines)) = failure {
                failures += 1;
                let _ = write!(
                    cases,
                    "\n      <failure type=\"memory budget\" message=\"{}\">{}</failure>\n    ",
                    escape(message.as_str()),
                    escape(lines.join("\n"))
                );
            }
            cases.push_str("</testcase>\n");
        };
        if verdict.processes == 0 {
            case("processes", Some((unmatched(verdict), Vec::new())));
        }
        for outcome in &verdict.outcomes {
            let failure = outcome.breached().then(|| (finding(outcome), stacks(outcome)));
            case(outcome.figure.key(), failure);
        }
    }
    let xml = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites name=\"memtrace check\" tests=\"{tests}\" \
         failures=\"{failures}\">\n  <testsuite name=\"memtrace check\" tests=\"{tests}\" failures=\"{failures}\" \
         errors=\"0\" skipped=\"0\">\n{cases}  </testsuite>\n</testsuites>\n"
    );
    std::fs::write(path, xml)
        .with_context(|| format!("cannot write {}: is its directory there and writable?", path.display()))
}
