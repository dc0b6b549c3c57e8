//! The short text report printed on stderr at the end of a run.

use std::fmt::Write as _;

use anyhow::Result;

use super::exporter::Exporter;
use crate::{
    interpreters::LANGUAGES,
    model::{FunctionTotals, Model, Process, RunEnd},
};

pub struct TextReport {
    /// How many leaking stacks and functions to list per process.
    pub top: usize,
}

impl Exporter for TextReport {
    fn finish(&mut self, model: &Model, end: RunEnd) -> Result<()> {
        eprint!("{}", render(model, end, self.top));
        Ok(())
    }
}

pub fn render(model: &Model, end: RunEnd, top: usize) -> String {
    let mut text = String::new();
    let processes = model.every_process().count();
    let _ = writeln!(
        text,
        "memtrace: traced {processes} process{} for {:.2} s",
        if processes == 1 { "" } else { "es" },
        end.duration.as_secs_f64()
    );
    for process in model.every_process() {
        write_figures(&mut text, process);
        write_memory(&mut text, process);
        write_oom_kill(&mut text, process);
        write_usdt(&mut text, process);
        write_stacks(&mut text, process, top);
    }
    write_folded(&mut text, model);
    if let Some(sampling) = model.sampling {
        let _ = writeln!(
            text,
            "memtrace: sampled a mean of {} apart: allocations, allocated bytes and failures are exact; \
             {} are estimates",
            bytes(sampling.mean_bytes),
            sampling.estimated.join(", ")
        );
    }
    if let Some(windows) = model.windows {
        let _ = writeln!(
            text,
            "memtrace: allocations probed in windows of {}s every {}s ({:.1}s of {:.1}s): each process's \
             recorded allocations are scaled by its user CPU time over that inside windows (by {:.2}, the \
             run's time over the windows', where too little of it was inside); {} are estimates; the stacks \
             of the blocks a window recorded are exact",
            windows.on_s,
            windows.every_s,
            windows.probed_s,
            windows.elapsed_s,
            windows.weight,
            windows.estimated.join(", ")
        );
    }
    if let Some(app) = model.app_sampled {
        let _ = writeln!(
            text,
            "memtrace: allocations from the allocators' own samples ({}): {} are estimates; {} count samples",
            app.probes,
            app.estimated.join(", "),
            app.samples.join(", ")
        );
    }
    if !model.single_stepped.is_empty() {
        let named: Vec<String> = model
            .single_stepped
            .iter()
            .map(|probe| format!("{} in {} ({})", probe.function, file_name(&probe.file), probe.instruction))
            .collect();
        let _ = writeln!(
            text,
            "memtrace: single-stepped probes (the kernel cannot emulate the instruction there, a second \
             trap at every call): {}",
            named.join(", ")
        );
    }
    let lost = model.lost_events();
    if lost > 0 {
        let _ = writeln!(
            text,
            "memtrace: warning: {lost} events could not be recorded; figures are incomplete \
             (raise --max-allocations if the live-allocation table filled up)"
        );
    }
    text
}

fn file_name(path: &std::path::Path) -> std::borrow::Cow<'_, str> {
    path.file_name().unwrap_or(path.as_os_str()).to_string_lossy()
}

/// The exited processes folded into per-command totals (`--keep-exited`), the largest few.
fn write_folded(text: &mut String, model: &Model) {
    let folded = model.folded_by_count();
    if folded.is_empty() {
        return;
    }
    let processes: u64 = folded.iter().map(|f| f.processes).sum();
    let commands: Vec<String> = folded
        .iter()
        .take(5)
        .map(|f| format!("{} ({} processes, {} allocated)", f.comm, f.processes, bytes(f.allocated_bytes)))
        .collect();
    let more =
        if folded.len() > 5 { format!(" and {} more commands", folded.len() - 5) } else { String::new() };
    let _ = writeln!(
        text,
        "  {processes} earlier exited processes, summed per command (--keep-exited): {}{more}",
        commands.join(", ")
    );
}

