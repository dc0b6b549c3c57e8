//! Every program runs on the kernel's own stack, never on a private per-CPU one.
//!
//! Since Linux 6.13 the verifier gives a kprobe-type program (uprobes are kprobe-type) a private
//! stack per CPU for each function whose frame is 64 bytes or more, on the assumption that such a
//! program cannot be preempted. A uprobe program can be, on PREEMPT(lazy), PREEMPT and PREEMPT_RT
//! kernels: another thread then runs the same program on the same CPU, on the same private stack,
//! and overwrites the first run's frames (kernel crashes in alloc_exit on Debian's 7.2). The
//! verifier gives no private stack to a program that holds a tail call, so every program holds one
//! here, behind a global the loader never sets: it never runs, costs a load and a branch, and the
//! verifier (which knows read-only globals) does not even walk it. What the program needs beyond
//! that then has to fit the 512 bytes of stack a call chain may use on every kernel; what does not
//! fit lives in a slot the run claims (scratch.rs). The one sleepable program, usdt_site, may not
//! hold a tail call: no function of it keeps the 64 bytes that would earn a private stack.

use aya_ebpf::{macros::map, maps::ProgramArray, EbpfContext};

use crate::helpers::loaded;

/// Never filled: a tail call into it fails and returns.
#[map]
static NO_PROGRAMS: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// Never set by the loader: the tail call below is there for the verifier to see, not to run.
#[no_mangle]
static TAIL_CALL_NEVER: u8 = 0;

/// Keeps the calling program on the kernel stack; call it from the program's own body (the
/// verifier looks for the tail call in any function of the program, the main one is simplest).
#[inline(always)]
pub(crate) fn stay_on_kernel_stack(ctx: &impl EbpfContext) {
    if loaded(&TAIL_CALL_NEVER) != 0 {
        // SAFETY: `ctx` is the program's own context; the array is empty, so the call returns.
        unsafe { NO_PROGRAMS.tail_call(ctx, 0) };
    }
}
