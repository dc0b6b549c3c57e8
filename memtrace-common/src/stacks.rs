//! Call stacks as the kernel stores them: how deep and how many, one frame (`StackFrame`, its
//! `FRAME_*` kinds, interpreter frames among them), a stack of the common depth and a deeper one
//! (`StackFrames`, `DeepStackFrames`), and what each stack of a process allocated (`StackKey`,
//! `StackTotals`).

/// Distinct call stacks remembered at once (per machine).
pub const MAX_STACKS: u32 = 131_072;
/// Raw stacks (return addresses of one process) whose build-ID form is remembered; a cache.
pub const MAX_RAW_STACKS: u32 = 65_536;
/// (process, stack) pairs with totals at once.
pub const MAX_STACK_TOTALS: u32 = 131_072;
/// Frames the unwinder takes per stack, innermost first; deeper stacks are cut at the outer end
/// (`unwind_stop::DEPTH_LIMIT`). As deep as the OpenTelemetry profiler's native walk: a real
/// program's deepest stacks (an interpreter's, a recursive parser's) fit.
pub const STACK_DEPTH: usize = 128;
/// Frames a stack of the common depth is stored with (`StackFrames`, in STACKS); a deeper stack
/// is stored whole in DEEP_STACKS (`DeepStackFrames`), so that most stacks take a quarter of the
/// memory. The frame-pointer fallback (a process with no mapping table) takes at most this many.
pub const SHALLOW_STACK_DEPTH: usize = 32;
/// `Allocation::stack` when no stack was taken (--no-stacks, or the stack could not be recorded).
pub const NO_STACK: u64 = 0;

/// One user stack frame as the kernel resolves it at capture time (struct bpf_stack_build_id): the
/// file's build ID and offset while the process is alive, so it can be symbolized after it exits.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackFrame {
    /// FRAME_EMPTY, FRAME_BUILD_ID or FRAME_IP.
    pub status: i32,
    pub build_id: [u8; 20],
    /// File offset for FRAME_BUILD_ID, virtual address for FRAME_IP.
    pub offset_or_ip: u64,
}

impl StackFrame {
    /// Past the end of the stack: all zero, as bpf_get_stack leaves unused frames.
    pub const EMPTY: StackFrame = StackFrame { status: FRAME_EMPTY, build_id: [0; 20], offset_or_ip: 0 };
}

/// A Python frame, stored after the native frames of its stack: `build_id[0..8]` the code
/// object's address (little-endian), `build_id[8]` 1 for an entry frame (the first a native call
/// of the eval loop runs; the frames from one entry frame to the next ran in one native frame of
/// `_PyEval_EvalFrameDefault`), `build_id[12..20]` the code object's fingerprint
/// (`InterpreterCodeKey::fingerprint`), `offset_or_ip` the index of its current instruction (in
/// code units) in the code object.
pub const FRAME_PYTHON: i32 = 3;

/// A Perl frame, stored after the native frames of its stack: `build_id[0..8]` its code (the CV
/// of a sub; for another kind, the address of its file's name), `build_id[8]` 1 for the last frame
/// of a stack of contexts (one run of the op loop), `build_id[9]` its `perl_frame` kind,
/// `offset_or_ip` the line it is at.
pub const FRAME_PERL: i32 = 4;

/// What a Perl frame is (`FRAME_PERL`'s `build_id[9]`).
pub mod perl_frame {
    /// A sub's body: its code is its CV.
    pub const SUB: u8 = 0;
    /// The main program's code outside any sub (NYTProf's `main::RUNTIME`).
    pub const MAIN: u8 = 1;
    /// An `eval` (a string or a block).
    pub const EVAL: u8 = 2;
    /// A file's code run by `require` or `use`.
    pub const REQUIRE: u8 = 3;
}

/// No frame (past the end of the stack).
pub const FRAME_EMPTY: i32 = 0;
/// `build_id` and a file offset are valid.
pub const FRAME_BUILD_ID: i32 = 1;
/// The kernel could not read a build ID; only the address is known.
pub const FRAME_IP: i32 = 2;

/// A user call stack of at most `SHALLOW_STACK_DEPTH` frames, innermost frame (the allocator's
/// caller) first, zeroed past its end.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackFrames {
    pub frames: [StackFrame; SHALLOW_STACK_DEPTH],
}

/// A user call stack deeper than `SHALLOW_STACK_DEPTH` frames, innermost first, zeroed past its
/// end. Its first `SHALLOW_STACK_DEPTH` frames have the layout of a `StackFrames`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeepStackFrames {
    pub frames: [StackFrame; STACK_DEPTH],
}

/// Key of the per-(process, stack) totals.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StackKey {
    pub tgid: u32,
    pub _pad: u32,
    pub stack: u64,
}

/// What one call stack of one process allocated, and how much of it is still live.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize, serde::Deserialize))]
pub struct StackTotals {
    /// CLOCK_MONOTONIC nanoseconds when the first allocation from this stack was seen (a clock of
    /// the machine that traced: not kept in a summary).
    #[cfg_attr(feature = "user", serde(skip))]
    pub started_ns: u64,
    pub allocations: u64,
    pub allocated_bytes: u64,
    pub live_allocations: i64,
    pub live_bytes: i64,
    /// Allocations freed before the thread that made them allocated anything else (heaptrack's
    /// temporary allocations).
    pub temporary_allocations: u64,
    pub temporary_bytes: u64,
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: #[repr(C)] plain integers and byte arrays, padding spelled out as fields.
    unsafe impl aya::Pod for super::StackFrames {}
    unsafe impl aya::Pod for super::DeepStackFrames {}
    unsafe impl aya::Pod for super::StackKey {}
    unsafe impl aya::Pod for super::StackTotals {}
}

const _: () = assert!(STACK_DEPTH.is_power_of_two() && SHALLOW_STACK_DEPTH.is_power_of_two());
const _: () = assert!(SHALLOW_STACK_DEPTH < STACK_DEPTH);
