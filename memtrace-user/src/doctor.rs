//! `memtrace doctor`: whether tracing can work on this machine, and why not. It prints the kernel
//! and its preemption model, every kernel feature memtrace uses (found or missing, with the
//! oldest kernel that has it and what memtrace does without it), the attach path and unwinder a
//! run would take, the privileges held, and then loads memtrace's BPF programs as a run does and
//! says whether the kernel's verifier accepted them. The verdict comes last; the exit status
//! agrees with it (0: tracing can work here, 1: it cannot). Modelled on `bpftrace --info` and
//! `bpftool feature probe`.

use std::process::ExitCode;

use anyhow::Result;

use crate::{
    kernel::features::{Feature, FeatureInfo, KernelFeatures, LinkKind, Needs, Presence, Without, FEATURES},
    kernel::{self, ProbeConfig, Probes, Reach},
    privileges,
    process::{
        allocator::{installed_allocator_libraries, probe_points_in},
        probe_point::ProbePoint,
        FileCache,
    },
};

/// What came of loading memtrace's BPF programs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Programs {
    Accepted,
    /// The kernel refused them: the program and the verifier's reason, as far as they are known.
    Rejected(String),
    /// Not tried, and why.
    NotTried(String),
}

/// Whether tracing can work here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    CanWork,
    Cannot { why: String, fix: String },
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::CanWork => write!(f, "memtrace: tracing can work here"),
            Self::Cannot { why, fix } => write!(f, "memtrace: tracing cannot work here: {why}; {fix}"),
        }
    }
}

/// Runs `memtrace doctor`.
pub fn run() -> Result<ExitCode> {
    let features = KernelFeatures::probe();
    let kernel = &features.kernel;
    println!("kernel       {} ({})", kernel.release, kernel.version);
    println!("architecture {}", architecture());
    println!("preemption   {}", kernel.preemption);
    println!("features     (the oldest mainline kernel that has each; what memtrace does without it)");
    for info in &FEATURES {
        println!("  {}", feature_line(info, &features));
    }
    let link_kind = kernel::link_kind_for(&features)?;
    println!("attach path  {}", describe_links(link_kind, &features));
    println!("unwinder     {}", describe_unwinder(&features));
    println!("privileges   {}", describe_privileges(&privileges::held()));
    println!("probe points (where each function's probes sit in the allocators installed; * single-stepped: a second trap at every call)");
    for line in probe_point_lines() {
        println!("  {line}");
    }
    let missing_privileges = privileges::missing_for_a_run(link_kind == LinkKind::PerfEvent);
    let refusal = features.refusal(Needs::default());
    let programs = match (missing_privileges.is_empty(), &refusal) {
        (false, _) => Programs::NotTried("not loaded: loading needs root".into()),
        (true, Some(_)) => Programs::NotTried("not loaded: the kernel lacks what they need".into()),
        (true, None) => load_programs(&features),
    };
    println!("programs     {}", describe_programs(&programs));
    let verdict = verdict(&missing_privileges, refusal.as_deref(), &programs);
    println!("{verdict}");
    Ok(match verdict {
        Verdict::CanWork => ExitCode::SUCCESS,
        Verdict::Cannot { .. } => ExitCode::from(1),
    })
}

/// One line an installed allocator library: each function where its probes sit, `+offset` past
/// its entry and the instruction there, starred where the kernel single-steps it; then the
/// single-stepped ones again by name, or none.
fn probe_point_lines() -> Vec<String> {
    let cache = FileCache::default();
    // Each file once, by its real path: /lib is /usr/lib, and every .so is a link to its version.
    let libraries: std::collections::BTreeSet<_> = installed_allocator_libraries()
        .into_iter()
        .map(|path| std::fs::canonicalize(&path).unwrap_or(path))
        .collect();
    libraries
        .iter()
        .map(|path| match probe_points_in(path, &cache) {
            Ok(points) => {
                let placed: Vec<String> =
                    points.iter().map(|(name, point)| describe_point(name, point)).collect();
                let stepped: Vec<&str> = points
                    .iter()
                    .filter(|(_, point)| !point.emulated)
                    .map(|(name, _)| name.as_str())
                    .collect();
                let stepped = if stepped.is_empty() { "none".to_owned() } else { stepped.join(", ") };
                format!("{}: {}; single-stepped: {stepped}", path.display(), placed.join(", "))
            }
            Err(err) => format!("{}: not read: {err:#}", path.display()),
        })
        .collect()
}

