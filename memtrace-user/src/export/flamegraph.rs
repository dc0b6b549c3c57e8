//! `--flamegraph PATH`: an SVG flamegraph of live bytes by call stack, one tower per process.

use std::{fs::File, io::Write};

use anyhow::{Context, Result};
use inferno::flamegraph;

use super::exporter::WholeFile;
use crate::model::{Model, RunEnd};

/// `--flamegraph`'s file.
pub struct Flamegraph;

impl WholeFile for Flamegraph {
    const WHAT: &'static str = "flamegraph";
    const OPTION: &'static str = "--flamegraph";

    fn write(model: &Model, _end: RunEnd, file: &mut File) -> Result<()> {
        let lines = folded_stacks(model);
        let mut options = flamegraph::Options::default();
        options.title = "memtrace: live bytes by call stack".to_owned();
        options.count_name = "bytes".to_owned();
        // inferno refuses an empty profile; an empty picture says the same without an error.
        let svg = if lines.is_empty() {
            EMPTY_FLAMEGRAPH.as_bytes().to_vec()
        } else {
            let mut svg = Vec::new();
            flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), &mut svg)
                .context("drawing the flamegraph")?;
            svg
        };
        Ok(file.write_all(&svg)?)
    }
}

const EMPTY_FLAMEGRAPH: &str = r#"<svg xmlns="http://www.w3.org/2000/svg" width="600" height="40"><text x="10" y="25">memtrace: no live bytes with a recorded stack</text></svg>
"#;

/// "comm (pid);outermost;...;innermost bytes" per stack that still holds bytes.
fn folded_stacks(model: &Model) -> Vec<String> {
    let mut lines = Vec::new();
    for process in model.every_process() {
        for stack in process.stacks.iter().filter(|s| s.totals.live_bytes > 0) {
            let mut names = vec![format!("{} ({})", process.identity.display_name(), process.identity.pid)];
            names.extend(stack.frames.iter().rev().map(|f| f.name().replace(';', ":")));
            lines.push(format!("{} {}", names.join(";"), stack.totals.live_bytes));
        }
    }
    lines
}

#[cfg(test)]
mod tests {
    use memtrace_common::StackTotals;

    use super::*;
    use crate::model::{frame::Frame, StackProfile};

    #[test]
    fn stacks_fold_outermost_first() {
        let mut model = Model::default();
        model.add_process(crate::model::identity::ProcessIdentity::new(5, "app".into()), "/libc".into());
        let frame = |name: &str| {
            std::sync::Arc::new(Frame {
                function: Some(name.into()),
                file: None,
                line: None,
                module: "m".into(),
                offset: 0,
                interpreter: None,
            })
        };
        let live = StackTotals {
            allocations: 1,
            allocated_bytes: 64,
            live_allocations: 1,
            live_bytes: 64,
            ..StackTotals::default()
        };
        let freed = StackTotals { live_allocations: 0, live_bytes: 0, ..live };
        let stack = |frames, totals| StackProfile {
            frames,
            totals,
            leaked_bytes: 0,
            leaked_allocations: 0,
            oldest_age: None,
        };
        model.processes.get_mut(&5).unwrap().stacks = vec![
            stack(vec![frame("leak"), frame("main")], live),
            stack(vec![frame("temp"), frame("main")], freed),
        ];
        assert_eq!(folded_stacks(&model), ["app (5);main;leak 64"]);
    }
}
