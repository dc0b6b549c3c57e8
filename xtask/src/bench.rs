//! What tracing costs the traced program, in one run, as ratios: a malloc/free loop (one thread,
//! 64 live slots, mixed sizes, built with frame pointers) untraced; under the floor of exact
//! tracing (programs that do nothing on the same probe points, `memtrace --empty-probes`); and
//! under memtrace exact with and without stacks, and sampled. The traced variants are measured in turns, round
//! after round, and the best round of each is kept, so that a noisy moment does not favour one.
//! Then what following a process tree costs everyone else: the same loop, untraced, in a process
//! outside the tree while memtrace follows one (its probes then fire in every process that maps
//! libc); the traced cost of a subsystem report on a 5-byte and on a 1-byte nop site; and how long
//! a whole run of `memtrace -- true` takes. Then scale: two threads at once on two cores, traced
//! (no event may be lost, and each thread's figure is set against the single thread's); and the
//! collector's own CPU use while 100 quiet processes are traced. Last, bpftrace running a
//! memleak-style script on the same loop, where bpftrace is installed or can be; and real Python
//! work, exact, sampled, under heaptrack and in the fleet mode (`--app-sampled`): python_work.rs.
//! Real servers (redis, sqlite3, python3 with glibc, tcmalloc and mimalloc) beside heaptrack are
//! a run of their own, `--servers`: servers.rs.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

mod collector;
mod python_work;
mod servers;

use crate::{as_root, compile_c, workspace_root};

const PAIRS: &str = "400000";
const ROUNDS: usize = 5;

/// One way of running the loop.
struct Variant {
    name: &'static str,
    /// memtrace's options, or None for the untraced loop.
    memtrace_args: Option<&'static [&'static str]>,
    best_ns: f64,
}

/// What `cargo xtask bench` measures: everything, or one part alone.
pub enum Part {
    All,
    Python,
    Windowed,
    Collector,
    /// Real servers and programs side by side with heaptrack (servers.rs).
    Servers,
}

pub fn run(memtrace: &Path, part: Part) -> Result<()> {
    let trace = workspace_root().join("target/bench/trace.json");
    match part {
        Part::Python => return python_work::run(memtrace),
        Part::Windowed => return python_work::run_windowed(memtrace),
        Part::Collector => return collector_costs(memtrace, &trace),
        Part::Servers => return servers::run(memtrace),
        Part::All => {}
    }
    let program = compile_c("bench/malloc_loop.c", "bench", &["-pthread"])?;
    let PairCosts { untraced, floor, single } = pair_costs(memtrace, &program, &trace)?;
    let outside = ns_outside_a_followed_tree(memtrace, &program, &trace)?;
    println!(
        "  {:<24} {:>8.1} ns   x untraced {:>6.1}   (an untraced process while memtrace follows a tree)",
        "outside a followed tree",
        outside,
        outside / untraced
    );
    let threads = two_threads(memtrace, &program, &trace)?;
    println!(
        "two threads at once, each {PAIRS} pairs (best of {ROUNDS}): untraced {:.1} ns, memtrace {:.1} ns per \
         pair and thread = x{:.2} the single thread's; {} events lost",
        threads.untraced,
        threads.traced,
        threads.traced / single,
        threads.lost_events
    );
    collector_costs(memtrace, &trace)?;
    match bpftrace_ns(&program)? {
        Some(ns) => println!(
            "  {:<24} {:>8.1} ns   x untraced {:>6.1}   x floor {:>5.2}   (memtrace is x{:.2} cheaper; \
             above the floor, x{:.2})",
            "bpftrace memleak-style",
            ns,
            ns / untraced,
            ns / floor,
            ns / single,
            (ns - floor) / (single - floor)
        ),
        None => println!("bpftrace: not installed and could not be installed; its row is left out"),
    }
    unwinder_cost(memtrace, &trace, Baseline { untraced, floor })?;
    let [nop5, nop1] = usdt_report_ns(memtrace, &trace)?;
    println!(
        "subsystem report traced ({REPORTS} MEMTRACE_REPORT_DELTA, best of {ROUNDS}): 5-byte nop site \
         (memtrace.h's default) {nop5:.1} ns, 1-byte nop site (MEMTRACE_ONE_BYTE_SITES, \
         as sdt.h's STAP_PROBE2) {nop1:.1} ns"
    );
    python_work::run(memtrace)?;
    let whole_run = whole_run_time(memtrace, &trace)?;
    println!(
        "a whole run of `memtrace -- true` (load, attach, detach, outputs): {:.0} ms",
        whole_run.as_secs_f64() * 1e3
    );
    Ok(())
}