/// `malloc+0x7 ja`, `free+0x30 jne`, `mremap sub*`.
pub fn describe_point(name: &str, point: &ProbePoint) -> String {
    let offset = if point.delta == 0 { String::new() } else { format!("+{:#x}", point.delta) };
    let star = if point.emulated { "" } else { "*" };
    format!("{name}{offset} {}{star}", point.instruction)
}

/// One feature: found or missing, the kernel that has it, and what memtrace does without it.
fn feature_line(info: &FeatureInfo, features: &KernelFeatures) -> String {
    let (major, minor) = info.since;
    let since = format!("{major}.{minor}+");
    let (status, note) = match features.presence(info.feature) {
        Presence::Found => ("found", String::new()),
        Presence::Missing(how) => ("missing", format!("{how}: {}", without(info, features))),
        Presence::Unknown(why) => ("unknown", format!("not probed: {why}")),
    };
    format!("{status:<8} {:<42} {since:<6} {note}", info.name).trim_end().to_owned()
}

/// What memtrace does on this kernel without a feature.
fn without(info: &FeatureInfo, features: &KernelFeatures) -> String {
    match info.without {
        Without::Refuse(_) => "required: memtrace refuses to start without it".into(),
        Without::RefuseForTrees(_) => {
            "required to follow process trees (--no-children and plain --pid work without it)".into()
        }
        Without::RefuseUnless(other, _) if features.has(other) => {
            format!("not needed: {} serve instead", other.info().name)
        }
        Without::RefuseUnless(other, _) => {
            format!("required without {}: memtrace refuses to start", other.info().name)
        }
        Without::Fallback(what) => what.into(),
    }
}

fn describe_links(kind: LinkKind, features: &KernelFeatures) -> String {
    if let Presence::Unknown(_) = features.presence(Feature::UprobeMulti) {
        return "unknown: uprobe_multi links cannot be probed without root".into();
    }
    let forced = match kernel::link_kind_for(features).ok() == Some(features.link_kind()) {
        true => "",
        false => " (as MEMTRACE_LINKS says)",
    };
    match kind {
        LinkKind::Multi => format!("uprobe_multi links, one per probed file{forced}"),
        LinkKind::PerfEvent => format!("per-site uprobe perf links, one per probe site{forced}"),
    }
}

fn describe_unwinder(features: &KernelFeatures) -> String {
    match features.lacks(Feature::BpfLoop) {
        true => "none: the .eh_frame unwinder needs bpf_loop".into(),
        false => ".eh_frame tables walked with bpf_loop; a process's mappings the kernel's (bpf_find_vma) \
                  until memtrace has read them"
            .into(),
    }
}

fn describe_privileges(held: &[privileges::Held]) -> String {
    let names = |held_or_not: bool| -> String {
        let names: Vec<&str> =
            held.iter().filter(|cap| cap.held == held_or_not).map(|cap| cap.name).collect();
        if names.is_empty() {
            "none".into()
        } else {
            names.join(", ")
        }
    };
    format!("held: {}; missing: {}", names(true), names(false))
}

fn describe_programs(programs: &Programs) -> String {
    match programs {
        Programs::Accepted => "loaded: the kernel's verifier accepted every program (then unloaded)".into(),
        Programs::Rejected(reason) => format!("rejected by the kernel: {reason}"),
        Programs::NotTried(why) => why.clone(),
    }
}

/// Loads memtrace's programs through the path a run takes (`memtrace -- COMMAND`: following the
/// command's tree where the kernel has BTF), with small tables, and drops them.
fn load_programs(features: &KernelFeatures) -> Programs {
    let config = ProbeConfig {
        max_allocations: 1024,
        max_stacks: 1024,
        capture_stacks: true,
        reach: if features.has(Feature::Btf) { Reach::Tree } else { Reach::Targets },
        ..ProbeConfig::default()
    };
    let kernel = crate::plan::Kernel::resolve(features.clone(), &config.reach);
    let loaded = kernel.and_then(|kernel| {
        let layout = kernel.layout()?;
        let mut probes = Probes::load(&config, &layout, kernel.link_kind)?;
        probes.load_every_program()?;
        Ok((probes, layout))
    });
    match loaded {
        Ok((probes, layout)) => {
            let line = match probes.reads_exits_early() {
                true => "read at do_exit's entry (fentry) and at sched_process_exit",
                false => {
                    "read at sched_process_exit only (no fentry on do_exit here): where that runs \
                          after the task's memory is released (before 6.18), a process that ends \
                          within an interval has no exit levels"
                }
            };
            println!("exit levels  {line}; {}", per_cpu_counts(&layout));
            drop(probes);
            Programs::Accepted
        }
        Err(err) => Programs::Rejected(rejection(&format!("{err:#}"))),
    }
}

