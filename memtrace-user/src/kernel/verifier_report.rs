//! The BPF stack each program uses, as the verifier reports it: every program of the embedded
//! object loaded once more with the verifier's statistics (`stack depth A+B+...`, one figure per
//! function in the order the functions lie in the program), and the program's call graph read
//! from its instructions, so that the deepest chain of calls (bpf_loop callbacks included, as the
//! verifier counts them) is summed from the verifier's own figures.
//!
//! Two rules follow from kernel_stack.rs in memtrace-ebpf and are what `memtrace verifier-report`
//! and its test hold: every chain fits the 512 bytes of stack a chain may use on a kernel without
//! private stacks, and a program may run preempted (every uprobe program) only on the kernel's
//! stack: it holds the tail call that rules private stacks out, or, sleepable, keeps every
//! function's frame under the 64 bytes from which the verifier gives one.

use std::collections::BTreeSet;

use anyhow::{bail, Context, Result};
use aya::Ebpf;
use aya_obj::generated::bpf_insn;

use std::os::fd::AsFd;

use super::loader::{load_logged, Prepared, ProgramKind};
use crate::kernel::sys::prog_info;

/// The stack a call chain may use without a private stack (MAX_BPF_STACK).
pub const MAX_CHAIN_BYTES: u32 = 512;
/// The smallest frame the verifier gives a private stack to (BPF_PRIV_STACK_MIN_SIZE, 6.13+).
pub const PRIVATE_STACK_FROM: u32 = 64;
/// The verifier's statistics only: no walk.
const LOG_STATS: u32 = 4;

/// One program's stack, by the verifier.
#[derive(Debug, serde::Serialize)]
pub struct ProgramStack {
    pub name: String,
    pub sleepable: bool,
    /// A uprobe program, which the kernel may preempt mid-run and run again on the same CPU (a raw
    /// tracepoint program is never run twice on one CPU at once: the kernel skips, and counts, such
    /// a run).
    pub preemptible: bool,
    /// Whether it holds a tail call (which keeps it off a private stack).
    pub tail_call: bool,
    /// The verifier's frame sizes, one a function, the program's own first.
    pub frames: Vec<u32>,
    /// The deepest chain of calls: its functions (indices into `frames`) and their frames summed,
    /// each rounded up to 16 bytes as the verifier does for a JIT-compiled program (every kernel
    /// of the matrix has BPF_JIT_ALWAYS_ON).
    pub deepest_chain: Vec<usize>,
    pub deepest_bytes: u32,
    /// The deepest chain as the verifier itself sums it, where it says (`... max N`).
    pub verifier_max: Option<u32>,
    /// What verifying it cost: instructions the verifier walked (1,000,000 at most) and the time.
    pub verifier_cost: VerifierCost,
}

/// The verifier's own statistics of one load (`processed N insns`, `verification time N usec`).
#[derive(Debug, Default, Clone, Copy, PartialEq, serde::Serialize)]
pub struct VerifierCost {
    pub insns_processed: u64,
    pub verification_us: u64,
}

impl VerifierCost {
    fn of(log: &str) -> Self {
        let figure = |prefix: &str| {
            log.lines()
                .find_map(|line| line.strip_prefix(prefix))
                .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
                .unwrap_or(0)
        };
        Self { insns_processed: figure("processed "), verification_us: figure("verification time ") }
    }
}

impl ProgramStack {
    /// What is wrong with the program's stack, if anything.
    pub fn problem(&self) -> Option<String> {
        if let Some(max) = self.verifier_max.filter(|&max| max > MAX_CHAIN_BYTES) {
            return Some(format!(
                "{}: the verifier sums its deepest chain of calls to {max} bytes of stack",
                self.name
            ));
        }
        if self.deepest_bytes > MAX_CHAIN_BYTES {
            return Some(format!(
                "{}: a chain of calls takes {} bytes of stack (functions {:?} of frames {:?}), more than {MAX_CHAIN_BYTES}",
                self.name, self.deepest_bytes, self.deepest_chain, self.frames
            ));
        }
        let largest = self.frames.iter().copied().max().unwrap_or(0);
        if self.preemptible && !self.tail_call && largest >= PRIVATE_STACK_FROM {
            return Some(format!(
                "{}: holds no tail call, yet a function's frame is {largest} bytes (from {PRIVATE_STACK_FROM} the \
                 verifier of 6.13+ gives it a private per-CPU stack, which preempted runs share)",
                self.name
            ));
        }
        None
    }
}