fn write_figures(text: &mut String, process: &Process) {
    let stats = &process.stats;
    let _ = writeln!(
        text,
        "  pid {} ({}){} via {} ({})",
        process.identity.pid,
        process.identity.display_name(),
        if process.exited { ", exited" } else { "" },
        process.allocator_kind,
        process.allocator.display()
    );
    if let Some(container) = &process.identity.container {
        let id = container.id.as_deref().unwrap_or("-");
        let pod = container.pod_uid.as_deref().unwrap_or("-");
        let _ = writeln!(text, "    container {id}, pod uid {pod}, cgroup {}", container.cgroup);
    }
    let _ = writeln!(
        text,
        "    live {} in {} allocations, peak {}, rss {}",
        bytes(stats.live_bytes.max(0) as u64),
        stats.live_allocations,
        bytes(stats.peak_live_bytes.max(0) as u64),
        bytes(process.memory.rss_bytes())
    );
    let _ = writeln!(
        text,
        "    {} allocations ({}), {} frees ({}), {} untracked frees, {} failed allocations, {} lost",
        stats.allocations,
        bytes(stats.allocated_bytes),
        stats.frees,
        bytes(stats.freed_bytes),
        stats.untracked_frees,
        stats.failed_allocations,
        stats.lost_events
    );
    if stats.temporary_allocations > 0 {
        let _ = writeln!(
            text,
            "    {} temporary allocations ({}): freed before their thread allocated again",
            stats.temporary_allocations,
            bytes(stats.temporary_bytes)
        );
    }
}

/// The allocator's free pool said in words when it is large (a tenth of the resident anonymous
/// memory, and at least 1 MiB): how much, what would give it back, and over how many arenas.
pub fn free_pool_words(process: &Process) -> Option<String> {
    let memory = &process.memory;
    let free = memory.allocator_free_resident_bytes?;
    if free < (1 << 20) || free * 10 < memory.rss_anon_bytes + memory.swap_bytes {
        return None;
    }
    let giver = match process.allocator_kind.as_str() {
        "glibc" => "malloc_trim(0) would return them",
        kind if kind.starts_with("jemalloc") => "a purge of its arenas would return them",
        _ => "a trim of the allocator could return them",
    };
    let arenas = process.free_pool.as_ref().map_or(0, |pool| pool.arenas);
    let arenas = match arenas {
        0 => String::new(),
        1 => "; 1 arena".to_owned(),
        n => format!("; {n} arenas"),
    };
    Some(format!("the allocator keeps {} of resident free pages ({giver}){arenas}", bytes(free)))
}

/// The free pool's size classes that hold resident pages, most resident first, at most 6.
fn free_pool_classes(process: &Process) -> Option<String> {
    let mut classes: Vec<_> =
        process.free_pool.as_ref()?.classes.iter().filter(|class| class.resident_bytes > 0).collect();
    if classes.is_empty() {
        return None;
    }
    classes.sort_by_key(|class| std::cmp::Reverse(class.resident_bytes));
    let shown: Vec<String> = classes
        .iter()
        .take(6)
        .map(|class| {
            let gaps = if class.gaps == 1 { "gap" } else { "gaps" };
            format!(
                "{}+ {} / {} in {} {gaps}",
                bytes(class.min_bytes),
                bytes(class.resident_bytes),
                bytes(class.bytes),
                class.gaps
            )
        })
        .collect();
    Some(shown.join(", "))
}