/// What a malloc/free pair costs untraced, under the floor and under memtrace exact (with stacks).
struct PairCosts {
    untraced: f64,
    floor: f64,
    single: f64,
}

/// Times the loop in every variant, alternating, and prints them side by side.
fn pair_costs(memtrace: &Path, program: &Path, trace: &Path) -> Result<PairCosts> {
    let mut variants = [
        Variant { name: "untraced", memtrace_args: None, best_ns: f64::MAX },
        Variant {
            name: "floor (empty programs)",
            memtrace_args: Some(&["--empty-probes"]),
            best_ns: f64::MAX,
        },
        Variant { name: "memtrace", memtrace_args: Some(&[]), best_ns: f64::MAX },
        Variant { name: "memtrace --no-stacks", memtrace_args: Some(&["--no-stacks"]), best_ns: f64::MAX },
        Variant {
            name: "memtrace --no-children",
            memtrace_args: Some(&["--no-children"]),
            best_ns: f64::MAX,
        },
        Variant {
            name: "memtrace --sample 512KiB",
            memtrace_args: Some(&["--sample", "512KiB"]),
            best_ns: f64::MAX,
        },
    ];
    for _ in 0..ROUNDS {
        for variant in &mut variants {
            let mut command = match variant.memtrace_args {
                None => Command::new(program),
                Some(args) => {
                    let mut command = memtrace_writing(memtrace, trace);
                    command.args(args).arg("--").arg(program);
                    command
                }
            };
            variant.best_ns = variant.best_ns.min(ns_per_pair(command.arg(PAIRS))?);
        }
    }
    let (untraced, floor, single) = (variants[0].best_ns, variants[1].best_ns, variants[2].best_ns);
    println!(
        "malloc/free pair ({PAIRS} pairs, 64 live slots, mixed sizes; best of {ROUNDS} rounds, one run):"
    );
    for variant in &variants {
        println!(
            "  {:<24} {:>8.1} ns   x untraced {:>6.1}   x floor {:>5.2}",
            variant.name,
            variant.best_ns,
            variant.best_ns / untraced,
            variant.best_ns / floor
        );
    }
    Ok(PairCosts { untraced, floor, single })
}

/// The loop run outside memtrace's tree while memtrace follows `sleep` and its descendants: the
/// probes fire in the loop's process too and are filtered out in the kernel. Best of ROUNDS.
fn ns_outside_a_followed_tree(memtrace: &Path, program: &Path, trace: &Path) -> Result<f64> {
    let mut follower = memtrace_writing(memtrace, trace)
        .args(["--", "sleep", "600"])
        .stderr(Stdio::piped())
        .spawn()
        .context("starting memtrace -- sleep 600")?;
    let stderr = follower.stderr.take().context("memtrace's stderr")?;
    let mut lines = BufReader::new(stderr).lines().map_while(Result::ok);
    // Probes are in place once memtrace says it is tracing.
    let measured = match lines.any(|line| line.starts_with("memtrace: tracing")) {
        true => {
            (0..ROUNDS).map(|_| ns_per_pair(Command::new(program).arg(PAIRS))).collect::<Result<Vec<f64>>>()
        }
        false => Err(anyhow::anyhow!("memtrace -- sleep 600 never said it was tracing")),
    };
    let _ = Command::new("kill").arg("-INT").arg(follower.id().to_string()).status();
    // Read what it says to the end, so that it never blocks on a full pipe.
    lines.for_each(drop);
    let _ = follower.wait();
    Ok(measured?.into_iter().fold(f64::MAX, f64::min))
}

/// The loop's figures with two threads at once.
struct TwoThreads {
    untraced: f64,
    traced: f64,
    /// What memtrace's summary counted as lost over every traced run.
    lost_events: u64,
}

fn two_threads(memtrace: &Path, program: &Path, trace: &Path) -> Result<TwoThreads> {
    let summary = trace.with_file_name("summary.json");
    let mut figures = TwoThreads { untraced: f64::MAX, traced: f64::MAX, lost_events: 0 };
    for _ in 0..ROUNDS {
        figures.untraced = figures.untraced.min(ns_per_pair(Command::new(program).args([PAIRS, "2"]))?);
        let mut traced = memtrace_writing(memtrace, trace);
        traced.arg("--summary").arg(&summary).arg("--").arg(program).args([PAIRS, "2"]);
        figures.traced = figures.traced.min(ns_per_pair(&mut traced)?);
        figures.lost_events += lost_events(&summary)?;
    }
    Ok(figures)
}

