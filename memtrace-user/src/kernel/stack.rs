//! A call stack as the kernel stored it (STACKS or DEEP_STACKS, by depth), cut to its frames: the
//! one shape the collector and the symbolizer see, whichever table it came from.

use std::sync::Arc;

use memtrace_common::{StackFrame, FRAME_EMPTY};

/// The frames of one stack in build-ID form, innermost first; cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stack(Arc<[StackFrame]>);

impl Stack {
    /// The frames of a table's value, up to the first empty one (the kernel zeroes past the end).
    pub fn new(frames: &[StackFrame]) -> Self {
        let depth = frames.iter().position(|frame| frame.status == FRAME_EMPTY).unwrap_or(frames.len());
        Self(frames[..depth].into())
    }

    pub fn frames(&self) -> &[StackFrame] {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memtrace_common::{DeepStackFrames, FRAME_BUILD_ID, STACK_DEPTH};

    #[test]
    fn a_stack_ends_at_its_first_empty_frame() {
        let frame = StackFrame { status: FRAME_BUILD_ID, build_id: [1; 20], offset_or_ip: 8 };
        let mut deep = DeepStackFrames { frames: [StackFrame::EMPTY; STACK_DEPTH] };
        deep.frames[..100].fill(frame);
        assert_eq!(Stack::new(&deep.frames).frames().len(), 100);
        deep.frames.fill(frame);
        assert_eq!(Stack::new(&deep.frames).frames().len(), STACK_DEPTH);
    }
}