/// Whether the exit levels sum the CPUs' pending RSS counts (kernels whose counters are per-CPU).
fn per_cpu_counts(layout: &memtrace_common::KernelLayout) -> &'static str {
    match (layout.percpu_counter_counters, layout.per_cpu_offset) {
        (0, _) => "the kernel's RSS counts are exact (no per-CPU counters)",
        (_, 0) => {
            "per-CPU RSS counts not summed: /proc/kallsyms has no __per_cpu_offset (a kernel without \
             CONFIG_KALLSYMS_ALL, or addresses hidden: run as root or with CAP_SYSLOG), so a process \
             that lives milliseconds may show fewer resident pages than it had"
        }
        _ => "per-CPU RSS counts summed (__per_cpu_offset from /proc/kallsyms)",
    }
}

/// A load's error as one line: its first context (which program) and the verifier's reason.
fn rejection(error: &str) -> String {
    let first = error.lines().next().unwrap_or_default();
    let what = first.split(": ").next().unwrap_or(first);
    // aya quotes the log after its own words, on the error's first line.
    let reason = verifier_reason(error).map(|line| line.rsplit("Verifier output: ").next().unwrap_or(line));
    match reason {
        Some(reason) if reason != what => format!("{what}: {reason}"),
        _ => first.to_owned(),
    }
}

/// The verifier's reason in its log: the last line that is neither the log's closing statistics
/// nor a dump of instructions or states.
pub fn verifier_reason(log: &str) -> Option<&str> {
    const TRAILERS: [&str; 6] = [
        "processed ",
        "verification time",
        "stack depth",
        "max_states_per_insn",
        "-- END PROG LOAD LOG --",
        "peak",
    ];
    let is_dump = |line: &str| {
        let numbered =
            line.split_once(':').is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        // `: <errno>` ends an error chain that quotes the log.
        let chain = line.starts_with(": ");
        numbered
            || chain
            || line.starts_with(';')
            || line.starts_with("from ")
            || line.starts_with("mark_precise")
    };
    log.lines()
        .map(str::trim)
        .rev()
        .find(|line| !line.is_empty() && !TRAILERS.iter().any(|t| line.starts_with(t)) && !is_dump(line))
}

/// The verdict: privileges first (without them nothing was probed for sure), then what the kernel
/// lacks, then whether it took the programs.
pub fn verdict(missing_privileges: &[&str], refusal: Option<&str>, programs: &Programs) -> Verdict {
    let cannot = |why: String, fix: &str| Verdict::Cannot { why, fix: fix.to_owned() };
    if !missing_privileges.is_empty() {
        let missing = missing_privileges.join(", ");
        let why = format!("not run as root (missing {missing}), so the kernel was not fully probed");
        return cannot(why, "run it as root: sudo memtrace doctor");
    }
    if let Some(refusal) = refusal {
        let (why, fix) = refusal.split_once("; ").unwrap_or((refusal, "run memtrace on a newer kernel"));
        return cannot(why.to_owned(), fix);
    }
    match programs {
        Programs::Accepted => Verdict::CanWork,
        Programs::Rejected(reason) => cannot(
            format!("the kernel's verifier rejected memtrace's BPF programs ({reason})"),
            "nothing on this machine can make the kernel take them: report it to memtrace's \
             maintainers with this output",
        ),
        Programs::NotTried(why) => cannot(why.clone(), "run it as root: sudo memtrace doctor"),
    }
}