/// Every event a summary counts as lost, over the run and its processes.
fn lost_events(summary: &Path) -> Result<u64> {
    let text = std::fs::read_to_string(summary).with_context(|| format!("reading {}", summary.display()))?;
    let summary: serde_json::Value = serde_json::from_str(&text)?;
    let processes = summary["processes"].as_array().map(Vec::as_slice).unwrap_or_default();
    let per_process: u64 = processes.iter().filter_map(|process| process["lost_events"].as_u64()).sum();
    Ok(summary["lost_events"].as_u64().unwrap_or(0) + per_process)
}

/// bpftrace with a memleak-style script (sizes at entry, live blocks and their user stacks at
/// return, forgotten at free, which bpftrace probes at entry) on the loop; best of two runs.
/// None where bpftrace is missing and cannot be installed.
fn bpftrace_ns(program: &Path) -> Result<Option<f64>> {
    if crate::toolchain::ensure_packages(&["bpftrace"]).is_err() || !crate::toolchain::on_path("bpftrace") {
        return Ok(None);
    }
    let libc = "/lib/x86_64-linux-gnu/libc.so.6";
    let script = format!(
        "uprobe:{libc}:malloc /pid == cpid/ {{ @size[tid] = arg0; }}
         uretprobe:{libc}:malloc /@size[tid]/ {{ @live[retval] = @size[tid]; @stack[retval] = ustack; delete(@size[tid]); }}
         uprobe:{libc}:free /pid == cpid/ {{ delete(@live[arg0]); delete(@stack[arg0]); }}
         END {{ clear(@size); clear(@live); clear(@stack); }}"
    );
    let mut best = f64::MAX;
    for _ in 0..2 {
        let output = Command::new("bpftrace")
            .arg("-e")
            .arg(&script)
            .arg("-c")
            .arg(format!("{} {PAIRS}", program.display()))
            .output()
            .context("running bpftrace")?;
        let text = String::from_utf8_lossy(&output.stdout);
        // bpftrace's own lines come around the loop's figure.
        let ns = text.lines().find_map(|line| line.trim().parse::<f64>().ok());
        best = best.min(ns.with_context(|| format!("bpftrace printed no figure: {text}"))?);
    }
    Ok(Some(best))
}

/// What the unwinder's cost is set against: a pair untraced and under empty programs, in ns.
#[derive(Clone, Copy)]
struct Baseline {
    untraced: f64,
    floor: f64,
}

/// Pairs per run of the deep loop.
const DEEP_PAIRS: &str = "200000";
/// Frames of a deep-loop stack beyond its descent: the allocating call site, turn_over, the last
/// descend, main, and libc's __libc_start_call_main, __libc_start_main and _start.
const DEEP_BASE_FRAMES: u32 = 7;
const DEEP: u32 = 16;

/// The unwinder's cost per allocation (memtrace with stacks less memtrace --no-stacks, a pair
/// taking one stack) on a stack DEEP_BASE_FRAMES deep and one DEEP frames deeper, on code built
/// with frame pointers and without; per frame from the difference. Each twice: every stack the
/// same as the one before (taken from the memo of the CPU's last walk), and stacks alternating
/// between two call sites (each walked in full). Best of ROUNDS each.
fn unwinder_cost(memtrace: &Path, trace: &Path, baseline: Baseline) -> Result<()> {
    let Baseline { untraced, floor } = baseline;
    let builds = [
        ("frame pointers", compile_c("bench/deep_loop.c", "bench", &[])?),
        ("no frame pointers", compile_c("bench/deep_loop.c", "bench-nofp", &["-fomit-frame-pointer"])?),
    ];
    println!(
        "the unwinder, per allocation (memtrace less --no-stacks; {DEEP_PAIRS} pairs, best of {ROUNDS}; a pair takes {untraced:.0} ns untraced, {floor:.0} ns under empty programs):"
    );
    for (sites, kind) in [("2", "walked"), ("1", "repeated")] {
        for (name, program) in &builds {
            let mut stack_ns = [0.0; 2];
            for (depth, cost) in [0, DEEP].into_iter().zip(&mut stack_ns) {
                *cost = stack_cost(memtrace, trace, program, depth, sites)?;
            }
            let per_frame = (stack_ns[1] - stack_ns[0]) / f64::from(DEEP);
            println!(
                "  {kind:<8} {name:<18} {:>2}-frame stack {:>6.0} ns ({:.2} x floor, {:.0} x untraced), {:>2}-frame stack {:>6.0} ns ({:.2} x floor, {:.0} x untraced); {:.0} ns a frame",
                DEEP_BASE_FRAMES,
                stack_ns[0],
                stack_ns[0] / floor,
                stack_ns[0] / untraced,
                DEEP_BASE_FRAMES + DEEP,
                stack_ns[1],
                stack_ns[1] / floor,
                stack_ns[1] / untraced,
                per_frame
            );
        }
    }
    Ok(())
}

