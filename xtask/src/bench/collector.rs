//! memtrace's own CPU while it traces, as a share of one core over CPU_WINDOW (utime + stime of
//! its process in /proc), at the default 1 s interval, in four settings: 100 quiet processes it
//! launched (seen from their start: their free pools are measured too), 100 quiet processes that
//! ran before a system-wide run (`--all`), the same under the agent (`memtrace serve --all`, with
//! its resident set), and one process with 1 GiB live in 1,048,576 blocks, the most smaps,
//! pagemap and free-pool work one process brings. Root only: through sudo, the child would be
//! sudo, not memtrace.

use std::{
    io::{BufRead, BufReader, Lines},
    process::{Child, ChildStderr, Command, Stdio},
    time::Duration,
};

use anyhow::{Context, Result};

use crate::compile_c;

pub const QUIET_PROCESSES: usize = 100;
/// How long the CPU time is counted, once every traced process runs.
const CPU_WINDOW: Duration = Duration::from_secs(8);
/// How long each quiet or big process lives: the window, the settling and the set-up.
const LIFETIME_S: u64 = CPU_WINDOW.as_secs() + 8;

/// memtrace's share of a core in each setting, and its resident set at the end of the big one.
pub struct CollectorCpu {
    pub launched: f64,
    pub system_wide: f64,
    /// `memtrace serve --all` over the same quiet processes, and its VmRSS at the window's end.
    pub agent: f64,
    pub agent_rss: u64,
    pub big_heap: f64,
    pub big_heap_memtrace_rss: u64,
}

/// `memtrace` is a command that runs memtrace as root with its trace file set; `agent` one that
/// runs `memtrace serve` as root.
pub fn measure(memtrace: impl Fn() -> Command, agent: impl Fn() -> Command) -> Result<CollectorCpu> {
    let idle = compile_c("bench/idle_allocator.c", "bench", &[])?;
    let big = compile_c("bench/big_heap.c", "bench", &[])?;
    let script =
        format!("for i in $(seq {QUIET_PROCESSES}); do {} {LIFETIME_S} & done; wait", idle.display());
    let mut launched = memtrace();
    launched.args(["--", "sh", "-c", &script]);
    let (launched, _) = share_while(launched, |_| Ok(()))?;

    let duration = format!("{}s", LIFETIME_S - 4);
    let mut system_wide = memtrace();
    system_wide.args(["--all", "--duration", &duration]);
    let (system_wide, _) = over_quiet_processes(&idle, system_wide)?;
    let mut serve = agent();
    serve.args(["serve", "--all", "--listen", "127.0.0.1:0", "--duration", &duration]);
    let (agent, agent_rss) = over_quiet_processes(&idle, serve)?;

    let mut big_heap = memtrace();
    big_heap.args(["--max-allocations", "2097152", "--"]).arg(&big).arg(LIFETIME_S.to_string());
    big_heap.stdout(Stdio::piped());
    let (big_heap, rss) = share_while(big_heap, |run| {
        let stdout = run.stdout.take().context("the big heap's stdout")?;
        let mut lines = BufReader::new(stdout).lines().map_while(Result::ok);
        anyhow::ensure!(lines.any(|line| line == "ready"), "the big heap never said it was ready");
        std::thread::spawn(move || lines.for_each(drop));
        Ok(())
    })?;
    Ok(CollectorCpu { launched, system_wide, agent, agent_rss, big_heap, big_heap_memtrace_rss: rss })
}

/// memtrace's share of a core and its VmRSS (`share_while`) running `command` (a system-wide run)
/// while QUIET_PROCESSES quiet processes, started before it, run.
fn over_quiet_processes(idle: &std::path::Path, command: Command) -> Result<(f64, u64)> {
    let mut quiet: Vec<Child> = (0..QUIET_PROCESSES)
        .map(|_| Command::new(idle).arg(LIFETIME_S.to_string()).spawn())
        .collect::<std::io::Result<_>>()
        .context("starting the quiet processes")?;
    let measured = share_while(command, |_| Ok(()));
    for child in &mut quiet {
        let _ = child.kill();
        let _ = child.wait();
    }
    measured
}

/// Starts `command` (memtrace), waits until it traces and `ready` says the workload is set, lets
/// it settle, and counts its CPU over the window; returns the share of a core and its VmRSS then.
fn share_while(mut command: Command, ready: impl FnOnce(&mut Child) -> Result<()>) -> Result<(f64, u64)> {
    let mut run = command.stderr(Stdio::piped()).spawn().context("starting memtrace")?;
    let mut lines = stderr_lines(&mut run)?;
    anyhow::ensure!(
        lines.any(|line| line.starts_with("memtrace: tracing")),
        "memtrace never said it was tracing"
    );
    ready(&mut run)?;
    // Let memtrace take every process in (a benchmark's settling time).
    std::thread::sleep(Duration::from_secs(2));
    let before = cpu_ticks(run.id())?;
    std::thread::sleep(CPU_WINDOW);
    let after = cpu_ticks(run.id())?;
    let rss = resident_bytes(run.id())?;
    std::thread::spawn(move || lines.for_each(drop));
    run.wait()?;
    let ticks_per_second = 100.0; // USER_HZ on Linux
    Ok(((after - before) as f64 / ticks_per_second / CPU_WINDOW.as_secs_f64(), rss))
}

fn stderr_lines(run: &mut Child) -> Result<impl Iterator<Item = String>> {
    let stderr: ChildStderr = run.stderr.take().context("memtrace's stderr")?;
    let lines: Lines<BufReader<ChildStderr>> = BufReader::new(stderr).lines();
    Ok(lines.map_while(Result::ok))
}

/// utime + stime of a process, in clock ticks (/proc/PID/stat fields 14 and 15).
fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name, in parentheses, may hold spaces: count fields after its closing one.
    let fields: Vec<&str> =
        stat.rsplit_once(')').context("no command in /proc/PID/stat")?.1.split_whitespace().collect();
    let field =
        |n: usize| -> Result<u64> { Ok(fields.get(n - 3).context("a short /proc/PID/stat")?.parse()?) };
    Ok(field(14)? + field(15)?)
}

/// VmRSS of a process, in bytes.
fn resident_bytes(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status.lines().find_map(|line| line.strip_prefix("VmRSS:")).context("no VmRSS")?;
    Ok(line.trim().trim_end_matches("kB").trim().parse::<u64>()? * 1024)
}