/// The levels, from the OS's view down: what holds the resident anonymous memory.
fn write_memory(text: &mut String, process: &Process) {
    let memory = &process.memory;
    if memory.rss_bytes() == 0 {
        return;
    }
    let _ = writeln!(
        text,
        "    memory: rss anon {} file {} shmem {}, swap {}; allocator holds {} (overhead {}, size-class \
         rounding {}), mapped by the program {}, dark {}",
        bytes(memory.rss_anon_bytes),
        bytes(memory.rss_file_bytes),
        bytes(memory.rss_shmem_bytes),
        bytes(memory.swap_bytes),
        bytes(memory.allocator_held_bytes),
        bytes(memory.heap_overhead_bytes),
        memory.heap_rounding_bytes.map_or_else(|| "unknown".to_owned(), bytes),
        bytes(memory.mapped_anon_bytes),
        bytes(memory.dark_bytes)
    );
    let _ = writeln!(
        text,
        "    resident anon + swap by owner: allocator {} (free {}), program {}, stacks {}, static {}, dark {}",
        bytes(memory.allocator_resident_bytes),
        memory.allocator_free_resident_bytes.map_or_else(|| "unknown".to_owned(), bytes),
        bytes(memory.mapped_anon_resident_bytes),
        bytes(memory.stack_bytes),
        bytes(memory.static_bytes),
        bytes(memory.dark_bytes)
    );
    if let Some(words) = free_pool_words(process) {
        let _ = writeln!(text, "    {words}");
    }
    if let Some(classes) = free_pool_classes(process) {
        let at = process.free_pool.as_ref().map_or(0.0, |pool| pool.measured_at_us as f64 / 1e6);
        let _ =
            writeln!(text, "    free pool by gap size (resident / all), measured at {at:.2} s: {classes}");
    }
    if let Some(peak) = &process.peak {
        let _ = writeln!(
            text,
            "    heap peak seen at a sample: {} at {:.2} s{}",
            bytes(peak.heap_live_bytes.max(0) as u64),
            peak.ts_us as f64 / 1e6,
            peak.consumers.first().map_or(String::new(), |top| format!(
                ", most from {} ({} in {} blocks)",
                top.frames.first().map_or_else(|| "[unknown]".to_owned(), |frame| frame.name()),
                bytes(top.live_bytes.max(0) as u64),
                top.live_allocations
            ))
        );
    }
}

/// The kernel's OOM killer ended the process: when, where, and what held the most then.
fn write_oom_kill(text: &mut String, process: &Process) {
    let Some(kill) = &process.oom_kill else { return };
    let limit =
        kill.limit_bytes.map_or_else(|| "no limit".to_owned(), |limit| format!("limit {}", bytes(limit)));
    let _ = writeln!(
        text,
        "    OOM-killed at {:.2} s in memory cgroup {} ({limit}): live heap {} in {} blocks, rss {}{}",
        kill.ts_us as f64 / 1e6,
        kill.cgroup.as_deref().unwrap_or("unknown"),
        bytes(kill.live_bytes.max(0) as u64),
        kill.live_allocations,
        kill.rss_bytes.map_or_else(|| "unknown".to_owned(), bytes),
        kill.stacks.first().map_or(String::new(), |top| format!(
            ", most from {} ({} in {} blocks)",
            top.frames.first().map_or_else(|| "[unknown]".to_owned(), |frame| frame.name()),
            bytes(top.live_bytes.max(0) as u64),
            top.live_allocations
        ))
    );
}

fn write_usdt(text: &mut String, process: &Process) {
    if !process.usdt.subsystems.is_empty() {
        let subsystems: Vec<String> = process
            .usdt
            .subsystems
            .iter()
            .map(|(name, &value)| match u64::try_from(value) {
                Ok(value) => format!("{name} {}", bytes(value)),
                Err(_) => format!("{name} {value} B"),
            })
            .collect();
        let _ = writeln!(text, "    subsystems: {}", subsystems.join(", "));
    }
    for (label, counter) in &process.usdt.probes {
        let _ = match counter.value {
            Some(value) => writeln!(text, "    usdt {label}: {} hits, last value {value}", counter.hits),
            None => writeln!(text, "    usdt {label}: {} hits", counter.hits),
        };
    }
}