/// What taking a stack adds to a pair in the deep loop (`depth`, `sites` as deep_loop.c takes
/// them): with stacks and --no-stacks alternately, best of ROUNDS each.
fn stack_cost(memtrace: &Path, trace: &Path, program: &Path, depth: u32, sites: &str) -> Result<f64> {
    let mut best = [f64::MAX; 2];
    for _ in 0..ROUNDS {
        for (stacks, best) in [true, false].into_iter().zip(&mut best) {
            let mut command = memtrace_writing(memtrace, trace);
            if !stacks {
                command.arg("--no-stacks");
            }
            command.arg("--").arg(program).args([DEEP_PAIRS, &depth.to_string(), sites]);
            *best = best.min(ns_per_pair(&mut command)?);
        }
    }
    Ok(best[0] - best[1])
}

const REPORTS: &str = "400000";

/// The traced cost of one subsystem report, on the site include/memtrace.h writes and on the one
/// sdt.h writes, measured alternately: best of ROUNDS each.
fn usdt_report_ns(memtrace: &Path, trace: &Path) -> Result<[f64; 2]> {
    let include = format!("-I{}", workspace_root().join("include").display());
    let programs = [
        compile_c("bench/usdt_loop.c", "bench", &[&include])?,
        compile_c("bench/usdt_loop.c", "bench-nop1", &["-DONE_BYTE_NOP"])?,
    ];
    let mut best = [f64::MAX; 2];
    for _ in 0..ROUNDS {
        for (program, best) in programs.iter().zip(&mut best) {
            let mut command = memtrace_writing(memtrace, trace);
            command.arg("--").arg(program).arg(REPORTS);
            *best = best.min(ns_per_pair(&mut command)?);
        }
    }
    Ok(best)
}

/// memtrace's own CPU and memory while it traces (collector.rs), said in one line.
fn collector_costs(memtrace: &Path, trace: &Path) -> Result<()> {
    match crate::is_root() {
        true => {
            let cpu = collector::measure(|| memtrace_writing(memtrace, trace), || as_root(memtrace))?;
            let share = |share: f64| format!("{:.2}% of a core", share * 100.0);
            println!(
                "the collector's CPU (default 1 s interval): {} quiet processes launched {}; the same under \
                 --all, running before it {}; under the agent (serve --all) {} (its RSS {} MiB); one process \
                 with 1 GiB live in 1,048,576 blocks {} (memtrace's RSS then {} MiB)",
                collector::QUIET_PROCESSES,
                share(cpu.launched),
                share(cpu.system_wide),
                share(cpu.agent),
                cpu.agent_rss >> 20,
                share(cpu.big_heap),
                cpu.big_heap_memtrace_rss >> 20
            );
        }
        false => println!("the collector's CPU: not measured (needs xtask to run as root)"),
    }
    Ok(())
}

/// memtrace, as root, writing its trace to `trace` (every run of the bench overwrites the one file).
fn memtrace_writing(memtrace: &Path, trace: &Path) -> Command {
    let mut command = as_root(memtrace);
    command.arg("-o").arg(trace);
    command
}

fn ns_per_pair(command: &mut Command) -> Result<f64> {
    let text = stdout_of(command)?;
    text.trim().parse().with_context(|| format!("{command:?} printed {text:?}, not nanoseconds"))
}

/// What a command printed on stdout (its stdin empty), once it has exited successfully; else an
/// error naming it, with its status and the end of what it said on stderr.
fn stdout_of(command: &mut Command) -> Result<String> {
    let output = command.stdin(Stdio::null()).output().with_context(|| format!("running {command:?}"))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        let tail = lines[lines.len().saturating_sub(STDERR_LINES)..].join("\n");
        anyhow::bail!("{command:?} failed ({}); the end of its stderr:\n{tail}", output.status);
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// How much of a failed command's stderr an error quotes.
const STDERR_LINES: usize = 20;

/// memtrace's whole run on `true` (which itself takes about a millisecond): start-up, attach,
/// detach and the outputs.
fn whole_run_time(memtrace: &Path, trace: &Path) -> Result<Duration> {
    let started = Instant::now();
    let status = memtrace_writing(memtrace, trace).args(["--", "true"]).output()?.status;
    anyhow::ensure!(status.success(), "memtrace -- true failed");
    Ok(started.elapsed())
}
