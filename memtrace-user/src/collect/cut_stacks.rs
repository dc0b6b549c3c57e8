//! Stacks cut short, folded into the whole stacks they begin: a stack taken by frame pointers before
//! its process's unwind tables were loaded stops at the first frame it cannot place in a file, and
//! would otherwise be a second site of the leak it belongs to.

use std::sync::Arc;

use super::stack_table::add;
use crate::model::{frame::Frame, PeakConsumer, StackProfile};

/// Folds each stack that is the beginning of exactly one longer stack of the same process into it.
/// Such a stack was cut short: taken by frame pointers before the process's unwind tables were
/// loaded (a command's first allocations, before its first sample), where the walk stops at the
/// first frame it cannot place in a file. A whole stack always reaches the program's entry, so a
/// real call site is never the beginning of another; without this, one leak site would be two.
pub(super) fn merge_cut_stacks(stacks: &mut Vec<StackProfile>) {
    // In frame order, the stacks a stack begins follow it at once.
    stacks.sort_by(|a, b| a.frames.cmp(&b.frames));
    let mut whole_of: Vec<Option<usize>> = vec![None; stacks.len()];
    for (index, whole_of) in whole_of.iter_mut().enumerate() {
        let cut = &stacks[index].frames;
        let mut longer = (index + 1..stacks.len())
            .take_while(|&other| stacks[other].frames.starts_with(cut))
            .filter(|&other| stacks[other].frames.len() > cut.len());
        if let (Some(whole), None) = (longer.next(), longer.next()) {
            *whole_of = Some(whole);
        }
    }
    // A whole stack is never cut from another: what begins it begins the other too, so it would
    // have two longer stacks.
    for (cut, whole) in whole_of.iter().enumerate().filter_map(|(cut, whole)| Some((cut, (*whole)?))) {
        let cut = stacks[cut].clone();
        let whole = &mut stacks[whole];
        // Every figure, temporaries too (they were left behind until the demo's test showed
        // a worker's first batches, cut short, missing from its hot spot's temporaries).
        add(&mut whole.totals, &cut.totals);
        whole.leaked_bytes += cut.leaked_bytes;
        whole.leaked_allocations += cut.leaked_allocations;
        whole.oldest_age = whole.oldest_age.max(cut.oldest_age);
    }
    let mut index = 0;
    stacks.retain(|_| {
        index += 1;
        whole_of[index - 1].is_none()
    });
}

/// Folds the peak's cut stacks into the whole ones, as `merge_cut_stacks` folds the process's:
/// a consumer whose frames begin exactly one longer stack of the process is that stack. Most
/// live bytes first.
pub(super) fn merge_cut_consumers(
    consumers: Vec<PeakConsumer>,
    stacks: &[StackProfile],
) -> Vec<PeakConsumer> {
    let whole: Vec<Vec<Arc<Frame>>> = stacks.iter().map(|stack| stack.frames.clone()).collect();
    merge_into_whole(consumers, whole)
}

/// Folds each of `consumers` whose frames begin exactly one of `whole` into it (see
/// `merge_cut_consumers`); most live bytes first.
pub(super) fn merge_into_whole(
    consumers: Vec<PeakConsumer>,
    whole: Vec<Vec<Arc<Frame>>>,
) -> Vec<PeakConsumer> {
    let mut whole: Vec<&[Arc<Frame>]> = whole.iter().map(Vec::as_slice).collect();
    whole.sort();
    let mut merged: Vec<PeakConsumer> = Vec::with_capacity(consumers.len());
    for mut consumer in consumers {
        let first = whole.partition_point(|frames| *frames < consumer.frames.as_slice());
        let mut longer = whole[first..]
            .iter()
            .take_while(|frames| frames.starts_with(&consumer.frames))
            .filter(|frames| frames.len() > consumer.frames.len());
        if let (Some(frames), None) = (longer.next(), longer.next()) {
            consumer.frames = frames.to_vec();
        }
        match merged.iter_mut().find(|seen| seen.frames == consumer.frames) {
            Some(seen) => {
                seen.live_bytes += consumer.live_bytes;
                seen.live_allocations += consumer.live_allocations;
            }
            None => merged.push(consumer),
        }
    }
    merged.sort_by_key(|consumer| std::cmp::Reverse(consumer.live_bytes));
    merged
}

#[cfg(test)]
mod tests {
    use super::*;
    use memtrace_common::StackTotals;

    fn stack(names: &[&str], live: i64) -> StackProfile {
        let frame = |name: &&str| {
            std::sync::Arc::new(Frame {
                function: Some((*name).into()),
                file: None,
                line: None,
                module: "m".into(),
                offset: 0,
                interpreter: None,
            })
        };
        StackProfile {
            frames: names.iter().map(frame).collect(),
            totals: StackTotals {
                allocations: 2,
                allocated_bytes: 30,
                live_allocations: 1,
                live_bytes: live,
                temporary_allocations: 1,
                temporary_bytes: 20,
                started_ns: live as u64,
            },
            leaked_bytes: live as u64,
            leaked_allocations: 1,
            oldest_age: None,
        }
    }

    #[test]
    fn a_cut_stack_joins_the_one_whole_stack_it_begins() {
        let mut stacks = vec![
            stack(&["leak", "main"], 10),
            stack(&["leak", "main", "__libc_start_main", "_start"], 100),
            stack(&["other", "main", "__libc_start_main", "_start"], 1),
            // The beginning of two stacks: which one it was cut from is unknown, so it stays.
            stack(&["main"], 5),
        ];
        merge_cut_stacks(&mut stacks);
        assert_eq!(stacks.len(), 3);
        let leak = stacks.iter().find(|s| s.frames[0].function.as_deref() == Some("leak")).unwrap();
        assert_eq!((leak.frames.len(), leak.totals.live_bytes, leak.leaked_bytes), (4, 110, 110));
        // Every figure of the cut stack joins the whole one's; it began with the earlier.
        let expected = StackTotals {
            allocations: 4,
            allocated_bytes: 60,
            live_allocations: 2,
            live_bytes: 110,
            temporary_allocations: 2,
            temporary_bytes: 40,
            started_ns: 10,
        };
        assert_eq!(leak.totals, expected);
        assert!(stacks.iter().any(|s| s.frames.len() == 1));
    }
}
