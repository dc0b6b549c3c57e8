//! `memtrace diff --pprof PATH`: the comparison as one gzipped pprof profile, built the way
//! `go tool pprof -diff_base BASE NEW` builds its own: the new run's stacks as they are, the base
//! run's with every value negated and the label `pprof::base=true`, so pprof shows what changed
//! (`go tool pprof -top PATH`: a function's flat figure is its change) and takes its percentages
//! from the new run alone. Frames are the names the comparison matches stacks by (function and
//! module file name), so two builds' stacks meet.

use std::path::Path;

use anyhow::{Context, Result};

use super::compare::{Compared, Diff, Figures, StackKey};
use crate::{
    export::pprof::{profile_of, write_gzipped, NamedSample},
    model::frame::Frame,
};

/// The sample types, one a figure, in the order of `Figures::NAMES`.
const SAMPLE_TYPES: [(&str, &str); 6] = [
    ("alloc_space", "bytes"),
    ("alloc_objects", "count"),
    ("peak_space", "bytes"),
    ("inuse_space", "bytes"),
    ("leaked_space", "bytes"),
    ("temporary_objects", "count"),
];

fn values(figures: &Figures, sign: i64) -> Vec<i64> {
    figures.values().iter().map(|value| value * sign).collect()
}

/// A frame of the profile, named as the comparison names it.
fn frame(name: &str) -> Frame {
    Frame {
        function: Some(name.to_owned()),
        file: None,
        line: None,
        module: String::new(),
        offset: 0,
        interpreter: None,
    }
}

/// The two samples of a compared stack: the new run's, and the base's negated (where each has
/// one).
fn samples(row: &Compared<StackKey>) -> impl Iterator<Item = NamedSample<'_>> {
    let mut frames: Vec<Frame> = row.key.frames.iter().map(|name| frame(name)).collect();
    frames.push(frame(&row.key.command));
    let command: &str = &row.key.command;
    let new = (row.new != Figures::default()).then(|| NamedSample {
        frames: frames.clone(),
        values: values(&row.new, 1),
        labels: vec![("command", command)],
    });
    let base = (row.base != Figures::default()).then(|| NamedSample {
        frames,
        values: values(&row.base, -1),
        labels: vec![("command", command), ("pprof::base", "true")],
    });
    new.into_iter().chain(base)
}

/// Writes the comparison's profile to `path`.
pub fn write(diff: &Diff, path: &Path) -> Result<()> {
    let profile = profile_of(&SAMPLE_TYPES, "alloc_space", diff.stacks.iter().flat_map(samples));
    let file = std::fs::File::create(path)
        .with_context(|| format!("cannot write {}: is its directory there and writable?", path.display()))?;
    write_gzipped(&profile, file).with_context(|| format!("writing {}", path.display()))
}