/// A stack's frame names with each run of one name (recursion) written once, with its count:
/// `descend (x100)`.
fn folded_runs(names: impl Iterator<Item = String>) -> Vec<String> {
    let mut runs: Vec<(String, usize)> = Vec::new();
    for name in names {
        match runs.last_mut() {
            Some((last, count)) if *last == name => *count += 1,
            _ => runs.push((name, 1)),
        }
    }
    runs.into_iter()
        .map(|(name, count)| if count == 1 { name } else { format!("{name} (x{count})") })
        .collect()
}

fn write_stacks(text: &mut String, process: &Process, top: usize) {
    for leak in process.leaks(top) {
        let names = folded_runs(leak.frames.iter().map(|frame| frame.name()));
        let _ = writeln!(
            text,
            "    leak: {} in {} blocks, oldest {:.1} s, from {}",
            bytes(leak.leaked_bytes),
            leak.leaked_allocations,
            leak.oldest_age.unwrap_or_default().as_secs_f64(),
            names.join(" <- ")
        );
    }
    let functions = process.function_totals();
    write_functions(text, "function", functions.iter().take(top));
    // A script's own functions, which the native ones above would crowd out.
    for language in LANGUAGES {
        let script = functions.iter().filter(|f| f.interpreter.as_deref() == Some(language.name));
        write_functions(text, language.functions, script.take(top));
    }
}

/// A table of bytes per function, headed "by `what`" (nothing where there are none).
fn write_functions<'a>(text: &mut String, what: &str, functions: impl Iterator<Item = &'a FunctionTotals>) {
    for (index, function) in functions.enumerate() {
        if index == 0 {
            let _ = writeln!(text, "    live bytes by {what} (inclusive / exclusive):");
        }
        let _ = writeln!(
            text,
            "      {:>10} / {:>10}  {}",
            bytes(function.live_inclusive_bytes.max(0) as u64),
            bytes(function.live_exclusive_bytes.max(0) as u64),
            function.name
        );
    }
}

/// Bytes with a binary unit, exact below 10 KiB.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 10 * 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recursion_is_folded_into_one_frame_with_its_count() {
        let names = ["leaf", "descend", "descend", "descend", "main", "main"].map(String::from);
        assert_eq!(folded_runs(names.into_iter()), ["leaf", "descend (x3)", "main (x2)"]);
    }
    use std::time::Duration;

    #[test]
    fn byte_units() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(10_239), "10239 B");
        assert_eq!(bytes(10 * 1024), "10.0 KiB");
        assert_eq!(bytes(3 * 1024 * 1024), "3.0 MiB");
    }

    #[test]
    fn report_names_each_process_and_any_loss() {
        let mut model = Model::default();
        model.add_process(
            crate::model::identity::ProcessIdentity::new(7, "server".into()),
            "/lib/libc.so.6".into(),
        );
        model.processes.get_mut(&7).unwrap().stats.untracked_frees = 3;
        model.processes.get_mut(&7).unwrap().allocator_kind = "glibc".into();
        let end = RunEnd { duration: Duration::from_secs(2) };
        let text = render(&model, end, 10);
        assert!(text.contains("pid 7 (server) via glibc (/lib/libc.so.6)"), "{text}");
        assert!(text.contains("3 untracked frees"), "{text}");
        assert!(!text.contains("memory:"), "no levels read, none shown: {text}");
        let process = model.processes.get_mut(&7).unwrap();
        process.memory.rss_anon_bytes = 3 << 20;
        process.memory.dark_bytes = 2 << 20;
        process.stats.temporary_allocations = 4;
        process.stats.temporary_bytes = 40;
        let text = render(&model, end, 10);
        assert!(text.contains("memory: rss anon 3.0 MiB") && text.contains("dark 2.0 MiB"), "{text}");
        assert!(text.contains("4 temporary allocations (40 B)"), "{text}");
        assert!(!text.contains("warning"));
        model.unattributed_lost_events = 5;
        assert!(render(&model, end, 10).contains("warning: 5 events could not be recorded"));
    }
}
