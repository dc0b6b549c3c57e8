//! The heap profile as the model holds it, read once for every encoding of it (pprof, OTLP): the
//! four sample types, which processes a profile covers, each call stack's values in sample-type
//! order, and what sampling means for those values.

use std::sync::Arc;

use crate::model::{estimate::Sampling, frame::Frame, Model, Process};

/// The sample types of every heap profile memtrace writes, as (type, unit), in the order of each
/// sample's values.
pub const SAMPLE_TYPES: [(&str, &str); 4] = [
    ("alloc_objects", "count"),
    ("alloc_space", "bytes"),
    ("inuse_objects", "count"),
    ("inuse_space", "bytes"),
];

/// The sample type viewers show first: the live heap.
pub const DEFAULT_SAMPLE_TYPE: &str = "inuse_space";

/// Which processes a profile covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Processes {
    All,
    /// One process, by pid (`/debug/pprof/heap?pid=N` of `memtrace serve`).
    One(u32),
}

/// One call stack of one process, with its values in [`SAMPLE_TYPES`] order.
pub struct StackSample<'a> {
    /// Innermost first.
    pub frames: &'a [Arc<Frame>],
    pub values: [i64; 4],
}

/// The processes `processes` names, in the model's order.
pub fn chosen(model: &Model, processes: Processes) -> impl Iterator<Item = &Process> {
    model
        .every_process()
        .filter(move |p| processes == Processes::All || processes == Processes::One(p.identity.pid))
}

/// A process's call stacks as samples.
pub fn samples(process: &Process) -> impl Iterator<Item = StackSample<'_>> {
    process.stacks.iter().map(|stack| StackSample {
        frames: &stack.frames,
        values: [
            stack.totals.allocations as i64,
            stack.totals.allocated_bytes as i64,
            stack.totals.live_allocations,
            stack.totals.live_bytes,
        ],
    })
}

/// What the values of a sampled run (`--sample`) are, in words.
pub fn sampling_note(sampling: Sampling) -> String {
    let mean = sampling.mean_bytes;
    format!(
        "memtrace --sample {mean}: values are estimates from allocations sampled a mean of {mean} bytes apart, \
         each scaled by 1/(1-exp(-size/{mean})) as pprof scales heap samples"
    )
}

/// What makes a profile's values estimates, said in its comment: `--sample`'s scaling, or the
/// allocators' own samples (`--app-sampled`); None for exact figures.
pub fn estimate_note(model: &Model) -> Option<String> {
    if let Some(windows) = model.windows {
        return Some(format!(
            "memtrace --window {}s/{}s: values are estimates, the allocations of {:.1}s of windows in {:.1}s, \
             each process's scaled by its user CPU time over that inside windows (or by {:.2}, the run's \
             time over the windows')",
            windows.on_s, windows.every_s, windows.probed_s, windows.elapsed_s, windows.weight
        ));
    }
    match (model.sampling, model.app_sampled) {
        (Some(sampling), _) => Some(sampling_note(sampling)),
        (None, Some(app)) => Some(format!(
            "memtrace --app-sampled: values are the allocators' own estimates ({}): each sample counts \
             as the weighted bytes the allocator gave it",
            app.probes
        )),
        (None, None) => None,
    }
}

/// The `n` processes of the model with the largest live heaps (the agent's pushes), largest first.
pub fn largest(model: &Model, n: usize) -> Vec<&Process> {
    let mut processes: Vec<&Process> = model.processes.values().collect();
    processes.sort_by_key(|process| (std::cmp::Reverse(process.stats.live_bytes), process.identity.pid));
    processes.truncate(n);
    processes
}
