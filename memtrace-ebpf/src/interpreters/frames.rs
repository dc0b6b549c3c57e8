//! An interpreter's frames as the kernel side reads them (python.rs, perl.rs) and stores them
//! after a stack's native frames (stacks.rs): the same four words a frame whichever interpreter.

use memtrace_common::{interpreter_stop, FRAME_PERL, FRAME_PYTHON, INTERPRETER_MAX_FRAMES};

/// One interpreter frame as read: its code (a code object, a CV), where in it (an instruction, a
/// line), whether it ends a run of the interpreter's loop and its kind (Perl's `perl_frame`), and
/// what tells its code from another that had the same address before it (Python's).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct InterpreterFrame {
    pub(crate) code: u64,
    pub(crate) at: u64,
    /// 1 for an entry frame, and the kind from bit 8.
    pub(crate) flags: u64,
    pub(crate) fingerprint: u64,
}

impl InterpreterFrame {
    pub(crate) fn new(code: u64, at: u64, entry: u64, kind: u8, fingerprint: u64) -> Self {
        Self { code, at, flags: entry & 1 | u64::from(kind) << 8, fingerprint }
    }
}

/// The interpreter frames of one stack, innermost first (in the run's scratch slot).
#[repr(C)]
pub(crate) struct InterpreterFrames {
    /// `FRAME_PYTHON` or `FRAME_PERL`: how they are stored.
    pub(crate) status: u64,
    pub(crate) count: u64,
    /// Why they end short: 1 + an `interpreter_stop`, 0 when they are whole.
    pub(crate) cut: u64,
    pub(crate) frames: [InterpreterFrame; INTERPRETER_MAX_FRAMES],
}

impl InterpreterFrames {
    /// Starts a stack of `status` frames (none yet).
    pub(crate) fn begin(&mut self, status: i32) {
        self.status = status as u64;
        self.count = 0;
        self.cut = 0;
    }

    /// Adds a frame innermost-to-outermost; false when they are all taken (and the frames are
    /// then cut at the depth limit).
    pub(crate) fn push(&mut self, frame: InterpreterFrame) -> bool {
        let index = self.count;
        match self.frames.get_mut(index as usize & (INTERPRETER_MAX_FRAMES - 1)) {
            Some(slot) if index < INTERPRETER_MAX_FRAMES as u64 => {
                *slot = frame;
                self.count = index + 1;
                true
            }
            _ => {
                self.cut_at(interpreter_stop::DEPTH_LIMIT);
                false
            }
        }
    }

    /// Says why the frames end here, where they end short (`interpreter_stop`); the first reason
    /// given stands.
    pub(crate) fn cut_at(&mut self, stop: usize) {
        if self.cut == 0 {
            self.cut = stop as u64 + 1;
        }
    }

    /// Ends a walk (bpf_loop's 1) at a frame that could not be read.
    pub(crate) fn unreadable(&mut self) -> i64 {
        self.cut_at(interpreter_stop::UNREADABLE);
        1
    }

    /// Why the frames end short (an `interpreter_stop`), if they do.
    pub(crate) fn stop(&self) -> Option<usize> {
        self.cut.checked_sub(1).map(|stop| stop as usize)
    }

    /// Marks the last frame taken as ending a run of the interpreter's loop.
    pub(crate) fn mark_entry(&mut self) {
        let last = self.count.wrapping_sub(1);
        if let Some(frame) = self.frames.get_mut(last as usize & (INTERPRETER_MAX_FRAMES - 1)) {
            if last < INTERPRETER_MAX_FRAMES as u64 {
                frame.flags |= 1;
            }
        }
    }

    /// The frames as words, four a frame, `count` of them valid.
    pub(crate) fn words(&self) -> &[u64; INTERPRETER_MAX_FRAMES * 4] {
        // SAFETY: #[repr(C)] frames of four u64 words each.
        unsafe { &*(&raw const self.frames).cast() }
    }

    /// Frame `index` as a stored frame: the code in the build ID's first 8 bytes, the entry flag in
    /// its ninth, the kind in its tenth, the fingerprint in its last 8, the instruction or line as
    /// the offset.
    pub(crate) fn stored_words(&self, index: u64) -> [u64; 4] {
        let status = if self.status == FRAME_PERL as u64 { FRAME_PERL } else { FRAME_PYTHON };
        match self.frames.get(index as usize & (INTERPRETER_MAX_FRAMES - 1)) {
            Some(frame) => [
                status as u32 as u64 | (frame.code & 0xffff_ffff) << 32,
                frame.code >> 32 | (frame.flags & 0xffff) << 32,
                frame.fingerprint,
                frame.at,
            ],
            None => [0; 4],
        }
    }
}