/// The machine's architecture as memtrace reads it there, and what differs on it. memtrace runs
/// on its own architecture's processes: an arm64 build on arm64, an x86-64 build on x86-64.
fn architecture() -> String {
    match std::env::consts::ARCH {
        "aarch64" => "aarch64 (arm64: a function that starts with paciasp or stp x29, x30 keeps its probes \
                      there, single-stepped, as a return probe must come before them)"
            .to_owned(),
        arch => arch.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STACK_LOG: &str = "the kernel refused program alloc_exit for uprobe_multi: Permission denied (os error 13)\n\
        1234: (85) call pc+12\n\
        ; let x = y; @ stacks.rs:12\n\
        combined stack size of 2 calls is 736. Too large\n\
        verification time 41234 usec\n\
        stack depth 352+376+0\n\
        processed 12345 insns (limit 1000000) max_states_per_insn 4 total_states 100 peak_states 90 mark_read 9";

    #[test]
    fn the_verifier_reason_is_its_last_word_before_the_statistics() {
        assert_eq!(verifier_reason(STACK_LOG), Some("combined stack size of 2 calls is 736. Too large"));
        let bounds = "171: (0f) r2 += r1\nR2 min value is negative, either use unsigned or 'var &= const'\n\
                      processed 300 insns (limit 1000000)";
        assert_eq!(
            verifier_reason(bounds),
            Some("R2 min value is negative, either use unsigned or 'var &= const'")
        );
    }

    #[test]
    fn a_rejection_names_the_program_and_the_reason() {
        assert_eq!(
            rejection(STACK_LOG),
            "the kernel refused program alloc_exit for uprobe_multi: combined stack size of 2 calls is 736. Too large"
        );
    }

    #[test]
    fn a_rejection_through_aya_drops_its_wrapping() {
        let aya = "verifying BPF program usdt_site: the BPF_PROG_LOAD syscall returned Permission denied \
                   (os error 13). Verifier output: combined stack size of 2 calls is 608. Too large\n\
                   verification time 12 usec\nstack depth 352+256\n: Permission denied (os error 13)";
        assert_eq!(
            rejection(aya),
            "verifying BPF program usdt_site: combined stack size of 2 calls is 608. Too large"
        );
    }

    #[test]
    fn the_verdict_puts_privileges_first_then_the_kernel_then_the_programs() {
        assert_eq!(verdict(&[], None, &Programs::Accepted), Verdict::CanWork);
        assert_eq!(verdict(&[], None, &Programs::Accepted).to_string(), "memtrace: tracing can work here");
        let not_root = verdict(&["CAP_BPF"], None, &Programs::NotTried("x".into())).to_string();
        assert!(not_root.starts_with("memtrace: tracing cannot work here: not run as root"), "{not_root}");
        assert!(not_root.ends_with("; run it as root: sudo memtrace doctor"), "{not_root}");
        let features = KernelFeatures::with_missing("5.10.0-32-amd64", &[Feature::BpfLoop]);
        let refusal = features.refusal(Needs::default()).unwrap();
        let old = verdict(&[], Some(&refusal), &Programs::NotTried("x".into())).to_string();
        assert!(old.contains("cannot work here: this kernel (5.10.0-32-amd64) lacks bpf_loop"), "{old}");
        assert!(
            old.ends_with("; run memtrace on a newer kernel (Debian 12's 6.1 is the oldest tested)"),
            "{old}"
        );
        let rejected = verdict(&[], None, &Programs::Rejected("alloc_exit: Too large".into())).to_string();
        assert!(
            rejected.contains("verifier rejected memtrace's BPF programs (alloc_exit: Too large); "),
            "{rejected}"
        );
    }

    #[test]
    fn feature_lines_say_what_memtrace_does_without() {
        let features = KernelFeatures::with_missing("6.1.0", &[Feature::UprobeMulti, Feature::BpfLoop]);
        let multi = feature_line(Feature::UprobeMulti.info(), &features);
        assert!(multi.starts_with("missing  uprobe_multi links") && multi.contains("6.6+"), "{multi}");
        assert!(multi.contains("per-site uprobe perf links"), "{multi}");
        let bpf_loop = feature_line(Feature::BpfLoop.info(), &features);
        assert!(bpf_loop.contains("5.17+") && bpf_loop.contains("refuses to start"), "{bpf_loop}");
        assert!(feature_line(Feature::Btf.info(), &features).starts_with("found    BTF"));
    }
}
