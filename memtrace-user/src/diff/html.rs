//! `memtrace diff --html PATH`: one page with the comparison's table and two differential
//! flamegraphs (inferno's), of leaked and of allocated bytes by call stack: each frame as wide as
//! the new run's bytes, red where it grew over the base run, blue where it shrank, the deeper the
//! more. A stack the new run no longer has is as wide as nothing: the table lists it.

use std::{fmt::Write as _, path::Path};

use anyhow::{Context, Result};
use inferno::flamegraph;
use quick_xml::escape::escape;

use super::compare::{Diff, Figures};

/// "command;outermost;...;innermost BASE NEW": inferno's differential form of folded stacks.
fn folded(diff: &Diff, figure: fn(&Figures) -> i64) -> Vec<String> {
    diff.stacks
        .iter()
        .filter(|row| figure(&row.base) > 0 || figure(&row.new) > 0)
        .map(|row| {
            let mut names = vec![row.key.command.replace(';', ":")];
            names.extend(row.key.frames.iter().rev().map(|name| name.replace(';', ":")));
            format!("{} {} {}", names.join(";"), figure(&row.base).max(0), figure(&row.new).max(0))
        })
        .collect()
}

/// One flamegraph's SVG, or a line saying there is nothing to draw.
fn flamegraph_svg(diff: &Diff, title: &str, figure: fn(&Figures) -> i64) -> Result<String> {
    let lines = folded(diff, figure);
    if lines.iter().all(|line| line.ends_with(" 0")) {
        return Ok(format!("<p>{}: no stack has any in the new run.</p>", escape(title)));
    }
    let mut options = flamegraph::Options::default();
    options.title = title.to_owned();
    options.count_name = "bytes".to_owned();
    let mut svg = Vec::new();
    flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), &mut svg)
        .with_context(|| format!("drawing the flamegraph of {title}"))?;
    // In a frame of its own: the picture's script and ids stay its own.
    Ok(format!(
        "<iframe style=\"width:100%;height:60vh;border:0\" title=\"{}\" srcdoc=\"{}\"></iframe>",
        escape(title),
        escape(String::from_utf8_lossy(&svg).as_ref())
    ))
}

/// Writes the page: the table (`text`, as `memtrace diff` prints it), then the flamegraphs.
pub fn write(diff: &Diff, text: &str, path: &Path) -> Result<()> {
    let mut page = String::from(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>memtrace diff</title></head><body>\n",
    );
    let _ = writeln!(page, "<h1>memtrace diff</h1>\n<pre>{}</pre>", escape(text));
    page.push_str(
        "<p>Each frame is as wide as the new run's bytes; red grew over the base run, blue shrank.</p>\n",
    );
    for (title, figure) in [
        ("leaked bytes (change over the base run)", (|f: &Figures| f.leaked_bytes) as fn(&Figures) -> i64),
        ("allocated bytes (change over the base run)", |f: &Figures| f.allocated_bytes),
    ] {
        let _ = writeln!(page, "<h2>{}</h2>\n{}", escape(title), flamegraph_svg(diff, title, figure)?);
    }
    page.push_str("</body></html>\n");
    std::fs::write(path, page)
        .with_context(|| format!("cannot write {}: is its directory there and writable?", path.display()))
}