/// Every uprobe and raw tracepoint program of `object` (whose maps `ebpf` created), verified, the
/// uprobes with `attach_type`: the one the run's own uprobes were loaded with, as the kernel lets
/// programs that share a program array (kernel_stack.rs's) differ in nothing else.
pub fn report(object: &[u8], ebpf: &Ebpf, attach_type: u32) -> Result<Vec<ProgramStack>> {
    let prepared = Prepared::new(object, ebpf)?;
    let mut report = Vec::new();
    for (name, _) in ebpf.programs() {
        let (section, function) = prepared.program(name)?;
        let Some(kind) = ProgramKind::of(section, attach_type) else { continue };
        let (loaded, log) = load_logged(name, function, &prepared, kind, Some(LOG_STATS))?;
        let fd = loaded.with_context(|| format!("the kernel refused BPF program {name}:\n{log}"))?;
        let (kept, verifier_max) = stack_depths(&log)
            .with_context(|| format!("no `stack depth` in the verifier's log of {name}:\n{log}"))?;
        let graph = CallGraph::of(&function.instructions);
        let kept_types = prog_info::function_types(fd.as_fd())?;
        let types: Vec<u32> = function.func_info.func_info.iter().map(|info| info.type_id).collect();
        if kept_types.len() != kept.len() || types.len() != graph.starts.len() {
            bail!(
                "{name}: the verifier reports {} functions of {}, its code has {}",
                kept.len(),
                kept_types.len(),
                graph.starts.len()
            );
        }
        // A function the verifier dropped (only dead code called it) ran nowhere: its frame is 0.
        let frames = types
            .iter()
            .map(|ty| kept_types.iter().position(|kept_type| kept_type == ty).map_or(0, |at| kept[at]))
            .collect::<Vec<u32>>();
        let (deepest_bytes, deepest_chain) = graph.deepest(0, &frames, &mut Vec::new());
        report.push(ProgramStack {
            name: name.to_owned(),
            sleepable: kind.sleepable,
            preemptible: kind.preemptible(),
            tail_call: graph.tail_call,
            frames,
            deepest_chain,
            deepest_bytes,
            verifier_max,
            verifier_cost: VerifierCost::of(&log),
        });
    }
    report.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(report)
}

/// The figures of the log's `stack depth 48+104+0` line, and the deepest chain where the kernel
/// says it too (`stack depth 48+0+40 max 88`, newer kernels).
fn stack_depths(log: &str) -> Option<(Vec<u32>, Option<u32>)> {
    let line = log.lines().find_map(|line| line.strip_prefix("stack depth "))?;
    let mut words = line.split_whitespace();
    let frames = words.next()?.split('+').map(|figure| figure.parse().ok()).collect::<Option<Vec<u32>>>()?;
    let max = match (words.next(), words.next()) {
        (Some("max"), Some(max)) => Some(max.parse().ok()?),
        _ => None,
    };
    Some((frames, max))
}

const CALL: u8 = 0x85;
const LOAD_IMM64: u8 = 0x18;
const PSEUDO_CALL: u8 = 1;
const PSEUDO_FUNC: u8 = 4;
const FUNC_TAIL_CALL: i32 = 12;

/// A program's functions (by their first instruction) and which calls which.
struct CallGraph {
    starts: Vec<usize>,
    /// (caller, callee) by function index.
    calls: BTreeSet<(usize, usize)>,
    tail_call: bool,
}

impl CallGraph {
    fn of(code: &[bpf_insn]) -> Self {
        let mut edges = Vec::new();
        let mut tail_call = false;
        for (at, insn) in code.iter().enumerate() {
            let target = (at as i64 + i64::from(insn.imm) + 1) as usize;
            match (insn.code, insn.src_reg()) {
                (CALL, PSEUDO_CALL) | (LOAD_IMM64, PSEUDO_FUNC) => edges.push((at, target)),
                (CALL, 0) if insn.imm == FUNC_TAIL_CALL => tail_call = true,
                _ => {}
            }
        }
        let starts: Vec<usize> =
            BTreeSet::from_iter(std::iter::once(0).chain(edges.iter().map(|&(_, target)| target)))
                .into_iter()
                .collect();
        let function_of = |at: usize| starts.partition_point(|&start| start <= at) - 1;
        let calls = edges.iter().map(|&(at, target)| (function_of(at), function_of(target))).collect();
        Self { starts, calls, tail_call }
    }

    /// The deepest chain from `function`: its bytes and its functions.
    fn deepest(&self, function: usize, frames: &[u32], path: &mut Vec<usize>) -> (u32, Vec<usize>) {
        path.push(function);
        let mut best = (0, Vec::new());
        for &(_, callee) in self.calls.range((function, 0)..=(function, usize::MAX)) {
            if path.contains(&callee) {
                continue;
            }
            let below = self.deepest(callee, frames, path);
            if below.0 > best.0 {
                best = below;
            }
        }
        path.pop();
        let own = frames.get(function).copied().unwrap_or(0).div_ceil(16) * 16;
        best.1.insert(0, function);
        (own + best.0, best.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stack_depth_line_is_read() {
        let log = "func#0 @0\nverification time 68340 usec\nstack depth 224+0+376+16\nprocessed 10 insns\n";
        assert_eq!(stack_depths(log), Some((vec![224, 0, 376, 16], None)));
        assert_eq!(
            stack_depths("stack depth 48+0+40+16+48 max 112\n"),
            Some((vec![48, 0, 40, 16, 48], Some(112)))
        );
        assert_eq!(stack_depths("processed 10 insns"), None);
        assert_eq!(VerifierCost::of(log), VerifierCost { insns_processed: 10, verification_us: 68340 });
    }

    #[test]
    fn a_chain_over_512_bytes_is_a_problem() {
        let stack = |frames: Vec<u32>, chain: u32, tail_call| ProgramStack {
            name: "p".into(),
            sleepable: false,
            preemptible: true,
            tail_call,
            frames,
            deepest_chain: vec![0, 1],
            deepest_bytes: chain,
            verifier_max: None,
            verifier_cost: VerifierCost::default(),
        };
        assert!(stack(vec![352, 376], 736, true).problem().unwrap().contains("736 bytes"));
        assert!(stack(vec![48, 280], 352, true).problem().is_none());
        assert!(stack(vec![48, 64], 128, false).problem().unwrap().contains("private"));
        assert!(stack(vec![48, 63], 128, false).problem().is_none());
    }
}
